"""RichProgressBar: the default progress display, drawn by rank 0 and throttled so steps stay cheap."""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torchyard.callbacks.base import Callback
from torchyard.trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer


def metrics_text(trainer: Trainer) -> str:
    """'step=120 loss=0.1234 ...': the bar's tensors become floats only here, when drawn, so no step syncs for it."""
    values = (f"{name}={value:.4g}" for name, value in trainer.progress_bar_metrics.items())
    return " ".join([f"step={trainer.global_step}", *values])


def _trainer_progress(before_render: Callable[[], None], console: Console, refresh_interval: float) -> Progress:
    """A rich Progress that reads the trainer just before each redraw (in rich's thread): the loop never calls it.
    rich is imported here, where a bar is drawn, so that `import` stays light (benchmarks/overhead.py)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class SpeedColumn(ProgressColumn):
        """Batches per second, as rich estimates it from the updates it was given."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:.1f} it/s" if speed is not None else "? it/s", style="progress.data.speed")

    class TrainerProgress(Progress):
        def get_renderables(self) -> Iterable[Any]:
            before_render()
            yield from super().get_renderables()

    return TrainerProgress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), SpeedColumn(),
        TextColumn("{task.fields[metrics]}", markup=False), console=console, auto_refresh=refresh_interval > 0,
        refresh_per_second=1 / refresh_interval if refresh_interval else 1,
    )


