"""The fit, evaluation and predict loops: read top to bottom, with strategy calls where devices matter."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from trainer.data import (
    batch_mover,
    data_wait_advice,
    measure_data_wait,
    merge_prediction_shares,
    recording_batch_indices,
    set_epoch,
    shard_batches,
    skip_batches,
)
from trainer.errors import MisconfigurationError
from trainer.faults import StepGuard
from trainer.optim import step_scheduler
from trainer.rng import rng_state, seeded, set_rng_state
from trainer.step import TrainStep
from trainer.strategies.base import move_to_device

if TYPE_CHECKING:
    from trainer.trainer import Trainer


@dataclass
class Progress:
    """Where a fit stands; saved in every checkpoint so a resume continues at the same batch."""

    epoch: int = 0
    global_step: int = 0  # optimizer steps taken
    # The loggers' step, as in Lightning: batches that stepped, once each however many optimizers a
    # manual-optimization batch steps (two for a GAN), so that log_every_n_steps counts batches there too.
    batches_stepped: int = 0
    epoch_batches: int = 0  # batches consumed in the current epoch
    epoch_done: bool = False  # the current epoch's batches are all consumed
    # epoch_batches when this epoch's latest mid-epoch validation began: a checkpoint taken before a due
    # validation (in on_train_batch_end) resumes by running it, one taken during it does not run it twice.
    validated_batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.batches_stepped = int(state.get("batches_stepped", self.global_step))
        self.epoch_batches, self.epoch_done = int(state["epoch_batches"]), bool(state["epoch_done"])
        self.validated_batches = int(state.get("validated_batches", self.epoch_batches))
        if self.epoch_done:  # the checkpoint was taken after the epoch's last batch: start the next one
            self.new_epoch()

    def new_epoch(self) -> None:
        self.epoch, self.epoch_batches, self.epoch_done, self.validated_batches = self.epoch + 1, 0, False, 0


def batch_limit(loader: DataLoader, limit: int | float, length: int | float | None = None) -> int | float:
    """How many batches of `loader` (or of `length` batches) a stage runs: a count, or a fraction of its
    length (math.inf: until exhausted)."""
    if length is None:
        try:
            length = len(loader)
        except TypeError:  # an IterableDataset without __len__
            length = math.inf
    if isinstance(limit, int) and not isinstance(limit, bool):
        return int(min(limit, length))
    if length != math.inf:
        if 0 < length * limit < 1:  # a fraction that rounds to no batch is a mistake, not a wish to skip
            raise MisconfigurationError(
                f"a batch limit of {limit} is less than one of this dataloader's {length} batches; use at least "
                f"{1 / length:.3g}, a count (an int), or 0 to run none."
            )
        return int(length * limit)
    if limit not in (0.0, 1.0):
        raise MisconfigurationError(
            f"a batch limit of {limit} (a fraction) needs a dataloader with a length; this one has none, "
            "so give a batch count (an int) instead."
        )
    return math.inf if limit == 1.0 else 0


# --------------------------------------------------------------------------- fit


def fit_loop(trainer: Trainer, train_loader: DataLoader, val_loaders: list[DataLoader], guard: StepGuard | None = None) -> None:
    """Epochs of training with validation at the configured points."""
    config, progress, module = trainer.config, trainer.progress, trainer.module
    guard = guard or StepGuard(trainer)
    train_step = TrainStep(trainer, guard)
    num_batches, val_loaders, val_every = _use_loaders(trainer, val_loaders)
    _warn_if_no_step_is_logged(trainer)
    reload_every, loaded_epoch = config.reload_dataloaders_every_n_epochs, trainer.fit_loaders_epoch
    window = config.accumulate_grad_batches if module.automatic_optimization else 1
    step_limit = config.max_steps if config.max_steps != -1 else math.inf

    if config.num_sanity_val_steps and val_loaders and progress.global_step == 0:
        limit = config.limit_val_batches  # -1: all the batches a validation runs
        if config.num_sanity_val_steps > 0:
            limit = min(config.num_sanity_val_steps, limit) if isinstance(limit, int) else config.num_sanity_val_steps
        trainer.sanity_checking = True
        trainer.call("on_sanity_check_start")
        # Its loaders and hooks draw from the global RNG (a worker seed, a shuffle): restored, so that training
        # does not depend on whether a sanity check ran, as in Lightning.
        saved = rng_state()
        evaluation_loop(trainer, "validate", val_loaders, limit=limit)
        set_rng_state(saved)
        trainer.call("on_sanity_check_end")
        trainer.sanity_checking = False

    trainer.metrics.in_step = False  # as in Lightning, on_train_start and on_train_epoch_start log per epoch
    trainer.call("on_train_start")
    max_epochs = config.resolved_max_epochs()
    watch_data = True  # in the first epoch of this fit: how long the steps wait for their batches
    while not _done(trainer, max_epochs):
        # Epoch e trains on the loaders built at the start of epoch e - e % n, also in a resumed run (whose
        # loaders were built before its checkpoint moved it on).
        if reload_every and progress.epoch - progress.epoch % reload_every != loaded_epoch:
            loaded_epoch = progress.epoch - progress.epoch % reload_every
            train_loader, *val_loaders = _fit_loaders_as_of(trainer, loaded_epoch)
            trainer.train_dataloader = train_loader
            trainer.num_training_batches = batch_limit(train_loader, config.limit_train_batches)
            num_batches, val_loaders, val_every = _use_loaders(trainer, val_loaders)
        module.train()
        set_epoch(train_loader, progress.epoch)
        if not skip_batches(train_loader, progress.epoch_batches):
            # A loader whose batches are dealt as they are asked for (async ps) cannot start mid-epoch: the epoch
            # runs again from its start rather than the saved run being refused (as Lightning does too).
            if trainer.is_global_zero:
                warnings.warn(f"this training dataloader cannot skip the {progress.epoch_batches} batches of epoch "
                              f"{progress.epoch} trained before the checkpoint, so the epoch starts over and trains them "
                              "again; checkpoints at epoch ends resume exactly.", stacklevel=2)
            progress.epoch_batches = progress.validated_batches = 0
        trainer.metrics.stage, trainer.metrics.in_step = "train", False
        trainer.call("on_train_epoch_start")
        trainer.metrics.in_step = True
        resumed_at = progress.epoch_batches
        if 0 < resumed_at < num_batches and _validates_after(resumed_at, val_every, window) and resumed_at != progress.validated_batches:
            _validate_mid_epoch(trainer, val_loaders)  # resumed from a checkpoint taken before this validation
        finished = False
        batches = _epoch_batches(train_loader, progress.epoch_batches, num_batches)
        if watch_data:
            batches, watch_data = measure_data_wait(batches, functools.partial(_report_data_wait, trainer)), False
        for batch_idx, batch, is_last in batches:
            if train_step(batch, batch_idx, is_last):
                finished = True  # on_train_batch_start returned -1: the epoch ends here and counts as done
                break
            finished = is_last and progress.epoch_batches == batch_idx + 1
            # The last batch (or the step that reaches max_steps) validates after the loop, once.
            steps_done = progress.global_step >= step_limit
            if _validates_after(batch_idx + 1, val_every, window) and not is_last and not steps_done:
                _validate_mid_epoch(trainer, val_loaders)
            guard.stop_if_signalled()  # SIGTERM on any rank: every rank saves last.ckpt and exits
            # `progress.epoch` epochs are complete: stopping now must still leave min_epochs whole epochs.
            if steps_done or trainer.should_stop and progress.epoch >= config.min_epochs:
                break
        else:
            if progress.epoch_batches == 0:
                raise MisconfigurationError("the training dataloader yielded no batches in this epoch.")
            finished = True
        progress.epoch_done = finished
        if progress.epoch_done:
            _validate_if_due(trainer, val_loaders)
        elif _steps_done(trainer):  # recorded as done at this batch: a resume from here does not validate again
            # A run that goes on validates here only at a regular point; elsewhere the RNG this validation draws
            # (its loaders' seeds) is given back, so that a resume with a higher max_steps matches such a run.
            _validate_mid_epoch(trainer, val_loaders, keep_rng=not _validates_after(progress.epoch_batches, val_every, window))
        # Stopped mid-epoch (max_steps): a resume continues the epoch, so its checkpoint keeps the running values.
        running = None if progress.epoch_done else trainer.metrics.state_dict()
        trainer.metrics.in_step = False
        trainer.publish_epoch_metrics(write=False)  # written with what on_train_epoch_end logs, in one row
        # Epoch schedulers step before the monitors' on_train_epoch_end, where checkpoints are written, so a
        # checkpoint taken at the epoch's end already holds the scheduler state of the next epoch; the others
        # before the epoch-end hooks, ReduceLROnPlateau after them, as in Lightning, so it sees what they log.
        # Under manual optimization the user steps schedulers (as in Lightning); stepping here would double them.
        due = [scheduler for scheduler in trainer.lr_scheduler_configs if module.automatic_optimization
               and scheduler.interval == "epoch" and progress.epoch_done and (progress.epoch + 1) % scheduler.frequency == 0]
        for scheduler in due:
            if not scheduler.reduce_on_plateau:
                step_scheduler(scheduler, trainer.callback_metrics, module.lr_scheduler_step)
        trainer.call("on_train_epoch_end")
        trainer.publish_epoch_metrics()  # what on_train_epoch_end itself logged, which the monitors decide on too
        for scheduler in due:
            if scheduler.reduce_on_plateau:
                step_scheduler(scheduler, trainer.callback_metrics, module.lr_scheduler_step)
        if running:
            trainer.metrics.load_state_dict(running)
        trainer.call_monitors("on_train_epoch_end")
        trainer.metrics.reset_metrics()
        if not progress.epoch_done:
            break  # stopped mid-epoch (should_stop or max_steps): the epoch does not count as finished
        progress.new_epoch()
    trainer.call("on_train_end")


def _use_loaders(trainer: Trainer, val_loaders: list[DataLoader]) -> tuple[int | float, list[DataLoader], int | float]:
    """The training batches per epoch, the validation loaders in use and the batches between validations."""
    num_batches, config = trainer.num_training_batches, trainer.config  # counted before configure_optimizers
    if num_batches == 0:
        raise MisconfigurationError("the training dataloader yields no batches (empty dataset or limit_train_batches=0).")
    if config.limit_val_batches == 0:
        val_loaders = []  # validation turned off, sanity check included, as in Lightning
    trainer.val_dataloaders = val_loaders
    return num_batches, val_loaders, _val_every(config.val_check_interval, num_batches)


def _fit_loaders_as_of(trainer: Trainer, epoch: int) -> list[DataLoader]:
    """The fit's loaders asked for again, with trainer.current_epoch reading `epoch` and the random generators
    seeded from the run's seed and `epoch` (then given back): where a resume starts after `epoch`, a loader
    built from the epoch or from random draws (a curriculum, a random subset) is the one the uninterrupted run
    used, and training draws the same numbers after the reload as without it."""
    progress = trainer.progress
    current, progress.epoch = progress.epoch, epoch
    try:
        with seeded((trainer.config.seed or 0) + epoch):
            return trainer.build_fit_loaders()
    finally:
        progress.epoch = current


def _warn_if_no_step_is_logged(trainer: Trainer) -> None:
    """As Lightning does: a fit shorter than log_every_n_steps writes no per-step row, which looks like a bug."""
    config = trainer.config
    if not trainer.loggers or not trainer.is_global_zero or config.fast_dev_run:
        return
    steps = trainer.estimated_stepping_batches
    if steps < config.log_every_n_steps:
        warnings.warn(f"this fit takes {steps} optimizer steps, fewer than log_every_n_steps={config.log_every_n_steps}, "
                      "so its loggers get no per-step values (epoch values are written); set log_every_n_steps lower "
                      "to see them.", stacklevel=4)


def _report_data_wait(trainer: Trainer, share: float, wait: float) -> None:
    """Keep the measured wait for the run summary; on rank 0, say when more loader workers would help."""
    trainer.data_wait = (share, wait)
    strategy = trainer.strategy
    advice = data_wait_advice(share, wait, trainer.train_dataloader.num_workers, strategy.environment.local_world_size,
                              strategy.root_device.type)
    if advice is not None and trainer.is_global_zero:
        warnings.warn(advice, stacklevel=2)


def _val_every(interval: int | float, num_batches: int | float) -> int | float:
    if isinstance(interval, float) and num_batches == math.inf:
        if interval != 1.0:
            raise MisconfigurationError(
                f"val_check_interval={interval} is a fraction of an epoch, but the training dataloader has no "
                "length; give a batch count (an int) or 1.0 (validate at each epoch end)."
            )
        return math.inf
    if isinstance(interval, float):
        return max(1, int(num_batches * interval))
    if interval > num_batches:
        raise MisconfigurationError(
            f"val_check_interval={interval} batches is more than the {num_batches} training batches of an epoch, so "
            "it would never validate mid-epoch; use at most that many (validation at each epoch end is 1.0), or "
            "limit_val_batches=0 to turn validation off."
        )
    return max(1, interval)


def _validates_after(batches: int, val_every: int | float, window: int) -> bool:
    """Whether a mid-epoch validation follows the epoch's first `batches` batches: at the first step boundary
    at or after each multiple of `val_every`. Never inside an accumulation `window`: a checkpoint saved after
    the validation would lack the window's pending gradients, and a resume from it would not match."""
    return batches % window == 0 and batches // val_every > (batches - window) // val_every


