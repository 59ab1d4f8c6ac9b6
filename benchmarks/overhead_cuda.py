"""overhead.py's comparison on a CUDA device: the same MLP and data, hand-written loop vs Trainer defaults.

The hand-written loop is the usual GPU one: a pinned DataLoader, `.cuda(non_blocking=True)`, forward,
backward, step, zero_grad. The Trainer runs on its defaults (progress bar, CSV logging, model summary,
the non-finite loss check, which reads the loss on the host once per step), without epoch-end
checkpoints, plus two variants: nonfinite_loss='ignore' (no per-step host read) and everything off.
Each run is one epoch timed from its first batch to a final torch.cuda.synchronize(); runs alternate, and
the median per-step time of each is printed with its ratio to the hand-written loop.

    python benchmarks/overhead_cuda.py [--runs 5] [--steps 1500]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from overhead import BATCH, MLP, synthetic_data
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer


def hand_written(data: TensorDataset, steps: int) -> float:
    torch.manual_seed(0)
    model = MLP().cuda()  # the Trainer's module class, called as a plain nn.Module (see overhead.py)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


class EpochClock(Callback):
    def on_train_epoch_start(self, trainer, module):
        torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start


def with_trainer(data: TensorDataset, steps: int, **options) -> float:
    clock = EpochClock()
    Trainer(max_epochs=1, accelerator="cuda", default_root_dir=tempfile.mkdtemp(), callbacks=[clock],
            enable_checkpointing=False, **options).fit(MLP(), DataLoader(data, batch_size=BATCH, shuffle=True))
    return clock.seconds / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("overhead_cuda.py needs a CUDA device; benchmarks/overhead.py measures the CPU.")
    data = synthetic_data(args.steps * BATCH)
    bare = dict(nonfinite_loss="ignore", enable_progress_bar=False, logger=False, enable_model_summary=False)
    runs = {
        "hand-written": lambda: hand_written(data, args.steps),
        "Trainer (defaults)": lambda: with_trainer(data, args.steps),
        "Trainer, nonfinite_loss='ignore'": lambda: with_trainer(data, args.steps, nonfinite_loss="ignore"),
        "Trainer, all extras off": lambda: with_trainer(data, args.steps, **bare),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.runs):
        for name, run in runs.items():
            times[name].append(run())
    hand = statistics.median(times["hand-written"])
    print(f"{torch.cuda.get_device_name()}, MLP, batch {BATCH}, {args.steps} steps x {args.runs} runs")
    for name, values in times.items():
        ours = statistics.median(values)
        print(f"{name:>34}: {ours * 1e6:8.1f} us/step   ratio {ours / hand:.3f}")


if __name__ == "__main__":
    main()
