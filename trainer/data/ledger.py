"""The sample ledger: which positions of each epoch's order every rank trained, and in which optimizer steps, so
that a run can show that every sample of every epoch was trained exactly once (`trainer ledger <run folder>`).

It lives in data/ beside the samplers whose deals it records (samplers.EpochShare says which positions a rank's
batches hold). The loop opens and closes its stretches, the checkpoint keeps it (checkpointing/state.py, which
also writes the run folder's copy, LEDGER_FILE), and a resume reads where the epoch stands from it.

Cheap: nothing is recorded per step. A stretch opens when an epoch (or the resumed rest of one) starts, at the
batch and step it starts at; it is read from the loop's own counters when a checkpoint is taken, and closed at
the epoch's end: one strided range of positions per rank and stretch of steps, kept as
`[epoch, rank, world, first_step, last_step, start, stop, stride]` (positions range(start, stop, stride), trained
while global_step went from first_step to last_step).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchyard.trainer.data.samplers import EpochShare, epoch_share, resume_epoch_at
from torchyard.trainer.errors import MisconfigurationError

LEDGER_FILE = "sample_ledger.json"
LEDGER_VERSION = 1
#: The duplicates and missing samples a report names one by one, per epoch; the rest are counted.
SHOWN = 10
EPOCH, RANK, WORLD, FIRST_STEP, LAST_STEP, START, STOP, STRIDE = range(8)


class SampleLedger:
    """One rank's view of the ledger: every rank's stretches as of the last gather, and its own since."""

    def __init__(self) -> None:
        #: str(epoch) -> {"samples": n, "order": how it is drawn, "planned": positions it trains, "finished"}
        self.epochs: dict[str, dict[str, Any]] = {}
        self.segments: list[list[int]] = []  # every rank's, as of the last checkpoint (or load)
        self.recent: list[list[int]] = []  # this rank's, closed since
        self._open: tuple[int, EpochShare, int, int] | None = None  # epoch, share, first batch, first step

    def open(self, epoch: int, loader: Any, batches_done: int, step: int, num_batches: int | float) -> None:
        """An epoch (or its resumed rest) starts at batch `batches_done` and global step `step`."""
        share = epoch_share(loader)
        self._open = None
        if share is None:
            return
        per_rank = share.count if num_batches == float("inf") else min(
            max(0, int(num_batches) - share.lead) * share.batch_size, share.count)
        meta = {"samples": share.samples, "order": share.order, "finished": False,
                "planned": min(share.samples, share.start + share.world * per_rank)}
        earlier = self.epochs.get(str(epoch))
        if earlier is not None and (earlier["order"], earlier["samples"]) != (share.order, share.samples):
            meta["order_changed"] = True  # positions of two orders cannot be matched
        self.epochs[str(epoch)] = {**(earlier or {}), **meta}
        self._open = (epoch, share, batches_done, step)

    def close(self, batches_done: int, step: int, finished: bool) -> None:
        """The open stretch ends with the epoch (`finished`: all its batches were trained)."""
        if self._open is None:
            return
        segment = self._segment(batches_done, step)
        if segment is not None:
            self.recent.append(segment)
        self.epochs[str(self._open[0])]["finished"] = finished
        self._open = None

    def _segment(self, batches_done: int, step: int) -> list[int] | None:
        epoch, share, first_batch, first_step = self._open  # type: ignore[misc]
        positions = share.positions(first_batch, batches_done)
        if not positions:
            return None
        return [epoch, share.rank, share.world, first_step, step, positions.start, positions.stop, positions.step]

    def gather(self, batches_done: int, step: int, all_gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
        """Every rank's record up to now, as a checkpoint keeps it. A collective (`all_gather`: the strategy's
        all_gather_object): call on every rank. Afterwards each rank holds the whole record."""
        own = list(self.recent)
        if self._open is not None:
            segment = self._segment(batches_done, step)
            if segment is not None:
                own.append(segment)
            self._open = (self._open[0], self._open[1], batches_done, step)  # the rest is new
        parts = all_gather({"epochs": self.epochs, "segments": own})
        epochs: dict[str, dict[str, Any]] = {}
        for part in parts:  # rank 0's first; equal on every rank but for a rank that has no training loader
            for key, meta in part["epochs"].items():
                epochs.setdefault(key, meta)
        # Two processes of one data-parallel rank (pipeline stages) record the same stretch: kept once.
        merged = _coalesce(self.segments + [segment for part in parts for segment in part["segments"]])
        self.epochs, self.segments, self.recent = epochs, merged, []
        return self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """A copy: a checkpoint's ledger does not change as the epoch goes on."""
        return {"version": LEDGER_VERSION, "epochs": {key: dict(meta) for key, meta in self.epochs.items()},
                "segments": [list(segment) for segment in self.segments]}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The record a checkpoint kept (None: a checkpoint from before the ledger, which starts an empty one)."""
        state = state or {}
        self.epochs = {key: dict(meta) for key, meta in state.get("epochs", {}).items()}
        self.segments = [list(segment) for segment in state.get("segments", [])]
        self.recent, self._open = [], None

    def first_untrained(self, epoch: int) -> int | None:
        """The first position of `epoch`'s order that no rank has trained (None: the epoch has no record)."""
        meta = self.epochs.get(str(epoch))
        if meta is None or meta.get("order_changed"):
            return None
        counts, _ = position_counts(self.segments, epoch, meta["samples"])
        untrained = (counts == 0).nonzero()
        return int(untrained[0]) if len(untrained) else meta["samples"]


