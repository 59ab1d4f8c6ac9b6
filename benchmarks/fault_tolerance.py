"""Live recovery's cost per step without failures: strategy ddp with fault_tolerance against plain ddp (issue 50's
target: <= 5% on CPU).

    python benchmarks/fault_tolerance.py [--rounds 3] [--steps 60] [--hidden 128]

Both train the digits recipe's CNN through the Trainer on 3 CPU processes with the same global batch (3 x 32): plain
ddp as one job of 3 ranks (torch's DDP, gloo), and fault_tolerance as 3 replica groups of one process (per step: a
lighthouse quorum, torchft's all-reduce over it, a commit vote). They alternate round by round, so drift in the
machine's load hits both alike. Per step: the median time between two optimizer steps of rank 0 (replica group 0),
from the 6th step on (launch and warm-up excluded). Prints each round, the medians over rounds and the ratio.
torchft's own cost against a hand-written torch DDP loop, without the framework: benchmarks/torchft_overhead.py.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from torchyard.callbacks import Callback
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer

BATCH, PROCESSES, WARMUP = 32, 3, 5


class StepClock(Callback):
    """Rank 0 (replica group 0) writes the median seconds between its optimizer steps after WARMUP to `path`."""

    def __init__(self, path: str) -> None:
        self.path, self.times = path, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())

    def on_train_end(self, trainer, module):
        if trainer.is_global_zero:
            steps = [later - earlier for earlier, later in zip(self.times[WARMUP:], self.times[WARMUP + 1:])]
            Path(self.path).write_text(str(statistics.median(steps)))


def step_seconds(kind: str, root: Path, steps: int, hidden: int) -> float:
    if kind == "ddp":
        strategy, devices = {"name": "ddp", "find_unused_parameters": False}, PROCESSES
    else:
        strategy, devices = {"name": "ddp", "fault_tolerance": {"replica_groups": PROCESSES,
                                                                "min_replicas": PROCESSES}}, 1
    clock = root / f"{kind}.txt"
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=steps, seed=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(root),
                      callbacks=[StepClock(str(clock))])
    trainer.fit(DigitsCNN(hidden=hidden), datamodule=DigitsData(batch_size=BATCH))
    return float(clock.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"ddp": [], "fault_tolerance": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            kinds = list(results) if round_index % 2 == 0 else list(results)[::-1]
            for kind in kinds:
                seconds = step_seconds(kind, Path(folder) / f"round{round_index}", args.steps, args.hidden)
                results[kind].append(seconds)
                print(f"round {round_index}: {kind}: {seconds * 1e3:.2f} ms/step", flush=True)
    ddp, ft = (statistics.median(results[kind]) for kind in results)
    print(f"ddp {ddp * 1e3:.2f} ms/step, fault_tolerance {ft * 1e3:.2f} ms/step: ratio {ft / ddp:.3f} "
          f"(target <= 1.05)")


if __name__ == "__main__":
    main()
