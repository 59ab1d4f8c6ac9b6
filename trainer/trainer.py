"""Trainer: options, the fit/validate/test/predict entry points, and the state callbacks may read."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from callbacks.base import Callback
from trainer import faults
from trainer.checkpoint import build_checkpoint, restore_checkpoint
from trainer.config import TrainerConfig, make_config, save_run_config
from trainer.data import STAGE_LOADERS, DataModule, build_loaders, own_loader, stage_loaders
from trainer.errors import MisconfigurationError
from trainer.logging import (
    RUN_ID_FILE,
    CSVLogger,
    Logger,
    MetricCollector,
    TensorBoardLogger,
    next_version,
    print_results_table,
    run_folder,
    version_folder,
    version_of_job,
)
from trainer.loop import Progress, batch_limit, evaluation_loop, fit_loop, predict_loop
from trainer.module import TrainModule, overridden
from trainer.optim import (
    LRScaler,
    ManualOptimizer,
    SchedulerConfig,
    check_closure_optimizer,
    is_torch_scheduler,
    parse_optimizers,
)
from trainer.resume import load_resume_checkpoint, resolve_ckpt_path, resume_after_restart
from trainer.rng import seed_everything, set_determinism
from trainer.strategies import Strategy, build_strategy

#: Hooks whose monitoring callbacks (checkpointing, early stopping) run after the module's, via `call_monitors`.
MONITORS_LAST = ("on_train_epoch_end",)


class Trainer:
    """Runs a TrainModule: `Trainer(max_epochs=5, strategy="ddp", devices=2).fit(module, datamodule=dm)`.

    Every keyword option is a field of TrainerConfig (see `trainer config` or the README table);
    `callbacks` takes Callback instances and `logger` may also be Logger instances.
    """

    def __init__(self, *, callbacks: list[Callback] | Callback | None = None, **options: Any) -> None:
        self.config: TrainerConfig = make_config(options)
        self._apply_fast_dev_run()
        # Validated here, in the calling process, before any worker starts.
        self.strategy: Strategy = build_strategy(self.config.strategy)
        self.strategy.configure(self.config.accelerator, self.config.devices, self.config.num_nodes, self.config.precision)
        self.strategy.timeout = float(self.config.timeout)
        self.loggers: list[Logger] = self._build_loggers(self.config.logger)
        self.callbacks: list[Callback] = self._with_default_callbacks(_callback_list(callbacks, "callbacks must be"))
        self.strategy.check_config(self.config, self.callbacks)
        self.progress = Progress()
        self.module: TrainModule | None = None
        self.datamodule: DataModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.manual_optimizers: list[ManualOptimizer] = []  # what self.optimizers() gives under manual optimization
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.lr_scaler = LRScaler("none", 1, 0)
        self.metrics: MetricCollector | None = None
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, float] = {}
        # What prog_bar=True logged, kept as tensors: a float per step would be a device sync per step.
        self._bar_values: dict[str, torch.Tensor] = {}
        self.should_stop = False
        self.sanity_checking = False
        self.stage: str | None = None
        self.train_dataloader: DataLoader | None = None  # this rank's training loader, during fit
        self.val_dataloaders: list[DataLoader] = []  # and the validation loaders it validates on (none: off)
        self.predict_dataloaders: list[DataLoader] = []  # during predict: this rank's loaders
        #: During predict: the dataset indices of the current batch (None where the loader cannot tell them).
        self.predict_batch_indices: list[int] | None = None
        self._return_predictions = True
        self.num_training_batches = 0
        # During fit: builds the fit's loaders again (reload_dataloaders_every_n_epochs), and the epoch that the
        # current ones were built in (trainer.current_epoch then).
        self.build_fit_loaders: Callable[[], list[DataLoader]] | None = None
        self.fit_loaders_epoch = 0
        #: (share of the time, seconds a batch) the fit waited for training batches, measured on its first ones.
        self.data_wait: tuple[float, float] | None = None
        self._last_logged_step = -1
        self._step_row: dict[str, torch.Tensor] | None = None  # a step's values waiting for on_train_batch_end
        self._row_written_early = False
        self._epoch_row: dict[str, torch.Tensor] | None = None  # an epoch's values waiting for on_train_epoch_end
        self._hook_targets: dict[str, tuple[list[Any], Any]] = {}  # hook -> (callback methods, module method)
        self._callbacks_configured_by: TrainModule | None = None  # the module whose configure_callbacks was applied
        #: The resolved recipe (set by the `trainer` command); rank 0 saves it as config.yaml in the run folder.
        self.run_config: dict[str, Any] | None = None

    # ------------------------------------------------------------------ construction helpers
    def _apply_fast_dev_run(self) -> None:
        runs = int(self.config.fast_dev_run)
        if not runs:
            return
        self.config = dataclasses.replace(
            self.config, max_epochs=1, max_steps=-1, limit_train_batches=runs, limit_val_batches=runs,
            limit_test_batches=runs, limit_predict_batches=runs, num_sanity_val_steps=0, val_check_interval=1.0,
            enable_checkpointing=False, logger=False,
        )

    def _build_loggers(self, spec: Any) -> list[Logger]:
        if self.config.fast_dev_run or spec is False or spec is None:
            return []
        items = spec if isinstance(spec, (list, tuple)) else [spec]
        root, name = self.config.default_root_dir, self.config.name
        loggers: list[Logger] = []
        for item in items:
            if isinstance(item, Logger):
                loggers.append(item)
            elif item is True or item == "csv":
                loggers.append(CSVLogger(root, name))
            elif item == "tensorboard":
                loggers.append(TensorBoardLogger(root, name))
        return loggers  # anything else was refused by config.validate

    def _with_default_callbacks(self, callbacks: list[Callback]) -> list[Callback]:
        from callbacks import ModelCheckpoint, ModelSummary, RichProgressBar, Timer

        kinds = {type(c) for c in callbacks}
        # fast_dev_run turns checkpointing off itself; the checkpoint callbacks a user gives then save nothing.
        for option, kind in (("enable_progress_bar", RichProgressBar), ("enable_checkpointing", ModelCheckpoint)):
            given = [k.__name__ for k in kinds if issubclass(k, kind)]
            if given and not getattr(self.config, option) and not (option == "enable_checkpointing" and self.config.fast_dev_run):
                raise MisconfigurationError(f"{option}=False, but callbacks has a {given[0]}; drop one of the two.")
        if self.config.enable_progress_bar and not any(issubclass(k, RichProgressBar) for k in kinds):
            callbacks.append(RichProgressBar())
        if self.config.enable_model_summary and not any(issubclass(k, ModelSummary) for k in kinds):
            callbacks.append(ModelSummary())
        if self.config.enable_checkpointing and not any(issubclass(k, ModelCheckpoint) for k in kinds):
            callbacks.append(ModelCheckpoint(save_last=True))
        if self.config.max_time is not None:
            if any(issubclass(k, Timer) for k in kinds):  # Lightning ignores max_time then, with a warning
                raise MisconfigurationError("max_time and a Timer callback both time the run; give the budget to one of "
                                            "them (Timer(duration=...) or max_time).")
            callbacks.append(Timer(duration=self.config.max_time))
        _check_state_keys(callbacks)
        return _checkpointing_last(callbacks)

    def _attach_module_callbacks(self, module: TrainModule) -> None:
        """Lightning's configure_callbacks: the module's callbacks join the Trainer's and replace those of their types
        or base types. Asked once per module, so that a test after a fit keeps the fit's ModelCheckpoint (its best path)."""
        if self._callbacks_configured_by is module:
            return
        given = _callback_list(module.configure_callbacks(), f"{type(module).__name__}.configure_callbacks must return")
        kept = [callback for callback in self.callbacks if not any(isinstance(mine, type(callback)) for mine in given)]
        _check_state_keys(kept + given)
        self.strategy.check_config(self.config, kept + given)
        self.callbacks = _checkpointing_last(kept + given)
        self._callbacks_configured_by = module

    # ------------------------------------------------------------------ public state
    @property
    def current_epoch(self) -> int:
        return self.progress.epoch

    @property
    def training(self) -> bool:
        """In fit's training loop (not its validations), as Lightning's `trainer.training`."""
        return self.stage == "fit" and self.metrics is not None and self.metrics.stage == "train"

    @property
    def validating(self) -> bool:
        """In a validation loop, of fit or of `validate` (not the sanity check, as in Lightning)."""
        return self.metrics is not None and self.metrics.stage == "validation" and not self.sanity_checking

    @property
    def testing(self) -> bool:
        return self.stage == "test"

    @property
    def predicting(self) -> bool:
        return self.stage == "predict"

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    # Facts about the fit's schedule that callbacks read, so that none re-derives it from progress or config.
    @property
    def batches_stepped(self) -> int:
        """The loggers' step: batches that stepped, once each however many optimizers a batch steps."""
        return self.progress.batches_stepped

    @property
    def batches_this_epoch(self) -> int:
        """Training batches consumed so far in the current epoch (a resumed epoch counts those before it)."""
        return self.progress.epoch_batches

    @property
    def epoch_batches_done(self) -> bool:
        """The current epoch's batches are all consumed (False while it runs and where a stop cut it short)."""
        return self.progress.epoch_done

    @property
    def logs_this_step(self) -> bool:
        """The loggers' step is one that per-step rows are written at (a multiple of log_every_n_steps)."""
        return self.progress.batches_stepped % self.config.log_every_n_steps == 0

    @property
    def validates_at_epoch_end(self) -> bool:
        """Every training epoch's end validates, given val loaders (check_val_every_n_epoch=1, limit_val_batches!=0)."""
        return self.config.check_val_every_n_epoch == 1 and self.config.limit_val_batches != 0

    @property
    def validates_only_at_epoch_end(self) -> bool:
        """Any validation runs at each epoch's end and nowhere else (val_check_interval=1.0, every epoch)."""
        interval = self.config.val_check_interval
        return isinstance(interval, float) and interval == 1.0 and self.config.check_val_every_n_epoch == 1

    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def max_epochs(self) -> int:
        return self.config.resolved_max_epochs()

    @property
    def max_steps(self) -> int:
        return self.config.max_steps

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """What was logged with prog_bar=True, last values, as floats (`loss_step` and `loss_epoch` for a value
        logged per step and per epoch, as in Lightning)."""
        return {name: float(value) for name, value in dict(self._bar_values).items()}

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def estimated_stepping_batches(self) -> int | float:
        """The optimizer steps this fit takes in all (math.inf when unbounded), for schedules such as
        OneCycleLR(total_steps=...): batches per epoch over accumulation, times max_epochs, capped by max_steps."""
        epochs = self.config.resolved_max_epochs()
        per_epoch = self.num_training_batches
        per_epoch = math.ceil(per_epoch / self.config.accumulate_grad_batches) if per_epoch != math.inf else math.inf
        total = per_epoch * epochs if epochs != -1 else math.inf
        return min(total, self.config.max_steps) if self.config.max_steps != -1 else total

    @property
    def num_val_batches(self) -> list[int | float]:
        """Batches each validation loader runs (with limit_val_batches), as in Lightning."""
        return [batch_limit(loader, self.config.limit_val_batches) for loader in self.val_dataloaders]

    # Lightning's names for what this Trainer holds under its own.
    @property
    def lightning_module(self) -> TrainModule | None:
        return self.module

    model = lightning_module

    @property
    def default_root_dir(self) -> str:
        return self.config.default_root_dir

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def accumulate_grad_batches(self) -> int:
        return self.config.accumulate_grad_batches

    @property
    def log_every_n_steps(self) -> int:
        return self.config.log_every_n_steps

    @property
    def early_stopping_callback(self) -> Any:
        from callbacks import EarlyStopping

        return next((c for c in self.callbacks if isinstance(c, EarlyStopping)), None)

    @property
    def log_dir(self) -> Path:
        """This run's folder: `<default_root_dir>/<name>/version_<n>`."""
        if self.loggers:
            return self.loggers[0].log_dir
        return Path(self.config.default_root_dir) / self.config.name / version_folder(self._run_version())

    @property
    def version(self) -> int | str:
        """The run's number: log_dir is `<default_root_dir>/<name>/version_<n>`."""
        return self.loggers[0].version if self.loggers else self._run_version()

    def _run_version(self) -> int:
        if getattr(self, "_version", None) is None:
            self._version = next_version(self.config.default_root_dir, self.config.name)
        return self._version

    @property
    def checkpoint_callbacks(self) -> list[Callback]:
        from callbacks import ModelCheckpoint

        return [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> Any:
        found = self.checkpoint_callbacks
        return found[0] if found else None

    # ------------------------------------------------------------------ hooks and metrics
    def call(self, hook: str, *args: Any) -> Any:
        """Fire `hook` on every callback, then on the module (where it has one); return the module's answer.
        For on_train_epoch_end, callbacks that monitor logged values wait for `call_monitors`."""
        targets = self._hook_targets.get(hook)
        if targets is None:
            targets = self._hook_targets[hook] = self._resolve_hook(hook)
        for method in targets[0]:
            method(self, self.module, *args)
        return targets[1](*args) if targets[1] is not None else None

    def call_monitors(self, hook: str) -> None:
        """Fire `hook` on the callbacks that `call` left for later (`Callback.monitors`)."""
        for callback in self.callbacks:
            if callback.monitors and callback.uses_hook(hook):
                getattr(callback, hook)(self, self.module)

    def hook(self, hook: str) -> Callable[..., Any] | None:
        """A callable that fires `hook` as `call` does, or None when no callback and not the module overrides
        it. The loop resolves its per-step hooks through this once per run and calls only the ones in use."""
        methods, module_hook = self._resolve_hook(hook)
        if not methods:
            return module_hook
        if len(methods) == 1 and module_hook is None:
            return functools.partial(methods[0], self, self.module)
        return functools.partial(self.call, hook)

    def _resolve_hook(self, hook: str) -> tuple[list[Any], Any]:
        """The callback and module methods that override `hook` (and that the callback says it uses): the
        base classes' empty bodies are never called."""
        monitors_later = hook in MONITORS_LAST
        methods = [overridden(c, hook, Callback) for c in self.callbacks
                   if c.uses_hook(hook) and not (monitors_later and c.monitors)]
        return [m for m in methods if m is not None], overridden(self.module, hook, TrainModule)

    def publish_step_metrics(self, write: bool = True) -> None:
        """Make this step's logged values visible to callbacks and the bar; write them every n steps. With
        `write=False` the row waits for the next call, so that it also holds what on_train_batch_end logs."""
        assert self.metrics is not None
        for_logger, for_bar, for_callbacks = self.metrics.take_step_values()
        if for_bar:
            self._bar_values.update(for_bar)
        if for_callbacks:
            self.callback_metrics.update(for_callbacks)
        if for_logger:
            pending = self._step_row
            self._step_row = {**pending, **for_logger} if pending else for_logger
        if write:
            if self._step_row:
                self._write_step_row()
            self._row_written_early = False

    def _write_step_row(self) -> None:
        """Write the pending step row (there is one), if this step is due for logging."""
        row, self._step_row = self._step_row, None
        step = self.progress.batches_stepped
        # One row per step: later micro-batches of an accumulated step share it and are not written, unless a
        # checkpoint wrote the step's row early (see save_checkpoint) and on_train_batch_end logged more after it.
        if step % self.config.log_every_n_steps == 0 and (step != self._last_logged_step or self._row_written_early):
            self._last_logged_step = step
            self._write(row, step)

    def write_eval_step_metrics(self) -> None:
        """Write what an evaluation step logged with on_step=True, at the training step it was logged in."""
        assert self.metrics is not None
        for_logger, for_bar, _ = self.metrics.take_step_values()
        if for_bar:
            self._bar_values.update(for_bar)
        if for_logger and not self.sanity_checking:
            self._write(for_logger, self.progress.batches_stepped)

    def publish_epoch_metrics(self, log: bool = True, write: bool = True) -> dict[str, float]:
        """Aggregate the epoch's on_epoch values (synced across ranks) and write them; returns every value
        aggregated, logger=False ones too. With `write=False` their row waits for the next call, so that the
        epoch's one row also holds what the epoch-end hooks log."""
        assert self.metrics is not None
        for_logger, for_bar, for_callbacks = self.metrics.epoch_values()
        if not log:
            return {}
        self.callback_metrics.update(for_callbacks)
        for key, value in for_callbacks.items():  # `loss_epoch` (or `loss_epoch/dataloader_idx_1`) is also `loss`
            name = _EPOCH_SUFFIX.sub("", key, count=1)
            if name != key:
                self.callback_metrics[name] = value
        self._bar_values.update(for_bar)
        if for_logger:
            self._epoch_row = {**self._epoch_row, **for_logger} if self._epoch_row else for_logger
        if write and self._epoch_row:
            self._write_epoch_row()
        return {k: float(v) for k, v in for_callbacks.items()}

    def _write_epoch_row(self) -> None:
        row, self._epoch_row = self._epoch_row, None
        self._write(row, self.progress.batches_stepped)

    def _write(self, values: dict[str, Any], step: int) -> None:
        """One row for the loggers: `values` as floats, and the epoch they were logged in."""
        floats: dict[str, Any] = {k: float(v) for k, v in values.items()}
        self.logged_metrics.update(floats)  # what was logged; the epoch column is the loggers' (as in Lightning)
        floats.setdefault("epoch", self.progress.epoch)
        if self.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(floats, step)

    # ------------------------------------------------------------------ entry points
    # The entry points take Lightning's names and argument order (`model`, a DataModule in the dataloaders
    # slot), so that calls with positional or keyword arguments port too; `module=` is this framework's name.
    def fit(self, model: TrainModule | None = None, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | Path | None = None, *,
            module: TrainModule | None = None) -> None:
        """Train `model`; afterwards it holds the trained weights, whatever the strategy."""
        module = _one_module(model, module)
        train_dataloaders, datamodule = _datamodule_given_as_loaders(train_dataloaders, datamodule)
        self._check_inputs(module, datamodule, "fit", train_dataloaders)
        ckpt = resolve_ckpt_path(self, ckpt_path, "fit")
        self._dispatch("fit", module, datamodule, ckpt, train_dataloaders, val_dataloaders)

    def validate(self, model: TrainModule | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
                 verbose: bool = True, datamodule: DataModule | None = None, *,
                 module: TrainModule | None = None) -> list[dict[str, float]]:
        """Run validation once; returns the logged epoch metrics, one dict per loader (`verbose`: also prints them)."""
        return self._evaluate("validate", _one_module(model, module), dataloaders, datamodule, ckpt_path, verbose)

    def test(self, model: TrainModule | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
             verbose: bool = True, datamodule: DataModule | None = None, *,
             module: TrainModule | None = None) -> list[dict[str, float]]:
        """Run the test set once; returns the logged epoch metrics, one dict per loader (`verbose`: also prints them)."""
        return self._evaluate("test", _one_module(model, module), dataloaders, datamodule, ckpt_path, verbose)

    def predict(self, model: TrainModule | None = None, dataloaders: Any = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None,
                ckpt_path: str | Path | None = None, *, module: TrainModule | None = None) -> list[Any] | None:
        """predict_step over every batch; a list of outputs (a list per loader when there are several), or None
        with `return_predictions=False`, which keeps none of them (a BasePredictionWriter writes them instead)."""
        module = _one_module(model, module)
        self._return_predictions = return_predictions is None or bool(return_predictions)
        ckpt_path = self._default_ckpt_path("predict", module, ckpt_path, calls_below_user=1)
        module = module or self.module
        dataloaders, datamodule = _datamodule_given_as_loaders(dataloaders, datamodule)
        datamodule = datamodule or (self.datamodule if dataloaders is None else None)
        self._check_inputs(module, datamodule, "predict", dataloaders)
        result = self._dispatch("predict", module, datamodule, resolve_ckpt_path(self, ckpt_path, "predict"), dataloaders)
        if result is None:
            return None
        return result[0] if len(result) == 1 else result

    def _evaluate(self, stage: str, module: TrainModule | None, dataloaders: Any, datamodule: DataModule | None,
                  ckpt_path: str | Path | None, verbose: bool) -> list[dict[str, float]]:
        ckpt_path = self._default_ckpt_path(stage, module, ckpt_path, calls_below_user=2)
        module = module or self.module
        dataloaders, datamodule = _datamodule_given_as_loaders(dataloaders, datamodule)
        datamodule = datamodule or (self.datamodule if dataloaders is None else None)
        self._check_inputs(module, datamodule, stage, dataloaders)
        results = self._dispatch(stage, module, datamodule, resolve_ckpt_path(self, ckpt_path, stage), dataloaders)
        if verbose and results and self.is_global_zero:
            print_results_table(results, stage)
        return results

    def _default_ckpt_path(self, stage: str, module: TrainModule | None, ckpt_path: str | Path | None,
                           calls_below_user: int) -> str | Path | None:
        """As in Lightning: called after a fit with neither a module nor a ckpt_path, a stage evaluates the fit's
        best checkpoint (where one was kept), not its last weights, and says so."""
        best = getattr(self.checkpoint_callback, "best_model_path", "")
        if module is not None or ckpt_path is not None or self.module is None or not best:
            return ckpt_path
        warnings.warn(f"Trainer.{stage} was called without a module: it uses the previous fit's best checkpoint, "
                      f"{best}; pass ckpt_path='last' (or a path), or the module, to choose.", stacklevel=2 + calls_below_user)
        return "best"

    def _check_inputs(self, module: Any, datamodule: Any, stage: str, loaders: Any) -> None:
        if not isinstance(module, TrainModule):
            got = "no module" if module is None else type(module).__name__
            raise MisconfigurationError(f"Trainer.{stage} needs a TrainModule; got {got}.")
        self.strategy.check_module(module, stage)
        _check_no_uncalled_lightning_hooks(module)
        if stage == "fit" and type(module).configure_optimizers is TrainModule.configure_optimizers:
            module.configure_optimizers()  # raises the explanatory error
        if stage == "fit" and not module.automatic_optimization:
            self._check_manual_optimization(type(module).__name__)
        if datamodule is not None and loaders is not None:
            raise MisconfigurationError(f"Trainer.{stage}: pass either dataloaders or a datamodule, not both.")
        if datamodule is None and loaders is None and own_loader(module, STAGE_LOADERS[stage]) is None:
            raise MisconfigurationError(
                f"Trainer.{stage} needs dataloaders, a datamodule, or a {type(module).__name__}.{STAGE_LOADERS[stage]}().")
        if datamodule is not None and not isinstance(datamodule, DataModule):
            raise MisconfigurationError(f"datamodule must be a DataModule; got {type(datamodule).__name__}.")

    def _check_manual_optimization(self, name: str) -> None:
        """Options the loop applies around optimizer steps mean nothing when the module takes the steps itself."""
        config, fixes = self.config, []
        if config.gradient_clip_val:
            fixes.append(f"gradient_clip_val={config.gradient_clip_val} (clip in training_step before opt.step(), "
                         "e.g. torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm))")
        if config.accumulate_grad_batches != 1:
            fixes.append(f"accumulate_grad_batches={config.accumulate_grad_batches} (step every n batches in training_step)")
        if config.lr_warmup_steps:
            fixes.append(f"lr_warmup_steps={config.lr_warmup_steps} (set the optimizer's lr in training_step)")
        if fixes:
            raise MisconfigurationError(
                f"{name} sets automatic_optimization=False, so the Trainer takes no optimizer steps and these options "
                f"would do nothing: {'; '.join(fixes)}. Remove them."
            )

    def _dispatch(self, stage: str, module: TrainModule, datamodule: DataModule | None, ckpt: Path | None,
                  *loaders: Any) -> Any:
        """Run here, or start the job's processes and adopt rank 0's result."""
        # After ckpt_path was resolved: "best" means the best of the callbacks that ran before, as in Lightning.
        self._attach_module_callbacks(module)
        environment = self.strategy.detect_environment()
        if self.strategy.job_size > 1 and not environment.launched:
            # Imported here: torch's elastic agent takes 150 ms to import, needed only to start processes.
            from trainer import launcher

            outcome = launcher.launch(self, stage, module, datamodule, ckpt, *loaders)
            # As after a stage run here, test() may follow fit() on the same module and datamodule.
            self.stage, self.module, self.datamodule = stage, module, datamodule
            if datamodule is not None:
                datamodule.trainer = self
            launcher.adopt(self, module, outcome)
            return outcome["result"]
        return self._run(stage, module, datamodule, ckpt, *loaders, environment=environment)["result"]

    # ------------------------------------------------------------------ one stage in this process
    def _run(self, stage: str, module: TrainModule, datamodule: DataModule | None, ckpt: Path | None,
             *loaders: Any, environment: Any = None, hand_back: bool = False) -> dict[str, Any]:
        """The stage in this process. `hand_back` (a worker the Trainer started): the outcome also carries the
        final state for the launching script on this node to adopt."""
        strategy = self.strategy
        strategy.setup_environment(environment or strategy.detect_environment())
        strategy.keeps_process_group = strategy.environment.launched and not hand_back
        if strategy.serve():  # a rank whose role is not the loop (a parameter server) served until the job ended
            strategy.teardown()
            return {"result": None}
        self.stage, self.module, self.datamodule, self.should_stop = stage, module, datamodule, False
        self._hook_targets = {}  # callbacks and module are fixed for the run from here on
        if self.config.seed is not None:
            seed_everything(self.config.seed)
        set_determinism(self.config.deterministic, self.config.benchmark)
        module._trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        self.metrics = MetricCollector(strategy.reduce)
        # Each stage reports its own values, as in Lightning: a test after a fit does not show the fit's.
        self.callback_metrics, self.logged_metrics, self._bar_values = {}, {}, {}
        # A failed stage's unfinished rows are not this one's.
        self._step_row, self._row_written_early, self._epoch_row = None, False, None
        try:
            checkpoint = load_resume_checkpoint(strategy, ckpt, stage)
            self._setup_loggers(checkpoint if stage == "fit" else None)
            prepared = stage_loaders(strategy, stage, module, datamodule, loaders, self.config.seed or 0,
                                     checkpoint.get("datamodule") if checkpoint is not None else None)
            strategy.setup_module(module)
            if stage == "fit":
                # Known before configure_optimizers, which may read estimated_stepping_batches (OneCycleLR).
                self.train_dataloader = prepared[0]
                self.num_training_batches = batch_limit(prepared[0], self.config.limit_train_batches)
                self.build_fit_loaders = functools.partial(build_loaders, strategy, stage, module, datamodule, loaders,
                                                           self.config.seed or 0)
                self.fit_loaders_epoch = self.progress.epoch  # before a checkpoint moves the run on
                self._setup_optimizers(module)
            for callback in self.callbacks:
                callback.setup(self, module, stage)
            if stage == "fit":  # an elastic restart continues from the newest good checkpoint of this run
                checkpoint = resume_after_restart(self, checkpoint)
            if checkpoint is not None:
                restore_checkpoint(self, checkpoint, full=stage == "fit")
                # The checkpoint's step was already written (if due) before it was saved; a micro-batch
                # that follows it without stepping must not write a second row for the same step.
                self._last_logged_step = self.progress.batches_stepped
            self._write_run_files()
            result = self._run_stage(stage, prepared)
            outcome = {"result": result}
            if stage == "fit" and not hand_back:  # the script that called fit goes on in this process
                strategy.gather_module()
            if hand_back:
                from trainer import launcher

                # Every rank joins: gathering a split model's weights (pipeline) is a collective. It leaves the
                # whole model on every rank, so each node's first rank hands it to the script on its node.
                state = launcher.final_state(self)
                if strategy.is_global_zero or strategy.local_rank == 0:
                    outcome["state"] = state
            return outcome
        except BaseException as exception:
            for callback in self.callbacks:
                callback.on_exception(self, module, exception)
            faults.raise_if_collective_timeout(exception, strategy)  # gloo's socket message -> the operation
            raise
        finally:
            for callback in self.callbacks:
                callback.teardown(self, module, stage)
            module.teardown(stage)
            if datamodule is not None:
                datamodule.teardown(stage)
            if strategy.is_global_zero:
                for logger in self.loggers:
                    logger.finalize()
            strategy.teardown()

    def _run_stage(self, stage: str, loaders: list[DataLoader]) -> Any:
        config = self.config
        if stage == "fit":
            self.call("on_fit_start")
            # Off: whatever the script set stays in force.
            anomaly = torch.autograd.set_detect_anomaly(True) if config.detect_anomaly else contextlib.nullcontext()
            with faults.StepGuard(self) as guard, anomaly:  # SIGTERM and non-finite losses, settled at optimizer steps
                fit_loop(self, loaders[0], loaders[1:], guard)
            self.call("on_fit_end")
            return None
        if stage == "predict":
            return predict_loop(self, loaders, config.limit_predict_batches)
        limit = config.limit_val_batches if stage == "validate" else config.limit_test_batches
        return evaluation_loop(self, stage, loaders, limit)

    def _setup_loggers(self, checkpoint: dict[str, Any] | None) -> None:
        saved = (checkpoint or {}).get("loggers", [])
        for index, logger in enumerate(self.loggers):
            if index < len(saved) and logger.continues(saved[index]):
                logger.load_state_dict(saved[index])  # resume in the same run folder, same rows
            else:
                earlier = self._earlier_attempts_version(logger.save_dir, logger.name) if self.is_global_zero else None
                if earlier is not None and not logger.version_chosen:
                    logger.version = earlier
                logger.version = self.strategy.broadcast(logger.version if self.is_global_zero else None)
        if not self.loggers:  # a resume continues in its run's folder, as loggers do through their state
            loops = (checkpoint or {}).get("loops", {})
            here = run_folder(self.config.default_root_dir, self.config.name)
            ours = "version" in loops and loops.get("folder", here) == here
            if self.is_global_zero and getattr(self, "_version", None) is None:
                self._version = self._earlier_attempts_version(self.config.default_root_dir, self.config.name)
            version = loops["version"] if ours else self._run_version() if self.is_global_zero else None
            self._version = self.strategy.broadcast(version)

    def _earlier_attempts_version(self, save_dir: str | Path, name: str) -> int | str | None:
        """After an elastic restart under torchrun, the version folder that the job's earlier attempts wrote to
        (their checkpoints are there; a new folder would start the job over). None on a first attempt."""
        environment = self.strategy.environment
        if environment.restart_count == 0 or environment.run_id is None:
            return None
        return version_of_job(save_dir, name, environment.run_id)

    def _write_run_files(self) -> None:
        """hparams.yaml (through the loggers) and the recipe's config.yaml in the run folder. Written once the
        stage's checkpoint, if any, has been restored: a refused one leaves a resumed run's files as they were."""
        if self.is_global_zero and self.module is not None and self.loggers:
            hparams = self._logged_hparams()
            for logger in self.loggers:
                logger.log_hyperparams(hparams)
        if self.is_global_zero and self.run_config is not None and not self.config.fast_dev_run:
            save_run_config(self.log_dir / "config.yaml", self.run_config)
        run_id = self.strategy.environment.run_id
        if self.is_global_zero and run_id is not None and self.stage == "fit":  # found again by a restart
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / RUN_ID_FILE).write_text(run_id)

    def _logged_hparams(self) -> dict[str, Any]:
        """The module's hparams and the datamodule's, as in Lightning; a key both hold with different values is refused."""
        assert self.module is not None
        hparams, data = dict(self.module.hparams), dict(self.datamodule.hparams) if self.datamodule is not None else {}
        clashing = sorted(key for key in hparams.keys() & data.keys() if not _equal(hparams[key], data[key]))
        if clashing:
            raise MisconfigurationError(
                f"the hparams {clashing} are saved by both {type(self.module).__name__} and "
                f"{type(self.datamodule).__name__} with different values; the logged hparams are both's, so rename one."
            )
        return {**hparams, **data}

    def _setup_optimizers(self, module: TrainModule) -> None:
        optimizers, schedulers = parse_optimizers(module.configure_optimizers())
        foreign = [type(c.scheduler).__name__ for c in schedulers if not is_torch_scheduler(c.scheduler)]
        if foreign and type(module).lr_scheduler_step is TrainModule.lr_scheduler_step:
            raise MisconfigurationError(
                f"the scheduler {foreign[0]} is not one of torch's, whose step() the Trainer knows how to call; define "
                f"{type(module).__name__}.lr_scheduler_step(self, scheduler, metric) to step it, as in Lightning.")
        if module.automatic_optimization:
            check_closure_optimizer(optimizers, self.config.accumulate_grad_batches, self.config.precision)
        self.optimizers = self.strategy.setup_optimizers(optimizers)
        self.manual_optimizers = [ManualOptimizer(optimizer, self) for optimizer in self.optimizers]
        self.lr_scheduler_configs = schedulers
        workers = self.strategy.data_parallel_size * self.config.accumulate_grad_batches
        self.lr_scaler = LRScaler(self.config.lr_scaling, workers, self.config.lr_warmup_steps)
        self.lr_scaler.apply(self.optimizers, schedulers)
        if self.lr_scaler.factor != 1.0 and self.is_global_zero:
            rates = ", ".join(f"{group['lr']:.4g}" for opt in self.optimizers for group in opt.param_groups)
            warmup = f", reached by linear warm-up over {self.config.lr_warmup_steps} steps" if self.config.lr_warmup_steps else ""
            print(f"lr_scaling={self.config.lr_scaling}: learning rates x{self.lr_scaler.factor:g} (data-parallel size "
                  f"{self.strategy.data_parallel_size} x accumulate_grad_batches {self.config.accumulate_grad_batches})"
                  f" -> {rates}{warmup}")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path, weights_only: bool = False) -> None:
        """Write a resumable checkpoint, or with `weights_only` one of the weights and hparams alone (call on
        every rank; the strategy decides who writes)."""
        if self.strategy.module is None:
            last = getattr(self.checkpoint_callback, "last_model_path", "")
            raise MisconfigurationError(
                "trainer.save_checkpoint needs a run's state in this process, and here is none: no stage ran yet, or "
                "the processes this script started have ended with it (optimizers included). "
                + (f"The run's last checkpoint is {last}; " if last else "")
                + "call it inside the run (a callback's on_train_end), or save the weights: torch.save(module.state_dict(), path)."
            )
        if self._step_row:  # saved in on_train_batch_end: the step's row so far belongs before the checkpoint
            self._write_step_row()
            self._row_written_early = True
        if self._epoch_row:  # likewise for the epoch's row, saved in on_train_epoch_end
            self._write_epoch_row()
        if self.is_global_zero:
            for logger in self.loggers:
                logger.save()  # the file must hold every row the checkpoint counts
        self.strategy.save_checkpoint(self.checkpoint_state(weights_only), path)

    def checkpoint_state(self, weights_only: bool = False) -> dict[str, Any]:
        """The checkpoint dict (format: trainer/checkpoint.py). A collective: call on every rank."""
        return build_checkpoint(self, weights_only)


