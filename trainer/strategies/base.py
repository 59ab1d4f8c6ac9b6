"""The Strategy contract: everything about devices and processes, so the loop never asks which one runs.

Single-process strategies keep the collectives' honest no-ops (`barrier` does nothing, `broadcast`
returns its argument), so the loop has no branches on the strategy. Strategy's docstring says what a
new strategy implements and in which order the Trainer calls it.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from torchyard.trainer.checkpointing.files import (
    CheckpointFiles,
    load_checkpoint_file,
    sync_folder,
)
from torchyard.trainer.cluster.environment import ClusterEnvironment, detect_environment
from torchyard.trainer.compile.regions import start_compile, stop_compile
from torchyard.trainer.data.batches import move_to_device
from torchyard.trainer.data.loaders import prepare_loader
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.module import TrainModule, overridden
from torchyard.trainer.precision import Precision
from torchyard.trainer.strategies.user_steps import bound_step, run_step, step_loss

HOST = torch.device("cpu")

if TYPE_CHECKING:
    from torchyard.trainer.compile.options import CompileOptions
    from torchyard.trainer.compile.report import CompileRecord
    from torchyard.trainer.config import TrainerConfig


def resolve_accelerator(accelerator: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; an unavailable choice is a clear error."""
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cpu", "cuda", "gpu"):
        raise MisconfigurationError(f"accelerator={accelerator!r} is not known; use 'cpu', 'cuda' or 'auto'.")
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise MisconfigurationError(f"accelerator={accelerator!r} but no CUDA device is visible; use 'cpu' or 'auto'.")
    return "cuda" if accelerator == "gpu" else accelerator


