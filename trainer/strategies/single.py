"""One process, one device: the module runs as it is."""

from __future__ import annotations

from trainer.errors import MisconfigurationError
from trainer.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Everything on one device; collectives are the base class's no-ops."""

    name = "single"

    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        if devices != 1 or num_nodes != 1:
            raise MisconfigurationError(
                f"strategy='single' runs on one device, but devices={devices}, num_nodes={num_nodes}; "
                "use strategy='ddp' to train on several."
            )
