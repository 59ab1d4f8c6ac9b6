"""Evaluation and prediction across ranks: which batches each rank was dealt (every rank must get one), and how the
ranks' outputs merge back in order."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from torchyard.trainer.data.batches import batch_limit
from torchyard.trainer.data.loaders import loader_kwargs
from torchyard.trainer.data.samplers import ShardedSampler
from torchyard.trainer.errors import MisconfigurationError


def shard_batches(loader: DataLoader) -> tuple[int, list[int]] | None:
    """(how many batches the loader had before `prepare_loader` sliced it into this rank's `loader`, each
    data-parallel rank's batch count of its slice): every rank can work them all out alone. None where the
    loader was not sliced (every rank runs it whole)."""
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, ShardedSampler):  # a custom batch_sampler: whole batches were dealt out
        whole, replicas = batch_sampler.sampler, batch_sampler.num_replicas
        return len(whole), [len(ShardedSampler(whole, replicas, rank)) for rank in range(replicas)]  # type: ignore[arg-type]
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, ShardedSampler):
        return None
    whole, replicas = sampler.sampler, sampler.num_replicas
    return (_batches_of(len(whole), batch_sampler),  # type: ignore[arg-type]
            [_batches_of(len(ShardedSampler(whole, replicas, rank)), batch_sampler) for rank in range(replicas)])


def _batches_of(samples: int, batch_sampler: BatchSampler) -> int:
    size = batch_sampler.batch_size
    return samples // size if batch_sampler.drop_last else math.ceil(samples / size)


class _RecordingBatchSampler:
    """A batch sampler that also appends each batch of indices it hands the loader to `drawn` (the loader draws
    them in the main process, ahead of the batches when workers prefetch, so batch i's are `drawn[i]`)."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler, self.drawn = batch_sampler, []

    def __iter__(self) -> Iterator[Any]:
        for indices in self.batch_sampler:
            self.drawn.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.batch_sampler)


def recording_batch_indices(loader: DataLoader) -> tuple[DataLoader, list[list[int]] | None]:
    """A loader giving the same batches as `loader`, and the list that the dataset indices of each batch it
    yields are appended to; `loader` itself and None where they cannot be known (an IterableDataset, a
    DataLoader subclass, a loader without a batch sampler)."""
    if (type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset)
            or loader.batch_sampler is None):
        return loader, None
    recording = _RecordingBatchSampler(loader.batch_sampler)
    return DataLoader(loader.dataset, batch_sampler=recording, **loader_kwargs(loader, None)), recording.drawn


def merge_prediction_shares(shares: list[list[Any]], loader: DataLoader) -> list[Any]:
    """One loader's predictions from every data-parallel rank (`shares[r]`: rank r's batch outputs, from its
    slice of `loader`) as one process would have made them: in the loader's order, in its batch size.

    Evaluation loaders give rank r every world_size-th sample (or batch) from position r (ShardedSampler), so
    a sample's position is known from its rank and place. Re-cutting batches needs outputs that are tensors
    (or lists, tuples, dicts of them) with one row per sample; other outputs come back batch by batch in
    turn over the ranks, with a warning. A loader the trainer did not shard ran whole on every rank: rank 0's
    outputs are returned.
    """
    replicas, batch_sampler = len(shares), loader.batch_sampler
    if isinstance(batch_sampler, ShardedSampler):  # a custom batch_sampler: whole batches were dealt out
        return _interleave_batches(shares)
    if not isinstance(getattr(batch_sampler, "sampler", None), ShardedSampler):
        return shares[0]
    batch_size, ordered = batch_sampler.batch_size, batch_sampler.sampler.sampler
    tables = {rank: _rows(share) for rank, share in enumerate(shares) if share}
    # Rank r's slice holds the positions r, r + replicas, ...; of it, the first len(shares[r]) batches ran.
    expected = {
        rank: min(len(shares[rank]) * batch_size, len(ShardedSampler(ordered, replicas, rank))) for rank in tables
    }
    rows_per_sample = all(
        table is not None and table[0][0].shape[0] == expected[rank] for rank, table in tables.items()
    )
    structures = [table[1] for table in tables.values() if table is not None]
    if not rows_per_sample or any(structure != structures[0] for structure in structures):
        warnings.warn(
            f"predict_step's outputs are not tensors with one row per sample, so the {replicas} ranks' "
            "predictions cannot be put back in dataset order: they come batch by batch, in turn over the ranks.",
            stacklevel=2,
        )
        return _interleave_batches(shares)
    if not tables:
        return []
    positions = torch.cat([rank + replicas * torch.arange(expected[rank]) for rank in tables])
    order = positions.argsort()
    columns = [table[0] for table in tables.values() if table is not None]
    leaves = [torch.cat([rank_columns[leaf] for rank_columns in columns])[order] for leaf in range(len(columns[0]))]
    return [
        pytree.tree_unflatten(list(batch), structures[0]) for batch in zip(*(leaf.split(batch_size) for leaf in leaves))
    ]


def _interleave_batches(shares: list[list[Any]]) -> list[Any]:
    """Batch b of one pass came from rank b % len(shares)."""
    return [share[index] for index in range(max(map(len, shares), default=0)) for share in shares if index < len(share)]


def _rows(share: list[Any]) -> tuple[list[torch.Tensor], Any] | None:
    """A rank's outputs as per-leaf tensors of all its samples, and their common structure; None when some
    output is not made of tensors with one row per sample."""
    structure = pytree.tree_flatten(share[0])[1]
    columns: list[list[torch.Tensor]] = [[] for _ in range(structure.num_leaves)]
    for output in share:
        leaves, spec = pytree.tree_flatten(output)
        sizes = {leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.ndim else None for leaf in leaves}
        if spec != structure or not leaves or None in sizes or len(sizes) > 1:
            return None
        for column, leaf in zip(columns, leaves):
            column.append(leaf)
    return [torch.cat(column) for column in columns], structure


def check_every_rank_evaluates(loader: DataLoader, limit: int | float, hook: str, index: int | None) -> None:
    """A clear error, on every rank alike, where some data-parallel rank's slice of `loader` holds no batch:
    that rank would never join the others' end-of-epoch reduction of what they logged, and they would wait
    for it until the collective timeout."""
    sliced = shard_batches(loader)
    if sliced is None:
        return
    counts = sliced[1]
    limited = [batch_limit(loader, limit, count) for count in counts]
    if max(limited) > 0 and min(limited) == 0:
        idle = [rank for rank, count in enumerate(limited) if count == 0]
        which = f"{hook} dataloader" + (f" {index}" if index is not None else "")
        raise MisconfigurationError(
            f"the {which} gives {len(counts)} data-parallel processes {sum(counts)} batch(es) in all, so rank(s) "
            f"{', '.join(map(str, idle))} would get none and the others would wait for them at the epoch's end; "
            f"give it at least {len(counts)} samples (or batches), or use fewer devices."
        )


def check_several_loaders(module: Any, step_name: str, loaders: list[DataLoader]) -> bool:
    """True for several loaders, after checking that the step takes the `dataloader_idx` it then gets."""
    if len(loaders) < 2:
        return False
    step = getattr(module, step_name)
    try:
        inspect.signature(step).bind(None, 0, 0)
    except TypeError:
        raise MisconfigurationError(
            f"{len(loaders)} dataloaders were given, but {type(module).__name__}.{step_name} takes no dataloader_idx; "
            f"define it as {step_name}(self, batch, batch_idx, dataloader_idx=0)."
        ) from None
    return True
