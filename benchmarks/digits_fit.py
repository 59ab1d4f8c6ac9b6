"""The digits CNN fit with validation each epoch: Trainer (on its defaults) against a hand-written PyTorch loop.

    python benchmarks/digits_fit.py [--rounds 10] [--epochs 5] [--threads 1] [--interleaved | --processes]

Both sides train recipes/digits.yaml's model and data (DigitsCNN, DigitsData: batch 64, lr 0.002; the module built
right after torch.manual_seed(0)) for the same epochs, on the same loaders: DigitsData's train_dataloader()
(shuffled) and val_dataloader() after its setup, 20 training and 6 validation batches an epoch.

The hand-written loop takes its optimizer from the module's configure_optimizers (AdamW), calls the module as the
plain nn.Module it is (its forward, so both sides run the same layers), records the loss every log_every_n_steps (5)
steps into a CSV file with `.item()`, validates after every epoch under torch.no_grad() in eval mode (the mean loss
and a torchmetrics MulticlassAccuracy, written to the CSV), and saves a checkpoint (model, optimizer, epoch) after
every epoch, written to a temporary file, fsynced and renamed: the guarantee the framework's checkpoints give.
Both sides `update` the accuracy metric each batch and compute it once an epoch (the recipe's validation_step logs
the Metric object, so no per-batch accuracy is computed).

The Trainer runs `Trainer(max_epochs=N, accelerator="cpu", log_every_n_steps=5, default_root_dir=tmp)
.fit(module, datamodule=DigitsData())` on its defaults: rich progress bar, model summary, CSV logger, the
sanity check (2 validation batches) and the default ModelCheckpoint (no monitor: each epoch's checkpoint, also
named last.ckpt; not the recipe's monitor=val/acc). The module logs train/loss every step and val/loss, val/acc
in validation (recipes/digits.py, unchanged); a subclass only adds on_train_start / on_train_end hooks that take
the timestamps. The progress bar writes to stdout as it does for a user; outside a terminal that is a line per
epoch.

Method: each side's training phase is timed from just before the first training step (the Trainer's
on_train_start, after its sanity check) to the end of the last epoch, its validation and checkpoint included
(on_train_end), in wall time (perf_counter) and in the process's CPU time (process_time: every thread, the
progress bar's included); divided by the epochs, that is the time per epoch with validation. The whole fit
is timed too, in wall time: from the seeding and the module's construction to the end of `fit` (the hand
loop's return), with the data's setup, the sanity check, the model summary and the logger's files in it.
One warm-up run of each side (one epoch) comes first; then each round runs both sides, alternating which goes
first, so that drift in the machine's speed hits both alike. Prints each side's median and spread (min-max),
and the ratio Trainer / hand-written both as the median of the rounds' own ratios (the two runs of a round
ran back to back) and as the ratio of the medians.

Interleaved (`--interleaved`): whole runs a second apart are not comparable on a shared machine, whose speed
drifts by tens of percent within a second (one round's ratio moves by +-15% there). So this mode interleaves
epochs within one fit: the module's on_train_epoch_start runs a whole hand-written epoch (training, validation,
checkpoint) before each of the Trainer's epochs, and its on_train_end one more after the last; each Trainer
epoch (from the end of one hand-written epoch to the start of the next: its training, validation, checkpoint and
hooks) is divided by the mean of the two hand-written epochs around it, which cancels a drift linear over the
three. The hand-written epochs draw from an RNG stream of their own (the global RNG swapped in and out around
them), so the Trainer's side draws exactly what it draws alone and the two sides still train the same weights.
The median over every epoch of every round is the figure; the method's own bias is measured by an A/A run (a
second hand-written loop in the Trainer's place, timed the same way), printed, and divided out. The progress
bar's line thread is idle between its lines; in a terminal, rich's live bar redraws from its own thread during
both sides' epochs, which the interleaving would split between them: read this mode through a pipe.

Fresh processes (`--processes`): each side's whole fit runs in a process of its own, as a user runs it (the
issue that asked for this benchmark measured this way): the hand-written loop, the Trainer on its defaults, and
the Trainer with tune_malloc=False, the order rotating from round to round. Only here does the Trainer's
malloc setting (trainer/loop/host_memory.py) meet a hand-written loop on glibc's defaults: in the modes above both
sides share one process, so the hand-written epochs run under the setting too once the Trainer has set it, and
their ratio is the framework's own work. Each fit's training phase per epoch is printed, and each Trainer
side's ratios to the hand-written fit of the same round (median, min-max). The spread is wide: a fit takes
about a second, and how often glibc's defaults fault a step's memory in again depends on where its blocks land.

The two sides must train the same weights: the framework keeps the loader's own shuffle, drawn from the
global RNG as each epoch's iterator starts, and the validation loader's iterator draws its seed from it
after every epoch on both sides (the Trainer's sanity check gives back what it drew). The benchmark
prints whether the final weights of the last round are bitwise equal (in both modes), and both sides' last
val/acc.

One intra-op thread by default: a second one only adds noise on a shared machine, and what differs between the
sides is the framework's Python work, not the kernels.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from overhead import finish_checkpoints, save_atomically  # the hand-written loops' checkpoint, as in overhead.py
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer

BATCH, LR = 64, 0.002  # recipes/digits.yaml
LOG_EVERY = 5
CLOCKS = ("wall", "cpu")


def now() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all its threads)."""
    return time.perf_counter(), time.process_time()


