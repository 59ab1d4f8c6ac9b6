"""Distributed data parallel: one process per device, gradients all-reduced by torch's DDP.
How the data is split between ranks (train, validation, predict): docs/data-and-sharding.md."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainer.environment import ClusterEnvironment, resolve_environment
from trainer.errors import MisconfigurationError
from trainer.strategies import distributed
from trainer.strategies.base import StepDispatcher, Strategy

if TYPE_CHECKING:
    from trainer.module import TrainModule

# Gradient compression through torch's own DDP communication hooks: buckets travel in half precision.
COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
BACKENDS = ("gloo", "nccl", "mpi")


class DDPStrategy(Strategy):
    """`Trainer(strategy="ddp", devices=N, num_nodes=M)`: N processes per node, one device each.

    backend: 'gloo' on CPU and 'nccl' on CUDA unless given. find_unused_parameters, static_graph and
    gradient_as_bucket_view go to torch's DistributedDataParallel. comm_hook: None, 'fp16' or 'bf16'
    (compress gradients for the all-reduce). environment: who launched the job, when detection should
    not decide: 'torchrun', 'slurm', 'mpi', 'local' or a ClusterEnvironment.
    """

    name = "ddp"

    def __init__(
        self,
        backend: str | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        comm_hook: str | None = None,
        environment: str | ClusterEnvironment | None = None,
    ) -> None:
        super().__init__()
        if backend is not None and backend not in BACKENDS:
            raise MisconfigurationError(f"DDPStrategy(backend={backend!r}) is not known; use one of {', '.join(BACKENDS)} or leave it unset.")
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise MisconfigurationError(f"DDPStrategy(comm_hook={comm_hook!r}) is not known; use None, 'fp16' or 'bf16'.")
        self.backend = backend
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_hook = comm_hook
        self.environment_choice = environment
        self._owns_group = False

    # ------------------------------------------------------------------ the world
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        self.backend = distributed.resolve_backend(self.backend, self.accelerator, "DDPStrategy")
        # Checked only when the Trainer will start the processes: a launcher may give each process its own
        # GPU (srun --gpus-per-task=1), and each then sees one device.
        if self.accelerator == "cuda" and devices > torch.cuda.device_count() and not self.detect_environment().launched:
            raise MisconfigurationError(
                f"devices={devices} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"use devices={torch.cuda.device_count()} or fewer (devices counts per node)."
            )

    def processes_per_node(self) -> int:
        return self.devices

    def detect_environment(self) -> ClusterEnvironment:
        return resolve_environment(self.environment_choice)

    def setup_environment(self, environment: ClusterEnvironment) -> None:
        """Check the launch matches devices * num_nodes, pin this rank's device, join the process group."""
        expected = self.devices * self.num_nodes
        if environment.world_size != expected:
            raise MisconfigurationError(
                f"{environment.name} started {environment.world_size} process(es), but Trainer(devices={self.devices}, "
                f"num_nodes={self.num_nodes}) expects {expected}; make them match (processes per node = devices)."
            )
        if self.accelerator == "cuda":
            self._pin_cuda_device(environment)
        else:
            super().setup_environment(environment)
        # A group the user's script created itself is theirs to destroy.
        self._owns_group = not torch.distributed.is_initialized()
        distributed.init_process_group(environment, self.backend, self.timeout)

    def _pin_cuda_device(self, environment: ClusterEnvironment) -> None:
        """cuda:<local rank>, or cuda:0 when the launcher made a single GPU visible to each process."""
        visible = torch.cuda.device_count()
        if environment.local_rank < visible:
            index = environment.local_rank
        elif visible == 1:
            index = 0
        else:
            raise MisconfigurationError(
                f"local rank {environment.local_rank} has no CUDA device (this process sees {visible}); "
                "start at most one process per GPU on each node."
            )
        self.environment, self.root_device = environment, torch.device("cuda", index)
        torch.cuda.set_device(self.root_device)

    def teardown(self) -> None:
        """Release the DDP wrapper, then the process group; the order matters (see below)."""
        # DDP's reducer holds the process group and its communication state. Destroying the group while
        # the wrapper still lives was seen to hang gloo runs at interpreter exit; drop it first, and if a
        # reference cycle keeps it alive, collect now rather than whenever the garbage collector next runs.
        wrapper = weakref.ref(self.model) if self.model is not None and self.model is not self.module else None
        self.model = self.module
        if wrapper is not None and wrapper() is not None:
            gc.collect()
        if self._owns_group:
            distributed.leave_process_group(keep=self.keeps_process_group)
        super().teardown()

    # ------------------------------------------------------------------ the model
    def setup_module(self, module: TrainModule) -> None:
        """Wrap the module so training_step runs through DDP's forward (its gradient-sync hooks fire)."""
        super().setup_module(module)
        if not any(p.requires_grad for p in module.parameters()):
            return  # nothing to synchronise (a frozen model being evaluated); DDP refuses such modules
        on_cuda = self.root_device.type == "cuda"
        self.model = DistributedDataParallel(
            StepDispatcher(module), device_ids=[self.root_device.index] if on_cuda else None,
            find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        if self.comm_hook is not None:
            self.model.register_comm_hook(state=None, hook=COMM_HOOKS[self.comm_hook])

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if not isinstance(self.model, DistributedDataParallel):
            return super().training_step(batch, batch_idx)
        with self.precision.autocast():
            return self.model("training_step", batch, batch_idx)

    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        device = distributed.collective_device(self.backend, self.root_device)
        return distributed.all_reduce(tensor.to(device), op).to(tensor.device)

    def max_across_ranks_async(self, values: list[float]) -> Any:
        return distributed.max_across_ranks_async(values, distributed.collective_device(self.backend, self.root_device))

    def max_across_ranks_result(self, pending: Any) -> list[float]:
        return distributed.max_across_ranks_result(pending)

    def barrier(self, name: str | None = None) -> None:
        distributed.barrier(self.backend, self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return distributed.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return distributed.all_gather_object(obj)

    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        return distributed.all_gather_tensor(tensor, distributed.collective_device(self.backend, self.root_device), sync_grads)
