"""Per-step overhead of Trainer (on its defaults) against a hand-written PyTorch loop doing the same work.

Both sides train the same MLP (one module class, as in Lightning's own parity benchmark: the hand-written
loop calls it as the plain nn.Module it is, the Trainer through its training_step, so both run the same
forward code, attribute lookups included) on the same in-memory tensors through a DataLoader(shuffle=True)
for the same number of optimizer steps, save a checkpoint at every epoch end (written to a temporary file,
fsynced and renamed, the guarantee our checkpoint format gives) and record the loss every 50 steps
(the hand loop into a CSV file, with `.item()`). The Trainer runs on its defaults: rich progress bar,
model summary, ModelCheckpoint, CSV logger, and the module calls `self.log("loss", loss, prog_bar=True)`
every step. The default ModelCheckpoint writes one file per epoch (`epoch=N-step=M.ckpt`) and gives it
a second name, `last.ckpt` (a hard link), so both sides write one checkpoint per epoch.

Method: a timestamp is taken as each training step starts its forward pass: first thing in the module's
`training_step` for the Trainer, and at the same point (batch in hand) in the hand loop; so no measuring
callback runs per step on the Trainer's side, whose whole step cycle (batch fetch, hooks, optimizer, logging)
lies between two stamps. One more at the start and one at the end of the training phase (the module's
`on_train_start` / `on_train_end`).
  steady   = median interval between consecutive step starts inside an epoch; the median, not the mean,
             so that the moments another process holds the CPU do not count;
  epoch    = median over epochs of the extra time at the epoch boundary (epoch-end validation is off;
             this is checkpointing, epoch metrics, the next loader iterator), up to the start of the next
             epoch's second step (the Trainer's first step waits there for its checkpoint's rename), spread
             over its steps;
  per step = steady + epoch / steps per epoch.
Each timestamp reads two clocks: wall time (perf_counter) and this thread's CPU time (thread_time;
with one intra-op thread all the work runs on it). On a quiet machine they agree; on a shared one the
wall clock also counts the time other processes held the CPU, so there the CPU-time ratio is the one
to read. One-off setup (strategy, loaders, model summary; whole `fit` minus the training phase, wall
time) is printed separately. Runs alternate hand/Trainer several times so that drifts in machine speed
hit both; the medians over runs are compared, and so are the two runs of each repeat (the median of
their ratios).

Interleaved blocks (the steady figure): on a shared machine the speed drifts by tens of percent within
a second, so runs a second apart are not comparable. So a last measurement interleaves in blocks: the
module's training_step, where it takes its timestamp, runs `--block` hand-written steps (their own model
copy, loader and optimizer) after every `--block` Trainer steps; no callback of the benchmark's runs per
step, so the Trainer's side takes its default per-step path. Within a block each side runs in its own
steady state, with its own code and data in the caches; the first step after a switch is left out on
both sides. The medians of the two
sides' steps give the steady ratio, and adding each side's epoch boundary (from the separate runs) gives
the per-step ratio that the target is about. The method has a bias of its own, so it is also run with a
hand-written loop in the Trainer's place (an A/A run: the same step on both sides, measured the same
way); it is printed, and the ratio divided by it is shown too. `--block 1` pairs single steps (the
caches then hold the other side's code at every step, the least favourable case for the Trainer).

Framework floor: the same comparison with a step that does almost nothing (one scalar weight), many
short runs, the minimum over runs of each side's median step: the per-step cost the Trainer adds in
microseconds, with as little of the machine's noise as a shared machine allows.

Loop only (`--loop-only`): the interleaved measurement again, of a module whose training_step is the hand-written
step itself (manual optimization, its own optimizer, nothing logged; no bar, logger or checkpoints). Its ratio
is what the Trainer's step (hooks, logging, the loss check, the optimizer path) does not account for: the loop
around the step, a module whose layers are reached through nn.Module attributes, and whatever else differs
between the two sides (where their tensors lie in memory, say).

One intra-op thread by default: a second one only adds noise on a shared machine, and the overhead
measured is the framework's Python work, not the kernels.

Also prints the wall time of `python -c "from torchyard.trainer import Trainer"` next to `python -c "import torch"`.

`--valgrind` prints instead what the two sides execute per step under valgrind's cachegrind: instructions,
simulated cache misses and mispredicted branches, and KCachegrind's rough cycle estimate from them. Those
counts are deterministic (thread pools and hash seeds pinned), so they show the framework's own work
exactly where the timings above cannot.

Run: python benchmarks/overhead.py [--valgrind] [--loop-only] [--repeats 7] [--epochs 3] [--steps-per-epoch 400]
     [--block 20] [--threads 1] [--floor-runs 15]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule

FEATURES, HIDDEN, CLASSES, BATCH = 128, 256, 10, 64
LOG_EVERY = 50


def build_net() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def synthetic_data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=generator)
    return TensorDataset(x, torch.randint(0, CLASSES, (samples,), generator=generator))


CLOCKS = ("wall", "cpu")


def now() -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds)."""
    return time.perf_counter(), time.thread_time()