def _epoch_batches(loader: DataLoader, start: int, num_batches: int | float) -> Iterator[tuple[int, Any, bool]]:
    """(batch_idx, batch, is_last) for the epoch's batches from `start` on.

    With a known length nothing is fetched beyond the last batch; without one (an IterableDataset) the
    next batch is fetched one step early, the only way to know that the current one ends the epoch (its
    accumulated gradients must be stepped on, and not leak into the next epoch).
    """
    if num_batches != math.inf:
        # zip stops on the range first, so the loader is never asked for a batch past the limit; built from
        # iterators alone, with no Python frame of ours between the loader and each batch.
        last = itertools.chain(itertools.repeat(False, int(num_batches) - start - 1), (True,))
        return zip(range(start, int(num_batches)), loader, last)
    return _unsized_epoch_batches(loader, start)


def _unsized_epoch_batches(loader: DataLoader, start: int) -> Iterator[tuple[int, Any, bool]]:
    iterator = iter(loader)
    try:
        batch = next(iterator)
    except StopIteration:
        return
    batch_idx = start
    for following in iterator:
        yield batch_idx, batch, False
        batch, batch_idx = following, batch_idx + 1
    yield batch_idx, batch, True


def _steps_done(trainer: Trainer) -> bool:
    return trainer.config.max_steps != -1 and trainer.progress.global_step >= trainer.config.max_steps


