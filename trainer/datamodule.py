"""DataModule: the user's datasets and their loaders, Lightning-compatible by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.module import BatchTransferHooks, HyperparametersMixin

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer


class DataModule(HyperparametersMixin, BatchTransferHooks):
    """Owns the datasets and their loaders. `prepare_data` runs once per node; `setup` on every process.
    `self.trainer` is the Trainer running it (as in Lightning), from before `setup` on; None before."""

    trainer: Trainer | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The trainer travels separately to spawned workers, as for the module.
        return {**self.__dict__, "trainer": None}

    def prepare_data(self) -> None:
        """Download or write files; runs on local rank 0 only, before any `setup`."""

    def setup(self, stage: str) -> None:
        """Build datasets for `stage` ('fit', 'validate', 'test' or 'predict') on every process."""

    def teardown(self, stage: str) -> None:
        """Release what `setup` built."""

    def train_dataloader(self) -> DataLoader:
        raise MisconfigurationError(f"{type(self).__name__} has no train_dataloader(); fit needs one.")

    def val_dataloader(self) -> DataLoader | list[DataLoader] | None:
        return None

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        raise MisconfigurationError(f"{type(self).__name__} has no test_dataloader(); test needs one.")

    def predict_dataloader(self) -> DataLoader | list[DataLoader]:
        raise MisconfigurationError(f"{type(self).__name__} has no predict_dataloader(); predict needs one.")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
