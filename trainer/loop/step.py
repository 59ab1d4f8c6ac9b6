"""One training micro-batch, and the optimizer step that follows every accumulate_grad_batches of them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from torchyard.trainer.data.loaders import batch_mover
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.module import TrainModule, overridden
from torchyard.trainer.optim import HookedClosure, HookOptimizer, needs_closure, step_scheduler, takes_closure
from torchyard.trainer.strategies.base import HOST
from torchyard.trainer.strategies.user_steps import step_loss

if TYPE_CHECKING:
    from torchyard.trainer.loop.faults import StepGuard
    from torchyard.trainer.trainer import Trainer


class TrainStep:
    """`train_step(batch, batch_idx, is_last)` runs one micro-batch through the strategy.

    Built once per fit: what cannot change during it (the strategy, the hooks a callback or the module
    overrides, the optimizers, clipping, accumulation) is looked up here rather than on every batch. On a
    small model this Python runs between kernels that have just evicted it from the CPU caches, where every
    lookup and call costs microseconds; a hook nobody overrides is not called at all
    (benchmarks/overhead.py measures what is left).
    """

    def __init__(self, trainer: Trainer, guard: StepGuard) -> None:
        config = trainer.config
        self.trainer, self.guard = trainer, guard
        self.strategy, self.module, self.progress = trainer.strategy, trainer.module, trainer.progress
        self.metrics = trainer.metrics
        self.rows = trainer.metrics.rows  # where the step publishes its values (no Trainer method in between)
        self.automatic = trainer.module.automatic_optimization
        self.accumulate = config.accumulate_grad_batches
        self.loss_scale = 1.0 / config.accumulate_grad_batches
        self.clip_value = float(config.gradient_clip_val) if config.gradient_clip_val else None
        self.clip_algorithm = config.gradient_clip_algorithm
        self.optimizers = trainer.optimizers
        self.lr_scaler = trainer.lr_scaler
        self.step_schedulers = [s for s in trainer.lr_scheduler_configs if s.interval == "step"]
        # None where nobody overrides the hook.
        hooks = trainer.hooks
        self.on_train_batch_start = hooks.bound("on_train_batch_start")
        self.on_before_backward = hooks.bound("on_before_backward")
        self.on_after_backward = hooks.bound("on_after_backward")
        self.on_before_optimizer_step = hooks.bound("on_before_optimizer_step")
        self.on_before_zero_grad = hooks.bound("on_before_zero_grad")
        self.on_train_batch_end = hooks.bound("on_train_batch_end")
        # Lightning's optimizer hooks where the module overrides them; None: the loop's own path.
        self.module_optimizer_step = overridden(trainer.module, "optimizer_step", TrainModule)
        self.module_zero_grad = overridden(trainer.module, "optimizer_zero_grad", TrainModule)
        self.module_clipping = overridden(trainer.module, "configure_gradient_clipping", TrainModule)
        # Optimizers whose step gets a closure (optim.takes_closure); one that needs it (LBFGS) is the only one.
        self.closure_optimizers = [self.automatic and takes_closure(optimizer) for optimizer in self.optimizers]
        self.to_device = batch_mover(trainer.strategy, trainer.module, trainer.datamodule, 0)
        # Whether to_device can change a batch: not the strategy's own move on the host, which leaves it as it is.
        self.moves_batches = self.to_device != trainer.strategy.batch_to_device or trainer.strategy.root_device != HOST
        self.skipped = (-1, 0)  # (epoch, batches whose training_step returned None in it)
        # Where this fit's training starts (after a resume's restore): a None there, before any batch trained,
        # is a training_step without `return`, on every process alike, not one process skipping a batch.
        self.start = (self.progress.epoch, self.progress.epoch_batches, self.progress.batches_stepped)
        # The module's training_step where the fit uses nothing that the general path's branches are for (hooks,
        # optimizer overrides, closures, clipping, step schedulers, several optimizers, an lr warm-up, a strategy
        # or precision with its own backward or optimizer step): epochs without accumulation then run `plain_step`.
        plain = trainer.strategy.plain_training_step() if self.automatic else None
        general = (
            self.on_train_batch_start, self.on_before_backward, self.on_after_backward, self.on_before_optimizer_step,
            self.on_before_zero_grad, self.on_train_batch_end, self.module_optimizer_step, self.module_zero_grad,
            self.module_clipping, self.clip_value, *self.step_schedulers,
        )
        one_optimizer = len(self.optimizers) == 1 and not self.closure_optimizers[0]
        simple = one_optimizer and self.lr_scaler.warmup_end == 0 and all(part is None for part in general)
        self.plain_training_step = plain if simple else None
        self.previous_loss: torch.Tensor | None = None
        # What the loop calls for each batch of the current epoch: this object, or its plain_step.
        self.step_batch: Callable[[Any, int, bool], bool | None] = self

    def set_accumulation(self, micro_batches: int) -> None:
        """Step every `micro_batches` batches from now on (the epoch's accumulate_grad_batches)."""
        self.accumulate, self.loss_scale = micro_batches, 1.0 / micro_batches
        plain = self.plain_training_step is not None and micro_batches == 1
        self.step_batch = self.plain_step if plain else self

    def plain_step(self, batch: Any, batch_idx: int, is_last: bool) -> bool | None:
        """What `self(batch, batch_idx, is_last)` does in an epoch that uses none of its branches (see
        `plain_training_step`): the same calls in the same order, made here rather than through the strategy's and
        the optimizer path's layers, which together cost a measurable share of a small model's step
        (benchmarks/overhead.py)."""
        progress = self.progress
        if self.moves_batches:
            batch = self.to_device(batch)
        self.metrics.batch = batch
        outputs = self.plain_training_step(batch, batch_idx)
        if outputs is None:
            self._skipped_batch(batch_idx, is_last)
        else:
            loss = outputs if type(outputs) is torch.Tensor else step_loss(outputs)
            loss.backward()
            # Kept until the next step's loss replaces it, as a plain loop's `loss` variable is: its graph's
            # gradient accumulators then live on into the next forward, which reuses them rather than building
            # and freeing new ones each step.
            self.previous_loss = loss
            if self.guard.allow_step(outputs, batch_idx, True):
                if self.strategy.checkpoint_in_flight:
                    self.strategy.finish_checkpoints()
                optimizer = self.optimizers[0]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                progress.global_step += 1
                progress.batches_stepped += 1
        progress.epoch_batches = batch_idx + 1
        self.rows.publish_step()
        return None

    def __call__(self, batch: Any, batch_idx: int, is_last: bool) -> bool | None:
        """True when on_train_batch_start returned -1: Lightning's convention for skipping the rest of the epoch."""
        strategy, progress = self.strategy, self.progress
        batch = self.to_device(batch)
        self.metrics.batch = batch
        if self.on_train_batch_start is not None and self.on_train_batch_start(batch, batch_idx) == -1:
            return True
        if strategy.checkpoint_in_flight and not self.automatic:
            strategy.finish_checkpoints()  # the module's own optimizer steps come in training_step
        if not self.automatic:
            outputs = strategy.training_step(batch, batch_idx)  # its optimizers' steps count in global_step
            progress.batches_stepped += 1
        else:
            # The epoch's tail may hold fewer than `accumulate` micro-batches; step on it anyway.
            stepping = is_last or (batch_idx + 1) % self.accumulate == 0
            if stepping:
                outputs = strategy.forward_backward(batch, batch_idx, self.loss_scale, self.on_before_backward)
            else:
                with strategy.no_backward_sync():  # gradients only need synchronising on the micro-batch that steps
                    outputs = strategy.forward_backward(batch, batch_idx, self.loss_scale, self.on_before_backward)
            if outputs is None:
                self._skipped_batch(batch_idx, is_last)
            else:
                if self.on_after_backward is not None:
                    self.on_after_backward()
                # A NaN/inf loss in the window raises, or (nonfinite_loss="skip") drops this step.
                if self.guard.allow_step(outputs, batch_idx, stepping):
                    outputs = self.optimizer_step(batch, batch_idx, outputs)
        progress.epoch_batches = batch_idx + 1
        if self.on_train_batch_end is not None:  # the hooks see this step's values; its row also holds what they log
            self.on_train_batch_end(batch_end_outputs(outputs), batch, batch_idx)
        self.rows.publish_step()

    def _skipped_batch(self, batch_idx: int, is_last: bool) -> None:
        """training_step returned None: no backward and no optimizer step for this batch (gradients accumulated
        before it wait for the next step), as in Lightning. Only where one process trains: the others would
        wait in their gradient all-reduce for this one. An epoch of nothing but None is a forgotten `return`."""
        epoch, strategy = self.progress.epoch, self.strategy
        if strategy.data_parallel_size > 1:
            where = f"batch {batch_idx} of epoch {epoch} on rank {strategy.global_rank} of {strategy.world_size}"
            if (epoch, self.progress.epoch_batches, self.progress.batches_stepped) == self.start:
                raise MisconfigurationError(
                    f"training_step returned None (nothing) for the fit's first batch ({where}); under automatic "
                    "optimization it must return the loss tensor or a dict with key 'loss' (is its `return` "
                    "missing?), or set `automatic_optimization = False`.")
            raise MisconfigurationError(
                f"training_step returned None for {where}, which skips the batch on that process only; the "
                "other processes would wait for it in the gradient all-reduce. Return a loss on every process "
                "(e.g. loss * 0 to skip).")
        skipped = self.skipped[1] + 1 if self.skipped[0] == epoch else 1
        self.skipped = (epoch, skipped)
        if is_last and skipped == batch_idx + 1:
            raise MisconfigurationError(
                f"training_step returned None (nothing) for every batch of epoch {epoch}; under automatic "
                "optimization it must return the loss tensor or a dict with key 'loss' (None skips a batch), or set "
                "`automatic_optimization = False`.")

    def optimizer_step(self, batch: Any, batch_idx: int, outputs: Any) -> Any:
        """Clip, step and zero every optimizer (at a lowered rate during lr warm-up), then the step schedulers;
        through the module's optimizer_step, optimizer_zero_grad and configure_gradient_clipping where it
        overrides them. An optimizer that takes a closure (optim.takes_closure: LBFGS, SAM) gets one.

        Returns training_step's output from the step's last evaluation (`outputs` unless a closure ran it
        again), which on_train_batch_end gets, as in Lightning."""
        strategy, progress = self.strategy, self.progress
        if strategy.checkpoint_in_flight:
            strategy.finish_checkpoints()
        warming_up = progress.global_step < self.lr_scaler.warmup_end
        for optimizer, gets_closure in zip(self.optimizers, self.closure_optimizers):
            if self.module_optimizer_step is not None:
                # As in Lightning, on_before_optimizer_step and clipping run inside the override's optimizer.step(),
                # so they see what its body did first (a warm-up's rate), and not at all if it skips the step.
                apply = (
                    functools.partial(
                        self.lr_scaler.step, global_step=progress.global_step, optimizer_step=strategy.optimizer_step
                    )
                    if warming_up
                    else strategy.optimizer_step
                )
                hooked = HookOptimizer(optimizer, apply, self._before_optimizer_step)
                step_closure = StepClosure(self, optimizer, batch, batch_idx, outputs)
                self.module_optimizer_step(progress.epoch, batch_idx, hooked, step_closure)
                outputs = step_closure.outputs
            else:
                closure = step_closure = None
                if gets_closure:  # on_before_optimizer_step and clipping run after each of its evaluations
                    step_closure = StepClosure(self, optimizer, batch, batch_idx, outputs)
                    closure = HookedClosure(step_closure, self._before_optimizer_step, optimizer)
                else:
                    self._before_optimizer_step(optimizer)
                if warming_up:
                    self.lr_scaler.step(optimizer, progress.global_step, strategy.optimizer_step, closure)
                else:
                    strategy.optimizer_step(optimizer, closure)
                if step_closure is not None:
                    outputs = step_closure.outputs
            self._zero_grad(optimizer, batch_idx)
        progress.global_step += 1
        progress.batches_stepped += 1
        for scheduler in self.step_schedulers:
            if progress.global_step % scheduler.frequency == 0:
                step_scheduler(scheduler, self.trainer.callback_metrics, self.module.lr_scheduler_step)
        return outputs

    def _before_optimizer_step(self, optimizer: Optimizer) -> None:
        """on_before_optimizer_step, then clipping (the module's own, where it overrides it)."""
        if self.on_before_optimizer_step is not None:
            self.on_before_optimizer_step(optimizer)
        if self.module_clipping is not None:
            self.module_clipping(optimizer, self.clip_value, self.clip_algorithm if self.clip_value else None)
        elif self.clip_value is not None:
            self.strategy.clip_gradients(optimizer, self.clip_value, self.clip_algorithm)

    def _zero_grad(self, optimizer: Optimizer, batch_idx: int) -> None:
        """on_before_zero_grad, then the module's optimizer_zero_grad where it overrides it, else zero_grad."""
        if self.on_before_zero_grad is not None:
            self.on_before_zero_grad(optimizer)
        if self.module_zero_grad is not None:
            self.module_zero_grad(self.progress.epoch, batch_idx, optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)

    def evaluate_again(self, optimizer: Optimizer, batch: Any, batch_idx: int) -> tuple[Any, torch.Tensor]:
        """Zero the gradients, run training_step and backward on `batch` again (at the weights the optimizer has
        moved to), with the hooks around them, as Lightning's closure does; training_step's new output and loss."""
        if len(self.optimizers) > 1:  # the backward would fill the other optimizers' gradients too
            raise MisconfigurationError(
                f"{type(optimizer).__name__}'s closure was called again, which runs training_step and backward again; "
                f"that needs one optimizer, and configure_optimizers returned {len(self.optimizers)}. Step them "
                "yourself with `automatic_optimization = False`.")
        self._zero_grad(optimizer, batch_idx)
        outputs = self.strategy.forward_backward(batch, batch_idx, self.loss_scale, self.on_before_backward)
        if outputs is None:
            raise MisconfigurationError(
                f"training_step returned None when {type(optimizer).__name__} evaluated the loss again on batch "
                f"{batch_idx}; return the loss on every call.")
        if self.on_after_backward is not None:
            self.on_after_backward()
        loss = step_loss(outputs).detach()
        self.guard.check_reevaluated(loss, batch_idx)
        return outputs, loss


def batch_end_outputs(outputs: Any) -> Any:
    """training_step's output as on_train_batch_end gets it in Lightning: a dict whose "loss" is detached (a loss
    returned alone becomes {"loss": ...}), so that a hook keeping it keeps no graph."""
    if isinstance(outputs, torch.Tensor):
        return {"loss": outputs.detach()}
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor):
        return {**outputs, "loss": outputs["loss"].detach()}
    return outputs


