"""Timer: measure time per stage and stop the fit once a training-time budget is spent."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from torchyard.callbacks.base import Callback
from torchyard.trainer.config import parse_duration
from torchyard.trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer

STAGES = ("train", "validate", "test")


class Timer(Callback):
    """Times the train, validate and test stages; with `duration`, stops training once it has run that long.

    The check runs after every optimizer step (`interval="step"`) or at each epoch's end ("epoch"). The
    training time so far is saved in checkpoints, so a resumed run continues the same budget.
    """

    def __init__(self, duration: Any = None, interval: str = "step", verbose: bool = True) -> None:
        if interval not in ("step", "epoch"):
            raise MisconfigurationError(f"Timer(interval={interval!r}) is not known; use 'step' or 'epoch'.")
        self.duration = parse_duration(duration, f"Timer(duration={duration!r})")
        self.interval, self.verbose = interval, verbose
        self._start: dict[str, float] = {}
        self._end: dict[str, float] = {}
        self._offset = 0.0  # training seconds spent before a resume
        self._announced = False

    @property
    def step_collective(self) -> str | None:
        """Checking a budget after every step asks rank 0's clock (a broadcast) each step."""
        return "Timer(interval='step')" if self.duration is not None and self.interval == "step" else None

    def start_time(self, stage: str = "train") -> float | None:
        """When `stage` last started (time.monotonic), or None."""
        return self._start.get(stage)

    def end_time(self, stage: str = "train") -> float | None:
        """When `stage` last ended (time.monotonic), or None while it runs."""
        return self._end.get(stage)

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds `stage` has run (its latest run; training includes time before a resume)."""
        offset = self._offset if stage == "train" else 0.0
        start = self._start.get(stage)
        if start is None:
            return offset
        return self._end.get(stage, time.monotonic()) - start + offset

    @override
    def stop_reason(self, trainer: Trainer) -> str | None:
        if self.duration is None or self.time_elapsed("train") < self.duration:
            return None
        return f"time limit reached ({timedelta(seconds=self.duration)})"

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of `duration`, or None without one."""
        return None if self.duration is None else self.duration - self.time_elapsed(stage)

    def _begin(self, stage: str) -> None:
        self._start[stage] = time.monotonic()
        self._end.pop(stage, None)

    def _finish(self, stage: str) -> None:
        self._end[stage] = time.monotonic()

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._check(trainer)  # a resumed run whose budget is already spent trains no further step

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._announced = False
        self._begin("train")

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._finish("train")

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._begin("validate")

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._finish("validate")

    def on_test_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._begin("test")

    def on_test_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._finish("test")

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.interval == "step":
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.interval == "epoch":
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        if self.duration is None:
            return
        # Rank 0's clock decides, so every rank stops after the same step.
        if trainer.strategy.broadcast(self.time_elapsed("train") >= self.duration):
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero and not self._announced:
                self._announced = True  # min_epochs may keep the run going: say it once
                print(f"Timer: the time budget of {timedelta(seconds=self.duration)} is spent "
                      f"({timedelta(seconds=round(self.time_elapsed('train')))} elapsed); stopping.")

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._offset = float(state["time_elapsed"].get("train", 0.0))
