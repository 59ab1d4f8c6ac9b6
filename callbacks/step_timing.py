"""StepTiming: where each training step's time goes (compute, gradient communication, data wait), samples per
second, peak memory per rank, and when a target metric is first reached. `trainer scale` adds it to every run."""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from torchyard.callbacks.base import Callback
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.runs import atomic_write_text

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer


class StepTiming(Callback):
    """Times the training steps after `warmup_steps` optimizer steps and writes, from rank 0, `output` (JSON): one
    entry per rank (seconds in steps, of which waiting for the gradient all-reduce; seconds between steps, waiting
    for data; samples; peak memory) and, with `target` ('val/acc>=0.97' or 'val/loss<=1.2'), when it was reached.

    A rank's wait for a collective holds the transfer and the time the other ranks took to arrive; both are what
    synchronous communication costs the step (`communication_s`). The rank that arrives last waits for the transfer
    alone, so per step the smallest wait over the ranks is the transfer (`transfer_s`) and the rest of each rank's
    wait is waiting for slower ranks. No clocks are compared across ranks.

    Reaching the target stops the fit. Gaps that hold validation or an epoch's end are not counted as data wait.
    """

    def __init__(self, output: str, warmup_steps: int = 5, target: str | None = None) -> None:
        if warmup_steps < 0:
            raise MisconfigurationError(f"StepTiming(warmup_steps={warmup_steps}) must be at least 0.")
        self.output = output
        self.warmup_steps = warmup_steps
        self.target = parse_target(target) if target is not None else None
        self.totals = {"step_s": 0.0, "communication_s": 0.0, "data_wait_s": 0.0, "steps": 0, "samples": 0}
        self.step_waits: list[float] = []  # this rank's communication wait in each counted step
        self.first_counted: float | None = None
        self.last_end: float | None = None  # None: the gap before the next step is not a data wait
        self.step_start = self.comm_at_start = self.fit_start = 0.0
        self.reached: dict[str, float] | None = None

    def _now(self, trainer: Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":  # the step's kernels belong to the step
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def _counting(self, trainer: Trainer) -> bool:
        return trainer.global_step >= self.warmup_steps

    @override
    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.fit_start = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        now = self._now(trainer)
        if self._counting(trainer):
            if self.first_counted is None:
                self.first_counted = now
            elif self.last_end is not None:
                self.totals["data_wait_s"] += now - self.last_end
        self.step_start, self.comm_at_start = now, trainer.strategy.communication_seconds()

    @override
    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = self._now(trainer)
        if self._counting(trainer) and self.first_counted is not None:
            self.totals["step_s"] += now - self.step_start
            wait = trainer.strategy.communication_seconds() - self.comm_at_start
            self.totals["communication_s"] += wait
            self.step_waits.append(wait)
            self.totals["steps"] += 1
            self.totals["samples"] += batch_size(batch)
        self.last_end = now

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        self.last_end = None

    @override
    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.last_end = None

    @override
    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if self.target is None or trainer.sanity_checking or self.reached is not None:
            return
        name, better, goal = self.target
        value = trainer.callback_metrics.get(name)
        if value is not None and (float(value) >= goal if better == ">=" else float(value) <= goal):
            steps_per_epoch = trainer.num_training_batches / trainer.accumulate_grad_batches
            self.reached = {"seconds": time.perf_counter() - self.fit_start, "value": float(value),
                            "epochs": trainer.global_step / steps_per_epoch if steps_per_epoch else math.nan}
            trainer.should_stop = True

    @override
    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        end = self.last_end if self.last_end is not None else time.perf_counter()
        rank = {**self.totals, "wall_s": end - self.first_counted if self.first_counted is not None else 0.0,
                "peak_memory_mb": peak_memory_mb(trainer.strategy.root_device)}
        ranks = trainer.strategy.all_gather_object((rank, self.step_waits))
        ranks = [{**totals, "transfer_s": transfer_seconds([waits for _, waits in ranks])} for totals, _ in ranks]
        if trainer.is_global_zero:
            report = {"ranks": ranks, "world_size": trainer.world_size, "num_nodes": trainer.strategy.num_nodes,
                      "steps_per_epoch": trainer.num_training_batches / trainer.accumulate_grad_batches,
                      "target": self.reached, "epochs_run": trainer.current_epoch, "global_step": trainer.global_step}
            atomic_write_text(Path(self.output), json.dumps(report, indent=1))


def transfer_seconds(step_waits: list[list[float]]) -> float:
    """The transfer, summed over the steps: per step, the wait of the rank that waited least."""
    return sum(min(waits) for waits in zip(*step_waits)) if step_waits else 0.0


def parse_target(text: str) -> tuple[str, str, float]:
    """('val/acc', '>=', 0.97) from 'val/acc>=0.97', 'val/acc=0.97' (higher is better) or 'val/loss<=1.2'."""
    for sign in (">=", "<=", "="):
        name, found, value = text.partition(sign)
        if found and name.strip():
            try:
                goal = float(value)
            except ValueError:
                break
            better = sign if sign != "=" else ("<=" if "loss" in name else ">=")
            return name.strip(), better, goal
    raise MisconfigurationError(f"target {text!r} is not METRIC=VALUE; write e.g. val/acc=0.97 (higher is better), "
                                "val/acc>=0.97 or val/loss<=1.2.")


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (in a tuple, list or dict, however nested)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size(batch[0])
    return 1


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak: allocated CUDA memory on a GPU, resident host memory (ru_maxrss, KiB on Linux) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