@dataclass
class Timing:
    """Timestamps of one run: start of training, each step start (grouped per epoch), end of training."""

    start: tuple[float, float]
    epochs: list[list[tuple[float, float]]]
    end: tuple[float, float]
    whole: float  # the whole run, setup included (wall)

    @property
    def steps(self) -> int:
        return sum(len(epoch) for epoch in self.epochs)

    def steady_step(self, clock: int) -> float:
        return statistics.median(b[clock] - a[clock] for epoch in self.epochs for a, b in zip(epoch, epoch[1:]))

    def epoch_extra(self, clock: int) -> float:
        """Median time an epoch boundary adds beyond the steady steps it contains: from the previous epoch's last
        step start (the training start, for the first epoch) to the start of this epoch's second step, so that
        what the boundary leaves to the next step (the Trainer's wait for its checkpoint's rename) counts too; the
        last epoch's also holds its last step and the end of training."""
        steady = self.steady_step(clock)
        extras = [self.epochs[0][1][clock] - self.start[clock] - steady]
        for previous, epoch in zip(self.epochs, self.epochs[1:]):
            # A step, the epoch's end, the next's start and its first step.
            extras.append(epoch[1][clock] - previous[-1][clock] - 2 * steady)
        extras[-1] += self.end[clock] - self.epochs[-1][-1][clock] - steady
        return statistics.median(extras)

    def per_step(self, clock: int) -> float:
        return self.steady_step(clock) + self.epoch_extra(clock) * len(self.epochs) / self.steps

    def setup(self) -> float:
        return self.whole - (self.end[0] - self.start[0])


class StepStamps:
    """Timestamps of one run, taken by the module itself (see "Method"): no callback runs per step."""

    def __init__(self) -> None:
        self.epochs: list[list[tuple[float, float]]] = []
        self.start = self.end = (0.0, 0.0)

    def step(self, batch_idx: int) -> None:
        if batch_idx == 0:
            self.epochs.append([])
        self.epochs[-1].append(now())


class Stamped(TrainModule):
    """Stamps each step's start (its training_step calls `self.stamps.step`) and the training phase's start and end."""

    def __init__(self, stamps: StepStamps | None = None) -> None:
        super().__init__()
        self.stamps = StepStamps() if stamps is None else stamps

    def on_train_start(self) -> None:
        self.stamps.start = now()

    def on_train_end(self) -> None:
        finish_checkpoints(self)
        self.stamps.end = now()


def finish_checkpoints(module: TrainModule) -> None:
    """Wait for the checkpoint work the Trainer finishes off its training thread (its fsyncs and renames), which
    counts in its time: the last epoch's has no next step to wait for it. Commits before it have none."""
    finish = getattr(module.trainer.strategy, "finish_checkpoints", None)
    if finish is not None:
        finish()


class MLP(Stamped):
    """The model both sides train: the hand-written loop calls it as the nn.Module it is (`model(x)`), the
    Trainer through training_step (`self(x)`), so the two run the same forward code."""

    def __init__(self, stamps: StepStamps | None = None) -> None:
        super().__init__(stamps)
        self.net = build_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.stamps.step(batch_idx)
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def hand_parts(data: TensorDataset) -> tuple[MLP, torch.optim.Optimizer, DataLoader]:
    """A hand-written side's model, optimizer and shuffled loader, seeded like the Trainer's module."""
    torch.manual_seed(0)
    model = MLP()
    return (
        model,
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        DataLoader(data, batch_size=BATCH, shuffle=True),
    )


