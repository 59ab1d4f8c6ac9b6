"""overhead.py's comparison on a CUDA device: the same MLP and data, hand-written loop vs the Trainer.

The hand-written loop is the usual GPU one: a pinned DataLoader, `.cuda(non_blocking=True)`, forward,
backward, step, zero_grad. The Trainer runs on its defaults (progress bar, CSV logging, model summary, the
non-finite loss check; the module logs its loss every step), without epoch-end checkpoints, and with
nonfinite_loss='ignore' (no loss check).

Interleaved blocks (the default; overhead.py's "Interleaved blocks" method): in one process, the module's
training_step runs `--block` hand-written steps (their own model on the GPU, pinned loader and optimizer)
after every `--block` Trainer steps. This small MLP's step is bound by the CPU that feeds and launches it, and
a shared host's speed drifts by several percent from one second to the next, which whole runs a second apart
cannot resolve (their ratios spread 0.87-1.21 on a lent H200). Each side's steady step is the median interval
between its consecutive step starts, on the wall clock (so a host that waits for the GPU pays for it), the
first after a switch left out. An A/A run, a hand-written loop in the Trainer's place, gives the method's bias.

`--split` adds variants with parts of the Trainer's per-step work turned off (the module's `self.log`, the
progress bar and logger, the loss check, then all of them), so that a GPU host shows where the Trainer's extra
microseconds a step go, as overhead.py's no-op step shows it on a CPU.

Whole runs (`--whole-runs`): each run is one epoch timed from its first batch to a final
torch.cuda.synchronize(); a hand-written run comes before and after every Trainer run, and each Trainer
run's ratio is to the mean of its two neighbours.

    python benchmarks/overhead_cuda.py [--runs 3] [--steps 300] [--epochs 2] [--block 20] [--split | --whole-runs]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from overhead import BATCH, MLP, InterleavedHandSteps, synthetic_data
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer

VARIANTS = {"Trainer (defaults)": {}, "Trainer, nonfinite_loss='ignore'": {"nonfinite_loss": "ignore"}}
EXTRAS_OFF = {"enable_progress_bar": False, "logger": False, "enable_model_summary": False}


class UnloggedMLP(MLP):
    """The MLP without its per-step `self.log` (`--split`)."""

    def training_step(self, batch, batch_idx):
        self.stamps.step(batch_idx)
        x, y = batch
        return F.cross_entropy(self(x), y)


SPLIT_VARIANTS = {  # `--split`: (the module's class, the Trainer's options)
    "Trainer, no self.log": (UnloggedMLP, {}),
    "Trainer, no bar, no logger": (MLP, EXTRAS_OFF),
    "Trainer, all of these off": (UnloggedMLP, {"nonfinite_loss": "ignore", **EXTRAS_OFF}),
}


class CudaHandSteps(InterleavedHandSteps):
    """overhead.py's interleaved hand-written steps, as the usual GPU loop."""

    def __init__(self, data: TensorDataset, block: int) -> None:
        super().__init__(data, block)
        self.model.cuda()  # the optimizer holds the same parameters, now on the GPU
        self.loader = DataLoader(data, batch_size=BATCH, shuffle=True, pin_memory=True)
        self.batches = iter(self.loader)
        self.device = torch.device("cuda")


def hand_written(data: TensorDataset, epochs: int, interleaved: CudaHandSteps | None = None) -> float:
    """The hand-written loop; seconds per step (`interleaved`: it takes the Trainer's place in that measurement)."""
    torch.manual_seed(0)
    model = MLP().cuda()  # the Trainer's module class, called as a plain nn.Module (see overhead.py)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(epochs):
        for batch_idx, (x, y) in enumerate(loader):
            if interleaved is not None:
                interleaved.step(batch_idx)
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (epochs * len(loader))


class EpochClock(Callback):
    def on_train_epoch_start(self, trainer, module):
        torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start


