"""A user's training script, run for real by the tests in this folder (torchrun, srun-like, python).

    python ddp_script.py <mode> <out_dir> [devices] [num_nodes]

mode 'train': fit; under torchrun or srun also validate (a second process group in the same processes)
and write each rank's weights and val_loss to <out_dir>/rank<r>.pt; when the Trainer started the workers
itself, the calling process writes its module's weights to <out_dir>/caller.pt. mode 'fail': the same,
but rank 1 raises in its third training step. mode 'restart': checkpoints every step, and rank 1 raises in
its third step of the first attempt only (for torchrun --max-restarts).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchyard.callbacks import ModelCheckpoint
from torchyard.trainer import Trainer, TrainModule

SEED, BATCH, EPOCHS, LR = 5, 4, 2, 0.1


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(24, 3, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True) * 0.5)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return Line().state_dict()


class Line(TrainModule):
    """Defined in the script: under self-launch, the workers find it by re-importing the script."""

    def __init__(self, fail_marker: str = "") -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.fail_marker = fail_marker

    def training_step(self, batch, batch_idx):
        if self.fail_marker and self.global_rank == 1 and batch_idx == 2:
            Path(self.fail_marker).write_text(repr(time.time()))
            raise RuntimeError("rank 1 fails on purpose")
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def concatenated_reference(world_size: int = 2) -> dict[str, torch.Tensor]:
    """One process stepping on all ranks' batches at once (what DDP with a mean loss computes)."""
    module = Line()
    module.load_state_dict(initial_state())
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    train = data()
    samplers = [DistributedSampler(train, world_size, rank, shuffle=True, seed=SEED) for rank in range(world_size)]
    for epoch in range(EPOCHS):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        shards = [list(sampler) for sampler in samplers]
        for start in range(0, len(shards[0]), BATCH):
            index = torch.tensor([i for shard in shards for i in shard[start:start + BATCH]])
            optimizer.zero_grad()
            F.mse_loss(module.layer(train.tensors[0][index]), train.tensors[1][index]).backward()
            optimizer.step()
    return module.state_dict()


def main(mode: str, out: Path, devices: int, num_nodes: int) -> None:
    restart = mode == "restart"
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    module = Line(fail_marker=str(out / "raised_at") if mode == "fail" or restart and first_attempt else "")
    module.load_state_dict(initial_state())
    trainer = Trainer(strategy="ddp", devices=devices, num_nodes=num_nodes, accelerator="cpu", max_epochs=EPOCHS,
                      seed=SEED, logger=False, enable_checkpointing=restart, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(out),
                      callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)] if restart else [])
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    trainer.fit(module, loader)
    if not torch.distributed.is_initialized():  # the Trainer started the workers itself: this is the calling process
        torch.save(module.state_dict(), out / "caller.pt")
        return
    # Launched by torchrun or srun: the process group outlives fit, for the script's own collectives and a
    # second stage in the same processes.
    ranks = torch.tensor([float(trainer.global_rank)])
    torch.distributed.all_reduce(ranks)
    result = trainer.validate(module, DataLoader(data(), batch_size=BATCH))
    torch.save({"state_dict": module.state_dict(), "val_loss": result[0]["val_loss"], "rank_sum": ranks.item()},
               out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2,
         int(sys.argv[4]) if len(sys.argv) > 4 else 1)