class StepClosure:
    """Lightning's `optimizer_closure`: the loss of the step's forward and backward, which have already run when
    the optimizer gets it, so its first call only returns that loss, while the weights are still the ones it
    was computed at. A call at other weights (SAM, after moving them), or any later one (LBFGS's iterations),
    runs them anew (TrainStep.evaluate_again). Where several processes train, an optimizer that needs the
    closure gets the ranks' mean loss, so that every rank's takes the same decisions (how often to evaluate)
    on the same averaged gradients."""

    def __init__(self, train_step: TrainStep, optimizer: Optimizer, batch: Any, batch_idx: int, outputs: Any) -> None:
        self.train_step, self.optimizer, self.batch, self.batch_idx = train_step, optimizer, batch, batch_idx
        self.outputs = outputs  # training_step's output from the latest evaluation
        self.loss: torch.Tensor | None = step_loss(outputs).detach()  # the graph itself went with backward
        # In-place changes to the weights count up their tensors' versions. Read only for an optimizer that gets
        # the closure: a module's optimizer_step calls it before stepping, and per step the read costs a pass
        # over every parameter.
        self.versions = _versions(optimizer) if takes_closure(optimizer) else None
        self.mean_over_ranks = train_step.strategy.world_size > 1 and needs_closure(optimizer)

    def __call__(self) -> torch.Tensor:
        loss, self.loss = self.loss, None
        if loss is None or self.versions is not None and _versions(self.optimizer) != self.versions:
            self.outputs, loss = self.train_step.evaluate_again(self.optimizer, self.batch, self.batch_idx)
        return self.train_step.strategy.reduce(loss, "mean") if self.mean_over_ranks else loss


def _versions(optimizer: Optimizer) -> list[int]:
    return [parameter._version for group in optimizer.param_groups for parameter in group["params"]]
