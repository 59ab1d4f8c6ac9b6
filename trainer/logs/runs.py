"""Run folders: `<save_dir>/<name>/version_<n>`, numbered so that runs started at the same moment never share one."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchyard.trainer.logs.loggers import Logger
    from torchyard.trainer.strategies import Strategy

RUN_ID_FILE = ".elastic_run_id"  # in a version folder: the torchrun job whose attempts all write there
_VERSION = re.compile(r"version_(\d+)")


def next_version(save_dir: str | Path, name: str) -> int:
    """The first free `version_<n>` number under `<save_dir>/<name>` (not reserved: VersionClaim reserves one)."""
    root = Path(save_dir) / name
    taken = [int(m.group(1)) for p in root.glob("version_*") if (m := _VERSION.fullmatch(p.name))]
    return max(taken, default=-1) + 1


class VersionClaim:
    """A `version_<n>` folder this process created, and the parent folders it created on the way, so that a run
    which writes nothing can give them back (`release`) and leave no folder behind, as before."""

    def __init__(self, save_dir: str | Path, name: str) -> None:
        self.save_dir, self.name = Path(save_dir), name
        self.created: list[Path] = []  # innermost last
        self.version = self._claim()

    def _claim(self) -> int:
        """Create the first free version folder with an exclusive mkdir: of two runs started together, the one
        whose mkdir comes second gets FileExistsError and tries the next number (a glob alone gave both the
        same number, and they wrote into one folder)."""
        root = self.save_dir / self.name
        version = next_version(self.save_dir, self.name)
        while True:
            self._make_parents(root)
            try:
                (root / version_folder(version)).mkdir()
            except FileExistsError:
                version += 1
                continue
            except FileNotFoundError:  # another run gave its empty parents back in between: make them again
                continue
            self.created.append(root / version_folder(version))
            return version

    def _make_parents(self, root: Path) -> None:
        for folder in reversed([root, *root.parents]):
            if folder.is_dir():
                continue
            try:
                folder.mkdir()
            except FileExistsError:
                continue  # another run made it: not ours to give back
            self.created.append(folder)

    def release(self) -> None:
        """Remove the folders this claim created that are still empty (the run wrote nothing; the marker a torchrun
        job leaves for its restarts does not count: a run that ended has no restart left to find the folder)."""
        for folder in reversed(self.created):
            if not holds_run_files(folder):
                (folder / RUN_ID_FILE).unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:  # not empty (the run, or another one, wrote there), or gone already
                return
        self.created = []


def holds_run_files(folder: str | Path) -> bool:
    """Whether a run wrote anything into `folder` besides the restart marker (a folder gone holds nothing)."""
    try:
        return any(entry.name != RUN_ID_FILE for entry in Path(folder).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False


def version_of_job(save_dir: str | Path, name: str, run_id: str) -> int | str | None:
    """The version under `<save_dir>/<name>` whose folder an earlier attempt of torchrun job `run_id` marked: the
    most recently marked one, as a reused --rdzv-id may have marked an older job's folder too."""
    marked = []
    for marker in (Path(save_dir) / name).glob("*/" + RUN_ID_FILE):
        try:
            if marker.read_text().strip() == run_id:
                marked.append((marker.stat().st_mtime_ns, marker.parent.name))
        except OSError:
            continue
    if not marked:
        return None
    folder = max(marked)[1]
    number = _VERSION.fullmatch(folder)
    return int(number.group(1)) if number else folder


def run_folder(save_dir: str | Path, name: str) -> str:
    """Where runs of this name are numbered, as checkpoints record it: a resume continues a run's version
    only in the same place, so a checkpoint taken from another run never writes into this one's folder."""
    return str((Path(save_dir) / name).resolve())


def version_folder(version: int | str) -> str:
    """`version_<n>` for a number; a name given as a string is the folder's name as it is (as in Lightning)."""
    return version if isinstance(version, str) else f"version_{version}"


