"""The samplers the framework puts into loaders: a rank's share of any sampler, and batches that resume mid-epoch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, Sampler


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


class ResumableBatchSampler(BatchSampler):
    """A BatchSampler that can drop the first `skip` batches of its next epoch without loading them."""

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.skip = 0
        self.generator_seed: int | None = None  # set when the loader's generator is ours to reseed
        self._resumed: _ResumedBatches | None = None  # the pass that skips, until its sampler has drawn its order

    def __iter__(self) -> Iterator[list[int]]:
        # islice, not a generator of ours: no extra Python frame between the loader and each batch.
        batches = itertools.islice(super().__iter__(), self.skip, None)
        if not self.skip:
            return batches
        # `skip` holds until the pass has yielded a batch: a loader with workers asks for its iterator twice.
        self._resumed = _ResumedBatches(batches, self)
        return self._resumed

    def set_epoch(self, epoch: int) -> None:
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
