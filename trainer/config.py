"""The typed trainer options: one dataclass documents, defaults and validates every key.

`Trainer(**options)` and a recipe's `trainer:` section both go through TrainerConfig, so a key has
one name, one default and one check, wherever it is set.

This module imports no torch (nor any module that does) at import time: `trainer --help` and
`trainer config --reference` read the schema, and importing torch takes seconds. The value sets the
schema names (precisions, lr scalings, ...) are defined here; the modules that act on them import them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchyard.trainer.compile.options import compile_options
from torchyard.trainer.errors import MisconfigurationError, closest

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
# Lightning's other spellings of the same three, so that a ported Trainer(precision=...) keeps working.
PRECISION_ALIASES = {"32-true": "32", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
# Lightning's whole-model precisions (weights and optimizer state in that dtype), with what to use instead.
UNSUPPORTED_PRECISIONS = {
    "16-true": "'16-mixed', which keeps float32 weights and optimizer state",
    "bf16-true": "'bf16-mixed', which keeps float32 weights and optimizer state",
    "64-true": "precision='32' with the module cast by you (module.double()) and float64 data",
}


CLIP_ALGORITHMS = ("norm", "value")  # gradient clipping by global L2 norm, or element-wise
LR_SCALINGS = ("none", "linear", "sqrt")
NONFINITE_MODES = ("error", "skip", "ignore")
DIAGNOSIS_MODES = ("on", "off", "debug")
LAUNCHERS = ("auto", "ray")
_RAY_ADDRESS = re.compile(r"^[^\s:/]+:\d+$")  # the head node's GCS, as `ray start --head` prints it
PROFILERS = ("simple", "advanced", "pytorch")
#: What barebones=True turns off, as in Lightning.
BAREBONES_OFF = ("logger", "enable_checkpointing", "enable_progress_bar", "enable_model_summary")


def _opt(default: Any, help: str, shown_type: str | None = None) -> Any:
    """A TrainerConfig field; `shown_type` is the type the reference names where the annotation is wider
    (omegaconf types a recipe's value by the annotation, and takes no union of int and str)."""
    metadata = {"help": help, "type": shown_type}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainerConfig:
    """Every Trainer option, with its default and meaning."""

    max_epochs: Any = _opt(None, "Stop after this many epochs; -1 for no limit; unset: 1000 unless max_steps is set.")
    max_steps: int = _opt(-1, "Stop after this many optimizer steps; -1 for no limit.")
    max_time: Any = _opt(
        None,
        "Stop training once it has run this long: 'DD:HH:MM:SS', seconds, a dict like {hours: 12} "
        "or a timedelta (a Timer callback; a resumed run goes on with what is left of it).",
    )
    min_epochs: int = _opt(0, "Train at least this many epochs, even if a callback asks to stop.")
    limit_train_batches: Any = _opt(
        1.0, "Batches per training epoch (per process): a fraction (float) or a count (int)."
    )
    limit_val_batches: Any = _opt(1.0, "Batches per validation (per process): a fraction (float) or a count (int).")
    limit_test_batches: Any = _opt(1.0, "Batches per test run (per process): a fraction (float) or a count (int).")
    limit_predict_batches: Any = _opt(1.0, "Batches per predict run, of the loader as one process sees it (the "
                                      "predictions are one process's): a fraction (float) or a count (int).")
    val_check_interval: Any = _opt(
        1.0,
        "Validate every this fraction of an epoch (float) or this many batches (int), "
        "and at each epoch's end (unlike Lightning, whose epoch end then validates only on a multiple).",
    )
    check_val_every_n_epoch: int = _opt(1, "Validate after every n-th training epoch.")
    reload_dataloaders_every_n_epochs: int = _opt(0, "Ask the datamodule (or module) for new train and validation "
                                                  "loaders every n epochs (0: once per fit), e.g. for a curriculum "
                                                  "that reads trainer.current_epoch.")
    num_sanity_val_steps: int = _opt(2, "Validation batches run before training to catch bugs early; -1 for all.")
    accumulate_grad_batches: int = _opt(1, "Micro-batches whose gradients add up before one optimizer step.")
    gradient_clip_val: Any = _opt(None, "Clip gradients at this value (unset: no clipping).")
    gradient_clip_algorithm: str = _opt("norm", "'norm' (global L2 norm) or 'value' (element-wise).")
    precision: str = _opt(
        "32", f"One of {', '.join(PRECISIONS)} (Lightning's spellings '32-true', '16' and 'bf16' are taken as those)."
    )
    seed: Any = _opt(
        None, "Seed python, numpy and torch when the Trainer is built (build the module after it) and on every rank "
              "as a stage starts; also seeds the data order (default order seed 0)."
    )
    deterministic: bool = _opt(
        False, "Ask torch for deterministic algorithms, warning where one has none (Lightning's 'warn')."
    )
    benchmark: Any = _opt(
        None,
        "Set torch.backends.cudnn.benchmark: cuDNN times convolution algorithms per input shape and "
        "keeps the fastest; unset: left as it is (off under deterministic).",
    )
    detect_anomaly: bool = _opt(
        False,
        "Train under torch.autograd.set_detect_anomaly: a backward that makes NaN raises, "
        "naming the forward operation (slow; for debugging).",
    )
    default_root_dir: str = _opt("runs", "Runs land in <default_root_dir>/<name>/version_<n>/.")
    name: str = _opt("default", "The run name: the folder under default_root_dir.")
    logger: Any = _opt(True, "True or 'csv': CSV logger; 'tensorboard'; a list of those; False: none.")
    log_every_n_steps: int = _opt(50, "Write step metrics to the loggers every n optimizer steps.")
    enable_progress_bar: bool = _opt(True, "Show the rich progress bar (rank 0 only).")
    enable_checkpointing: bool = _opt(
        True, "Add a ModelCheckpoint when none is given: the newest epoch checkpoint, also named last.ckpt."
    )
    enable_model_summary: bool = _opt(True, "Print a model summary table at fit start and a run summary at its end.")
    fast_dev_run: Any = _opt(False, "Run 1 (or n) batch of train, val and test, without loggers or checkpoints.")
    accelerator: str = _opt("auto", "'cpu', 'cuda' or 'auto'.")
    strategy: Any = _opt("auto", "'single', 'dp', 'ddp', 'fsdp', 'pipeline', 'ps', or {name: ..., options...}.")
    devices: Any = _opt(1, "Devices (processes for ddp) per node; 'auto': every GPU when on GPUs, else 1.",
                        shown_type="int")  # omegaconf would refuse 'auto' in a recipe as not an int
    num_nodes: int = _opt(1, "Number of nodes.")
    lr_scaling: str = _opt("none", f"Scale learning rates by the data-parallel size: {', '.join(LR_SCALINGS)}.")
    lr_warmup_steps: int = _opt(0, "Steps of linear warm-up from the base to the scaled learning rate.")
    timeout: float = _opt(1800.0, "Seconds a collective may wait before the job fails instead of hanging.")
    diagnosis: str = _opt(
        "on",
        "Watch the ranks of a multi-process job: 'on' names a stuck rank and its line at a timeout and reports a "
        "rank persistently slower than the others; 'debug' also stops at the first collective whose operation, "
        "shapes or call site differ between ranks, the user's own included (slower); 'off' neither. "
        "docs/diagnosis.md.",
    )
    max_restarts: int = _opt(
        0, "Times the elastic agent restarts a failed multi-process job (resuming from the last checkpoint)."
    )
    nonfinite_loss: str = _opt(
        "error",
        "A NaN/inf training loss: 'error' stops the fit, naming step and batch, before its optimizer step on "
        "a CPU (on a GPU it reads the losses every 0.5 s, never into a checkpoint); 'skip' skips that step "
        "(one host sync per step on a GPU) and counts it in train/skipped_nonfinite; 'ignore' checks nothing.",
    )
    inference_mode: bool = _opt(True, "Evaluate under torch.inference_mode (else no_grad).")
    tune_malloc: bool = _opt(
        True,
        "On glibc, keep the host memory a step frees for the next step instead of handing it back to the OS and "
        "faulting it in again (mallopt's trim and mmap thresholds, per process; the digits CNN's epochs run 8-22% "
        "faster on the CPU). Left alone where MALLOC_* or GLIBC_TUNABLES are set or jemalloc/tcmalloc is preloaded.",
    )
    evaluator: Any = _opt(
        None,
        "Score each checkpoint in a side process instead of (or beside) in-loop validation: true, or "
        "{accelerator, device, every_n, poll_interval, limit_val_batches} (docs/evaluator.md); unset: none.",
    )
    launcher: str = _opt(
        "auto",
        "Who starts a job's processes when no launcher (torchrun, srun, mpirun) did: 'auto', torch's elastic agent "
        "in this process; 'ray', Ray actors on the cluster at ray_address (needs torchyard[ray]; docs/ray.md).",
    )
    ray_address: Any = _opt(
        None,
        "launcher='ray': the cluster's 'host:port', 'auto' (RAY_ADDRESS, else a cluster started on this machine) or "
        "'local' (a new local cluster); unset: 'auto' where there is such a cluster, else 'local'.",
        shown_type="str",
    )
    min_steps: Any = _opt(None, "Train at least this many optimizer steps, even if a callback asks to stop "
                          "(max_epochs and max_steps still end the fit).", shown_type="int")
    overfit_batches: Any = _opt(0.0, "Train and validate on the same first batches of the training and validation "
                                "loaders every epoch, unshuffled: a fraction (float) or a count (int); 0: off.")
    profiler: Any = _opt(None, f"Time the fit and print a summary at its end: {', '.join(PROFILERS)}, or a profiler "
                         "from torchyard.callbacks.profilers; unset: none.", shown_type="str")
    sync_batchnorm: bool = _opt(False, "Turn BatchNorm layers into torch.nn.SyncBatchNorm (statistics over every "
                                "data-parallel process; needs CUDA devices).")
    use_distributed_sampler: bool = _opt(True, "Shard, seed and resume the loaders' samplers per rank; False: use "
                                         "each loader as given (shard it yourself; a resume restarts its epoch).")
    barebones: bool = _opt(False, "Run the loop alone, as in Lightning: no loggers, checkpoints, progress bar or "
                           "model summary (setting one of them on too is an error).")
    enable_autolog_hparams: bool = _opt(True, "Give the loggers the module's and datamodule's hparams at the "
                                        "start of each stage.")
    compile: Any = _opt(False, "torch.compile the model once the strategy has wrapped or sharded it: true, or "
                        "{backend, mode, fullgraph, dynamic, regions: [block class names], cache_dir} "
                        "(docs/strategies.md).",
                        shown_type="bool")

    def __post_init__(self) -> None:
        validate(self)

    def resolved_max_epochs(self) -> int:
        """max_epochs with 'unset' resolved: 1000 without max_steps, else unlimited (-1)."""
        if self.max_epochs is None:
            return 1000 if self.max_steps == -1 else -1
        return int(self.max_epochs)


EVALUATOR_ACCELERATORS = ("auto", "cpu", "cuda")


@dataclass
class EvaluatorConfig:
    """The evaluator side process (trainer/evaluation/evaluator.py): `Trainer(evaluator={...})`, a recipe's
    `trainer.evaluator`, or the options of `trainer evaluate`."""

    #: 'cpu', 'cuda', or 'auto': a GPU of this node that the training leaves free, else the CPU.
    accelerator: str = "auto"
    #: With 'cuda': the GPU's index on this node; unset: the first one the training leaves free.
    device: Any = None
    #: Score every n-th checkpoint the evaluator finds (the run's last one always).
    every_n: int = 1
    #: Seconds between two looks at the checkpoint folder.
    poll_interval: float = 1.0
    #: Validation batches per checkpoint: a fraction (float) or a count (int).
    limit_val_batches: Any = 1.0


def evaluator_config(value: Any) -> EvaluatorConfig | None:
    """The evaluator option as an EvaluatorConfig (None: off), checked; `value` is None/False, True, a mapping of
    EvaluatorConfig fields or an EvaluatorConfig."""
    if value is None or value is False:
        return None
    if value is True:
        value = EvaluatorConfig()
    elif isinstance(value, Mapping):
        fields = [f.name for f in dataclasses.fields(EvaluatorConfig)]
        for key in value:
            _need(key in fields, f"unknown evaluator option {key!r}{closest(str(key), fields)}; "
                                 f"the evaluator takes {', '.join(fields)}.")
        value = EvaluatorConfig(**value)
    _need(isinstance(value, EvaluatorConfig),
          f"evaluator={value!r}: use true, or a mapping such as {{accelerator: cpu, every_n: 1}}.")
    _need(value.accelerator in EVALUATOR_ACCELERATORS,
          f"evaluator.accelerator={value.accelerator!r}; use one of {', '.join(EVALUATOR_ACCELERATORS)}.")
    _need(value.device is None or (_is_int(value.device) and value.device >= 0),
          f"evaluator.device={value.device!r} must be a GPU index (int >= 0) or unset.")
    _need(value.device is None or value.accelerator != "cpu",
          f"evaluator.device={value.device} names a GPU, but evaluator.accelerator='cpu'; drop one of the two.")
    _need(_is_int(value.every_n) and value.every_n >= 1,
          f"evaluator.every_n={value.every_n!r} must be an integer >= 1.")
    interval = value.poll_interval
    _need(isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval > 0,
          f"evaluator.poll_interval={interval!r} must be a positive number of seconds.")
    limit = value.limit_val_batches
    _need((_is_int(limit) and limit >= 1) or (isinstance(limit, float) and 0.0 < limit <= 1.0),
          f"evaluator.limit_val_batches={limit!r} must be a fraction in (0.0, 1.0] or a batch count (int >= 1).")
    return value


_DHMS = re.compile(r"^\s*(\d+):(\d+):(\d+):(\d+)\s*$")


def parse_duration(duration: Any, what: str = "duration") -> float | None:
    """Seconds from None, a number of seconds, a timedelta, a dict of timedelta arguments or "DD:HH:MM:SS";
    `what` names the setting in errors (e.g. "max_time='1:30'")."""
    if duration is None:
        return None
    seconds: float
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, dict):
        try:
            seconds = timedelta(**duration).total_seconds()
        except TypeError as err:
            raise MisconfigurationError(
                f"{what}: a dict takes timedelta arguments (days, hours, minutes, seconds, ...)."
            ) from err
    elif isinstance(duration, str):
        match = _DHMS.match(duration)
        if match is None:
            raise MisconfigurationError(f"{what}: a string must read 'DD:HH:MM:SS', e.g. '00:12:00:00'.")
        days, hours, minutes, secs = (int(group) for group in match.groups())
        seconds = timedelta(days=days, hours=hours, minutes=minutes, seconds=secs).total_seconds()
    elif isinstance(duration, (int, float)) and not isinstance(duration, bool):
        seconds = float(duration)
    else:
        raise MisconfigurationError(f"{what}: use seconds, a timedelta, a dict like {{'hours': 2}} or 'DD:HH:MM:SS'.")
    if seconds < 0:
        raise MisconfigurationError(f"{what} is negative; give a time budget >= 0.")
    return seconds


