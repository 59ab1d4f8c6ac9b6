"""Distributed data parallel: one process per device, gradients all-reduced by torch's DDP.
How the data is split between ranks (train, validation, predict): docs/data-and-sharding.md."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors
from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.data.batches import move_to_device
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.base import HOST
from torchyard.trainer.strategies.comm_timing import CommunicationTimer, timed_hook
from torchyard.trainer.strategies.process_group import ProcessGroupStrategy
from torchyard.trainer.strategies.user_steps import StepDispatcher

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchyard.trainer.module import TrainModule

# Gradient compression through torch's own DDP communication hooks: buckets travel in half precision. 'noop' skips
# the all-reduce (replicas drift apart): it exists to measure what the all-reduce costs (benchmarks/local_sgd.py).
COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
              "noop": debugging_hooks.noop_hook}
BACKENDS = ("gloo", "nccl", "mpi")
BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's bucket_cap_mb default


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
        sync_every: int = 1,
        sync_warmup_steps: int = 0,
        time_communication: bool = False,
    ) -> None:
        super().__init__(backend, environment)
        check_local_sgd_options(sync_every, sync_warmup_steps, comm_hook)
        if backend is not None and backend not in BACKENDS:
            raise MisconfigurationError(
                f"DDPStrategy(backend={backend!r}) is not known; use one of {', '.join(BACKENDS)} or leave it unset."
            )
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise MisconfigurationError(
                f"DDPStrategy(comm_hook={comm_hook!r}) is not known; use None, 'fp16', 'bf16' or 'noop'."
            )
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.comm_hook = comm_hook
        self.sync_every, self.sync_warmup_steps = sync_every, sync_warmup_steps
        self.time_communication = time_communication
        self._synced_backward: bool | None = None  # inside a manual-optimization step: whether a backward synced
        self._local_sgd: PostLocalSGDState | None = None  # the hook's step counter, with local SGD
        self._averagers: dict[int, PeriodicModelAverager] = {}  # id(optimizer) -> its averager, with local SGD
        self._timer: CommunicationTimer | None = None

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
        self._register_comm_hook(self.model)

    @override
    def setup_module_to_plan(self, module: TrainModule) -> None:
        """DDP's reducer is C++ that needs real tensors, so `trainer plan` runs the plain module with the reducer's
        memory and traffic: gradients are views of flat buckets, each all-reduced once its gradients are in."""
        module.to_empty(device=self.root_device)
        super(ProcessGroupStrategy, self).setup_module(module)
        if self.sync_every == 1:  # local SGD averages parameters after the step instead: not planned here
            all_reduce_in_buckets(module, self.world_size)

    def _register_comm_hook(self, model: DistributedDataParallel) -> None:
        hook, state = (COMM_HOOKS[self.comm_hook], None) if self.comm_hook is not None else (None, None)
        if self.sync_every > 1:
            # No gradient all-reduce after the warm-up (not even within a node): the averager alone synchronises.
            self._local_sgd = PostLocalSGDState(process_group=None, subgroup=None,
                                                start_localSGD_iter=self.sync_warmup_steps,
                                                post_local_gradient_allreduce=False)
            hook, state = post_localSGD_hook, self._local_sgd
        if self.time_communication:
            # DDP's own all-reduce is C++ with no hook to time; torch's Python allreduce_hook does the same work.
            self._timer = CommunicationTimer(hook or default_hooks.allreduce_hook, state)
            hook, state = timed_hook, self._timer
        if hook is not None:
            model.register_comm_hook(state=state, hook=hook)

    @override
    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """With local SGD, one PeriodicModelAverager per optimizer, run after each of its steps."""
        if self._local_sgd is not None:
            self._averagers = {id(opt): PeriodicModelAverager(self.sync_every, self.sync_warmup_steps)
                               for opt in optimizers}
        return optimizers

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], torch.Tensor] | None = None
    ) -> Any:
        result = super().optimizer_step(optimizer, closure)
        averager = self._averagers.get(id(optimizer))
        if averager is not None:
            with self._timer.timed() if self._timer is not None else contextlib.nullcontext():
                averager.average_parameters(optimizer.param_groups)
        return result

    @property
    def communication_timer(self) -> CommunicationTimer | None:
        """The timer around the communication hook (with time_communication); benchmarks swap the hook it runs."""
        return self._timer

    @override
    def communication_seconds(self) -> float:
        """Seconds this rank waited for the gradient all-reduce and local SGD's averaging (with time_communication)."""
        return self._timer.seconds if self._timer is not None else 0.0

    # ------------------------------------------------------------------ checkpoint state
    @override
    def state_dict(self, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """With local SGD: the hook's and averagers' step counters and, once replicas step on their own, every rank's
        weights and optimizer states (a collective), so a resume continues each replica where it was."""
        if self._local_sgd is None:
            return {}
        state: dict[str, Any] = {"hook_iter": self._local_sgd.iter,
                                 "averager_steps": [self._averagers[id(opt)].step for opt in optimizers]}
        if self._local_sgd.iter >= self.sync_warmup_steps:
            assert self.module is not None
            replica = {"model": dict(self.module.state_dict()),
                       "optimizers": [self.optimizer_state_dict(opt) for opt in optimizers]}
            state["replicas"] = self.all_gather_object(move_to_device(replica, HOST))
        return state

    @override
    def load_state_dict(self, state: dict[str, Any], optimizers: list[torch.optim.Optimizer]) -> None:
        if self._local_sgd is None or not state:
            return
        self._local_sgd.iter = int(state["hook_iter"])
        for opt, step in zip(optimizers, state["averager_steps"], strict=True):
            self._averagers[id(opt)].step = int(step)
        replicas = state.get("replicas", [])
        if len(replicas) == self.world_size:  # on another number of processes every replica starts from rank 0's
            assert self.module is not None
            self.module.load_state_dict(replicas[self.global_rank]["model"])
            for opt, opt_state in zip(optimizers, replicas[self.global_rank]["optimizers"], strict=True):
                self.load_optimizer_state_dict(opt, opt_state)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if not isinstance(self.model, DistributedDataParallel):
            return super().training_step(batch, batch_idx)
        if not self.module.automatic_optimization:
            return self._manual_training_step(batch, batch_idx)
        with self.precision.autocast():
            return self.model("training_step", batch, batch_idx)

    def _manual_training_step(self, batch: Any, batch_idx: int) -> Any:
        """Manual optimization: the user's backward runs inside DDP's forward (the step is the forward), before DDP's
        post-forward would ready the reducer for it. So the forward runs as a no-sync one, and each manual_backward
        readies the reducer itself (see backward)."""
        assert isinstance(self.model, DistributedDataParallel)
        self._synced_backward = False
        try:
            with self.model.no_sync(), self.precision.autocast():
                output = self.model("training_step", batch, batch_idx)
            if self._synced_backward:
                self.model.require_forward_param_sync = True  # the next forward broadcasts buffers, as after a sync
        finally:
            self._synced_backward = None
        return output

    @override
    def backward(self, loss: torch.Tensor) -> None:
        model = self.model
        if not (isinstance(model, DistributedDataParallel) and self._synced_backward is not None):
            return super().backward(loss)
        model.require_backward_grad_sync = True  # inside the step's no-sync forward: this backward syncs
        try:
            _prepare_reducer(model, loss)
            super().backward(loss)
        finally:
            model.require_backward_grad_sync = False
        self._synced_backward = True
        return None

    @override
    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()


def all_reduce_in_buckets(module: torch.nn.Module, world_size: int) -> None:
    """DDP's reducer by hand: parameters in reverse order (the order gradients arrive) in buckets, the first 1 MiB
    and the others 25 MiB (DistributedDataParallel's defaults), each bucket a PlannedBucket."""
    buckets: list[list[torch.nn.Parameter]] = [[]]
    cap, size = dist._DEFAULT_FIRST_BUCKET_BYTES, 0
    for param in reversed([p for p in module.parameters() if p.requires_grad]):
        if buckets[-1] and size + param.numel() * param.element_size() > cap:
            buckets.append([])
            cap, size = BUCKET_CAP_BYTES, 0
        buckets[-1].append(param)
        size += param.numel() * param.element_size()
    for params in buckets:
        bucket = PlannedBucket(params, world_size)
        for param in params:
            param.register_post_accumulate_grad_hook(bucket.arrived)


class PlannedBucket:
    """One gradient bucket of DDP's reducer: made at the first backward, each gradient copied into its view of it
    and left there (gradient_as_bucket_view), the whole bucket all-reduced and averaged when its last one is in."""

    def __init__(self, params: list[torch.nn.Parameter], world_size: int) -> None:
        self.index = {id(param): i for i, param in enumerate(params)}
        self.params, self.world_size = params, world_size
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.ready: set[int] = set()

    def arrived(self, param: torch.Tensor) -> None:
        if self.flat is None:
            self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=param.dtype, device=param.device)
            offsets = [sum(p.numel() for p in self.params[:i]) for i in range(len(self.params))]
            self.views = [self.flat.narrow(0, start, p.numel()).view_as(p)
                          for p, start in zip(self.params, offsets, strict=True)]
        index = self.index[id(param)]
        if param.grad._base is not self.flat:  # a fresh gradient (the last step's was set to None)
            self.views[index].copy_(param.grad)
            param.grad = self.views[index]
        self.ready.add(index)
        if len(self.ready) == len(self.params):
            self.ready.clear()
            dist.all_reduce(self.flat)
            self.flat.div_(self.world_size)


