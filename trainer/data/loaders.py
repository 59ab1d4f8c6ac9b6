"""How a strategy's loaders are built: sharded, seeded per epoch, resumable mid-epoch."""

from __future__ import annotations

import dataclasses
import itertools
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from torchyard.trainer.cluster.environment import usable_cores
from torchyard.trainer.data.combined import CombinedLoader, as_loader_list, training_loader
from torchyard.trainer.data.samplers import EpochSampler, ResumableBatchSampler, ShardedSampler
from torchyard.trainer.datamodule import DataModule
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.module import BatchTransferHooks, TrainModule, overridden

if TYPE_CHECKING:
    from torchyard.trainer.config import TrainerConfig
    from torchyard.trainer.strategies.base import Strategy


TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def batch_mover(strategy: Strategy, module: TrainModule, datamodule: DataModule | None,
                dataloader_idx: int) -> Callable[[Any], Any]:
    """How the batches of loader `dataloader_idx` reach the device: the strategy's move, or the batch-transfer
    hooks where the datamodule or the module overrides one (looked up once per stage, not per batch)."""
    hooks = [_transfer_hook(name, module, datamodule) for name in TRANSFER_HOOKS]
    if not any(hooks):
        return strategy.batch_to_device
    before, transfer, after = hooks

    def move(batch: Any) -> Any:
        if before is not None:
            batch = before(batch, dataloader_idx)
        batch = (
            strategy.batch_to_device(batch)
            if transfer is None
            else transfer(batch, strategy.root_device, dataloader_idx)
        )
        return batch if after is None else after(batch, dataloader_idx)

    return move


def _transfer_hook(name: str, module: TrainModule, datamodule: DataModule | None) -> Callable[..., Any] | None:
    hooks = [
        hook
        for hook in (overridden(datamodule, name, BatchTransferHooks), overridden(module, name, BatchTransferHooks))
        if hook is not None
    ]
    if len(hooks) == 2:
        warnings.warn(f"both {type(datamodule).__name__} and {type(module).__name__} define {name}; the datamodule's "
                      "is called, as in Lightning.", stacklevel=2)
    return hooks[0] if hooks else None