def option_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainerConfig)]


#: Lightning 1.x Trainer options that Lightning 2 removed, with their 2.x spelling (which ported code should use).
REMOVED_OPTIONS = {
    "gpus": "accelerator='gpu', devices=N",
    "tpu_cores": "accelerator='tpu', devices=N (TPUs are not supported here)",
    "ipus": "accelerator='ipu', devices=N (IPUs are not supported here)",
    "num_processes": "devices=N (with strategy='ddp')",
    "auto_select_gpus": "devices='auto'",
    "progress_bar_refresh_rate": "callbacks=[TQDMProgressBar(refresh_rate=N)], or enable_progress_bar=False",
    "weights_summary": "enable_model_summary, or callbacks=[ModelSummary(max_depth=N)]",
    "checkpoint_callback": "enable_checkpointing",
    "resume_from_checkpoint": "trainer.fit(model, ckpt_path=...)",
    "flush_logs_every_n_steps": "the logger's own flush setting (CSVLogger(flush_logs_every_n_steps=N))",
    "stochastic_weight_avg": "callbacks=[StochasticWeightAveraging(...)]",
    "terminate_on_nan": "detect_anomaly=True, or nonfinite_loss='error' (the default here)",
    "auto_lr_find": "Tuner(trainer).lr_find(model)",
    "auto_scale_batch_size": "Tuner(trainer).scale_batch_size(model)",
    "track_grad_norm": "logging torch.nn.utils.get_total_norm of the gradients in on_before_optimizer_step",
    "replace_sampler_ddp": "use_distributed_sampler",
    "multiple_trainloader_mode": "CombinedLoader(loaders, mode=...) as the train_dataloaders",
    "reload_dataloaders_every_epoch": "reload_dataloaders_every_n_epochs=1",
    "distributed_backend": "strategy",
    "amp_backend": "precision='16-mixed' (torch.amp is the only backend)",
    "amp_level": "precision='16-mixed' (torch.amp is the only backend)",
    "move_metrics_to_cpu": "nothing (remove it; logged values are kept on their device)",
    "log_gpu_memory": "callbacks=[DeviceStatsMonitor()]",
    "process_position": "callbacks=[TQDMProgressBar(process_position=N)]",
    "prepare_data_per_node": "the DataModule attribute prepare_data_per_node",
    "truncated_bptt_steps": "manual optimization that splits the sequence in training_step",
    "weights_save_path": "default_root_dir, or ModelCheckpoint(dirpath=...)",
}


