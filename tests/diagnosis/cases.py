"""Small jobs that go wrong on purpose, for tests/test_diagnosis.py and the output shown in docs/diagnosis.md.

    python cases.py stuck <ddp|fsdp|pipeline|ps> [timeout]    rank 1 blocks in its training_step at step 5
    python cases.py slow <ddp|...>                            rank 1 takes 30 ms longer every training_step
    python cases.py mismatch <ddp|...> [timeout]              rank 1 alone calls an extra all_reduce at step 3
    python cases.py doze <ddp|...> ROOT DOZING [seconds]      rank 1 sleeps in its training_step at step 2, then the
                                                              job goes on (`trainer doctor ROOT/default/version_0`)
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

STUCK_STEP = 5  # the optimizer step at which rank 1 blocks
DOZE_STEP = 2  # the optimizer step at which rank 1 of `doze` sleeps for a while
#: Each strategy as the cases run it (2 processes; ps: one server, two workers), and the rank that blocks.
STRATEGIES = {"ddp": ("ddp", 2), "fsdp": ("fsdp", 2), "pipeline": ({"name": "pipeline", "microbatches": 2}, 2),
              "ps": ({"name": "ps", "staleness": 0}, 3)}


def loader(samples: int = 64, batch: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch)


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StuckRank(Net):
    """Rank 1 blocks in its training_step at step 5 (a hung data read, a lock it never gets), after writing the time
    to `stuck_at` (when given)."""

    def __init__(self, stuck_at: str | None = None) -> None:
        super().__init__()
        self.stuck_at = stuck_at

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == STUCK_STEP:
            if self.stuck_at:
                Path(self.stuck_at).write_text(repr(time.time()))
            time.sleep(600)
        return super().training_step(batch, batch_idx)


class StuckStage(StuckRank):
    """Under pipeline, the last stage (rank 1) blocks in its loss at step 5: the stages run no training_step."""

    def pipeline_loss(self, output, batch):
        if self.global_rank == 1 and self.global_step == STUCK_STEP:
            if self.stuck_at:
                Path(self.stuck_at).write_text(repr(time.time()))
            time.sleep(600)
        return F.mse_loss(output, batch[1])


class DozingRank(Net):
    """Rank 1 sleeps in its training_step at step DOZE_STEP (well within the job's timeout: a slow read), after
    writing the time to `dozing`, for `seconds` or until a file `<dozing>.release` appears; then the job goes on."""

    def __init__(self, dozing: str, seconds: float) -> None:
        super().__init__()
        self.dozing, self.seconds = dozing, seconds

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == DOZE_STEP:
            Path(self.dozing).write_text(repr(time.time()))
            until, release = time.time() + self.seconds, Path(self.dozing + ".release")
            while time.time() < until and not release.exists():
                time.sleep(0.2)
        return super().training_step(batch, batch_idx)


class DozingStage(DozingRank):
    """Under pipeline, the last stage (rank 1) sleeps in its loss at step DOZE_STEP: the stages run no training_step."""

    def pipeline_loss(self, output, batch):
        if self.global_rank == 1 and self.global_step == DOZE_STEP:
            Path(self.dozing).write_text(repr(time.time()))
            time.sleep(self.seconds)
        return F.mse_loss(output, batch[1])


class SlowRank(Net):
    """Rank 1 takes 30 ms longer over every training_step (a slower GPU, a busy host, a costly batch)."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            time.sleep(0.03)
        return super().training_step(batch, batch_idx)


class ExtraCollective(Net):
    """Rank 1 alone calls an all-reduce of its own at step 3: the ranks' collectives no longer match."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            torch.distributed.all_reduce(torch.ones(3))
        return super().training_step(batch, batch_idx)


def mismatch(strategy: str, timeout: float = 20.0) -> None:
    trainer(strategy, timeout, diagnosis="debug").fit(ExtraCollective(), loader())


def trainer(strategy: str, timeout: float, **options) -> Trainer:
    spec, devices = STRATEGIES[strategy]
    options = {"logger": False, "enable_checkpointing": False, **options}
    return Trainer(strategy=spec, devices=devices, accelerator="cpu", max_epochs=1, timeout=timeout,
                   enable_progress_bar=False, enable_model_summary=False, **options)


def stuck(strategy: str, timeout: float = 4.0, stuck_at: str | None = None) -> None:
    module = (StuckStage if strategy == "pipeline" else StuckRank)(stuck_at)
    trainer(strategy, timeout).fit(module, loader())


def slow(strategy: str, root: str = "runs") -> Trainer:
    """The fit of SlowRank, sampling every step's time split (logged under `root`); the Trainer it ran."""
    fitted = trainer(strategy, 60.0, logger=True, default_root_dir=root, log_every_n_steps=1)
    fitted.fit(SlowRank(), loader())
    return fitted


def doze(strategy: str, root: str, dozing: str, seconds: float = 4.0) -> None:
    """DozingRank's fit, saving its checkpoint in its run folder `<root>/default/version_0`."""
    module = (DozingStage if strategy == "pipeline" else DozingRank)(dozing, seconds)
    trainer(strategy, 60.0, default_root_dir=root, enable_checkpointing=True).fit(module, loader(samples=32))


if __name__ == "__main__":
    case, strategy, *rest = sys.argv[1:]
    if case == "doze":
        doze(strategy, rest[0], rest[1], *map(float, rest[2:3]))
    elif case == "slow":
        slow(strategy)
    elif case == "mismatch":
        mismatch(strategy, *map(float, rest[:1]))
    else:
        stuck(strategy, *map(float, rest[:1]), *rest[1:])
