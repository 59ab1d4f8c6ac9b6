"""The shared base of the strategies that run one process per device in a torch process group.

ProcessGroupStrategy holds what ddp, pipeline and ps have in common: the backend (gloo on CPU, nccl on CUDA),
who launched the job (`environment`), one process per device on each node, the check that the launch has
devices x num_nodes processes, this rank's device, the default process group (joined in setup_environment,
left in teardown unless the user's script made it) and the collectives over it. The torch.distributed calls
themselves are plain functions in distributed.py.

A strategy on a process group subclasses this and adds only what is its own, for example:
- ddp: wraps the module in DistributedDataParallel (setup_module, training_step, no_backward_sync).
- fsdp (torch FSDP2): setup_module shards the module with `fully_shard` on a DeviceMesh built over the
  joined group; no_backward_sync turns gradient sync off through `set_requires_gradient_sync`;
  clip_gradients clips by the global norm over DTensor gradients; model_state_dict / optimizer_state_dict
  and their loads go through torch.distributed.checkpoint (full or sharded).
- a strategy that needs subgroups (pipeline's mesh) builds them after super().setup_environment and
  destroys them in teardown before calling super().teardown().
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment, resolve_environment
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import distributed
from torchyard.trainer.strategies.base import Strategy


class ProcessGroupStrategy(Strategy):
    """One process per device, `devices` per node, joined in torch's default process group.

    backend: None picks nccl on CUDA and gloo on CPU. environment: who launched the job when detection
    should not decide ('torchrun', 'slurm', 'mpi', 'local' or a ClusterEnvironment); None detects it.
    """

    def __init__(self, backend: str | None = None, environment: str | ClusterEnvironment | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.environment_choice = environment
        self._owns_group = False  # this strategy created the default group (not the user's script)

    # ------------------------------------------------------------------ the world
    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        self.backend = distributed.resolve_backend(self.backend, self.accelerator, type(self).__name__)

    @override
    def processes_per_node(self) -> int:
        return self.devices

    @override
    def detect_environment(self) -> ClusterEnvironment:
        return resolve_environment(self.environment_choice)

    @override
    def setup_environment(self, environment: ClusterEnvironment) -> None:
        """Check the launch matches devices * num_nodes, pin this rank's device, join the process group."""
        self._check_launch(environment)
        self._pin_device(environment)
        # A group the user's script created itself is theirs to destroy.
        self._owns_group = not dist.is_initialized()
        distributed.init_process_group(environment, self.backend, self.timeout)

    def _check_launch(self, environment: ClusterEnvironment) -> None:
        expected = self.devices * self.num_nodes
        # An elastic job (torchrun --nnodes=MIN:MAX) re-forms on the nodes it has: num_nodes is then the most.
        elastic = environment.max_restarts > 0 and environment.local_world_size == self.devices
        if environment.world_size != expected and not (elastic and 0 < environment.world_size <= expected):
            raise MisconfigurationError(
                f"{environment.name} started {environment.world_size} process(es), but Trainer(devices={self.devices}, "
                f"num_nodes={self.num_nodes}) expects {expected}; make them match (processes per node = devices)."
            )

    def _pin_device(self, environment: ClusterEnvironment) -> None:
        if self.accelerator == "cuda":
            self._pin_cuda_device(environment)
        else:
            super().setup_environment(environment)  # Strategy's: the host

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

    @override
    def teardown(self) -> None:
        """Leave the process group this strategy created (at exit where the script keeps it), then the base's."""
        if self._owns_group:
            distributed.leave_process_group(keep=self.keeps_process_group)
        super().teardown()

    # ------------------------------------------------------------------ collectives (over the default group)
    @property
    def collective_device(self) -> torch.device:
        """Where a collective's tensors must be: the rank's GPU for nccl, the host for gloo."""
        return distributed.collective_device(self.backend, self.root_device)

    @override
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return distributed.all_reduce(tensor.to(self.collective_device), op).to(tensor.device)

    @override
    def max_across_ranks_async(self, values: list[float]) -> Any:
        return distributed.max_across_ranks_async(values, self.collective_device)

    @override
    def max_across_ranks_result(self, pending: Any) -> list[float]:
        return distributed.max_across_ranks_result(pending)

    @override
    def barrier(self, name: str | None = None) -> None:
        distributed.barrier(self.backend, self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return distributed.broadcast_object(obj, src)

    @override
    def all_gather_object(self, obj: Any) -> list[Any]:
        return distributed.all_gather_object(obj)

    @override
    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        if sync_grads and not self.steps_in_lockstep:
            # A gather that carries gradients all-reduces them in backward: every rank must reach it together.
            return super().all_gather(tensor, sync_grads)  # which refuses it
        return distributed.all_gather_tensor(tensor, self.collective_device, sync_grads)