@dataclass
class Run:
    """One fit: its training phase's start and end (both clocks), the whole fit (wall), what it trained."""

    start: tuple[float, float]
    end: tuple[float, float]
    whole: float
    epochs: int
    weights: dict[str, torch.Tensor]
    val_acc: float

    def per_epoch(self, clock: int) -> float:
        return (self.end[clock] - self.start[clock]) / self.epochs


class TimedDigitsCNN(DigitsCNN):
    """DigitsCNN as the recipe builds it, stamping the start and end of the training phase."""

    def on_train_start(self) -> None:
        self.train_start = now()

    def on_train_end(self) -> None:
        finish_checkpoints(self)
        self.train_end = now()


def validate(model: DigitsCNN, loader: DataLoader, accuracy: MulticlassAccuracy) -> tuple[float, float]:
    """Mean loss over the validation images and their accuracy."""
    model.eval()
    loss_sum, images_seen = torch.zeros(()), 0
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images)
            loss_sum += F.cross_entropy(logits, labels, reduction="sum")
            images_seen += len(labels)
            accuracy.update(logits, labels)
    result = (loss_sum / images_seen).item(), accuracy.compute().item()
    accuracy.reset()
    return result


class HandLoop:
    """The hand-written side: built as a script would build it (seed, model, data, optimizer, CSV file); `epoch`
    trains one epoch, validates and saves the checkpoint."""

    def __init__(self, folder: Path) -> None:
        torch.manual_seed(0)
        self.model = DigitsCNN(lr=LR)
        data = DigitsData(batch_size=BATCH)
        data.setup("fit")
        self.train_loader, self.val_loader = data.train_dataloader(), data.val_dataloader()
        self.optimizer = self.model.configure_optimizers()
        self.accuracy = MulticlassAccuracy(num_classes=10, average="micro")
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.metrics_file = open(folder / "metrics.csv", "w", newline="")
        self.writer = csv.writer(self.metrics_file)
        self.writer.writerow(["epoch", "step", "train/loss", "val/loss", "val/acc"])
        self.epochs_done = self.steps = 0
        self.val_acc = float("nan")

    def epoch(self) -> None:
        model, optimizer, writer, steps = self.model, self.optimizer, self.writer, self.steps
        model.train()
        for images, labels in self.train_loader:
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps % LOG_EVERY == 0:
                writer.writerow([self.epochs_done, steps, loss.item(), "", ""])
        val_loss, self.val_acc = validate(model, self.val_loader, self.accuracy)
        writer.writerow([self.epochs_done, steps, "", val_loss, self.val_acc])
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": self.epochs_done,
                 "step": steps}
        save_atomically(state, self.folder / "last.ckpt")
        self.steps, self.epochs_done = steps, self.epochs_done + 1

    def close(self) -> None:
        self.metrics_file.close()