def save_atomically(state: dict, path: Path) -> None:
    """torch.save to a temporary file, fsynced, then renamed over `path`: the checkpoint is whole or absent."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def hand_written(data: TensorDataset, epochs: int, folder: Path) -> Timing:
    begin = time.perf_counter()
    model, optimizer, loader = hand_parts(data)
    folder.mkdir(parents=True, exist_ok=True)
    steps, stamps = 0, StepStamps()
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss"])
        stamps.start = now()
        for epoch in range(epochs):
            model.train()
            for batch_idx, (x, y) in enumerate(loader):
                stamps.step(batch_idx)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
                if steps % LOG_EVERY == 0:
                    writer.writerow([steps, loss.item()])
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            save_atomically(state, folder / "last.ckpt")  # atomic and durable, like ours
        stamps.end = now()
    return Timing(stamps.start, stamps.epochs, stamps.end, time.perf_counter() - begin)


def with_trainer(data: TensorDataset, epochs: int, folder: Path) -> Timing:
    begin = time.perf_counter()
    torch.manual_seed(0)
    module = MLP()
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(folder), accelerator="cpu", log_every_n_steps=LOG_EVERY)
    trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=True))
    stamps = module.stamps
    return Timing(stamps.start, stamps.epochs, stamps.end, time.perf_counter() - begin)


class InterleavedHandSteps(StepStamps):
    """After every `block` Trainer steps, runs and times `block` hand-written steps (see "Interleaved blocks").

    It takes StepStamps' place in a module, whose training_step calls `step` first thing: so the Trainer's
    side runs its default per-step path, with no callback of ours in it."""

    def __init__(self, data: TensorDataset, block: int) -> None:
        super().__init__()
        self.model, self.optimizer, self.loader = hand_parts(data)
        self.batches = iter(self.loader)
        self.block, self.count, self.hand_steps = block, 0, 0
        self.hand: list[tuple[float, float]] = []
        self.trainer: list[tuple[float, float]] = []
        self.previous: tuple[float, float] | None = None
        self.device: torch.device | None = None  # where the hand-written steps move their batches (overhead_cuda.py)

    def step(self, batch_idx: int) -> None:
        stamp = now()
        if batch_idx == 0:
            self.previous = None  # the epoch boundary is not a steady step
        if self.previous is not None:
            self.trainer.append((stamp[0] - self.previous[0], stamp[1] - self.previous[1]))
        self.previous, self.count = stamp, self.count + 1
        if self.count % self.block:
            return
        for step in range(self.block):
            batch = next(self.batches, None)
            if batch is None:
                self.batches = iter(self.loader)
                batch = next(self.batches)
            x, y = batch
            if self.device is not None:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.hand_steps += 1
            if self.hand_steps % LOG_EVERY == 0:
                loss.item()
            end = now()
            if step > 0 or self.block == 1:  # a block's first step starts after the other side's code
                self.hand.append((end[0] - stamp[0], end[1] - stamp[1]))
            stamp = end
        # The Trainer's step that goes on from here runs after the hand-written code: counted only when pairing
        # single steps.
        self.previous = stamp if self.block == 1 else None

    def ratios(self) -> tuple[float, ...]:
        return tuple(statistics.median(t[clock] for t in self.trainer) / statistics.median(h[clock] for h in self.hand)
                     for clock in range(len(CLOCKS)))


def interleaved_blocks(data: TensorDataset, epochs: int, block: int, folder: Path) -> InterleavedHandSteps:
    interleaved = InterleavedHandSteps(data, block)
    trainer = Trainer(max_epochs=epochs, default_root_dir=str(folder), accelerator="cpu", log_every_n_steps=LOG_EVERY)
    trainer.fit(MLP(interleaved), DataLoader(data, batch_size=BATCH, shuffle=True))
    return interleaved


class HandStepInLoop(MLP):
    """The hand-written step itself, run by the Trainer's loop (manual optimization, its own optimizer, nothing
    logged): what the loop and the run around it cost without the Trainer's step (see `--loop-only`)."""

    automatic_optimization = False

    def __init__(self, stamps: StepStamps) -> None:
        super().__init__(stamps)
        self.sgd = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def training_step(self, batch, batch_idx):
        self.stamps.step(batch_idx)
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        loss.backward()
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        return self.sgd


