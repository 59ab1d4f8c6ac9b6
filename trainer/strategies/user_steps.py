"""How a strategy calls the user's steps: by name, with batch_idx and dataloader_idx passed as the step's signature
takes them (as Lightning does), through a wrapper's forward where the wrapper's hooks must fire."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchyard.trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule


class StepDispatcher(nn.Module):
    """Routes `wrapper(name, *args)` to `module.<name>(*args)` so a wrapper's forward hooks
    (DDP's gradient-sync preparation, DataParallel's scatter/gather) fire around the user's steps."""

    def __init__(self, module: TrainModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, step_name: str, *args: Any) -> Any:
        return run_step(self.module, step_name, *args)


def bound_step(module: nn.Module, step_name: str) -> Callable[..., Any]:
    """The module's `step_name`, to call on (batch, batch_idx, ...): batch_idx is left out where the step takes
    none, as Lightning does (`def training_step(self, batch):` is common)."""
    step = getattr(module, step_name)
    if _needs_dataloader_idx(type(module), step_name):
        return lambda batch, batch_idx, *rest: step(batch, batch_idx, *(rest or (0,)))
    if _takes_batch_idx(type(module), step_name):
        return step
    return lambda batch, batch_idx, *rest: step(batch, *rest)


def run_step(module: nn.Module, step_name: str, batch: Any, batch_idx: int, *rest: Any) -> Any:
    """The module's `step_name` on (batch, batch_idx, ...) (see bound_step)."""
    return bound_step(module, step_name)(batch, batch_idx, *rest)


@functools.cache
def _takes_batch_idx(cls: type, step_name: str) -> bool:
    """Whether the step has a batch_idx parameter: a third positional one (after self and batch), or *args."""
    parameters = inspect.signature(getattr(cls, step_name)).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


@functools.cache
def _needs_dataloader_idx(cls: type, step_name: str) -> bool:
    """Whether the step's dataloader_idx has no default: Lightning then passes it for a single loader too."""
    try:
        inspect.signature(getattr(cls, step_name)).bind(None, None, 0)  # self, batch, batch_idx
    except TypeError:
        return _takes_batch_idx(cls, step_name)
    return False


def step_loss(output: Any) -> torch.Tensor:
    """The loss in what training_step returned (a tensor, or a dict with 'loss')."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        got = "None (nothing)" if output is None else type(output).__name__
        raise MisconfigurationError(
            f"training_step returned {got}; under automatic optimization it must return the loss tensor "
            "or a dict with key 'loss' (or set `automatic_optimization = False`)."
        )
    return loss
