"""The evaluator: a process beside the training job that scores each checkpoint as it appears, so that training never
stops for validation and validation can use a device of its own (TensorFlow's evaluator task).

    Trainer(evaluator=True, limit_val_batches=0)     rank 0 starts one side process for the fit (EvaluatorProcess)
    trainer evaluate runs/digits/version_0 --watch    the same, standalone, for a run started elsewhere
    trainer evaluate runs/digits/version_0            every checkpoint of a finished run, once (a backfill)

It lists `*.ckpt` in the run's checkpoint folder (only complete files carry that name: they arrive by an atomic
rename), scores each training state once with the module's validation_step over the validation loader, and logs the
values under their usual names at the checkpoint's step into the run's folder (metrics_evaluator.csv beside
metrics.csv, and TensorBoard events where the run writes them), and what each checkpoint scored into
evaluations.json (trainer/logs/evaluations.py), which EarlyStopping and ModelCheckpoint can read. It never writes a
checkpoint, skips one removed (top-k) before it got to it, and ends once the training has ended and its last
checkpoint is scored.
"""

from __future__ import annotations

import copy
import multiprocessing
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from torchyard.callbacks.base import Callback
from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.cluster.script_guard import in_spawn_bootstrap
from torchyard.trainer.config import EvaluatorConfig
from torchyard.trainer.datamodule import DataModule
from torchyard.trainer.errors import CheckpointError, MisconfigurationError
from torchyard.trainer.logs.evaluations import (
    DELETED,
    EVALUATOR_STAGE,
    SCORED,
    SKIPPED,
    Evaluation,
    read_record,
    training_ended,
    write_record,
)
from torchyard.trainer.logs.loggers import CSVLogger, Logger, TensorBoardLogger
from torchyard.trainer.module import TrainModule, overridden
from torchyard.trainer.strategies.single import SingleDeviceStrategy

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer

PENDING = "pending"


class EvaluatorStrategy(SingleDeviceStrategy):
    """One process on one device that belongs to no job: under torchrun or srun the evaluator is a task beside the
    training's ranks, not one of them, so it reads no launcher's variables."""

    def __init__(self, gpu: int | None = None) -> None:
        super().__init__()
        self.gpu = gpu

    @override
    def detect_environment(self) -> ClusterEnvironment:
        return ClusterEnvironment(name="local")

    @override
    def setup_environment(self, environment: ClusterEnvironment) -> None:
        super().setup_environment(environment)
        if self.gpu is not None:
            self.root_device = torch.device("cuda", self.gpu)
            torch.cuda.set_device(self.root_device)


def run_loggers(run_dir: Path, tensorboard: bool) -> list[Logger]:
    """Loggers that write into the run folder `run_dir` (`<save_dir>/<name>/<version folder>`): a CSV file of the
    evaluator's own, and TensorBoard events beside the training's (TensorBoard shows them as one run)."""
    where = {"save_dir": run_dir.parent.parent, "name": run_dir.parent.name, "version": run_dir.name}
    csv_logger = CSVLogger(**where, flush_logs_every_n_steps=1)
    csv_logger.log_into_run(run_dir.name, EVALUATOR_STAGE)
    loggers: list[Logger] = [csv_logger]
    if tensorboard:
        loggers.append(TensorBoardLogger(**where))
    return loggers


def _position(checkpoint: dict[str, Any]) -> tuple[int, int, int]:
    """(loggers' step, global step, epoch) at which `checkpoint` was saved (a weights-only one: Lightning's keys)."""
    progress = checkpoint.get("loops", {}).get("progress") if isinstance(checkpoint.get("loops"), dict) else None
    if progress is None:
        global_step = int(checkpoint.get("global_step", 0))
        return global_step, global_step, int(checkpoint.get("epoch", 0))
    global_step = int(progress["global_step"])
    return int(progress.get("batches_stepped", global_step)), global_step, int(progress["epoch"])


