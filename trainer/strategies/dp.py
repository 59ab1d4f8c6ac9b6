"""DataParallel: one process drives several CUDA devices, each running training_step on a slice of the batch.

Kept for users who know it; strategy="ddp" is faster and preferred (torch says the same). Under dp:
- `batch_size` is the whole batch, split across the devices each step; the learning rate is not scaled.
- training_step runs once per replica; tensors it returns are gathered onto the first device and
  averaged (the loss becomes the mean of the replicas' losses, as Lightning's dp does).
- Validation, test and predict run on the first device only.
- State that replicas change in place (torchmetrics updated inside training_step, buffers) is lost with
  the replicas; update metrics in the evaluation steps instead.
Without two or more CUDA devices it warns once and runs on a single device.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.base import Strategy
from torchyard.trainer.strategies.user_steps import StepDispatcher

if TYPE_CHECKING:
    from torchyard.trainer.config import TrainerConfig
    from torchyard.trainer.module import TrainModule


def _as_vector(value: Any) -> Any:
    """Scalars become 1-element vectors, so gathering concatenates them (instead of warning and stacking)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.unsqueeze(0)
    if isinstance(value, dict):
        return type(value)({k: _as_vector(v) for k, v in value.items()})
    return value


def _mean_over_replicas(value: Any) -> Any:
    """Every gathered tensor averaged over its first dimension (a dict's tensors one by one)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float().mean().to(value.dtype)
    if isinstance(value, dict):
        return type(value)({k: _mean_over_replicas(v) for k, v in value.items()})
    return value


class ReplicaSteps(StepDispatcher):
    """A StepDispatcher whose scalar outputs gather cleanly across replicas."""

    @override
    def forward(self, step_name: str, *args: Any) -> Any:
        return _as_vector(super().forward(step_name, *args))


class DataParallelStrategy(Strategy):
    """`Trainer(strategy="dp", devices=N)`: torch.nn.DataParallel over N CUDA devices of this node."""

    name = "dp"
    plannable = False  # torch DataParallel replicates onto CUDA devices in its forward: fake tensors have none

    def __init__(self) -> None:
        super().__init__()
        self.device_ids: list[int] = []

    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        if num_nodes != 1:
            raise MisconfigurationError(
                f"strategy='dp' runs in one process on one node, but num_nodes={num_nodes}; use strategy='ddp' across "
                "nodes."
            )
        available = torch.cuda.device_count() if self.accelerator == "cuda" else 0
        if available >= 2 and devices > available:
            raise MisconfigurationError(
                f"devices={devices} but this machine has {available} CUDA devices; use devices<={available}."
            )
        self.device_ids = list(range(devices)) if available >= 2 else []
        if len(self.device_ids) < 2:
            self.device_ids = []
            warnings.warn(
                f"strategy='dp' needs two or more CUDA devices (found {available} on accelerator={self.accelerator!r}, "
                f"devices={devices}); running on a single device instead.",
                UserWarning,
                stacklevel=3,  # the Trainer(...) line
            )

    @override
    def check_config(self, config: TrainerConfig, callbacks: list[Any]) -> None:
        if config.compile is not None:  # DataParallel copies the module onto each GPU at every forward
            raise MisconfigurationError("compile is not supported with strategy='dp' (DataParallel replicates the "
                                        "module at every step); use strategy='ddp' with compile, or drop compile.")

    @override
    def processes_per_node(self) -> int:
        return 1  # one process drives every device of the node

    @property
    def parallel(self) -> bool:
        return len(self.device_ids) >= 2

    @override
    def setup_module(self, module: TrainModule) -> None:
        super().setup_module(module)
        if self.parallel:
            self.model = nn.DataParallel(
                ReplicaSteps(module), device_ids=self.device_ids, output_device=self.device_ids[0]
            )

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if not self.parallel:
            return super().training_step(batch, batch_idx)
        # DataParallel carries the autocast state into its replica threads.
        with self.precision.autocast():
            return _mean_over_replicas(self.model("training_step", batch, batch_idx))
