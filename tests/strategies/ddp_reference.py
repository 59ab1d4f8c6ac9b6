"""The hand-written torch DDP loop the ddp tests compare against.

It imports torch only (not the trainer), so its spawned processes start quickly.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def reference_net() -> nn.Module:
    """The tests' Net without the TrainModule around it (same layers, keys without the 'net.' prefix)."""
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def ddp_worker(rank: int, port: int, init: dict, data: tuple, lr: float, batch: int, epochs: int, seed: int,
               out: str) -> None:
    """gloo, DistributedSampler(seed) with set_epoch, SGD with momentum: the textbook DDP loop."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
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
    dist.destroy_process_group()
