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
from typing_extensions import override

from torchyard.trainer.environment import ClusterEnvironment
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.base import StepDispatcher
from torchyard.trainer.strategies.process_group import ProcessGroupStrategy

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule

# Gradient compression through torch's own DDP communication hooks: buckets travel in half precision.
COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
BACKENDS = ("gloo", "nccl", "mpi")


class DDPStrategy(ProcessGroupStrategy):
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
        super().__init__(backend, environment)
        if backend is not None and backend not in BACKENDS:
            raise MisconfigurationError(
                f"DDPStrategy(backend={backend!r}) is not known; use one of {', '.join(BACKENDS)} or leave it unset."
            )
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise MisconfigurationError(
                f"DDPStrategy(comm_hook={comm_hook!r}) is not known; use None, 'fp16' or 'bf16'."
            )
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_hook = comm_hook

    # ------------------------------------------------------------------ the world
    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        # Checked only when the Trainer will start the processes: a launcher may give each process its own
        # GPU (srun --gpus-per-task=1), and each then sees one device.
        if (
            self.accelerator == "cuda"
            and devices > torch.cuda.device_count()
            and not self.detect_environment().launched
        ):
            raise MisconfigurationError(
                f"devices={devices} but this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"use devices={torch.cuda.device_count()} or fewer (devices counts per node)."
            )

    @override
    def teardown(self) -> None:
        """Release the DDP wrapper, then the process group; the order matters (see below)."""
        # DDP's reducer holds the process group and its communication state. Destroying the group while
        # the wrapper still lives was seen to hang gloo runs at interpreter exit; drop it first, and if a
        # reference cycle keeps it alive, collect now rather than whenever the garbage collector next runs.
        wrapper = weakref.ref(self.model) if self.model is not None and self.model is not self.module else None
        self.model = self.module
        if wrapper is not None and wrapper() is not None:
            gc.collect()
        super().teardown()

    # ------------------------------------------------------------------ the model
    @override
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

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if not isinstance(self.model, DistributedDataParallel):
            return super().training_step(batch, batch_idx)
        with self.precision.autocast():
            return self.model("training_step", batch, batch_idx)

    @override
    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()