class Evaluator:
    """Scores the checkpoints in `checkpoint_dir` into the run folder `run_dir`, each training state once (also
    across evaluators: what evaluations.json already holds is not scored again). It validates with a
    `trainer_class` (the Trainer) of its own: given, as this module sits below the Trainer's."""

    def __init__(self, trainer_class: type[Trainer], module: TrainModule, datamodule: DataModule | None,
                 run_dir: str | Path, checkpoint_dir: str | Path, options: EvaluatorConfig, *, gpu: int | None = None,
                 precision: str = "32", inference_mode: bool = True, tensorboard: bool = False,
                 say: Callable[[str], None] | None = None) -> None:
        self.module, self.datamodule, self.options = module, datamodule, options
        self.run_dir, self.checkpoint_dir = Path(run_dir).absolute(), Path(checkpoint_dir)
        self.say = say or (lambda line: print(line, flush=True))
        # The validation Trainer numbers a run folder of its own, which must not land beside the user's runs.
        self._scratch = tempfile.mkdtemp(prefix="trainer-evaluator-")
        if gpu is None and precision == "16-mixed":
            precision = "32"  # no fp16 autocast on the CPU: a GPU run's checkpoints are scored in float32 there
        self.trainer = trainer_class(
            strategy=EvaluatorStrategy(gpu), accelerator="cpu" if gpu is None else "cuda", precision=precision,
            inference_mode=inference_mode, limit_val_batches=options.limit_val_batches, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=self._scratch,
        )
        self.loggers = run_loggers(self.run_dir, tensorboard)
        self.record = read_record(self.run_dir)
        self._looked_at: dict[str, tuple[int, int, int]] = {}  # file name -> (inode, mtime, size) when read
        self._found = len(self.record)  # training states found so far, for every_n

    def run(self, watch: bool = False, ended: Callable[[], bool] | None = None, idle_timeout: float | None = None
            ) -> list[Evaluation]:
        """Score the checkpoints there are; with `watch`, look again every poll_interval until `ended()` (default:
        the fit left its end marker in the checkpoint folder), then score what it left last. Returns the record."""
        ended = ended or (lambda: training_ended(self.checkpoint_dir) is not None)
        last_new = time.monotonic()
        try:
            while True:
                # Asked before the look: a checkpoint written before the end is then in it.
                finished = not watch or ended()
                found = self.new_states()
                if found:
                    last_new = time.monotonic()
                self.score(found)
                if finished:
                    self._score_skipped_last()
                    return self.record
                if idle_timeout is not None and time.monotonic() - last_new > idle_timeout:
                    self.say(f"evaluator: no new checkpoint in {self.checkpoint_dir} for {idle_timeout:g} s and the "
                             "training has not said it ended; stopping.")
                    return self.record
                time.sleep(self.options.poll_interval)
        finally:
            self.close()

    def close(self) -> None:
        """Flush the loggers and remove the validation Trainer's scratch folder."""
        for logger in self.loggers:
            logger.finalize()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def new_states(self) -> list[Evaluation]:
        """The training states in checkpoint files that appeared (or were replaced) since the last look and that are
        not recorded yet, by step. A file name seen again for a recorded state is added to its entry."""
        known = {evaluation.step: evaluation for evaluation in self.record}
        found: dict[int, Evaluation] = {}
        renamed = False
        for path in sorted(self.checkpoint_dir.glob("*.ckpt")):
            try:
                stat = path.stat()
                signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
                if self._looked_at.get(path.name) == signature:
                    continue
                step, global_step, epoch = _position(load_checkpoint_file(path, mmap=True))
            except (FileNotFoundError, CheckpointError) as err:
                if path.exists():  # a damaged file: say so once, score the others
                    self.say(f"evaluator: skipping {path.name}: {err}")
                    self._looked_at[path.name] = signature
                continue  # removed (top-k) after the listing
            self._looked_at[path.name] = signature
            entry = known.get(step) or found.get(step)
            if entry is None:
                found[step] = Evaluation(step, global_step, epoch, [path.name], status=PENDING)
            elif path.name not in entry.checkpoints:
                entry.checkpoints.append(path.name)
                renamed = renamed or entry is known.get(step)
        if renamed:
            write_record(self.run_dir, self.record)
        return sorted(found.values(), key=lambda evaluation: evaluation.step)

    def score(self, found: list[Evaluation]) -> None:
        """Score `found` in step order (every_n-th of them; the others are recorded as skipped)."""
        for evaluation in found:
            self._found += 1
            if self._found % self.options.every_n == 0:
                self._score_one(evaluation)
            else:
                evaluation.status = SKIPPED
            self.record.append(evaluation)
            write_record(self.run_dir, self.record)

    def _score_skipped_last(self) -> None:
        """The run's last state is scored whatever every_n says."""
        newest = max(self.record, key=lambda evaluation: evaluation.step, default=None)
        if newest is not None and newest.status == SKIPPED:
            self._score_one(newest)
            write_record(self.run_dir, self.record)

    def _load(self, evaluation: Evaluation) -> dict[str, Any] | None:
        """The checkpoint of `evaluation` from any file that still holds its state (last.ckpt may hold a newer one
        by now, and top-k may have removed the others)."""
        for name in evaluation.checkpoints:
            try:
                checkpoint = load_checkpoint_file(self.checkpoint_dir / name)
            except CheckpointError as err:
                if (self.checkpoint_dir / name).exists():  # damaged: the state may be whole under another name
                    self.say(f"evaluator: cannot read {name}: {err}")
                continue
            if _position(checkpoint)[0] == evaluation.step:
                return checkpoint
        return None

    def _score_one(self, evaluation: Evaluation) -> None:
        checkpoint = self._load(evaluation)
        names = ", ".join(evaluation.checkpoints)
        if checkpoint is None:
            evaluation.status = DELETED
            self.say(f"evaluator: {names} (step {evaluation.step}) was removed before it was scored; skipped.")
            return
        self.module.on_load_checkpoint(checkpoint)
        self.module.load_state_dict(checkpoint["state_dict"])
        results = self.trainer.validate(self.module, datamodule=self.datamodule, verbose=False)
        metrics = {name: float(value) for per_loader in results for name, value in per_loader.items()}
        evaluation.metrics, evaluation.status = metrics, SCORED
        for logger in self.loggers:
            logger.log_metrics({**metrics, "epoch": evaluation.epoch}, evaluation.step)
            logger.save()
        shown = " ".join(f"{name}={value:.5g}" for name, value in sorted(metrics.items()))
        self.say(f"evaluator: {names} (epoch {evaluation.epoch}, step {evaluation.step}): {shown}")


