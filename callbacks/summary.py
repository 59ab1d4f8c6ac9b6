"""ModelSummary: a layer table when the fit starts, and a run summary (best scores, throughput) when it ends."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.parameter import UninitializedParameter

from torchyard.callbacks.base import Callback
from torchyard.trainer.checkpointing.resume import shown_path
from torchyard.trainer.data.loaders import samples_in_batches
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.loggers import output_console
from torchyard.trainer.logs.runs import holds_run_files

if TYPE_CHECKING:
    from rich.table import Table

    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer


@dataclass
class LayerSummary:
    """One row of the layer table."""

    name: str
    type: str
    parameters: int
    trainable: int


def count_parameters(parameters: Any) -> tuple[int, int]:
    """(all, trainable) element counts; lazy parameters not yet materialised count as 0."""
    total = trainable = 0
    for p in parameters:
        if isinstance(p, UninitializedParameter):
            continue
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def summarize(module: nn.Module, max_depth: int = 1) -> list[LayerSummary]:
    """Rows for the submodules down to `max_depth` levels (-1: all); shared parameters count once per row."""
    rows = []
    for name, submodule in module.named_modules():
        depth = name.count(".") + 1
        if not name or (max_depth != -1 and depth > max_depth):
            continue
        total, trainable = count_parameters(submodule.parameters())
        rows.append(LayerSummary(name, type(submodule).__name__, total, trainable))
    return rows


def human_count(number: float) -> str:
    """1234567 -> '1.2 M'."""
    for unit in ("", " K", " M", " B"):
        if abs(number) < 1000:
            return f"{number:.0f}{unit}" if not unit else f"{number:.1f}{unit}"
        number /= 1000
    return f"{number:.1f} T"


def processes_line(trainer: Trainer) -> str:
    """'trainer: fit with strategy ddp, 2 processes on cpu (1 node)': what runs the fit."""
    strategy = trainer.strategy
    count = strategy.world_size
    nodes = f", {strategy.num_nodes} nodes" if strategy.num_nodes > 1 else ""
    return (f"trainer: fit with strategy {strategy.name}, {count} process{'es' if count != 1 else ''} "
            f"on {strategy.root_device.type}{nodes}")


def stop_reason(trainer: Trainer) -> str:
    """Why a fit's training ended, read from the trainer and its callbacks once it has (nothing is tracked per step)."""
    config, progress = trainer.config, trainer.progress
    if trainer.should_stop:
        told = (c.stop_reason(trainer) for c in trainer.callbacks if isinstance(c, Callback))
        reason = next((reason for reason in told if reason is not None), None)
        if reason is not None:
            return reason
    if config.fast_dev_run:  # it sets max_epochs=1 itself: the user asked for n batches, not for an epoch
        runs = int(config.fast_dev_run)
        return f"fast_dev_run={runs} ran {runs} batch{'es' if runs != 1 else ''}"
    if config.max_steps != -1 and progress.global_step >= config.max_steps:
        return f"max_steps={config.max_steps} reached"
    if trainer.max_epochs != -1 and progress.epoch >= trainer.max_epochs:
        return f"max_epochs={trainer.max_epochs} reached"
    return "trainer.should_stop was set" if trainer.should_stop else "the training loader ran out"


