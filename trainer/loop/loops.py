"""The fit, evaluation and predict loops: read top to bottom, with strategy calls where devices matter."""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from torchyard.trainer.data.batches import (
    batch_limit,
    epoch_batches,
    move_to_device,
    training_batches,
    val_every,
    validates_after,
)
from torchyard.trainer.data.combined import CombinedLoader
from torchyard.trainer.data.ledger import resume_trained_epoch
from torchyard.trainer.data.loaders import batch_mover, data_wait_advice, measure_data_wait, set_epoch
from torchyard.trainer.data.samplers import draw_epoch_order, skip_batches
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.evaluation.predictions import (
    check_every_rank_evaluates,
    check_several_loaders,
    merge_prediction_shares,
    recording_batch_indices,
    shard_batches,
)
from torchyard.trainer.loop.faults import StepGuard
from torchyard.trainer.loop.progress import Progress
from torchyard.trainer.loop.rng import rng_state, seeded, set_rng_state
from torchyard.trainer.loop.step import TrainStep
from torchyard.trainer.optim import SchedulerConfig, step_scheduler

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer

__all__ = ["Progress", "batch_limit", "evaluation_loop", "fit_loop", "predict_loop"]


# --------------------------------------------------------------------------- fit


def fit_loop(
    trainer: Trainer, train_loader: DataLoader, val_loaders: list[DataLoader], guard: StepGuard | None = None
) -> None:
    """Epochs of training with validation at the configured points."""
    fit = FitEpochs(trainer, train_loader, val_loaders, guard or StepGuard(trainer))
    fit.sanity_check()
    progress, hooks = trainer.progress, trainer.hooks
    # As in Lightning, on_train_start, on_train_epoch_start and the epoch-end hooks log per epoch.
    with trainer.metrics.scope("train", in_step=False):
        hooks.call("on_train_start")
        while not _done(trainer, fit.max_epochs):
            fit.start_epoch()
            finished = fit.run_batches()
            fit.end_epoch(finished)
            if not progress.epoch_done:
                break  # stopped mid-epoch (should_stop or max_steps): the epoch does not count as finished
            progress.new_epoch()
        trainer.metrics.rows.write_last_step_row()
        hooks.call("on_train_end")


