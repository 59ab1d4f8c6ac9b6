"""What a Trainer builds from its options and for a stage, and checks of what a stage is given."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

from torchyard.callbacks import ModelCheckpoint, ModelSummary, RichProgressBar, Timer
from torchyard.callbacks.base import Callback
from torchyard.callbacks.compile_report import CompileReport
from torchyard.callbacks.profilers import Profiler, build_profiler
from torchyard.trainer.checkpointing.resume import shown_path
from torchyard.trainer.compile.regions import unwrap_compiled
from torchyard.trainer.config import TrainerConfig
from torchyard.trainer.data.loaders import STAGE_LOADERS, own_loader
from torchyard.trainer.datamodule import DataModule
from torchyard.trainer.diagnosis.doctor import announce
from torchyard.trainer.diagnosis.stragglers import StragglerWatch
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.evaluation.evaluator import EvaluatorProcess
from torchyard.trainer.logs.loggers import CSVLogger, Logger, TensorBoardLogger, share_run_folders
from torchyard.trainer.logs.runs import RUN_ID_FILE, dump_yaml, save_run_config
from torchyard.trainer.module import TrainModule
from torchyard.trainer.optim import (
    LRScaler,
    SchedulerConfig,
    check_closure_optimizer,
    check_monitors,
    is_torch_scheduler,
    parse_optimizers,
)

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer


def apply_fast_dev_run(config: TrainerConfig) -> TrainerConfig:
    """`config` as fast_dev_run=n runs it: n batches of each stage, once, writing nothing."""
    runs = int(config.fast_dev_run)
    if not runs:
        return config
    return dataclasses.replace(
        config, max_epochs=1, max_steps=-1, limit_train_batches=runs, limit_val_batches=runs,
        limit_test_batches=runs, limit_predict_batches=runs, num_sanity_val_steps=0, val_check_interval=1.0,
        enable_checkpointing=False, logger=False,
    )

def apply_overfit_batches(config: TrainerConfig) -> TrainerConfig:
    """`config` as overfit_batches=n runs it: the first n (or share n of the) training and validation batches."""
    overfit = config.overfit_batches
    if not overfit:
        return config
    return dataclasses.replace(config, limit_train_batches=overfit, limit_val_batches=overfit)


def build_loggers(config: TrainerConfig, spec: Any) -> list[Logger]:
    """The loggers the `logger` option names (True and 'csv': a CSVLogger), none under fast_dev_run."""
    if config.fast_dev_run or spec is False or spec is None:
        return []
    items = spec if isinstance(spec, (list, tuple)) else [spec]
    root, name = config.default_root_dir, config.name
    loggers: list[Logger] = []
    for item in items:
        if isinstance(item, Logger):
            loggers.append(item)
        elif item is True or item == "csv":
            loggers.append(CSVLogger(root, name))
        elif item == "tensorboard":
            loggers.append(TensorBoardLogger(root, name))
    share_run_folders(loggers)  # one run, one folder: csv and tensorboard side by side in version_<n>
    return loggers  # anything else was refused by config.validate

def with_default_callbacks(config: TrainerConfig, callbacks: list[Callback]) -> list[Callback]:
    """`callbacks` and those the options add (progress bar, summary, checkpointing, a Timer for max_time)."""
    kinds = {type(c) for c in callbacks}
    # fast_dev_run turns checkpointing off itself; the checkpoint callbacks a user gives then save nothing.
    for option, kind in (("enable_progress_bar", RichProgressBar), ("enable_checkpointing", ModelCheckpoint)):
        given = [k.__name__ for k in kinds if issubclass(k, kind)]
        if given and not getattr(config, option) and not (option == "enable_checkpointing" and config.fast_dev_run):
            raise MisconfigurationError(f"{option}=False, but callbacks has a {given[0]}; drop one of the two.")
    if config.enable_progress_bar and not any(issubclass(k, RichProgressBar) for k in kinds):
        callbacks.append(RichProgressBar())
    if config.enable_model_summary and not any(issubclass(k, ModelSummary) for k in kinds):
        callbacks.append(ModelSummary())
    if config.enable_checkpointing and not any(issubclass(k, ModelCheckpoint) for k in kinds):
        callbacks.append(ModelCheckpoint(save_last=True))
    if config.evaluator is not None:
        if not config.enable_checkpointing:
            raise MisconfigurationError("evaluator scores the checkpoints the fit writes, but enable_checkpointing="
                                        "False writes none; drop one of the two.")
        # Ahead of the ModelSummary: it waits for the evaluator's last score in on_fit_end, so that what the
        # evaluator prints comes before the summary's closing "training stopped" line, the fit's last.
        summary = next((i for i, c in enumerate(callbacks) if isinstance(c, ModelSummary)), len(callbacks))
        callbacks.insert(summary, EvaluatorProcess(config.evaluator))
    if config.max_time is not None:
        if any(issubclass(k, Timer) for k in kinds):  # Lightning ignores max_time then, with a warning
            raise MisconfigurationError("max_time and a Timer callback both time the run; give the budget to one of "
                                        "them (Timer(duration=...) or max_time).")
        callbacks.append(Timer(duration=config.max_time))
    if config.compile is not None:
        callbacks.append(CompileReport())
    profiler = build_profiler(config.profiler)
    if profiler is not None and not any(isinstance(c, Profiler) for c in callbacks):
        callbacks.append(profiler)
    several = isinstance(config.devices, int) and config.devices * config.num_nodes > 1
    if several and config.diagnosis != "off" and not any(issubclass(k, StragglerWatch) for k in kinds):
        callbacks.append(StragglerWatch(every_n_steps=config.log_every_n_steps))  # names a persistently slow rank
    _check_state_keys(callbacks)
    return _checkpointing_last(callbacks)


def check_sync_batchnorm(config: TrainerConfig, processes: int, device_type: str) -> None:
    """sync_batchnorm needs several processes (else it does nothing: a warning) on CUDA (torch's SyncBatchNorm has
    no CPU kernel: an error, before any process starts)."""
    if not config.sync_batchnorm:
        return
    if processes == 1:
        warnings.warn("sync_batchnorm=True has no effect on one process: there are no other batch statistics to "
                      "synchronise with.", stacklevel=3)
    elif device_type != "cuda":
        raise MisconfigurationError("sync_batchnorm=True needs CUDA devices: torch's SyncBatchNorm has no CPU kernel; "
                                    "drop it (each process then normalises with its own batch statistics).")


def module_callbacks(trainer: Trainer, module: TrainModule) -> list[Callback]:
    """Lightning's configure_callbacks: the Trainer's callbacks with the module's, which replace those of their
    types or base types."""
    given = callback_list(module.configure_callbacks(), f"{type(module).__name__}.configure_callbacks must return")
    kept = [callback for callback in trainer.callbacks if not any(isinstance(mine, type(callback)) for mine in given)]
    _check_state_keys(kept + given)
    trainer.strategy.check_config(trainer.config, kept + given)
    return _checkpointing_last(kept + given)


def check_inputs(trainer: Trainer, module: Any, datamodule: Any, stage: str, loaders: Any) -> None:
    """Clear errors for what a stage cannot run with, before anything starts."""
    if not isinstance(module, TrainModule):
        got = "no module" if module is None else type(module).__name__
        raise MisconfigurationError(f"Trainer.{stage} needs a TrainModule; got {got}.")
    trainer.strategy.check_module(module, stage)
    _check_no_uncalled_lightning_hooks(module)
    if stage == "fit" and type(module).configure_optimizers is TrainModule.configure_optimizers:
        module.configure_optimizers()  # raises the explanatory error
    if stage == "fit" and not module.automatic_optimization:
        _check_manual_optimization(trainer.config, type(module).__name__)
    if datamodule is not None and loaders is not None:
        raise MisconfigurationError(f"Trainer.{stage}: pass either dataloaders or a datamodule, not both.")
    if datamodule is None and loaders is None and own_loader(module, STAGE_LOADERS[stage]) is None:
        raise MisconfigurationError(
            f"Trainer.{stage} needs dataloaders, a datamodule, or a {type(module).__name__}.{STAGE_LOADERS[stage]}().")
    if datamodule is not None and not isinstance(datamodule, DataModule):
        raise MisconfigurationError(f"datamodule must be a DataModule; got {type(datamodule).__name__}.")

def _check_manual_optimization(config: TrainerConfig, name: str) -> None:
    """Options the loop applies around optimizer steps mean nothing when the module takes the steps itself."""
    fixes = []
    if config.gradient_clip_val:
        fixes.append(f"gradient_clip_val={config.gradient_clip_val} (clip in training_step before opt.step(), "
                     "e.g. torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm))")
    if config.accumulate_grad_batches != 1:
        fixes.append(
            f"accumulate_grad_batches={config.accumulate_grad_batches} (step every n batches in training_step)"
        )
    if config.lr_warmup_steps:
        fixes.append(f"lr_warmup_steps={config.lr_warmup_steps} (set the optimizer's lr in training_step)")
    if fixes:
        raise MisconfigurationError(
            f"{name} sets automatic_optimization=False, so the Trainer takes no optimizer steps and these options "
            f"would do nothing: {'; '.join(fixes)}. Remove them."
        )


def logged_hparams(module: TrainModule, datamodule: DataModule | None) -> dict[str, Any]:
    """The module's hparams and the datamodule's, as in Lightning; a key both hold with different values is refused."""
    hparams, data = dict(module.hparams), dict(datamodule.hparams) if datamodule is not None else {}
    clashing = sorted(key for key in hparams.keys() & data.keys() if not _equal(hparams[key], data[key]))
    if clashing:
        raise MisconfigurationError(
            f"the hparams {clashing} are saved by both {type(module).__name__} and "
            f"{type(datamodule).__name__} with different values; the logged hparams are both's, so rename one."
        )
    return {**hparams, **data}


#: LightningModule hooks this Trainer does not call, with what to do instead: overridden, they would do nothing.
_UNCALLED_LIGHTNING_HOOKS = {
    "configure_sharded_model": "rename it configure_model (its Lightning 2 name), which runs after setup(stage)",
}


def _check_no_uncalled_lightning_hooks(module: TrainModule) -> None:
    overridden = [name for name in _UNCALLED_LIGHTNING_HOOKS if callable(getattr(type(module), name, None))]
    if overridden:
        advice = "; ".join(f"{name}: {_UNCALLED_LIGHTNING_HOOKS[name]}" for name in overridden)
        raise MisconfigurationError(
            f"{type(module).__name__} defines {', '.join(overridden)}, Lightning hook(s) this Trainer does not call, "
            f"so they would silently do nothing. Instead: {advice}."
        )


def one_module(model: TrainModule | None, module: TrainModule | None) -> TrainModule | None:
    if model is not None and module is not None and model is not module:
        raise MisconfigurationError("pass the module once: as model (Lightning's name) or as module.")
    # torch.compile(module) trains as its plain module, compiled the same way by the strategy (keys stay plain).
    return unwrap_compiled(model if model is not None else module)


def datamodule_given_as_loaders(loaders: Any, datamodule: DataModule | None) -> tuple[Any, DataModule | None]:
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


def callback_list(value: Any, must: str) -> list[Callback]:
    """`value` as a list of callbacks (one alone is accepted, as Lightning accepts it); `must` starts the error for
    anything else in it, e.g. "callbacks must be"."""
    callbacks = [value] if isinstance(value, Callback) else list(value or [])
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise MisconfigurationError(f"{must} Callback instances; got {type(callback).__name__}.")
    return callbacks


def _checkpointing_last(callbacks: list[Callback]) -> list[Callback]:
    """Checkpointing runs after callbacks that may change what it saves (EarlyStopping's counters)."""
    return sorted(callbacks, key=lambda c: isinstance(c, ModelCheckpoint))


def _equal(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements, arrays
        return False


def build_optimizers(trainer: Trainer, module: TrainModule) -> tuple[list[Optimizer], list[SchedulerConfig], LRScaler]:
    """configure_optimizers' optimizers (set up by the strategy), schedulers, and the lr_scaling applied to them."""
    config, strategy = trainer.config, trainer.strategy
    optimizers, schedulers = parse_optimizers(module.configure_optimizers())
    foreign = [type(c.scheduler).__name__ for c in schedulers if not is_torch_scheduler(c.scheduler)]
    if foreign and type(module).lr_scheduler_step is TrainModule.lr_scheduler_step:
        raise MisconfigurationError(
            f"the scheduler {foreign[0]} is not one of torch's, whose step() the Trainer knows how to call; define "
            f"{type(module).__name__}.lr_scheduler_step(self, scheduler, metric) to step it, as in Lightning.")
    if module.automatic_optimization:
        check_closure_optimizer(optimizers, config.accumulate_grad_batches, config.precision)
        check_monitors(schedulers)
    optimizers = strategy.setup_optimizers(optimizers)
    workers = strategy.data_parallel_size * config.accumulate_grad_batches
    lr_scaler = LRScaler(config.lr_scaling, workers, config.lr_warmup_steps)
    lr_scaler.apply(optimizers, schedulers)
    if lr_scaler.factor != 1.0 and trainer.is_global_zero:
        rates = ", ".join(f"{group['lr']:.4g}" for opt in optimizers for group in opt.param_groups)
        warmup = f", reached by linear warm-up over {config.lr_warmup_steps} steps" if config.lr_warmup_steps else ""
        print(f"lr_scaling={config.lr_scaling}: learning rates x{lr_scaler.factor:g} (data-parallel size "
              f"{strategy.data_parallel_size} x accumulate_grad_batches {config.accumulate_grad_batches})"
              f" -> {rates}{warmup}")
    return optimizers, schedulers, lr_scaler


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested recipe as {"model.lr": 0.1, ...}, so that two recipes compare key by key."""
    if not isinstance(tree, dict) or not tree:
        return {prefix.rstrip("."): tree}
    return {key: value for name, item in tree.items() for key, value in _flat(item, f"{prefix}{name}.").items()}


def save_recipe_beside_earlier(folder: Path, run_config: dict[str, Any], stage: str = "fit") -> Path | None:
    """Save the resolved recipe as `folder`/config.yaml; where a run's earlier attempt saved one already, it is kept:
    a recipe that differs from it is saved beside it (config_resume_<n>.yaml, config_test_<n>.yaml for a test of the
    run, ...; once: a recipe saved there already is not saved again) and its differing keys printed."""
    earlier_path = folder / "config.yaml"
    if not earlier_path.is_file():
        save_run_config(earlier_path, run_config)
        return earlier_path
    import yaml  # here, for the recipes the `trainer` command runs: a Python script's import stays light

    earlier, now = _flat(yaml.safe_load(earlier_path.read_text()) or {}), _flat(yaml.safe_load(dump_yaml(run_config)))
    unset = "<unset>"
    changed = sorted(key for key in earlier.keys() | now.keys() if earlier.get(key, unset) != now.get(key, unset))
    if not changed:
        return None
    differences = ", ".join(f"{key}: {earlier.get(key, unset)} -> {now.get(key, unset)}" for key in changed)
    saved = sorted(folder.glob("config_*.yaml"))
    same = next((path for path in saved if _flat(yaml.safe_load(path.read_text())) == now), None)
    if same is None:
        kind, number = "resume" if stage == "fit" else stage, 1
        while (folder / f"config_{kind}_{number}.yaml").exists():
            number += 1
        same = folder / f"config_{kind}_{number}.yaml"
        save_run_config(same, run_config)
    # stderr, as the other lines the trainer adds: predict prints its text to stdout
    print(f"trainer: this recipe differs from the run's {shown_path(earlier_path)} in {differences}; "
          f"kept that file, this recipe is in {same.name}", file=sys.stderr, flush=True)
    return same


def write_run_files(trainer: Trainer) -> None:
    """hparams.yaml (through the loggers) and the recipe's config.yaml in the run folder. Written once the
    stage's checkpoint, if any, has been restored: a refused one leaves a resumed run's files as they were."""
    autolog = trainer.config.enable_autolog_hparams
    if trainer.is_global_zero and trainer.module is not None and trainer.loggers and autolog:
        hparams = logged_hparams(trainer.module, trainer.datamodule)
        for logger in trainer.loggers:
            if getattr(logger, "evaluation_stage", None) is None:  # an evaluated run keeps its own hparams.yaml
                logger.log_hyperparams(hparams)
    if trainer.is_global_zero and trainer.run_config is not None and not trainer.config.fast_dev_run:
        save_recipe_beside_earlier(Path(trainer.log_dir), trainer.run_config, trainer.stage or "fit")
    run_id = trainer.strategy.environment.run_id
    if trainer.is_global_zero and run_id is not None and trainer.stage == "fit":  # found again by a restart
        Path(trainer.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(trainer.log_dir) / RUN_ID_FILE).write_text(run_id)


def announce_live_job(trainer: Trainer) -> Path | None:
    """Where `trainer doctor <run folder>` reaches this stage's watchdogs, left in the run folder by rank 0 (None:
    not rank 0, or no watchdog watches the ranks); removed when the stage ends (trainer/diagnosis/doctor.py)."""
    job = trainer.strategy.live_job() if trainer.is_global_zero else None
    return None if job is None else announce(trainer.log_dir, job)