def _prepare_reducer(model: DistributedDataParallel, loss: torch.Tensor) -> None:
    """Ready DDP's reducer for a backward of `loss`, as DDP's post-forward does after an ordinary forward."""
    model.require_forward_param_sync = True
    unused_search = model.find_unused_parameters and not model.static_graph
    model.reducer._rebuild_buckets()  # once, after the first backward: the buckets in the order gradients came
    model.reducer.prepare_for_backward(list(_find_tensors(loss)) if unused_search else [])


def check_local_sgd_options(sync_every: Any, sync_warmup_steps: Any, comm_hook: str | None) -> None:
    """One-line errors for local SGD options that cannot run."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise MisconfigurationError(
            f"DDPStrategy(sync_every={sync_every!r}) must be an integer of at least 1: the number of optimizer steps "
            "between parameter averagings (1 is ordinary DDP, which all-reduces gradients every step)."
        )
    if isinstance(sync_warmup_steps, bool) or not isinstance(sync_warmup_steps, int) or sync_warmup_steps < 0:
        raise MisconfigurationError(
            f"DDPStrategy(sync_warmup_steps={sync_warmup_steps!r}) must be an integer of at least 0: the optimizer "
            "steps that all-reduce gradients as ordinary DDP before local SGD starts."
        )
    if sync_every > 1 and comm_hook is not None:
        raise MisconfigurationError(
            f"DDPStrategy(sync_every={sync_every}, comm_hook={comm_hook!r}): local SGD installs its own communication "
            "hook (post-local SGD); leave comm_hook unset, or use sync_every=1."
        )