# --------------------------------------------------------------------------- the side process of a fit


def evaluator_gpu(options: EvaluatorConfig, training_gpus: int) -> int | None:
    """The GPU the evaluator uses (None: the CPU): `device` if given, else the first one of this node past the
    `training_gpus` the training uses; 'auto' falls back to the CPU where none is left, 'cuda' refuses."""
    if options.accelerator == "cpu":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = options.device if options.device is not None else training_gpus
    if gpu < count:
        return gpu
    if options.accelerator == "auto" and options.device is None:
        return None
    raise MisconfigurationError(
        f"evaluator.accelerator={options.accelerator!r} needs GPU {gpu}, but this node has {count} GPU(s)"
        + (f" and the training uses {training_gpus}" if training_gpus else "")
        + "; set evaluator.device, or evaluator.accelerator='cpu'."
    )


@dataclass
class SideJob:
    """What the side process needs, pickled to it: copies of the module and datamodule, where to look and write."""

    trainer_class: type[Trainer]
    module: TrainModule
    datamodule: DataModule | None
    run_dir: str
    checkpoint_dir: str
    options: EvaluatorConfig
    gpu: int | None
    precision: str
    inference_mode: bool
    tensorboard: bool


def _side_process(job: SideJob, ended: Any) -> None:
    """The side process: score until the fit says it ended (or its process is gone)."""
    if job.gpu is None:
        torch.set_num_threads(1)  # the training's processes own the cores
    parent = multiprocessing.parent_process()
    evaluator = Evaluator(job.trainer_class, job.module, job.datamodule, job.run_dir, job.checkpoint_dir,
                          job.options, gpu=job.gpu, precision=job.precision, inference_mode=job.inference_mode,
                          tensorboard=job.tensorboard, say=lambda line: print(line, file=sys.stderr, flush=True))
    evaluator.run(watch=True, ended=lambda: ended.is_set() or (parent is not None and not parent.is_alive()))