def _done(trainer: Trainer, max_epochs: int) -> bool:
    progress, config = trainer.progress, trainer.config
    if _steps_done(trainer) or (max_epochs != -1 and progress.epoch >= max_epochs):
        return True
    return trainer.should_stop and progress.epoch >= config.min_epochs


def _validate_mid_epoch(trainer: Trainer, val_loaders: list[DataLoader], keep_rng: bool = False) -> None:
    trainer.progress.validated_batches = trainer.progress.epoch_batches
    _validate_if_due(trainer, val_loaders, keep_rng)


def _validate_if_due(trainer: Trainer, val_loaders: list[DataLoader], keep_rng: bool = False) -> None:
    config = trainer.config
    if not val_loaders or (trainer.progress.epoch + 1) % config.check_val_every_n_epoch:
        return
    evaluation_loop(trainer, "validate", val_loaders, limit=config.limit_val_batches, keep_rng=keep_rng)
    trainer.module.train()
    trainer.metrics.stage, trainer.metrics.in_step = "train", True


# --------------------------------------------------------------------------- validate / test


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
    step_name = f"{hook}_step"
    strategy, module = trainer.strategy, trainer.module
    several = _check_several_loaders(module, step_name, loaders)
    for dataloader_idx, loader in enumerate(loaders):
        _check_every_rank_evaluates(loader, limit, hook, dataloader_idx if several else None)
    saved_stage = trainer.metrics.stage
    trainer.metrics.stage, trainer.metrics.in_step = hook, False
    module.eval()
    # Hooks included, as in Lightning: what they compute from the model needs no graph either.
    with torch.inference_mode() if trainer.config.inference_mode else torch.no_grad():
        trainer.call(f"on_{hook}_start")
        trainer.call(f"on_{hook}_epoch_start")
        trainer.metrics.in_step = True
        for dataloader_idx, loader in enumerate(loaders):
            num_batches = batch_limit(loader, limit)
            trainer.metrics.name_suffix = f"/dataloader_idx_{dataloader_idx}" if several else ""
            to_device = batch_mover(strategy, module, trainer.datamodule, dataloader_idx)
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= num_batches:
                    break
                batch = to_device(batch)
                trainer.metrics.batch = batch
                trainer.call(f"on_{hook}_batch_start", batch, batch_idx, dataloader_idx)
                outputs = strategy.eval_step(step_name, batch, batch_idx, dataloader_idx if several else None)
                trainer.call(f"on_{hook}_batch_end", outputs, batch, batch_idx, dataloader_idx)
                trainer.write_eval_step_metrics()
        if saved_rng is not None:
            set_rng_state(saved_rng)
        trainer.metrics.in_step, trainer.metrics.name_suffix = False, ""
        # As in Lightning, the epoch-end hooks see this epoch's values in callback_metrics; what they log
        # joins the same row.
        results = trainer.publish_epoch_metrics(log=not trainer.sanity_checking, write=False)
        trainer.call(f"on_{hook}_epoch_end")
        results.update(trainer.publish_epoch_metrics(log=not trainer.sanity_checking))
        trainer.call(f"on_{hook}_end")
    trainer.metrics.reset_metrics()
    trainer.metrics.stage = saved_stage
    if not several:
        return [results]
    # Each loader's dict: its own values, and those logged outside its batches (in epoch-end hooks).
    return [{name: value for name, value in results.items() if not _LOADER_SUFFIX.search(name) or
             name.endswith(f"/dataloader_idx_{index}")} for index in range(len(loaders))]