def interleaved_loop_only(data: TensorDataset, epochs: int, block: int, folder: Path) -> InterleavedHandSteps:
    """The interleaved measurement of HandStepInLoop, with nothing else per step (no bar, logger or checkpoints)."""
    interleaved = InterleavedHandSteps(data, block)
    torch.manual_seed(0)
    Trainer(max_epochs=epochs, default_root_dir=str(folder), accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False,
            ).fit(HandStepInLoop(interleaved), DataLoader(data, batch_size=BATCH, shuffle=True))
    return interleaved


def interleaved_hand_blocks(data: TensorDataset, epochs: int, block: int) -> InterleavedHandSteps:
    """The interleaved measurement with a hand-written loop in the Trainer's place: its ratio is the method's bias."""
    interleaved = InterleavedHandSteps(data, block)
    model, optimizer, loader = hand_parts(data)
    steps = 0
    for _ in range(epochs):
        for batch_idx, (x, y) in enumerate(loader):
            interleaved.step(batch_idx)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps % LOG_EVERY == 0:
                loss.item()
    return interleaved


class NoOp(Stamped):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x.sum()

    def training_step(self, batch, batch_idx):
        self.stamps.step(batch_idx)
        loss = self(batch[0])
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def framework_floor(runs: int, steps: int, folder: Path) -> None:
    data = TensorDataset(torch.ones(steps, 1))
    hand, ours = [], []
    for run in range(runs):
        model = NoOp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        stamps = StepStamps()
        for batch_idx, (x,) in enumerate(DataLoader(data, batch_size=1, shuffle=True)):
            stamps.step(batch_idx)
            loss = model(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (batch_idx + 1) % LOG_EVERY == 0:
                loss.item()
        hand.append(Timing(stamps.start, stamps.epochs, stamps.end, 0.0).steady_step(1))
        module = NoOp()
        Trainer(max_epochs=1, default_root_dir=str(folder / str(run)), accelerator="cpu",
                log_every_n_steps=LOG_EVERY).fit(module, DataLoader(data, batch_size=1, shuffle=True))
        ours.append(Timing(module.stamps.start, module.stamps.epochs, module.stamps.end, 0.0).steady_step(1))
    floor_hand, floor_ours = min(hand) * 1e6, min(ours) * 1e6
    print(f"framework floor (cpu, no-op step, min of {runs} runs): hand-written {floor_hand:.1f} us, Trainer "
          f"{floor_ours:.1f} us: the Trainer adds {floor_ours - floor_hand:.1f} us per step")


CACHES = {"I1": "32768,8,64", "D1": "32768,8,64", "LL": "524288,8,64"}  # one core's L1s and L2 (AMD Zen 3 here)
EVENTS = {"Ir": "instructions", "I1mr": "L1 instruction misses", "ILmr": "L2 instruction misses",
          "D1mr": "L1 data read misses", "D1mw": "L1 data write misses", "DLmr": "L2 data read misses",
          "Bcm": "mispredicted conditional branches", "Bim": "mispredicted indirect branches"}


def cachegrind_totals(side: str, steps: int, folder: Path) -> dict[str, int]:
    """The event totals of one `--side` run under valgrind's cachegrind (simulated caches and branch predictor)."""
    out = folder / f"cachegrind.{side}.{steps}"
    caches = [f"--{name}={spec}" for name, spec in CACHES.items()]
    # A BLAS thread pool spins a varying number of instructions, and hash seeds vary dict layouts: both pinned,
    # so that the counts repeat from run to run.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=yes", "--branch-sim=yes", *caches,
                    f"--cachegrind-out-file={out}", sys.executable, __file__, "--side", side, "--steps", str(steps),
                    "--folder", str(folder / f"{side}{steps}")], check=True, capture_output=True, env=env)
    lines = out.read_text().splitlines()
    names = next(line for line in lines if line.startswith("events:")).split()[1:]
    totals = next(line for line in lines if line.startswith("summary:")).split()[1:]
    return dict(zip(names, map(int, totals)))