class FitEpochs:
    """The phases of fit_loop, and what they share over the fit: its loaders, where it validates, its step."""

    def __init__(self, trainer: Trainer, train_loader: DataLoader, val_loaders: list[DataLoader],
                 guard: StepGuard) -> None:
        config = trainer.config
        self.trainer, self.config, self.guard = trainer, config, guard
        self.state, self.progress, self.module = trainer.loop_state, trainer.progress, trainer.module
        self.hooks, self.metrics = trainer.hooks, trainer.metrics
        self.train_step = TrainStep(trainer, guard)
        self.train_loader = train_loader
        self.num_batches, self.val_loaders, self.val_every = _use_loaders(trainer, val_loaders)
        _warn_if_no_step_is_logged(trainer)
        self.loaded_epoch = self.state.fit_loaders_epoch
        self.window = config.accumulate_grad_batches if self.module.automatic_optimization else 1
        self.step_limit = config.max_steps if config.max_steps != -1 else math.inf
        self.max_epochs = config.resolved_max_epochs()
        self.watch_data = True  # in the first epoch of this fit: how long the steps wait for their batches

    def sanity_check(self) -> None:
        """A few validation batches before training (num_sanity_val_steps), in a fit that starts from step 0."""
        config = self.config
        if not (config.num_sanity_val_steps and self.val_loaders and self.progress.global_step == 0):
            return
        limit = config.limit_val_batches  # -1: all the batches a validation runs
        if config.num_sanity_val_steps > 0:
            limit = min(config.num_sanity_val_steps, limit) if isinstance(limit, int) else config.num_sanity_val_steps
        self.state.sanity_checking = True
        self.hooks.call("on_sanity_check_start")
        # Its loaders and hooks draw from the global RNG (a worker seed, a shuffle): restored, so that training
        # does not depend on whether a sanity check ran, as in Lightning.
        saved = rng_state()
        evaluation_loop(self.trainer, "validate", self.val_loaders, limit=limit)
        set_rng_state(saved)
        self.hooks.call("on_sanity_check_end")
        self.state.sanity_checking = False

    def start_epoch(self) -> None:
        """Reload the loaders where due, skip the batches a resumed epoch trained already, on_train_epoch_start."""
        self._reload_loaders_if_due()
        if self.module.automatic_optimization:  # a GradientAccumulationScheduler may change it from epoch to epoch
            self.window = self.trainer.accumulate_grad_batches
            self.train_step.set_accumulation(self.window)
        self.module.train()
        set_epoch(self.train_loader, self.progress.epoch)
        self._skip_trained_batches()
        self.state.ledger.open(self.progress.epoch, self.train_loader, self.progress.epoch_batches,
                               self.progress.global_step, self.num_batches)
        self.hooks.call("on_train_epoch_start")

    def _reload_loaders_if_due(self) -> None:
        # Epoch e trains on the loaders built at the start of epoch e - e % n, also in a resumed run (whose
        # loaders were built before its checkpoint moved it on).
        reload_every, epoch = self.config.reload_dataloaders_every_n_epochs, self.progress.epoch
        if not reload_every or epoch - epoch % reload_every == self.loaded_epoch:
            return
        self.loaded_epoch = epoch - epoch % reload_every
        self.train_loader, *val_loaders = _fit_loaders_as_of(self.trainer, self.loaded_epoch)
        self.state.train_dataloader = self.train_loader
        self.state.num_training_batches = training_batches(self.train_loader, self.config.limit_train_batches)
        self.num_batches, self.val_loaders, self.val_every = _use_loaders(self.trainer, val_loaders)

    def _skip_trained_batches(self) -> None:
        progress = self.progress
        resume_trained_epoch(self.state.ledger, self.train_loader, progress)  # the rest dealt again, exactly
        if skip_batches(self.train_loader, progress.epoch_batches):
            return
        # A loader whose batches are dealt as they are asked for (async ps) cannot start mid-epoch: the epoch
        # runs again from its start rather than the saved run being refused (as Lightning does too).
        if self.trainer.is_global_zero:
            warnings.warn(f"this training dataloader cannot skip the {progress.epoch_batches} batches of epoch "
                          f"{progress.epoch} trained before the checkpoint, so the epoch starts over and trains them "
                          "again; checkpoints at epoch ends resume exactly.", stacklevel=4)
        progress.epoch_batches = progress.validated_batches = 0

    def run_batches(self) -> bool:
        """The epoch's training batches, with the validations due among them; whether the epoch counts as done."""
        progress, config, state = self.progress, self.config, self.state
        with self.metrics.scope("train", in_step=True):
            resumed_at = progress.epoch_batches
            if (0 < resumed_at < self.num_batches and self._validates_after(resumed_at)
                    and resumed_at != progress.validated_batches):
                self._validate_mid_epoch()  # resumed from a checkpoint taken before this validation
            # Locals: this loop runs every step, where each attribute lookup costs (benchmarks/overhead.py).
            step_batch, guard, step_limit, val_every, window = (self.train_step.step_batch, self.guard,
                                                                self.step_limit, self.val_every, self.window)
            validates_mid_epoch = val_every < self.num_batches  # else only after the epoch's last batch
            for batch_idx, batch, is_last in self._batches():
                state.is_last_batch = is_last
                if step_batch(batch, batch_idx, is_last):
                    return True  # on_train_batch_start returned -1: the epoch ends here and counts as done
                # The last batch (or the step that reaches max_steps) validates after the loop, once.
                steps_done = progress.global_step >= step_limit
                if (validates_mid_epoch and validates_after(batch_idx + 1, val_every, window) and not is_last
                        and not steps_done):
                    self._validate_mid_epoch()
                guard.stop_if_signalled()  # SIGTERM on any rank: every rank saves last.ckpt and exits
                # `progress.epoch` epochs are complete: stopping now must still leave min_epochs whole epochs.
                if steps_done or state.should_stop and _stop_allowed(progress, config):
                    return is_last and progress.epoch_batches == batch_idx + 1  # whether the epoch is finished
        if progress.epoch_batches == 0:
            raise MisconfigurationError("the training dataloader yielded no batches in this epoch.")
        return True

    def _batches(self) -> Iterable[tuple[int, Any, bool]]:
        loader = self.train_loader
        source = loader.batches() if isinstance(loader, CombinedLoader) else self._epoch_loader()
        batches = epoch_batches(source, self.progress.epoch_batches, self.num_batches)
        if self.watch_data:
            batches = measure_data_wait(batches, functools.partial(_report_data_wait, self.trainer))
            self.watch_data = False
        return batches

    def _epoch_loader(self) -> Iterable[Any]:
        """The training loader, or its iterator started from the torch RNG state its epoch began with: a shuffling
        loader draws its order (and worker seeds) from torch's global RNG as iteration starts, as in a plain loop."""
        state, loader = self.state, self.train_loader
        resumed, state.resumed_epoch_rng = state.resumed_epoch_rng, None
        if resumed is None or self.progress.epoch_batches == 0:
            state.epoch_start_rng = torch.get_rng_state()  # a copy, about a microsecond
            return loader
        # A mid-epoch resume: the order is drawn again from the saved epoch start, then training goes on from the
        # checkpoint's own state (the draws of the batches before it are behind it).
        now, state.epoch_start_rng = torch.get_rng_state(), resumed
        torch.set_rng_state(resumed.cpu())  # a checkpoint may have been mapped to a GPU
        iterator = iter(loader)
        draw_epoch_order(loader)
        torch.set_rng_state(now)
        return iterator

    def end_epoch(self, finished: bool) -> None:
        """The epoch's closing validation, then its values, schedulers, hooks and monitors, in Lightning's order."""
        progress, metrics = self.progress, self.metrics
        self.guard.read_losses()  # a NaN kept unread (on an accelerator) stops the fit before the epoch's values
        progress.epoch_done = finished
        self.state.ledger.close(progress.epoch_batches, progress.global_step, finished)
        if progress.epoch_done:
            _validate_if_due(self.trainer, self.val_loaders)
        elif _steps_done(self.trainer):  # recorded as done at this batch: a resume from here does not validate again
            # A run that goes on validates here only at a regular point; elsewhere the RNG this validation draws
            # (its loaders' seeds) is given back, so that a resume with a higher max_steps matches such a run.
            self._validate_mid_epoch(keep_rng=not self._validates_after(progress.epoch_batches))
        # Stopped mid-epoch (max_steps): a resume continues the epoch, so its checkpoint keeps the running values.
        running = None if progress.epoch_done else metrics.state_dict()
        metrics.publish_epoch(write=False)  # written with what on_train_epoch_end logs, in one row
        # Epoch schedulers step before the monitors' on_train_epoch_end, where checkpoints are written, so a
        # checkpoint taken at the epoch's end already holds the scheduler state of the next epoch; the others
        # before the epoch-end hooks, ReduceLROnPlateau after them, as in Lightning, so it sees what they log.
        due = self._epoch_schedulers_due()
        self._step_schedulers(due, reduce_on_plateau=False)
        self.hooks.call("on_train_epoch_end")
        metrics.publish_epoch()  # what on_train_epoch_end itself logged, which the monitors decide on too
        self._step_schedulers(due, reduce_on_plateau=True)
        if running:
            metrics.load_state_dict(running)
        self.hooks.call_monitors("on_train_epoch_end")
        metrics.reset_metrics()

    def _epoch_schedulers_due(self) -> list[SchedulerConfig]:
        # Under manual optimization the user steps schedulers (as in Lightning); stepping here would double them.
        progress = self.progress
        if not self.module.automatic_optimization or not progress.epoch_done:
            return []
        return [scheduler for scheduler in self.trainer.lr_scheduler_configs
                if scheduler.interval == "epoch" and (progress.epoch + 1) % scheduler.frequency == 0]

    def _step_schedulers(self, due: list[SchedulerConfig], reduce_on_plateau: bool) -> None:
        for scheduler in due:
            if scheduler.reduce_on_plateau == reduce_on_plateau:
                step_scheduler(scheduler, self.trainer.callback_metrics, self.module.lr_scheduler_step)

    def _validates_after(self, batches: int) -> bool:
        return validates_after(batches, self.val_every, self.window)

    def _validate_mid_epoch(self, keep_rng: bool = False) -> None:
        self.progress.validated_batches = self.progress.epoch_batches
        _validate_if_due(self.trainer, self.val_loaders, keep_rng)


