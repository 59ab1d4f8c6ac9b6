"""BasePredictionWriter: write predictions where they are made, batch by batch or once per predict run.

Under data parallelism each rank writes its own share (name the files by `trainer.global_rank`), with the
dataset index of every sample it predicted, so nothing is gathered into one process's memory; pair it with
`trainer.predict(..., return_predictions=False)` to keep none there either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchyard.callbacks.base import Callback
from torchyard.trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer

WRITE_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Lightning's prediction writer: subclass it and implement `write_on_batch_end` (write_interval "batch"),
    `write_on_epoch_end` ("epoch") or both ("batch_and_epoch").

    `batch_indices` are the dataset indices of a batch's samples, as this rank's sampler drew them; None where
    the trainer cannot know them (an IterableDataset, a DataLoader subclass, a loader without a batch sampler).
    With `limit_predict_batches` under data parallelism each rank runs whole batches of its own slice, so what
    is written may hold a few samples past one process's limit (the returned predictions are cut to it).
    """

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in WRITE_INTERVALS:
            raise MisconfigurationError(
                f"{type(self).__name__}(write_interval={write_interval!r}) is not known; "
                f"use one of {', '.join(WRITE_INTERVALS)}.")
        self.write_interval = write_interval
        self._predictions: dict[int, list[Any]] = {}  # per dataloader_idx, kept for write_on_epoch_end
        self._batch_indices: dict[int, list[list[int] | None]] = {}

    def write_on_batch_end(self, trainer: Trainer, module: TrainModule, prediction: Any,
                           batch_indices: list[int] | None, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        """Write one batch's prediction."""
        raise NotImplementedError(
            f"{type(self).__name__}(write_interval={self.write_interval!r}) must implement write_on_batch_end.")

    def write_on_epoch_end(self, trainer: Trainer, module: TrainModule, predictions: list[Any],
                           batch_indices: list[list[list[int] | None]]) -> None:
        """Write this rank's predictions of the whole run: a list of batch outputs (a list of those per loader
        when there are several); `batch_indices` holds each loader's list of batch indices."""
        raise NotImplementedError(
            f"{type(self).__name__}(write_interval={self.write_interval!r}) must implement write_on_epoch_end.")

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._predictions, self._batch_indices = {}, {}

    def on_predict_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        indices = trainer.predict_batch_indices
        if self.write_interval != "epoch":
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, dataloader_idx)
        if self.write_interval != "batch":
            self._predictions.setdefault(dataloader_idx, []).append(outputs)
            self._batch_indices.setdefault(dataloader_idx, []).append(indices)

    def on_predict_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.write_interval == "batch":
            return
        loaders = range(len(trainer.predict_dataloaders))
        predictions = [self._predictions.get(index, []) for index in loaders]
        batch_indices = [self._batch_indices.get(index, []) for index in loaders]
        self._predictions, self._batch_indices = {}, {}
        self.write_on_epoch_end(trainer, module, predictions[0] if len(predictions) == 1 else predictions,
                                batch_indices)
