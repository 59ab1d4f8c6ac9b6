"""fsdp's checkpoint IO: full state dicts gathered to rank 0 in the project's one format, and sharded folders written
by every rank through torch.distributed.checkpoint (DCP).

A sharded checkpoint is a folder named like a checkpoint file (`last.ckpt/`) holding DCP's files (one
`__<rank>_0.distcp` per rank and `.metadata`) for the weights and the optimizer states, plus `trainer_state.pt`:
the rest of the checkpoint (counters, callbacks, RNG, hparams, ...) in the one format, with its tensor parts empty.
Optimizer states travel keyed by parameter name (DCP's layout, which reshards to any number of ranks); a full file
holds them keyed by index, as torch's `optimizer.state_dict()` does, so that every strategy loads it.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchyard.trainer.checkpointing.files import SHARDED_STATE_FILE, load_checkpoint_file, save_checkpoint_file
from torchyard.trainer.errors import CheckpointError

#: Gathered whole on rank 0 (the other ranks get empty dicts), on the host: a full checkpoint never needs a
#: device's memory for more than one tensor at a time beyond the shards.
FULL_ON_RANK_ZERO = StateDictOptions(full_state_dict=True, cpu_offload=True)
WHOLE_ON_EVERY_RANK = StateDictOptions(full_state_dict=True)
# Names that wrappers insert between a module and its parameters, which state dicts leave out.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


class ShardedPart(dict):
    """Stands, in a checkpoint read from a sharded folder, for a part DCP holds there (the weights, or optimizer
    `index`); empty, so that code walking the checkpoint sees no tensors."""

    def __init__(self, folder: Path, index: int | None = None) -> None:
        super().__init__()
        self.folder, self.index = folder, index


# --------------------------------------------------------------------------- full state dicts


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The state-dict name of each of `optimizer`'s parameters, in its param_groups' order."""
    names = {}
    for name, parameter in module.named_parameters():
        for segment in _WRAPPER_SEGMENTS:
            name = name.replace(segment, "")
        names[id(parameter)] = name
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def indexed_optimizer_state(named: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (DCP's layout) in torch's own layout, keyed by index."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in named.get("state", {}).items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in named["param_groups"]],
    }


def named_optimizer_state(indexed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of indexed_optimizer_state: torch's layout, keyed by parameter name."""
    try:
        return {
            "state": {names[int(i)]: value for i, value in indexed.get("state", {}).items()},
            "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                             for group in indexed["param_groups"]],
        }
    except (IndexError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"the saved optimizer state does not fit this optimizer's {len(names)} parameters") from err


def full_model_state(module: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The whole model under plain keys on rank 0, on the host ({} elsewhere); with `every_rank`, on every rank,
    on its device. A collective."""
    return get_model_state_dict(module, options=WHOLE_ON_EVERY_RANK if every_rank else FULL_ON_RANK_ZERO)


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state in torch's layout on rank 0, on the host ({} elsewhere). A collective."""
    named = get_optimizer_state_dict(module, optimizer, options=FULL_ON_RANK_ZERO)
    return indexed_optimizer_state(named, parameter_names(module, optimizer)) if named else {}


def load_full_model_state(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Shard a whole model's weights, which every rank holds, into `module`'s parameters."""
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, state_dict, options=options)


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Shard a whole optimizer state in torch's layout (from any strategy), which every rank holds, into `optimizer`."""
    named = named_optimizer_state(state, parameter_names(module, optimizer))
    set_optimizer_state_dict(module, optimizer, named, options=WHOLE_ON_EVERY_RANK)


# --------------------------------------------------------------------------- sharded folders


def save_sharded(checkpoint: dict[str, Any], path: Path, is_zero: bool, barrier: Any) -> Path:
    """Every rank writes its shards of the checkpoint's weights and optimizer states to `<path>.tmp/`, rank 0 the
    rest of it, then rank 0 renames the folder to `path`: a crash at any moment leaves the previous one whole."""
    tmp = path.with_name(path.name + ".tmp")
    if is_zero:
        remove_path(tmp)
        tmp.mkdir(parents=True)
    barrier()
    optimizers = checkpoint.get("optimizer_states")
    tensors: dict[str, Any] = {"model": checkpoint["state_dict"]}
    if optimizers is not None:
        tensors["optimizers"] = {str(i): state for i, state in enumerate(optimizers)}
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))  # returns once every rank wrote
    if is_zero:
        rest = {**checkpoint, "state_dict": {}}
        if optimizers is not None:
            rest["optimizer_states"] = [{} for _ in optimizers]
        save_checkpoint_file(rest, tmp / SHARDED_STATE_FILE)
        replace_folder(tmp, path)
    barrier()
    return path


def read_sharded(folder: Path, map_location: Any) -> dict[str, Any]:
    """A sharded folder's checkpoint, its weights and optimizer states standing as ShardedParts (loaded by
    load_sharded_model / load_sharded_optimizer once the model is sharded)."""
    check_complete(folder)
    checkpoint = load_checkpoint_file(folder / SHARDED_STATE_FILE, map_location=map_location)
    checkpoint["state_dict"] = ShardedPart(folder)
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [ShardedPart(folder, i) for i in range(len(checkpoint["optimizer_states"]))]
    return checkpoint


def load_sharded_model(module: nn.Module, folder: Path) -> None:
    """The folder's weights into `module`'s shards (DCP reshards them to this run's ranks)."""
    state = {"model": get_model_state_dict(module)}
    _dcp_load(state, folder)
    set_model_state_dict(module, state["model"])


def load_sharded_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, part: ShardedPart) -> None:
    """Optimizer `part.index`'s state from the folder into `optimizer` (resharded as the weights)."""
    key = str(part.index)
    state = {"optimizers": {key: get_optimizer_state_dict(module, optimizer)}}
    _dcp_load(state, part.folder)
    set_optimizer_state_dict(module, optimizer, state["optimizers"][key])


def _dcp_load(state: dict[str, Any], folder: Path) -> None:
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    except (RuntimeError, ValueError, KeyError) as err:  # DCP's CheckpointException is a BaseException subclass
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(f"sharded checkpoint {str(folder)!r} does not fit this model ({detail}).") from err


def check_complete(folder: Path) -> None:
    """A clear error for a folder missing DCP's metadata or a rank's file (every rank must have written), or holding
    values that only full unpickling could build. DCP itself unpickles `.metadata` and non-tensor values fully (and
    tensors with weights_only); every load goes through this check first, so nothing in the folder runs code."""
    if not (folder / ".metadata").is_file() or not (folder / SHARDED_STATE_FILE).is_file():
        raise CheckpointError(f"{str(folder)!r} is not a whole sharded checkpoint: it lacks .metadata or "
                              f"{SHARDED_STATE_FILE}; give a folder that fsdp's checkpoint='sharded' wrote.")
    metadata = _read_metadata(folder)
    stored = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(name for name in stored if not (folder / name).is_file())
    if missing:
        raise CheckpointError(f"sharded checkpoint {str(folder)!r} is missing {', '.join(missing)} (a rank's shard: "
                              "copy the whole folder from where every rank wrote it).")
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                value = f.read(info.length)
            try:
                torch.load(io.BytesIO(value), weights_only=True)
            except Exception as err:  # noqa: BLE001 - whatever the weights-only unpickler refuses
                raise CheckpointError(f"sharded checkpoint {str(folder)!r}: {index.fqn} holds objects that only full "
                                      "unpickling could build, which could run code, so it was refused.") from err


# What DCP's .metadata pickle is made of (torch 2.13): its dataclasses, tensor sizes, dtypes and layouts, paths.
_METADATA_CLASSES = {
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _METADATA_CLASSES
            or module == "torch.distributed.checkpoint.metadata"
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def _read_metadata(folder: Path) -> Metadata:
    try:
        with open(folder / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise CheckpointError(f"sharded checkpoint {str(folder)!r}: its .metadata is corrupt or holds objects other "
                              f"than DCP's ({err}); it was not loaded.") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"sharded checkpoint {str(folder)!r}: its .metadata is not DCP's.")
    return metadata


def convert_to_file(folder: Path, out: Path) -> Path:
    """A sharded folder as one full checkpoint file, which every strategy and load_from_checkpoint read."""
    check_complete(folder)
    checkpoint = load_checkpoint_file(folder / SHARDED_STATE_FILE)
    gathered = out.with_name(out.name + ".dcp.tmp")
    try:
        dcp_to_torch_save(folder, gathered)
        tensors = torch.load(gathered, weights_only=True)
    finally:
        gathered.unlink(missing_ok=True)
    checkpoint["state_dict"] = tensors["model"]
    if "optimizer_states" in checkpoint:
        named = [tensors["optimizers"][str(i)] for i in range(len(checkpoint["optimizer_states"]))]
        # DCP lists each group's parameters by name, in the optimizer's order: the indices torch's layout uses.
        checkpoint["optimizer_states"] = [
            indexed_optimizer_state(state, [name for group in state["param_groups"] for name in group["params"]])
            for state in named
        ]
    return save_checkpoint_file(checkpoint, out)


# --------------------------------------------------------------------------- folder names


def replace_folder(tmp: Path, path: Path) -> None:
    """Give `tmp` the name `path`. A folder cannot be renamed over another: the old one steps aside to
    `<path>.old` first, so between the two renames the previous checkpoint is whole under that name."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        remove_path(old)
        os.replace(path, old)
    os.replace(tmp, path)
    remove_path(old)


def link_folder(source: Path, path: Path) -> None:
    """Give the folder `source` the name `path` too: hard links to its files (a copy where links fail)."""
    tmp = path.with_name(path.name + ".tmp")
    remove_path(tmp)
    try:
        shutil.copytree(source, tmp, copy_function=os.link)
    except OSError:
        remove_path(tmp)
        shutil.copytree(source, tmp)
    replace_folder(tmp, path)


def remove_path(path: Path) -> None:
    """Delete a checkpoint file or sharded folder, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
