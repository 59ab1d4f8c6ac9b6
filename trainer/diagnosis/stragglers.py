"""Stragglers: where each rank's step time goes, sampled every n steps, and one line at the fit's end naming a rank
that is persistently slower than the others.

A rank's step splits into waiting for its batch, its training step (the forward), its backward (which holds the
gradient communication, and with it the time the faster ranks wait for a slower one) and its optimizer step. The
ranks step in lockstep, so their whole steps take the same time; a slow rank shows as more time of its own (data,
training step, optimizer) and the others as more time in backward, waiting for it. The Trainer adds this callback
to every job of several processes (diagnosis='on'); its cost is four clock reads a step, plus, every n steps, a
gather of four numbers per rank that no step waits for (and on CUDA a synchronize at the sampled step's phases, so
that the clock sees the device's work). benchmarks/diagnosis.py measures it.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from torchyard.callbacks.base import Callback

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer

PHASES = ("data", "training_step", "backward", "optimizer")
#: How the summary names the phase where a slow rank loses its time.
PHASE_WORDS = {"data": "waiting for data", "training_step": "in its training step", "backward": "in its backward",
               "optimizer": "in its optimizer step"}
#: A rank is reported when its own time exceeds the other ranks' median by this much (and by 10% of a step)...
MIN_EXCESS_S = 0.002
#: ... and it was the slowest in at least this share of at least MIN_SAMPLES sampled steps (a busy machine makes
#: any rank slow now and then).
MIN_SHARE = 0.75
MIN_SAMPLES = 5


class StragglerWatch(Callback):
    """Every `every_n_steps` optimizer steps, each rank's time split of one step, gathered onto every rank, logged
    as metrics by rank 0 (`diagnosis/rank<r>_<phase>_ms`) and summed; at the end of fit, rank 0 prints one line when
    a rank was persistently slower than the others ("rank 1 is the slowest: +30 ms a step (in its training step)")."""

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = max(1, int(every_n_steps))
        self._last_end: float | None = None  # the end of the previous batch: the next one's data wait starts there
        self._marks: list[float] = []  # the sampled step's clock reads: start, after forward, after backward
        self._sampling = False
        self.samples: list[list[list[float]]] = []  # per sampled step: per rank, seconds in each phase
        self.summary: str | None = None
        self._pending: tuple[Any, int] | None = None  # the gather of the last sampled step, and that step

    @property
    def state_key(self) -> str:
        return "StragglerWatch"

    def _clock(self, trainer: Trainer) -> float:
        device = trainer.strategy.root_device
        if device.type == "cuda":  # only on sampled steps: the phase's kernels belong to the phase
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer: Trainer, module: TrainModule, batch: Any, batch_idx: int) -> None:
        self._sampling = trainer.global_step % self.every_n_steps == 0 and self._last_end is not None
        if self._sampling:
            self._marks = [self._clock(trainer)]

    def on_before_backward(self, trainer: Trainer, module: TrainModule, loss: torch.Tensor) -> None:
        if self._sampling:
            self._marks.append(self._clock(trainer))

    def on_after_backward(self, trainer: Trainer, module: TrainModule) -> None:
        if self._sampling:
            self._marks.append(self._clock(trainer))

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = self._clock(trainer) if self._sampling else time.perf_counter()
        if self._sampling and len(self._marks) == 3 and self._last_end is not None:
            start, forward_end, backward_end = self._marks
            split = [start - self._last_end, forward_end - start, backward_end - forward_end, end - backward_end]
            self._record(trainer, split)
            end = time.perf_counter()  # the gather is this callback's, not the next batch's data wait
        self._sampling = False
        self._last_end = end

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._last_end = None  # the gap to the next epoch's first batch is no data wait

    def on_validation_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._last_end = None

    def _record(self, trainer: Trainer, split: list[float]) -> None:
        strategy = trainer.strategy
        if not strategy.steps_in_lockstep:  # ranks at their own pace: compared once, at the end
            self.samples.append([split])
            return
        self._collect(trainer)
        # A gather as a MAX all-reduce of each rank's own slots (zeros elsewhere), started now and read at the next
        # sampled step (or the end), so that no step waits for it.
        values = [0.0] * (len(PHASES) * strategy.world_size)
        values[len(PHASES) * strategy.global_rank:len(PHASES) * (strategy.global_rank + 1)] = split
        self._pending = (strategy.max_across_ranks_async(values), trainer.batches_stepped)

    def _collect(self, trainer: Trainer) -> None:
        """Read the gather started at the last sampled step; rank 0 logs it."""
        if self._pending is None:
            return
        (pending, step), self._pending = self._pending, None
        flat = trainer.strategy.max_across_ranks_result(pending)
        ranks = [flat[i:i + len(PHASES)] for i in range(0, len(flat), len(PHASES))]
        self.samples.append(ranks)
        if trainer.is_global_zero:
            values = {f"diagnosis/rank{rank}_{phase}_ms": seconds * 1e3
                      for rank, row in enumerate(ranks) for phase, seconds in zip(PHASES, row)}
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        strategy = trainer.strategy
        if strategy.world_size < 2:
            return
        self._collect(trainer)
        samples = self.samples
        if not strategy.steps_in_lockstep:  # each rank's own samples, compared by their means
            per_rank = strategy.all_gather_object([row[0] for row in samples])
            samples = [[_mean_split(rows) for rows in per_rank]] if all(per_rank) else []
        self.summary = slowest_rank(samples)
        if self.summary is not None and trainer.is_global_zero:
            print(f"trainer: {self.summary}", file=sys.stderr, flush=True)


def _mean_split(rows: list[list[float]]) -> list[float]:
    return [statistics.fmean(column) for column in zip(*rows)]


def slowest_rank(samples: list[list[list[float]]]) -> str | None:
    """The summary line for a rank persistently slower than the others, from each sampled step's per-rank split
    (seconds in PHASES); None when no rank is."""
    if not samples or len(samples[0]) < 2 or (len(samples) < MIN_SAMPLES and len(samples) > 1):
        return None  # (one sample: the means of ranks that run at their own pace, ps's)
    own = [i for i, phase in enumerate(PHASES) if phase != "backward"]  # backward holds the wait for the others

    def own_time(row: list[float]) -> float:
        return sum(row[i] for i in own)

    slowest_counts: dict[int, int] = {}
    for ranks in samples:
        rank = max(range(len(ranks)), key=lambda r: own_time(ranks[r]))
        slowest_counts[rank] = slowest_counts.get(rank, 0) + 1
    rank, count = max(slowest_counts.items(), key=lambda item: item[1])
    means = [_mean_split([ranks[r] for ranks in samples]) for r in range(len(samples[0]))]
    others = [m for r, m in enumerate(means) if r != rank]
    excess = [means[rank][i] - statistics.median(m[i] for m in others) for i in range(len(PHASES))]
    total = sum(excess[i] for i in own)
    step = statistics.median(sum(m) for m in means)
    if count < MIN_SHARE * len(samples) or total < max(MIN_EXCESS_S, 0.1 * step):
        return None
    phase = PHASES[max(own, key=lambda i: excess[i])]
    return (f"rank {rank} is the slowest: +{total * 1e3:.0f} ms a step ({PHASE_WORDS[phase]}), in {count} of "
            f"{len(samples)} sampled steps; its step splits into " +
            ", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in zip(PHASES, means[rank])) + " (diagnosis/* metrics)")
