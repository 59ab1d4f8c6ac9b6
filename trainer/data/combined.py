"""Several loaders read as one (Lightning's CombinedLoader), and a plain iterable of batches read as a loader."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from torchyard.trainer.errors import MisconfigurationError

#: How a CombinedLoader's batches end, as in Lightning: "max_size_cycle" at the longest loader's end, restarting
#: the shorter ones; "min_size" at the shortest's end; "max_size" at the longest's end, with None for the loaders
#: already done; "sequential" one loader after the other (evaluation only).
MODES = ("max_size_cycle", "min_size", "max_size", "sequential")
TRAINING_MODES = MODES[:3]


class CombinedLoader:
    """Lightning's CombinedLoader: `iterables` (a list, tuple or dict of loaders) read together in `mode`.

    Iterating it yields `(batch, batch_idx, dataloader_idx)` as Lightning's does; a batch is a list (or dict)
    holding one batch of each loader (for "sequential": one loader's batch). Given to `fit` as the training data,
    training_step gets the combined batch; a plain list or dict of training loaders is read as
    `CombinedLoader(loaders, "max_size_cycle")`, Lightning's default for training.
    """

    batch_sampler = None  # no single sampler: the run summary does not count samples from it

    def __init__(self, iterables: Any, mode: str = "min_size") -> None:
        if mode not in MODES:
            raise MisconfigurationError(f"CombinedLoader mode={mode!r} is not known; use one of {', '.join(MODES)}.")
        if not isinstance(iterables, (list, tuple, Mapping)):
            iterables = [iterables]
        if not iterables:
            raise MisconfigurationError("CombinedLoader got no loaders; give a list or dict of at least one.")
        self.iterables, self.mode = iterables, mode

    @property
    def flattened(self) -> list[Any]:
        """The loaders, in order (a dict's in its key order)."""
        return list(self.iterables.values()) if isinstance(self.iterables, Mapping) else list(self.iterables)

    def map(self, function: Callable[[Any], Any]) -> CombinedLoader:
        """The same combination of `function(loader)` for each loader (e.g. each prepared for this rank)."""
        if isinstance(self.iterables, Mapping):
            return CombinedLoader({key: function(loader) for key, loader in self.iterables.items()}, self.mode)
        return CombinedLoader([function(loader) for loader in self.iterables], self.mode)

    @property
    def num_workers(self) -> int:
        return max(getattr(loader, "num_workers", 0) for loader in self.flattened)

    def lengths(self) -> list[int]:
        """Each loader's number of batches (a TypeError where one has no length)."""
        return [len(loader) for loader in self.flattened]

    def __len__(self) -> int:
        lengths = self.lengths()
        if self.mode == "min_size":
            return min(lengths)
        return sum(lengths) if self.mode == "sequential" else max(lengths)

    def batches(self) -> Iterator[Any]:
        """The combined batches alone (what the fit loop gives training_step)."""
        if self.mode == "sequential":
            return (batch for loader in self.flattened for batch in loader)
        loaders = self.flattened
        if self.mode == "min_size":
            rows: Iterator[tuple[Any, ...]] = zip(*loaders)
        elif self.mode == "max_size":
            rows = itertools.zip_longest(*loaders)
        else:
            rows = _cycled_rows(loaders, self._cycle_length())
        return (self._packed(row) for row in rows)

    def _cycle_length(self) -> int | None:
        try:
            return max(self.lengths())
        except TypeError:  # an unsized loader: cycle the others until it ends
            return None

    def _packed(self, row: tuple[Any, ...]) -> Any:
        if isinstance(self.iterables, Mapping):
            return dict(zip(self.iterables.keys(), row))
        return list(row)

    def __iter__(self) -> Iterator[tuple[Any, int, int]]:
        if self.mode != "sequential":
            return ((batch, batch_idx, 0) for batch_idx, batch in enumerate(self.batches()))
        return ((batch, batch_idx, index) for index, loader in enumerate(self.flattened)
                for batch_idx, batch in enumerate(loader))

    def set_epoch(self, epoch: int, set_loader_epoch: Callable[[Any, int], None]) -> None:
        for loader in self.flattened:
            set_loader_epoch(loader, epoch)


def _cycled_rows(loaders: list[Any], length: int | None) -> Iterator[tuple[Any, ...]]:
    """Rows of one batch per loader until the longest ends (`length` rows; None: until an unsized one ends), each
    shorter loader started again when it runs out."""
    iterators = [iter(loader) for loader in loaders]
    count = 0
    while length is None or count < length:
        row = []
        for index, loader in enumerate(loaders):
            try:
                row.append(next(iterators[index]))
            except StopIteration:
                if length is None and not _sized(loader):
                    return
                iterators[index] = iter(loader)
                row.append(next(iterators[index]))
        yield tuple(row)
        count += 1


def _sized(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


class _BatchList(Dataset):
    """A list of ready batches as a dataset whose samples are those batches."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]


class _BatchStream(IterableDataset):
    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def only_item(items: list[Any]) -> Any:
    """The collate function of a loader of ready batches: its one 'sample' is the batch itself."""
    return items[0]


def batches_as_loader(batches: Iterable[Any]) -> DataLoader:
    """A DataLoader over an iterable of ready batches (Lightning takes a plain list as a loader): sized ones are
    sharded, shuffled and resumed like any map-style loader (one batch per index); a generator streams as is."""
    if isinstance(batches, (list, tuple)) or _sized(batches) and hasattr(batches, "__getitem__"):
        return DataLoader(_BatchList(list(batches)), batch_size=1, collate_fn=only_item)
    return DataLoader(_BatchStream(batches), batch_size=None)


def is_loader(value: Any) -> bool:
    return isinstance(value, (DataLoader, CombinedLoader))


def as_loader(value: Any, what: str) -> DataLoader | CombinedLoader:
    """`value` as one loader: a DataLoader or CombinedLoader as it is, any other iterable as a loader of its
    batches."""
    if is_loader(value):
        return value
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise MisconfigurationError(
            f"{what} must be a DataLoader, a list of them, or an iterable of batches; got {type(value).__name__}.")
    return batches_as_loader(value)


def as_loader_list(loaders: Any, what: str) -> list[DataLoader]:
    """None / a loader / a list or dict of loaders / a sequential CombinedLoader / an iterable of batches as a list
    of loaders, with a clear error for anything else."""
    if loaders is None:
        return []
    if isinstance(loaders, CombinedLoader):
        if loaders.mode != "sequential":
            raise MisconfigurationError(f"{what}: a CombinedLoader here must use mode='sequential' (each loader "
                                        f"evaluated on its own), not {loaders.mode!r}.")
        return [as_loader(loader, what) for loader in loaders.flattened]
    several = list(loaders.values()) if isinstance(loaders, Mapping) else loaders
    if isinstance(several, (list, tuple)) and several and all(is_loader(item) for item in several):
        return [as_loader(item, what) for item in several]
    return [as_loader(loaders, what)]


def training_loader(loaders: Any) -> DataLoader | CombinedLoader:
    """fit's training data as one loader: a list or dict of loaders read together as Lightning reads them
    (CombinedLoader, mode 'max_size_cycle'), anything else as `as_loader` takes it."""
    what = "train_dataloaders"
    if isinstance(loaders, CombinedLoader):
        if loaders.mode not in TRAINING_MODES:
            raise MisconfigurationError(f"fit does not take a CombinedLoader with mode={loaders.mode!r} (as in "
                                        f"Lightning); use one of {', '.join(TRAINING_MODES)}.")
        return loaders.map(lambda loader: as_loader(loader, what))
    several = list(loaders.values()) if isinstance(loaders, Mapping) else loaders
    if isinstance(several, (list, tuple)) and several and all(is_loader(item) for item in several):
        return CombinedLoader(loaders, "max_size_cycle")
    return as_loader(loaders, what)
