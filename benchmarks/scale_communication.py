"""Is the communication time `trainer scale` reports right? Checked against an independent measurement.

    python benchmarks/scale_communication.py [--hidden 128] [--block 10] [--blocks 24] [--processes 2]

`trainer scale` reports, per step, the communication of the gradient all-reduce: each rank's wait for it is timed
inside DDP's communication hook (trainer/strategies/comm_timing.py), transfer and waiting for the slower rank alike,
and the report takes the mean over the ranks. The independent measurement is the step time it costs: the same digits
fit on 2 processes (gloo) alternates, in blocks of `--block` optimizer steps, between the real all-reduce and
torch's no-op hook (debugging_hooks.noop_hook) swapped into the strategy's timer, so both kinds of block run in the
same processes, interleaved, and drift in the machine's load hits both alike (whole runs minutes apart are not
comparable on a shared machine). Prints each rank's step times and wait, the mean reported wait in all-reduce
blocks, the difference of the mean step times (all-reduce blocks - no-op blocks, mean over the ranks), and their
ratio (target: 0.75-1.25).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

from torchyard.callbacks import Callback
from torchyard.callbacks.step_timing import transfer_seconds
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer
from torchyard.trainer.strategies.ddp import DDPStrategy

WARMUP = 10


class AlternatingHook:
    """The real hook in even blocks of steps, torch's no-op hook in odd ones."""

    def __init__(self, real) -> None:
        self.real = real
        self.skip = False

    def __call__(self, state, bucket):
        return debugging_hooks.noop_hook(None, bucket) if self.skip else self.real(state, bucket)


class Interleave(Callback):
    """Switches the hook per block; records each step's time and the timer's wait, by kind of block."""

    def __init__(self, block: int, output: str) -> None:
        self.block, self.output = block, output
        self.steps: dict[str, list[float]] = {"allreduce": [], "noop": []}
        self.waits: list[float] = []

    def on_train_start(self, trainer, module):
        timer = trainer.strategy.communication_timer
        self.hook = AlternatingHook(timer.hook)
        timer.hook = self.hook

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.hook.skip = (trainer.global_step // self.block) % 2 == 1
        self.wait_at_start = trainer.strategy.communication_seconds()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        seconds = time.perf_counter() - self.start
        if trainer.global_step <= WARMUP:
            return
        self.steps["noop" if self.hook.skip else "allreduce"].append(seconds)
        if not self.hook.skip:
            self.waits.append(trainer.strategy.communication_seconds() - self.wait_at_start)

    def on_train_end(self, trainer, module):
        ranks = trainer.strategy.all_gather_object((self.steps, self.waits))  # every rank's, step by step
        if trainer.is_global_zero:
            Path(self.output).write_text(json.dumps([{"steps": steps, "waits": waits} for steps, waits in ranks]))
        del self.hook  # the caller gets this callback back; a hook need not travel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128, help="DigitsCNN's hidden width (the gradient's size)")
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=24, help="blocks of each kind")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--keep", help=argparse.SUPPRESS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        output = str(Path(root) / "interleaved.json") if not args.keep else args.keep
        torch.manual_seed(0)
        trainer = Trainer(strategy=DDPStrategy(time_communication=True), devices=args.processes, accelerator="cpu",
                          max_steps=WARMUP + 2 * args.block * args.blocks, limit_val_batches=0,
                          num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False, logger=False, default_root_dir=root,
                          callbacks=[Interleave(args.block, output)])
        trainer.fit(DigitsCNN(hidden=args.hidden), datamodule=DigitsData())
        ranks = json.loads(Path(output).read_text())
    print(f"{args.processes} processes, DigitsCNN(hidden={args.hidden}), {len(ranks[0]['steps']['allreduce'])} "
          f"all-reduce and {len(ranks[0]['steps']['noop'])} no-op steps per rank, interleaved in blocks of "
          f"{args.block}:")
    for rank, timing in enumerate(ranks):
        steps = {kind: [1000 * s for s in values] for kind, values in timing["steps"].items()}
        print(f"  rank {rank}: step {statistics.fmean(steps['allreduce']):.2f} ms with the all-reduce, "
              f"{statistics.fmean(steps['noop']):.2f} ms with the no-op hook; waited "
              f"{1000 * statistics.fmean(timing['waits']):.2f} ms in the all-reduce")
    # As StepTiming and the scale report: the mean over the ranks of each rank's wait, per step.
    reported = 1000 * statistics.fmean(statistics.fmean(timing["waits"]) for timing in ranks)
    measured = statistics.fmean(statistics.fmean(t["steps"]["allreduce"]) - statistics.fmean(t["steps"]["noop"])
                                for t in ranks) * 1000
    transfer = 1000 * transfer_seconds([timing["waits"] for timing in ranks]) / len(ranks[0]["waits"])
    print(f"  of the wait, {transfer:.2f} ms/step was the transfer (the last rank to arrive), the rest waiting for "
          "the slower rank")
    print(f"  communication reported (trainer scale's timer) {reported:.2f} ms/step; step-time difference "
          f"{measured:.2f} ms/step (mean over the ranks); ratio {reported / measured:.2f} (target 0.75-1.25)")


if __name__ == "__main__":
    main()