def hand_written(epochs: int, folder: Path) -> Run:
    begin = time.perf_counter()
    hand = HandLoop(folder)
    start = now()
    for _ in range(epochs):
        hand.epoch()
    end = now()
    hand.close()
    return Run(start, end, time.perf_counter() - begin, epochs, hand.model.state_dict(), hand.val_acc)


def with_trainer(epochs: int, folder: Path, tune_malloc: bool = True) -> Run:
    begin = time.perf_counter()
    torch.manual_seed(0)
    module = TimedDigitsCNN(lr=LR)
    trainer = Trainer(max_epochs=epochs, accelerator="cpu", log_every_n_steps=LOG_EVERY, default_root_dir=str(folder),
                      tune_malloc=tune_malloc)
    trainer.fit(module, datamodule=DigitsData(batch_size=BATCH))
    whole = time.perf_counter() - begin
    val_acc = float(trainer.callback_metrics["val/acc"])
    return Run(module.train_start, module.train_end, whole, epochs, module.state_dict(), val_acc)


class OwnRng:
    """A stream of torch's global RNG of its own: inside `with`, the global RNG goes on from where this stream
    left off; outside, it is the caller's, untouched (unlike torch.random.fork_rng, the stream continues)."""

    def __init__(self) -> None:
        self.state = torch.get_rng_state()

    def __enter__(self) -> None:
        self.callers = torch.get_rng_state()
        torch.set_rng_state(self.state)

    def __exit__(self, *exc: object) -> None:
        self.state = torch.get_rng_state()
        torch.set_rng_state(self.callers)


class TimedEpochs:
    """Interleaved epochs: a hand-written epoch before each epoch of the other side and one after its last, each
    timed; `other` collects the other side's epochs (from the end of one hand-written epoch to the next's start)."""

    def __init__(self, hand: HandLoop) -> None:
        self.hand, self.rng = hand, OwnRng()  # the hand side draws its own stream: the other's is left as it was
        self.hand_epochs: list[tuple[float, float]] = []
        self.other: list[tuple[float, float]] = []
        self.mark: tuple[float, float] | None = None
        self.hand_weights: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}  # the other side's, at its end

    def hand_epoch(self, last: bool = False) -> None:
        stamp = now()
        if self.mark is not None:
            self.other.append((stamp[0] - self.mark[0], stamp[1] - self.mark[1]))
        if last:  # the weights after as many epochs as the other side trained (the copy timed by neither side)
            self.hand_weights = {name: value.clone() for name, value in self.hand.model.state_dict().items()}
            stamp = now()
        with self.rng:
            self.hand.epoch()
        self.mark = now()
        self.hand_epochs.append((self.mark[0] - stamp[0], self.mark[1] - stamp[1]))

    def ratios(self, clock: int) -> list[float]:
        """Each epoch of the other side over the mean of the two hand-written epochs around it."""
        hand = [epoch[clock] for epoch in self.hand_epochs]
        return [other[clock] / ((before + after) / 2) for other, before, after in
                zip(self.other, hand, hand[1:])]


class InterleavedDigitsCNN(DigitsCNN):
    """DigitsCNN as the recipe builds it, running TimedEpochs' hand-written epochs from its epoch hooks."""

    timed: TimedEpochs  # set after construction: save_hyperparameters records only the recipe's arguments

    def on_train_epoch_start(self) -> None:
        finish_checkpoints(self)  # the previous epoch's, within its time rather than the hand-written epoch's
        self.timed.hand_epoch()

    def on_train_end(self) -> None:
        finish_checkpoints(self)
        self.timed.hand_epoch(last=True)


def interleaved(epochs: int, folder: Path) -> TimedEpochs:
    """The Trainer's fit with a hand-written epoch before each of its epochs and after its last."""
    timed = TimedEpochs(HandLoop(folder / "hand"))
    torch.manual_seed(0)
    module = InterleavedDigitsCNN(lr=LR)
    module.timed = timed
    trainer = Trainer(max_epochs=epochs, accelerator="cpu", log_every_n_steps=LOG_EVERY, default_root_dir=str(folder))
    trainer.fit(module, datamodule=DigitsData(batch_size=BATCH))
    timed.hand.close()
    timed.weights = module.state_dict()
    return timed


