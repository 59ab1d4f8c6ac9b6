"""What the ranks' SIGTERM agreement (trainer/loop/faults.py) costs the training thread of each ddp rank, per step.

    python benchmarks/agreement.py [--steps 2000]

Two gloo processes run `--steps` step boundaries, each after a small matmul standing in for a step, and time the
agreement's call at each boundary alone: wall time (mean and median) and this thread's CPU time. A hand-written DDP
loop has no such call, so these microseconds are the agreement's whole share of the ddp step's overhead; the
exchanges themselves run on a thread of their own every 0.2 s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.loop import faults
from torchyard.trainer.strategies import distributed


class CollectivesOnly:
    """What StepGuard reads of a strategy: two ranks in lockstep, and the blocking exchange it falls back on."""

    world_size, steps_in_lockstep, timeout = 2, True, 60.0
    environment = types.SimpleNamespace(launched=True)

    def max_across_ranks_async(self, values: list[float]) -> object:
        return distributed.max_across_ranks_async(values, torch.device("cpu"))

    def max_across_ranks_result(self, pending: object) -> list[float]:
        return distributed.max_across_ranks_result(pending)


def worker(rank: int, port: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    trainer = types.SimpleNamespace(config=types.SimpleNamespace(nonfinite_loss="error"), strategy=CollectivesOnly())
    a, b = torch.randn(96, 96), torch.randn(96, 96)
    walls, cpus = [], []
    with faults.StepGuard(trainer) as guard:
        dist.barrier()
        for _ in range(steps):
            for _ in range(20):
                a @ b  # the step
            wall, cpu = time.perf_counter(), time.thread_time()
            guard._settle(False)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
    if rank == 0:
        Path(out).write_text(f"{statistics.mean(walls)} {statistics.median(walls)} {statistics.mean(cpus)}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    out = str(Path(tempfile.mkdtemp()) / "agreement.txt")
    mp.spawn(worker, args=(find_free_port(), args.steps, out), nprocs=2, join=True)
    mean, median, cpu = (float(value) * 1e6 for value in Path(out).read_text().split())
    print(f"SIGTERM agreement on rank 0's training thread, per step ({args.steps} steps): wall {mean:.1f} us "
          f"(median {median:.1f} us), CPU {cpu:.1f} us")


if __name__ == "__main__":
    main()
