"""Training wall time with the evaluator side process against in-loop validation, on the digits model.

Both runs train the same model from the same initial weights on the same batches for the same epochs and save a
checkpoint at each epoch's end. The in-loop run validates at each epoch's end, and the training waits for it; the
evaluator run switches in-loop validation off (limit_val_batches=0) and scores each checkpoint in a side process
(`Trainer(evaluator=...)`), on `--evaluator-accelerator` (auto: a GPU the training leaves free, else the CPU).
Neither runs a sanity check. Printed for each run:

  training   wall time from on_train_start to on_train_end: the loop that validation leaves with the evaluator;
  fit        the whole `fit` call, which with the evaluator also waits for the last checkpoint's score.

The two kinds of run alternate `--repeats` times (so drifts in machine speed hit both); the medians and their
ratios (evaluator / in-loop) are printed, and the last epoch's val/acc of each, which agree: the same weights (the
model runs without dropout, whose masks would follow the random numbers that in-loop validation draws too).
`--val-fraction` sets the share of the images validated (default 0.5, so validation weighs as much as training
does in many real runs; the recipe's own is 0.2). On a 2-core CPU the side process takes one core from the training
while it scores (it runs one thread); with a GPU for the training and the CPU (or another GPU) for the evaluator,
they do not compete.

    python benchmarks/evaluator.py [--epochs 6] [--repeats 3] [--accelerator cpu] [--evaluator-accelerator auto]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from typing_extensions import override

from torchyard.callbacks import Callback, ModelCheckpoint
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer, seed_everything


class TrainingTime(Callback):
    """Wall time of the training phase of a fit."""

    def __init__(self) -> None:
        self.start, self.seconds = 0.0, 0.0

    @override
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.start = time.perf_counter()

    @override
    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def last_val_acc(metrics_file: Path) -> float:
    with open(metrics_file, newline="") as f:
        values = [float(row["val/acc"]) for row in csv.DictReader(f) if row.get("val/acc")]
    return values[-1]


def one_fit(args: argparse.Namespace, root: str, with_evaluator: bool) -> tuple[float, float, float]:
    """(training seconds, fit seconds, last val/acc) of one run."""
    seed_everything(0)
    module = DigitsCNN(dropout=0.0)  # no dropout: the in-loop validations' loaders draw from the RNG it would use
    data = DigitsData(val_fraction=args.val_fraction, test_fraction=0.05)
    timer = TrainingTime()
    options: dict[str, Any] = {"limit_val_batches": 0, "evaluator": {"accelerator": args.evaluator_accelerator,
                                                                      "poll_interval": 0.1}} if with_evaluator else {}
    trainer = Trainer(max_epochs=args.epochs, seed=0, default_root_dir=root, name="bench", accelerator=args.accelerator,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      log_every_n_steps=10, callbacks=[timer, ModelCheckpoint(save_top_k=-1)], **options)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fit_seconds = time.perf_counter() - start
    metrics_file = Path(trainer.log_dir) / ("metrics_evaluator.csv" if with_evaluator else "metrics.csv")
    return timer.seconds, fit_seconds, last_val_acc(metrics_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu", help="the training's (cpu, cuda)")
    parser.add_argument("--evaluator-accelerator", default="auto", help="the evaluator's (auto, cpu, cuda)")
    parser.add_argument("--val-fraction", type=float, default=0.5)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {"in-loop": [], "evaluator": []}
    with tempfile.TemporaryDirectory(prefix="bench-evaluator-") as root:
        for _ in range(args.repeats):
            for kind in results:
                results[kind].append(one_fit(args, root, kind == "evaluator"))
    print(f"{args.epochs} epochs, validation {args.val_fraction:.0%} of the images, training on {args.accelerator}, "
          f"evaluator on {args.evaluator_accelerator}; medians of {args.repeats} runs each")
    medians = {kind: [statistics.median(run[i] for run in runs) for i in range(3)] for kind, runs in results.items()}
    for kind, (training, fit, accuracy) in medians.items():
        print(f"  {kind:<10} training {training:7.2f} s   fit {fit:7.2f} s   last val/acc {accuracy:.4f}")
    loop, side = medians["in-loop"], medians["evaluator"]
    print(f"  ratio (evaluator / in-loop): training {side[0] / loop[0]:.3f}, fit {side[1] / loop[1]:.3f}")


if __name__ == "__main__":
    main()