def _use_loaders(trainer: Trainer, val_loaders: list[DataLoader]) -> tuple[int | float, list[DataLoader], int | float]:
    """The training batches per epoch, the validation loaders in use and the batches between validations."""
    num_batches, config = trainer.num_training_batches, trainer.config  # counted (never 0) before configure_optimizers
    if config.limit_val_batches == 0:
        val_loaders = []  # validation turned off, sanity check included, as in Lightning
    if val_loaders and not trainer.strategy.validates(trainer.module):
        if trainer.is_global_zero:
            warnings.warn(f"validation dataloaders were given, but {type(trainer.module).__name__} has no "
                          "validation_step, so the fit does not validate (as in Lightning); define validation_step "
                          "or drop the loaders.", stacklevel=5)
        val_loaders = []
    trainer.loop_state.val_dataloaders = val_loaders
    return num_batches, val_loaders, val_every(config.val_check_interval, num_batches)


def _fit_loaders_as_of(trainer: Trainer, epoch: int) -> list[DataLoader]:
    """The fit's loaders asked for again, with trainer.current_epoch reading `epoch` and the random generators
    seeded from the run's seed and `epoch` (then given back): where a resume starts after `epoch`, a loader
    built from the epoch or from random draws (a curriculum, a random subset) is the one the uninterrupted run
    used, and training draws the same numbers after the reload as without it."""
    progress = trainer.progress
    current, progress.epoch = progress.epoch, epoch
    try:
        with seeded((trainer.config.seed or 0) + epoch):
            return trainer.loop_state.build_fit_loaders()
    finally:
        progress.epoch = current