def make_config(options: dict[str, Any]) -> TrainerConfig:
    """TrainerConfig from keyword options; an unknown key names the closest valid ones, a Lightning 1.x option
    its 2.x spelling."""
    names = option_names()
    for key in options:
        if key in REMOVED_OPTIONS:
            raise MisconfigurationError(
                f"trainer option {key!r} was removed in Lightning 2.0; use {REMOVED_OPTIONS[key]} instead."
            )
        if key not in names:
            raise MisconfigurationError(f"unknown trainer option {key!r}{closest(key, names)}.")
    if options.get("barebones"):
        turned_on = [key for key in BAREBONES_OFF if options.get(key) not in (None, False)]
        if turned_on:
            raise MisconfigurationError(f"barebones=True runs without {', '.join(BAREBONES_OFF)}, but "
                                        f"{', '.join(f'{k}={options[k]!r}' for k in turned_on)} was given; drop one.")
        options = {**options, **dict.fromkeys(BAREBONES_OFF, False)}
    return TrainerConfig(**options)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise MisconfigurationError(message)


# The three helpers below import torch (directly or through the module they need) when called, not when this
# module is imported: validating options needs torch, reading the schema (`trainer config --reference`) does not.


def _auto_devices(accelerator: str) -> int:
    """devices='auto': every visible GPU when the run uses GPUs, else one process."""
    import torch

    gpus = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    return max(1, torch.cuda.device_count()) if gpus else 1