# --------------------------------------------------------------------------- loaders


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the first tensor in a batch (the weight of its logged means); 1 without one."""
    return _first_tensor_size(batch) or 1


def _first_tensor_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, field.name) for field in dataclasses.fields(batch)]
    elif isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):  # strings and other leaves say nothing about the batch's size
        for item in batch:
            size = _first_tensor_size(item)
            if size is not None:
                return size
    return None


def samples_in_batches(loader: DataLoader, start: int, end: int) -> int | None:
    """How many samples batches [start, end) of one pass over `loader` hold, worked out from its batch size and
    sampler length (so nobody measures batches); None when those are unknown (a custom or unsized sampler)."""
    batch_sampler = loader.batch_sampler
    batch_size, sampler = getattr(batch_sampler, "batch_size", None), getattr(batch_sampler, "sampler", None)
    try:
        available = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        return None
    if not isinstance(batch_size, int):
        return None
    return min(end * batch_size, available) - min(start * batch_size, available)


class WorkerInit:
    """A loader worker's start: ignore SIGTERM and SIGHUP, then run the user's worker_init_fn.

    A job's SIGTERM (SLURM signals every process of the job), or the SIGHUP of a closed terminal (sent to its
    whole process group), would otherwise kill the workers at once, and the training process, which saves a
    checkpoint at its next step boundaries (faults.py), would fail on its next batch instead. Workers still
    end with the training process.
    """

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if self.user_init is not None:
            self.user_init(worker_id)


def loader_kwargs(loader: DataLoader, pin_memory: bool | None) -> dict[str, Any]:
    user_init = loader.worker_init_fn
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory if pin_memory is None else (pin_memory or loader.pin_memory),
        "timeout": loader.timeout,
        "worker_init_fn": user_init if isinstance(user_init, WorkerInit) else WorkerInit(user_init),
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def prepare_loader(
    loader: DataLoader,
    *,
    train: bool,
    num_replicas: int = 1,
    rank: int = 0,
    seed: int = 0,
    pin_memory: bool | None = None,
    own_order: bool = False,
) -> DataLoader:
    """Rebuild `loader` for one rank.

    Training with `own_order` (a job of one process): the loader's own sampler and generator, so that a shuffle
    draws from the global RNG as each epoch starts, as in a plain loop (the fit loop keeps that RNG state, from
    which a mid-epoch resume draws the order again). Otherwise the order is a function of (seed, epoch) only,
    the same on every rank. `skip` and `set_epoch` live on its batch sampler. Evaluation: each rank takes a
    disjoint, unpadded slice, so metrics count every sample once.
    """
    if not isinstance(loader, DataLoader):
        raise MisconfigurationError(f"expected a torch DataLoader, got {type(loader).__name__}.")
    if isinstance(loader.dataset, IterableDataset):
        if num_replicas > 1:
            warnings.warn("an IterableDataset is not sharded by the trainer: shard it by rank yourself.", stacklevel=2)
        return loader
    if type(loader) is not DataLoader:
        warnings.warn(
            f"{type(loader).__name__} is a DataLoader subclass; it is used as is (not sharded, not resumable "
            "mid-epoch).", stacklevel=2,
        )
        return loader
    if loader.batch_size is None:
        # A custom batch_sampler: shard its batches instead of its indices.
        batch_sampler = (ShardedSampler(loader.batch_sampler, num_replicas, rank, padded=train) if num_replicas > 1
                         else loader.batch_sampler)
        return DataLoader(loader.dataset, batch_sampler=batch_sampler, **loader_kwargs(loader, pin_memory))
    sampler = _rank_sampler(loader, train, num_replicas, rank, seed, own_order)
    batch_sampler_cls = ResumableBatchSampler if train else BatchSampler
    batch_sampler = batch_sampler_cls(sampler, loader.batch_size, loader.drop_last)
    kwargs = loader_kwargs(loader, pin_memory)
    if train and kwargs["generator"] is None and not own_order:
        # Each iterator draws its workers' base seed from this generator; from the global RNG instead,
        # a run resumed mid-epoch would draw once more than the uninterrupted run and diverge.
        # Reseeded per epoch in set_epoch, so worker seeds depend on (seed, epoch) only.
        kwargs["generator"] = torch.Generator().manual_seed(seed)
        batch_sampler.generator_seed = seed
    return DataLoader(loader.dataset, batch_sampler=batch_sampler, **kwargs)


def _rank_sampler(loader: DataLoader, train: bool, num_replicas: int, rank: int, seed: int,
                  own_order: bool) -> Sampler[Any]:
    """This rank's sampler of `loader`'s indices (see prepare_loader)."""
    user_sampler = loader.sampler
    if train and own_order or num_replicas == 1 and not train:
        return user_sampler
    if train and isinstance(user_sampler, (RandomSampler, SequentialSampler)):
        shuffle = isinstance(user_sampler, RandomSampler)
        return EpochSampler(loader.dataset, num_replicas, rank, shuffle, seed, drop_last=loader.drop_last)
    if num_replicas == 1:
        return user_sampler
    if isinstance(user_sampler, RandomSampler) and user_sampler.generator is None:
        # Each rank would draw its own order, and their slices would overlap: all draw the same one.
        user_sampler = RandomSampler(loader.dataset, user_sampler.replacement, user_sampler._num_samples,
                                     generator=torch.Generator().manual_seed(seed))
    return ShardedSampler(user_sampler, num_replicas, rank, padded=train)


def set_epoch(loader: DataLoader | CombinedLoader, epoch: int) -> None:
    """Reseed the loader's order (and, where the trainer owns it, its worker-seed generator) for `epoch`."""
    if isinstance(loader, CombinedLoader):
        loader.set_epoch(epoch, set_epoch)
        return
    seed = getattr(loader.batch_sampler, "generator_seed", None)
    if seed is not None and loader.generator is not None:
        loader.generator.manual_seed(seed + epoch)
    for holder in (loader.batch_sampler, loader.sampler):
        if hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)
            return