def with_trainer(data: TensorDataset, epochs: int, module: MLP, **options) -> float:
    """One fit on the GPU; seconds per step of its last epoch."""
    clock = EpochClock()
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    Trainer(max_epochs=epochs, accelerator="cuda", default_root_dir=tempfile.mkdtemp(), callbacks=[clock],
            enable_checkpointing=False, **options).fit(module, loader)
    return clock.seconds / len(loader)


def interleaved_blocks(data: TensorDataset, args: argparse.Namespace) -> None:
    variants = {name: (MLP, options) for name, options in VARIANTS.items()}
    if args.split:
        variants.update(SPLIT_VARIANTS)
    runs: dict[str, list[CudaHandSteps]] = {name: [] for name in ("A/A", *variants)}
    for _ in range(args.runs):
        for name in runs:
            interleaved = CudaHandSteps(data, args.block)
            if name == "A/A":
                hand_written(data, args.epochs, interleaved)
            else:
                torch.manual_seed(0)
                module_class, options = variants[name]
                with_trainer(data, args.epochs, module_class(interleaved), **options)
            runs[name].append(interleaved)
    bias = statistics.median(run.ratios()[0] for run in runs.pop("A/A"))
    print(f"interleaved blocks of {args.block} steps, {args.runs} runs of each; the method's bias (A/A) {bias:.3f}")
    for name, variant_runs in runs.items():
        ratios = [run.ratios()[0] for run in variant_runs]
        ours = statistics.median(statistics.median(t[0] for t in run.trainer) for run in variant_runs)
        hand = statistics.median(statistics.median(h[0] for h in run.hand) for run in variant_runs)
        ratio = statistics.median(ratios)
        print(f"{name:>34}: {ours * 1e6:7.1f} us/step, hand-written {hand * 1e6:7.1f} ({(ours - hand) * 1e6:+5.1f})   "
              f"steady ratio {ratio:.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}); without the method's bias {ratio / bias:.3f}")


def whole_runs(data: TensorDataset, args: argparse.Namespace) -> None:
    variants = {**VARIANTS, "Trainer, all extras off": dict(nonfinite_loss="ignore", **EXTRAS_OFF)}
    hand = [hand_written(data, 1)]
    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, options in variants.items():
            torch.manual_seed(0)
            times[name].append(with_trainer(data, 1, MLP(), **options))
            hand.append(hand_written(data, 1))
            ratios[name].append(times[name][-1] / ((hand[-2] + hand[-1]) / 2))
    print(f"whole runs of one epoch, {args.runs} runs of each")
    print(f"{'hand-written':>34}: {statistics.median(hand) * 1e6:8.1f} us/step")
    for name in variants:
        print(f"{name:>34}: {statistics.median(times[name]) * 1e6:8.1f} us/step   "
              f"ratio {statistics.median(ratios[name]):.3f} ({min(ratios[name]):.3f}-{max(ratios[name]):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each variant")
    parser.add_argument("--steps", type=int, default=300, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per interleaved run")
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--split", action="store_true", help="also the variants with parts of the Trainer off")
    parser.add_argument("--whole-runs", action="store_true", help="alternate whole runs instead")
    args = parser.parse_args()
    if args.split and args.whole_runs:
        parser.error("--split is a variant of the interleaved blocks; leave out --whole-runs")
    if not torch.cuda.is_available():
        raise SystemExit("overhead_cuda.py needs a CUDA device; benchmarks/overhead.py measures the CPU.")
    torch.set_num_threads(1)  # as overhead.py: the overhead measured is the framework's Python, not the kernels
    data = synthetic_data(args.steps * BATCH)
    hand_written(data, 1)  # warm-up: CUDA's context, kernels and the pinned-memory cache
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, MLP, batch {BATCH}, {args.steps} steps an epoch")
    (whole_runs if args.whole_runs else interleaved_blocks)(data, args)


if __name__ == "__main__":
    main()
