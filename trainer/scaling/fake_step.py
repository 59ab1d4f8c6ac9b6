"""One training step of a recipe's model under a strategy, with per-rank peak memory by part and the collectives it
issued: on fake tensors and torch's fake process group for `trainer plan` (no real memory, no other process), or on
real tensors in a real job to measure what the plan predicted.

The step is the strategies' own code: build_strategy, configure, setup_environment, setup_module_to_plan (the
strategy's setup_module, or a stand-in with the same memory and traffic where its wrapper needs real tensors: DDP's
C++ reducer), forward_backward, optimizer_step and zero_grad, as the fit loop calls them. Memory is counted by
torch's MemTracker (torch.distributed._tools), which sorts every live tensor storage into parameters, gradients,
optimizer state, activations and temporaries; collectives by a dispatch mode that sees every c10d op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.optim import parse_optimizers
from torchyard.trainer.strategies import build_strategy

if TYPE_CHECKING:
    from torchyard.trainer.cli.recipe import Recipe

#: MemTracker's kinds of storage -> our parts (buffers are counted with parameters, "other" with temporaries).
PARTS = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Optstate": "optimizer",
         "Activation": "activations", "Temp": "temporaries", "Other": "temporaries"}


WARMUP_STEPS = 1


@dataclasses.dataclass
class StepMemory:
    """Bytes held by one rank at its peak, by part."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    temporaries: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporaries

    @property
    def model_state(self) -> int:
        """Parameters, gradients and optimizer state: what does not grow with the micro-batch."""
        return self.parameters + self.gradients + self.optimizer


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a step as this rank issued it: torch's op name, its tensors' bytes, its group's size."""

    op: str
    bytes: int
    group_size: int


@dataclasses.dataclass
class StepRecord:
    memory: StepMemory
    collectives: list[Collective]


class CollectiveCounter(TorchDispatchMode):
    """Records every c10d collective dispatched inside it (the waits and barriers aside), fake or real."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func in collective_ops and func not in sync_ops:
            group = CollectiveOp.get_process_group(func, args)
            size = CollectiveOp.get_comm_tensor_size(func, result, args, kwargs or {})
            self.collectives.append(Collective(func._schema.name.split("::")[-1], int(size), group.size()))
        return result


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as `rank` of a job of `world_size` on torch's fake backend: collectives return at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend with torch

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sample_batch(recipe: Recipe) -> Any:
    """The first training batch of the recipe's data (real and small: the plan resizes it)."""
    datamodule = recipe.data.instantiate()
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def resize_batch(batch: Any, size: int) -> Any:
    """`batch` with `size` samples, repeating its own (every tensor's first dimension is the batch's)."""
    def resized(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[torch.arange(size) % tensor.shape[0]]

    return tree_map_only(torch.Tensor, resized, batch)


def run_step(recipe: Recipe, strategy: dict[str, Any], world_size: int, rank: int, batch: Any,
             fake: bool = True, accelerator: str = "cpu") -> StepRecord:
    """Training steps of the recipe's model under `strategy` as `rank` of `world_size` processes, in the
    process group this process already joined (fake_process_group, or a real one); the peak and the collectives of
    the last one (the ones before warm up). `fake`: every tensor is a fake one. `accelerator`: 'cuda' measures a
    real run on this rank's GPU (a plan is made on the host: bytes do not depend on the device)."""
    mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    built = build_strategy(strategy, world_size)
    built.configure(accelerator, world_size, 1, str(recipe.trainer.precision))
    built.setup_environment(ClusterEnvironment("local", rank, rank, world_size, world_size))
    try:
        with torch.device("meta") if fake else contextlib.nullcontext():
            module = recipe.model.instantiate()
        built.check_module(module, "fit")
        with mode:
            if fake:
                built.setup_module_to_plan(module)
            else:
                built.setup_module(module)
            optimizers = built.setup_optimizers(parse_optimizers(module.configure_optimizers())[0])
            batch = tree_map_only(torch.Tensor, mode.from_tensor, batch) if fake else built.batch_to_device(batch)
            # Untracked: the first step allocates the optimizer state (Adam's moments); a real DDP rebuilds its
            # buckets in the second step's forward, so a real run warms up one step more.
            for _ in range(WARMUP_STEPS if fake else WARMUP_STEPS + 1):
                one_step(built, optimizers, batch)
            tracker, counter = MemTracker(), CollectiveCounter()
            # The state a step leaves: parameters, optimizer state, and gradients (held between steps where they
            # live in buffers, as DDP's buckets; the next step's zero_grad frees the others).
            tracker.track_external(built.model, *optimizers)
            with tracker, counter:
                one_step(built, optimizers, batch)
        return StepRecord(peak_memory(tracker), counter.collectives)
    finally:
        built.model = built.module = None


def time_steps(recipe: Recipe, batch: Any, steps: int = 2) -> float:
    """Seconds of one real training step of the recipe's model on one process here ('single'), the fastest of
    `steps` after a warm-up one: the plan's compute time. On one thread, as `trainer scale` runs each CPU worker
    (two threads on two busy cores were seen to take ten times as long)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _time_steps(recipe, batch, steps)
    finally:
        torch.set_num_threads(threads)


def _time_steps(recipe: Recipe, batch: Any, steps: int) -> float:
    strategy = build_strategy("single")
    strategy.configure("cpu", 1, 1, str(recipe.trainer.precision))
    strategy.setup_environment(ClusterEnvironment("local"))
    strategy.setup_module(recipe.model.instantiate())
    optimizers = strategy.setup_optimizers(parse_optimizers(strategy.module.configure_optimizers())[0])
    one_step(strategy, optimizers, batch)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        one_step(strategy, optimizers, batch)
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def one_step(strategy: Any, optimizers: list[torch.optim.Optimizer], batch: Any) -> None:
    """The fit loop's calls for one automatic-optimization step of one batch (the last step's gradients dropped
    first: the loop's zero_grad after a step, here at the start of the next)."""
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    strategy.forward_backward(batch, 0, 1.0, None)
    for optimizer in optimizers:
        strategy.optimizer_step(optimizer)


def peak_memory(tracker: MemTracker) -> StepMemory:
    """MemTracker's peak snapshot summed over devices, in our parts."""
    memory = StepMemory()
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        for kind, nbytes in snapshot.items():
            part = PARTS.get(str(getattr(kind, "value", kind)))
            if part is not None:
                setattr(memory, part, getattr(memory, part) + int(nbytes))
    return memory
