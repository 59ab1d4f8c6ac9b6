"""LearningRateMonitor: write each optimizer group's learning rate to the loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from trainer.errors import MisconfigurationError
from trainer.optim import current_lrs

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class LearningRateMonitor(Callback):
    """Logs `lr-<optimizer index>-<group index>` on rank 0, at the start of a step or of an epoch.

    `logging_interval="step"` logs every `log_every_n_steps` optimizer steps, "epoch" once per epoch, and
    None follows each optimizer's schedulers (step-interval ones per step, the others per epoch). A row
    at step s holds the rate the next optimizer step uses.
    """

    def __init__(self, logging_interval: str | None = None) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise MisconfigurationError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}) is not known; use None, 'step' or 'epoch'."
            )
        self.logging_interval = logging_interval
        self._interval_of: dict[int, str] = {}  # optimizer index -> "step" | "epoch"
        self._last_logged_step = -1

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        # Under fast_dev_run the Trainer, not the user, turned the loggers off: the smoke test runs, logging nothing.
        if stage == "fit" and not trainer.loggers and not trainer.config.fast_dev_run:
            raise MisconfigurationError("LearningRateMonitor writes to the trainer's loggers, but the Trainer has none; "
                                        "set logger=True (or 'csv', 'tensorboard') or drop the callback.")

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._last_logged_step = -1
        self._interval_of = {}
        for index, optimizer in enumerate(trainer.optimizers):
            if self.logging_interval is not None:
                self._interval_of[index] = self.logging_interval
                continue
            stepped = any(c.interval == "step" and getattr(c.scheduler, "optimizer", None) is optimizer
                          for c in trainer.lr_scheduler_configs)
            self._interval_of[index] = "step" if stepped else "epoch"

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        step = trainer.progress.batches_stepped
        # Micro-batches of one accumulated step share a global step: log once per step.
        if step == self._last_logged_step or step % trainer.config.log_every_n_steps:
            return
        self._last_logged_step = step
        self._log(trainer, "step")

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._log(trainer, "epoch")

    def _log(self, trainer: Trainer, interval: str) -> None:
        if not trainer.is_global_zero:
            return
        # During lr_scaling's warm-up the step runs at a fraction of the group's rate: log what it uses.
        ratio = trainer.lr_scaler.warmup_ratio(trainer.global_step)
        rates = {key: lr for key, lr in current_lrs(trainer.optimizers, ratio).items()
                 if self._interval_of.get(int(key.split("-")[1])) == interval}
        if rates:
            for logger in trainer.loggers:
                logger.log_metrics(rates, step=trainer.progress.batches_stepped)
