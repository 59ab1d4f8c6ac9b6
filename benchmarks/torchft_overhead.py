"""What torchft's live recovery costs per step without failures, against torch's DDP (issue 50's target: <= 5%).

    python benchmarks/torchft_overhead.py [--blocks 10] [--steps 20]

Needs torchft 0.2.0 (`pip install --no-deps torchft==0.2.0` and the OpenTelemetry OTLP exporter it imports); the
framework has no strategy on it yet, so this measures torchft itself, the floor of any such strategy's overhead.
Two replica groups of one CPU process each, in the same two processes as a two-rank torch DDP job: each process
trains one copy of a small MLP under torch's DDP (gloo) and another under torchft's Manager (a lighthouse
quorum and a commit vote per step, its DistributedDataParallel and OptimizerWrapper), in interleaved blocks of
`--steps` steps, so that load on the machine hits both alike. Prints each one's median step time and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchyard.trainer.cluster.environment import find_free_port

BATCH, FEATURES, HIDDEN, CLASSES = 64, 64, 256, 10


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def timed_block(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, generator: torch.Generator) -> float:
    """Seconds per step over `steps` steps, as a plain loop runs them (zero_grad, forward, backward, step)."""
    start = time.perf_counter()
    for _ in range(steps):
        x = torch.randn(BATCH, FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - start) / steps


def worker(rank: int, port: int, lighthouse: str, blocks: int, steps: int, results: dict) -> None:
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    plain = nn.parallel.DistributedDataParallel(mlp())
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)
    ft_model = mlp()
    ft_sgd = torch.optim.SGD(ft_model.parameters(), lr=0.01)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's own
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=2,
                      load_state_dict=lambda state: ft_model.load_state_dict(state),
                      state_dict=ft_model.state_dict, replica_id=f"group{rank}", lighthouse_addr=lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, hostname="127.0.0.1")
    ft_ddp, ft_optimizer = DistributedDataParallel(manager, ft_model), OptimizerWrapper(manager, ft_sgd)
    generator = torch.Generator().manual_seed(rank)
    timed_block(plain, plain_optimizer, 3, generator)  # warm-up: both paths' first steps build their state
    timed_block(ft_ddp, ft_optimizer, 3, generator)
    times: dict[str, list[float]] = {"ddp": [], "torchft": []}
    for block in range(blocks):
        order = [("ddp", plain, plain_optimizer), ("torchft", ft_ddp, ft_optimizer)]
        for name, model, optimizer in order if block % 2 == 0 else order[::-1]:
            times[name].append(timed_block(model, optimizer, steps, generator))
    if rank == 0:
        results.update(times)
    manager.shutdown()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise SystemExit("torchft is not installed: pip install --no-deps torchft==0.2.0 "
                         "opentelemetry-exporter-otlp-proto-http") from None
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    with mp.Manager() as shared:
        results = shared.dict()
        mp.spawn(worker, args=(find_free_port(), lighthouse.address(), args.blocks, args.steps, results), nprocs=2)
        times = dict(results)
    lighthouse.shutdown()
    ddp, ft = statistics.median(times["ddp"]), statistics.median(times["torchft"])
    print(f"per step, median of {args.blocks} interleaved blocks of {args.steps} steps, 2 CPU processes:")
    print(f"  torch DDP   {ddp * 1e3:8.2f} ms")
    print(f"  torchft     {ft * 1e3:8.2f} ms   ({ft / ddp:.2f}x DDP, {100 * (ft / ddp - 1):+.0f}%)")


if __name__ == "__main__":
    main()
