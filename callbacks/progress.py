"""RichProgressBar: the default progress display, drawn by rank 0 and throttled so steps stay cheap."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from callbacks.base import Callback
from trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class _SpeedColumn(ProgressColumn):
    """Batches per second, as rich estimates it from the updates it was given."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} it/s" if speed is not None else "? it/s", style="progress.data.speed")


def metrics_text(trainer: Trainer) -> str:
    """'step=120 loss=0.1234 ...' from the progress-bar metrics (tensors become floats only here)."""
    parts = [f"step={trainer.global_step}"]
    for name, value in trainer.progress_bar_metrics.items():
        number = float(value)
        parts.append(f"{name}={number:.4g}")
    return " ".join(parts)


class RichProgressBar(Callback):
    """A training bar (epoch, batches, elapsed, ETA, it/s, step and prog_bar metrics) and transient eval bars.

    Per batch it only records counters; the display is redrawn at most every `refresh_rate` seconds,
    which is when logged tensors are read. Ranks other than 0 draw nothing. When stdout is not a
    terminal (CI logs) it prints one line per training epoch instead.
    """

    def __init__(self, refresh_rate: float = 0.5, console: Console | None = None) -> None:
        if not isinstance(refresh_rate, (int, float)) or refresh_rate < 0:
            raise MisconfigurationError(f"RichProgressBar(refresh_rate={refresh_rate!r}) must be seconds >= 0.")
        self.refresh_rate = float(refresh_rate)
        self._user_console = console
        self._console: Console | None = None
        self._progress: Progress | None = None
        self._enabled = False
        self._interactive = False
        self._train_task: TaskID | None = None
        self._eval_task: TaskID | None = None
        self._train_done = self._eval_done = 0
        self._next_refresh = 0.0
        self._epoch_started = 0.0
        self._epoch_first_batch = 0

    def __getstate__(self) -> dict[str, Any]:
        # Consoles and live displays hold files and locks; worker processes build their own.
        state = self.__dict__.copy()
        state.update(_user_console=None, _console=None, _progress=None, _train_task=None, _eval_task=None)
        return state

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._enabled = trainer.is_global_zero
        if not self._enabled:
            return
        self._console = self._user_console or Console()
        self._interactive = self._console.is_terminal and not self._console.is_dumb_terminal

    def _live(self) -> Progress | None:
        """The live display, started on first use (None when not drawing one)."""
        if not (self._enabled and self._interactive):
            return None
        if self._progress is None:
            self._progress = Progress(
                TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), _SpeedColumn(),
                TextColumn("{task.fields[metrics]}", markup=False),
                console=self._console, auto_refresh=False,
            )
            self._progress.start()
        return self._progress

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress, self._train_task, self._eval_task = None, None, None

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._stop()  # what prints after training (the run summary) appears below a finished bar

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._stop()

    # ------------------------------------------------------------------ training bar
    def _epoch_description(self, trainer: Trainer) -> str:
        last = trainer.max_epochs - 1
        return f"Epoch {trainer.current_epoch}/{last}" if last >= 0 else f"Epoch {trainer.current_epoch}"

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._enabled:
            return
        self._train_done = self._epoch_first_batch = trainer.progress.epoch_batches  # a resume starts mid-epoch
        self._epoch_started = time.monotonic()
        progress = self._live()
        if progress is None:
            return
        description = self._epoch_description(trainer)
        # math.inf for a loader without a length: rich then draws an open-ended bar ("n/?").
        total = trainer.num_training_batches if math.isfinite(trainer.num_training_batches) else None
        if self._train_task is None:
            self._train_task = progress.add_task(description, total=total, metrics="")
        else:
            progress.reset(self._train_task, total=total, description=description)
        self._refresh_train(trainer)

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._train_done = batch_idx + 1
        if self._progress is not None and time.monotonic() >= self._next_refresh:
            self._refresh_train(trainer)

    def _refresh_train(self, trainer: Trainer) -> None:
        progress = self._progress
        if progress is None or self._train_task is None:
            return
        progress.update(self._train_task, completed=self._train_done, metrics=metrics_text(trainer))
        progress.refresh()
        self._next_refresh = time.monotonic() + self.refresh_rate

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._enabled:
            return
        if self._progress is not None:
            self._refresh_train(trainer)
            return
        elapsed = time.monotonic() - self._epoch_started
        rate = (self._train_done - self._epoch_first_batch) / elapsed if elapsed > 0 else 0.0
        line = (f"{self._epoch_description(trainer)}: {self._train_done}/{trainer.num_training_batches} batches, "
                f"{elapsed:.1f}s, {rate:.1f} it/s, {metrics_text(trainer)}")
        assert self._console is not None
        self._console.print(Text(line), soft_wrap=True, highlight=False)

    # ------------------------------------------------------------------ evaluation bars (transient)
    def _eval_start(self, description: str) -> None:
        self._eval_done = 0
        progress = self._live()
        if progress is not None:
            self._eval_task = progress.add_task(description, total=None, metrics="")
            progress.refresh()

    def _eval_batch(self) -> None:
        self._eval_done += 1
        if self._eval_task is not None and time.monotonic() >= self._next_refresh:
            assert self._progress is not None
            self._progress.update(self._eval_task, completed=self._eval_done)
            self._progress.refresh()
            self._next_refresh = time.monotonic() + self.refresh_rate

    def _eval_end(self, trainer: Trainer) -> None:
        if self._progress is not None and self._eval_task is not None:
            self._progress.remove_task(self._eval_task)
            self._eval_task = None
            self._refresh_train(trainer)  # epoch-level metrics (validation) show on the training bar

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._eval_start("Sanity checking" if trainer.sanity_checking else "Validation")

    def on_validation_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._eval_batch()

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._eval_end(trainer)

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._eval_start("Testing")

    def on_test_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._eval_batch()

    def on_test_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._eval_end(trainer)

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._eval_start("Predicting")

    def on_predict_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._eval_batch()

    def on_predict_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._eval_end(trainer)
