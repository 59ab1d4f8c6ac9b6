"""GradientAccumulationScheduler: accumulate_grad_batches that changes with the epoch, as in Lightning."""

from __future__ import annotations

from typing import TYPE_CHECKING

from typing_extensions import override

from torchyard.callbacks.base import Callback
from torchyard.trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """`scheduling` {first epoch: micro-batches per optimizer step} (epochs count from 0; before the first key: 1).
    The fit loop reads it at each epoch's start (trainer.accumulate_grad_batches)."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not isinstance(scheduling, dict) or not scheduling:
            raise MisconfigurationError("GradientAccumulationScheduler(scheduling=...) needs a non-empty dict "
                                        "{epoch: accumulate_grad_batches}, e.g. {0: 1, 4: 2}.")
        if any(not isinstance(key, int) or isinstance(key, bool) or key < 0 for key in scheduling):
            raise MisconfigurationError(f"GradientAccumulationScheduler epochs must be integers >= 0; got "
                                        f"{list(scheduling)}.")
        if any(not isinstance(value, int) or isinstance(value, bool) or value < 1 for value in scheduling.values()):
            raise MisconfigurationError(f"GradientAccumulationScheduler factors must be integers >= 1; got "
                                        f"{list(scheduling.values())}.")
        self.scheduling = {0: 1, **scheduling}
        self.epochs = sorted(self.scheduling)

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The factor in force at `epoch`."""
        return self.scheduling[max(first for first in self.epochs if first <= epoch)]

    def going_to_accumulate_grad_batches(self) -> bool:
        return any(value > 1 for value in self.scheduling.values())

    @override
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.config.accumulate_grad_batches != 1:
            raise MisconfigurationError(
                f"accumulate_grad_batches={trainer.config.accumulate_grad_batches} and a GradientAccumulationScheduler "
                "both set the accumulation; put the factor in the scheduler's scheduling ({0: n, ...}).")
        if not module.automatic_optimization and self.going_to_accumulate_grad_batches():
            raise MisconfigurationError(
                f"{type(module).__name__} sets automatic_optimization=False, so a GradientAccumulationScheduler "
                "would do nothing; accumulate in training_step (step every n batches) or remove the callback.")
