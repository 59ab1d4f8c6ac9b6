"""Checkpoint files: one format for every strategy, written atomically, read with weights_only=True.
What a Trainer puts in it and takes back is trainer/checkpointing/state.py's; the keys and the durability rules are in
docs/checkpoints.md.
"""

from __future__ import annotations

import collections
import os
import pickle
import queue
import re
import shutil
import struct
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from torchyard.trainer.errors import CheckpointError

CHECKPOINT_VERSION = 1
#: In a sharded checkpoint folder (strategy fsdp, checkpoint='sharded'): everything but the tensors, in this format.
SHARDED_STATE_FILE = "trainer_state.pt"


def save_checkpoint_file(checkpoint: Any, path: str | Path) -> Path:
    """torch.save `checkpoint` to `path` so that a crash at any moment, a power loss included, leaves the
    previous file intact: written to a temporary file, fsynced, then renamed over `path`.

    The folder is not synced after each rename (sync_folder does it; the strategy calls it once as its stage
    ends): that costs a journal commit per file, the largest part of an epoch-end checkpoint of a small model,
    and guards only the newest file's name; a power loss before the next commit leaves the previous name and
    file, whole."""
    path = Path(path)
    _sync_into_place(_write_temporary(checkpoint, path), path)
    return path


def _write_temporary(checkpoint: Any, path: Path) -> IO[bytes]:
    """`checkpoint` written to `path`'s temporary name, still open (its file removed where writing fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(_temporary(path), "wb")  # noqa: SIM115  (closed by _sync_into_place)
    try:
        torch.save(checkpoint, file)
        file.flush()
    except BaseException:
        _discard(file)
        raise
    return file


def _sync_into_place(file: IO[bytes], path: Path) -> None:
    """fsync the temporary `file` written for `path`, then rename it over `path` (removed where that fails)."""
    try:
        with file:
            os.fsync(file.fileno())
        os.replace(file.name, path)
    except BaseException:
        Path(file.name).unlink(missing_ok=True)
        raise


def _temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


class CheckpointFiles:
    """Rank 0's checkpoint files, made durable off the training thread.

    `save` writes the file under its temporary name in the caller's thread (the state is taken before training
    changes it) and queues the rest: its fsync and its rename into place. Links and removals queue behind it, so
    they happen in the order they were asked for, on one worker thread. The training thread goes on meanwhile (an
    fsync took 0.6 ms for the 0.8 MB file of benchmarks/overhead.py here, and takes seconds for a large one) and
    `wait`s before its next optimizer step, so a checkpoint is under its name before the training moves past it
    (docs/checkpoints.md). A crash or a kill before the rename leaves the previous file, as a synchronous save
    does. Where one piece of work fails, the work queued behind it (the removal of the file it would replace, say)
    is not done, and `wait` raises the failure.
    """

    def __init__(self) -> None:
        self._work: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._failure: tuple[str, BaseException] | None = None
        self.pending = False  # work was queued since the last `wait`

    def save(self, checkpoint: Any, path: str | Path) -> Path:
        """Write `checkpoint` for `path` now; it takes the name `path` once the worker has synced it."""
        path = Path(path)
        self.wait()  # a save still in flight for the same name would share its temporary file
        file = _write_temporary(checkpoint, path)
        self._queue(f"saving {path}", lambda: _sync_into_place(file, path), cleanup=lambda: _discard(file))
        return path

    def link(self, source: str | Path, path: str | Path) -> Path:
        """link_checkpoint_file(source, path), after the work queued before it."""
        self._queue(f"giving {source} the name {path}", lambda: link_checkpoint_file(source, path))
        return Path(path)

    def remove(self, path: str | Path) -> None:
        """Delete the file `path`, after the work queued before it."""
        self._queue(f"removing {path}", lambda: Path(path).unlink(missing_ok=True))

    def wait(self) -> None:
        """Return once the queued work is done; raise CheckpointError where some of it failed."""
        if not self.pending:
            return
        self._work.join()
        self.pending = False
        failure, self._failure = self._failure, None
        if failure is not None:
            what, error = failure
            raise CheckpointError(f"{what} failed: {error}; the checkpoint before it is intact.") from error

    def close(self) -> None:
        """wait(), then end the worker thread."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._work.put(None)
                self._worker.join()
                self._worker = None

    def _queue(self, what: str, work: Callable[[], Any], cleanup: Callable[[], Any] | None = None) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="checkpoint-files", daemon=True)
            self._worker.start()
        self.pending = True
        self._work.put(lambda: self._do(what, work, cleanup))

    def _do(self, what: str, work: Callable[[], Any], cleanup: Callable[[], Any] | None) -> None:
        if self._failure is not None:  # what follows a failure depended on it
            if cleanup is not None:
                cleanup()
            return
        try:
            work()
        except BaseException as error:  # noqa: BLE001  (handed to the training thread by `wait`)
            self._failure = (what, error)

    def _run(self) -> None:
        while (task := self._work.get()) is not None:
            try:
                task()
            finally:
                self._work.task_done()
        self._work.task_done()