def _warn_if_no_step_is_logged(trainer: Trainer) -> None:
    """A fit shorter than log_every_n_steps writes its epoch values and only its last step's values."""
    config = trainer.config
    if not trainer.loggers or not trainer.is_global_zero or config.fast_dev_run:
        return
    steps = trainer.estimated_stepping_batches
    if steps < config.log_every_n_steps:
        warnings.warn(
            f"this fit takes {steps} optimizer steps, fewer than log_every_n_steps={config.log_every_n_steps}, "
            "so its loggers get only its last step's per-step values, and its epoch values; set "
            "log_every_n_steps lower to see every step.",
            stacklevel=5,
        )


def _report_data_wait(trainer: Trainer, share: float, wait: float) -> None:
    """Keep the measured wait for the run summary; on rank 0, say when more loader workers would help."""
    trainer.loop_state.data_wait = (share, wait)
    strategy = trainer.strategy
    advice = data_wait_advice(share, wait, trainer.train_dataloader.num_workers, strategy.environment.local_world_size,
                              strategy.root_device.type)
    if advice is not None and trainer.is_global_zero:
        warnings.warn(advice, stacklevel=2)


def _steps_done(trainer: Trainer) -> bool:
    return trainer.config.max_steps != -1 and trainer.progress.global_step >= trainer.config.max_steps


def _done(trainer: Trainer, max_epochs: int) -> bool:
    progress, config = trainer.progress, trainer.config
    if _steps_done(trainer) or (max_epochs != -1 and progress.epoch >= max_epochs):
        return True
    return trainer.should_stop and _stop_allowed(progress, config)


def _stop_allowed(progress: Progress, config: Any) -> bool:
    """Whether a callback's request to stop may end the fit: min_epochs whole epochs and min_steps steps are done."""
    return progress.epoch >= config.min_epochs and progress.global_step >= (config.min_steps or 0)


