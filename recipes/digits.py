"""A small CNN on scikit-learn's handwritten digits: 1797 8x8 images, nothing to download.

    trainer fit recipes/digits.yaml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from torchyard.recipes import check_loader_args, check_optimizer_args
from torchyard.trainer import DataModule, TrainModule
from torchyard.trainer.errors import MisconfigurationError


class DigitsCNN(TrainModule):
    """Two 3x3 convolutions, one pooling, two linear layers: about 70k parameters."""

    def __init__(self, channels: int = 32, hidden: int = 128, dropout: float = 0.25, lr: float = 2e-3,
                 weight_decay: float = 1e-4) -> None:
        super().__init__()
        check_optimizer_args(type(self).__name__, lr, weight_decay)
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout),
            nn.Linear(2 * channels * 16, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val/loss", F.cross_entropy(logits, labels), prog_bar=True)
        # `update`, not a call: the epoch's accuracy is all that is logged, so no per-batch value is computed.
        self.val_acc.update(logits, labels)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("test/loss", F.cross_entropy(logits, labels))
        self.test_acc.update(logits, labels)
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class DigitsData(DataModule):
    """The digits as in-memory tensors, split by a fixed seed into train, validation (val_fraction) and a held-out
    test set (test_fraction) that neither training nor validation sees; predict uses the validation set."""

    def __init__(self, batch_size: int = 64, num_workers: int = 0, val_fraction: float = 0.2,
                 test_fraction: float = 0.1, split_seed: int = 0) -> None:
        super().__init__()
        check_loader_args(type(self).__name__, batch_size, num_workers)
        if not (val_fraction > 0 and test_fraction > 0 and val_fraction + test_fraction < 1):
            raise MisconfigurationError(f"{type(self).__name__}: val_fraction={val_fraction} and test_fraction="
                                        f"{test_fraction} must be positive and leave images to train on "
                                        "(data.init_args in a recipe).")
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        try:
            from sklearn.datasets import load_digits  # scikit-learn ships the images: nothing to download
        except ImportError:
            raise MisconfigurationError(
                "the digits recipes need scikit-learn, which ships their images: pip install 'torchyard[recipes]'."
            ) from None

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
        labels = torch.tensor(digits.target, dtype=torch.long)
        # A fixed permutation, independent of the trainer's seed: every run validates and tests on the same images.
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.hparams.split_seed))
        num_val, num_test = (round(len(labels) * fraction) for fraction in (self.hparams.val_fraction,
                                                                             self.hparams.test_fraction))
        val, test, train = order.split([num_val, num_test, len(order) - num_val - num_test])
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])
        self.test_set = TensorDataset(images[test], labels[test])

    def _loader(self, dataset: TensorDataset | None, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=shuffle,
                          num_workers=self.hparams.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)
