"""Which checkpoint a stage starts from: `ckpt_path` ("best", "last" or a file) and, after an elastic
restart, the run's latest good checkpoint.

`ckpt_path="last"` and an elastic restart take the best checkpoint of a run's folder that loads: its
last.ckpt when that is the newest file there, else the furthest-trained one (by the step saved in it);
ranked_checkpoints says why. A truncated or corrupt file is skipped with a warning naming it, and the next
one is used. Before a Trainer has run, "last" is the newest last.ckpt among the runs of its name and its
ModelCheckpoints' folders (a new Trainer resuming an interrupted run); once it has run, only its own run's
checkpoints count.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchyard.trainer.checkpointing.files import SHARDED_STATE_FILE, class_path, saved_position, weights_mismatch
from torchyard.trainer.errors import CheckpointError, MisconfigurationError, closest
from torchyard.trainer.logs.runs import version_folder

_RUN_FOLDER_NAME = re.compile(r"version_\d+")  # a numbered run folder, as runs.py names them

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.strategies import Strategy
    from torchyard.trainer.trainer import Trainer


def resolve_ckpt_path(trainer: Trainer, ckpt_path: str | Path | NewestCheckpoint | None,
                      stage: str = "fit") -> Path | NewestCheckpoint | None:
    """The file (or, for "last", the folder whose best good file, ranked_checkpoints) a stage of `trainer`
    loads; clear errors for names that resolve to nothing. A fit given "last" with nothing to resume starts
    afresh with a warning, as in Lightning, so that a job requeued with "last" works on its first run too."""
    if ckpt_path is None or isinstance(ckpt_path, NewestCheckpoint):  # the CLI's "last" of a given run
        return ckpt_path
    if ckpt_path == "best":
        best = getattr(trainer.checkpoint_callback, "best_model_path", "")
        if not best:
            raise MisconfigurationError(
                'ckpt_path="best" needs a ModelCheckpoint with a monitor that has saved a checkpoint.'
            )
        return Path(best)
    if ckpt_path == "last":
        found = _last_checkpoint_folder(trainer)
        if found is not None:
            # Chosen where it is loaded: a corrupt last.ckpt gives way to that folder's next good one.
            return NewestCheckpoint(found)
        if trainer.module is not None:
            folder = getattr(trainer.checkpoint_callback, "dirpath", None)
            missing = (
                f'ckpt_path="last": the run of this Trainer saved no checkpoint{f" in {folder}" if folder else ""}'
            )
            advice = "give a checkpoint's path, or resume with a new Trainer to pick the newest run's last.ckpt."
        else:
            places = " or ".join(str(folder / pattern) for folder, pattern in _last_checkpoint_places(trainer))
            missing = f'ckpt_path="last": no checkpoint matches {places}'
            advice = "give a checkpoint's path."
        if stage != "fit":
            raise MisconfigurationError(f"{missing}; {advice}")
        if trainer.is_global_zero:
            warnings.warn(f"{missing}, so this fit starts from the beginning.", stacklevel=3)
        return None
    path = Path(ckpt_path)
    if path.is_dir() and not (path / SHARDED_STATE_FILE).is_file():  # a sharded folder is one checkpoint
        raise MisconfigurationError(f"ckpt_path {str(path)!r} is a folder; give a checkpoint file in it, or 'last'.")
    if not path.exists():
        raise MisconfigurationError(f"ckpt_path {str(path)!r} does not exist{_checkpoints_beside(path)}.")
    return path


def _checkpoints_beside(path: Path) -> str:
    """The ' (did you mean ...?)' of a missing checkpoint file: the closest checkpoints of its folder, else those
    it holds (a few), else that the folder holds none or does not exist."""
    folder = path.parent
    if not folder.is_dir():
        return f" (nor does its folder {str(folder)!r})"
    names = sorted(entry.name for entry in folder.iterdir() if entry.suffix in (".ckpt", ".pt", ".pth"))
    if not names:
        return f"; its folder {str(folder)!r} holds no checkpoint"
    suggestion = closest(path.name, names)
    if suggestion:
        return suggestion
    listed = ", ".join(repr(name) for name in names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    return f"; its folder {str(folder)!r} holds {listed}"


def default_ckpt_path(trainer: Trainer, stage: str, module: TrainModule | None, ckpt_path: str | Path | None,
                      calls_below_user: int) -> str | Path | None:
    """As in Lightning: called after a fit with neither a module nor a ckpt_path, a stage evaluates the fit's
    best checkpoint (where one was kept), not its last weights, and says so."""
    best = getattr(trainer.checkpoint_callback, "best_model_path", "")
    if module is not None or ckpt_path is not None or trainer.module is None or not best:
        return ckpt_path
    warnings.warn(
        f"Trainer.{stage} was called without a module: it uses the previous fit's best checkpoint, "
        f"{best}; pass ckpt_path='last' (or a path), or the module, to choose.",
        stacklevel=2 + calls_below_user,
    )
    return "best"


def _last_checkpoint_places(trainer: Trainer) -> list[tuple[Path, str]]:
    """Where a new Trainer looks for last.ckpt, as (folder, glob pattern): its runs' checkpoint folders (under its
    first logger's folder, or default_root_dir/name) and every ModelCheckpoint's own dirpath."""
    logger = trainer.loggers[0] if trainer.loggers else None
    root = (
        Path(logger.save_dir) / logger.name
        if logger is not None
        else Path(trainer.config.default_root_dir) / trainer.config.name
    )
    given = [(c._dirpath_arg, "last*.ckpt") for c in trainer.checkpoint_callbacks if c._dirpath_arg is not None]
    return [(root, "*/checkpoints/last*.ckpt"), *given]


def _last_checkpoint_folder(trainer: Trainer) -> Path | None:
    """The folder whose best good checkpoint "last" means; which file that is,
    load_newest decides where the checkpoint is loaded (ranking reads every file's counters: once is enough)."""
    own = getattr(trainer.checkpoint_callback, "last_model_path", "")
    if own and Path(own).exists():  # a file, or a sharded checkpoint's folder
        return Path(own).parent
    if trainer.module is not None:  # this Trainer ran: its own run's checkpoints, never another run's
        folder = getattr(trainer.checkpoint_callback, "dirpath", None)
        return Path(folder) if folder and any(Path(folder).rglob("*.ckpt")) else None
    candidates = [path for folder, pattern in _last_checkpoint_places(trainer) for path in folder.glob(pattern)]
    return max(candidates, key=lambda p: p.stat().st_mtime).parent if candidates else None


@dataclass(frozen=True)
class NewestCheckpoint:
    """`ckpt_path="last"`: `folder`'s best checkpoint that loads (ranked_checkpoints), chosen where it is loaded."""

    folder: Path


def ranked_checkpoints(folders: Iterable[Path], resumable: bool = True) -> tuple[list[Path], list[CheckpointError]]:
    """The *.ckpt files under `folders` that read (and, with `resumable`, that a fit can resume from: not
    weights-only), best first, and why each of those that do not read does not.

    last.ckpt (or last-v1.ckpt, ...) comes first when it is the newest file, as Lightning's "last" means:
    the run's latest state even where files trained further lie beside it (a resume from an earlier
    checkpoint went on from there). Otherwise (it is stale: written by a SIGTERM, say, with newer top-k files
    since) the position saved in each file decides, furthest first (a file's time says little once a folder
    was copied or touched), then last.ckpt, then the newest file.
    """
    found: dict[Path, tuple[tuple[int, ...], bool, int, Path]] = {}
    unreadable: dict[Path, CheckpointError] = {}
    for folder in folders:
        for path in Path(folder).rglob("*.ckpt") if Path(folder).is_dir() else ():
            try:
                modified = path.stat().st_mtime_ns
            except OSError:
                continue  # removed while we looked (a top-k eviction)
            try:
                position = saved_position(path, resumable)
            except CheckpointError as err:  # what is wrong with it, in the loader's words
                unreadable[path.resolve()] = err
                continue
            if position is not None:
                found[path.resolve()] = (position, path.stem.startswith("last"), modified, path)
    newest = max((modified for *_, modified, _ in found.values()), default=None)
    ranked = sorted(found.values(), key=lambda entry: (entry[1] and entry[2] == newest, *entry[:3]), reverse=True)
    return [path for *_, path in ranked], list(unreadable.values())


def load_newest(
    strategy: Strategy, folders: Iterable[Path], resumable: bool = True
) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0 picks the best loadable checkpoint in `folders` (ranked_checkpoints), warning about every file that
    does not load (it may have held later steps); every rank loads the choice."""
    choice, checkpoint = None, None
    if strategy.decides_for_ranks:
        readable, skipped = ranked_checkpoints(folders, resumable)
        for path in readable:
            try:
                checkpoint = strategy.load_checkpoint(path)
            except CheckpointError as err:
                skipped.append(err)
                continue
            choice = str(path)
            break
        for err in skipped:
            instead = f"using {choice!r} instead" if choice else "no other checkpoint loads either"
            warnings.warn(f"{err} Skipped it: {instead}.", stacklevel=3)
    choice = strategy.broadcast(choice)
    if choice is None:
        return None
    if checkpoint is None:
        checkpoint = strategy.load_checkpoint(choice)
    return Path(choice), checkpoint


def load_resume_checkpoint(
    strategy: Strategy, ckpt: Path | NewestCheckpoint | None, stage: str = "fit", module: TrainModule | None = None
) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint a stage starts from and its file: a given file (errors are the user's to see) or the best good
    one ("last"; a fit needs one it can resume from, an evaluation only weights). Rank 0 prints which file, of which
    run, once it is known to be `module`'s (check_model_class)."""
    if ckpt is None:
        return None, None
    if not isinstance(ckpt, NewestCheckpoint):
        path, checkpoint = Path(ckpt), strategy.load_checkpoint(ckpt)
    else:
        found = load_newest(strategy, [ckpt.folder], resumable=stage == "fit")
        if found is None:
            hint = ", and weights-only ones (save_weights_only=True) hold no training state" if stage == "fit" else ""
            raise CheckpointError(f'ckpt_path="last": no checkpoint in {str(ckpt.folder)!r} can be used: those that do '
                                  f"not read are warned about above{hint}.")
        path, checkpoint = found
    if module is not None:
        check_model_class(path, checkpoint, module)
    if strategy.is_global_zero:
        print(loaded_checkpoint_line(stage, path, checkpoint), file=sys.stderr, flush=True)
    return path, checkpoint


def check_model_class(path: Path, checkpoint: dict[str, Any], module: TrainModule) -> None:
    """Refuse a checkpoint of another model class whose weights do not fit `module`, naming the class it holds.
    Another class whose weights fit (a subclass, a fine-tuning head kept apart) loads as before."""
    saved, given = checkpoint.get("module_class"), type(module)
    weights = checkpoint.get("state_dict")
    if not isinstance(saved, str) or saved == class_path(given) or not isinstance(weights, dict) or not weights:
        return  # an older checkpoint (no class recorded), the same class, or a sharded one (its weights unread)
    own = module.state_dict()
    keys_differ = module.strict_loading and set(own) != set(weights)
    shapes_differ = any(
        isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.parameter.UninitializedParameter)
        and isinstance(weights[key], torch.Tensor) and weights[key].shape != value.shape
        for key, value in own.items() if key in weights
    )
    if not (keys_differ or shapes_differ):
        return
    name = saved.rsplit(".", 1)[-1]
    differences = weights_mismatch(own, weights, RuntimeError("the weights differ"))
    raise CheckpointError(
        f"checkpoint {shown_path(path)!r} holds a {saved} (module_class), whose weights do not fit {given.__name__}: "
        f"{differences}. Give the fit a {name} (or {name}.load_from_checkpoint(path) to rebuild it from its "
        f"hparams), or a checkpoint of {given.__name__}."
    )