def _validate_if_due(trainer: Trainer, val_loaders: list[DataLoader], keep_rng: bool = False) -> None:
    config = trainer.config
    if not val_loaders or (trainer.progress.epoch + 1) % config.check_val_every_n_epoch:
        return
    evaluation_loop(trainer, "validate", val_loaders, limit=config.limit_val_batches, keep_rng=keep_rng)
    trainer.module.train()


# --------------------------------------------------------------------------- validate / test / predict


def evaluation_loop(trainer: Trainer, stage: str, loaders: list[DataLoader], limit: int | float,
                    keep_rng: bool = False) -> list[dict[str, float]]:
    """Forward-only passes over `loaders` ('validate' or 'test'); the epoch metrics logged, one dict per loader.

    `keep_rng`: for a validation that the run's training must not notice (the one at a max_steps stop), the
    global RNG that its start hooks, loaders and steps draw from is given back after its batches, before the
    end hooks, where a checkpoint may be saved.

    With several loaders, as in Lightning, the step gets each batch's `dataloader_idx` and what it logs is
    named `<name>/dataloader_idx_<i>`, so the loaders' values stay apart.
    """
    saved_rng = rng_state() if keep_rng else None
    hook = "validation" if stage == "validate" else "test"
    metrics, module = trainer.metrics, trainer.module
    several = check_several_loaders(module, f"{hook}_step", loaders)
    for dataloader_idx, loader in enumerate(loaders):
        check_every_rank_evaluates(loader, limit, hook, dataloader_idx if several else None)
    module.eval()
    with metrics.scope(hook, in_step=False):
        # Hooks included, as in Lightning: what they compute from the model needs no graph either.
        with _grad_mode(trainer):
            results = _evaluation_epoch(trainer, hook, loaders, limit, several, saved_rng)
        metrics.reset_metrics()  # outside inference mode: the states a Metric resets to must stay updatable in place
    if not several:
        return [results]
    # Each loader's dict: its own values, and those logged outside its batches (in epoch-end hooks).
    return [{name: value for name, value in results.items() if not _LOADER_SUFFIX.search(name) or
             name.endswith(f"/dataloader_idx_{index}")} for index in range(len(loaders))]


def _evaluation_epoch(trainer: Trainer, hook: str, loaders: list[DataLoader], limit: int | float, several: bool,
                      saved_rng: dict[str, Any] | None) -> dict[str, float]:
    """The evaluation's hooks around its loaders' batches; every epoch value it logged."""
    metrics, hooks = trainer.metrics, trainer.hooks
    write = not trainer.sanity_checking

    def before_batch(batch_idx: int, batch: Any) -> None:
        metrics.batch = batch

    def after_batch(batch_idx: int, batch: Any, outputs: Any) -> None:
        metrics.publish_eval_step(write=write)

    hooks.call(f"on_{hook}_start")
    hooks.call(f"on_{hook}_epoch_start")
    with metrics.scope(hook, in_step=True):
        for dataloader_idx, loader in enumerate(loaders):
            metrics.for_loader(dataloader_idx if several else None)
            _batch_loop(trainer, hook, loader, dataloader_idx, several, batch_limit(loader, limit),
                        before_batch, after_batch)
        metrics.for_loader(None)
    if saved_rng is not None:
        set_rng_state(saved_rng)
    # As in Lightning, the epoch-end hooks see this epoch's values in callback_metrics; what they log
    # joins the same row.
    results = metrics.publish_epoch(write=False, log=write)
    hooks.call(f"on_{hook}_epoch_end")
    results.update(metrics.publish_epoch(log=write))
    hooks.call(f"on_{hook}_end")
    return results


def _grad_mode(trainer: Trainer) -> Any:
    return torch.inference_mode() if trainer.config.inference_mode else torch.no_grad()