_LOADER_SUFFIX = re.compile(r"/dataloader_idx_\d+$")


def _check_every_rank_evaluates(loader: DataLoader, limit: int | float, hook: str, index: int | None) -> None:
    """A clear error, on every rank alike, where some data-parallel rank's slice of `loader` holds no batch:
    that rank would never join the others' end-of-epoch reduction of what they logged, and they would wait
    for it until the collective timeout."""
    sliced = shard_batches(loader)
    if sliced is None:
        return
    counts = sliced[1]
    limited = [batch_limit(loader, limit, count) for count in counts]
    if max(limited) > 0 and min(limited) == 0:
        idle = [rank for rank, count in enumerate(limited) if count == 0]
        which = f"{hook} dataloader" + (f" {index}" if index is not None else "")
        raise MisconfigurationError(
            f"the {which} gives {len(counts)} data-parallel processes {sum(counts)} batch(es) in all, so rank(s) "
            f"{', '.join(map(str, idle))} would get none and the others would wait for them at the epoch's end; "
            f"give it at least {len(counts)} samples (or batches), or use fewer devices."
        )


def _check_several_loaders(module: Any, step_name: str, loaders: list[DataLoader]) -> bool:
    """True for several loaders, after checking that the step takes the `dataloader_idx` it then gets."""
    if len(loaders) < 2:
        return False
    step = getattr(module, step_name)
    try:
        inspect.signature(step).bind(None, 0, 0)
    except TypeError:
        raise MisconfigurationError(
            f"{len(loaders)} dataloaders were given, but {type(module).__name__}.{step_name} takes no dataloader_idx; "
            f"define it as {step_name}(self, batch, batch_idx, dataloader_idx=0)."
        ) from None
    return True