def resume_trained_epoch(ledger: SampleLedger, loader: DataLoader, progress: Any) -> None:
    """A fit resumed mid-epoch (`progress`: the loop's Progress): deal the rest of the epoch after what its ledger
    shows trained, on any number of ranks, and count the batches that stand for it as done. Left to the batch
    count where the loader cannot (its order is not the seeded one the ledger recorded)."""
    if not progress.epoch_batches:
        return
    share, meta = epoch_share(loader), ledger.epochs.get(str(progress.epoch))
    if share is None or meta is None or share.order.get("kind") != "seeded":
        return
    if (meta["order"], meta["samples"]) != (share.order, share.samples):
        return
    position = ledger.first_untrained(progress.epoch)
    done = None if position is None else resume_epoch_at(loader, position)
    if done is not None and done != progress.epoch_batches:  # another number of ranks: other batch counts
        progress.validated_batches = done if progress.validated_batches == progress.epoch_batches else 0
        progress.epoch_batches = done


def _coalesce(segments: list[list[int]]) -> list[list[int]]:
    """The segments without repeats, each joined with the one that goes on from it (same rank and deal, the
    next positions, the next steps): a rank's stretch split by checkpoints is one again."""
    unique = sorted({tuple(segment) for segment in segments},
                    key=lambda s: (s[EPOCH], s[RANK], s[WORLD], s[STRIDE], s[START], s[FIRST_STEP]))
    joined: list[list[int]] = []
    for segment in unique:
        last = joined[-1] if joined else None
        if (last is not None and last[EPOCH:WORLD + 1] == list(segment[EPOCH:WORLD + 1])
                and last[STRIDE] == segment[STRIDE] and last[STOP] == segment[START]
                and last[LAST_STEP] == segment[FIRST_STEP]):
            last[STOP], last[LAST_STEP] = segment[STOP], segment[LAST_STEP]
        else:
            joined.append(list(segment))
    return joined


# --------------------------------------------------------------------------- the report


def position_counts(segments: list[list[int]], epoch: int, samples: int) -> tuple[torch.Tensor, int]:
    """How often each position [0, samples) of `epoch`'s order was trained, and how many padding repeats were."""
    counts = torch.zeros(samples, dtype=torch.int64)
    padding = 0
    for segment in segments:
        if segment[EPOCH] != epoch:
            continue
        positions = torch.arange(segment[START], segment[STOP], segment[STRIDE])
        real = positions[positions < samples]
        padding += len(positions) - len(real)
        counts.index_add_(0, real, torch.ones_like(real))
    return counts, padding