def _batch_loop(trainer: Trainer, hook: str, batches: Iterable[Any], dataloader_idx: int, several: bool,
                num_batches: int | float, before_batch: Callable[[int, Any], None],
                after_batch: Callable[[int, Any, Any], None]) -> None:
    """The shape evaluation and predict share: for each of a loader's first `num_batches` batches, moved to the
    device, `before_batch`, on_<hook>_batch_start, the strategy's <hook>_step, on_<hook>_batch_end, `after_batch`."""
    strategy, hooks = trainer.strategy, trainer.hooks
    step_name, start, end = f"{hook}_step", f"on_{hook}_batch_start", f"on_{hook}_batch_end"
    to_device = batch_mover(strategy, trainer.module, trainer.datamodule, dataloader_idx)
    step_idx = dataloader_idx if several else None
    for batch_idx, batch in enumerate(batches):
        if batch_idx >= num_batches:
            break
        batch = to_device(batch)
        before_batch(batch_idx, batch)
        hooks.call(start, batch, batch_idx, dataloader_idx)
        outputs = strategy.eval_step(step_name, batch, batch_idx, step_idx)
        hooks.call(end, outputs, batch, batch_idx, dataloader_idx)
        after_batch(batch_idx, batch, outputs)


_LOADER_SUFFIX = re.compile(r"/dataloader_idx_\d+$")


def predict_loop(trainer: Trainer, loaders: list[DataLoader], limit: int | float) -> list[list[Any]] | None:
    """predict_step over every batch; one list of outputs per loader (None: return_predictions=False).

    Under data parallelism each rank predicts its share, and every rank returns all of them, put back in the
    loader's order and batch size (on the CPU), as one process would have: predictions do not depend on
    the strategy.
    """
    state, hooks, strategy = trainer.loop_state, trainer.hooks, trainer.strategy
    several = check_several_loaders(trainer.module, "predict_step", loaders)
    state.predict_dataloaders = loaders
    trainer.module.eval()
    hooks.call("on_predict_start")
    hooks.call("on_predict_epoch_start")
    results: list[list[Any]] = []
    replicas = strategy.data_parallel_size
    # Under data parallelism the limit counts the loader's batches as one process would, so that the merged
    # predictions are one process's: each rank runs its share of them, and the merge keeps the first `kept`.
    kept: list[int | float | None] = []
    for loader in loaders:
        sliced = shard_batches(loader) if replicas > 1 else None
        kept.append(None if sliced is None else batch_limit(loader, limit, sliced[0]))
    with _grad_mode(trainer):
        for dataloader_idx, loader in enumerate(loaders):
            keep = kept[dataloader_idx]
            num_batches = batch_limit(loader, limit) if keep is None else math.ceil(keep / replicas)
            results.append(_predict_batches(trainer, loader, dataloader_idx, several, num_batches))
    state.predict_batch_indices = None
    hooks.call("on_predict_epoch_end")
    hooks.call("on_predict_end")
    if not state.return_predictions:
        return None
    if replicas == 1:
        return results
    # Tensors travel as pickles: on the CPU, so that a rank unpickles none onto another rank's GPU.
    shares = strategy.gather_data_parallel(move_to_device(results, torch.device("cpu")))
    merged = [
        merge_prediction_shares([share[index] for share in shares], loader) for index, loader in enumerate(loaders)
    ]
    return [batches if keep is None else batches[:keep] for batches, keep in zip(merged, kept)]


def _predict_batches(trainer: Trainer, loader: DataLoader, dataloader_idx: int, several: bool,
                     num_batches: int | float) -> list[Any]:
    """One loader's predictions (none kept with return_predictions=False), its batches' indices shown meanwhile."""
    state, outputs = trainer.loop_state, []
    recording, drawn = recording_batch_indices(loader)

    def before_batch(batch_idx: int, batch: Any) -> None:
        state.predict_batch_indices = drawn[batch_idx] if drawn is not None else None

    def after_batch(batch_idx: int, batch: Any, output: Any) -> None:
        if state.return_predictions:
            outputs.append(output)

    _batch_loop(trainer, "predict", recording, dataloader_idx, several, num_batches, before_batch, after_batch)
    return outputs
