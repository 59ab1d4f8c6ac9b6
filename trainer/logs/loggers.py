"""Metric writers: the Logger base (a run's version folder), CSVLogger, TensorBoardLogger and MLFlowLogger; the
import path of Lightning's `lightning.pytorch.loggers`."""

from __future__ import annotations

import csv
import io
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.runs import VersionClaim, atomic_write_text, run_folder, version_folder


class Logger:
    """A metrics writer. `log_dir` is `<save_dir>/<name>/version_<n>`; only rank 0 writes. A `prefix` is put
    before every metric name, joined by '-', as in Lightning."""

    def __init__(self, save_dir: str | Path = "runs", name: str = "default", version: int | str | None = None,
                 prefix: str = "") -> None:
        self.save_dir = Path(save_dir)
        self.name = name
        self._version = version
        self.prefix = prefix
        self._claim: VersionClaim | None = None
        #: An earlier logger of the same Trainer writing to the same `<save_dir>/<name>`: this one takes its
        #: version, so that one run's files (metrics, events, checkpoints) share one folder (share_run_folder).
        self._folder_of: Logger | None = None
        # Set when a validate/test/predict logs into the folder of the run whose checkpoint it was given: its
        # values go to a file of their own there, and the run's hparams.yaml stays as the run wrote it.
        self.evaluation_stage: str | None = None

    def prefixed(self, metrics: Mapping[str, float]) -> Mapping[str, float]:
        """`metrics` with this logger's prefix on their names."""
        return {f"{self.prefix}-{name}": value for name, value in metrics.items()} if self.prefix else metrics

    #: Whether `version` numbers folders under `<save_dir>/<name>` (MLflow's is a run id in its own store).
    numbers_folders = True

    @property
    def version(self) -> int | str:
        if self._version is None:
            folder_of = getattr(self, "_folder_of", None)  # a subclass may not call Logger.__init__
            if folder_of is not None:
                return folder_of.version  # followed, not copied: a resume may still restore the first one's
            self._claim = VersionClaim(self.save_dir, self.name)
            self._version = self._claim.version
        return self._version

    @version.setter
    def version(self, value: int | str) -> None:
        self._version = value

    @property
    def version_chosen(self) -> bool:
        """Whether the version is set (given, restored or numbered) rather than still to be numbered."""
        folder_of = getattr(self, "_folder_of", None)
        return self._version is not None or (folder_of is not None and folder_of.version_chosen)

    @property
    def log_dir(self) -> str:
        """`<save_dir>/<name>/version_<n>`, a str (as Lightning's, and as trainer.log_dir)."""
        return str(self.save_dir / self.name / version_folder(self.version))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> None:
        """Record the run's hyperparameters (and, as in Lightning, optional metrics that go with them)."""
    def save(self) -> None: ...

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Called on rank 0 after a ModelCheckpoint saved (Lightning's hook), e.g. to upload the files."""

    @property
    def experiment(self) -> Any:
        """The object this logger writes through, for what it has no method of its own for (as in Lightning)."""
        return self
    def finalize(self) -> None:
        self.save()
        claim = getattr(self, "_claim", None)  # a subclass may not call Logger.__init__
        if claim is not None:
            claim.release()  # a run that wrote nothing leaves no folder behind

    def log_into_run(self, version: int | str, stage: str) -> None:
        """Write a validate/test/predict of the run `version` (given its checkpoint) into that run's folder."""
        self.version, self.evaluation_stage = version, stage

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "folder": run_folder(self.save_dir, self.name)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._version = state["version"]

    def continues(self, state: dict[str, Any]) -> bool:
        """Whether a checkpoint's state of a logger is this logger's run, which a resume continues (checkpoints
        written before they recorded their folder are taken to be)."""
        return state.get("folder", run_folder(self.save_dir, self.name)) == run_folder(self.save_dir, self.name)


def share_run_folders(loggers: Sequence[Logger]) -> None:
    """Loggers of one Trainer that number folders under the same `<save_dir>/<name>` and were given no version
    write into one `version_<n>`: the first one's (each claimed a folder of its own before, so a csv and a
    tensorboard logger split one run over version_0 and version_1)."""
    first: dict[str, Logger] = {}
    for logger in loggers:
        if not getattr(logger, "numbers_folders", False) or getattr(logger, "_version", None) is not None:
            continue
        owner = first.setdefault(run_folder(logger.save_dir, logger.name), logger)
        if owner is not logger:
            logger._folder_of = owner


#: Where the output is a file or a pipe (a SLURM .out file, `| tee`), a table is this wide at most rather than 80
#: columns: a path in it stays on one line, whole, for the reader to copy and for grep.
LOG_WIDTH = 400


def output_console() -> Any:
    """A rich Console for tables printed to stdout: the terminal's width in a terminal; elsewhere no wrapping at
    80 columns and, as rich does outside a terminal, no colour or other escape codes."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH)


def print_results_table(results: list[dict[str, float]], stage: str) -> None:
    """The metrics of a validate/test run as a table: a row per metric, a column per dataloader."""
    from rich.table import Table

    table = Table(title=f"{stage} results", title_justify="left")
    table.add_column("metric")
    for index in range(len(results)):
        table.add_column(f"dataloader {index}" if len(results) > 1 else "value", justify="right")
    for name in sorted({name for metrics in results for name in metrics}):
        table.add_row(name, *(f"{metrics[name]:.6g}" if name in metrics else "" for metrics in results))
    output_console().print(table)


def hparams_yaml(params: Mapping[str, Any]) -> str:
    """Hyperparameters as YAML; a value YAML cannot hold (a dtype, a module, however deeply nested) as its repr."""
    # Imported when first needed, so `from torchyard.trainer import Trainer` costs little more than `import torch`.
    from omegaconf import OmegaConf

    def plain(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return [plain(v) for v in value]
        return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)

    return OmegaConf.to_yaml(OmegaConf.create(plain(params)))


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
        """metrics.csv; metrics_<stage>.csv for an evaluation logged into the run it evaluates (its training rows
        stay as they were, and `trainer plot` reads the training curves alone)."""
        stage = getattr(self, "evaluation_stage", None)  # a subclass may not call Logger.__init__
        return Path(self.log_dir) / (f"metrics_{stage}.csv" if stage else "metrics.csv")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **self.prefixed(metrics)}
        if self._redoable:
            self._drop_redone(row)
        self.rows.append(row)
        if len(self.rows) - self._written >= self.flush_logs_every_n_steps:
            self.save()

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> None:
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(self.log_dir) / "hparams.yaml", hparams_yaml(params))
        if metrics:
            self.log_metrics(metrics, step=0)

    @property
    def experiment(self) -> CSVExperiment:
        """Lightning's CSV experiment writer: log_metrics(metrics, step), log_hparams(params), save()."""
        return CSVExperiment(self)

    def save(self) -> None:
        if self._written == len(self.rows) and (self.metrics_path.exists() or not self.rows):
            return  # nothing new; a run that logged nothing (it failed before starting) leaves no folder behind
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        columns = list(self._columns)
        for row in self.rows[self._written:]:
            columns.extend(k for k in row if k not in columns)
        if columns != self._columns or not self.metrics_path.exists():
            # A new metric name widens the header: rewrite the whole file (atomically).
            buffer = io.StringIO()
            writer = csv.DictWriter(buffer, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
            atomic_write_text(self.metrics_path, buffer.getvalue())
            self._columns = columns
        else:
            with open(self.metrics_path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=columns).writerows(self.rows[self._written:])
        self._written = len(self.rows)

    def log_into_run(self, version: int | str, stage: str) -> None:
        """As Logger's, after the rows that earlier evaluations of the run wrote to the stage's file (kept)."""
        super().log_into_run(version, stage)
        self.rows, self._columns, self._written = self._read_rows(), [], 0

    def _read_rows(self) -> list[dict[str, Any]]:
        rows = []
        if self.metrics_path.exists():
            with open(self.metrics_path, newline="") as f:
                for row in csv.DictReader(f):
                    # step and epoch were written as ints: read them back as ints, or the rewrite says "0.0".
                    counts = ("step", "epoch", f"{self.prefix}-epoch")
                    rows.append({k: int(float(v)) if k in counts else float(v) for k, v in row.items() if v != ""})
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume in the same folder with the rows logged before the checkpoint, and those logged after it at
        its step or earlier (a test run after the fit). Rows of later steps are the interrupted run's, which
        the resumed one logs again; so are rows at its step that the resumed fit logs again (a validation or
        an epoch end that followed the checkpoint): each such row is replaced by the new one."""
        super().load_state_dict(state)
        rows = self._read_rows()
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


class CSVExperiment:
    """What Lightning's CSVLogger.experiment offers (its experiment writer), writing through a CSVLogger."""

    def __init__(self, logger: CSVLogger) -> None:
        self.logger = logger

    @property
    def log_dir(self) -> str:
        return str(self.logger.log_dir)

    @property
    def metrics_file_path(self) -> str:
        return str(self.logger.metrics_path)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return self.logger.rows

    def log_metrics(self, metrics_dict: Mapping[str, float], step: int | None = None) -> None:
        self.logger.log_metrics(metrics_dict, len(self.logger.rows) if step is None else step)

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        self.logger.log_hyperparams(params)

    def save(self) -> None:
        self.logger.save()


class TensorBoardLogger(Logger):
    """Event files for TensorBoard, through torch's SummaryWriter (needs the tensorboard package)."""

    def __init__(self, save_dir: str | Path = "runs", name: str = "default", version: int | None = None,
                 prefix: str = "") -> None:
        super().__init__(save_dir, name, version, prefix)
        try:
            import tensorboard  # noqa: F401
        except ImportError as err:
            raise MisconfigurationError(
                "TensorBoardLogger needs tensorboard: pip install 'torchyard[tensorboard]'."
            ) from err
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

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> None:
        """The hparams as text, and with `metrics` also in TensorBoard's HPARAMS tab (its hparams plugin)."""
        self.writer.add_text("hparams", hparams_yaml(params))
        if metrics:
            from torch.utils.tensorboard.summary import hparams

            plain = {key: value if isinstance(value, (bool, int, float, str)) else str(value)
                     for key, value in params.items()}
            for summary in hparams(plain, dict(metrics)):
                self.writer.file_writer.add_summary(summary)
            self.log_metrics(metrics, step=0)

    @property
    def experiment(self) -> Any:
        """torch's SummaryWriter, as Lightning's TensorBoardLogger.experiment."""
        return self.writer

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_writer"] = None  # SummaryWriter holds a thread and a file: re-open in the worker
        return state


class MLFlowLogger(Logger):
    """Metrics, hyperparameters and (with `log_model`) checkpoints in an MLflow tracking store, as Lightning's
    MLFlowLogger: `tracking_uri` is a server (http://...), a database (sqlite:///mlflow.db) or a folder (unset:
    `save_dir`). Needs mlflow: pip install 'torchyard[mlflow]'. `log_model`: True uploads the checkpoints at the
    end of the fit, "all" after each save, False none. `experiment` is an mlflow.tracking.MlflowClient."""

    numbers_folders = False  # its version is a run id in the tracking store, not a version_<n> folder

    def __init__(self, experiment_name: str = "lightning_logs", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: Mapping[str, Any] | None = None,
                 save_dir: str | Path = "./mlruns", log_model: bool | str = False, prefix: str = "",
                 artifact_location: str | None = None, run_id: str | None = None) -> None:
        try:
            import mlflow  # noqa: F401  (checked here: a missing extra is a one-line error when the logger is built)
        except ImportError as err:
            raise MisconfigurationError("MLFlowLogger needs mlflow: pip install 'torchyard[mlflow]'.") from err
        if log_model not in (True, False, "all"):
            raise MisconfigurationError(f"MLFlowLogger(log_model={log_model!r}); use True, False or 'all'.")
        super().__init__(save_dir, experiment_name, run_id, prefix)
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or Path(save_dir).absolute().as_uri()
        self.run_name, self.tags, self.log_model = run_name, dict(tags or {}), log_model
        self.artifact_location = artifact_location
        self._client: Any = None
        self._experiment_id: str | None = None
        self._checkpoint_callback: Any = None
        self._uploaded: set[str] = set()

    @property
    def experiment(self) -> Any:
        """The MlflowClient, with this run created on first use (rank 0 only uses it)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient  # the optional extra, imported only when a run logs to it

            self._client = MlflowClient(self.tracking_uri)
        if self._version is None:
            found = self._client.get_experiment_by_name(self.name)
            self._experiment_id = (found.experiment_id if found is not None else
                                   self._client.create_experiment(self.name, artifact_location=self.artifact_location))
            tags = {**self.tags, **({"mlflow.runName": self.run_name} if self.run_name else {})}
            self._version = self._client.create_run(self._experiment_id, tags=tags).info.run_id
        return self._client

    @property
    def run_id(self) -> str:
        self.experiment  # noqa: B018  (creates the run where there is none yet)
        return str(self._version)

    @property
    def experiment_id(self) -> str | None:
        if self._experiment_id is None:
            self._experiment_id = self.experiment.get_run(self.run_id).info.experiment_id
        return self._experiment_id

    @property
    def version(self) -> int | str:
        return self.run_id

    @version.setter
    def version(self, value: int | str) -> None:
        self._version = value

    @property
    def log_dir(self) -> str:
        """Where this run's local files go (its checkpoints): <save_dir>/<experiment id>/<run id>."""
        return str(self.save_dir / str(self.experiment_id) / self.run_id)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(key, float(value), now, step) for key, value in self.prefixed(metrics).items()]
        self.experiment.log_batch(self.run_id, metrics=entries)

    def log_hyperparams(self, params: Mapping[str, Any], metrics: Mapping[str, float] | None = None) -> None:
        from mlflow.entities import Param

        entries = [Param(str(key), str(value)[:6000]) for key, value in params.items()]  # mlflow's value limit
        self.experiment.log_batch(self.run_id, params=entries)
        if metrics:
            self.log_metrics(metrics, step=0)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._checkpoint_callback = checkpoint_callback
        if self.log_model == "all":
            self._upload_checkpoints()

    def _upload_checkpoints(self) -> None:
        folder = getattr(self._checkpoint_callback, "dirpath", None)
        for path in sorted(Path(folder).glob("*.ckpt")) if folder else []:
            key = f"{path.name}:{path.stat().st_mtime_ns}"
            if key not in self._uploaded:
                self.experiment.log_artifact(self.run_id, str(path), artifact_path="checkpoints")
                self._uploaded.add(key)

    def finalize(self, status: str = "FINISHED") -> None:
        if self._version is None or self._client is None:
            return  # nothing was logged: no run to close
        if self.log_model is True:
            self._upload_checkpoints()
        self._client.set_terminated(self.run_id, status)

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.run_id, "folder": self.tracking_uri}

    def continues(self, state: dict[str, Any]) -> bool:
        return state.get("folder") == self.tracking_uri

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}  # a client holds connections: built again where it is used
