"""torch.distributed plumbing shared by the multi-process strategies, as plain functions."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from trainer.environment import ClusterEnvironment
from trainer.errors import MisconfigurationError

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(environment: ClusterEnvironment, backend: str, timeout_s: float) -> None:
    """Join the job's default process group through env:// (the variables the environment exports)."""
    if not dist.is_available():
        raise MisconfigurationError("this torch build has no torch.distributed; install a build that has it.")
    if dist.is_initialized():
        return
    environment.export()
    dist.init_process_group(
        backend=backend, init_method="env://", rank=environment.global_rank, world_size=environment.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    """Leave the job; safe to call twice."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, op: str = "mean", group: Any = None) -> torch.Tensor:
    """A reduced copy of `tensor` across `group` ('mean', 'sum', 'max', 'min')."""
    if op not in _REDUCE_OPS:
        raise MisconfigurationError(f"reduce op {op!r} is not known; use one of {', '.join(_REDUCE_OPS)}.")
    result = tensor.detach().clone()
    if result.dtype in (torch.int32, torch.int64, torch.bool) and op == "mean":
        result = result.float()
    dist.all_reduce(result, op=_REDUCE_OPS[op], group=group)
    if op == "mean":
        result = result / dist.get_world_size(group)
    return result


def barrier(group: Any = None) -> None:
    dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