def precision_name(precision: Any) -> str:
    """The canonical name of `precision` (Lightning's spellings too: 32, "32-true", 16, "bf16"), or a clear
    error when it names none of PRECISIONS."""
    name = PRECISION_ALIASES.get(str(precision), str(precision))
    if name in PRECISIONS:
        return name
    if name in UNSUPPORTED_PRECISIONS:
        raise MisconfigurationError(
            f"precision={precision!r} (the whole model in {name[:-5]}) is not supported; use "
            f"{UNSUPPORTED_PRECISIONS[name]}."
        )
    raise MisconfigurationError(f"precision={precision!r} is not known; use one of {', '.join(PRECISIONS)}.")


INT_OPTIONS = ("max_steps", "min_epochs", "check_val_every_n_epoch", "reload_dataloaders_every_n_epochs",
               "num_sanity_val_steps", "accumulate_grad_batches", "log_every_n_steps", "devices", "num_nodes",
               "lr_warmup_steps", "max_restarts")
OPTIONAL_INT_OPTIONS = ("min_steps",)
LIMIT_OPTIONS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                 "val_check_interval", "overfit_batches")


def validate(config: TrainerConfig) -> None:
    """Check types and ranges of every option, with messages that say what to change."""
    if config.deterministic == "warn":  # Lightning's spelling of what True does here
        config.deterministic = True
    if config.devices == "auto":  # Lightning's default: every GPU where the run uses them, else one process
        config.devices = _auto_devices(config.accelerator)
    for key in (f.name for f in dataclasses.fields(config) if f.type in ("bool", bool)):
        value = getattr(config, key)
        _need(isinstance(value, bool), f"trainer option {key}={value!r} must be True or False.")
    for key in INT_OPTIONS:
        value = getattr(config, key)
        _need(_is_int(value), f"trainer option {key}={value!r} must be an integer.")
    for key in OPTIONAL_INT_OPTIONS:
        value = getattr(config, key)
        _need(value is None or (_is_int(value) and value >= 0), f"{key}={value!r} must be an integer >= 0 or unset.")
    _validate_counts(config)
    _validate_choices(config)
    _validate_limits(config)
    config.evaluator = evaluator_config(config.evaluator)
    config.compile = compile_options(config.compile)
    _validate_launcher(config)