# --------------------------------------------------------------------------- loader workers

#: Training batches timed once per fit, after the first (which also pays for starting the workers).
DATA_WAIT_WINDOW = 20
#: Waiting for data this share of the training time, and this many seconds a batch, is worth more workers.
DATA_BOUND_SHARE, DATA_BOUND_WAIT_S = 0.2, 0.001


def workers_per_process(local_processes: int) -> int:
    """Loader workers per training process that give each worker on this node a core of its own."""
    return max(1, usable_cores() // max(1, local_processes))


def worker_oversubscription(loader: DataLoader, what: str, local_processes: int) -> str | None:
    """A warning when `loader`'s workers, started by each of this node's processes, outnumber its cores.

    torch's DataLoader warns when one process's workers do; this is the case it cannot see, several processes
    whose workers fit the cores one by one but not together.
    """
    fitting = workers_per_process(local_processes)
    if loader.num_workers <= fitting or loader.num_workers > usable_cores():
        return None
    return (f"the {what} dataloader's num_workers={loader.num_workers} on each of {local_processes} process(es) "
            f"on this node starts {loader.num_workers * local_processes} loader processes for {usable_cores()} CPU "
            f"core(s), which then take turns with training; num_workers={fitting} fits this machine.")


def data_wait_advice(share: float, wait: float, num_workers: int, local_processes: int, device_type: str) -> str | None:
    """A warning when training waited for its batches (`share` of the time, `wait` seconds a batch) and more
    workers could load them meanwhile: where a GPU computes, so the process's cores idle during a step. On
    a CPU the steps already use every core, and workers would only take them away."""
    fitting = workers_per_process(local_processes)
    if device_type != "cuda" or share < DATA_BOUND_SHARE or wait < DATA_BOUND_WAIT_S or num_workers >= fitting:
        return None
    return (f"training waited for its dataloader {share:.0%} of the time ({wait * 1e3:.1f} ms a batch, over its "
            f"first batches) with num_workers={num_workers}; num_workers={fitting} would load batches while the "
            "GPU steps.")


def measure_data_wait(batches: Iterator[Any], report: Callable[[float, float], None],
                      window: int = DATA_WAIT_WINDOW) -> Iterator[Any]:
    """`batches` unchanged; once batches 1..window have been consumed, `report(share of the wall time spent
    waiting for them, seconds waited per batch)`. Later batches come straight from `batches`: nothing of
    this runs between them."""
    return itertools.chain(_timed_head(batches, window, report), batches)


_EXHAUSTED = object()


def _timed_head(batches: Iterator[Any], window: int, report: Callable[[float, float], None]) -> Iterator[Any]:
    for batch in batches:  # batch 0, untimed
        yield batch
        break
    started, waited, measured = time.perf_counter(), 0.0, 0
    while measured < window:
        asked = time.perf_counter()
        batch = next(batches, _EXHAUSTED)
        if batch is _EXHAUSTED:
            break
        waited += time.perf_counter() - asked
        measured += 1
        yield batch
    if measured:
        report(waited / (time.perf_counter() - started), waited / measured)


STAGE_LOADERS = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}
_LOADER_NAMES = {"validate": "validation", "test": "test", "predict": "predict"}


def own_loader(module: TrainModule, name: str) -> Callable[[], Any] | None:
    """The module's own `name` hook (train_dataloader, ...), where it defines one, as a LightningModule may."""
    return getattr(module, name) if callable(getattr(type(module), name, None)) else None


