"""The small model and data that the tests of Lightning's behaviours share (test_lightning_*.py)."""

from __future__ import annotations

import torch
from torch import nn

from torchyard.trainer import TrainModule

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
             logger=False, accelerator="cpu", num_sanity_val_steps=0)


def batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of 4 (x, y) pairs: a plain list, which Lightning (and the Trainer) take as a loader."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(count)]


class Linear(TrainModule):
    """One linear layer with the same initial weights each time, trained by SGD on the mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
