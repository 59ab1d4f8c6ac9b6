"""strategy="pipeline" against a hand-written torch.distributed.pipelining loop, schedule by schedule.

Both sides train the same MLP stack (embed, blocks, head), cut at the same places into the same stages,
with the same torch schedule and micro-batch count, on the same in-memory data read through a
DataLoader(shuffle=True), with plain SGD. The hand loop is what a user of torch.distributed.pipelining
writes: PipelineStage per local chunk, the schedule class, `schedule.step(x, target=y)` on the first/last
stage, `optimizer.step()`, and the mean loss sent from the last stage to rank 0 to be reported there. The
Trainer runs quiet (no progress bar, summary, logger or checkpoints): what is measured is the strategy
and the loop, not file writing.

Without the loss broadcast the hand loop was measured about 2x SLOWER than the Trainer on a 2-core machine
shared with other work (ranks that do not meet at the end of a step wake each other at worse moments); the
broadcast is what a real loop does to print its loss, and it makes the two sides do the same work.

Method: one set of worker processes (one per pipeline stage, gloo on CPU) shares one process group (the
Trainer adopts an existing group and leaves it alone). For every schedule, hand and Trainer runs alternate
`--repeats` times; each run times the interval between consecutive step ends on rank 0 (the hand loop
right after optimizer.step, the Trainer in on_train_batch_end), drops the first `--warmup` steps (shape
inference, first p2p connections), and keeps the median; the ratio is the median over repeats of
trainer / hand for the two runs of a repeat (adjacent in time, so they share the machine's load). Also
compared: CPU seconds per step (time.process_time) summed over the ranks, which other processes on a
shared machine do not inflate the way they inflate wall time.

Bubble: after the runs each rank times its own share of one step with no pipeline around it (forward and
backward of every local chunk over every micro-batch, `--busy-reps` times, median) = busy. Measured idle
fraction = 1 - busy / step time, averaged over ranks. Theory for p stages and m micro-batches:
(p-1)/(m+p-1) for GPipe and 1F1B; with v chunks per rank, interleaved schedules shrink it to
(p-1)/(v*m+p-1); zero-bubble schedules fill it with weight-gradient work. On a machine with fewer cores
than stages x threads, "idle" also counts waiting for a core.

Run: python benchmarks/pipeline.py [--stages 2] [--microbatches 8] [--steps 24] [--repeats 3]
     [--schedules gpipe,1f1b,...] [--threads 1] [--width 1024] [--blocks 6] [--batch 256]
Needs stages x threads free cores for meaningful wall times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
               "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble",
               "dualpipev": "DualPipeV"}
CLASSES = 16


def chunks_per_rank(schedule: str) -> int:
    return 1 if schedule in ("gpipe", "1f1b") else 2


def placement(rank: int, stages: int, per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SCHEDULES:
        return [rank, 2 * stages - 1 - rank]
    return [rank + k * stages for k in range(per_rank)]


def unit_groups(num_units: int, chunks: int) -> list[range]:
    """Consecutive, near-equal groups of unit indices."""
    bounds = [round(i * num_units / chunks) for i in range(chunks + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def build_model(args: argparse.Namespace) -> Any:
    from torchyard.trainer import TrainModule

    class StackNet(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.blocks)
            )
            self.head = nn.Linear(args.width, CLASSES)

        def units(self) -> list[tuple[str, nn.Module]]:
            return [
                ("embed", self.embed),
                *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)),
                ("head", self.head),
            ]

        def pipeline_loss(self, output, batch):
            return F.cross_entropy(output, batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    return StackNet()


def loader(args: argparse.Namespace) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    samples = args.batch * (args.steps + args.warmup)
    data = TensorDataset(torch.randn(samples, args.width, generator=generator),
                         torch.randint(0, CLASSES, (samples,), generator=generator))
    return DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)


def hand_run(args: argparse.Namespace, schedule: str) -> list[tuple[float, float]]:
    """The hand-written torch.distributed.pipelining loop; step-end timestamps."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    rank, stages, per_rank = dist.get_rank(), args.stages, chunks_per_rank(schedule)
    model, total = build_model(args), args.stages * per_rank
    units = model.units()
    groups = unit_groups(len(units), total)
    local = placement(rank, stages, per_rank, schedule)
    chunks = {i: nn.Sequential(*(units[u][1] for u in groups[i])) for i in local}
    pipeline_stages = [PipelineStage(chunks[i], i, total, torch.device("cpu")) for i in local]
    cls = get_schedule_class(TORCH_NAMES[schedule])
    runner = cls(pipeline_stages[0] if issubclass(cls, PipelineScheduleSingle) else pipeline_stages,
                 args.microbatches, loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD([p for c in chunks.values() for p in c.parameters()], lr=0.01)
    first, last = 0 in local, total - 1 in local
    last_rank = next(r for r in range(stages) if total - 1 in placement(r, stages, per_rank, schedule))
    stamps = [(time.perf_counter(), time.process_time())]
    for x, y in loader(args):
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        runner.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        optimizer.step()
        # Rank 0 reports the loss, which only the last stage has (the Trainer does the same for its logs).
        loss = torch.stack(losses).mean() if last else torch.zeros(())
        dist.broadcast(loss, src=last_rank)
        stamps.append((time.perf_counter(), time.process_time()))
    return stamps


def trainer_run(args: argparse.Namespace, schedule: str) -> list[tuple[float, float]]:
    """The Trainer with strategy=PipelineStrategy cut at the same places; step-end timestamps."""
    from torchyard.callbacks import Callback
    from torchyard.trainer import Trainer
    from torchyard.trainer.strategies.pipeline.strategy import PipelineStrategy

    class Stamp(Callback):
        def __init__(self) -> None:
            self.stamps: list[tuple[float, float]] = []

        def on_train_start(self, trainer, module):
            self.stamps.append((time.perf_counter(), time.process_time()))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.stamps.append((time.perf_counter(), time.process_time()))

    per_rank = chunks_per_rank(schedule)
    model = build_model(args)
    units = model.units()
    split_points = [units[group.start][0] for group in unit_groups(len(units), args.stages * per_rank)[1:]]
    stamp = Stamp()
    strategy = PipelineStrategy(stages=args.stages, microbatches=args.microbatches, schedule=schedule,
                                split_points=split_points, stages_per_rank=per_rank)
    trainer = Trainer(strategy=strategy, devices=args.stages, accelerator="cpu", max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=[stamp])
    trainer.fit(model, loader(args))
    return stamp.stamps


def busy_time(args: argparse.Namespace, schedule: str) -> float:
    """This rank's compute for one step with no pipeline around it: forward + backward of its chunks."""
    per_rank, total = chunks_per_rank(schedule), args.stages * chunks_per_rank(schedule)
    units = build_model(args).units()
    groups = unit_groups(len(units), total)
    micro = args.batch // args.microbatches
    x, y = torch.randn(micro, args.width), torch.randint(0, CLASSES, (micro,))
    times = []
    for _ in range(args.busy_reps):
        start = time.perf_counter()
        for index in placement(dist.get_rank(), args.stages, per_rank, schedule):
            chunk = nn.Sequential(*(units[u][1] for u in groups[index]))
            for _ in range(args.microbatches):
                inputs = x.clone().requires_grad_(index > 0)
                out = chunk(inputs)
                loss = F.cross_entropy(out, y) if index == total - 1 else out.square().mean()
                loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_step(stamps: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds between consecutive step ends, after the warm-up steps."""
    pairs = list(zip(stamps, stamps[1:]))[warmup:]
    return statistics.median(b[0] - a[0] for a, b in pairs), statistics.median(b[1] - a[1] for a, b in pairs)


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.stages), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(args.stages), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages, init_method=f"tcp://127.0.0.1:{port}")
    rows = []
    for schedule in args.schedules:
        hand, ours = [], []
        for _ in range(args.repeats):
            dist.barrier()
            hand.append(median_step(hand_run(args, schedule), args.warmup))
            dist.barrier()
            ours.append(median_step(trainer_run(args, schedule), args.warmup))
        dist.barrier()
        busy = busy_time(args, schedule)
        wall_hand, wall_ours = (statistics.median(run[0] for run in runs) for runs in (hand, ours))
        cpu_hand, cpu_ours = (statistics.median(run[1] for run in runs) for runs in (hand, ours))
        # Runs side by side in time share the machine's load: compare them in pairs.
        paired = statistics.median(o[0] / h[0] for h, o in zip(hand, ours))
        # Per rank: idle fractions; summed over ranks: CPU seconds per step (the framework's own work).
        totals = torch.tensor([1 - busy / wall_hand, 1 - busy / wall_ours, cpu_hand, cpu_ours], dtype=torch.float64)
        dist.all_reduce(totals)
        idle_hand, idle_ours = float(totals[0]) / args.stages, float(totals[1]) / args.stages
        rows.append((schedule, wall_hand, wall_ours, paired, idle_hand, idle_ours, float(totals[3] / totals[2])))
    if rank == 0:
        report(args, rows)
    dist.destroy_process_group()


def report(args: argparse.Namespace, rows: list[tuple[str, float, float, float, float, float, float]]) -> None:
    p, m = args.stages, args.microbatches
    print(f"\n{p} stages (processes), {m} micro-batches of {args.batch // m}, width {args.width}, "
          f"{args.blocks + 2} layers, {args.threads} thread(s) each, torch {torch.__version__}")
    print(f"{'schedule':<24}{'hand ms/step':>13}{'trainer ms/step':>16}{'ratio':>7}{'cpu ratio':>10}"
          f"{'idle hand':>11}{'idle trainer':>13}{'theory':>8}")
    for schedule, hand, ours, ratio, idle_hand, idle_ours, cpu_ratio in rows:
        v = chunks_per_rank(schedule)
        theory = (p - 1) / (m + p - 1) if v == 1 else (p - 1) / (v * m + p - 1)
        print(f"{schedule:<24}{hand * 1e3:>13.1f}{ours * 1e3:>16.1f}{ratio:>7.3f}{cpu_ratio:>10.3f}"
              f"{idle_hand:>11.1%}{idle_ours:>13.1%}{theory:>8.1%}")
    print(
        "ratio: trainer / hand wall time per step, median over the adjacent run pairs; target <= 1.05. cpu ratio: CPU "
        "seconds per step summed "
        "over the ranks (insensitive to other processes on the machine).\ntheory: (p-1)/(m+p-1) for gpipe/1f1b; "
        "(p-1)/(v*m+p-1) with v=2 chunks per rank for the others (zero-bubble schedules aim below it)."
    )


def main() -> None:
    from torchyard.trainer.cluster.environment import find_free_port
    from torchyard.trainer.strategies.pipeline.split import available_schedules

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy-reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--schedules", default=",".join(TORCH_NAMES))
    args = parser.parse_args()
    args.schedules = [s for s in args.schedules.split(",") if s in available_schedules()]
    port = find_free_port()
    mp.start_processes(worker, args=(args, port), nprocs=args.stages, start_method="spawn")


if __name__ == "__main__":
    main()