def stage_loaders(
    strategy: Strategy,
    stage: str,
    module: TrainModule,
    datamodule: DataModule | None,
    loaders: tuple[Any, ...],
    seed: int,
    datamodule_state: dict[str, Any] | None = None,
    config: TrainerConfig | None = None,
) -> list[DataLoader]:
    """The stage's data, in Lightning's order: prepare_data (once per node), the datamodule's setup, then the
    module's, then the loaders (for fit: training first, then validation) from `loaders`, else the datamodule,
    else the module's own hooks, each prepared for this rank by `strategy`. A checkpoint's `datamodule_state`
    is loaded after the datamodule's setup and before it builds the loaders, which may depend on it. Rank 0
    warns about workers that the node's processes start together beyond its cores."""
    preparers = [
        owner.prepare_data
        for owner in (datamodule, module)
        if owner is not None and type(owner).prepare_data not in (DataModule.prepare_data, TrainModule.prepare_data)
    ]
    if preparers:  # every rank sees the same classes, so all of them wait here or none does
        for prepare_data in preparers if strategy.local_rank == 0 else ():
            prepare_data()
        strategy.barrier("prepare_data")
    if datamodule is not None:
        datamodule.setup(stage)
        if datamodule_state is not None:
            datamodule.load_state_dict(datamodule_state)
    module.setup(stage)  # layers built here are then moved, wrapped and optimized like the others
    module.configure_model()
    return build_loaders(strategy, stage, module, datamodule, loaders, seed, config)


def prepare_for_rank(strategy: Strategy, loader: Any, train: bool, seed: int, config: TrainerConfig | None) -> Any:
    """`loader` (each of a CombinedLoader's) as `strategy` shards it for this rank; as given where the config says
    use_distributed_sampler=False, unshuffled for overfit_batches."""
    if isinstance(loader, CombinedLoader):
        return loader.map(lambda each: prepare_for_rank(strategy, each, train, seed, config))
    if config is not None and train and config.overfit_batches:
        loader = _unshuffled(loader)
    if config is not None and not config.use_distributed_sampler:
        return loader
    return strategy.prepare_loader(loader, train, seed)


def _unshuffled(loader: DataLoader) -> DataLoader:
    """`loader` in its dataset's order (overfit_batches trains on the same first batches each epoch)."""
    if not isinstance(loader.sampler, RandomSampler) or loader.batch_size is None:
        return loader
    warnings.warn("overfit_batches trains on the same batches every epoch, so the shuffling training dataloader is "
                  "read in order, as in Lightning.", stacklevel=4)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False, drop_last=loader.drop_last,
                      **loader_kwargs(loader, None))


def build_loaders(strategy: Strategy, stage: str, module: TrainModule, datamodule: DataModule | None,
                  loaders: tuple[Any, ...], seed: int, config: TrainerConfig | None = None) -> list[DataLoader]:
    """The stage's loaders (for fit: training first), from `loaders`, else the datamodule's hooks, else the
    module's, each prepared for this rank; called again for reload_dataloaders_every_n_epochs."""
    names = ["train_dataloader", "val_dataloader"] if stage == "fit" else [STAGE_LOADERS[stage]]
    if datamodule is not None:
        loaders = tuple(getattr(datamodule, name)() for name in names)
    else:
        hooks = [own_loader(module, name) for name in names]
        loaders = tuple(loader if loader is not None or hook is None else hook()
                        for loader, hook in itertools.zip_longest(loaders, hooks))
    if stage == "fit":
        if loaders[0] is None:
            raise MisconfigurationError("fit needs training data: train_dataloaders, a datamodule's or the module's "
                                        "train_dataloader().")
        val = as_loader_list(loaders[1] if len(loaders) > 1 else None, "val_dataloaders")
        named = [("training", training_loader(loaders[0]))] + [("validation", v) for v in val]
    else:
        named = [(_LOADER_NAMES[stage], loader) for loader in as_loader_list(loaders[0], f"{stage} dataloaders")]
    prepared = [prepare_for_rank(strategy, loader, what == "training", seed, config) for what, loader in named]
    for (what, _), loader in zip(named, prepared) if strategy.is_global_zero else ():
        warning = worker_oversubscription(loader, what, strategy.environment.local_world_size)
        if warning is not None:
            warnings.warn(warning, stacklevel=4)
    return prepared