# `help(Trainer)` and IDEs show every option, from the one dataclass that defines them.
Trainer.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     inspect.Parameter("callbacks", inspect.Parameter.KEYWORD_ONLY, default=None)]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
       for f in dataclasses.fields(TrainerConfig)]
)


_EPOCH_SUFFIX = re.compile(r"_epoch(?=$|/dataloader_idx_\d+$)")


#: LightningModule hooks this Trainer does not call, with what to do instead: overridden, they would do nothing.
_UNCALLED_LIGHTNING_HOOKS = {
    "configure_sharded_model": "rename it configure_model (its Lightning 2 name), which runs after setup(stage)",
}


def _check_no_uncalled_lightning_hooks(module: TrainModule) -> None:
    overridden = [name for name in _UNCALLED_LIGHTNING_HOOKS if callable(getattr(type(module), name, None))]
    if overridden:
        advice = "; ".join(f"{name}: {_UNCALLED_LIGHTNING_HOOKS[name]}" for name in overridden)
        raise MisconfigurationError(
            f"{type(module).__name__} defines {', '.join(overridden)}, Lightning hook(s) this Trainer does not call, so "
            f"they would silently do nothing. Instead: {advice}.")


def _one_module(model: TrainModule | None, module: TrainModule | None) -> TrainModule | None:
    if model is not None and module is not None and model is not module:
        raise MisconfigurationError("pass the module once: as model (Lightning's name) or as module.")
    return model if model is not None else module


