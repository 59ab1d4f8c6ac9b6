"""Checkpoint files: one format for every strategy, written atomically, read with weights_only=True.
The keys of the format and the durability rules are in docs/checkpoints.md."""

from __future__ import annotations

import collections
import os
import pickle
import re
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.errors import CheckpointError, MisconfigurationError
from trainer.logging import run_folder
from trainer.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from trainer.trainer import Trainer

CHECKPOINT_VERSION = 1


def save_checkpoint_file(checkpoint: Any, path: str | Path) -> Path:
    """torch.save `checkpoint` to `path` so that a crash at any moment, a power loss included, leaves the
    previous file intact: written to a temporary file, fsynced, then renamed over `path`.

    The folder is not synced after each rename (sync_folder does it; the strategy calls it once as its stage
    ends): that costs a journal commit per file, the largest part of an epoch-end checkpoint of a small model,
    and guards only the newest file's name; a power loss before the next commit leaves the previous name and
    file, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def link_checkpoint_file(source: str | Path, path: str | Path) -> Path:
    """Give the file `source` the name `path` as well, atomically: a hard link (no second write; files are only
    ever replaced, never changed in place, so the two names cannot diverge), or a copy where links fail."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def sync_folder(folder: str | Path) -> None:
    """Make the renames into `folder` durable (where the filesystem lets a folder be synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint_file(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint safely: nothing in the file can run code; bad files raise CheckpointError.
    `mmap`: tensors stay in the file until used (reading a checkpoint's counters costs no tensor reads)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is a folder; give a checkpoint file in it.")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if line.strip()]
        # Garbage (whatever opcode the unpickler took its first byte for), or a torch file whose pickle is
        # damaged (an "Unsupported operand"): no refused class to name, the file is corrupt.
        if not _starts_like_torch_file(path) or not any("Unsupported global" in line for line in lines):
            raise _corrupt(path, err) from err
        # torch's message is a page of advice; the line naming the refused class is the one to show.
        reason = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else type(err).__name__)
        reason = reason.split(". Please use")[0]  # the rest advises trusting the file, which it is our job not to do
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds objects that only full unpickling could build, which could run "
            f"arbitrary code, so it was refused ({reason[:200]}). Save plain tensors and containers."
        ) from err
    # The weights-only unpickler takes any bytes for opcodes and trusts them: on garbage it indexes an
    # empty stack or memo, unpacks short fields or hashes a list (IndexError, KeyError, struct.error, TypeError).
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError, IndexError, TypeError,
            struct.error) as err:
        raise _corrupt(path, err) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a trainer checkpoint (no 'state_dict' key).")
    return checkpoint


def saved_position(path: Path, resumable: bool = True) -> tuple[int, int, int] | None:
    """How far the run had trained when `path` was saved (global step, epochs done, batches into the next),
    read without reading its tensors; None for a checkpoint that holds no position, or (`resumable`) that no
    fit can resume from (weights-only). A file that does not load raises CheckpointError, saying why."""
    checkpoint = load_checkpoint_file(path, mmap=True)
    progress = checkpoint.get("loops", {}).get("progress") if isinstance(checkpoint.get("loops"), dict) else None
    try:
        if progress is None and not resumable:  # a weights-only file: Lightning's top-level counters
            return int(checkpoint["global_step"]), int(checkpoint["epoch"]), 0
        done = bool(progress["epoch_done"])
        return int(progress["global_step"]), int(progress["epoch"]) + done, 0 if done else int(progress["epoch_batches"])
    except (KeyError, TypeError, ValueError):
        return None


def _corrupt(path: Path, err: BaseException) -> CheckpointError:
    if not _starts_like_torch_file(path):
        detail = "it is neither a zip archive nor a pickle"  # what the unpickler says about garbage would mislead
    elif isinstance(err, pickle.UnpicklingError):  # torch's message is advice on trusting the file; the fact is:
        detail = "its pickled data does not decode"
    else:  # torch's reason, its first sentence whole (the rest is advice): a map_location it cannot use lands here too
        reason = re.split(r"(?<=\.)\s", " ".join(str(err).split()), maxsplit=1)[0].rstrip(".")
        detail = f"{type(err).__name__}: {reason}" if reason else type(err).__name__
    return CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupt and cannot be read ({detail}).")


def _starts_like_torch_file(path: Path) -> bool:
    """Whether the file begins as torch.save output does: a zip archive, or (legacy format) a pickle."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" or head[:1] == pickle.PROTO