def _validate_counts(config: TrainerConfig) -> None:
    _need(config.max_epochs is None or (_is_int(config.max_epochs) and config.max_epochs >= -1),
          f"max_epochs={config.max_epochs!r} must be an integer >= -1 (-1: no limit).")
    _need(config.max_steps >= -1, f"max_steps={config.max_steps} must be >= -1 (-1: no limit).")
    _need(config.devices >= 1, f"devices={config.devices} must be at least 1.")
    _need(config.num_nodes >= 1, f"num_nodes={config.num_nodes} must be at least 1.")
    _need(config.accumulate_grad_batches >= 1,
          f"accumulate_grad_batches={config.accumulate_grad_batches} must be at least 1.")
    _need(config.check_val_every_n_epoch >= 1,
          f"check_val_every_n_epoch={config.check_val_every_n_epoch} must be at least 1.")
    _need(config.reload_dataloaders_every_n_epochs >= 0,
          f"reload_dataloaders_every_n_epochs={config.reload_dataloaders_every_n_epochs} must be >= 0 (0: never).")
    _need(config.log_every_n_steps >= 1, f"log_every_n_steps={config.log_every_n_steps} must be at least 1.")
    _need(config.num_sanity_val_steps >= -1, f"num_sanity_val_steps={config.num_sanity_val_steps} must be >= -1.")
    _need(config.max_restarts >= 0, f"max_restarts={config.max_restarts} must be >= 0.")