def instruction_counts(short: int, long: int) -> None:
    """Per-step counts of both sides under cachegrind: the difference of a `long`- and a `short`-step run of
    each, divided by the steps between them, so that imports and setup cancel out. Deterministic: the same
    on a busy machine and a quiet one, unlike any timing here (but blind to what cachegrind does not
    model: the real core's prefetchers, op cache, memory latency)."""
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = {(side, steps): pool.submit(cachegrind_totals, side, steps, Path(tmp))
                for side in ("hand", "trainer") for steps in (short, long)}
        totals = {key: job.result() for key, job in jobs.items()}
    per_step = {side: {event: (totals[side, long][event] - totals[side, short][event]) / (long - short)
                       for event in totals[side, long]} for side in ("hand", "trainer")}
    print(f"cachegrind, per step (runs of {long} and {short} steps; caches {CACHES}):")
    for event, meaning in EVENTS.items():
        hand, ours = per_step["hand"][event], per_step["trainer"][event]
        print(f"  {meaning:>34}: hand-written {hand:12,.0f}  Trainer {ours:12,.0f}  ratio {ours / hand:.4f}")
    hand, ours = cycle_estimate(per_step["hand"]), cycle_estimate(per_step["trainer"])
    print(f"  {'cycle estimate':>34}: hand-written {hand:12,.0f}  Trainer {ours:12,.0f}  ratio {ours / hand:.4f} "
          "(KCachegrind's Ir + 10 mispredicted branches + 10 L1 misses + 100 L2 misses; a rough weighting)")


def cycle_estimate(counts: dict[str, float]) -> float:
    """KCachegrind's rough cycle estimate from cachegrind's counts: a miss in the last cache level simulated
    (here the L2) is taken to cost 100 cycles, an L1 miss or a mispredicted branch 10, an instruction 1."""
    l1_misses = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
    last_level_misses = counts["ILmr"] + counts["DLmr"] + counts["DLmw"]
    return counts["Ir"] + 10 * (counts["Bcm"] + counts["Bim"]) + 10 * l1_misses + 100 * last_level_misses


TRAINER_IMPORT = "from torchyard.trainer import Trainer"