def interleaved_hand_pair(epochs: int, folder: Path) -> TimedEpochs:
    """The same with a second hand-written loop in the Trainer's place (an A/A run): the method's own bias."""
    timed = TimedEpochs(HandLoop(folder / "hand"))
    other = HandLoop(folder / "other")
    for _ in range(epochs):
        timed.hand_epoch()
        other.epoch()
    timed.hand_epoch(last=True)
    timed.hand.close()
    other.close()
    timed.weights = other.model.state_dict()
    return timed


def report_interleaved(trainer_runs: list[TimedEpochs], aa_runs: list[TimedEpochs]) -> None:
    print(f"interleaved epochs, {len(trainer_runs)} rounds (a hand-written epoch before each Trainer epoch and after "
          "its last; each Trainer epoch over the mean of the two around it):")
    for clock, name in enumerate(CLOCKS):
        rounds = [statistics.median(run.ratios(clock)) for run in trainer_runs]
        every = [ratio for run in trainer_runs for ratio in run.ratios(clock)]
        bias = statistics.median(ratio for run in aa_runs for ratio in run.ratios(clock))
        median = statistics.median(every)
        print(f"  {name:>4}: Trainer / hand-written per epoch with validation: {median:.3f} (median of "
              f"{len(every)} epochs; rounds' medians {min(rounds):.3f}-{max(rounds):.3f}); A/A {bias:.3f}; "
              f"without the method's bias {median / bias:.3f}")
    last = trainer_runs[-1]
    print(f"  final weights, last round: {same_weights(last.hand_weights, last.weights)}")


def spread(values: list[float], unit: float, digits: int) -> str:
    scaled = [value * unit for value in values]
    return f"median {statistics.median(scaled):.{digits}f} (min-max {min(scaled):.{digits}f}-{max(scaled):.{digits}f})"


def report(what: str, hand: list[float], ours: list[float], unit: str, scale: float, digits: int) -> None:
    """Each side's median and spread, and the ratio Trainer / hand-written two ways."""
    rounds = [mine / theirs for mine, theirs in zip(ours, hand)]
    print(f"{what}:")
    print(f"  hand-written {spread(hand, scale, digits)} {unit}")
    print(f"  Trainer      {spread(ours, scale, digits)} {unit}")
    print(f"  ratio Trainer / hand-written: median of the rounds' ratios {statistics.median(rounds):.3f} "
          f"(min-max {min(rounds):.3f}-{max(rounds):.3f}); ratio of the medians "
          f"{statistics.median(ours) / statistics.median(hand):.3f}")


