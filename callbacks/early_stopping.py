"""EarlyStopping: stop the fit when a logged metric stops improving, diverges or is no longer finite."""

from __future__ import annotations

import math
import warnings
from enum import Enum
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from torchyard.callbacks.base import Callback
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.evaluations import SCORED, read_record, scores

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer


class EarlyStoppingReason(Enum):
    """Why EarlyStopping stopped the fit (Lightning's enum, same members and values)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Set `trainer.should_stop` once `monitor` has not improved by more than `min_delta` for `patience` checks.

    A check happens at each training epoch's end when validation runs once per epoch at its end (the
    default; this also covers runs without validation), otherwise after each validation; pass
    `check_on_train_epoch_end` to choose. It also stops when the value is not finite (`check_finite`),
    beats `stopping_threshold`, or is worse than `divergence_threshold`. `patience` counts checks, not epochs.
    Every rank decides on rank 0's value, so the reason is rank 0's and printed there only; Lightning's
    `log_rank_zero_only` is accepted for ported code and changes nothing.

    `from_evaluator=True` reads `monitor` from the scores of the evaluator side process (`Trainer(evaluator=...)`,
    its evaluations.json in the run folder) instead of the values logged in the loop: at each training epoch's end,
    each checkpoint it scored since the last check counts as one check, in step order, so the fit stops within one
    checkpoint interval of the score that says so (given the evaluator keeps up).
    """

    monitors = True

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, mode: str = "min",
                 check_finite: bool = True, stopping_threshold: float | None = None,
                 divergence_threshold: float | None = None, verbose: bool = False, strict: bool = True,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False,
                 from_evaluator: bool = False) -> None:
        if mode not in ("min", "max"):
            raise MisconfigurationError(f"EarlyStopping(mode={mode!r}) is not known; use 'min' or 'max'.")
        if not isinstance(patience, int) or patience < 0:
            raise MisconfigurationError(f"EarlyStopping(patience={patience!r}) must be a whole number >= 0.")
        if min_delta < 0:
            raise MisconfigurationError(
                f"EarlyStopping(min_delta={min_delta}) must be >= 0: it is the least change that counts as improvement."
            )
        self.monitor, self.min_delta, self.patience, self.mode = monitor, float(min_delta), patience, mode
        self.check_finite, self.strict, self.verbose = check_finite, strict, verbose
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.from_evaluator = from_evaluator
        self.evaluated_step = -1  # from_evaluator: the step of the newest evaluator score already checked
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = math.inf if mode == "min" else -math.inf
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None  # the sentence printed when it stopped
        self._at_epoch_end = True
        self._warned_missing = False

    @property
    def state_key(self) -> str:
        settings = {"monitor": self.monitor, "mode": self.mode}
        return f"{type(self).__qualname__}{settings!r}"

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.from_evaluator:  # the scores arrive from another process: read them at each epoch's end
            self._at_epoch_end = True
            return
        if self.check_on_train_epoch_end is not None:
            self._at_epoch_end = self.check_on_train_epoch_end
            return
        # Epoch ends check only where each follows its epoch's one validation: elsewhere they would see stale values.
        self._at_epoch_end = trainer.validates_only_at_epoch_end

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.sanity_checking or trainer.stage != "fit" or self._at_epoch_end:
            return
        self._run_early_stopping_check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self._at_epoch_end:
            self._run_early_stopping_check(trainer)

    def _run_early_stopping_check(self, trainer: Trainer) -> None:
        """One check of `monitor`: stop the fit where it says so. Lightning's override point, under its name: a
        subclass that checks elsewhere (at the end of training instead of after validation, as Lightning's docs
        show) overrides the hook that calls it and calls it from its own."""
        if trainer.config.fast_dev_run:
            return  # a smoke test of a batch or two: as in Lightning, it never stops early
        if self.from_evaluator:
            self._check_evaluator_scores(trainer)
            return
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            message = (f"EarlyStopping(monitor={self.monitor!r}) found no such logged metric; "
                       f"logged: {sorted(metrics)}. "
                       f"Log it with self.log({self.monitor!r}, value), fix the name, or pass strict=False"
                       + (" (or from_evaluator=True, to read the evaluator's scores)."
                          if trainer.config.evaluator is not None else ".")
                       + trainer.strategy.missing_metric_hint(trainer.module))
            if self.strict:
                raise MisconfigurationError(message)
            if not self._warned_missing and trainer.is_global_zero:
                self._warned_missing = True
                warnings.warn(message, stacklevel=2)
            return
        # Every rank follows rank 0's value so all of them stop at the same step.
        current = trainer.strategy.broadcast(float(metrics[self.monitor]))
        self._act(trainer, *self._evaluate(current), f"step {trainer.global_step}")

    def _act(self, trainer: Trainer, kind: EarlyStoppingReason, reason: str | None, where: str) -> bool:
        """Stop the run where `kind` says so, printing the reason; whether it stops."""
        should_stop = kind is not EarlyStoppingReason.NOT_STOPPED
        if should_stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason, self.stopping_reason_message = kind, reason
        if reason and (should_stop or self.verbose) and trainer.is_global_zero:
            print(f"EarlyStopping (epoch {trainer.current_epoch}, {where}): {reason}")
        return should_stop

    def _check_evaluator_scores(self, trainer: Trainer) -> None:
        """Each score the evaluator recorded since the last check is one check (rank 0 reads them for every rank)."""
        new: tuple[list[tuple[int, float]], list[str]] | None = None
        if trainer.is_global_zero:
            record = read_record(trainer.log_dir)
            lacking = sorted({name for e in record if e.status == SCORED and self.monitor not in e.metrics
                              for name in e.metrics})
            new = ([(step, value) for step, value in scores(record, self.monitor) if step > self.evaluated_step],
                   lacking)
        values, lacking = trainer.strategy.broadcast(new)
        if lacking and not values:
            message = (f"EarlyStopping(monitor={self.monitor!r}, from_evaluator=True): the evaluator's scores hold no "
                       f"such metric; they hold {lacking}. Fix the name, or pass strict=False.")
            if self.strict:
                raise MisconfigurationError(message)
            if not self._warned_missing and trainer.is_global_zero:
                self._warned_missing = True
                warnings.warn(message, stacklevel=2)
        for step, value in values:
            self.evaluated_step = step
            if self._act(trainer, *self._evaluate(value), f"the evaluator's score of step {step}"):
                return

    def _improves(self, current: float, reference: float, margin: float = 0.0) -> bool:
        return current < reference - margin if self.mode == "min" else current > reference + margin

    def _evaluate(self, current: float) -> tuple[EarlyStoppingReason, str | None]:
        """(why it stops, NOT_STOPPED where it goes on; what to print) for one new value; updates best_score and
        wait_count."""
        name, go_on, why = repr(self.monitor), EarlyStoppingReason.NOT_STOPPED, EarlyStoppingReason
        if self.check_finite and not math.isfinite(current):
            return why.NON_FINITE_METRIC, (f"{name} = {current} is not finite; the best was {self.best_score:.5g}. "
                                           "Stopping (pass check_finite=False to continue).")
        if self.stopping_threshold is not None and self._improves(current, self.stopping_threshold):
            return why.STOPPING_THRESHOLD, (f"{name} = {current:.5g} passed stopping_threshold="
                                            f"{self.stopping_threshold}. Stopping.")
        if self.divergence_threshold is not None and self._improves(self.divergence_threshold, current):
            return why.DIVERGENCE_THRESHOLD, (f"{name} = {current:.5g} is worse than divergence_threshold="
                                              f"{self.divergence_threshold}; the run diverged. Stopping.")
        if self._improves(current, self.best_score, self.min_delta):
            previous = self.best_score
            self.best_score, self.wait_count = current, 0
            if math.isfinite(previous):
                return go_on, f"{name} improved by {abs(previous - current):.5g} to {current:.5g}."
            return go_on, f"{name} = {current:.5g} is the first best."
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return why.PATIENCE_EXHAUSTED, (f"{name} did not improve by more than {self.min_delta} in the last "
                                            f"{self.wait_count} checks (best {self.best_score:.5g}). Stopping.")
        return go_on, None

    @override
    def stop_reason(self, trainer: Trainer) -> str | None:
        if self.stopping_reason_message is None:
            return None
        return f"early stopping: {self.stopping_reason_message.removesuffix(' Stopping.').rstrip('.')}"

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch, "best_score": self.best_score,
                "patience": self.patience, "evaluated_step": self.evaluated_step,
                "stopping_reason": self.stopping_reason.value, "stopping_reason_message": self.stopping_reason_message}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # patience stays as configured now: resuming with a different patience is a deliberate choice.
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_score = float(state["best_score"])
        self.evaluated_step = int(state.get("evaluated_step", -1))
        self.stopping_reason = EarlyStoppingReason(state.get("stopping_reason", 0))
        self.stopping_reason_message = state.get("stopping_reason_message")
