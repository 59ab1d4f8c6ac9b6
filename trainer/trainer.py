"""Trainer: options, the fit/validate/test/predict entry points, and the state callbacks may read."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchyard.callbacks.base import Callback
from torchyard.trainer.checkpointing.resume import (
    default_ckpt_path,
    load_resume_checkpoint,
    resolve_ckpt_path,
    resume_after_restart,
)
from torchyard.trainer.checkpointing.state import (
    build_checkpoint,
    record_ledger,
    restore_checkpoint,
    save_adopted_checkpoint,
)
from torchyard.trainer.compile.options import cache_folder
from torchyard.trainer.config import TrainerConfig, make_config
from torchyard.trainer.data.batches import training_batches
from torchyard.trainer.data.loaders import build_loaders, stage_loaders
from torchyard.trainer.datamodule import DataModule
from torchyard.trainer.diagnosis.doctor import withdraw
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.launch import warm_start
from torchyard.trainer.launch.script_launch import adopt_rank_zero_rng
from torchyard.trainer.logs.loggers import Logger, print_results_table
from torchyard.trainer.logs.metrics import MetricCollector
from torchyard.trainer.logs.runs import RunFolder
from torchyard.trainer.loop import faults
from torchyard.trainer.loop.hooks import Hooks
from torchyard.trainer.loop.host_memory import keep_freed_memory, release_freed_memory
from torchyard.trainer.loop.loops import evaluation_loop, fit_loop, predict_loop
from torchyard.trainer.loop.progress import LoopState, Progress, TrainerStatus
from torchyard.trainer.loop.rng import seed_everything, set_determinism, warn_if_weights_unseeded
from torchyard.trainer.module import TrainModule
from torchyard.trainer.optim import LRScaler, ManualOptimizer, SchedulerConfig
from torchyard.trainer.preflight import (
    announce_live_job,
    apply_fast_dev_run,
    apply_overfit_batches,
    build_loggers,
    build_optimizers,
    callback_list,
    check_inputs,
    check_sync_batchnorm,
    datamodule_given_as_loaders,
    module_callbacks,
    one_module,
    with_default_callbacks,
    write_run_files,
)
from torchyard.trainer.strategies import Strategy, build_strategy
from torchyard.trainer.strategies.base import resolve_accelerator
from torchyard.trainer.trainer_properties import TrainerProperties


class Trainer(TrainerProperties):
    """Runs a TrainModule: `Trainer(max_epochs=5, strategy="ddp", devices=2).fit(module, datamodule=dm)`.

    Every keyword option is a field of TrainerConfig (see `trainer config` or the README table);
    `callbacks` takes Callback instances and `logger` may also be Logger instances.
    """

    def __init__(self, *, callbacks: list[Callback] | Callback | None = None, run_config: dict[str, Any] | None = None,
                 **options: Any) -> None:
        self.config: TrainerConfig = apply_overfit_batches(apply_fast_dev_run(make_config(options)))
        if self.config.seed is not None:  # as seed_everything at a script's top: the module built next is seeded
            seed_everything(self.config.seed)
        # Validated here, in the calling process, before any worker starts.
        self.strategy: Strategy = build_strategy(self.config.strategy,
                                                 self.config.devices * self.config.num_nodes)
        self.strategy.configure(
            self.config.accelerator, self.config.devices, self.config.num_nodes, self.config.precision
        )
        self.strategy.timeout = float(self.config.timeout)
        self.strategy.diagnosis = self.config.diagnosis
        check_sync_batchnorm(self.config, self.strategy.job_size, resolve_accelerator(self.config.accelerator))
        self.loggers: list[Logger] = build_loggers(self.config, self.config.logger)
        given = callback_list(callbacks, "callbacks must be")
        self.callbacks: list[Callback] = with_default_callbacks(self.config, given)
        self.strategy.check_config(self.config, self.callbacks)
        self._start_workers_early()
        self.stage: str | None = None
        self.module: TrainModule | None = None
        self.datamodule: DataModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.manual_optimizers: list[ManualOptimizer] = []  # what self.optimizers() gives under manual optimization
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.lr_scaler = LRScaler("none", 1, 0)
        # Each owned by one object, which the properties below show: what the loops change, the hooks of the stage,
        # and the run's folder where no logger numbers it.
        self._loop = LoopState()
        #: The stage's collector of `self.log` values (one per stage), which also writes its rows. An attribute, not
        #: a property: TrainModule.log reads it on every call.
        self.metrics = MetricCollector(self.strategy.reduce)
        self._hooks = Hooks(self, self.callbacks, None)
        self._run_folder = RunFolder(self.config.default_root_dir, self.config.name)
        self._callbacks_configured_by: TrainModule | None = None  # the module whose configure_callbacks was applied
        self._job_world_size: int | None = None  # set once a job this process started handed its state back
        self._live_job_file: Path | None = None  # where `trainer doctor` finds a running stage (trainer/diagnosis)
        #: The resolved recipe the `trainer` command ran; rank 0 saves it as config.yaml in the run folder.
        self.run_config = run_config

    # ------------------------------------------------------------------ construction
    def _attach_module_callbacks(self, module: TrainModule) -> None:
        """Lightning's configure_callbacks (preflight.module_callbacks). Asked once per module, so that a test after a
        fit keeps the fit's ModelCheckpoint (its best path)."""
        if self._callbacks_configured_by is not module:
            self.callbacks, self._callbacks_configured_by = module_callbacks(self, module), module

    def _start_workers_early(self) -> None:
        """A job this process will start: the workers' forkserver imports from now on, beside the script's set-up."""
        with contextlib.suppress(MisconfigurationError):  # an environment error is raised where it matters, at fit
            if self.strategy.job_size > 1 and not self.strategy.detect_environment().launched:
                warm_start.start_early()

    # ------------------------------------------------------------------ entry points
    # The entry points take Lightning's names and argument order (`model`, a DataModule in the dataloaders
    # slot), so that calls with positional or keyword arguments port too; `module=` is this framework's name.
    def fit(self, model: TrainModule | None = None, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: DataModule | None = None, ckpt_path: str | Path | None = None, *,
            module: TrainModule | None = None) -> None:
        """Train `model`; afterwards it holds the trained weights, whatever the strategy."""
        module = one_module(model, module)
        train_dataloaders, datamodule = datamodule_given_as_loaders(train_dataloaders, datamodule)
        check_inputs(self, module, datamodule, "fit", train_dataloaders)
        ckpt = resolve_ckpt_path(self, ckpt_path, "fit")
        if ckpt is None:  # a resume's weights are the checkpoint's
            warn_if_weights_unseeded(module, self.config.seed)
        self._dispatch("fit", module, datamodule, ckpt, train_dataloaders, val_dataloaders)

    def validate(self, model: TrainModule | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
                 verbose: bool = True, datamodule: DataModule | None = None, *,
                 module: TrainModule | None = None) -> list[dict[str, float]]:
        """Run validation once; returns the logged epoch metrics, one dict per loader (`verbose`: also prints them)."""
        return self._evaluate("validate", one_module(model, module), dataloaders, datamodule, ckpt_path, verbose)

    def test(self, model: TrainModule | None = None, dataloaders: Any = None, ckpt_path: str | Path | None = None,
             verbose: bool = True, datamodule: DataModule | None = None, *,
             module: TrainModule | None = None) -> list[dict[str, float]]:
        """Run the test set once; returns the logged epoch metrics, one dict per loader (`verbose`: also prints
        them)."""
        return self._evaluate("test", one_module(model, module), dataloaders, datamodule, ckpt_path, verbose)

    def predict(self, model: TrainModule | None = None, dataloaders: Any = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None,
                ckpt_path: str | Path | None = None, *, module: TrainModule | None = None) -> list[Any] | None:
        """predict_step over every batch; a list of outputs (a list per loader when there are several), or None
        with `return_predictions=False`, which keeps none of them (a BasePredictionWriter writes them instead)."""
        module = one_module(model, module)
        self._loop.return_predictions = return_predictions is None or bool(return_predictions)
        ckpt_path = default_ckpt_path(self, "predict", module, ckpt_path, calls_below_user=1)
        module = module or self.module
        dataloaders, datamodule = datamodule_given_as_loaders(dataloaders, datamodule)
        datamodule = datamodule or (self.datamodule if dataloaders is None else None)
        check_inputs(self, module, datamodule, "predict", dataloaders)
        result = self._dispatch(
            "predict", module, datamodule, resolve_ckpt_path(self, ckpt_path, "predict"), dataloaders
        )
        if result is None:
            return None
        return result[0] if len(result) == 1 else result

    def _evaluate(self, stage: str, module: TrainModule | None, dataloaders: Any, datamodule: DataModule | None,
                  ckpt_path: str | Path | None, verbose: bool) -> list[dict[str, float]]:
        ckpt_path = default_ckpt_path(self, stage, module, ckpt_path, calls_below_user=2)
        module = module or self.module
        dataloaders, datamodule = datamodule_given_as_loaders(dataloaders, datamodule)
        datamodule = datamodule or (self.datamodule if dataloaders is None else None)
        check_inputs(self, module, datamodule, stage, dataloaders)
        results = self._dispatch(stage, module, datamodule, resolve_ckpt_path(self, ckpt_path, stage), dataloaders)
        if verbose and results and self.is_global_zero:
            print_results_table(results, stage)
        return results

    def _dispatch(self, stage: str, module: TrainModule, datamodule: DataModule | None, ckpt: Path | None,
                  *loaders: Any) -> Any:
        """Run here, or start the job's processes and adopt rank 0's result; trainer.state says how it went."""
        self._loop.status, self._loop.ckpt_path = TrainerStatus.RUNNING, None
        try:
            result = self._run_or_launch(stage, module, datamodule, ckpt, *loaders)
        except BaseException:
            self._loop.status = TrainerStatus.INTERRUPTED  # as in Lightning: any exception, Ctrl-C or SIGTERM
            raise
        self._loop.status = TrainerStatus.FINISHED
        return result

    def _run_or_launch(self, stage: str, module: TrainModule, datamodule: DataModule | None, ckpt: Path | None,
                       *loaders: Any) -> Any:
        # After ckpt_path was resolved: "best" means the best of the callbacks that ran before, as in Lightning.
        self._attach_module_callbacks(module)
        environment = self.strategy.detect_environment()
        on_ray = self.config.launcher == "ray"  # Ray starts even one process: on the cluster, not here
        if (self.strategy.job_size > 1 or on_ray) and not environment.launched:
            # Imported here: torch's elastic agent takes 150 ms to import, needed only to start processes.
            from torchyard.trainer.launch import elastic as launcher
            from torchyard.trainer.launch import ray_actors as ray_launcher
            from torchyard.trainer.launch import replica_groups as groups_launcher

            # Live recovery (strategies/ft): one group of processes per replica group, each restarted on its own.
            start = ray_launcher.launch if on_ray else (groups_launcher.launch if self.strategy.replica_groups > 1
                                                         else launcher.launch)
            outcome = start(self, stage, module, datamodule, ckpt, *loaders)
            # As after a stage run here, test() may follow fit() on the same module and datamodule.
            self.stage, self.module, self.datamodule = stage, module, datamodule
            if datamodule is not None:
                datamodule.trainer = self
            launcher.adopt(self, module, outcome)  # which hands the state to adopt_worker_state
            self._loop.ckpt_path = outcome.get("ckpt_path")
            return outcome["result"]
        return self._run(stage, module, datamodule, ckpt, *loaders, environment=environment)["result"]

    # ------------------------------------------------------------------ one stage in this process
    def _run(self, stage: str, module: TrainModule, datamodule: DataModule | None, ckpt: Path | None,
             *loaders: Any, environment: Any = None, hand_back: bool = False) -> dict[str, Any]:
        """The stage in this process. `hand_back` (a worker the Trainer started): the outcome also carries the
        final state for the launching script on this node to adopt."""
        strategy = self.strategy
        environment = environment or strategy.detect_environment()
        if environment.threads is not None:  # srun's and mpirun's tasks: a share of the node's cores each
            torch.set_num_threads(environment.threads)
        strategy.setup_environment(environment)
        strategy.keeps_process_group = strategy.environment.launched and not hand_back
        if strategy.serve():  # a rank whose role is not the loop (a parameter server) served until the job ended
            strategy.teardown()
            return {"result": None}
        self._start_stage(stage, module, datamodule)
        self._loop.status = TrainerStatus.RUNNING  # also in a worker, which _dispatch does not run in
        try:
            prepared = self._prepare_stage(stage, module, datamodule, ckpt, loaders)
            return self._stage_outcome(stage, self._run_stage(stage, prepared), hand_back)
        except BaseException as exception:
            self._loop.status = TrainerStatus.INTERRUPTED  # before on_exception, as in Lightning
            for callback in self.callbacks:
                callback.on_exception(self, module, exception)
            faults.raise_if_collective_timeout(exception, strategy)  # gloo's socket message -> the operation
            raise
        finally:
            self._end_stage(stage, module, datamodule)

    def _start_stage(self, stage: str, module: TrainModule, datamodule: DataModule | None) -> None:
        """The stage's module, hooks and collector (each stage reports its own values, as in Lightning: a test
        after a fit does not show the fit's), seeds and determinism."""
        self.stage, self.module, self.datamodule, self._loop.should_stop = stage, module, datamodule, False
        self._hooks = Hooks(self, self.callbacks, module)  # callbacks and module are fixed for the stage from here on
        adopt_rank_zero_rng()  # a rank that re-ran a script without a main guard starts from rank 0's RNG state
        if self.config.seed is not None:
            seed_everything(self.config.seed)
        set_determinism(self.config.deterministic, self.config.benchmark)
        if self.config.tune_malloc:
            keep_freed_memory()
        module._trainer = self
        if datamodule is not None:
            datamodule.trainer = self
        self.strategy.follow_progress(self.progress)  # a stuck job's report names the step (trainer/diagnosis)
        last_logged_step = self.metrics.rows.last_logged_step  # a later fit goes on at the same step
        self.metrics = MetricCollector(self.strategy.reduce, self.loggers, self.progress,
                                       self.config.log_every_n_steps, writes=self.is_global_zero)
        self.metrics.rows.last_logged_step = last_logged_step

    def _prepare_stage(self, stage: str, module: TrainModule, datamodule: DataModule | None, ckpt: Path | None,
                       loaders: tuple[Any, ...]) -> list[DataLoader]:
        """Versions, loaders, the module on its devices, optimizers, callbacks set up, the checkpoint restored."""
        strategy, config = self.strategy, self.config
        path, checkpoint = load_resume_checkpoint(strategy, ckpt, stage, module)
        self._loop.ckpt_path = str(path) if path is not None else None
        self._run_folder.adopt_evaluated_run(checkpoint if stage != "fit" else None, self.loggers, stage)
        self._run_folder.settle(strategy, checkpoint if stage == "fit" and checkpoint is not None else {}, self.loggers)
        prepared = stage_loaders(strategy, stage, module, datamodule, loaders, self.config.seed or 0,
                                 checkpoint.get("datamodule") if checkpoint is not None else None, self.config)
        if self.config.sync_batchnorm and strategy.data_parallel_size > 1:  # before the strategy wraps the module
            torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        strategy.setup_module(module)
        strategy.compile_module(config.compile, cache_folder(config.compile, config.default_root_dir, config.name))
        if stage == "fit":
            self._prepare_fit(module, datamodule, prepared, loaders)
        for callback in self.callbacks:
            callback.setup(self, module, stage)
        if stage == "fit" and not strategy.heals_from_peers:  # an elastic restart continues from the newest good
            checkpoint = resume_after_restart(self, checkpoint)  # checkpoint of this run
        if checkpoint is not None:
            self._restore(checkpoint, full=stage == "fit")
        # Live recovery (strategies/ft): once this replica's own state is in place, a live peer's where it is behind.
        healed = strategy.join_replicas(self) if stage == "fit" else None
        if healed is not None:
            self._restore(healed, full=True)
        write_run_files(self)
        self._live_job_file = announce_live_job(self)
        return prepared

    def _restore(self, checkpoint: dict[str, Any], full: bool) -> None:
        restore_checkpoint(self, checkpoint, full=full)
        # The checkpoint's step was already written (if due) before it was saved; a micro-batch
        # that follows it without stepping must not write a second row for the same step.
        self.metrics.rows.last_logged_step = self.progress.batches_stepped

    def _prepare_fit(self, module: TrainModule, datamodule: DataModule | None, prepared: list[DataLoader],
                     loaders: tuple[Any, ...]) -> None:
        """The fit's loaders in the loop state, known before configure_optimizers, which may read
        estimated_stepping_batches (OneCycleLR); then the optimizers."""
        loop, strategy = self._loop, self.strategy
        loop.train_dataloader = prepared[0]
        loop.num_training_batches = training_batches(prepared[0], self.config.limit_train_batches)
        loop.build_fit_loaders = functools.partial(build_loaders, strategy, "fit", module, datamodule, loaders,
                                                   self.config.seed or 0, self.config)
        loop.fit_loaders_epoch = self.progress.epoch  # before a checkpoint moves the run on
        self._setup_optimizers(module)

    def _stage_outcome(self, stage: str, result: Any, hand_back: bool) -> dict[str, Any]:
        """The stage's result; for a worker the Trainer started, also the final state its node's script adopts."""
        strategy, outcome = self.strategy, {"result": result}
        if stage == "fit" and not hand_back:  # the script that called fit goes on in this process
            strategy.gather_module()
        if hand_back:
            # Imported here: the launcher imports torch's elastic agent (150 ms), which only a started job needs.
            from torchyard.trainer.launch import elastic as launcher

            # Every rank joins: gathering a split model's weights (pipeline) is a collective. It leaves the
            # whole model on every rank, so each node's first rank hands it to the script on its node.
            state = launcher.final_state(self)
            if strategy.is_global_zero or strategy.local_rank == 0:
                outcome["state"] = state
            outcome["ckpt_path"] = self._loop.ckpt_path
        return outcome

    def _end_stage(self, stage: str, module: TrainModule, datamodule: DataModule | None) -> None:
        """Teardown, on every way out of a stage: callbacks, module, datamodule, loggers, the strategy."""
        if self._live_job_file is not None:
            withdraw(self._live_job_file)
            self._live_job_file = None
        for callback in self.callbacks:
            callback.teardown(self, module, stage)
        module.teardown(stage)
        if datamodule is not None:
            datamodule.teardown(stage)
        if self.strategy.is_global_zero:
            for logger in self.loggers:
                logger.finalize()
            self._run_folder.release()
        self.strategy.teardown()
        release_freed_memory()

    def _run_stage(self, stage: str, loaders: list[DataLoader]) -> Any:
        config = self.config
        if stage == "fit":
            self._hooks.call("on_fit_start")
            # Off: whatever the script set stays in force.
            anomaly = torch.autograd.set_detect_anomaly(True) if config.detect_anomaly else contextlib.nullcontext()
            with faults.StepGuard(self) as guard, anomaly:  # SIGTERM and non-finite losses, settled at optimizer steps
                fit_loop(self, loaders[0], loaders[1:], guard)
            record_ledger(self)  # the fit's whole sample ledger, in its run folder
            self.strategy.finish_checkpoints()  # the fit's checkpoints are under their names before on_fit_end
            with self.metrics.scope("train", in_step=False):  # as the fit loop's last hooks: it logs per epoch
                self._hooks.call("on_fit_end")
            return None
        if stage == "predict":
            return predict_loop(self, loaders, config.limit_predict_batches)
        limit = config.limit_val_batches if stage == "validate" else config.limit_test_batches
        return evaluation_loop(self, stage, loaders, limit)

    def _setup_optimizers(self, module: TrainModule) -> None:
        self.optimizers, self.lr_scheduler_configs, self.lr_scaler = build_optimizers(self, module)
        self.manual_optimizers = [ManualOptimizer(optimizer, self) for optimizer in self.optimizers]

    def adopt_worker_state(self, module: TrainModule, state: dict[str, Any]) -> None:
        """Take on the final state that the reporting worker of a job this Trainer started handed back
        (launcher.final_state): counters, values, loggers and the run's version, as after a stage run here."""
        self.module = module
        self._loop.progress = Progress(**state["progress"])
        self._loop.data_wait = state["data_wait"]
        rows = self.metrics.rows  # its dicts are filled, never replaced (see MetricRows)
        for values, handed_back in ((rows.callback_metrics, state["callback_metrics"]),
                                    (rows.logged_metrics, state["logged_metrics"]),
                                    (rows.bar_values, {name: torch.tensor(value)
                                                       for name, value in state["progress_bar_metrics"].items()})):
            values.clear()
            values.update(handed_back)
        for logger, logger_state in zip(self.loggers, state["loggers"]):
            logger.load_state_dict(logger_state)
        self._run_folder.version = state["version"]
        self._job_world_size = state["world_size"]  # trainer.world_size: the job's, as Lightning reports it

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path, weights_only: bool = False, *, wait: bool = True) -> None:
        """Write a resumable checkpoint, or with `weights_only` one of the weights and hparams alone (call on
        every rank; the strategy decides who writes). `wait=False` (ModelCheckpoint's saves) returns once the file
        is written: its fsync and rename into place finish on a thread of their own, before the next optimizer
        step or the stage's end."""
        if self.strategy.module is None and self._job_world_size is not None and self.module is not None:
            save_adopted_checkpoint(self, path, weights_only)  # after a fit of processes this script started
            return
        if self.strategy.module is None:
            last = getattr(self.checkpoint_callback, "last_model_path", "")
            raise MisconfigurationError(
                "trainer.save_checkpoint needs a run's state in this process, and here is none: no stage ran yet, or "
                "the processes this script started have ended with it (optimizers included). "
                + (f"The run's last checkpoint is {last}; " if last else "")
                + "call it inside the run (a callback's on_train_end), or save the weights: "
                  "torch.save(module.state_dict(), path)."
            )
        self.metrics.rows.flush()  # saved in on_train_batch_end or on_train_epoch_end: their rows come first
        if self.is_global_zero:
            for logger in self.loggers:
                logger.save()  # the file must hold every row the checkpoint counts
        self.strategy.save_checkpoint(self.checkpoint_state(weights_only), path)
        if wait:
            self.strategy.finish_checkpoints()

    def checkpoint_state(self, weights_only: bool = False) -> dict[str, Any]:
        """The checkpoint dict (format: trainer/checkpointing/files.py). A collective: call on every rank."""
        if self.loop_state.read_losses is not None:
            self.loop_state.read_losses()
        return build_checkpoint(self, weights_only)


# `help(Trainer)` and IDEs show every option, from the one dataclass that defines them.
Trainer.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
     inspect.Parameter("callbacks", inspect.Parameter.KEYWORD_ONLY, default=None)]
    + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
       for f in dataclasses.fields(TrainerConfig)]
)
