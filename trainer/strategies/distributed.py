"""torch.distributed plumbing shared by the multi-process strategies, as plain functions."""

from __future__ import annotations

import atexit
import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from torchyard.trainer.cluster import node_checks
from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.diagnosis.arrival import wait_for_ranks
from torchyard.trainer.errors import MisconfigurationError

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# Leaving the group releases the GIL this long first: a gloo worker still waiting for it to free a finished
# collective's tensors at interpreter exit aborts the process (SIGABRT), and torchrun reports the job as failed.
GIL_HANDOFF_S = 0.02


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def resolve_backend(backend: str | None, device_type: str, owner: str) -> str:
    """The process-group backend: the one asked for, else nccl on CUDA and gloo on CPU."""
    backend = backend or default_backend(device_type)
    if backend == "nccl" and device_type != "cuda":
        raise MisconfigurationError(f"{owner}(backend='nccl') needs CUDA devices; use backend='gloo' on CPU.")
    return backend


def collective_device(backend: str, root_device: torch.device) -> torch.device:
    """Where a collective's tensors must be: the rank's GPU for nccl, the host for gloo."""
    return root_device if backend == "nccl" else torch.device("cpu")


def init_process_group(environment: ClusterEnvironment, backend: str, timeout_s: float) -> None:
    """Join the job's default process group; a clear error for a busy port or a master out of reach."""
    if not dist.is_available():
        raise MisconfigurationError("this torch build has no torch.distributed; install a build that has it.")
    if dist.is_initialized():
        return
    environment.export()
    timeout = datetime.timedelta(seconds=timeout_s)
    store = job_store(environment, timeout, backend)
    # torch keys the default group's rendezvous the same way every time, so a group created after an
    # earlier one was destroyed (fit, then test) would read the old group's addresses and fail to
    # connect; each generation of groups gets its own key prefix, agreed through a counter in the store.
    counter = f"trainer/attempt_{environment.restart_count}/groups"
    generation = (store.add(counter, 1) - 1) // environment.world_size
    prefixed = dist.PrefixStore(f"trainer/attempt_{environment.restart_count}/group_{generation}/", store)
    # The ranks that arrived name the ones that did not, past the timeout (torch's own wait says only "timeout").
    wait_for_ranks(prefixed, environment.global_rank, environment.world_size, timeout_s,
                   f"{environment.master_addr}:{environment.master_port}", environment.name)
    dist.init_process_group(backend=backend, store=prefixed, rank=environment.global_rank,
                            world_size=environment.world_size, timeout=timeout)


_STORE: tuple[tuple[str, int, bool], dist.Store] | None = None  # this process's rendezvous store, kept for reuse


def job_store(environment: ClusterEnvironment, timeout: datetime.timedelta, backend: str = "gloo") -> dist.Store:
    """The job's TCPStore: served by rank 0 (or already by torch's elastic agent); one per process.

    It outlives process groups so that a group built after another was destroyed meets the same store. On a
    job of several nodes, the nodes' checks (trainer/cluster/node_checks.py) run when it is made, before any group
    forms.
    """
    global _STORE
    key = (environment.master_addr, environment.master_port, environment.use_agent_store)
    if _STORE is not None and _STORE[0] == key:
        return _STORE[1]
    addr, port = environment.master_addr, environment.master_port
    multi_node = node_checks.is_multi_node(environment)
    serves = environment.global_rank == 0 and not environment.use_agent_store
    node_checks.resolve_master(addr, port, environment.name)
    if multi_node and not serves:
        node_checks.wait_for_master(addr, port, timeout.total_seconds(), f"rank {environment.global_rank}")
    try:
        store = dist.TCPStore(addr, port, environment.world_size, serves, timeout=timeout, wait_for_workers=False)
    except dist.DistNetworkError as err:
        if "EADDRINUSE" in str(err):
            raise MisconfigurationError(
                f"port {port} on {addr} is already in use, so rank 0 cannot serve the job's rendezvous there; "
                "set MASTER_PORT to a free port (or stop the process holding it)."
            ) from err
        raise MisconfigurationError(
            f"rank {environment.global_rank} could not reach the master at {addr}:{port} within "
            f"{timeout.total_seconds():g} s; check MASTER_ADDR/MASTER_PORT, that rank 0 is running and that "
            "the port is open between the nodes."
        ) from err
    if multi_node:
        node_checks.compare_nodes(store, environment, backend, timeout.total_seconds())
    _STORE = (key, store)
    return store


def diagnosis_store(environment: ClusterEnvironment, timeout_s: float, backend: str) -> dist.Store:
    """Where this attempt's ranks publish their positions when stuck (trainer/diagnosis/watchdog.py)."""
    store = job_store(environment, datetime.timedelta(seconds=timeout_s), backend)
    return dist.PrefixStore(diagnosis_prefix(environment), store)


def diagnosis_prefix(environment: ClusterEnvironment) -> str:
    """The key prefix of this attempt's diagnosis in the job's store (what `trainer doctor` reads there too)."""
    return f"trainer/attempt_{environment.restart_count}/diagnosis/"


def destroy_process_group() -> None:
    """Leave the job; safe to call twice."""
    if dist.is_available() and dist.is_initialized():
        time.sleep(GIL_HANDOFF_S)
        dist.destroy_process_group()


def leave_process_group(keep: bool) -> None:
    """Leave the job now, or (`keep`) at interpreter exit, leaving the group to the script until then."""
    if keep:
        atexit.unregister(destroy_process_group)  # registered once, however many stages kept it
        atexit.register(destroy_process_group)
    else:
        destroy_process_group()


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


def max_across_ranks_async(values: list[float], device: torch.device, group: Any = None) -> tuple[Any, torch.Tensor]:
    """Start a MAX all-reduce of a few numbers without waiting; `max_across_ranks_result` waits for it."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True), tensor


def max_across_ranks_result(pending: tuple[Any, torch.Tensor]) -> list[float]:
    work, tensor = pending
    work.wait()
    return tensor.tolist()


def barrier(backend: str, root_device: torch.device, group: Any = None) -> None:
    """Wait for every rank of `group`; NCCL wants the rank's CUDA device named."""
    dist.barrier(group=group, device_ids=[root_device.index] if backend == "nccl" else None)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_tensor(tensor: torch.Tensor, device: torch.device, sync_grads: bool, group: Any = None) -> torch.Tensor:
    """Every rank's `tensor` (of one shape and dtype on all of them) stacked along a new first dimension, on
    `tensor`'s device, in one tensor collective; with `sync_grads`, gradients flow back to each rank's own."""
    if sync_grads:
        import torch.distributed.nn.functional as differentiable  # only here: it imports torch's rpc modules

        return torch.stack(differentiable.all_gather(tensor.to(device), group=group)).to(tensor.device)
    # all_gather_into_tensor concatenates along the first dimension: a leading 1 makes that a stack (0-dim too).
    local = tensor.detach().to(device).reshape(1, *tensor.shape).contiguous()
    gathered = torch.empty((dist.get_world_size(group), *tensor.shape), dtype=local.dtype, device=device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    return gathered.to(tensor.device)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
