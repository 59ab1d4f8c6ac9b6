"""LearningRateMonitor: write each optimizer group's learning rate (and momentum, weight decay) to the loggers."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from torchyard.callbacks.base import Callback
from torchyard.trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.optim import SchedulerConfig
    from torchyard.trainer.trainer import Trainer


class LearningRateMonitor(Callback):
    """Logs each optimizer's learning rate on rank 0, at the start of a step or of an epoch, under Lightning's names.

    Names: `lr-<optimizer class>` (`lr-Adam`, a second Adam `lr-Adam-1`), or the `name` of the optimizer's
    lr_scheduler dict; with several parameter groups `<name>/pg1`, `<name>/pg2` (or `<name>/<group's "name">`).
    `log_momentum` adds `<name>-momentum` (beta1 for Adam-like optimizers) and `log_weight_decay`
    `<name>-weight_decay`. `logging_interval="step"` logs every `log_every_n_steps` steps, "epoch" once per
    epoch, and None follows each optimizer's schedulers (step-interval ones per step, the others per epoch;
    an optimizer without one at both).
    A row at step s holds the rate the next optimizer step uses.
    """

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise MisconfigurationError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}) is not known; use None, 'step' or 'epoch'."
            )
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self._names: list[list[str]] = []  # per optimizer, per parameter group
        self._interval_of: list[str] = []  # per optimizer: "step" | "epoch" | "any"
        self._last_logged_step = -1

    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        # Under fast_dev_run the Trainer, not the user, turned the loggers off: the smoke test runs, logging nothing.
        if stage == "fit" and not trainer.loggers and not trainer.config.fast_dev_run:
            raise MisconfigurationError("LearningRateMonitor writes to the trainer's loggers, but the Trainer has "
                                        "none; set logger=True (or 'csv', 'tensorboard') or drop the callback.")

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._last_logged_step = -1
        self._names = group_names(trainer.optimizers, trainer.lr_scheduler_configs)
        self._interval_of = []
        for optimizer in trainer.optimizers:
            own = [c for c in trainer.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is optimizer]
            # As in Lightning, an optimizer without a scheduler (its rate changed by hand, say) is logged at both.
            follows = "step" if any(c.interval == "step" for c in own) else "epoch" if own else "any"
            self._interval_of.append(self.logging_interval or follows)

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        step = trainer.batches_stepped
        # Micro-batches of one accumulated step share a global step: log once per step.
        if step == self._last_logged_step or not trainer.logs_this_step:
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
        values: dict[str, float] = {}
        for optimizer, names, optimizer_interval in zip(trainer.optimizers, self._names, self._interval_of):
            if optimizer_interval not in (interval, "any"):
                continue
            for group, name in zip(optimizer.param_groups, names):
                values[name] = float(group["lr"]) * ratio
                if self.log_momentum:
                    momentum = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                    values[f"{name}-momentum"] = float(momentum)
                if self.log_weight_decay:
                    values[f"{name}-weight_decay"] = float(group.get("weight_decay", 0.0))
        if values:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.batches_stepped)


def group_names(optimizers: list[Optimizer], schedulers: list[SchedulerConfig]) -> list[list[str]]:
    """Lightning's names for each optimizer's parameter groups (see LearningRateMonitor)."""
    names, seen = [], Counter[type]()
    for optimizer in optimizers:
        named = [c.name for c in schedulers if c.name and getattr(c.scheduler, "optimizer", None) is optimizer]
        if named:
            base = named[0]
        else:
            kind = type(optimizer)
            base = f"lr-{kind.__name__}" + (f"-{seen[kind]}" if seen[kind] else "")
            seen[kind] += 1
        groups = optimizer.param_groups
        if len(groups) == 1:
            own = [f"{base}/{groups[0]['name']}" if groups[0].get("name") else base]
        else:
            own = [f"{base}/{group.get('name', f'pg{index + 1}')}" for index, group in enumerate(groups)]
        if len(set(own)) < len(own):
            raise MisconfigurationError(f"the parameter groups of {type(optimizer).__name__} share a 'name' "
                                        f"({own}); LearningRateMonitor needs each group's name to be its own.")
        names.append(own)
    return names