class EvaluatorProcess(Callback):
    """Added by `Trainer(evaluator=...)`: rank 0 starts the evaluator beside the fit and, once the fit's last
    checkpoint is written, lets it score that one and waits for it (a failed fit stops it at once)."""

    def __init__(self, options: EvaluatorConfig) -> None:
        if in_spawn_bootstrap():  # the spawned evaluator is importing the script, whose top level builds us again
            raise SystemExit("trainer: the evaluator process imported the script, whose top level builds the Trainer "
                             "again; put the code that builds the Trainer and calls fit under "
                             "`if __name__ == \"__main__\":`.")
        self.options = options
        self.process: Any = None
        self._ended: Any = None
        self._failed = False

    @override
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        # Refused here, before the fit takes its first step.
        evaluator_gpu(self.options, self._training_gpus(trainer))
        if trainer.datamodule is None and overridden(module, "val_dataloader", TrainModule) is None:
            raise MisconfigurationError(
                "the evaluator validates with the loader of a DataModule or of the module's val_dataloader, and this "
                "fit has neither (loaders given to fit stay in this process); pass a datamodule, or define "
                f"{type(module).__name__}.val_dataloader."
            )

    @staticmethod
    def _training_gpus(trainer: Trainer) -> int:
        return trainer.strategy.processes_per_node() if trainer.strategy.accelerator == "cuda" else 0

    @override
    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        checkpoints = trainer.checkpoint_callback
        if not trainer.is_global_zero or checkpoints is None or trainer.config.fast_dev_run:
            return
        # Copies on the CPU, without the Trainer (the module's reference to it is left out of the copy).
        memo = {id(trainer): None}
        module_copy = copy.deepcopy(module, memo).cpu()
        datamodule_copy = copy.deepcopy(trainer.datamodule, memo)
        tensorboard = any(isinstance(logger, TensorBoardLogger) for logger in trainer.loggers)
        job = SideJob(type(trainer), module_copy, datamodule_copy, str(Path(trainer.log_dir).absolute()),
                      str(checkpoints.dirpath), self.options, evaluator_gpu(self.options, self._training_gpus(trainer)),
                      trainer.config.precision, trainer.config.inference_mode, tensorboard)
        context = multiprocessing.get_context("spawn")
        self._ended, self._failed = context.Event(), False
        self.process = context.Process(target=_side_process, args=(job, self._ended), name="trainer-evaluator")
        self.process.start()
        device = "cpu" if job.gpu is None else f"cuda:{job.gpu}"
        print(f"trainer: evaluator process {self.process.pid} on {device} scores the checkpoints in "
              f"{checkpoints.dirpath}", file=sys.stderr, flush=True)

    @override
    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        self._failed = True

    @override
    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        # The fit's checkpoints are all in place by now: the evaluator scores the last ones and ends, and its
        # output comes before the fit's closing lines (ModelSummary's on_fit_end, which runs after this one).
        self.teardown(trainer, module, "fit")

    @override
    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.process is None:
            return
        if self._failed:
            self.process.terminate()
        self._ended.set()
        self.process.join()
        if self.process.exitcode not in (0, None) and not self._failed:
            warnings.warn(f"the evaluator process ended with status {self.process.exitcode}; its output above says "
                          "why. `trainer evaluate <run folder>` scores the checkpoints it left.", stacklevel=2)
        self.process, self._ended = None, None


# --------------------------------------------------------------------------- `trainer evaluate`


def wait_for_run(run_dir: Path, watch: bool, idle_timeout: float | None, poll_interval: float) -> Path:
    """The run's config.yaml (the recipe it ran), waited for with `watch` (the job may not have written it yet)."""
    config = run_dir / "config.yaml"
    start = time.monotonic()
    while not config.is_file():
        waited_out = idle_timeout is not None and time.monotonic() - start > idle_timeout
        if not watch or waited_out:
            raise MisconfigurationError(
                f"{str(run_dir)!r} holds no config.yaml: give the folder of a run the `trainer` command started "
                "(e.g. runs/digits/version_0); a run started from a script is evaluated with its module there: "
                "Evaluator(module, datamodule, run_dir, checkpoint_dir, EvaluatorConfig()).run()."
            )
        time.sleep(poll_interval)
    return config


def evaluate_run(trainer_class: type[Trainer], module: TrainModule, datamodule: DataModule | None,
                 recipe_trainer: Any, run_dir: str | Path, options: EvaluatorConfig, watch: bool = False,
                 checkpoint_dir: str | Path | None = None, idle_timeout: float | None = None) -> list[Evaluation]:
    """`trainer evaluate`: score a run's checkpoints with the module and data its recipe built (`recipe_trainer`:
    the recipe's TrainerConfig, whose precision and loggers the evaluation follows)."""
    run_dir = Path(run_dir).absolute()
    gpu = None
    if options.accelerator != "cpu" and (options.accelerator == "cuda" or torch.cuda.is_available()):
        gpu = evaluator_gpu(options, 0)
    loggers = recipe_trainer.logger if isinstance(recipe_trainer.logger, (list, tuple)) else [recipe_trainer.logger]
    evaluator = Evaluator(
        trainer_class, module, datamodule, run_dir,
        checkpoint_dir if checkpoint_dir is not None else run_dir / "checkpoints", options, gpu=gpu,
        precision=recipe_trainer.precision, inference_mode=recipe_trainer.inference_mode,
        tensorboard="tensorboard" in loggers or any(run_dir.glob("events.out.tfevents*")),
    )
    return evaluator.run(watch=watch, idle_timeout=idle_timeout)
