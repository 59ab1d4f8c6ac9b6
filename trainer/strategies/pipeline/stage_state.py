"""What a pipeline's ranks exchange besides activations: the values the last stage logged, and every stage's share of
the weights and optimizer state, gathered whole under single-device keys for a checkpoint and loaded back as each
rank's share."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchyard.trainer.data.batches import move_to_device
from torchyard.trainer.logs.metrics import batch_value, is_metric
from torchyard.trainer.strategies import distributed
from torchyard.trainer.strategies.mesh import into_layout, whole


def sendable(value: Any) -> Any:
    """A value the last stage logged, as its replica's other ranks get it: a Metric's state stays on this rank (its
    value for this batch goes), a tensor goes from the CPU."""
    if is_metric(value):
        value = batch_value(value)
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
    return value


def merged_shares(mine: dict[Any, Any], group: dist.ProcessGroup | None) -> dict[Any, Any]:
    """Every stage's `mine`, merged (a collective over the pipeline's stages)."""
    merged: dict[Any, Any] = {}
    for share in distributed.all_gather_object(mine, group=group):
        merged.update(share)
    return merged


def full_model_state(module: torch.nn.Module, owned_keys: set[str],
                     group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The whole model under single-device keys, on CPU: each stage's own keys gathered from it."""
    full = module.state_dict()
    # Tensor-parallel and sharded weights gathered whole within the stage (its ranks own the same keys, in order).
    mine = {key: whole(value.detach()).cpu() for key, value in full.items() if key in owned_keys}
    full.update(merged_shares(mine, group))
    return {key: value.detach().cpu() for key, value in full.items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """As on one device: the param groups plus every stage's per-parameter state."""
    state = optimizer.state_dict()
    mine = {index: move_to_device(whole(value), torch.device("cpu")) for index, value in state["state"].items()}
    return {"state": dict(sorted(merged_shares(mine, group).items())), "param_groups": state["param_groups"]}


def load_stage_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any], owned_params: set[int]) -> None:
    """Load the per-parameter state of this rank's stage parameters only (`owned_params`: their ids)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = {index for index, p in enumerate(params) if id(p) in owned_params}
    optimizer.load_state_dict({
        "state": {index: value for index, value in state["state"].items() if int(index) in local},
        "param_groups": state["param_groups"],
    })
    for parameter in params:  # whole tensors -> this rank's slices of sharded parameters
        saved = optimizer.state.get(parameter, {})
        for name, value in saved.items():
            if isinstance(value, torch.Tensor) and value.shape == parameter.shape and value.ndim:
                saved[name] = into_layout(value, parameter)
