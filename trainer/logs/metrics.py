"""`self.log` collection (step values, epoch aggregates, cross-rank reduction) and the rows it writes to the loggers."""

from __future__ import annotations

import numbers
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchyard.trainer.data.loaders import batch_size_of
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.loggers import Logger
from torchyard.trainer.precision import HALF_DTYPES

if TYPE_CHECKING:
    from torchmetrics import Metric

    from torchyard.trainer.loop.loops import Progress

REDUCE_FXS = ("mean", "sum", "max", "min")
#: MetricCollector.checked_step_logs: by name, the options a value was logged with and the dicts it goes to.
CheckedStepLogs = dict[str, tuple[tuple[Any, ...], tuple[dict[str, torch.Tensor], ...]]]


def is_metric(value: Any) -> bool:
    """Whether `value` is a torchmetrics Metric, without importing torchmetrics."""
    # Importing torchmetrics costs about as much as importing torch itself (it pulls in scipy), so it is
    # never imported here: a value can only be a Metric if its user already imported torchmetrics.
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


def batch_value(metric: Metric) -> torch.Tensor:
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


def _accumulate(entry: _Entry, tensor: torch.Tensor, weight: float, reduce_fx: str) -> None:
    """Add one step's value (of `weight` samples) to the entry's epoch aggregate."""
    if entry.total is None:
        entry.total = tensor * weight if reduce_fx == "mean" else tensor.clone()
    elif reduce_fx == "mean":
        entry.total = entry.total + tensor * weight
    elif reduce_fx == "sum":
        entry.total = entry.total + tensor
    else:
        entry.total = torch.maximum(entry.total, tensor) if reduce_fx == "max" else torch.minimum(entry.total, tensor)
    entry.weight += weight


