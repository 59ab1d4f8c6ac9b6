"""How many batches a loop runs, in which order they come, and after which of them a fit validates."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchyard.trainer.errors import MisconfigurationError


def batch_limit(loader: DataLoader, limit: int | float, length: int | float | None = None) -> int | float:
    """How many batches of `loader` (or of `length` batches) a stage runs: a count, or a fraction of its
    length (math.inf: until exhausted)."""
    if length is None:
        try:
            length = len(loader)
        except TypeError:  # an IterableDataset without __len__
            length = math.inf
    if isinstance(limit, int) and not isinstance(limit, bool):
        return int(min(limit, length))
    if length != math.inf:
        if 0 < length * limit < 1:  # a fraction that rounds to no batch is a mistake, not a wish to skip
            raise MisconfigurationError(
                f"a batch limit of {limit} is less than one of this dataloader's {length} batches; use at least "
                f"{1 / length:.3g}, a count (an int), or 0 to run none."
            )
        return int(length * limit)
    if limit not in (0.0, 1.0):
        raise MisconfigurationError(
            f"a batch limit of {limit} (a fraction) needs a dataloader with a length; this one has none, "
            "so give a batch count (an int) instead."
        )
    return math.inf if limit == 1.0 else 0


def training_batches(loader: DataLoader, limit: int | float) -> int | float:
    """batch_limit for a fit's training loader, which must give at least one batch: none is an error saying why."""
    num_batches = batch_limit(loader, limit)
    if num_batches == 0:
        raise MisconfigurationError(f"the training dataloader yields no batches: {_no_batches_cause(loader, limit)}.")
    return num_batches


def _no_batches_cause(loader: Any, limit: int | float) -> str:
    """Why a training dataloader gives no batch: what was given and the fix."""
    if limit == 0:
        return "limit_train_batches=0; give it a positive count or fraction"
    # The batch sampler holds batch_size and drop_last: the loader's own read None once ours replaced it.
    batches = getattr(loader, "batch_sampler", None)
    if not isinstance(batches, torch.utils.data.BatchSampler):  # a batch_sampler of the user's own
        return "its dataset or batch sampler is empty; check what the dataloader is given"
    try:
        samples = len(batches.sampler)  # each process's share under a DistributedSampler
    except TypeError:
        return "its dataset is empty; check what the dataloader is given"
    share = " on each process" if isinstance(batches.sampler, torch.utils.data.DistributedSampler) else ""
    if samples == 0:
        return f"its dataset has no samples{share}; check what the dataloader is given"
    if batches.drop_last and samples < batches.batch_size:
        return (f"drop_last=True drops the only batch, a partial one: batch_size={batches.batch_size} is larger than "
                f"the {samples} samples{share}; lower batch_size to at most {samples}, or set drop_last=False")
    return "its dataset is empty; check what the dataloader is given"


def val_every(interval: int | float, num_batches: int | float) -> int | float:
    """The training batches between validations that val_check_interval (a count, or a share of an epoch) asks for."""
    if isinstance(interval, float) and num_batches == math.inf:
        if interval != 1.0:
            raise MisconfigurationError(
                f"val_check_interval={interval} is a fraction of an epoch, but the training dataloader has no "
                "length; give a batch count (an int) or 1.0 (validate at each epoch end)."
            )
        return math.inf
    if isinstance(interval, float):
        return max(1, int(num_batches * interval))
    if interval > num_batches:
        raise MisconfigurationError(
            f"val_check_interval={interval} batches is more than the {num_batches} training batches of an epoch, so "
            "it would never validate mid-epoch; use at most that many (validation at each epoch end is 1.0), or "
            "limit_val_batches=0 to turn validation off."
        )
    return max(1, interval)


def validates_after(batches: int, val_every: int | float, window: int) -> bool:
    """Whether a mid-epoch validation follows the epoch's first `batches` batches: at the first step boundary
    at or after each multiple of `val_every`. Never inside an accumulation `window`: a checkpoint saved after
    the validation would lack the window's pending gradients, and a resume from it would not match."""
    return batches % window == 0 and batches // val_every > (batches - window) // val_every


def epoch_batches(loader: DataLoader, start: int, num_batches: int | float) -> Iterator[tuple[int, Any, bool]]:
    """(batch_idx, batch, is_last) for the epoch's batches from `start` on.

    With a known length nothing is fetched beyond the last batch; without one (an IterableDataset) the
    next batch is fetched one step early, the only way to know that the current one ends the epoch (its
    accumulated gradients must be stepped on, and not leak into the next epoch).
    """
    if num_batches != math.inf:
        # zip stops on the range first, so the loader is never asked for a batch past the limit; built from
        # iterators alone, with no Python frame of ours between the loader and each batch.
        last = itertools.chain(itertools.repeat(False, int(num_batches) - start - 1), (True,))
        return zip(range(start, int(num_batches)), loader, last)
    return _unsized_epoch_batches(loader, start)


def _unsized_epoch_batches(loader: DataLoader, start: int) -> Iterator[tuple[int, Any, bool]]:
    iterator = iter(loader)
    try:
        batch = next(iterator)
    except StopIteration:
        return
    batch_idx = start
    for following in iterator:
        yield batch_idx, batch, False
        batch, batch_idx = following, batch_idx + 1
    yield batch_idx, batch, True


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if type(batch) is list or type(batch) is tuple:
        # The default collate's batch, at every step of a fit on an accelerator: its tensors moved in one
        # comprehension rather than a call and a generator each (docs/benchmarks.md, tenth session).
        moved = [
            value.to(device, non_blocking=non_blocking) if type(value) is torch.Tensor
            else move_to_device(value, device, non_blocking)
            for value in batch
        ]
        return moved if type(batch) is list else tuple(moved)
    if isinstance(batch, dict):
        return type(batch)({k: move_to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device, non_blocking) for v in batch)
    return batch
