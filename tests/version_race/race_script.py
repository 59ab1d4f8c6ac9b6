"""A tiny fit that tests/test_runs.py starts eight times at once, all under one run name.

    python race_script.py <root> <go-file> <ready-file>

Each process imports everything, writes <ready-file>, then waits for <go-file> so that every fit asks for its
version folder at the same moment.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule

STEPS = 4


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    root, go, ready = (Path(arg) for arg in sys.argv[1:4])
    x = torch.randn(STEPS * 2, 3)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    trainer = Trainer(max_epochs=1, default_root_dir=str(root), name="race", log_every_n_steps=1,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      accelerator="cpu")
    ready.write_text("ready")
    while not go.exists():
        time.sleep(0.001)
    trainer.fit(Net(), loader)
    print(trainer.log_dir)


if __name__ == "__main__":
    main()
