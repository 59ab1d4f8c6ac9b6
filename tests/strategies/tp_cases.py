"""The tensor-parallel cases of tests/strategies/test_tensor_parallel.py, run as one 4-process job (the test forks
its ranks with tests/processes.run_ranks; by hand, as torchrun would start them):

    RANK=r WORLD_SIZE=4 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tp_cases.py OUT_DIR [3d]

0. All 4 ranks: a 2-stage pipeline x tp=2, and fsdp as HSDP replicate=2 x tp=2; 20 AdamW steps each, clipped by
   the global norm. (A pipeline whose replicas shard each stage with fsdp is the 3-D job's case.)
1. All 4 ranks: fsdp with tensor_parallel=2 (dp=2 x tp=2) trains 20 AdamW steps, clipped by the global norm, and
   at its end writes the same state twice: a full file (`full.ckpt`) and a sharded folder (`sharded.ckpt`).
2. The job's group is left, and the ranks pair up in two jobs of 2: ranks 0-1 resume the sharded folder at
   tp=1 x dp=2, ranks 2-3 the full file at tp=2 x dp=1; each trains one epoch more.
Rank 0 of each part writes `<part>.pt`: the final weights (gathered), the callback metrics, and what each rank saw.

With `3d`, on 8 ranks: pipeline=2 x fsdp=2 x tp=2 alone for THREE_D_STEPS steps, into
`pp2_fsdp2_tp2.pt`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster.environment import ClusterEnvironment, find_free_port
from torchyard.trainer.strategies.fsdp import FSDPStrategy
from torchyard.trainer.strategies.mesh import parallelize
from torchyard.trainer.strategies.pipeline.strategy import PipelineStrategy

SEED, GLOBAL_BATCH, LR, CLIP = 3, 8, 0.02, 0.05
EPOCHS, RESUMED_EPOCHS = 2, 3  # 10 steps an epoch: 20 steps, then 10 more after the resume
THREE_D_STEPS = 4  # 8 processes on CI's two cores: a few steps show the layout trains, within the slow-test budget
QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
             logger=False, enable_checkpointing=False)


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(100)
    x = torch.randn(80, 6, generator=generator)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def loader(data_parallel: int) -> DataLoader:
    """The global batch split over the data-parallel ranks, in order (the sampler deals sample i to rank i % dp, so
    the ranks' batches together are one process's batch of GLOBAL_BATCH)."""
    return DataLoader(dataset(), batch_size=GLOBAL_BATCH // data_parallel, shuffle=False)


class MLPBlock(nn.Module):
    """A transformer block's feed-forward half: `up` splits by columns, `down` by rows under tensor parallel."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TPNet(TrainModule):
    """Two MLPBlocks between an input and an output layer; configure_model applies the blocks' plan."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), MLPBlock(8), MLPBlock(8), nn.Linear(8, 1))
        self.first_batch: float | None = None

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or mesh["tp"].size() == 1:
            return
        for block in (self.net[1], self.net[2]):
            if not isinstance(block.up.weight, DTensor):  # a later stage calls this again
                parallelize(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.first_batch is None:
            self.first_batch = float(x.sum())
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.log("samples", float(len(x)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return loss

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TPNet().state_dict()


def fresh() -> TPNet:
    module = TPNet()
    module.load_state_dict(initial_state())
    return module


class SaveBoth(Callback):
    """At the last epoch's end, the same state as a full file and as a sharded folder."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_epoch_end(self, trainer, module) -> None:
        if trainer.current_epoch != EPOCHS - 1:
            return
        trainer.save_checkpoint(self.out / "full.ckpt")
        trainer.strategy.checkpoint = "sharded"
        try:
            trainer.save_checkpoint(self.out / "sharded.ckpt")
        finally:
            trainer.strategy.checkpoint = "full"


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in module.state_dict().items()}


def fit(strategy: FSDPStrategy | PipelineStrategy, devices: int, max_epochs: int, ckpt: Path | None,
        callbacks: list[Callback], data_parallel: int, max_steps: int = -1) -> dict[str, Any]:
    module = fresh()
    trainer = Trainer(strategy=strategy, devices=devices, max_epochs=max_epochs, max_steps=max_steps, seed=SEED,
                      gradient_clip_val=CLIP, callbacks=callbacks, **QUIET)
    trainer.fit(module, loader(data_parallel), ckpt_path=ckpt)
    return {"weights": gathered(module), "global_step": trainer.global_step,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "data_parallel_size": trainer.strategy.data_parallel_size,
            "first_batches": trainer.strategy.all_gather_object(module.first_batch)}


def three_d(out: Path) -> None:
    """8 ranks: pipeline=2 x fsdp=2 x tp=2, THREE_D_STEPS steps."""
    strategy = PipelineStrategy(stages=2, microbatches=2, tensor_parallel=2, data_parallel="fsdp")
    results = fit(strategy, 8, EPOCHS, None, [], 2, max_steps=THREE_D_STEPS)
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out / "pp2_fsdp2_tp2.pt")


def main(arguments: list[str]) -> None:
    """`arguments`: OUT_DIR, then `3d` for the 3-D job."""
    torch.set_num_threads(1)
    if arguments[1:] == ["3d"]:
        return three_d(Path(arguments[0]))
    out = Path(arguments[0])
    rank = int(os.environ["RANK"])
    pipelines = {"pp2_tp2": (PipelineStrategy(stages=2, microbatches=2, tensor_parallel=2), 1),
                 "hsdp2_tp2": (FSDPStrategy(tensor_parallel=2, replicate=2), 2)}  # dp_replicate=2 x tp=2
    for name, (strategy, data_parallel) in pipelines.items():
        results = fit(strategy, 4, EPOCHS, None, [], data_parallel)
        if rank == 0:
            torch.save(results, out / f"{name}.pt")
    strategy = FSDPStrategy(tensor_parallel=2, shard_units=["MLPBlock"])
    results = fit(strategy, 4, EPOCHS, None, [SaveBoth(out)], 2)
    if rank == 0:
        torch.save(results, out / "dp2_tp2.pt")
    # Two jobs of 2 ranks each, on the checkpoints just written. Each pair's first rank picks its port now and the
    # job's group shares them: a port picked before the job started could be taken by then.
    pair, pair_rank = divmod(rank, 2)
    ports: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ports, find_free_port() if pair_rank == 0 else None)
    dist.destroy_process_group()
    environment = ClusterEnvironment("torchrun", global_rank=pair_rank, local_rank=pair_rank, world_size=2,
                                     local_world_size=2, master_port=ports[2 * pair])
    tensor_parallel, source = ((1, "sharded.ckpt"), (2, "full.ckpt"))[pair]
    strategy = FSDPStrategy(tensor_parallel=tensor_parallel, environment=environment)
    results = fit(strategy, 2, RESUMED_EPOCHS, out / source, [], 2 // tensor_parallel)
    if pair_rank == 0:
        torch.save(results, out / f"resumed_tp{tensor_parallel}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