class Strategy(ABC):
    """Where the work runs: the process world, the wrapped model, loaders, collectives, checkpoint IO.

    A new strategy is one file: a subclass of Strategy (or of ProcessGroupStrategy in process_group.py, for
    one process per device joined in a torch process group) plus one line in strategies/__init__.py.

    Required: the class attribute `name` (the registry name) and the two abstract methods, `configure` (check
    the Trainer's resource options; call super() first) and `processes_per_node`. Every other member has a
    default that is right for one process on one device (collectives are no-ops, `no_backward_sync` is a
    nullcontext, checkpoints are written by rank 0): override only what differs, each override marked with
    `typing_extensions.override`, and call super() where the default does part of the work.

    The Trainer calls them in this order (members set by the Trainer: `timeout`, `keeps_process_group`):
        setup           configure (in Trainer(...)), check_config, check_module, detect_environment,
                        setup_environment (join the job, pick the device), serve, setup_module, compile_module,
                        setup_optimizers
        loaders         prepare_loader; then batch_to_device for every batch
        steps           training_step or forward_backward (under no_backward_sync while gradients accumulate),
                        backward, clip_gradients, optimizer_step; eval_step; collectives wherever the run needs them
        checkpoint IO   checkpoint_model_state (model_state_dict), optimizer_state_dict, save_checkpoint,
                        link_checkpoint, remove_checkpoint; load_checkpoint, load_model_state_dict,
                        load_optimizer_state_dict
        teardown        gather_module (after fit), then teardown on every way out (call super() last)
    """

    #: The registry name (`Trainer(strategy=name)`). Required.
    name: ClassVar[str] = ""
    #: Every rank takes each optimizer step together (ddp, pipeline), so a per-step collective is safe; False
    #: for workers that run at their own pace (ps), which then settle SIGTERM and NaN losses each on its own.
    steps_in_lockstep: ClassVar[bool] = True
    plannable: ClassVar[bool] = True  #: `trainer plan` can run its step on fake tensors (setup_module_to_plan)
    #: A restarted process takes a live peer's state (join_replicas: live recovery, strategies/ft) rather than
    #: reading the run's newest checkpoint.
    heals_from_peers: ClassVar[bool] = False

    def __init__(self) -> None:
        self.accelerator = "cpu"
        self.devices = 1
        self.num_nodes = 1
        self.precision = Precision()
        self.environment = ClusterEnvironment(name="local")
        self.timeout = 1800.0  # seconds a collective may wait (the Trainer sets its `timeout` option here)
        self.diagnosis = "on"  # the Trainer's `diagnosis` option: how closely the ranks are watched (trainer/diagnosis)
        #: Ends this process, given the report, when a collective hangs without raising (None: print, exit 1).
        self.on_hang: Callable[[str], None] | None = None
        self.root_device = torch.device("cpu")
        # Set by the Trainer where a launcher (torchrun, srun, mpirun) started this process and the script that
        # called fit goes on in it: the group stays up for the script's own collectives, as in Lightning, until exit.
        self.keeps_process_group = False
        self.module: TrainModule | None = None  # the user's module, unwrapped
        self.model: nn.Module | None = None  # what the steps run through (a wrapper or the module)
        #: The job's DeviceMesh, dimensions named (strategies/mesh.py), where the strategy lays its ranks on one
        #: (fsdp, pipeline); the module reads it as `self.device_mesh`.
        self.device_mesh: Any = None
        self._bound_training_step: Callable[[Any, int], Any] | None = None  # see setup_module
        self._plain_backward = False
        self._unsynced_folders: set[Path] = set()  # rank 0: folders holding renames not yet made durable
        self._checkpoint_files: CheckpointFiles | None = None  # rank 0, during a stage that saved
        #: Rank 0 has checkpoint work in flight (CheckpointFiles), which the next optimizer step waits for.
        self.checkpoint_in_flight = False
        self.compile_record: CompileRecord | None = None  # what compile_module compiled, for the reports
        #: Independent groups of processes the job runs, each restarted on its own when it dies (live recovery,
        #: strategies/ft: the Trainer's launch/replica_groups.py starts them); 1: the job is one group.
        self.replica_groups = 1

    # ------------------------------------------------------------------ required
    @abstractmethod
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        """Take the Trainer's resource options; validate them before any process starts. Overrides call this
        first, then refuse what their strategy cannot run."""
        self.accelerator = resolve_accelerator(accelerator)
        if devices < 1 or num_nodes < 1:
            raise MisconfigurationError(f"devices={devices} and num_nodes={num_nodes} must both be at least 1.")
        self.devices, self.num_nodes = devices, num_nodes
        self.precision = Precision(precision, self.accelerator)

    @abstractmethod
    def processes_per_node(self) -> int:
        """How many processes each node runs; more than one job-wide means the launcher must start them."""

    # ------------------------------------------------------------------ the world (defaults: one process)
    @property
    def job_size(self) -> int:
        """Processes in the whole job."""
        return self.processes_per_node() * self.num_nodes

    def detect_environment(self) -> ClusterEnvironment:
        """Who launched this process (a strategy may take an override, e.g. DDPStrategy(environment=...))."""
        return detect_environment()

    def setup_environment(self, environment: ClusterEnvironment) -> None:
        """Join the job (process group), pick this process's device."""
        self.environment = environment
        if self.accelerator == "cuda":
            self.root_device = torch.device("cuda", environment.local_rank)
            torch.cuda.set_device(self.root_device)
        else:
            self.root_device = torch.device("cpu")

    def teardown(self) -> None:
        """Release wrappers and the process group; must leave no thread or group behind. Makes the stage's
        checkpoint names durable first (on every way out, a SIGTERM stop or a crash included)."""
        try:
            if self._checkpoint_files is not None:
                self._checkpoint_files.close()
        finally:
            self._checkpoint_files, self.checkpoint_in_flight = None, False
            for folder in self._unsynced_folders:  # once per stage, not per file: see checkpoint.save_checkpoint_file
                sync_folder(folder)
            self._unsynced_folders.clear()
            stop_compile(self.compile_record)
            self.model = self.module

    @property
    def global_rank(self) -> int:
        """This process's rank in the loop's world."""
        return self.environment.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.environment.local_rank

    @property
    def world_size(self) -> int:
        """How many processes run the loop."""
        return self.environment.world_size

    @property
    def is_global_zero(self) -> bool:
        """This process logs, prints and writes checkpoints."""
        return self.global_rank == 0

    @property
    def decides_for_ranks(self) -> bool:
        """This process picks the run folder's version and the checkpoint to resume for the ranks it reaches: rank 0;
        under live recovery, each replica group's first process (they all find the same files)."""
        return self.is_global_zero

    @property
    def data_parallel_size(self) -> int:
        """How many replicas see different data (sampler shards, LR scaling)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """This process's replica among the data_parallel_size."""
        return self.global_rank

    # ------------------------------------------------------------------ optional abilities (defaults: none)
    def check_config(self, config: TrainerConfig, callbacks: list[Any]) -> None:
        """Refuse, when the Trainer is built, options (and callbacks) this strategy cannot run with."""
        return None  # the default runs with every option and callback

    def check_module(self, module: TrainModule, stage: str) -> None:
        """Refuse, before any process starts, a module this strategy cannot run `stage` ("fit", ...) with."""
        step = {"validate": "validation_step", "test": "test_step"}.get(stage)
        if step is not None and getattr(type(module), step) is getattr(TrainModule, step):
            raise MisconfigurationError(
                f"Trainer.{stage} needs {type(module).__name__}.{step}(self, batch, batch_idx); it has none."
            )

    def missing_metric_hint(self, module: TrainModule) -> str:
        """Why a value `module` logs may be missing from a fit's logged values under this strategy, for the
        monitors' errors ("" where nothing of the module's is left uncalled)."""
        return ""

    def validates(self, module: TrainModule) -> bool:
        """Whether a fit given validation loaders validates `module` (it has a validation_step to run)."""
        return type(module).validation_step is not TrainModule.validation_step

    def serve(self) -> bool:
        """Run this rank's part when it is not the loop (a parameter server answering the workers) until the
        job ends; True when it did, and the Trainer then skips the stage on this rank."""
        return False

    @property
    def reporting_rank(self) -> int:
        """The global rank whose console output the launcher shows and whose final state the caller adopts."""
        return 0

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """A hook for strategies that own the optimizer (a parameter server); returns the optimizers to use."""
        return optimizers

    def gather_module(self) -> None:
        """After fit, on a rank whose module was trained only in part (a pipeline stage): load the whole trained
        model into it, so that the script that called fit holds it (a collective where it does anything)."""
        return None  # the default trains the whole module on every rank

    def state_dict(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """The strategy's own training state for an exact resume (a model averager's step, per-rank replicas), in
        plain containers and tensors. Called on every rank: it may gather."""
        return {}  # the default keeps nothing beyond the weights and optimizer states the checkpoint holds

    def load_state_dict(self, state: dict[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
        """Take back what state_dict returned, after the weights and optimizer states were restored."""
        return None

    def join_replicas(self, trainer: Any) -> dict[str, Any] | None:
        """Before a fit trains, once this process's own state (a checkpoint's, if any) is in place: a live peer's
        training state where this process is behind the others (live recovery), which the Trainer then restores as
        it restores a checkpoint; None to train on from here."""
        return None

    def communication_seconds(self) -> float:
        """Seconds this rank has waited for gradient communication since set-up, where the strategy times it."""
        return 0.0  # one process: no communication

    def follow_progress(self, progress: Any) -> None:
        """Take the loop's Progress, whose step the reports of a stuck job name."""
        return None  # one process: nobody to wait for, nothing to report

    def stuck_seconds(self) -> float:
        """How long this rank has not advanced (no step, no collective), where a watchdog watches it."""
        return 0.0

    def hang_report(self, error: BaseException) -> str | None:
        """For a collective that timed out with `error`: where every rank is and which are behind (None: unknown)."""
        return None

    def live_job(self) -> dict[str, Any] | None:
        """Where `trainer doctor` reaches this job's watchdogs (the store's address, key prefix, ranks, timeout), or
        None where no watchdog watches the ranks (trainer/diagnosis/doctor.py)."""
        return None

    # ------------------------------------------------------------------ the model
    def setup_module(self, module: TrainModule) -> None:
        """Move the module to this process's device and wrap it for training."""
        # Not moved when already there: fake tensors (`trainer plan`) cannot be swapped by Module.to.
        self.module = module if _on_device(module, self.root_device) else module.to(self.root_device)
        self.model = self.module
        self._bound_training_step = bound_step(module, "training_step")  # looked up once, not every step
        # Where neither this strategy, the precision nor the module changes backward, each step calls the
        # loss's own: three calls fewer per step. One process only: with several, a backward stuck in the
        # gradient all-reduce is reported by the frame it waits in (faults.raise_if_collective_timeout).
        self._plain_backward = (
            self.world_size == 1
            and type(self).backward is Strategy.backward
            and self.precision.scaler is None
            and overridden(module, "backward", TrainModule) is None
        )

    def setup_module_to_plan(self, module: TrainModule) -> None:
        """setup_module for `trainer plan` (scaling/fake_step.py): `module` is on the meta device, a FakeTensorMode
        is active, the process group is torch's fake one; by default the module's fake tensors are made, then set up
        as for training. A wrapper that needs real tensors overrides this with a stand-in of the same memory and
        collectives."""
        module.to_empty(device=self.root_device)
        self.setup_module(module)

    def compile_module(self, options: CompileOptions | None, cache_dir: Path) -> None:
        """After setup_module wrapped or sharded the module: compile its regions (the `compile` option, else what the
        user compiled with torch.compile), caching in `cache_dir`; its steps then run compiled."""
        assert self.module is not None
        self.compile_record = start_compile([self.module], options, self.module, cache_dir, self.is_global_zero)

    # ------------------------------------------------------------------ the steps (the per-step path)
    def plain_training_step(self) -> Callable[[Any, int], Any] | None:
        """The module's training_step, where this strategy's micro-step is nothing more than it followed by the
        loss's own backward, and its optimizer step nothing more than `optimizer.step()` (one process, full
        precision, none of them overridden): the training step may then make those calls itself. None elsewhere."""
        cls = type(self)
        if (not self._plain_backward or self.precision.mixed or cls.training_step is not Strategy.training_step
                or cls.forward_backward is not Strategy.forward_backward
                or cls.optimizer_step is not Strategy.optimizer_step):
            return None
        return self._bound_training_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Run the user's training_step under autocast (through the wrapper, if any)."""
        step = self._bound_training_step or bound_step(self.module, "training_step")
        if not self.precision.mixed:  # the per-step path: no context to enter and leave
            return step(batch, batch_idx)
        with self.precision.autocast():
            return step(batch, batch_idx)

    def backward(self, loss: torch.Tensor) -> None:
        """The module's backward, with the precision's scaling."""
        self.precision.backward(loss, self.module)

    def forward_backward(
        self, batch: Any, batch_idx: int, loss_scale: float, before_backward: Callable[[torch.Tensor], None] | None
    ) -> Any:
        """One automatic-optimization micro-step: training_step, on_before_backward (where someone overrides it),
        then backward of loss * loss_scale.

        Returns training_step's output (its loss unscaled). A pipeline overrides this: its schedule does both.
        """
        output = self.training_step(batch, batch_idx)
        if output is None:
            return None  # the batch is skipped, as in Lightning (TrainStep allows it where one process trains)
        loss = step_loss(output)
        if before_backward is not None:
            before_backward(loss)
        if loss_scale != 1.0:
            loss = loss * loss_scale
        if self._plain_backward:
            loss.backward()
        else:
            self.backward(loss)
        return output

    def eval_step(self, step_name: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        """validation_step / test_step / predict_step under autocast, forward only; `dataloader_idx` is passed
        on (None: a single loader, whose steps get none)."""
        rest = () if dataloader_idx is None else (dataloader_idx,)
        with self.precision.autocast():
            return run_step(self.module, step_name, batch, batch_idx, *rest)

    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        """A context whose backward passes skip gradient synchronisation (micro-batches that accumulate)."""
        return contextlib.nullcontext()

    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> None:
        """Clip this optimizer's gradients by global norm or by value (after unscaling)."""
        self.precision.unscale(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(params, value)
        else:
            torch.nn.utils.clip_grad_value_(params, value)

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], torch.Tensor] | None = None
    ) -> Any:
        """Apply the gradients (a parameter server pushes them instead); `closure` is for an optimizer that
        evaluates the loss itself (LBFGS). Returns what the optimizer's step returns."""
        return self.precision.step(optimizer, closure)

    # ------------------------------------------------------------------ data
    def prepare_loader(self, loader: DataLoader, train: bool, seed: int) -> DataLoader:
        """This rank's view of `loader`: sharded over the data-parallel ranks, pinned for CUDA."""
        return prepare_loader(
            loader, train=train, num_replicas=self.data_parallel_size, rank=self.data_parallel_rank, seed=seed,
            pin_memory=True if self.root_device.type == "cuda" else None,
            # A job of several processes (or one that may become several: elastic) draws one order, seeded.
            own_order=self.environment.world_size == 1 and not self.environment.max_restarts,
        )

    def batch_to_device(self, batch: Any) -> Any:
        """The batch on this process's device. On a CPU the loader's host tensors are used as they are:
        walking every batch to find nothing to move costs each step for no gain."""
        if self.root_device == HOST:  # not `.type == "cpu"`: reading `.type` builds a new string each call
            return batch
        return move_to_device(batch, self.root_device, non_blocking=self.root_device.type == "cuda")

    # ------------------------------------------------------------------ collectives (honest no-ops on one process)
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce across all ranks with 'mean', 'sum', 'max' or 'min'."""
        return tensor

    def max_across_ranks_async(self, values: list[float]) -> Any:
        """Start taking the maximum of each of `values` over every rank, without waiting for it."""
        return values  # one process: nobody else to ask

    def max_across_ranks_result(self, pending: Any) -> list[float]:
        """Wait for a `max_across_ranks_async` and return its maxima."""
        return pending

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank."""
        return None  # one process: nobody to wait for

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src`, on every rank."""
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, ordered by rank."""
        return [obj]

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's `tensor` (of one shape on all) stacked along a new first dimension, on its device. Here
        by pickling; strategies with a tensor collective override it (and support `sync_grads`)."""
        if sync_grads:
            raise MisconfigurationError(f"all_gather(sync_grads=True) is not supported under {type(self).__name__}; "
                                        "use strategy='ddp' for gathers that carry gradients.")
        return torch.stack([t.to(tensor.device) for t in self.all_gather_object(tensor.detach().cpu())])

    def gather_data_parallel(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's `obj`, ordered by data-parallel rank (the ranks that split the data)."""
        return self.all_gather_object(obj)

    # ------------------------------------------------------------------ checkpoints
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model under plain keys (gathered when it is split), identical across strategies."""
        assert self.module is not None
        # self.module is the unwrapped user module, so its keys are already plain; stripping 'module.'
        # here would mangle a user's own submodule named `module` and break strict loading on resume.
        return dict(self.module.state_dict())

    def checkpoint_model_state(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds: model_state_dict, unless the strategy saves them in shards (fsdp)."""
        return self.model_state_dict()

    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load what model_state_dict returned (from any strategy) into the module."""
        assert self.module is not None
        self.module.load_state_dict(state_dict, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state in the layout of one device (gathered when it is split)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what optimizer_state_dict returned (from any strategy) into `optimizer`."""
        optimizer.load_state_dict(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Rank 0 writes, atomically: the file now, its fsync and rename on a thread of its own, done before the
        next optimizer step (checkpoint.CheckpointFiles); every rank waits for the file to be written."""
        if self.is_global_zero:
            self._unsynced_folders.add(self._files().save(checkpoint, path).parent)
        self.barrier("save_checkpoint")

    def link_checkpoint(self, source: str | Path, path: str | Path) -> None:
        """Give the checkpoint just saved at `source` the name `path` too (atomically), behind the same barrier."""
        if self.is_global_zero:
            self._unsynced_folders.add(self._files().link(source, path).parent)
        self.barrier("save_checkpoint")

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Read a checkpoint onto this process's device."""
        self.finish_checkpoints()
        return load_checkpoint_file(path, map_location=self.root_device)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Delete a checkpoint file (rank 0), after the checkpoint work asked for before."""
        if self.is_global_zero:
            self._files().remove(path)

    def finish_checkpoints(self) -> None:
        """Return once this rank's checkpoint files are synced and named; raise CheckpointError where that failed."""
        self.checkpoint_in_flight = False
        if self._checkpoint_files is not None:
            self._checkpoint_files.wait()

    def _files(self) -> CheckpointFiles:
        if self._checkpoint_files is None:
            self._checkpoint_files = CheckpointFiles()
        self.checkpoint_in_flight = True
        return self._checkpoint_files


def _on_device(module: nn.Module, device: torch.device) -> bool:
    """Every parameter and buffer already on `device`, the host (a CUDA device without an index is ambiguous)."""
    return device.type == "cpu" and all(t.device.type == "cpu" for t in (*module.parameters(), *module.buffers()))
