"""Trainer(strategy="ddp") against a hand-written torch DDP loop: 2 CPU processes (gloo), same work.

    python benchmarks/ddp.py [--steps 100] [--rounds 8] [--hidden 512] [--batch 64] [--lean] [--accelerator cuda]
                             [--compare-diagnosis]

The Trainer runs on its defaults (progress bar, CSV logger every 50 steps with `self.log("loss", prog_bar=True)`
every step, ModelCheckpoint, the SIGTERM/NaN agreement between ranks); the hand-written loop writes its loss to a
CSV file every 50 steps on rank 0. `--lean` turns the Trainer's bar, logger and checkpoints off (and the hand
loop's CSV). Both run in the same two processes, interleaved round by round (each goes first in every other round),
so drift in the machine's load hits both alike. A step is timed from the end of one optimizer step to the end of the
next (data loading, forward, backward, all-reduce, step and, for the Trainer, its loop, logging and
callbacks). Prints the median time per step of each, their ratio (target <= 1.02), and the scaling
efficiency: the median step time of one process (Trainer, strategy="single", same per-process batch)
divided by the 2-process Trainer's (1.0 = perfect weak scaling).

`--compare-diagnosis` also runs the Trainer with diagnosis='off' (no watchdog, no straggler sampling) in the same
rounds and prints the ratio of the default ('on') to it: what watching the ranks costs a step (target <= 1.01).

`--accelerator cuda` (two GPUs): one process per GPU over nccl; the hand-written loop is the usual GPU one
(pinned loader, `.cuda(non_blocking=True)`, DDP with device_ids). The host runs ahead of its GPU there, so a
step's end on the host says little about the device's: each run's time is its mean step over the `--steps`
steps after the warm-up, between two torch.cuda.synchronize() calls (at the warm-up's last step and at the run's
last), which both sides make.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster.environment import find_free_port

WARMUP = 5
LOG_EVERY = 50


def make_net(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def make_data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 256, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


class Classifier(TrainModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = make_net(hidden)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepClock(Callback):
    """Time stamps at the end of every training batch (after the optimizer step)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stamps: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        stamp_step(self.stamps, self.args)


def stamp() -> tuple[float, float]:
    """(wall clock, this process's CPU time): CPU time per step barely moves when other jobs load the machine."""
    return time.perf_counter(), time.process_time()


def step_times(stamps: list[tuple[float, float]], warmup: int = WARMUP) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each step after the first `warmup` ones."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]


def stamp_step(stamps: list[tuple[float, float]], args: argparse.Namespace) -> None:
    """Stamp the end of a step; on a GPU the timed window starts and ends with the device's queue empty."""
    if args.accelerator == "cuda" and len(stamps) in (WARMUP, WARMUP + args.steps):
        torch.cuda.synchronize()
    stamps.append(stamp())


def run_times(stamps: list[tuple[float, float]], args: argparse.Namespace) -> list[tuple[float, float]]:
    """The run's step times: each step after the warm-up's, or on a GPU their mean (see the module docstring)."""
    if args.accelerator == "cuda":
        (wall, cpu), (end_wall, end_cpu) = stamps[WARMUP], stamps[WARMUP + args.steps]
        return [((end_wall - wall) / args.steps, (end_cpu - cpu) / args.steps)]
    return step_times(stamps)


def hand_written(rank: int, port: int, data: TensorDataset, args: argparse.Namespace) -> list[tuple[float, float]]:
    """The textbook loop: DistributedSampler, DDP, zero_grad / forward / backward / step."""
    if dist.is_initialized():  # a torchrun-launched Trainer leaves its group up for the script, as Lightning does
        dist.destroy_process_group()
    cuda = args.accelerator == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    # The Trainer's DDP defaults to gradient_as_bucket_view=True (no gradient copy into the buckets); the
    # reference gets the same, so the ratio measures the framework's overhead, not a DDP setting.
    net = make_net(args.hidden).to(rank if cuda else "cpu")
    model = nn.parallel.DistributedDataParallel(net, device_ids=[rank] if cuda else None,
                                                gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    stamps = []
    log = open(os.path.join(tempfile.mkdtemp(), "metrics.csv"), "w") if rank == 0 and not args.lean else None
    for step, (x, y) in enumerate(DataLoader(data, batch_size=args.batch, sampler=sampler, pin_memory=cuda)):
        if step >= args.steps + WARMUP + 1:
            break
        if cuda:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if log is not None and (step + 1) % LOG_EVERY == 0:
            log.write(f"{step},{loss.item()}\n")
        stamp_step(stamps, args)
    if log is not None:
        log.close()
    del model
    dist.destroy_process_group()
    return run_times(stamps, args)


def with_trainer(data: TensorDataset, args: argparse.Namespace, strategy: str, root: str,
                 diagnosis: str = "on") -> list[tuple[float, float]]:
    clock = StepClock(args)
    torch.manual_seed(0)
    lean = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False} if args.lean else {}
    trainer = Trainer(strategy=strategy, devices=2 if strategy == "ddp" else 1, accelerator=args.accelerator,
                      max_steps=args.steps + WARMUP + 1, enable_model_summary=False, num_sanity_val_steps=0,
                      log_every_n_steps=LOG_EVERY, default_root_dir=root, callbacks=[clock], diagnosis=diagnosis,
                      **lean)
    trainer.fit(Classifier(args.hidden), DataLoader(data, batch_size=args.batch, shuffle=True))
    return run_times(clock.stamps, args)