def same_weights(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> str:
    """'bitwise equal', or which tensors differ and by how much at most."""
    differing = [name for name in first if not torch.equal(first[name], second[name])]
    if not differing:
        return f"bitwise equal ({len(first)} tensors)"
    largest = max((first[name].double() - second[name].double()).abs().max().item() for name in differing)
    return (f"DIFFERENT: {len(differing)} of {len(first)} tensors ({', '.join(differing[:4])}...), "
            f"by up to {largest:.3g}")


def separate_rounds(rounds: int, epochs: int) -> None:
    """Whole fits of each side, alternating which goes first (see "Method")."""
    sides = {"hand-written": hand_written, "Trainer": with_trainer}
    runs: dict[str, list[Run]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for name, side in sides.items():  # first-touch costs (allocator, kernels, the digits file) hit neither side
            side(1, Path(tmp) / f"warmup-{name}")
        for round_index in range(rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for name in order:
                runs[name].append(sides[name](epochs, Path(tmp) / f"{name}-{round_index}"))
    hand, ours = runs["hand-written"], runs["Trainer"]
    print(f"\n{header(epochs)}, {rounds} rounds alternating which side goes first")
    for clock, name in enumerate(CLOCKS):
        report(f"time per epoch with validation ({name})", [run.per_epoch(clock) for run in hand],
               [run.per_epoch(clock) for run in ours], "ms", 1e3, 1)
    report("whole fit (wall)", [run.whole for run in hand], [run.whole for run in ours], "s", 1.0, 3)
    setup = [statistics.median(run.whole - (run.end[0] - run.start[0]) for run in side) * 1e3 for side in (hand, ours)]
    print(f"  of which outside the training phase (set-up, sanity check, summaries), median: hand-written "
          f"{setup[0]:.0f} ms, Trainer {setup[1]:.0f} ms")
    print(f"final weights, last round: {same_weights(hand[-1].weights, ours[-1].weights)}; "
          f"val/acc hand-written {hand[-1].val_acc:.4f}, Trainer {ours[-1].val_acc:.4f}")


def interleaved_rounds(rounds: int, epochs: int) -> None:
    """The Trainer's epochs interleaved with hand-written ones, and the A/A run, alternating (see "Interleaved")."""
    trainer_runs, aa_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        interleaved(1, Path(tmp) / "warmup")
        sides = {"Trainer": (interleaved, trainer_runs), "A/A": (interleaved_hand_pair, aa_runs)}
        for round_index in range(rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for name in order:
                measure, runs = sides[name]
                runs.append(measure(epochs, Path(tmp) / f"{name.replace('/', '')}-{round_index}"))
    print(f"\n{header(epochs)}")
    report_interleaved(trainer_runs, aa_runs)


# The sides of --processes, each a whole fit in a fresh process.
PROCESS_SIDES = {
    "hand-written": hand_written,
    "Trainer": with_trainer,
    "Trainer, tune_malloc=False": lambda epochs, folder: with_trainer(epochs, folder, tune_malloc=False),
}


def one_side(side: str, epochs: int) -> None:
    """`--side`: one side's fit in this fresh process; its training phase per epoch, as JSON on the last line."""
    with tempfile.TemporaryDirectory() as tmp:
        run = PROCESS_SIDES[side](epochs, Path(tmp))
    print(json.dumps({"wall": run.per_epoch(0), "cpu": run.per_epoch(1), "val_acc": run.val_acc}))


def process_rounds(rounds: int, epochs: int, threads: int) -> None:
    """Each side's fit in a fresh process, the order rotating from round to round (see "Fresh processes")."""
    sides = list(PROCESS_SIDES)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for round_index in range(rounds):
        for name in sides[round_index % len(sides):] + sides[:round_index % len(sides)]:
            done = subprocess.run([sys.executable, __file__, "--side", name, "--epochs", str(epochs), "--threads",
                                   str(threads)], capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\n{header(epochs)}; {rounds} rounds of fresh processes, one per side, the order rotating")
    hand = runs["hand-written"]
    for clock in CLOCKS:
        print(f"  {clock}: training phase per epoch (validation and checkpoint included)")
        for name in sides:
            print(f"    {name:<28} {spread([run[clock] for run in runs[name]], 1e3, 1)} ms")
            if name != "hand-written":
                ratios = [run[clock] / own[clock] for run, own in zip(runs[name], hand)]
                print(f"      / hand-written, the rounds' ratios: median {statistics.median(ratios):.3f} "
                      f"(min-max {min(ratios):.3f}-{max(ratios):.3f})")
    print("  val/acc, last round: " + ", ".join(f"{name} {runs[name][-1]['val_acc']:.4f}" for name in sides))


def header(epochs: int) -> str:
    bar = "a live bar (stdout is a terminal)" if sys.stdout.isatty() else "a line per epoch (stdout is no terminal)"
    return (f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); digits CNN, batch {BATCH}, "
            f"{epochs} epochs with validation each; progress bar: {bar}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--interleaved", action="store_true",
                      help="instead of whole fits, interleave hand-written epochs with the Trainer's (and an A/A run)")
    mode.add_argument("--processes", action="store_true",
                      help="each side's whole fit in a fresh process of its own, as a user runs it")
    mode.add_argument("--side", choices=list(PROCESS_SIDES), help=argparse.SUPPRESS)  # one fit of --processes
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.side is not None:
        one_side(args.side, args.epochs)
    elif args.processes:
        process_rounds(args.rounds, args.epochs, args.threads)
    else:
        (interleaved_rounds if args.interleaved else separate_rounds)(args.rounds, args.epochs)


if __name__ == "__main__":
    main()
