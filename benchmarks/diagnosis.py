"""What diagnosis='on' adds to each training step, measured on its own (the interleaved whole-step comparison is
`benchmarks/ddp.py --compare-diagnosis`, whose ratio a busy machine blurs by more than this cost):

    python benchmarks/diagnosis.py [--steps 200000]

Per step the Trainer then runs StragglerWatch's four hooks on a step it does not sample (a clock read each, and the
loop's calls of them) and the marker's enter/leave around backward. Every log_every_n_steps steps (50 by default)
one step is sampled: four more clock reads and a gather of four numbers per rank, started then and read at the
next sampled step; what the training thread spends on it is timed here on 2 gloo processes.
The watchdog thread wakes every timeout/8 seconds (225 s at the default timeout) and touches nothing then.
Prints microseconds per step and their share of the hand-written DDP step of benchmarks/ddp.py (its figure, given
with --step-ms).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.diagnosis.markers import Marker
from torchyard.trainer.diagnosis.stragglers import StragglerWatch


def per_step_us(steps: int) -> float:
    """The hooks of an unsampled step and the marker's enter/leave, as the loop calls them."""
    watch, marker = StragglerWatch(every_n_steps=10**9), Marker()
    trainer = SimpleNamespace(global_step=1, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    loss = torch.zeros(())
    start = time.perf_counter()
    for _ in range(steps):
        watch.on_train_batch_start(trainer, None, None, 0)
        watch.on_before_backward(trainer, None, loss)
        marker.enter("all_reduce", "gradients")
        marker.leave()
        watch.on_after_backward(trainer, None)
        watch.on_train_batch_end(trainer, None, None, None, 0)
    return (time.perf_counter() - start) / steps * 1e6


def gather_us(rank: int, port: int, rounds: int, out: str) -> None:
    """What the training thread spends on one sampled step's gather: starting the MAX all-reduce of 4 numbers per
    rank, and reading it a few steps' time later (5 ms here), as StragglerWatch does."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    spent = 0.0
    for round_index in range(rounds + 20):
        start = time.perf_counter()
        values = torch.zeros(8, dtype=torch.float64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True)
        issued = time.perf_counter() - start
        time.sleep(0.005)
        start = time.perf_counter()
        work.wait()
        values.tolist()
        if round_index >= 20:
            spent += issued + time.perf_counter() - start
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(spent / rounds * 1e6))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--every", type=int, default=50, help="log_every_n_steps: one sampled step in so many")
    parser.add_argument("--step-ms", type=float, default=7.3, help="a ddp step (benchmarks/ddp.py's hand loop)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hooks = min(per_step_us(args.steps) for _ in range(3))
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"diagnosis_gather_{os.getpid()}.txt")
    mp.spawn(gather_us, args=(find_free_port(), 300, out), nprocs=2, join=True)
    with open(out) as f:
        gather = float(f.read())
    total = hooks + gather / args.every
    print(f"hooks and marker of an unsampled step: {hooks:8.2f} us")
    print(f"gather of a sampled step, started and read (2 gloo processes): {gather:8.1f} us, once in {args.every} "
          "steps")
    print(f"per step on average: {total:8.2f} us = {total / (args.step_ms * 1e3):.3%} of a {args.step_ms:g} ms ddp step"
          " (target <= 1%)")


if __name__ == "__main__":
    main()