def worker(rank: int, ports: list[int], args: argparse.Namespace, out: str) -> None:
    # Both processes look torchrun-launched to the Trainer; the hand-written loop uses its own ports.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    torch.set_num_threads(1)
    if args.accelerator == "cuda":
        torch.cuda.set_device(rank)  # nccl's collectives of the hand-written loop run on the current device
    data = make_data(2 * args.batch * (args.steps + WARMUP + 2))
    times: dict[str, list[tuple[float, float]]] = {"hand": [], "trainer": [], "no_diagnosis": []}
    names = ["hand", "trainer"] + (["no_diagnosis"] if args.compare_diagnosis else [])
    for round_index in range(args.rounds):
        # Rotate who goes first (and second, with three), so a warm cache or a load spike favours none.
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            if name == "hand":
                times["hand"] += hand_written(rank, ports[1 + round_index], data, args)
            else:
                diagnosis = "off" if name == "no_diagnosis" else "on"
                times[name] += with_trainer(data, args, "ddp", tempfile.mkdtemp(), diagnosis)
    if rank == 0:
        torch.save(times, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lean", action="store_true", help="the Trainer without bar, logger and checkpoints")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one process per GPU over nccl (needs two GPUs)")
    parser.add_argument("--compare-diagnosis", action="store_true",
                        help="also run the Trainer with diagnosis='off' in the same rounds: what watching ranks costs")
    args = parser.parse_args()
    if args.accelerator == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"ddp.py --accelerator cuda needs two GPUs; this machine has {torch.cuda.device_count()}.")
    out = Path(tempfile.mkdtemp()) / "times.pt"
    ports = [find_free_port() for _ in range(args.rounds + 1)]
    mp.spawn(worker, args=(ports, args, str(out)), nprocs=2, join=True)
    times = torch.load(out)

    torch.set_num_threads(1)
    single = with_trainer(make_data(args.batch * (args.steps + WARMUP + 2)), args, "single", tempfile.mkdtemp())
    (hand, hand_cpu), (ours, ours_cpu), (one, one_cpu) = (
        (statistics.median(w for w, _ in t) * 1e3, statistics.median(c for _, c in t) * 1e3)
        for t in (times["hand"], times["trainer"], single))
    device = f"2 x {torch.cuda.get_device_name()} (nccl)" if args.accelerator == "cuda" else "2 CPU processes (gloo)"
    print(
        f"model 256-{args.hidden}-{args.hidden}-10, batch {args.batch} per process, {args.rounds} rounds x "
        f"{args.steps} steps, {device}, torch {torch.__version__}"
    )
    print("                                      wall ms/step   CPU ms/step (rank 0)")
    print(f"hand-written DDP loop (2 processes): {hand:10.3f}    {hand_cpu:10.3f}")
    print(f"Trainer(strategy='ddp', devices=2):  {ours:10.3f}    {ours_cpu:10.3f}")
    print(f"Trainer one process (same batch):    {one:10.3f}    {one_cpu:10.3f}")
    print(f"ratio Trainer / hand-written:        {ours / hand:10.3f}    {ours_cpu / hand_cpu:10.3f}   (target <= 1.02)")
    print(f"scaling efficiency 1 -> 2 processes: {one / ours:10.3f}                (wall; 1.0 = perfect weak scaling)")
    if args.compare_diagnosis:
        off, off_cpu = (statistics.median(w for w, _ in times["no_diagnosis"]) * 1e3,
                        statistics.median(c for _, c in times["no_diagnosis"]) * 1e3)
        print(f"Trainer, diagnosis='off':            {off:10.3f}    {off_cpu:10.3f}")
        print(f"ratio diagnosis 'on' / 'off':        {ours / off:10.3f}    {ours_cpu / off_cpu:10.3f}"
              "   (target <= 1.01)")


if __name__ == "__main__":
    main()