def sample_of(meta: dict[str, Any], epoch: int, position: int) -> str:
    """'sample 17 (position 3)' where the order can be drawn again from the epoch, else 'position 3'."""
    order = meta["order"]
    if order.get("kind") != "seeded":
        return f"position {position}"
    if order["shuffle"]:
        generator = torch.Generator().manual_seed(order["seed"] + epoch)
        index = int(torch.randperm(meta["samples"], generator=generator)[position])
    else:
        index = position
    return f"sample {index} (position {position})"


def report(state: dict[str, Any]) -> tuple[list[str], bool]:
    """The ledger's lines for a person, per epoch, and whether every finished epoch trained each of its samples
    exactly once (and an unfinished one none twice)."""
    lines, clean = [], True
    segments = state.get("segments", [])
    for key in sorted(state.get("epochs", {}), key=int):
        epoch_lines, epoch_clean = _epoch_report(int(key), state["epochs"][key], segments)
        lines += epoch_lines
        clean = clean and epoch_clean
    if not lines:
        lines.append("the ledger records no epoch (the training loader's batches are not a sized sampler's).")
    return lines, clean


def _epoch_report(epoch: int, meta: dict[str, Any], segments: list[list[int]]) -> tuple[list[str], bool]:
    if meta.get("order_changed"):
        return [f"epoch {epoch}: its order changed mid-epoch (a one-process run resumed on several, or the data "
                "changed), so its samples cannot be matched"], False
    samples, planned = meta["samples"], meta.get("planned", meta["samples"])
    counts, padding = position_counts(segments, epoch, samples)
    once, more = int((counts == 1).sum()), (counts > 1).nonzero().flatten().tolist()
    missing = (counts[:planned] == 0).nonzero().flatten().tolist() if meta.get("finished") else []
    notes = []
    if padding:
        notes.append(f"{padding} padding repeat(s) that even out the ranks' shares")
    if meta.get("finished") and planned < samples:
        notes.append(f"{samples - planned} left out by drop_last or limit_train_batches")
    extra = f" ({'; '.join(notes)})" if notes else ""
    if not more and not missing:
        if meta.get("finished"):
            return [f"epoch {epoch}: {once} of {samples} samples trained, each exactly once{extra}"], True
        return [f"epoch {epoch}: {once} of {samples} samples trained so far, none twice (unfinished){extra}"], True
    lines = [f"epoch {epoch}: {samples} samples: {once} trained once, {len(more)} more than once, {len(missing)} "
             f"missing{extra}"]
    for position in more[:SHOWN]:
        by = ", ".join(f"rank {s[RANK]} of {s[WORLD]} in steps {s[FIRST_STEP]}-{s[LAST_STEP]}"
                       for s in segments if s[EPOCH] == epoch and position in range(s[START], s[STOP], s[STRIDE]))
        lines.append(f"  duplicate: {sample_of(meta, epoch, position)} trained {int(counts[position])} times: {by}")
    lines += [f"  missing: {sample_of(meta, epoch, position)}" for position in missing[:SHOWN]]
    hidden = max(0, len(more) - SHOWN) + max(0, len(missing) - SHOWN)
    if hidden:
        lines.append(f"  ... and {hidden} more")
    return lines, False


def read_ledger(run_folder: str | Path) -> dict[str, Any]:
    """The ledger a run folder holds (its LEDGER_FILE), or the file given itself."""
    path = Path(run_folder)
    path = path / LEDGER_FILE if path.is_dir() else path
    if not path.is_file():
        raise MisconfigurationError(f"{str(path)!r} does not exist: give a run folder (runs/<name>/version_<n>) of a "
                                    f"fit that saved a checkpoint or ended, or its {LEDGER_FILE}.")
    return json.loads(path.read_text())
