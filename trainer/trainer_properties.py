"""The Trainer's read-only public state under Lightning's names: what callbacks and user code may read."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from torchyard.callbacks import EarlyStopping, GradientAccumulationScheduler, ModelCheckpoint
from torchyard.callbacks.base import Callback
from torchyard.callbacks.profilers import Profiler
from torchyard.trainer.data.batches import batch_limit
from torchyard.trainer.logs.loggers import Logger
from torchyard.trainer.loop.hooks import Hooks
from torchyard.trainer.loop.progress import LoopState, RunningStage, TrainerFn, TrainerState, TrainerStatus

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule


def _config_field(name: str) -> property:
    """The option `name`, read-only, where Lightning's Trainer has it as an attribute."""
    return property(lambda trainer: getattr(trainer.config, name), doc=f"The {name} option.")


def _loop_field(name: str, doc: str) -> property:
    """A read-only view of the loops' state (LoopState) under Lightning's name."""
    return property(lambda trainer: getattr(trainer._loop, name), doc=doc)


class TrainerProperties:
    """Read-only views of the state a Trainer's parts own (its config, strategy, loop state, collector, run folder);
    the Trainer sets up those parts, this class only shows them."""

    sanity_checking = _loop_field("sanity_checking", "In fit's sanity check (validation batches before training).")
    train_dataloader = _loop_field("train_dataloader", "This rank's training loader, during fit.")
    val_dataloaders = _loop_field("val_dataloaders", "The validation loaders a fit validates on (none: off).")
    num_training_batches = _loop_field("num_training_batches", "Training batches per epoch (math.inf: unsized).")
    predict_dataloaders = _loop_field("predict_dataloaders", "During predict: this rank's loaders.")
    predict_batch_indices = _loop_field("predict_batch_indices", "During predict: the dataset indices of the batch.")
    data_wait = _loop_field("data_wait", "(share of the time, seconds a batch) the fit waited for training batches.")
    is_last_batch = _loop_field("is_last_batch", "Whether the training batch being run is the last of its epoch.")
    progress = _loop_field("progress", "Where the run stands (Progress): epoch, steps, batches of the epoch.")

    @property
    def should_stop(self) -> bool:
        """Set by a callback (as in Lightning) to end the fit at the next chance (min_epochs permitting)."""
        return self._loop.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._loop.should_stop = bool(value)

    @property
    def loop_state(self) -> LoopState:
        """What the loops change while a stage runs; theirs to write, everyone else's to read."""
        return self._loop

    @property
    def hooks(self) -> Hooks:
        """The stage's hook dispatch (callbacks, then the module)."""
        return self._hooks

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.rows.callback_metrics

    @property
    def logged_metrics(self) -> dict[str, float]:
        return self.metrics.rows.logged_metrics

    @property
    def current_epoch(self) -> int:
        return self.progress.epoch

    @property
    def training(self) -> bool:
        """In fit's training loop (not its validations), as Lightning's `trainer.training`."""
        return self.stage == "fit" and self.metrics.stage == "train"

    @property
    def validating(self) -> bool:
        """In a validation loop, of fit or of `validate` (not the sanity check, as in Lightning)."""
        return self.metrics.stage == "validation" and not self.sanity_checking

    @property
    def testing(self) -> bool:
        return self.stage == "test"

    @property
    def predicting(self) -> bool:
        return self.stage == "predict"

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    # Facts about the fit's schedule that callbacks read, so that none re-derives it from progress or config.
    @property
    def batches_stepped(self) -> int:
        """The loggers' step: batches that stepped, once each however many optimizers a batch steps."""
        return self.progress.batches_stepped

    @property
    def batches_this_epoch(self) -> int:
        """Training batches consumed so far in the current epoch (a resumed epoch counts those before it)."""
        return self.progress.epoch_batches

    @property
    def epoch_batches_done(self) -> bool:
        """The current epoch's batches are all consumed (False while it runs and where a stop cut it short)."""
        return self.progress.epoch_done

    @property
    def logs_this_step(self) -> bool:
        """The loggers' step is one that per-step rows are written at (a multiple of log_every_n_steps)."""
        return self.progress.batches_stepped % self.config.log_every_n_steps == 0

    @property
    def validates_at_epoch_end(self) -> bool:
        """Every training epoch's end validates, given val loaders (check_val_every_n_epoch=1, limit_val_batches!=0)."""
        return self.config.check_val_every_n_epoch == 1 and self.config.limit_val_batches != 0

    @property
    def validates_only_at_epoch_end(self) -> bool:
        """Any validation runs at each epoch's end and nowhere else (val_check_interval=1.0, every epoch)."""
        interval = self.config.val_check_interval
        return isinstance(interval, float) and interval == 1.0 and self.config.check_val_every_n_epoch == 1

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        """The job's process count; in a script whose fit started the processes itself, theirs once it ran."""
        job = getattr(self, "_job_world_size", None)  # carried to the workers of a later stage: theirs is their own
        return job if job is not None and not self.strategy.environment.launched else self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def max_epochs(self) -> int:
        return self.config.resolved_max_epochs()

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """What was logged with prog_bar=True, last values, as floats (`loss_step` and `loss_epoch` for a value
        logged per step and per epoch, as in Lightning)."""
        return {name: float(value) for name, value in dict(self.metrics.rows.bar_values).items()}

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps this fit takes in all (math.inf when unbounded), for schedules such as
        OneCycleLR(total_steps=...): batches per epoch over accumulation, times max_epochs, capped by max_steps."""
        epochs = self.config.resolved_max_epochs()
        per_epoch = self.num_training_batches
        per_epoch = math.ceil(per_epoch / self.config.accumulate_grad_batches) if per_epoch != math.inf else math.inf
        total = per_epoch * epochs if epochs != -1 else math.inf
        return min(total, self.config.max_steps) if self.config.max_steps != -1 else total

    @property
    def num_val_batches(self) -> list[int | float]:
        """Batches each validation loader runs (with limit_val_batches), as in Lightning."""
        return [batch_limit(loader, self.config.limit_val_batches) for loader in self.val_dataloaders]

    # Lightning's names for what this Trainer holds under its own.
    default_root_dir = _config_field("default_root_dir")
    precision = _config_field("precision")

    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches per optimizer step in the current epoch: a GradientAccumulationScheduler's factor, else
        the option's."""
        scheduler = next((c for c in self.callbacks if isinstance(c, GradientAccumulationScheduler)), None)
        if scheduler is None:
            return self.config.accumulate_grad_batches
        return scheduler.get_accumulate_grad_batches(self.current_epoch)
    log_every_n_steps = _config_field("log_every_n_steps")
    max_steps = _config_field("max_steps")

    @property
    def lightning_module(self) -> TrainModule | None:
        return self.module

    model = lightning_module

    @property
    def early_stopping_callback(self) -> Any:
        return next((c for c in self.callbacks if isinstance(c, EarlyStopping)), None)

    @property
    def log_dir(self) -> str:
        """This run's folder, `<default_root_dir>/<name>/version_<n>`, as a string (as Lightning's)."""
        if self.loggers:
            return str(self.loggers[0].log_dir)
        return str(self._run_folder.path)

    @property
    def version(self) -> int | str:
        """The run's number: log_dir is `<default_root_dir>/<name>/version_<n>`."""
        return self.loggers[0].version if self.loggers else self._run_folder.number()

    @property
    def profiler(self) -> Profiler | None:
        """The fit's profiler (the profiler option's, or one given among the callbacks), as in Lightning."""
        return next((c for c in self.callbacks if isinstance(c, Profiler)), None)

    @property
    def checkpoint_callbacks(self) -> list[Callback]:
        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Any:
        found = self.checkpoint_callbacks
        return found[0] if found else None

    # Lightning's facts about the devices and the run, under its names and meanings.
    @property
    def device_ids(self) -> list[int]:
        """The indexes of the devices this Trainer uses on each node (`[0, 1]` for devices=2, CPU or GPU)."""
        return list(range(self.strategy.devices))

    @property
    def num_devices(self) -> int:
        """How many devices this Trainer uses on each node: len(device_ids)."""
        return len(self.device_ids)

    @property
    def num_nodes(self) -> int:
        return self.strategy.num_nodes

    @property
    def node_rank(self) -> int:
        """This process's node in the job (0 in the process that launched it, as on the first node)."""
        return self.strategy.environment.node_rank

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint file the latest fit, validate, test or predict loaded ("last" and "best" resolved to
        the file); None when it loaded none. Read-only: give ckpt_path to the entry point instead."""
        return self._loop.ckpt_path

    @property
    def interrupted(self) -> bool:
        """The latest entry point ended by an exception (Ctrl-C and SIGTERM included), as in Lightning."""
        return self._loop.status == TrainerStatus.INTERRUPTED

    @property
    def state(self) -> TrainerState:
        """Lightning's TrainerState: `fn` (the entry point: "fit", ...), `status` ("running", "finished",
        "interrupted") and `stage` (the loop running now: "train", "sanity_check", "validate", ...; else None)."""
        status = self._loop.status
        fn = TrainerFn(self.stage) if self.stage is not None else None
        return TrainerState(status, fn, self._running_stage() if status == TrainerStatus.RUNNING else None)

    def _running_stage(self) -> RunningStage | None:
        if self.stage is None:
            return None
        if self.sanity_checking:
            return RunningStage.SANITY_CHECKING
        if self.stage == "fit":
            return RunningStage.VALIDATING if self.metrics.stage == "validation" else RunningStage.TRAINING
        return RunningStage(self.stage)