def loaded_checkpoint_line(stage: str, path: Path, checkpoint: dict[str, Any]) -> str:
    """One line: the checkpoint a stage loaded, the run that saved it and how far that run had trained."""
    loops = checkpoint.get("loops", {})
    progress = loops.get("progress", {})
    run = checkpoint_run_folder(path, checkpoint)
    where = f"run {shown_path(run)}" if run is not None else "run unknown"
    if progress:
        where += f", epoch {progress.get('epoch', '?')}, global step {progress.get('global_step', '?')}"
    verb = "resumes from" if stage == "fit" else "loads"
    return f"trainer: {stage} {verb} {shown_path(path)} ({where})"


def checkpoint_run_folder(path: Path, checkpoint: dict[str, Any]) -> Path | None:
    """The version folder of the run that saved a checkpoint: as the checkpoint records it, where that folder exists,
    else the version_<n> folder the file lies in."""
    loops = checkpoint.get("loops", {})
    if "version" in loops and "folder" in loops:
        recorded = Path(loops["folder"]) / version_folder(loops["version"])
        if recorded.is_dir():
            return recorded
    return next((parent for parent in Path(path).resolve().parents if _RUN_FOLDER_NAME.fullmatch(parent.name)), None)


def shown_path(path: str | Path) -> str:
    """`path` relative to the working folder where it lies below it (shorter to read), else as it is."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def resume_after_restart(trainer: Trainer, checkpoint: dict[str, Any] | None) -> dict[str, Any] | None:
    """After an elastic restart: the newest good checkpoint of this run's folder (else what fit was given).

    Call once the callbacks are set up (their folders are known). The loggers continue from its rows.
    """
    restarts = trainer.strategy.environment.restart_count
    if restarts == 0:
        return checkpoint
    folders = [Path(trainer.log_dir)] + [Path(c.dirpath) for c in trainer.checkpoint_callbacks if c.dirpath]
    found = load_newest(trainer.strategy, folders)
    if trainer.is_global_zero:
        if found is None:
            print(f"trainer: restart {restarts}: no checkpoint in {', '.join(map(str, folders))}; starting over.",
                  file=sys.stderr, flush=True)
        else:
            step = found[1].get("loops", {}).get("progress", {}).get("global_step", "?")
            print(
                f"trainer: restart {restarts}: resuming from {found[0]} (global step {step}).",
                file=sys.stderr,
                flush=True,
            )
    if found is None:
        return checkpoint
    for logger, state in zip(trainer.loggers, found[1].get("loggers", [])):
        logger.load_state_dict(state)
    return found[1]
