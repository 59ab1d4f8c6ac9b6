"""Each step's global batch dealt over the replica groups of that step's quorum, so that every sample of every epoch is
trained exactly once however many replicas are alive. The epoch's order is the seeded one every replica draws alike
(data/samplers.EpochSampler, from the seed and the epoch), cut into global batches of `replica_groups x batch_size`
samples: global batch k is positions [k * G, (k + 1) * G) of it, whichever replicas train it. At each step, once the
quorum is known, participant p of n takes the p-th of n near-equal contiguous parts, and weighs its mean loss by n x
its share of the batch, so that the quorum's average gradient is the global batch's mean one. A step that does not
commit is trained again on the same global batch (the strategy re-deals it over the next quorum), and the loop
counts only committed steps, so the loop's batch count within the epoch is the cursor a restarted replica heals to,
and the sample ledger (data/ledger.py) records global batches as one rank's (world 1, batch size G) positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from torchyard.trainer.data.samplers import EpochSampler, ResumableBatchSampler

#: Called at the start of each step, before its batch is drawn: (this replica's place p, participants n).
Quorum = Callable[[], "tuple[int, int]"]


def replica_part(indices: list[int], place: int, participants: int) -> list[int]:
    """Participant `place` of `participants`' contiguous part of a global batch. Where a short last batch has
    fewer samples than participants, a replica left without one trains the batch's last sample again (a
    padding repeat, as DistributedSampler pads; the ledger counts positions, not repeats)."""
    size = len(indices)
    part = indices[place * size // participants:(place + 1) * size // participants]
    return part or indices[-1:]


class ReplicaSlices(ResumableBatchSampler):
    """A ResumableBatchSampler of global batches (so skipping, resuming and the ledger count global batches) that
    yields this replica's part of each, dealt by the quorum of the step it starts."""

    def __init__(self, sampler: EpochSampler, global_batch: int, drop_last: bool, quorum: Quorum) -> None:
        super().__init__(sampler, global_batch, drop_last)
        self.quorum = quorum
        self.current: list[int] = []  # the global batch of the step in progress
        #: participants x this replica's share of it: the weight of its part's mean loss (see replica_weight)
        self.weight = 1.0

    def __iter__(self) -> Iterator[list[int]]:
        return self._parts(super().__iter__())

    def _parts(self, batches: Iterator[list[int]]) -> Iterator[list[int]]:
        for batch in batches:
            self.current = batch
            yield self.deal(*self.quorum())

    def deal(self, place: int, participants: int) -> list[int]:
        """This replica's part of the current global batch under a quorum of `participants`; sets its weight."""
        part = replica_part(self.current, place, participants)
        self.weight = participants * len(part) / len(self.current)
        return part


class StepBatches:
    """The training loader's batches of the step in progress, fetched again for a retried step's new quorum."""

    def __init__(self, loader: DataLoader, slices: ReplicaSlices) -> None:
        self.dataset, self.collate_fn, self.slices = loader.dataset, loader.collate_fn, slices

    def refetch(self, place: int, participants: int) -> Any:
        """This replica's part of the current global batch under a quorum of `participants`, collated."""
        indices = self.slices.deal(place, participants)
        get_items = getattr(self.dataset, "__getitems__", None)
        items = get_items(indices) if get_items is not None else [self.dataset[i] for i in indices]
        return self.collate_fn(items)


def replica_loader(prepared: DataLoader, replica_groups: int, quorum: Quorum) -> tuple[DataLoader, StepBatches] | None:
    """A training loader prepared for one rank in the seeded order (data/loaders.prepare_loader with
    num_replicas=1) rebuilt to yield this replica's part of each global batch; None where its order is not the
    seeded one (a custom sampler or batch sampler, an IterableDataset), which cannot be dealt this way.

    Batches are drawn in this process (no loader workers): a part is known only once its step's quorum is."""
    batch_sampler = getattr(prepared, "batch_sampler", None)
    if not isinstance(batch_sampler, ResumableBatchSampler) or not isinstance(batch_sampler.sampler, EpochSampler):
        return None
    slices = ReplicaSlices(batch_sampler.sampler, batch_sampler.batch_size * replica_groups, batch_sampler.drop_last,
                           quorum)
    loader = DataLoader(prepared.dataset, batch_sampler=slices, collate_fn=prepared.collate_fn,
                        pin_memory=prepared.pin_memory)
    return loader, StepBatches(loader, slices)
