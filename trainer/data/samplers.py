"""The samplers the framework puts into loaders: a rank's share of any sampler, and batches that resume mid-epoch
(also on another number of ranks: the rest of the epoch dealt again), and which positions of the epoch's order each
rank's batches hold (what the sample ledger records)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler


class ShardedSampler(Sampler[int]):
    """Rank `rank`'s share of any sampler's indices (or a batch sampler's batches): every world_size-th one.

    Evaluation loaders take it unpadded, so that each sample counts exactly once (ranks may then see one
    batch more or fewer). A user's own training sampler takes it `padded`, as DistributedSampler pads: the
    shards are made equal by repeating the first indices, since a rank with one batch more would run a
    gradient all-reduce that the others never join.
    """

    def __init__(self, sampler: Sampler[Any] | range, num_replicas: int, rank: int, padded: bool = False) -> None:
        self.sampler, self.num_replicas, self.rank, self.padded = sampler, num_replicas, rank, padded

    def __iter__(self) -> Iterator[Any]:
        if self.padded:
            indices = list(self.sampler)
            missing = len(self) * self.num_replicas - len(indices)
            while missing > 0 and indices:
                indices += indices[:missing]
                missing = len(self) * self.num_replicas - len(indices)
            return itertools.islice(indices, self.rank, None, self.num_replicas)
        return itertools.islice(self.sampler, self.rank, None, self.num_replicas)

    def __len__(self) -> int:
        total = len(self.sampler)  # type: ignore[arg-type]
        if self.padded:
            return math.ceil(total / self.num_replicas)
        return total // self.num_replicas + int(self.rank < total % self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


class EpochSampler(DistributedSampler):
    """torch's DistributedSampler (the same order and shares), which can also deal out the rest of an epoch.

    With `start` set (resume_epoch_at): positions [0, start) of the epoch's order were trained (on any number of
    ranks), and this epoch's pass deals positions start.. to the ranks, padded or cut to equal shares as
    DistributedSampler does. Its length still counts the `lead_samples` that stand for the trained part, so that
    the epoch keeps the batch count a fresh one has here (the loop's batch limit, schedulers and validation
    points stay as they are). The next set_epoch deals whole epochs again.
    """

    start = 0  # the first position of the epoch's order this pass deals (0: the whole epoch)
    lead_samples = 0  # the samples per rank that stand for positions [0, start) in the length

    def epoch_order(self) -> list[int]:
        """The epoch's order of dataset indices, as DistributedSampler draws it (from seed + epoch only)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]

    def rest_count(self) -> int:
        """This rank's share of positions start.. (equal on every rank)."""
        rest = len(self.dataset) - self.start  # type: ignore[arg-type]
        return rest // self.num_replicas if self.drop_last else math.ceil(rest / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        if not self.start:
            return super().__iter__()
        order = self.epoch_order()
        rest, total = order[self.start:], self.rest_count() * self.num_replicas
        while len(rest) < total:  # padded with the epoch's first indices, as DistributedSampler pads a whole epoch
            rest += order[: total - len(rest)]
        return iter(rest[self.rank:total:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples if not self.start else self.lead_samples + self.rest_count()

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = self.lead_samples = 0


class ResumableBatchSampler(BatchSampler):
    """A BatchSampler that can drop the first `skip` batches of its next epoch without loading them."""

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.skip = 0
        self.lead = 0  # of `skip`, the batches that its EpochSampler's dealt rest already leaves out
        self.generator_seed: int | None = None  # set when the loader's generator is ours to reseed
        self._resumed: _ResumedBatches | None = None  # the pass that skips, until its sampler has drawn its order

    def __iter__(self) -> Iterator[list[int]]:
        # islice, not a generator of ours: no extra Python frame between the loader and each batch.
        skip = self.skip - self.lead
        batches = itertools.islice(super().__iter__(), skip, None)
        if not skip:
            return batches
        # `skip` holds until the pass has yielded a batch: a loader with workers asks for its iterator twice.
        self._resumed = _ResumedBatches(batches, self)
        return self._resumed

    def set_epoch(self, epoch: int) -> None:
        self.lead = 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


class _ResumedBatches:
    """A resumed epoch's batch indices, whose first batch can be drawn before the loader asks for it."""

    def __init__(self, batches: Iterator[list[int]], sampler: ResumableBatchSampler) -> None:
        self.batches, self.sampler = batches, sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        self.sampler.skip = 0  # this pass has begun: later ones start at the epoch's first batch
        return next(self.batches)

    def draw_order(self) -> None:
        first = next(self, None)
        if first is not None:
            self.batches = itertools.chain([first], self.batches)


def draw_epoch_order(loader: DataLoader) -> None:
    """After `iter(loader)` of an epoch resumed mid-way: let its sampler draw the epoch's order now, from the
    random state the epoch started with (a sampler draws its seed at its first batch; workers have done so)."""
    resumed = getattr(loader.batch_sampler, "_resumed", None)
    if isinstance(resumed, _ResumedBatches):
        loader.batch_sampler._resumed = None
        resumed.draw_order()


def skip_batches(loader: DataLoader, count: int) -> bool:
    """Make the next pass over `loader` start at batch `count`; False when the loader cannot skip cheaply."""
    if isinstance(getattr(loader, "batch_sampler", None), ResumableBatchSampler):
        loader.batch_sampler.skip = count
        return True
    return count == 0


def resume_epoch_at(loader: DataLoader, position: int) -> int | None:
    """Deal the rest of the epoch after positions [0, position) of its order to this loader's ranks (call after
    set_epoch): the batches per rank that the loop then counts as done; None when its sampler cannot (only a
    seeded EpochSampler draws the same order on any number of ranks)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(batch_sampler, ResumableBatchSampler) or not isinstance(batch_sampler.sampler, EpochSampler):
        return None
    sampler, size = batch_sampler.sampler, batch_sampler.batch_size
    sampler.start = sampler.lead_samples = 0
    whole_epoch = len(batch_sampler)  # what a fresh epoch has at this number of ranks
    sampler.start = position
    rest = sampler.rest_count()
    rest_batches = rest // size if batch_sampler.drop_last else math.ceil(rest / size)
    batch_sampler.lead = max(0, whole_epoch - rest_batches)
    sampler.lead_samples = batch_sampler.lead * size
    batch_sampler.skip = batch_sampler.lead
    return batch_sampler.lead


@dataclass(frozen=True)
class EpochShare:
    """Which positions of an epoch's order one rank's batches hold: its i-th sample (from the pass's start) is
    position `start + rank + world * i`; batch j holds samples (j - lead) * batch_size onwards, `count` in all.
    Positions from `samples` on are padding (repeats that make the ranks' shares equal)."""

    samples: int  # the epoch's samples (its order's length before padding)
    world: int
    rank: int
    start: int
    lead: int
    batch_size: int
    count: int
    #: How the order is drawn: {"kind": "seeded", "shuffle", "seed"} (DistributedSampler's, found again from the
    #: epoch alone) or {"kind": "sampler"} (the loader's own sampler: positions only).
    order: dict[str, Any]

    def positions(self, first_batch: int, end_batch: int) -> range:
        """The positions batches [first_batch, end_batch) of the epoch hold on this rank."""
        first = (first_batch - self.lead) * self.batch_size
        end = min((end_batch - self.lead) * self.batch_size, self.count)
        base = self.start + self.rank
        return range(base + self.world * first, base + self.world * max(first, end), self.world)


def epoch_share(loader: Any) -> EpochShare | None:
    """This rank's EpochShare of a training loader the framework prepared; None where its batches are not a
    sized sampler's dealt by a batch size (an IterableDataset, a custom batch_sampler, a CombinedLoader)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(batch_sampler, ResumableBatchSampler):
        return None
    sampler, size, lead = batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.lead
    if isinstance(sampler, EpochSampler):
        return EpochShare(len(sampler.dataset), sampler.num_replicas, sampler.rank, sampler.start, lead,  # type: ignore[arg-type]
                          size, len(sampler) - sampler.lead_samples,
                          {"kind": "seeded", "shuffle": sampler.shuffle, "seed": sampler.seed})
    try:
        if isinstance(sampler, ShardedSampler):
            return EpochShare(len(sampler.sampler), sampler.num_replicas, sampler.rank, 0, 0, size, len(sampler),  # type: ignore[arg-type]
                              {"kind": "sampler"})
        return EpochShare(len(sampler), 1, 0, 0, 0, size, len(sampler), {"kind": "sampler"})  # type: ignore[arg-type]
    except TypeError:  # an unsized sampler
        return None
