"""The hand-written torch DDP loop the ddp tests compare against.

It imports torch only (not the trainer), so its spawned processes start quickly. Run by torchrun it is the
textbook torchrun script (tests/torchrun/unguarded_script.py trains the same run with the Trainer):

    torchrun --nproc-per-node 2 ddp_reference.py <out.pt>
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def reference_net() -> nn.Module:
    """The tests' Net without the TrainModule around it (same layers, keys without the 'net.' prefix)."""
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


#: The torchrun run: one batch per rank per epoch, so how samples are ordered within an epoch cannot matter.
TORCHRUN_RUN = dict(lr=0.1, batch=4, epochs=3, seed=0)


def reference_data(samples: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(samples, 5, generator=generator)
    return x, x.sum(1, keepdim=True)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return reference_net().state_dict()


def ddp_worker(rank: int, port: int | None, init: dict, data: tuple, lr: float, batch: int, epochs: int, seed: int,
               out: str) -> NoReturn:
    """gloo, DistributedSampler(seed) with set_epoch, SGD with momentum: the textbook DDP loop (port None: the
    rendezvous torchrun set up). It ends the process (exit_without_finalizing): call it in a worker process."""
    torch.set_num_threads(1)
    init_method = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = reference_net()
    model.load_state_dict(init)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    train = TensorDataset(*data)
    sampler = DistributedSampler(train, num_replicas=2, rank=rank, shuffle=True, seed=seed)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=batch, sampler=sampler):
            optimizer.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            optimizer.step()
    if rank == 0:
        torch.save(model.state_dict(), out)
    del ddp
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing()


def exit_without_finalizing() -> NoReturn:
    """End the process now, skipping the interpreter's finalization.

    DDP keeps the gloo group's worker threads alive to the end of the process. The collective of the last
    backward captured the backward's Python context, and the worker that frees it needs the GIL. On a loaded
    machine that worker can still be waiting for the GIL when the interpreter finalizes, and the process aborts
    ("terminate called without an active exception"; core dump: ~AsyncWork -> SafePyObject decref -> take_gil
    -> PyThread_exit_thread). That failed 3 of about 76 torchrun runs with two jobs sharing the 2 cores, after the
    weights were written, and torchrun then reports the job failed. This script has nothing left to finalize.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    ddp_worker(int(os.environ["RANK"]), None, initial_state(), reference_data(), out=sys.argv[1], **TORCHRUN_RUN)