def predict_loop(trainer: Trainer, loaders: list[DataLoader], limit: int | float) -> list[list[Any]] | None:
    """predict_step over every batch; one list of outputs per loader (None: return_predictions=False).

    Under data parallelism each rank predicts its share, and every rank returns all of them, put back in the
    loader's order and batch size (on the CPU), as one process would have: predictions do not depend on
    the strategy.
    """
    strategy, module = trainer.strategy, trainer.module
    several = _check_several_loaders(module, "predict_step", loaders)
    keep_outputs = trainer._return_predictions
    trainer.predict_dataloaders = loaders
    module.eval()
    trainer.call("on_predict_start")
    trainer.call("on_predict_epoch_start")
    results: list[list[Any]] = []
    replicas = strategy.data_parallel_size
    # Under data parallelism the limit counts the loader's batches as one process would, so that the merged
    # predictions are one process's: each rank runs its share of them, and the merge keeps the first `kept`.
    kept: list[int | float | None] = []
    for loader in loaders:
        sliced = shard_batches(loader) if replicas > 1 else None
        kept.append(None if sliced is None else batch_limit(loader, limit, sliced[0]))
    grad_mode = torch.inference_mode() if trainer.config.inference_mode else torch.no_grad()
    with grad_mode:
        for dataloader_idx, loader in enumerate(loaders):
            outputs: list[Any] = []
            keep = kept[dataloader_idx]
            num_batches = batch_limit(loader, limit) if keep is None else math.ceil(keep / replicas)
            to_device = batch_mover(strategy, module, trainer.datamodule, dataloader_idx)
            recording, drawn = recording_batch_indices(loader)
            for batch_idx, batch in enumerate(recording):
                if batch_idx >= num_batches:
                    break
                trainer.predict_batch_indices = drawn[batch_idx] if drawn is not None else None
                batch = to_device(batch)
                trainer.call("on_predict_batch_start", batch, batch_idx, dataloader_idx)
                output = strategy.eval_step("predict_step", batch, batch_idx, dataloader_idx if several else None)
                trainer.call("on_predict_batch_end", output, batch, batch_idx, dataloader_idx)
                if keep_outputs:
                    outputs.append(output)
            results.append(outputs)
    trainer.predict_batch_indices = None
    trainer.call("on_predict_epoch_end")
    trainer.call("on_predict_end")
    if not keep_outputs:
        return None
    if replicas == 1:
        return results
    # Tensors travel as pickles: on the CPU, so that a rank unpickles none onto another rank's GPU.
    shares = strategy.gather_data_parallel(move_to_device(results, torch.device("cpu")))
    merged = [merge_prediction_shares([share[index] for share in shares], loader) for index, loader in enumerate(loaders)]
    return [batches if keep is None else batches[:keep] for batches, keep in zip(merged, kept)]
