"""Fully sharded data parallel on torch's FSDP2 (`fully_shard` on a DeviceMesh): each rank keeps 1/N of the
weights, gradients and optimizer state, gathering a unit's weights only while it computes.

How the model is cut into shard units, checkpoints (full or sharded) and the options: docs/strategies.md.
The checkpoint IO itself is fsdp_checkpoint.py's.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint as checkpointed
from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.errors import MisconfigurationError, closest
from torchyard.trainer.module import TrainModule
from torchyard.trainer.strategies.fsdp_checkpoint import (
    ShardedPart,
    full_model_state,
    full_optimizer_state,
    link_folder,
    load_full_model_state,
    load_full_optimizer_state,
    load_sharded_model,
    load_sharded_optimizer,
    read_sharded,
    remove_path,
    save_sharded,
)
from torchyard.trainer.strategies.mesh import (
    MeshLayout,
    broadcast_tensor_parallel_shards,
    build_mesh,
    check_plan_applied,
    check_plan_hook,
    clip_grad_norm_across_meshes,
    data_parallel_mesh,
    layout_for,
    positive_size,
    shard_mesh,
)
from torchyard.trainer.strategies.process_group import ProcessGroupStrategy
from torchyard.trainer.strategies.user_steps import StepDispatcher

CHECKPOINT_KINDS = ("full", "sharded")
#: Modules whose parameters are DTensors on the mesh of a run that has ended: no later run can use them.
_SHARDED_BY_ENDED_RUNS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
BACKENDS = ("gloo", "nccl")
# Weights gathered and computed in bf16, gradients reduced in fp32 (the sharded fp32 weights are what steps).
MIXED_PRECISION = {"bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


class FSDPStrategy(ProcessGroupStrategy):
    """`Trainer(strategy="fsdp", devices=N)`: N processes per node, each holding 1/N of the model.

    shard_units: class names of the submodules that become their own shard units (e.g. the transformer block);
    min_params: instead, every submodule holding at least this many parameters not in a smaller unit. Without
    either, the module's own configure_model may call `fully_shard(layer, mesh=self.device_mesh["dp_shard"])`;
    the rest (the root) is always one unit. reshard_after_forward: free gathered weights after each unit's forward
    (ZeRO-3; False keeps them until backward, ZeRO-2). cpu_offload: keep shards, gradients and optimizer state on
    the host (CUDA). activation_checkpointing: class names whose forward is recomputed in backward.
    sync_batchnorm: batch norm statistics over every rank (CUDA). checkpoint: 'full' (one file, gathered to
    rank 0, which every strategy loads) or 'sharded' (a folder, every rank writing its shard through DCP).
    tensor_parallel: ranks that split each parallelized layer (the module's configure_model applies its plan on
    `self.device_mesh["tp"]`); replicate: replicas of the sharded model (HSDP: shards within a replica, gradients
    all-reduced across them). The rest of devices x num_nodes shards (mesh: mesh.py).
    """

    name = "fsdp"

    backward_collective = "reduce_scatter"  # FSDP reduces each unit's gradients to their shards

    def __init__(
        self,
        backend: str | None = None,
        shard_units: list[str] | None = None,
        min_params: int | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: list[str] | None = None,
        sync_batchnorm: bool = False,
        checkpoint: str = "full",
        environment: str | ClusterEnvironment | None = None,
        tensor_parallel: int = 1,
        replicate: int = 1,
    ) -> None:
        super().__init__(backend, environment)
        self.tensor_parallel = positive_size("FSDPStrategy", "tensor_parallel", tensor_parallel)
        self.replicate = positive_size("FSDPStrategy", "replicate", replicate)
        self.layout = MeshLayout(dp_replicate=replicate, tp=tensor_parallel)  # completed by configure
        if backend is not None and backend not in BACKENDS:
            raise MisconfigurationError(f"FSDPStrategy(backend={backend!r}) is not known; use one of "
                                        f"{', '.join(BACKENDS)} or leave it unset.")
        if checkpoint not in CHECKPOINT_KINDS:
            raise MisconfigurationError(f"FSDPStrategy(checkpoint={checkpoint!r}) is not known; use 'full' (one file) "
                                        "or 'sharded' (a folder of every rank's shards).")
        if shard_units is not None and min_params is not None:
            raise MisconfigurationError("FSDPStrategy takes shard_units or min_params, not both: name the unit "
                                        "classes, or give the parameter count that makes a unit.")
        if min_params is not None and (isinstance(min_params, bool) or not isinstance(min_params, int)
                                       or min_params < 1):
            raise MisconfigurationError(f"FSDPStrategy(min_params={min_params!r}) must be a positive whole number.")
        self.shard_units = _class_names("shard_units", shard_units)
        self.activation_checkpointing = _class_names("activation_checkpointing", activation_checkpointing)
        self.min_params = min_params
        self.reshard_after_forward = bool(reshard_after_forward)
        self.cpu_offload = bool(cpu_offload)
        self.sync_batchnorm = bool(sync_batchnorm)
        self.checkpoint = checkpoint
        self.device_mesh: DeviceMesh | None = None  # this job's ranks (mesh.py), built when the process joins the group
        self._dp_mesh: DeviceMesh | None = None  # dp_replicate x dp_shard as one dimension, under tensor parallel
        self._sharded: tuple[nn.Module, nn.Module] | None = None  # (module, its sharded root) of the last setup

    # ------------------------------------------------------------------ the world
    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        self.layout = layout_for(devices * num_nodes, "FSDPStrategy", tensor_parallel=self.tensor_parallel,
                                 replicate=self.replicate)
        if self.precision.precision == "16-mixed":
            raise MisconfigurationError("strategy='fsdp' takes precision='bf16-mixed' or '32' (fp16 would need a "
                                        "gradient scaler across shards); use 'bf16-mixed'.")
        for option in ("cpu_offload", "sync_batchnorm"):
            if getattr(self, option) and self.accelerator != "cuda":
                raise MisconfigurationError(f"FSDPStrategy({option}=True) needs accelerator='cuda' (on CPU the "
                                            "weights already live on the host and torch's SyncBatchNorm needs a GPU).")
        visible = torch.cuda.device_count()
        if self.accelerator == "cuda" and devices > visible and not self.detect_environment().launched:
            raise MisconfigurationError(f"devices={devices} but this machine has {visible} CUDA device(s); use "
                                        f"devices={visible} or fewer (devices counts per node).")

    @override
    def setup_environment(self, environment: ClusterEnvironment) -> None:
        """Join the group, then lay the job's ranks on the layout's mesh (FSDP shards over its data-parallel part)."""
        super().setup_environment(environment)
        self.device_mesh = build_mesh(self.root_device.type, self.layout)
        if self.tensor_parallel > 1:
            self._dp_mesh = data_parallel_mesh(self.device_mesh)

    @property
    @override
    def data_parallel_size(self) -> int:
        return max(1, self.world_size // self.tensor_parallel)  # a TP group's ranks read one batch together

    @property
    @override
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.tensor_parallel  # tp is the mesh's innermost dimension

    @override
    def teardown(self) -> None:
        """Leave the module's parameters sharded (the root keeps its gathered weights after an evaluation forward),
        release FSDP's root, then the group."""
        self._reshard()
        if self._sharded is not None and not self.keeps_process_group:
            _SHARDED_BY_ENDED_RUNS.add(self._sharded[0])  # its parameters live on this run's mesh, which ends here
        self.model = self.module
        super().teardown()

    def _reshard(self) -> None:
        """Every unit back to its shard: FSDP's root keeps the weights it gathered for a forward that no backward
        followed (an evaluation's), which state dicts must not see."""
        for layer in [*(self.module.modules() if self.module is not None else ()), self.model]:
            if isinstance(layer, FSDPModule):
                layer.reshard()

    # ------------------------------------------------------------------ the model
    @override
    def check_module(self, module: TrainModule, stage: str) -> None:
        """Unknown class names, a threshold that makes no unit, sync_batchnorm without batch norm: before any
        process starts (a module that builds its layers in setup or configure_model is checked once it has)."""
        super().check_module(module, stage)
        builds_later = type(module).configure_model is not TrainModule.configure_model
        check_plan_hook("FSDPStrategy", self.tensor_parallel, module, builds_later)
        if type(module).setup is TrainModule.setup and not builds_later:
            self._check_layers(module)

    def _check_layers(self, module: nn.Module) -> None:
        present = sorted({type(m).__name__ for m in module.modules()})
        for option in ("shard_units", "activation_checkpointing"):
            for name in getattr(self, option) or ():
                if name not in present:
                    raise MisconfigurationError(
                        f"FSDPStrategy({option}=[{name!r}]): {type(module).__name__} has no submodule of class "
                        f"{name!r}{closest(name, present)}; its classes: {', '.join(present)}.")
        if self.min_params is not None and not shard_units(module, None, self.min_params):
            largest = max((sum(p.numel() for p in m.parameters()) for m in module.children()), default=0)
            raise MisconfigurationError(
                f"FSDPStrategy(min_params={self.min_params}) makes no shard unit of {type(module).__name__}: its "
                f"largest child holds {largest} parameters; lower min_params or name shard_units.")
        if self.sync_batchnorm and not any(isinstance(m, BATCH_NORMS) for m in module.modules()):
            raise MisconfigurationError(f"FSDPStrategy(sync_batchnorm=True): {type(module).__name__} has no batch norm "
                                        "layer to synchronise; leave the option out.")

    @override
    def setup_module(self, module: TrainModule) -> None:
        """Shard the module in place: its units, then the root (a StepDispatcher, so FSDP's gathers run around
        the user's steps, as DDP's hooks do)."""
        if module in _SHARDED_BY_ENDED_RUNS:
            raise MisconfigurationError(
                f"{type(module).__name__} was sharded by an earlier fsdp run whose process group has ended; build a "
                "new one and load the weights (load_from_checkpoint or ckpt_path=...).")
        if self._sharded is not None and self._sharded[0] is module and distributed_alive(self._sharded[1]):
            super().setup_module(module)
            self.model = self._sharded[1]  # a later stage in the same job (torchrun): the module is sharded already
            return
        self._check_layers(module)
        check_plan_applied("FSDPStrategy", self.tensor_parallel, module)
        if self.sync_batchnorm:
            module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        super().setup_module(module)
        if self.world_size > 1:  # every rank starts from rank 0's weights, as under ddp
            for tensor in [*module.parameters(), *module.buffers()]:
                if not isinstance(tensor, DTensor):  # configure_model's units are already sharded
                    torch.distributed.broadcast(tensor.data, src=0)
        if self._dp_mesh is not None and self._dp_mesh.size() > 1:  # each TP shard from data-parallel replica 0
            broadcast_tensor_parallel_shards(module, self._dp_mesh)
        for layer in module.modules():
            if type(layer).__name__ in (self.activation_checkpointing or ()):
                recompute_in_backward(layer)
        options = self._shard_options()
        for unit in shard_units(module, self.shard_units, self.min_params):
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **options)
        self.model = fully_shard(StepDispatcher(module), **options)  # the root: what no unit holds
        self._sharded = (module, self.model)

    @override
    def setup_module_to_plan(self, module: TrainModule) -> None:
        """Shard on the meta device, then make this rank's shards (fake tensors): fully_shard cuts each parameter
        into one chunk per rank, which on the meta device is C++ alone but through fake tensors costs seconds per
        parameter at a thousand ranks."""
        device, self.root_device = self.root_device, torch.device("meta")
        try:
            with unset_fake_temporarily():  # plain meta tensors, outside the fake mode's dispatch
                self.setup_module(module)
        finally:
            self.root_device = device
        self.model.to_empty(device=device)

    def _shard_options(self) -> dict[str, Any]:
        policy = MIXED_PRECISION.get(self.precision.precision, MixedPrecisionPolicy())
        offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        assert self.device_mesh is not None
        return {"mesh": shard_mesh(self.device_mesh), "mp_policy": policy, "offload_policy": offload}

    # ------------------------------------------------------------------ the steps
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        with self.precision.autocast():
            return self.model("training_step", batch, batch_idx)

    @override
    def eval_step(self, step_name: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        rest = () if dataloader_idx is None else (dataloader_idx,)
        # FSDP's gathered weights must track versions, which tensors made under inference_mode cannot: no_grad.
        with torch.inference_mode(False), torch.no_grad(), self.precision.autocast():
            return self.model(step_name, batch, batch_idx, *rest)

    @override
    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        return _gradient_sync_off(self.model) if isinstance(self.model, FSDPModule) else contextlib.nullcontext()

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> None:
        """By norm: the global norm over every rank's DTensor shards (the same on every rank), mesh by mesh where
        tensor parallel lays some gradients over dp x tp and the rest over dp (mesh.clip_grad_norm_across_meshes)."""
        if algorithm != "norm":
            return super().clip_gradients(optimizer, value, algorithm)
        self.precision.unscale(optimizer)
        clip_grad_norm_across_meshes([p for group in optimizer.param_groups for p in group["params"]], value)
        return None

    # ------------------------------------------------------------------ collectives over the mesh
    @override
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Over every rank; the ranks of a TP group log the same values, so a sum counts each replica once."""
        result = super().reduce(tensor, op)
        return result / self.tensor_parallel if op == "sum" and self.tensor_parallel > 1 else result

    @override
    def gather_data_parallel(self, obj: Any) -> list[Any]:
        """From the first rank of each TP group, in data-parallel order (tp is the innermost dimension)."""
        return self.all_gather_object(obj)[::self.tensor_parallel]

    # ------------------------------------------------------------------ checkpoints
    @override
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model on every rank, on the host (a collective): what each node's launching script adopts."""
        assert self.module is not None
        with self._state_dict_context():
            return {key: value.cpu() for key, value in full_model_state(self.module, every_rank=True).items()}

    @override
    def checkpoint_model_state(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        with self._state_dict_context():
            if self.checkpoint == "sharded":
                return get_model_state_dict(self.module)  # this rank's shards, as DTensors
            return full_model_state(self.module)

    @override
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.module is not None
        with self._state_dict_context():
            if self.checkpoint == "sharded":
                return get_optimizer_state_dict(self.module, optimizer)
            return full_optimizer_state(self.module, optimizer)

    def _state_dict_context(self) -> contextlib.AbstractContextManager:
        """Sharded weights, outside inference_mode (a save from a validation's hooks runs inside it, where FSDP's
        state-dict hooks cannot run)."""
        self._reshard()
        return torch.inference_mode(False)

    @override
    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        assert self.module is not None
        if isinstance(state_dict, ShardedPart):
            load_sharded_model(self.module, state_dict.folder)
        else:
            load_full_model_state(self.module, state_dict, strict)

    @override
    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        assert self.module is not None
        if isinstance(state, ShardedPart):
            load_sharded_optimizer(self.module, optimizer, state)
        else:
            load_full_optimizer_state(self.module, optimizer, state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        if self.checkpoint != "sharded":
            return super().save_checkpoint(checkpoint, path)
        self.finish_checkpoints()  # a file's save or link still in flight comes first
        written = save_sharded(checkpoint, Path(path), self.is_global_zero, functools.partial(self.barrier, "save"))
        if self.is_global_zero:
            self._unsynced_folders.add(written.parent)
        return None

    @override
    def link_checkpoint(self, source: str | Path, path: str | Path) -> None:
        if not Path(source).is_dir():
            return super().link_checkpoint(source, path)
        if self.is_global_zero:
            self.finish_checkpoints()
            link_folder(Path(source), Path(path))
            self._unsynced_folders.add(Path(path).parent)
        self.barrier("save_checkpoint")
        return None

    @override
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        if Path(path).is_dir():
            return read_sharded(Path(path), map_location=self.root_device)
        return super().load_checkpoint(path)

    @override
    def remove_checkpoint(self, path: str | Path) -> None:
        if not Path(path).is_dir():
            return super().remove_checkpoint(path)  # a file: removed after the work queued before it
        if self.is_global_zero:
            self.finish_checkpoints()  # what was asked for before (a file's save or link, in flight) comes first
            remove_path(Path(path))
        return None


# --------------------------------------------------------------------------- plain functions


def _class_names(option: str, names: Any) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) for n in names) or not names:
        raise MisconfigurationError(f"FSDPStrategy({option}={names!r}) takes a non-empty list of module class "
                                    "names, e.g. ['Block'].")
    return list(names)


def shard_units(module: nn.Module, class_names: list[str] | None, min_params: int | None) -> list[nn.Module]:
    """The submodules to shard as their own units, innermost first (fully_shard goes bottom-up); those the module's
    configure_model sharded itself, and what they hold, are left as they are."""
    taken = {id(p) for m in module.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    units = []
    for layer in reversed(list(module.modules())):  # every submodule before its parents
        if layer is module or isinstance(layer, FSDPModule):
            continue
        free = [p for p in layer.parameters() if id(p) not in taken]
        if class_names is not None:
            chosen = type(layer).__name__ in class_names
        else:
            chosen = min_params is not None and sum(p.numel() for p in free) >= min_params
        if chosen and free:
            units.append(layer)
            taken.update(id(p) for p in free)
    return units


def recompute_in_backward(layer: nn.Module) -> None:
    """Run `layer`'s forward under torch.utils.checkpoint: its activations are recomputed in backward, not kept.
    (The forward is replaced on the instance, so parameter and state-dict names stay as they were.)"""
    forward = layer.forward
    if getattr(forward, "func", None) is checkpointed:
        return  # a second stage on the same module
    layer.forward = functools.partial(checkpointed, forward, use_reentrant=False)


@contextlib.contextmanager
def _gradient_sync_off(root: FSDPModule) -> Iterator[None]:
    """Backward passes that accumulate unsharded gradients without reduce-scattering them."""
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def distributed_alive(root: nn.Module) -> bool:
    """Whether the process group a sharded root was built on is still up (a later stage may reuse it)."""
    return torch.distributed.is_initialized() and isinstance(root, FSDPModule)


__all__ = ["FSDPStrategy", "shard_units"]