def _datamodule_given_as_loaders(loaders: Any, datamodule: DataModule | None) -> tuple[Any, DataModule | None]:
    """Lightning takes a DataModule in the dataloaders' place (`trainer.fit(model, dm)`): (loaders, datamodule)."""
    if not isinstance(loaders, DataModule):
        return loaders, datamodule
    if datamodule is not None:
        raise MisconfigurationError("a DataModule was given as the dataloaders and another as datamodule; pass one.")
    return None, loaders


def _check_state_keys(callbacks: list[Callback]) -> None:
    """Callbacks with state need distinct state_keys: under one key, a checkpoint keeps one of their states,
    and a resume gives it to both (two ModelCheckpoints would then evict each other's files)."""
    seen: dict[str, Callback] = {}
    for callback in callbacks:
        if not callback.has_state:
            continue  # nothing saved, nothing to mix up
        other = seen.setdefault(callback.state_key, callback)
        if other is not callback:
            raise MisconfigurationError(
                f"two {type(callback).__name__} callbacks have the same state_key {callback.state_key!r}, so a "
                "checkpoint could keep only one of their states; give them different settings (for ModelCheckpoint: "
                "monitor, mode or filename), or override state_key."
            )


def _callback_list(value: Any, must: str) -> list[Callback]:
    """`value` as a list of callbacks (one alone is accepted, as Lightning accepts it); `must` starts the error for
    anything else in it, e.g. "callbacks must be"."""
    callbacks = [value] if isinstance(value, Callback) else list(value or [])
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise MisconfigurationError(f"{must} Callback instances; got {type(callback).__name__}.")
    return callbacks


def _checkpointing_last(callbacks: list[Callback]) -> list[Callback]:
    """Checkpointing runs after callbacks that may change what it saves (EarlyStopping's counters)."""
    from callbacks import ModelCheckpoint

    return sorted(callbacks, key=lambda c: isinstance(c, ModelCheckpoint))


def _equal(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements, arrays
        return False