class MetricCollector:
    """What `self.log` writes into during one stage (fit, validate, test) of a run."""

    def __init__(self, reduce: Callable[[torch.Tensor, str], torch.Tensor], loggers: list[Logger] | None = None,
                 progress: Progress | None = None, log_every_n_steps: int = 1, writes: bool = True) -> None:
        self._reduce = reduce
        # The rows: where they go (only rank 0 `writes`), at which step, and what callbacks and the bar see.
        self.rows = MetricRows(loggers or [], progress, log_every_n_steps, writes)
        # Keyed by (stage, name): a validation in the middle of a training epoch aggregates and resets its own
        # values only, never the training epoch's running ones.
        self._entries: dict[tuple[str, str], _Entry] = {}
        # An evaluation step's on_step values for the loggers and the bar, filled by `log` itself so that taking
        # them costs nothing per entry. A training step's go to `rows` at once (MetricRows.step_values).
        self._eval_step_for_logger: dict[str, torch.Tensor] = {}
        self._eval_step_for_bar: dict[str, torch.Tensor] = {}
        self.batch: Any = None  # the current batch; its size weighs on_epoch means logged without batch_size
        # Set through `scope`: False in hooks that run once per epoch or stage (only per-epoch values there).
        self.in_step = True
        self.name_suffix = ""  # "/dataloader_idx_<i>" while one of several evaluation loaders runs (`for_loader`)
        self.stage = "train"
        # Scalar tensors logged in training steps per step only (no epoch aggregate, no sync), by name: the options
        # of the call that checked them, and the dicts such a value goes to. TrainModule.log stores a later value
        # logged with the same options itself: the checks, and the calls down to here, cost a measurable share of
        # a small model's step (benchmarks/overhead.py). `checked_step_logs` is this dict inside training steps and
        # None elsewhere (set by `scope`, and by `recording`, whose records must see every call).
        self._checked_step_logs: CheckedStepLogs = {}
        self.checked_step_logs: CheckedStepLogs | None = None

    def scope(self, stage: str, in_step: bool) -> _Scope:
        """`with collector.scope(stage, in_step):` what is logged inside counts for `stage`, per step or (in hooks
        that run once per epoch or stage) per epoch; the previous stage and mode come back on leaving."""
        return _Scope(self, stage, in_step)

    def _set_scope(self, stage: str, in_step: bool) -> None:
        self.stage, self.in_step = stage, in_step
        self.checked_step_logs = self._checked_step_logs if (stage, in_step) == ("train", True) else None

    def for_loader(self, index: int | None) -> None:
        """Name what is logged from now on after evaluation loader `index` (None: one loader, names as they are)."""
        self.name_suffix = f"/dataloader_idx_{index}" if index is not None else ""

    def recording(self, convert: Callable[[Any], Any]) -> _Recording:
        """`with collector.recording(convert) as records:` `log` calls are kept in `records` as (name,
        convert(value), options) instead of being collected; another rank `replay`s them (the pipeline's last
        stage computes what its replica's ranks log)."""
        return _Recording(self, convert)

    def publish_epoch(self, write: bool = True, log: bool = True) -> dict[str, float]:
        """Aggregate the current stage's epoch values and publish them (MetricRows.publish_epoch); returns them as
        floats. `log=False` (a sanity check) drops them."""
        values = self.epoch_values()
        return self.rows.publish_epoch(values, write) if log else {}

    def publish_eval_step(self, write: bool) -> None:
        """Publish what an evaluation step logged with on_step=True (MetricRows.publish_eval_step)."""
        self.rows.publish_eval_step(self.take_eval_step_values(), write)

    def replay(self, records: list[tuple[str, Any, tuple[Any, ...]]]) -> None:
        """Log what another rank recorded (`recording`), as if logged here."""
        for name, value, options in records:
            self.log(name, value, *options)

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: str = "mean", sync_dist: bool = False,
            batch_size: int | None = None, add_dataloader_idx: bool = True) -> None:
        """Record one value; defaults follow Lightning (train steps: on_step; eval and epoch hooks: on_epoch).
        TrainModule.log stores a value under a name in `checked_step_logs` itself, without calling this."""
        options = (prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)  # before the defaults fill them in
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
        if (self.checked_step_logs is not None and type(value) is torch.Tensor and entry.metric is None
                and (entry.prog_bar, entry.logger, entry.on_step, entry.on_epoch, entry.sync_dist, on_step, on_epoch,
                     sync_dist) == (prog_bar, logger, True, False, False, True, False, False)):
            # Where what follows stores such a value (_show_train_step_value; a step-only entry's step_key is `name`).
            rows = self.rows
            stores = (rows.step_values,) if logger else ()
            stores += ((rows.bar_values,) if prog_bar else ()) + (rows.callback_metrics,)
            self._checked_step_logs[name] = (options, stores)
        if type(value) is torch.Tensor and value.ndim == 0:  # the usual value, checked first: this runs every step
            # `.data` is `.detach()` (the same storage, no graph) without a trip through the dispatcher; it is only
            # read. A tensor outside autograd is kept as it is, as detach would share its storage anyway.
            tensor = value.data if value.requires_grad else value
        elif not isinstance(value, torch.Tensor) and is_metric(value):
            # A Metric keeps its own epoch state and syncs it in compute(); only its batch value is taken here.
            entry.metric, sync_dist, on_epoch = value, False, False
            tensor = batch_value(value).detach() if on_step else None
        else:
            tensor = _to_tensor(name, value)
        if tensor is not None and tensor.dtype in HALF_DTYPES:
            # As in Lightning, values are float32 whatever the precision: an epoch's sum needs its range
            tensor = tensor.float()
        if on_step:
            # Evaluation ranks may run one batch more or fewer than each other (every sample counts once), so an
            # evaluation step's per-batch value is this rank's own: a reduction there could wait forever.
            step_value = self._reduce(tensor, reduce_fx) if sync_dist and self.stage == "train" else tensor
            if self.stage == "train":
                self._show_train_step_value(name, entry, step_value)
            else:  # evaluation step values are written and shown, never monitored
                if entry.logger:
                    self._eval_step_for_logger[entry.step_key] = step_value
                if entry.prog_bar:
                    self._eval_step_for_bar[entry.step_key] = step_value
        if on_epoch:
            _accumulate(entry, tensor, float(batch_size or batch_size_of(self.batch)), reduce_fx)

    def _show_train_step_value(self, name: str, entry: _Entry, value: torch.Tensor) -> None:
        # As in Lightning, monitors see every training step value, logger=False ones too, under its name and,
        # when it is also aggregated per epoch, under `<name>_step`: from the moment it is logged.
        rows = self.rows
        if entry.logger:
            rows.step_values[entry.step_key] = value
        if entry.prog_bar:
            rows.bar_values[entry.step_key] = value
        rows.callback_metrics[name] = value
        if entry.step_key != name:
            rows.callback_metrics[entry.step_key] = value

    def _add(self, stage: str, name: str, entry: _Entry, loader_suffix: str = "") -> _Entry:
        both = entry.on_step and entry.on_epoch  # then the two values are told apart by a suffix
        if both:  # before a loader's suffix, as Lightning names them: `loss_epoch/dataloader_idx_1`
            base = name[: len(name) - len(loader_suffix)]
            entry.step_key, entry.epoch_key = f"{base}_step{loader_suffix}", f"{base}_epoch{loader_suffix}"
        else:
            entry.step_key = entry.epoch_key = name
        self._entries[stage, name] = entry
        return entry

    def take_eval_step_values(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(values for loggers, for the progress bar) logged in the current evaluation step, which they leave."""
        for_logger, for_bar = self._eval_step_for_logger, self._eval_step_for_bar
        if for_logger:
            self._eval_step_for_logger = {}
        if for_bar:
            self._eval_step_for_bar = {}
        return for_logger, for_bar

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

    _SAVED_FIELDS = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "sync_dist", "total", "weight",
                     "updated")

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
        self._checked_step_logs.clear()  # their entries may be replaced
        for name, saved in state.items():
            self._add(saved.get("stage", "train"), name, _Entry(**{key: saved[key] for key in self._SAVED_FIELDS}))

    def reset(self) -> None:
        for entry in self._entries.values():
            if entry.metric is not None:
                entry.metric.reset()
        self._entries.clear()
        self._checked_step_logs.clear()


class _Scope:
    """MetricCollector.scope: a class rather than a generator, as the loop enters one per epoch and per validation."""

    __slots__ = ("collector", "stage", "in_step", "saved")

    def __init__(self, collector: MetricCollector, stage: str, in_step: bool) -> None:
        self.collector, self.stage, self.in_step = collector, stage, in_step
        self.saved = (collector.stage, collector.in_step)

    def __enter__(self) -> MetricCollector:
        collector = self.collector
        self.saved = (collector.stage, collector.in_step)
        collector._set_scope(self.stage, self.in_step)
        return collector

    def __exit__(self, *exc: object) -> None:
        self.collector._set_scope(*self.saved)


class _Recording:
    """MetricCollector.recording. The collector's `log` is shadowed by an instance attribute while it lasts, so that
    the usual path of `log`, which runs every step, checks for nothing; TrainModule.log's shortcut is off."""

    def __init__(self, collector: MetricCollector, convert: Callable[[Any], Any]) -> None:
        self.collector, self.convert = collector, convert
        self.records: list[tuple[str, Any, tuple[Any, ...]]] = []
        self.checked_step_logs: CheckedStepLogs | None = None  # the collector's, taken away while the recording lasts

    def _record(self, name: str, value: Any, *options: Any) -> None:
        self.records.append((name, self.convert(value), options))

    def __enter__(self) -> list[tuple[str, Any, tuple[Any, ...]]]:
        collector = self.collector
        self.checked_step_logs, collector.checked_step_logs = collector.checked_step_logs, None
        collector.log = self._record  # type: ignore[method-assign]
        return self.records

    def __exit__(self, *exc: object) -> None:
        del self.collector.log
        self.collector.checked_step_logs = self.checked_step_logs


_EPOCH_SUFFIX = re.compile(r"_epoch(?=$|/dataloader_idx_\d+$)")


class MetricRows:
    """The values a stage has made visible (callback_metrics, logged_metrics, the bar's) and the rows it writes:
    one per logging step, and one per epoch, each also holding what the hooks that follow its values log."""

    def __init__(self, loggers: list[Logger], progress: Progress | None, log_every_n_steps: int, writes: bool) -> None:
        self.loggers, self.progress, self.log_every_n_steps, self.writes = loggers, progress, log_every_n_steps, writes
        # These dicts are filled and emptied, never replaced: the collector's checked names hold them, and a
        # callback may keep trainer.callback_metrics.
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        # What prog_bar=True logged, kept as tensors: a float per step would be a device sync per step.
        self.bar_values: dict[str, torch.Tensor] = {}
        self.last_logged_step = -1
        # The current training step's values for the loggers, filled by `log` as they are logged (on_train_batch_end
        # included) and emptied when the step is published.
        self.step_values: dict[str, torch.Tensor] = {}
        self.row_written_early = False
        self.epoch_row: dict[str, torch.Tensor] | None = None  # an epoch's values waiting for on_train_epoch_end
        # The newest step row that was not due (step, epoch, values): a fit shorter than log_every_n_steps writes it
        # at its end (write_last_step_row), so that its metrics.csv is not missing or empty.
        self.unwritten_step_row: tuple[int, int, dict[str, torch.Tensor]] | None = None
        self.wrote_step_row = False

    def publish_step(self) -> None:
        """The training step is over (its on_train_batch_end too): write its values as a row if the step is due."""
        if self.step_values:
            self.write_step_row()
        self.row_written_early = False

    def write_step_row(self) -> None:
        """Write the step's values (there are some), if this step is due for logging; they leave the step."""
        values, step = self.step_values, self.progress.batches_stepped
        # One row per step: later micro-batches of an accumulated step share it and are not written, unless a
        # checkpoint wrote the step's row early (flush) and on_train_batch_end logged more after it.
        if step % self.log_every_n_steps == 0 and (step != self.last_logged_step or self.row_written_early):
            self.last_logged_step, self.wrote_step_row, self.unwritten_step_row = step, True, None
            self.write(values, step)
        elif not self.wrote_step_row:
            self.unwritten_step_row = (step, self.progress.epoch, dict(values))
        values.clear()

    def write_last_step_row(self) -> None:
        """At the end of a fit that wrote no step row (shorter than log_every_n_steps): its last step's values."""
        if self.wrote_step_row or self.unwritten_step_row is None:
            return
        step, epoch, row = self.unwritten_step_row
        self.unwritten_step_row, self.last_logged_step = None, step
        self.write(row, step, epoch)

    def publish_eval_step(self, step_values: tuple[dict[str, torch.Tensor], ...], write: bool) -> None:
        """What an evaluation step logged with on_step=True: to the bar, and (`write`) to the loggers, at the
        training step it was logged in."""
        for_logger, for_bar = step_values
        if for_bar:
            self.bar_values.update(for_bar)
        if for_logger and write:
            self.write(for_logger, self.progress.batches_stepped)

    def publish_epoch(self, epoch_values: tuple[dict[str, torch.Tensor], ...], write: bool = True) -> dict[str, float]:
        """Make an epoch's aggregates visible and write them; returns every one, logger=False ones too. With
        `write=False` their row waits for the next call, so that it also holds what the epoch-end hooks log."""
        for_logger, for_bar, for_callbacks = epoch_values
        self.callback_metrics.update(for_callbacks)
        for key, value in for_callbacks.items():  # `loss_epoch` (or `loss_epoch/dataloader_idx_1`) is also `loss`
            name = _EPOCH_SUFFIX.sub("", key, count=1)
            if name != key:
                self.callback_metrics[name] = value
        self.bar_values.update(for_bar)
        if for_logger:
            self.epoch_row = {**self.epoch_row, **for_logger} if self.epoch_row else for_logger
        if write and self.epoch_row:
            self.write_epoch_row()
        return {k: float(v) for k, v in for_callbacks.items()}

    def write_epoch_row(self) -> None:
        row, self.epoch_row = self.epoch_row, None
        self.write(row, self.progress.batches_stepped)

    def flush(self) -> None:
        """Write the rows still waiting for their hooks (a checkpoint saved in those hooks counts them)."""
        if self.step_values:
            self.write_step_row()
            self.row_written_early = True
        if self.epoch_row:
            self.write_epoch_row()

    def write(self, values: dict[str, Any], step: int, epoch: int | None = None) -> None:
        """One row for the loggers: `values` as floats, and the epoch they were logged in (`epoch`, else now)."""
        floats: dict[str, Any] = {k: float(v) for k, v in values.items()}
        self.logged_metrics.update(floats)  # what was logged; the epoch column is the loggers' (as in Lightning)
        floats.setdefault("epoch", self.progress.epoch if epoch is None else epoch)
        if self.writes:
            for logger in self.loggers:
                logger.log_metrics(floats, step)
