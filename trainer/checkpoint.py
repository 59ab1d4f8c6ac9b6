"""Checkpoint files: one format for every strategy, written atomically, read with weights_only=True.

A checkpoint is a plain dict that `torch.load(weights_only=True)` can read:
    version          format version (CHECKPOINT_VERSION)
    state_dict       the whole model under plain keys (no `module.` or stage prefixes)
    optimizer_states one state_dict per optimizer, parameters keyed as in a single-device run
    lr_schedulers    one state_dict per scheduler
    precision        grad-scaler state ({} without one)
    loops            epoch, global_step, batches consumed in the current epoch, sampler seed
    callbacks        {callback.state_key: its state_dict()}
    loggers          {index: logger state_dict()}
    rng              one entry per global rank (python, numpy, torch, cuda)
    hparams          the module's saved hyperparameters
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from trainer.errors import CheckpointError

CHECKPOINT_VERSION = 1


def save_checkpoint_file(checkpoint: dict[str, Any], path: str | Path) -> Path:
    """Write `checkpoint` to `path` so that a crash at any moment leaves the previous file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)  # make the rename itself durable
    return path


def _fsync_dir(folder: Path) -> None:
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


def load_checkpoint_file(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely: nothing in the file can run code; bad files raise CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds objects that only full unpickling could build, which could run "
            f"arbitrary code, so it was refused ({first_line[:200]}). Save plain tensors and containers."
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or corrupt and cannot be read ({type(err).__name__})."
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a trainer checkpoint (no 'state_dict' key).")
    return checkpoint


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