def _validate_choices(config: TrainerConfig) -> None:
    _need(config.nonfinite_loss in NONFINITE_MODES,
          f"nonfinite_loss={config.nonfinite_loss!r} is not known; use one of {', '.join(NONFINITE_MODES)}.")
    _need(config.diagnosis in DIAGNOSIS_MODES,
          f"diagnosis={config.diagnosis!r} is not known; use one of {', '.join(DIAGNOSIS_MODES)}.")
    config.precision = precision_name(config.precision)
    _need(config.gradient_clip_algorithm in CLIP_ALGORITHMS,
          f"gradient_clip_algorithm={config.gradient_clip_algorithm!r}; use 'norm' or 'value'.")
    clip = config.gradient_clip_val
    _need(clip is None or (isinstance(clip, (int, float)) and clip > 0),
          f"gradient_clip_val={clip!r} must be a positive number or unset.")
    _need(config.lr_scaling in LR_SCALINGS,
          f"lr_scaling={config.lr_scaling!r} is not known; use one of {', '.join(LR_SCALINGS)}.")
    _need(isinstance(config.timeout, (int, float)) and config.timeout > 0,
          f"timeout={config.timeout!r} must be a positive number of seconds.")
    _need(config.accelerator in ("auto", "cpu", "cuda", "gpu"),
          f"accelerator={config.accelerator!r}; use 'cpu', 'cuda' or 'auto'.")
    _need(config.seed is None or _is_int(config.seed), f"seed={config.seed!r} must be an integer or unset.")
    parse_duration(config.max_time, f"max_time={config.max_time!r}")
    _need(config.benchmark is None or isinstance(config.benchmark, bool),
          f"benchmark={config.benchmark!r} must be true, false or unset.")
    _need(not (config.benchmark and config.deterministic), "benchmark=True lets cuDNN pick algorithms by speed, which "
          "deterministic=True rules out; set one of them.")
    profiler = config.profiler
    _need(profiler is None or not isinstance(profiler, str) or profiler in PROFILERS,
          f"profiler={profiler!r} is not known; use one of {', '.join(PROFILERS)}, a profiler object, or unset.")
    # The schema sits below the loggers it names (every folder reads its options), so their base class comes late.
    from torchyard.trainer.logs.loggers import Logger

    for item in config.logger if isinstance(config.logger, (list, tuple)) else [config.logger]:
        known = item is None or isinstance(item, bool) or item in ("csv", "tensorboard") or isinstance(item, Logger)
        _need(known, f"logger={item!r} is not known; use true, false, 'csv', 'tensorboard' or a Logger.")


