"""What the loops change while a stage runs: the Trainer shows it read-only through its properties."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchyard.trainer.data.ledger import SampleLedger


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


class TrainerFn(str, Enum):
    """The entry point a Trainer runs or ran last (Lightning's names and values; equal to the plain strings)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class TrainerStatus(str, Enum):
    """Whether that entry point is running, finished, or ended by an exception (Lightning's)."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


class RunningStage(str, Enum):
    """The loop running now (Lightning's)."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


@dataclass(frozen=True)
class TrainerState:
    """`trainer.state` (Lightning's): the entry point, its status, and the loop running now (None outside one)."""

    status: TrainerStatus = TrainerStatus.INITIALIZING
    fn: TrainerFn | None = None
    stage: RunningStage | None = None

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status in (TrainerStatus.FINISHED, TrainerStatus.INTERRUPTED)


@dataclass
class LoopState:
    """The loops' state of a Trainer's stages (Progress carries over from stage to stage, and into checkpoints)."""

    progress: Progress = field(default_factory=Progress)
    should_stop: bool = False  # set by callbacks (EarlyStopping, Timer): the fit ends at the next chance
    status: TrainerStatus = TrainerStatus.INITIALIZING  # of the latest entry point (fit, validate, test, predict)
    ckpt_path: str | None = None  # the checkpoint file the latest entry point loaded (None: none)
    sanity_checking: bool = False
    is_last_batch: bool = False  # the training batch being run is its epoch's last
    train_dataloader: DataLoader | None = None  # this rank's training loader, during fit
    val_dataloaders: list[DataLoader] = field(default_factory=list)  # and the ones it validates on (none: off)
    num_training_batches: int | float = 0
    # During fit: builds the fit's loaders again (reload_dataloaders_every_n_epochs), and the epoch that the
    # current ones were built in (current_epoch then).
    build_fit_loaders: Callable[[], list[DataLoader]] | None = None
    fit_loaders_epoch: int = 0
    #: (share of the time, seconds a batch) the fit waited for training batches, measured on its first ones.
    data_wait: tuple[float, float] | None = None
    predict_dataloaders: list[DataLoader] = field(default_factory=list)  # during predict: this rank's loaders
    #: During predict: the dataset indices of the current batch (None where the loader cannot tell them).
    predict_batch_indices: list[int] | None = None
    return_predictions: bool = True
    #: During fit: this rank's torch RNG state as the running epoch began, when its loader drew its order and
    #: worker seeds (from torch's generator); a checkpoint keeps it, so a mid-epoch resume draws them again.
    epoch_start_rng: torch.Tensor | None = None
    #: During fit: reads the training losses that the step guard keeps unread (faults.StepGuard.read_losses) and
    #: raises at a NaN or inf; a checkpoint is built only after it, so none holds weights such a loss moved.
    read_losses: Callable[[], None] | None = None
    #: After restoring a mid-epoch checkpoint: its epoch_start_rng, until the resumed epoch has drawn its order.
    resumed_epoch_rng: torch.Tensor | None = None
    #: Which positions of each epoch's order every rank trained (data/ledger.py), kept in checkpoints.
    ledger: SampleLedger = field(default_factory=SampleLedger)
