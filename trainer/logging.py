"""`self.log` collection (step values, epoch aggregates, cross-rank reduction) and the CSV/TensorBoard writers."""

from __future__ import annotations

import csv
import io
import numbers
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.data import batch_size_of
from trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torchmetrics import Metric

REDUCE_FXS = ("mean", "sum", "max", "min")
_HALF_DTYPES = frozenset((torch.float16, torch.bfloat16))  # a set: `in` a tuple compares dtypes with ==, slower per step


def _is_metric(value: Any) -> bool:
    # Importing torchmetrics costs about as much as importing torch itself (it pulls in scipy), so it is
    # never imported here: a value can only be a Metric if its user already imported torchmetrics.
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


def _batch_value(metric: Metric) -> torch.Tensor:
    # torchmetrics keeps the value of the last forward() in a private attribute; it is the only way to
    # log a Metric's per-batch value without computing it twice (Lightning reads the same attribute).
    cached = getattr(metric, "_forward_cache", None)
    return cached if cached is not None else metric.compute()


def _to_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise MisconfigurationError(f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log scalars.")
        return value.detach().reshape(())
    if isinstance(value, numbers.Real):  # numpy scalars too
        return torch.tensor(float(value))
    raise MisconfigurationError(
        f"self.log({name!r}) got {type(value).__name__}; log a number, a scalar tensor or a torchmetrics Metric."
    )


@dataclass
class _Entry:
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduce_fx: str
    sync_dist: bool
    metric: Metric | None = None
    total: torch.Tensor | None = None
    weight: float = 0.0
    updated: bool = False  # logged since the last epoch aggregation
    step_key: str = ""  # the names it is written under (set by MetricCollector._add)
    epoch_key: str = ""


class MetricCollector:
    """What `self.log` writes into during one stage (fit, validate, test) of a run."""

    def __init__(self, reduce: Callable[[torch.Tensor, str], torch.Tensor]) -> None:
        self._reduce = reduce
        # Keyed by (stage, name): a validation in the middle of a training epoch aggregates and resets its own
        # values only, never the training epoch's running ones.
        self._entries: dict[tuple[str, str], _Entry] = {}
        # This step's on_step values, filled by `log` itself so that taking them costs nothing per entry.
        self._step_for_logger: dict[str, torch.Tensor] = {}
        self._step_for_bar: dict[str, torch.Tensor] = {}
        # As in Lightning, monitors see every training step value, logger=False ones too, under its name and,
        # when it is also aggregated per epoch, under `<name>_step`.
        self._step_for_callbacks: dict[str, torch.Tensor] = {}
        self.batch: Any = None  # the current batch; its size weighs on_epoch means logged without batch_size
        self.in_step = True  # False in hooks that run once per epoch or stage: only per-epoch values there
        self.name_suffix = ""  # "/dataloader_idx_<i>" while one of several evaluation loaders runs
        self.stage = "train"

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: str = "mean", sync_dist: bool = False,
            batch_size: int | None = None, add_dataloader_idx: bool = True) -> None:
        """Record one value; defaults follow Lightning (train steps: on_step; eval and epoch hooks: on_epoch)."""
        if reduce_fx not in REDUCE_FXS:
            raise MisconfigurationError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): use one of {REDUCE_FXS}.")
        if self.name_suffix and add_dataloader_idx:
            name += self.name_suffix
        step_default = self.in_step and self.stage == "train"
        on_step = step_default if on_step is None else on_step
        on_epoch = (not step_default) if on_epoch is None else on_epoch
        if not self.in_step and (on_step or not on_epoch):
            raise MisconfigurationError(
                f"self.log({name!r}, on_step={on_step}, on_epoch={on_epoch}) in a hook that runs once per epoch or "
                "stage (on_*_start, on_*_epoch_start/end): what it logs is a per-epoch value; use on_step=False, "
                "on_epoch=True (the defaults there).")
        entry = self._entries.get((self.stage, name))
        if entry is None:
            entry = self._add(self.stage, name, _Entry(prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist),
                              self.name_suffix)
        entry.updated = True
        if type(value) is torch.Tensor and value.ndim == 0:  # the usual value, checked first: this runs every step
            # `.data` is `.detach()` (the same storage, no graph) without a trip through the dispatcher; it is only
            # read. A tensor outside autograd is kept as it is, as detach would share its storage anyway.
            tensor = value.data if value.requires_grad else value
        elif not isinstance(value, torch.Tensor) and _is_metric(value):
            # A Metric keeps its own epoch state and syncs it in compute(); only its batch value is taken here.
            entry.metric, tensor, sync_dist, on_epoch = value, _batch_value(value).detach() if on_step else None, False, False
        else:
            tensor = _to_tensor(name, value)
        if tensor is not None and tensor.dtype in _HALF_DTYPES:
            tensor = tensor.float()  # as in Lightning, values are float32 whatever the precision: an epoch's sum needs its range
        if on_step:
            # Evaluation ranks may run one batch more or fewer than each other (every sample counts once), so an
            # evaluation step's per-batch value is this rank's own: a reduction there could wait forever.
            step_value = self._reduce(tensor, reduce_fx) if sync_dist and self.stage == "train" else tensor
            if entry.logger:
                self._step_for_logger[entry.step_key] = step_value
            if entry.prog_bar:
                self._step_for_bar[entry.step_key] = step_value
            if self.stage == "train":  # evaluation step values are written, never monitored
                self._step_for_callbacks[name] = step_value
                if entry.step_key != name:
                    self._step_for_callbacks[entry.step_key] = step_value
        if on_epoch:
            weight = float(batch_size or batch_size_of(self.batch))
            if entry.total is None:
                entry.total = tensor * weight if reduce_fx == "mean" else tensor.clone()
            elif reduce_fx == "mean":
                entry.total = entry.total + tensor * weight
            elif reduce_fx == "sum":
                entry.total = entry.total + tensor
            else:
                entry.total = torch.maximum(entry.total, tensor) if reduce_fx == "max" else torch.minimum(entry.total, tensor)
            entry.weight += weight

    def _add(self, stage: str, name: str, entry: _Entry, loader_suffix: str = "") -> _Entry:
        both = entry.on_step and entry.on_epoch  # then the two values are told apart by a suffix
        if both:  # before a loader's suffix, as Lightning names them: `loss_epoch/dataloader_idx_1`
            base = name[: len(name) - len(loader_suffix)]
            entry.step_key, entry.epoch_key = f"{base}_step{loader_suffix}", f"{base}_epoch{loader_suffix}"
        else:
            entry.step_key = entry.epoch_key = name
        self._entries[stage, name] = entry
        return entry

    def take_step_values(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(values for loggers, for the progress bar, for callbacks) logged in the current step, which they leave."""
        for_logger, for_bar, for_callbacks = self._step_for_logger, self._step_for_bar, self._step_for_callbacks
        if for_logger:
            self._step_for_logger = {}
        if for_bar:
            self._step_for_bar = {}
        if for_callbacks:
            self._step_for_callbacks = {}
        return for_logger, for_bar, for_callbacks

    def epoch_values(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Aggregate the current stage's on_epoch values (Metrics computed over the epoch, synced), then reset them:
        (values for loggers, for the progress bar, for callbacks: logger=False ones too)."""
        for_logger, for_bar, for_callbacks = {}, {}, {}
        for (stage, _), entry in self._entries.items():
            if stage != self.stage or not entry.on_epoch or not entry.updated:
                continue
            entry.updated = False
            if entry.metric is not None:
                value = entry.metric.compute().detach()  # reset by reset_metrics, once the epoch's hooks have run
            elif entry.total is not None:
                value = self._epoch_tensor(entry)
            else:
                continue
            for_callbacks[entry.epoch_key] = value
            if entry.logger:
                for_logger[entry.epoch_key] = value
            if entry.prog_bar:
                for_bar[entry.epoch_key] = value
            entry.total, entry.weight = None, 0.0
        return for_logger, for_bar, for_callbacks

    def reset_metrics(self) -> None:
        """Reset the torchmetrics Metrics logged in the current stage, per step or per epoch: as in Lightning,
        after the epoch-end hooks, which may still compute them."""
        for (stage, _), entry in self._entries.items():
            if stage == self.stage and entry.metric is not None:
                entry.metric.reset()

    def _epoch_tensor(self, entry: _Entry) -> torch.Tensor:
        assert entry.total is not None
        if entry.reduce_fx != "mean":
            return self._reduce(entry.total, entry.reduce_fx) if entry.sync_dist else entry.total
        total_and_weight = torch.stack([entry.total.float(), torch.tensor(entry.weight, device=entry.total.device)])
        if entry.sync_dist:  # a weighted mean over every rank's samples, not a mean of rank means
            total_and_weight = self._reduce(total_and_weight, "sum")
        return total_and_weight[0] / total_and_weight[1]

    _SAVED_FIELDS = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist", "total", "weight", "updated")

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """The running epoch aggregates of plain values, so an epoch resumed mid-way reports whole-epoch values.

        torchmetrics Metrics are not included: their states belong to the Metric (make them persistent).
        """
        return {
            name: {"stage": stage, **{key: getattr(entry, key) for key in self._SAVED_FIELDS}}
            for (stage, name), entry in self._entries.items()
            if entry.updated and entry.metric is None and entry.total is not None
        }

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        for name, saved in state.items():
            self._add(saved.get("stage", "train"), name, _Entry(**{key: saved[key] for key in self._SAVED_FIELDS}))

    def reset(self) -> None:
        for entry in self._entries.values():
            if entry.metric is not None:
                entry.metric.reset()
        self._entries.clear()


# --------------------------------------------------------------------------- writers


def next_version(save_dir: str | Path, name: str) -> int:
    """The first free `version_<n>` number under `<save_dir>/<name>`."""
    root = Path(save_dir) / name
    taken = [int(m.group(1)) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return max(taken, default=-1) + 1


RUN_ID_FILE = ".elastic_run_id"  # in a version folder: the torchrun job whose attempts all write there


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
    number = re.fullmatch(r"version_(\d+)", folder)
    return int(number.group(1)) if number else folder


def run_folder(save_dir: str | Path, name: str) -> str:
    """Where runs of this name are numbered, as checkpoints record it: a resume continues a run's version
    only in the same place, so a checkpoint taken from another run never writes into this one's folder."""
    return str((Path(save_dir) / name).resolve())


def version_folder(version: int | str) -> str:
    """`version_<n>` for a number; a name given as a string is the folder's name as it is (as in Lightning)."""
    return version if isinstance(version, str) else f"version_{version}"


class Logger:
    """A metrics writer. `log_dir` is `<save_dir>/<name>/version_<n>`; only rank 0 writes. A `prefix` is put
    before every metric name, joined by '-', as in Lightning."""

    def __init__(self, save_dir: str | Path = "runs", name: str = "default", version: int | str | None = None,
                 prefix: str = "") -> None:
        self.save_dir = Path(save_dir)
        self.name = name
        self._version = version
        self.prefix = prefix

    def prefixed(self, metrics: Mapping[str, float]) -> Mapping[str, float]:
        """`metrics` with this logger's prefix on their names."""
        return {f"{self.prefix}-{name}": value for name, value in metrics.items()} if self.prefix else metrics

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(self.save_dir, self.name)
        return self._version

    @version.setter
    def version(self, value: int | str) -> None:
        self._version = value

    @property
    def version_chosen(self) -> bool:
        """Whether the version is set (given, restored or numbered) rather than still to be numbered."""
        return self._version is not None

    @property
    def log_dir(self) -> Path:
        return self.save_dir / self.name / version_folder(self.version)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_hyperparams(self, params: Mapping[str, Any]) -> None: ...
    def save(self) -> None: ...
    def finalize(self) -> None:
        self.save()

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "folder": run_folder(self.save_dir, self.name)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._version = state["version"]

    def continues(self, state: dict[str, Any]) -> bool:
        """Whether a checkpoint's state of a logger is this logger's run, which a resume continues (checkpoints
        written before they recorded their folder are taken to be)."""
        return state.get("folder", run_folder(self.save_dir, self.name)) == run_folder(self.save_dir, self.name)


def print_results_table(results: list[dict[str, float]], stage: str) -> None:
    """The metrics of a validate/test run as a table: a row per metric, a column per dataloader."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{stage} results", title_justify="left")
    table.add_column("metric")
    for index in range(len(results)):
        table.add_column(f"dataloader {index}" if len(results) > 1 else "value", justify="right")
    for name in sorted({name for metrics in results for name in metrics}):
        table.add_row(name, *(f"{metrics[name]:.6g}" if name in metrics else "" for metrics in results))
    Console().print(table)


def hparams_yaml(params: Mapping[str, Any]) -> str:
    """Hyperparameters as YAML; a value YAML cannot hold (a dtype, a module, however deeply nested) as its repr."""
    # Imported when first needed, so `import trainer` costs little more than `import torch`.
    from omegaconf import OmegaConf

    def plain(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)

    return OmegaConf.to_yaml(OmegaConf.create(plain(params)))


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CSVLogger(Logger):
    """metrics.csv (one row per logging step, one column per metric) and hparams.yaml in the version folder."""

    def __init__(self, save_dir: str | Path = "runs", name: str = "default", version: int | None = None,
                 prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(save_dir, name, version, prefix)
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self.rows: list[dict[str, Any]] = []
        self._columns: list[str] = []
        self._written = 0  # rows already on disk under the current header
        self._redoable: list[dict[str, Any]] = []  # see load_state_dict

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / "metrics.csv"

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **self.prefixed(metrics)}
        if self._redoable:
            self._drop_redone(row)
        self.rows.append(row)
        if len(self.rows) - self._written >= self.flush_logs_every_n_steps:
            self.save()

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(self.log_dir / "hparams.yaml", hparams_yaml(params))

    def save(self) -> None:
        if self._written == len(self.rows) and (self.metrics_path.exists() or not self.rows):
            return  # nothing new; a run that logged nothing (it failed before starting) leaves no folder behind
        self.log_dir.mkdir(parents=True, exist_ok=True)
        columns = list(self._columns)
        for row in self.rows[self._written:]:
            columns.extend(k for k in row if k not in columns)
        if columns != self._columns or not self.metrics_path.exists():
            # A new metric name widens the header: rewrite the whole file (atomically).
            buffer = io.StringIO()
            writer = csv.DictWriter(buffer, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
            _atomic_write_text(self.metrics_path, buffer.getvalue())
            self._columns = columns
        else:
            with open(self.metrics_path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=columns).writerows(self.rows[self._written:])
        self._written = len(self.rows)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume in the same folder with the rows logged before the checkpoint, and those logged after it at
        its step or earlier (a test run after the fit). Rows of later steps are the interrupted run's, which
        the resumed one logs again; so are rows at its step that the resumed fit logs again (a validation or
        an epoch end that followed the checkpoint): each such row is replaced by the new one."""
        super().load_state_dict(state)
        rows = []
        if self.metrics_path.exists():
            with open(self.metrics_path, newline="") as f:
                for row in csv.DictReader(f):
                    # step and epoch were written as ints: read them back as ints, or the rewrite says "0.0".
                    counts = ("step", "epoch", f"{self.prefix}-epoch")
                    rows.append({k: int(float(v)) if k in counts else float(v) for k, v in row.items() if v != ""})
        saved, step = state.get("rows", len(rows)), state.get("step", -1)
        kept_after = [row for row in rows[saved:] if row.get("step", step + 1) <= step]
        self.rows = rows[:saved] + kept_after
        self._redoable = [row for row in kept_after if row.get("step") == step]
        self._columns, self._written = [], 0  # forces a rewrite that drops the rows left out

    def _drop_redone(self, row: dict[str, Any]) -> None:
        if row["step"] > self._redoable[0]["step"]:
            self._redoable = []  # the resumed fit has moved past its checkpoint's step
            return
        old = next((old for old in self._redoable if old.keys() == row.keys() and old["step"] == row["step"]), None)
        if old is not None:
            self._redoable.remove(old)
            self.rows = [kept for kept in self.rows if kept is not old]
            self._columns, self._written = [], 0


class TensorBoardLogger(Logger):
    """Event files for TensorBoard, through torch's SummaryWriter (needs the tensorboard package)."""

    def __init__(self, save_dir: str | Path = "runs", name: str = "default", version: int | None = None,
                 prefix: str = "") -> None:
        super().__init__(save_dir, name, version, prefix)
        try:
            import tensorboard  # noqa: F401
        except ImportError as err:
            raise MisconfigurationError("TensorBoardLogger needs tensorboard: pip install 'trainer[tensorboard]'.") from err
        self._writer = None

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in self.prefixed(metrics).items():
            self.writer.add_scalar(key, value, step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.writer.add_text("hparams", hparams_yaml(params))

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_writer"] = None  # SummaryWriter holds a thread and a file: re-open in the worker
        return state