def earlier_attempts_version(environment: Any, save_dir: str | Path, name: str) -> int | str | None:
    """After an elastic restart under torchrun, the version folder that the job's earlier attempts wrote to
    (their checkpoints are there; a new folder would start the job over). None on a first attempt."""
    if environment.restart_count == 0 or environment.run_id is None:
        return None
    return version_of_job(save_dir, name, environment.run_id)


class RunFolder:
    """The run's folder when no logger numbers it (a logger keeps its own version): claimed when first asked for."""

    def __init__(self, save_dir: str | Path, name: str) -> None:
        self.save_dir, self.name = str(save_dir), name
        self.version: int | str | None = None
        self.claim: VersionClaim | None = None

    def number(self) -> int | str:
        """The version, claiming a new folder if none is chosen yet."""
        if self.version is None:
            self.claim = VersionClaim(self.save_dir, self.name)
            self.version = self.claim.version
        return self.version

    @property
    def path(self) -> Path:
        return Path(self.save_dir) / self.name / version_folder(self.number())

    def settle(self, strategy: Strategy, checkpoint: dict[str, Any], loggers: list[Logger]) -> None:
        """Choose every version of a stage once, on rank 0, for every rank: a logger's restored one where a resumed
        checkpoint holds this run's state, else the folder of the job's earlier attempts, else a new one."""
        saved, rank_zero = checkpoint.get("loggers", []), strategy.decides_for_ranks
        for index, logger in enumerate(loggers):
            if index < len(saved) and logger.continues(saved[index]):
                logger.load_state_dict(saved[index])  # resume in the same run folder, same rows
                continue
            environment = strategy.environment
            earlier = earlier_attempts_version(environment, logger.save_dir, logger.name) if rank_zero else None
            if earlier is not None and not logger.version_chosen:
                logger.version = earlier
            logger.version = strategy.broadcast(logger.version if rank_zero else None)
        if loggers:
            return
        # A resume continues in its run's folder, as loggers do through their state.
        progress, here = checkpoint.get("loops", {}), run_folder(self.save_dir, self.name)
        ours = "version" in progress and progress.get("folder", here) == here
        if rank_zero and self.version is None:
            self.version = earlier_attempts_version(strategy.environment, self.save_dir, self.name)
        version = progress["version"] if ours else self.number() if rank_zero else None
        self.version = strategy.broadcast(version)

    def adopt_evaluated_run(self, checkpoint: dict[str, Any] | None, loggers: list[Logger], stage: str) -> None:
        """validate/test/predict given a checkpoint of a run of this name log into that run's folder (each logger
        whose version is not chosen yet, in a file of the stage's own), instead of numbering a new one."""
        if checkpoint is None:
            return
        saved = checkpoint.get("loggers", [])
        for logger, state in zip(loggers, saved):
            if not logger.version_chosen and "version" in state and logger.continues(state):
                logger.log_into_run(state["version"], stage)
        progress, here = checkpoint.get("loops", {}), run_folder(self.save_dir, self.name)
        if not loggers and self.version is None and "version" in progress and progress.get("folder") == here:
            self.version = progress["version"]

    def release(self) -> None:
        """Give back the folder claimed for a run that wrote nothing there."""
        if self.claim is not None:
            self.claim.release()


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a fsynced temporary file and a rename: a reader sees the old file or the new."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dump_yaml(plain: Any) -> str:
    """Plain containers as YAML that omegaconf reads back to the same values (a literal '${' is escaped)."""
    import yaml

    def escape(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: escape(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [escape(item) for item in value]
        return value.replace("${", "\\${") if isinstance(value, str) else value

    return yaml.safe_dump(escape(plain), sort_keys=False, allow_unicode=True)


def save_run_config(path: str | Path, run_config: dict[str, Any]) -> None:
    """Write a run's resolved recipe as YAML, atomically (what `trainer fit <that file>` reruns)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, dump_yaml(run_config))
