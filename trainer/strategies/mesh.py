"""Device meshes for N-D parallelism: one `init_device_mesh` per job, its dimensions named, built by the strategy.

A layout says how many ways each kind of parallelism cuts the job, outermost first:

    pp            pipeline stages (each holds a part of the layers)
    dp_replicate  replicas that all-reduce gradients (DDP, or HSDP's replicate dimension)
    dp_shard      ranks that shard weights, gradients and optimizer state (FSDP)
    tp            tensor-parallel ranks (each holds a slice of every parallelized layer)

Their product is the world size; tensor parallel is innermost, so a TP group is neighbouring ranks (one node's
fast links). The strategy hands the mesh to the module as `self.device_mesh`, whose `configure_model` applies a
`parallelize_module` plan on `self.device_mesh["tp"]`; the data-parallel coordinate (dp_replicate x dp_shard)
decides which shard of the data a rank reads, so all ranks of a TP group get the same batch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from torchyard.trainer.errors import MisconfigurationError, closest

#: The mesh's dimension names, outermost first.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
#: pipeline's order: rank r is stage r % stages (per TP rank), as before meshes had names.
PIPELINE_ORDER = ("dp_replicate", "dp_shard", "pp", "tp")
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How many ways each parallelism cuts the job (see the module docstring); sizes multiply to the world."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def data_parallel_size(self) -> int:
        """Replicas that read different data: every rank of a TP group (and of a pipeline) reads the same."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """'dp_shard=2 x tp=2' (the dimensions of more than one rank)."""
        cut = [f"{name}={size}" for name, size in zip(MESH_DIMS, self.sizes, strict=True) if size > 1]
        return " x ".join(cut) or "one rank"


def positive_size(owner: str, option: str, value: object) -> int:
    """`value` as a mesh size, or a one-line error naming `owner(option=...)`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MisconfigurationError(f"{owner}({option}={value!r}) must be a positive whole number (1 turns it off).")
    return value


def layout_for(world_size: int, owner: str, *, tensor_parallel: int = 1, replicate: int = 1, pipeline: int = 1,
               shard: bool = True) -> MeshLayout:
    """The layout of a job of `world_size` ranks: what tensor parallel, replicas and pipeline stages leave goes to
    the sharded (`shard`) or the replicated data-parallel dimension. Refused in one line where the sizes do not
    divide the world (checked when the Trainer is built, before any process starts)."""
    fixed = tensor_parallel * replicate * pipeline
    if world_size % fixed:
        parts = [f"{label}={size}" for label, size in
                 (("pipeline stages", pipeline), ("replicate", replicate), ("tensor_parallel", tensor_parallel))
                 if size > 1]
        raise MisconfigurationError(
            f"{owner}: {' x '.join(parts)} = {fixed} does not divide devices x num_nodes = {world_size}; use a "
            f"world size that is a multiple of {fixed}, or smaller sizes that divide {world_size}.")
    rest = world_size // fixed
    if shard:
        return MeshLayout(pp=pipeline, dp_replicate=replicate, dp_shard=rest, tp=tensor_parallel)
    return MeshLayout(pp=pipeline, dp_replicate=replicate * rest, dp_shard=1, tp=tensor_parallel)


def build_mesh(device_type: str, layout: MeshLayout, order: tuple[str, ...] = MESH_DIMS) -> DeviceMesh:
    """The job's mesh, every dimension named (those of size 1 too, so `mesh["tp"]` always exists), laid out in
    `order` (outermost first). A collective: every rank calls it once the default process group is up."""
    return init_device_mesh(device_type, tuple(getattr(layout, name) for name in order), mesh_dim_names=order)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: dp_shard, or (dp_replicate, dp_shard) for HSDP, which reduce-scatters within a
    replica and all-reduces across replicas."""
    if mesh["dp_replicate"].size() > 1:
        return mesh[DATA_PARALLEL_DIMS]
    return mesh["dp_shard"]


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """dp_replicate x dp_shard as one dimension named "dp": the ranks that read different data, whose group
    broadcasts initial weights and gathers per-replica results.

    torch has no public way to make one dimension of two (torchtitan calls the same private `_flatten`): isolated
    here, so a later torch changes one line."""
    return mesh[DATA_PARALLEL_DIMS]._flatten("dp")


def tensor_parallel_size(mesh: DeviceMesh | None) -> int:
    return 1 if mesh is None else mesh["tp"].size()


def check_plan_hook(owner: str, tensor_parallel: int, module: nn.Module, has_hook: bool) -> None:
    """Before any process starts: tensor parallel needs the module's configure_model, where its plan is applied."""
    if tensor_parallel > 1 and not has_hook:
        raise MisconfigurationError(
            f"{owner}(tensor_parallel={tensor_parallel}) needs {type(module).__name__}.configure_model(self) to apply "
            "a tensor-parallel plan, e.g. parallelize_module(self.block, self.device_mesh['tp'], {'up': "
            "ColwiseParallel(), 'down': RowwiseParallel()}); it has none.")


