"""Numeric precision: autocast for the forward pass and a grad scaler where fp16 needs one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchyard.trainer.config import precision_name
from torchyard.trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule

NO_AUTOCAST = contextlib.nullcontext()  # stateless and reentrant: one instance serves every step
#: Logged values of these dtypes are kept as float32, as in Lightning: an epoch's sum needs the range. A set, which
#: `value.dtype in` checks by hash (a tuple would compare dtypes with ==, slower per step).
HALF_DTYPES = frozenset((torch.float16, torch.bfloat16))


def validate_precision(precision: str, device_type: str) -> str:
    """The canonical precision name, or a clear error when it is unknown or not supported on `device_type`."""
    precision = precision_name(precision)
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

    def backward(self, loss: torch.Tensor, module: TrainModule) -> None:
        """The module's backward of the loss, scaled where a grad scaler is in use."""
        module.backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], torch.Tensor] | None = None) -> Any:
        """Step, letting the scaler skip steps whose gradients overflowed; a `closure` goes to an optimizer that
        evaluates the loss itself (LBFGS; refused with a scaler, see optim.check_closure_optimizer). Returns
        what the optimizer's step returns."""
        if self.scaler is None:
            return optimizer.step() if closure is None else optimizer.step(closure)
        result = self.scaler.step(optimizer)
        self.scaler.update()
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
