"""Throughput of strategy="ps" against ddp when one of two workers is slow.

Both train the digits CNN (recipes/digits.py) on the same data for the same epochs, with two
data-parallel workers, one of which sleeps `--delay` seconds before each training batch (a straggler:
a slower GPU, a noisy neighbour). ddp waits for it at every all-reduce; ps with staleness=None does not
wait and, claiming batches as it goes, gives the straggler fewer of them; bounded staleness waits for
it once it falls S steps behind; staleness=0 is synchronous.

Method: the training phase is timed on the chief (from `on_train_start` to `on_train_end`, so process
start-up, which differs by one process, is left out; every epoch ends with validation, which all
workers join, so the phase ends when the straggler is done too). Throughput is the epochs' training
samples over that time. Also printed: batches trained by the fast and the slow worker, stale gradients
the servers dropped, and the final validation accuracy: what the speed costs.

Run: python benchmarks/ps.py [--epochs 3] [--delay 0.2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from typing import Any

from torchyard.callbacks import Callback
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer

BATCH = 64
SLOW_RANK = 1  # the data-parallel rank that sleeps: ddp's rank 1, ps's worker 1 (the chief, worker 0, is fast)

RUNS: list[tuple[str, Any, int, bool]] = [  # (label, strategy, processes, workers claim batches as they go)
    ("ddp", "ddp", 2, False),
    ("ps staleness=0", {"name": "ps", "staleness": 0}, 3, False),
    ("ps staleness=4 drop", {"name": "ps", "staleness": 4, "stale_gradients": "drop"}, 3, False),
    ("ps staleness=None", {"name": "ps", "staleness": None}, 3, True),
]


class Straggler(Callback):
    """Makes one data-parallel rank sleep before each training batch; times the training phase here."""

    def __init__(self, rank: int, delay: float) -> None:
        self.rank, self.delay = rank, delay
        self.started, self.seconds, self.batches = 0.0, 0.0, 0

    def on_train_start(self, trainer: Trainer, module: Any) -> None:
        self.started = time.perf_counter()

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1
        if trainer.global_rank == self.rank:
            time.sleep(self.delay)

    def on_train_end(self, trainer: Trainer, module: Any) -> None:
        self.seconds = time.perf_counter() - self.started

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "batches": self.batches}  # the chief's, handed to this process

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seconds, self.batches = state["seconds"], state["batches"]


def train_samples() -> int:
    data = DigitsData(batch_size=BATCH)
    data.setup("fit")
    assert data.train_set is not None
    return len(data.train_set)


def run(strategy: Any, processes: int, args: argparse.Namespace, root: str) -> dict[str, float]:
    straggler = Straggler(SLOW_RANK, args.delay)
    trainer = Trainer(strategy=strategy, devices=processes, accelerator="cpu", max_epochs=args.epochs, seed=0,
                      default_root_dir=root, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[straggler])
    trainer.fit(DigitsCNN(), datamodule=DigitsData(batch_size=BATCH))
    metrics = trainer.callback_metrics
    return {"seconds": straggler.seconds, "fast_batches": straggler.batches,
            "stale": float(metrics.get("ps/stale_gradients", float("nan"))), "accuracy": float(metrics["val/acc"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds the slow worker sleeps per batch")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (the median is shown)")
    args = parser.parse_args()
    samples = train_samples() * args.epochs
    batches = math.ceil(train_samples() / BATCH) * args.epochs
    print(f"digits CNN, {args.epochs} epochs of {train_samples()} samples (batch {BATCH}), 2 workers, "
          f"worker {SLOW_RANK} sleeps {args.delay * 1000:.0f} ms per batch\n")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        for label, strategy, processes, _ in RUNS:
            outcomes = [run(strategy, processes, args, root) for _ in range(args.repeats)]
            median = statistics.median(o["seconds"] for o in outcomes)
            results[label] = next(o for o in outcomes if o["seconds"] == median)
            print(f"  {label}: {median:.1f} s", flush=True)
    base = samples / results["ddp"]["seconds"]
    print(
        "\n| run | processes | train phase (s) | samples/s | vs ddp | batches fast / slow worker | stale gradients "
        "dropped | val acc |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, _, processes, claims in RUNS:
        outcome = results[label]
        rate = samples / outcome["seconds"]
        stale = "-" if math.isnan(outcome["stale"]) else f"{outcome['stale']:.0f}"
        fast = int(outcome["fast_batches"])
        slow = batches - fast if claims else fast  # fixed shards: both train the same number
        print(f"| {label} | {processes} | {outcome['seconds']:.1f} | {rate:.0f} | {rate / base:.2f}x | "
              f"{fast} / {slow} | {stale} | {outcome['accuracy']:.3f} |")


if __name__ == "__main__":
    main()