class ModelSummary(Callback):
    """Prints (rank 0) which strategy runs how many processes and the module's layers and parameter totals at fit
    start (`max_depth` levels deep; 0: no table), and at fit end a run summary and one line: why training stopped,
    and the run's folder."""

    def __init__(self, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or max_depth < -1:
            raise MisconfigurationError(f"ModelSummary(max_depth={max_depth!r}): use -1 (all levels) or a depth >= 0.")
        self.max_depth = max_depth
        self.layers: list[LayerSummary] = []
        self.total_parameters = self.trainable_parameters = self.non_trainable_parameters = 0
        self.model_size_mb = 0.0
        self.run_summary: dict[str, Any] = {}
        self._fit_start = self._train_start = self._train_end = 0.0
        self._batches_samples = self._first_step = 0

    # ------------------------------------------------------------------ fit start: the layer table
    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._fit_start = time.perf_counter()
        if not trainer.is_global_zero:
            return
        self.layers = summarize(module, self.max_depth)
        self.total_parameters, self.trainable_parameters = count_parameters(module.parameters())
        self.non_trainable_parameters = self.total_parameters - self.trainable_parameters
        self.model_size_mb = sum(p.numel() * p.element_size() for p in module.parameters()
                                 if not isinstance(p, UninitializedParameter)) / 1e6
        print(processes_line(trainer), flush=True)
        if self.max_depth != 0:  # 0 turns the table off, as in Lightning; the run summary still prints
            _print_table(self.layer_table())

    def layer_table(self) -> Table:
        """The rich table of layers and totals."""
        from rich.table import Table  # rich only when a table is drawn: `import` stays light (benchmarks/overhead.py)

        table = Table(title="Model summary", title_justify="left")
        for header, justify in (("", "right"), ("Name", "left"), ("Type", "left"), ("Params", "right")):
            table.add_column(header, justify=justify)  # type: ignore[arg-type]
        for index, layer in enumerate(self.layers):
            table.add_row(str(index), layer.name, layer.type, human_count(layer.parameters))
        table.add_section()
        totals = (("Trainable params", human_count(self.trainable_parameters)),
                  ("Non-trainable params", human_count(self.non_trainable_parameters)),
                  ("Total params", f"{human_count(self.total_parameters)} ({self.total_parameters:,})"),
                  ("Params size (MB)", f"{self.model_size_mb:.3f}"))
        for label, value in totals:
            table.add_row("", label, "", value)
        return table

    # ------------------------------------------------------------------ during training: count samples
    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._train_start, self._train_samples = time.perf_counter(), 0
        self._first_step = trainer.batches_stepped

    def on_train_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._first_batch = trainer.batches_this_epoch  # a resumed epoch starts mid-way

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        # Counted per epoch from the loader's batch size, not per batch: nothing of ours runs between steps.
        samples = samples_in_batches(trainer.train_dataloader, self._first_batch, trainer.batches_this_epoch)
        self._train_samples = None if samples is None or self._train_samples is None else self._train_samples + samples

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._train_end = time.perf_counter()

    # ------------------------------------------------------------------ fit end: the run summary
    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        if not trainer.is_global_zero:
            return
        reason, folder = stop_reason(trainer), shown_path(trainer.log_dir)
        if not trainer.loggers and not holds_run_files(trainer.log_dir):
            # Nothing was saved there, so the folder is given back at the stage's end: do not name it.
            why = "fast_dev_run writes no logs or checkpoints" if trainer.config.fast_dev_run else (
                "no logger, and nothing was saved in it")
            self._print_run_summary(trainer)
            print(f"trainer: training stopped: {reason}; no run folder ({why})", flush=True)
            return
        if 0 < self._first_step == trainer.batches_stepped and "reached" in reason:
            # A resume of a finished run: nothing trained, so no summary of nothing.
            print(f"trainer: the run in {folder} is already complete ({reason}); nothing to train. Raise "
                  "max_epochs, max_steps or max_time to train it further.", flush=True)
            return
        self._print_run_summary(trainer)
        print(f"trainer: training stopped: {reason}; run folder {folder}", flush=True)

    def _print_run_summary(self, trainer: Trainer) -> None:
        train_seconds = max(self._train_end - self._train_start, 1e-9)
        samples = self._train_samples * trainer.strategy.data_parallel_size if self._train_samples is not None else None
        summary: dict[str, Any] = {"fit wall time (s)": time.perf_counter() - self._fit_start, "train samples": samples,
                                   "train samples/s": samples / train_seconds if samples is not None else None}
        if trainer.data_wait is not None:
            share, wait = trainer.data_wait
            summary["waiting for data"] = f"{share:.0%} of the time, {wait * 1e3:.2f} ms a batch (first batches)"
        for callback in trainer.checkpoint_callbacks:
            monitor = getattr(callback, "monitor", None)
            if monitor is not None:
                best = callback.best_model_score
                summary[f"{monitor} best"] = float(best) if best is not None else None
                last = trainer.callback_metrics.get(monitor)
                summary[f"{monitor} last"] = float(last) if last is not None else None
                summary[f"{monitor} best checkpoint"] = callback.best_model_path or None
            if callback.last_model_path:
                summary["last checkpoint"] = callback.last_model_path
        if trainer.strategy.compile_record is not None:  # time to first step (cold or warm), graph breaks, recompiles
            summary.update(trainer.strategy.compile_record.summary_rows())
        self.run_summary = summary
        _print_table(self.run_table())

    def run_table(self) -> Table:
        """The rich table of the run summary."""
        from rich.table import Table

        table = Table(title="Run summary", title_justify="left", show_header=False)
        table.add_column("quantity", justify="left")
        table.add_column("value", justify="left", overflow="fold")
        for key, value in self.run_summary.items():
            if value is None:
                text = "-"
            elif key == "fit wall time (s)":
                text = f"{value:.1f} s" if value < 60 else str(timedelta(seconds=round(value)))
                key = "fit wall time"
            elif key == "train samples/s":
                text = f"{value:,.1f}"
            elif isinstance(value, float):
                text = f"{value:.6g}"
            else:
                text = f"{value:,}" if isinstance(value, int) else str(value)
            table.add_row(key, text)
        return table


def _print_table(table: Table) -> None:
    output_console().print(table)  # in a log file: no path cut at 80 columns