def _validate_launcher(config: TrainerConfig) -> None:
    _need(config.launcher in LAUNCHERS,
          f"launcher={config.launcher!r} is not known; use one of {', '.join(LAUNCHERS)}.")
    address = config.ray_address
    well_formed = isinstance(address, str) and (address in ("auto", "local") or _RAY_ADDRESS.match(address) is not None)
    _need(address is None or well_formed,
          f"ray_address={address!r} is not 'host:port' (e.g. 10.0.0.1:6379), 'auto', 'local' or unset.")
    _need(config.ray_address is None or config.launcher == "ray",
          f"ray_address={config.ray_address!r} is for launcher='ray', but launcher={config.launcher!r}; set both.")
    _need(config.launcher != "ray" or importlib.util.find_spec("ray") is not None,
          "launcher='ray' needs Ray, which is not installed: pip install 'torchyard[ray]'.")


def _validate_limits(config: TrainerConfig) -> None:
    _need((_is_int(config.fast_dev_run) and config.fast_dev_run >= 0) or isinstance(config.fast_dev_run, bool),
          f"fast_dev_run={config.fast_dev_run!r} must be true/false or a number of batches (>= 0).")
    for key in LIMIT_OPTIONS:
        value = getattr(config, key)
        ok = (_is_int(value) and value >= 0) or (isinstance(value, float) and 0.0 <= value <= 1.0)
        _need(ok, f"{key}={value!r} must be a fraction in [0.0, 1.0] or a batch count (int >= 0).")
    _need(config.val_check_interval != 0,
          "val_check_interval=0 would never validate; use a fraction in (0, 1] or a batch count.")
    _need(config.limit_train_batches != 0, "limit_train_batches=0 would train on nothing; use a fraction in (0, 1] or "
          "a batch count >= 1 (to only evaluate, call trainer.validate or trainer.test).")
