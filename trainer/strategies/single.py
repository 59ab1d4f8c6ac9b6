"""One process, one device: the module runs as it is."""

from __future__ import annotations

from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Everything on one device; collectives are the base class's no-ops."""

    name = "single"

    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        if devices != 1 or num_nodes != 1:
            raise MisconfigurationError(
                f"strategy='single' runs on one device, but devices={devices}, num_nodes={num_nodes}; "
                "use strategy='ddp' to train on several."
            )

    @override
    def processes_per_node(self) -> int:
        return 1

    @override
    def setup_environment(self, environment: ClusterEnvironment) -> None:
        # Under torchrun/srun with several processes, 'single' would train unsynchronised copies on split data.
        if environment.world_size > 1:
            raise MisconfigurationError(
                f"this process is one of {environment.world_size} started by {environment.name}, but "
                "strategy='single' trains on one process; use strategy='ddp' (or launch one process)."
            )
        super().setup_environment(environment)