def import_seconds(statement: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", statement], check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def epoch_extra_per_step(runs: list[Timing], clock: int, steps_per_epoch: int) -> float:
    """An epoch boundary's extra time (median over runs), spread over the epoch's steps."""
    return statistics.median(run.epoch_extra(clock) for run in runs) / steps_per_epoch


def report_blocks(block: int, trainer_runs: list[InterleavedHandSteps], aa_runs: list[InterleavedHandSteps],
                  separate: dict[str, list[Timing]], steps_per_epoch: int) -> None:
    """The interleaved figures: steady steps side by side, then per step with each side's epoch boundary."""
    print(f"interleaved blocks of {block} step(s), {len(trainer_runs)} runs (first step after each switch left out):")
    for clock, name in enumerate(CLOCKS):
        hand_epoch = epoch_extra_per_step(separate["hand-written"], clock, steps_per_epoch)
        our_epoch = epoch_extra_per_step(separate["Trainer"], clock, steps_per_epoch)
        steady, per_step = [], []
        for run in trainer_runs:  # ratios within a run: its two sides ran at the same moments
            hand = statistics.median(h[clock] for h in run.hand)
            ours = statistics.median(t[clock] for t in run.trainer)
            steady.append(ours / hand)
            per_step.append((ours + our_epoch) / (hand + hand_epoch))
        bias = statistics.median(run.ratios()[clock] for run in aa_runs)
        print(
            f"  {name:>4}: steady step ratio {statistics.median(steady):.3f} (runs "
            f"{min(steady):.3f}..{max(steady):.3f}); "
            f"epoch boundary +{hand_epoch * 1e6:.1f} us per step hand-written, +{our_epoch * 1e6:.1f} us Trainer; "
            f"A/A ratio {bias:.3f}"
        )
        ratio = statistics.median(per_step)
        print(
            f"  {name:>4}: ratio Trainer / hand-written per step: {ratio:.3f} (runs "
            f"{min(per_step):.3f}..{max(per_step):.3f};"
            f" target <= 1.02); without the method's bias {ratio / bias:.3f}"
        )


def report(name: str, runs: list[Timing], clock: int) -> float:
    per_step = [run.per_step(clock) * 1e3 for run in runs]
    steady = statistics.median(run.steady_step(clock) * 1e3 for run in runs)
    epoch = statistics.median(run.epoch_extra(clock) * 1e3 for run in runs)
    setup = statistics.median(run.setup() * 1e3 for run in runs)
    print(f"{name:>13} {CLOCKS[clock]:>4}: {statistics.median(per_step):.4f} ms/step (runs {min(per_step):.4f}.."
          f"{max(per_step):.4f}; steady step {steady:.4f} ms, epoch boundary +{epoch:.1f} ms, setup {setup:.0f} ms)")
    return statistics.median(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=400)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--block-repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--import-repeats", type=int, default=5)
    parser.add_argument("--floor-runs", type=int, default=15)
    parser.add_argument(
        "--loop-only",
        action="store_true",
        help="also measure the hand-written step run by the Trainer's loop (manual optimization, nothing "
        "logged or saved): how much of the steady ratio is not the Trainer's step",
    )
    parser.add_argument("--valgrind", action="store_true",
                        help="only count instructions, cache misses and mispredicted branches per step under "
                             "valgrind's cachegrind (about 11 minutes)")
    parser.add_argument("--side", choices=("hand", "trainer"), help=argparse.SUPPRESS)  # one run, for --valgrind
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.side is not None:
        (hand_written if args.side == "hand" else with_trainer)(synthetic_data(args.steps * BATCH), 1, args.folder)
        return
    if args.valgrind:
        instruction_counts(short=20, long=120)
        return

    data = synthetic_data(args.steps_per_epoch * BATCH)
    runs: dict[str, list[Timing]] = {"hand-written": [], "Trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        hand_written(data, 1, Path(tmp) / "warmup")  # first-touch costs (allocator, kernels) hit neither side
        with_trainer(data, 1, Path(tmp) / "warmup")
        for repeat in range(args.repeats):
            runs["hand-written"].append(hand_written(data, args.epochs, Path(tmp) / f"hand{repeat}"))
            runs["Trainer"].append(with_trainer(data, args.epochs, Path(tmp) / f"trainer{repeat}"))

    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} thread(s); MLP "
        f"{FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, "
        f"batch {BATCH}; {args.epochs} epochs x {args.steps_per_epoch} steps; {args.repeats} interleaved repeats"
    )
    for clock, name in enumerate(CLOCKS):
        hand, trainer = report("hand-written", runs["hand-written"], clock), report("Trainer", runs["Trainer"], clock)
        # Each repeat ran its two sides back to back: their ratio leaves out the drift between repeats.
        paired = [
            ours.per_step(clock) / mine.per_step(clock) for mine, ours in zip(runs["hand-written"], runs["Trainer"])
        ]
        print(
            f"ratio Trainer / hand-written per step ({name} time): {trainer / hand:.3f} (target <= 1.02); "
            f"median of the repeats' own ratios {statistics.median(paired):.3f} ({min(paired):.3f}..{max(paired):.3f})"
        )

    with tempfile.TemporaryDirectory() as tmp:
        blocks, aa = [], []
        for repeat in range(args.block_repeats):
            blocks.append(interleaved_blocks(data, args.epochs, args.block, Path(tmp) / f"blocks{repeat}"))
            aa.append(interleaved_hand_blocks(data, args.epochs, args.block))
        report_blocks(args.block, blocks, aa, runs, args.steps_per_epoch)
        if args.loop_only:
            loop_only = [interleaved_loop_only(data, args.epochs, args.block, Path(tmp) / f"loop{repeat}")
                         for repeat in range(args.block_repeats)]
            for clock, name in enumerate(CLOCKS):
                ratios = [run.ratios()[clock] for run in loop_only]
                print(
                    f"  {name:>4}: loop only (the hand-written step run by the Trainer's loop, nothing logged or "
                    f"saved): steady step ratio {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
                )
        framework_floor(args.floor_runs, 300, Path(tmp))

    torch_import = import_seconds("import torch", args.import_repeats)
    # The package imports its public names on first use, so the import a script makes is of Trainer itself.
    trainer_import = import_seconds(TRAINER_IMPORT, args.import_repeats)
    print(f"python -c 'import torch':   {torch_import * 1e3:.0f} ms (median of {args.import_repeats})")
    print(f"python -c '{TRAINER_IMPORT}': {trainer_import * 1e3:.0f} ms (median of {args.import_repeats}); "
          f"{(trainer_import - torch_import) * 1e3:+.0f} ms over torch")


if __name__ == "__main__":
    main()