def check_plan_applied(owner: str, tensor_parallel: int, module: nn.Module) -> None:
    """After configure_model: some parameter is a DTensor over the mesh's "tp" dimension (a plan was applied)."""
    if tensor_parallel == 1:
        return
    for parameter in module.parameters():
        names = parameter.device_mesh.mesh_dim_names if isinstance(parameter, DTensor) else None
        if names and "tp" in names:
            return
    raise MisconfigurationError(
        f"{owner}(tensor_parallel={tensor_parallel}): {type(module).__name__}.configure_model applied no "
        "tensor-parallel plan (no parameter is a DTensor on self.device_mesh['tp']); call parallelize_module there, "
        "or use tensor_parallel=1.")


def parallelize(module: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """torch's parallelize_module(module, mesh, plan), but a plan key that names no submodule is a one-line error
    (torch only warns, and the layer then silently stays whole on every rank). Keys are dotted paths whose parts
    may hold fnmatch wildcards ("blocks.*.mlp.0"), as torch's are."""
    names = [name for name, _ in module.named_modules() if name]
    for key in plan:
        parts = key.split(".")
        if not any(len(name.split(".")) == len(parts) and all(fnmatch.fnmatchcase(n, p) for n, p in
                                                                zip(name.split("."), parts, strict=True))
                   for name in names):
            raise MisconfigurationError(
                f"tensor-parallel plan key {key!r} names no submodule of {type(module).__name__}"
                f"{closest(key, names)}; its submodules: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}.")
    return parallelize_module(module, mesh, plan)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor as it is)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole(value: object) -> object:
    """`value` (a tensor, or containers of them) with every DTensor gathered whole, on the host. A collective over
    each DTensor's mesh: every rank holding it calls this in the same order."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().cpu()
    if isinstance(value, dict):
        return {key: whole(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(whole(item) for item in value)
    return value


def into_layout(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor laid out as `like` (this rank's slice of it, as a DTensor where `like` is one). Every rank
    holds `value` whole, so nothing is sent."""
    if not isinstance(like, DTensor):
        return value.to(like.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def load_whole_state(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """A single-device state dict into a module whose tensors may be DTensors (tensor parallel, sharded):
    each rank copies its own slice, so nothing is sent."""
    own = module.state_dict(keep_vars=True)
    missing, unexpected = own.keys() - state_dict.keys(), state_dict.keys() - own.keys()
    if strict and (missing or unexpected):
        raise RuntimeError(f"state dict does not fit {type(module).__name__}: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for key in own.keys() & state_dict.keys():
            target, value = own[key], into_layout(state_dict[key], own[key])
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(value.to_local() if isinstance(value, DTensor) else value)


def broadcast_tensor_parallel_shards(module: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Every data-parallel replica starts from replica 0's weights: each rank's tensor-parallel shards, from the
    rank of data-parallel coordinate 0 that holds the same shards (as FSDP broadcasts the plain weights)."""
    group = dp_mesh.get_group()
    for tensor in [*module.parameters(), *module.buffers()]:
        # Only DTensors on the tp dimension alone: a unit fully_shard-ed in configure_model holds other shards
        # on each data-parallel rank, which must stay as they are.
        if isinstance(tensor, DTensor) and tensor.device_mesh.mesh_dim_names == ("tp",):
            torch.distributed.broadcast(tensor.to_local().data, group=group, group_src=0)


def _mesh_key(tensor: torch.Tensor) -> object:
    return tensor.device_mesh if isinstance(tensor, DTensor) else None


def global_grad_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of every gradient together, on every rank, as one device computes it. Gradients laid out on
    different meshes (fsdp x tp: plain layers shard over dp alone, parallelized ones over dp x tp) cannot meet in
    one DTensor op: each mesh's norm is reduced over its ranks (`full_tensor`), then the norms are combined."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(_mesh_key(grad), []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    devices = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(devices) for n in norms]), norm_type)


def clip_grad_norm_across_meshes(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for gradients on several meshes (see global_grad_norm): the same rule,
    applied mesh by mesh with the one global norm. Returns that norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = global_grad_norm(grads)
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            by_mesh.setdefault(_mesh_key(parameter.grad), []).append(parameter)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


__all__ = ["MESH_DIMS", "MeshLayout", "build_mesh", "clip_grad_norm_across_meshes", "data_parallel_mesh",
           "layout_for", "parallelize", "shard_mesh"]