def _discard(file: IO[bytes]) -> None:
    file.close()
    Path(file.name).unlink(missing_ok=True)


def link_checkpoint_file(source: str | Path, path: str | Path) -> Path:
    """Give the file `source` the name `path` as well, atomically: a hard link (no second write; files are only
    ever replaced, never changed in place, so the two names cannot diverge), or a copy where links fail."""
    path = Path(path)
    tmp = _temporary(path)
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
        if (path / SHARDED_STATE_FILE).is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is a sharded folder: load it with strategy='fsdp', or "
                                  f"make it one file: trainer checkpoint convert {path} FILE.ckpt")
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
        reason = next(
            (line for line in lines if "Unsupported global" in line), lines[0] if lines else type(err).__name__
        )
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


def load_hparams_file(path: str | Path) -> dict[str, Any]:
    """The hyperparameters in a YAML file (a run's hparams.yaml), for load_from_checkpoint(hparams_file=...)."""
    import yaml  # only this function reads YAML; the checkpoint IO above does not need it

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise CheckpointError(f"hparams_file {str(path)!r} cannot be read as YAML: {err}".splitlines()[0]) from err
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise CheckpointError(f"hparams_file {str(path)!r} holds a {type(loaded).__name__}, not a mapping of "
                              "hyperparameters.")
    return loaded


def saved_position(path: Path, resumable: bool = True) -> tuple[int, int, int] | None:
    """How far the run had trained when `path` was saved (global step, epochs done, batches into the next),
    read without reading its tensors; None for a checkpoint that holds no position, or (`resumable`) that no
    fit can resume from (weights-only). A file that does not load raises CheckpointError, saying why."""
    checkpoint = load_checkpoint_file(path / SHARDED_STATE_FILE if path.is_dir() else path, mmap=True)
    progress = checkpoint.get("loops", {}).get("progress") if isinstance(checkpoint.get("loops"), dict) else None
    try:
        if progress is None and not resumable:  # a weights-only file: Lightning's top-level counters
            return int(checkpoint["global_step"]), int(checkpoint["epoch"]), 0
        done = bool(progress["epoch_done"])
        return (
            int(progress["global_step"]),
            int(progress["epoch"]) + done,
            0 if done else int(progress["epoch_batches"]),
        )
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


def strip_prefixes(
    state_dict: dict[str, torch.Tensor], prefixes: tuple[str, ...] = ("module.", "_orig_mod.")
) -> dict[str, torch.Tensor]:
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


def class_path(cls: type) -> str:
    """`module.QualName`: the model class a checkpoint was saved from (its `module_class`)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def weights_mismatch(own: dict[str, Any], saved: dict[str, Any], error: RuntimeError, examples: int = 3) -> str:
    """How `saved` weights differ from a module's `own`: keys missing, keys unexpected, shapes that differ; else
    the last line of torch's `error` from loading them."""

    def some(items: list[str]) -> str:
        return ", ".join(items[:examples]) + (f", ... ({len(items)} in all)" if len(items) > examples else "")

    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    reshaped = [
        f"{k} {list(saved[k].shape)} in the checkpoint, {list(own[k].shape)} in the model"
        for k in own
        if k in saved
        and isinstance(saved[k], torch.Tensor)
        and isinstance(own[k], torch.Tensor)
        and not isinstance(own[k], torch.nn.parameter.UninitializedParameter)
        and saved[k].shape != own[k].shape
    ]
    parts = [f"{label} {some(keys)}" for label, keys in
             (("missing", missing), ("unexpected", unexpected), ("other shapes:", reshaped)) if keys]
    return "; ".join(parts) or str(error).splitlines()[-1].strip()