class RichProgressBar(Callback):
    """A training bar (epoch, batches, elapsed, ETA, it/s, step and prog_bar metrics) and transient eval bars.

    Training batches cost it nothing: rich's refresh thread redraws every `refresh_interval` seconds and
    reads the trainer's counters and logged tensors then (`refresh_interval=0`: a redraw after every batch,
    from the loop). Evaluation bars count their batches. Ranks other than 0 draw nothing. When stdout is not
    a terminal (CI logs) it prints one line per training epoch instead, and one every `line_interval` seconds
    while an epoch runs (from a thread of its own, so steps still cost nothing; 0: at epoch ends only).

    Lightning's arguments mean what they mean there: `refresh_rate` batches between updates of the count
    shown (0 hides the bar), `leave` keeps each finished epoch's bar on screen, `console_kwargs` build the
    rich Console (or pass one as `console`).
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = False, console_kwargs: dict[str, Any] | None = None,
                 refresh_interval: float = 0.5, console: Console | None = None, line_interval: float = 30.0) -> None:
        if not isinstance(refresh_rate, int) or isinstance(refresh_rate, bool) or refresh_rate < 0:
            raise MisconfigurationError(
                f"RichProgressBar(refresh_rate={refresh_rate!r}) must be a number of batches >= 0 (0 hides the bar).")
        if not isinstance(refresh_interval, (int, float)) or refresh_interval < 0:
            raise MisconfigurationError(f"RichProgressBar(refresh_interval={refresh_interval!r}) must be seconds >= 0.")
        if not isinstance(line_interval, (int, float)) or line_interval < 0:
            raise MisconfigurationError(f"RichProgressBar(line_interval={line_interval!r}) must be seconds >= 0.")
        self.refresh_rate, self.leave, self.refresh_interval = refresh_rate, leave, float(refresh_interval)
        self.line_interval = float(line_interval)
        self._lines_stop: threading.Event | None = None  # set to end the fit's periodic lines
        self._line_epoch: float | None = None  # the running epoch's start (monotonic), for the lines' thread
        self._console_kwargs = dict(console_kwargs or {})
        self._user_console = console
        self._console: Console | None = None
        self._progress: Progress | None = None
        self._enabled = False
        self._interactive = False
        self._trainer: Trainer | None = None  # read by the refresh thread
        self._train_task: TaskID | None = None
        self._eval_task: TaskID | None = None
        self._eval_done = 0
        self._epoch_started = 0.0
        self._epoch_first_batch = 0
        self._ended_epoch_batches: int | None = None  # what the bar shows once the trainer has moved past the epoch

    def __getstate__(self) -> dict[str, Any]:
        # Consoles and live displays hold files and locks; worker processes build their own.
        state = self.__dict__.copy()
        state.update(_user_console=None, _console=None, _progress=None, _trainer=None, _train_task=None,
                     _eval_task=None, _lines_stop=None)
        return state

    def uses_hook(self, hook: str) -> bool:
        # Training batches are drawn by the refresh thread, unless a redraw after every batch was asked for.
        return hook != "on_train_batch_end" or self.refresh_interval == 0

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._enabled = trainer.is_global_zero and self.refresh_rate > 0
        if not self._enabled:
            return
        self._trainer = trainer
        from rich.console import Console

        self._console = self._user_console or Console(**self._console_kwargs)
        self._interactive = self._console.is_terminal and not self._console.is_dumb_terminal

    def _live(self) -> Progress | None:
        """The live display, started on first use (None when not drawing one)."""
        if not (self._enabled and self._interactive):
            return None
        if self._progress is None:
            assert self._console is not None
            self._progress = _trainer_progress(self._update_tasks, self._console, self.refresh_interval)
            self._progress.start()
        return self._progress

    def _stop(self) -> None:
        self._stop_lines()
        if self._progress is not None:
            self._progress.stop()
        self._progress, self._train_task, self._eval_task = None, None, None

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._stop()  # what prints after training (the run summary) appears below a finished bar

    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._stop()
        self._trainer = None

    # ------------------------------------------------------------------ training bar
    def _epoch_description(self, trainer: Trainer) -> str:
        last = trainer.max_epochs - 1
        return f"Epoch {trainer.current_epoch}/{last}" if last >= 0 else f"Epoch {trainer.current_epoch}"

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._enabled:
            return
        self._epoch_first_batch = trainer.batches_this_epoch  # a resume starts mid-epoch
        self._ended_epoch_batches = None
        self._epoch_started = time.monotonic()
        progress = self._live()
        if progress is None:
            self._start_lines()
            return
        description = self._epoch_description(trainer)
        # math.inf for a loader without a length: rich then draws an open-ended bar ("n/?").
        total = trainer.num_training_batches if math.isfinite(trainer.num_training_batches) else None
        if self._train_task is None or self.leave:  # with leave, the finished epoch's bar stays above the new one
            self._train_task = progress.add_task(description, total=total, metrics="")
        else:
            progress.reset(self._train_task, total=total, description=description)  # both redraw

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._redraw()  # refresh_interval=0 only (see uses_hook)

    def _update_tasks(self) -> None:
        """Bring the tasks to the trainer's batch count and metrics; runs before each redraw, in either thread."""
        progress, trainer = self._progress, self._trainer
        if progress is None or trainer is None:
            return
        if self._train_task is not None:
            done = trainer.batches_this_epoch if self._ended_epoch_batches is None else self._ended_epoch_batches
            if self._ended_epoch_batches is None:
                done -= done % self.refresh_rate  # the count moves every refresh_rate batches
            progress.update(self._train_task, completed=done, metrics=metrics_text(trainer))
        eval_task = self._eval_task
        if eval_task is not None:
            try:
                progress.update(eval_task, completed=self._eval_done)
            except KeyError:  # the loop removed the finished evaluation's task since it was read
                pass

    def _redraw(self) -> None:
        if self._progress is not None:
            self._progress.refresh()

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._enabled:
            return
        if self._progress is not None:
            self._ended_epoch_batches = trainer.batches_this_epoch  # the loop resets it before on_train_end
            self._redraw()
            return
        self._line_epoch = None
        self._print_line(trainer)

    def _print_line(self, trainer: Trainer) -> None:
        """'Epoch 1/4: 12/40 batches, 3.1s, ...' (a loader without a length: '12 batches')."""
        elapsed = time.monotonic() - self._epoch_started
        done, total = trainer.batches_this_epoch, trainer.num_training_batches
        rate = (done - self._epoch_first_batch) / elapsed if elapsed > 0 else 0.0
        count = f"{done}/{total}" if math.isfinite(total) else str(done)
        line = (f"{self._epoch_description(trainer)}: {count} batches, {elapsed:.1f}s, {rate:.1f} it/s, "
                f"{metrics_text(trainer)}")
        from rich.text import Text

        assert self._console is not None
        self._console.print(Text(line), soft_wrap=True, highlight=False)

    def _start_lines(self) -> None:
        """Outside a terminal: a line every line_interval seconds of a running epoch, printed by one thread per fit
        (started at the first epoch: a thread started per epoch costs its boundary milliseconds of hand-over)."""
        self._line_epoch = self._epoch_started
        if self.line_interval <= 0 or self._lines_stop is not None:
            return
        self._lines_stop = stop = threading.Event()
        threading.Thread(target=self._print_lines, args=(stop,), name="progress-lines", daemon=True).start()

    def _print_lines(self, stop: threading.Event) -> None:
        while True:
            epoch_started = self._line_epoch  # None between epochs
            since = time.monotonic() - epoch_started if epoch_started is not None else 0.0
            if stop.wait(self.line_interval - since % self.line_interval):
                return
            trainer = self._trainer
            if trainer is None:
                return
            if epoch_started is not None and self._line_epoch == epoch_started:  # the same epoch still runs
                self._print_line(trainer)

    def _stop_lines(self) -> None:
        if self._lines_stop is not None:
            self._lines_stop.set()
            self._lines_stop = None

    # ------------------------------------------------------------------ evaluation bars (transient)
    def _eval_start(self, description: str) -> None:
        self._eval_done = 0
        progress = self._live()
        if progress is not None:
            self._eval_task = progress.add_task(description, total=None, metrics="")  # redraws

    def _eval_batch(self) -> None:
        self._eval_done += 1
        if self.refresh_interval == 0:
            self._redraw()

    def _eval_end(self, trainer: Trainer) -> None:
        if self._progress is not None and self._eval_task is not None:
            task, self._eval_task = self._eval_task, None
            self._progress.remove_task(task)
            self._redraw()  # epoch-level metrics (validation) show on the training bar

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


class TQDMProgressBar(RichProgressBar):
    """Lightning's TQDMProgressBar by name: this framework draws the same rich bar (no tqdm dependency);
    `refresh_rate` means what it means there, `process_position` (a terminal line offset) is accepted and unused."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.process_position = process_position
        if process_position:
            warnings.warn(f"TQDMProgressBar(process_position={process_position}) has no effect here: the bar is "
                          "drawn by rich on rank 0, at the terminal's current line.", stacklevel=2)