def strip_prefixes(state_dict: dict[str, torch.Tensor], prefixes: tuple[str, ...] = ("module.", "_orig_mod.")) -> dict[str, torch.Tensor]:
    """Keys as a bare module names them, whatever wrapped it (DDP, DataParallel, torch.compile)."""
    clean = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in prefixes:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        clean[key] = value
    return clean


# --------------------------------------------------------------------------- what a checkpoint holds


def build_checkpoint(trainer: Trainer, weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint dict of the format above. A collective (gathers RNG states): call on every rank.

    `weights_only`: version, epoch, global_step, state_dict and the hparams, what load_from_checkpoint and the
    evaluation stages need; a fit cannot resume from it (as in Lightning, callbacks add nothing to it).
    """
    assert trainer.module is not None
    strategy = trainer.strategy
    checkpoint: dict[str, Any] = {
        "version": CHECKPOINT_VERSION,
        # Lightning's top-level counters, for ported on_load_checkpoint code and tools (loops holds the rest).
        "epoch": trainer.current_epoch, "global_step": trainer.global_step,
        "state_dict": strategy.model_state_dict(),
        **_saved_hparams(trainer),
    }
    if not weights_only:
        checkpoint.update(_training_state(trainer))
    trainer.module.on_save_checkpoint(checkpoint)
    if not weights_only:
        for callback in trainer.callbacks:
            callback.on_save_checkpoint(trainer, trainer.module, checkpoint)
    refused = unloadable(checkpoint)
    if refused is not None:
        where, value = refused
        raise MisconfigurationError(
            f"the checkpoint's {where} is a {type(value).__module__}.{type(value).__qualname__}, which checkpoints cannot "
            "hold: they are read with torch.load(weights_only=True), which refuses it. Store plain Python values, "
            "lists, dicts or tensors there instead (e.g. float(x), x.tolist(), torch.as_tensor(x))."
        )
    return checkpoint


_LOADABLE = frozenset((str, bytes, bytearray, int, float, bool, complex, type(None), torch.dtype, torch.device,
                       torch.Size, torch.layout))


def unloadable(value: Any) -> tuple[str, Any] | None:
    """The first value in `value` (a checkpoint, or part of one) that torch.load(weights_only=True) refuses, and
    where it is (e.g. "callbacks['Counter']['best']"); None when it all loads."""
    found = _unloadable_part(value)
    if found is None:
        return None
    steps, part = found
    where = ""
    for step, key in reversed(steps):  # outermost first; a top-level key reads as a name: "callbacks[...]"
        if step == "key":
            where += f" key {key!r}"
        elif step == "index":
            where += f"[{key}]"
        else:
            where += f"[{key!r}]" if where else str(key)
    return where.lstrip() or "value", part


def _unloadable_part(value: Any) -> tuple[list[tuple[str, Any]], Any] | None:
    """The walk behind `unloadable`: the refused value and the steps to it, innermost first. Nothing is built for
    values that load, as a checkpoint is checked at every save (its RNG states alone hold 600 ints)."""
    kind = type(value)
    if kind in _LOADABLE or isinstance(value, torch.Tensor):
        return None
    if kind in (dict, collections.OrderedDict, collections.Counter):
        for key, item in value.items():
            for step, inner in (("key", key), ("item", item)):
                if (found := _unloadable_part(inner)) is not None:
                    found[0].append((step, key))
                    return found
        return None
    if kind in (list, tuple, set):
        if _LOADABLE.issuperset(map(type, value)):  # a flat sequence of plain values, checked without a call each
            return None
        for index, item in enumerate(value):
            if (found := _unloadable_part(item)) is not None:
                found[0].append(("index", index))
                return found
        return None
    if kind in torch.serialization.get_safe_globals():
        return None
    return [], value


def _training_state(trainer: Trainer) -> dict[str, Any]:
    """What a resume needs beyond the weights. A collective, like build_checkpoint."""
    strategy = trainer.strategy
    return {
        "optimizer_states": [strategy.optimizer_state_dict(opt) for opt in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": strategy.precision.state_dict(),
        "loops": {
            "progress": trainer.progress.state_dict(), "seed": trainer.config.seed or 0,
            "lr_scale": trainer.lr_scaler.factor,  # the optimizer states' rates carry it
            "data_parallel_size": trainer.strategy.data_parallel_size,  # epoch_batches counts each rank's batches
            # The run folder a resume continues in (when it resumes in the same place).
            "version": trainer.version, "folder": run_folder(trainer.config.default_root_dir, trainer.config.name),
            # Per rank, like rng: each rank's running epoch means of self.log values.
            "metrics": strategy.all_gather_object(trainer.metrics.state_dict() if trainer.metrics is not None else {}),
        },
        "callbacks": {callback.state_key: callback.state_dict() for callback in trainer.callbacks},
        # The step tells a resumed logger which of the rows logged after the checkpoint to keep.
        "loggers": [{**logger.state_dict(), "step": trainer.progress.batches_stepped} for logger in trainer.loggers],
        "rng": strategy.all_gather_object(rng_state()),
        "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else {},
    }


def restore_checkpoint(trainer: Trainer, checkpoint: dict[str, Any], full: bool) -> None:
    """Load the weights; with `full` (fit), also optimizers, schedulers, counters, callbacks, RNG: a resume."""
    assert trainer.module is not None
    if full:
        _check_resumable(checkpoint)
    trainer.module.on_load_checkpoint(checkpoint)
    for callback in trainer.callbacks:
        callback.on_load_checkpoint(trainer, trainer.module, checkpoint)
    try:
        trainer.strategy.load_model_state_dict(checkpoint["state_dict"])
    except RuntimeError as err:  # torch lists every key; say what differs in one line
        differences = weights_mismatch(trainer.module.state_dict(), checkpoint["state_dict"], err)
        raise CheckpointError(f"the checkpoint's weights do not fit {type(trainer.module).__name__}: {differences}. "
                              "Build the model with the hparams it was trained with.") from err
    if not full:
        return
    try:
        for index, (optimizer, state) in enumerate(zip(trainer.optimizers, checkpoint["optimizer_states"], strict=True)):
            # torch takes the saved param groups whole: another kind of optimizer's fail only at its first step. The
            # keys the optimizer's own groups hold are the ones it needs (its `defaults` may gain more on loading).
            needed = {key for group in optimizer.param_groups for key in group}
            trainer.strategy.load_optimizer_state_dict(optimizer, state)
            missing = sorted({key for key in needed for group in optimizer.param_groups if key not in group})
            if missing:
                raise CheckpointError(
                    f"the checkpoint's optimizer {index} has no {', '.join(missing)}, which configure_optimizers' "
                    f"{type(optimizer).__name__} needs: it was saved from another kind of optimizer. Resume with the one "
                    "it was trained with, or start a new fit from its weights (Net.load_from_checkpoint)."
                )
        for config, state in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(state)
            # The optimizer stepped before the checkpoint; torch's check that a scheduler steps after its
            # optimizer only sees this process, and would warn when a resume's first act is an epoch end.
            if isinstance(getattr(config.scheduler, "optimizer", None), torch.optim.Optimizer):
                config.scheduler.optimizer._opt_called = True
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"the checkpoint's optimizers or schedulers do not match configure_optimizers "
                              f"({type(err).__name__}: {err}); resume with the ones it was trained with.") from err
    # A run resumed on another number of processes (or accumulation) scales its rates by its own factor.
    saved_scale = float(checkpoint["loops"].get("lr_scale", trainer.lr_scaler.factor))
    if saved_scale != trainer.lr_scaler.factor:
        trainer.lr_scaler.rescale_restored(trainer.optimizers, trainer.lr_scheduler_configs, saved_scale)
        if trainer.is_global_zero:
            print(f"lr_scaling: the checkpoint's rates were scaled x{saved_scale:g}, this run's are x"
                  f"{trainer.lr_scaler.factor:g}; rescaled the restored rates to match.")
    trainer.strategy.precision.load_state_dict(checkpoint.get("precision", {}))
    trainer.progress.load_state_dict(checkpoint["loops"]["progress"])
    _rescale_epoch_position(trainer, int(checkpoint["loops"].get("data_parallel_size", trainer.strategy.data_parallel_size)))
    saved = checkpoint.get("callbacks", {})
    for callback in trainer.callbacks:
        key = next((k for k in (callback.state_key, getattr(callback, "legacy_state_key", None)) if k in saved), None)
        if key is not None:
            callback.load_state_dict(saved[key])
        elif callback.has_state and trainer.is_global_zero:
            warnings.warn(f"the checkpoint holds no state for the callback {callback.state_key} (it was saved without "
                          "it, or with other settings), so it starts afresh.", stacklevel=2)
    if trainer.datamodule is not None:  # again: an elastic restart's checkpoint came after the loaders were built
        trainer.datamodule.load_state_dict(checkpoint.get("datamodule", {}))
    metric_states = checkpoint["loops"].get("metrics", [])
    if metric_states and trainer.metrics is not None:
        trainer.metrics.load_state_dict(metric_states[trainer.global_rank] if len(metric_states) == trainer.world_size else metric_states[0])
    states = checkpoint.get("rng", [])
    if states:
        set_rng_state(states[trainer.global_rank] if len(states) == trainer.world_size else states[0])


def _check_resumable(checkpoint: dict[str, Any]) -> None:
    """A clear error for a checkpoint that holds weights but not this format's training state."""
    if "optimizer_states" not in checkpoint:
        raise CheckpointError(
            "this checkpoint holds only the model's weights (saved with weights_only=True, as "
            "ModelCheckpoint(save_weights_only=True) does), so a fit cannot resume from it; pass it to "
            "validate/test/predict or Net.load_from_checkpoint, or save full checkpoints to resume from."
        )
    loops = checkpoint.get("loops")
    if not isinstance(loops, dict) or not isinstance(loops.get("progress"), dict):
        raise CheckpointError(
            "this checkpoint has no training position in this framework's layout (loops.progress): it was not "
            "written by Trainer.save_checkpoint (a Lightning or hand-made file?), so a fit cannot resume from it; "
            "load its weights (Net.load_from_checkpoint) and start a new fit."
        )


def _saved_hparams(trainer: Trainer) -> dict[str, Any]:
    """The checkpoint's `hparams` and `hparams_repr` entries; warns once per key stored as its repr."""
    module = trainer.module
    assert module is not None
    hparams: dict[str, Any] = {}
    repr_keys: list[str] = []
    warned: set[str] = module.__dict__.setdefault("_hparams_repr_warned", set())
    for key, value in module.hparams.items():
        key = str(key)
        replaced: list[Any] = []
        hparams[key] = _plain(value, replaced)
        if not replaced:
            continue
        repr_keys.append(key)
        if key not in warned and trainer.is_global_zero:
            warned.add(key)
            warnings.warn(
                f"hparams[{key!r}] holds {', '.join(type(v).__name__ for v in replaced)}, which a weights-only "
                f"checkpoint cannot hold, so checkpoints store its repr {hparams[key]!r}; pass it again when "
                f"loading: {type(module).__name__}.load_from_checkpoint(path, {key}=...), or leave it out of "
                f"the hparams with save_hyperparameters(ignore=[{key!r}]).",
                stacklevel=2,
            )
    # `hyper_parameters` is Lightning's name for the same dict (pickled once), for ported on_load_checkpoint code.
    return {"hparams": hparams, "hyper_parameters": hparams, "hparams_repr": repr_keys}


def _rescale_epoch_position(trainer: Trainer, saved_size: int) -> None:
    """A mid-epoch resume on another number of data-parallel processes continues after as many samples as were
    trained (each rank's batches count `saved_size` times over), not after as many batches per rank."""
    progress, size = trainer.progress, trainer.strategy.data_parallel_size
    if saved_size == size or progress.epoch_batches == 0:
        return
    trained, progress.epoch_batches = progress.epoch_batches, progress.epoch_batches * saved_size // size
    progress.validated_batches = progress.epoch_batches if progress.validated_batches == trained else 0
    if trainer.is_global_zero:
        warnings.warn(
            f"resuming mid-epoch on {size} data-parallel process(es) from a checkpoint of {saved_size}: epoch "
            f"{progress.epoch} goes on after {progress.epoch_batches} batches per process ({trained} per process were "
            f"trained on {saved_size}). The samples left are not the ones an unchanged run would see, as the sampler "
            "splits the epoch by process count; checkpoints at epoch ends resume exactly.", stacklevel=2,
        )


def weights_mismatch(own: dict[str, Any], saved: dict[str, Any], error: RuntimeError, examples: int = 3) -> str:
    """How `saved` weights differ from a module's `own`: keys missing, keys unexpected, shapes that differ; else
    the last line of torch's `error` from loading them."""

    def some(items: list[str]) -> str:
        return ", ".join(items[:examples]) + (f", ... ({len(items)} in all)" if len(items) > examples else "")

    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    reshaped = [f"{k} {list(saved[k].shape)} in the checkpoint, {list(own[k].shape)} in the model" for k in own
                if k in saved and isinstance(saved[k], torch.Tensor) and isinstance(own[k], torch.Tensor)
                and not isinstance(own[k], torch.nn.parameter.UninitializedParameter) and saved[k].shape != own[k].shape]
    parts = [f"{label} {some(keys)}" for label, keys in
             (("missing", missing), ("unexpected", unexpected), ("other shapes:", reshaped)) if keys]
    return "; ".join(parts) or str(error).splitlines()[-1].strip()


def _plain(value: Any, replaced: list[Any]) -> Any:
    """`value` reduced to what weights_only loading accepts; what is not becomes its repr, listed in `replaced`."""
    if isinstance(value, dict):
        return {str(k): _plain(v, replaced) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, replaced) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    replaced.append(value)
    return repr(value)
