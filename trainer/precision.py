"""Numeric precision: autocast for the forward pass and a grad scaler where fp16 needs one."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from trainer.errors import MisconfigurationError

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
NO_AUTOCAST = contextlib.nullcontext()  # stateless and reentrant: one instance serves every step


def validate_precision(precision: str, device_type: str) -> str:
    """The precision name, or a clear error when it is unknown or not supported on `device_type`."""
    precision = str(precision)
    if precision not in PRECISIONS:
        raise MisconfigurationError(f"precision={precision!r} is not known; use one of {', '.join(PRECISIONS)}.")
    if precision == "16-mixed" and device_type == "cpu":
        raise MisconfigurationError(
            "precision='16-mixed' is not supported on CPU (fp16 autocast there is slow and unscaled); "
            "use precision='bf16-mixed' or run on CUDA."
        )
    if precision == "bf16-mixed" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise MisconfigurationError("precision='bf16-mixed' needs a GPU with bf16 support; use '16-mixed'.")
    return precision


class Precision:
    """Autocast context and (for '16-mixed') a GradScaler; '32' makes both no-ops."""

    def __init__(self, precision: str = "32", device_type: str = "cpu") -> None:
        self.precision = validate_precision(precision, device_type)
        self.mixed = self.precision != "32"  # forward passes run under autocast
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type) if self.precision == "16-mixed" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward pass runs in."""
        if not self.mixed:
            return NO_AUTOCAST
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        return torch.autocast(self.device_type, dtype=dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step, letting the scaler skip steps whose gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
