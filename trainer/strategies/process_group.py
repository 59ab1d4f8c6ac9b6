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

import contextlib
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment, resolve_environment
from torchyard.trainer.diagnosis import flight_recorder
from torchyard.trainer.diagnosis.agreement import CollectiveAgreement, checking_user_collectives
from torchyard.trainer.diagnosis.markers import Marker
from torchyard.trainer.diagnosis.watchdog import Watchdog
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import distributed
from torchyard.trainer.strategies.base import Strategy


class ProcessGroupStrategy(Strategy):
    """One process per device, `devices` per node, joined in torch's default process group.

    backend: None picks nccl on CUDA and gloo on CPU. environment: who launched the job when detection
    should not decide ('torchrun', 'slurm', 'mpi', 'local' or a ClusterEnvironment); None detects it.
    """

    #: The gradient collective a backward waits in, as a stuck job's report names it.
    backward_collective: ClassVar[str] = "all_reduce"

    def __init__(self, backend: str | None = None, environment: str | ClusterEnvironment | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.environment_choice = environment
        self._owns_group = False  # this strategy created the default group (not the user's script)
        # Where this rank is (the framework collective it waits in), and the thread that reports a stuck job from
        # it: trainer/diagnosis/.
        self.marker = Marker()
        self._watchdog: Watchdog | None = None
        self._user_checks = contextlib.ExitStack()  # diagnosis='debug': torch.distributed's functions, checked

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
        if self.diagnosis != "off":  # torch's own record of the collectives, read into a stuck job's report
            flight_recorder.enable()
        distributed.init_process_group(environment, self.backend, self.timeout)
        # Not on a group the user's script made itself, unless its store is the launcher's (else it is the script's).
        if self.diagnosis != "off" and (self._owns_group or environment.use_agent_store):
            self._start_watchdog(environment, self.global_rank, self.world_size)

    def _start_watchdog(self, environment: ClusterEnvironment, rank: int, world_size: int) -> None:
        """Watch this rank from a side thread (trainer/diagnosis/watchdog.py), publishing in the job's store."""
        store = distributed.diagnosis_store(environment, self.timeout, self.backend)
        self._watchdog = Watchdog(self.marker, store, rank, world_size, self.timeout, self.on_hang)
        self._watchdog.start()
        if self.diagnosis == "debug":  # every collective, the user's too, agreed on before it runs
            agreement = CollectiveAgreement(self.marker, store, rank, world_size)
            self.marker.agree = agreement.framework
            self._user_checks.enter_context(checking_user_collectives(agreement))

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
    def follow_progress(self, progress: Any) -> None:
        self.marker.progress = progress

    @override
    def stuck_seconds(self) -> float:
        return 0.0 if self._watchdog is None else self._watchdog.still_seconds()

    @override
    def live_job(self) -> dict[str, Any] | None:
        if self._watchdog is None:
            return None
        environment = self.environment
        return {"store": f"{environment.master_addr}:{environment.master_port}",
                "prefix": distributed.diagnosis_prefix(environment), "world_size": self._watchdog.world_size,
                "timeout_s": self.timeout, "strategy": type(self).__name__}

    @override
    def hang_report(self, error: BaseException) -> str | None:
        if self._watchdog is None:
            return None
        report = self._watchdog.report(self._watchdog.error_position(error))
        recorded = flight_recorder.describe(flight_recorder.entries(), self.global_rank)
        return report if recorded is None else f"{report}\n{recorded}"

    @override
    def teardown(self) -> None:
        """Leave the process group this strategy created (at exit where the script keeps it), then the base's."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        self._user_checks.close()
        self.marker.agree = None

        if self._owns_group:
            distributed.leave_process_group(keep=self.keeps_process_group)
        super().teardown()

    # ------------------------------------------------------------------ collectives (over the default group)
    @property
    def collective_device(self) -> torch.device:
        """Where a collective's tensors must be: the rank's GPU for nccl, the host for gloo."""
        return distributed.collective_device(self.backend, self.root_device)

    @override
    def backward(self, loss: torch.Tensor) -> None:
        self.marker.enter(self.backward_collective, "gradients")  # it runs inside backward
        super().backward(loss)
        self.marker.leave()

    @override
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        self.marker.enter("all_reduce", "logged values")
        result = distributed.all_reduce(tensor.to(self.collective_device), op).to(tensor.device)
        self.marker.leave()
        return result

    @override
    def max_across_ranks_async(self, values: list[float]) -> Any:
        return distributed.max_across_ranks_async(values, self.collective_device)

    @override
    def max_across_ranks_result(self, pending: Any) -> list[float]:
        self.marker.enter("all_reduce", "the ranks' SIGTERM and skipped-step flags")
        result = distributed.max_across_ranks_result(pending)
        self.marker.leave()
        return result

    @override
    def barrier(self, name: str | None = None) -> None:
        self.marker.enter("barrier", name or "a barrier")
        distributed.barrier(self.backend, self.root_device)
        self.marker.leave()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.marker.enter("broadcast", f"an object from rank {src}")
        result = distributed.broadcast_object(obj, src)
        self.marker.leave()
        return result

    @override
    def all_gather_object(self, obj: Any) -> list[Any]:
        self.marker.enter("all_gather", "an object from every rank")
        result = distributed.all_gather_object(obj)
        self.marker.leave()
        return result

    @override
    def all_gather(self, tensor: torch.Tensor, sync_grads: bool = False) -> torch.Tensor:
        if sync_grads and not self.steps_in_lockstep:
            # A gather that carries gradients all-reduces them in backward: every rank must reach it together.
            return super().all_gather(tensor, sync_grads)  # which refuses it
        self.marker.enter("all_gather", "a tensor from every rank")
        result = distributed.all_gather_tensor(tensor, self.collective_device, sync_grads)
        self.marker.leave()
        return result
