"""Pipeline parallelism: the model cut into stages, one process per stage, trained with torch.distributed.pipelining's
micro-batch schedules, optionally x data parallel. What a module provides and how the loop maps: docs/strategies.md."""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.compile.regions import start_compile
from torchyard.trainer.data.batches import move_to_device
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.module import TrainModule
from torchyard.trainer.optim import needs_closure
from torchyard.trainer.strategies import distributed
from torchyard.trainer.strategies.mesh import (
    PIPELINE_ORDER,
    MeshLayout,
    build_mesh,
    check_plan_applied,
    check_plan_hook,
    global_grad_norm,
    layout_for,
    load_whole_state,
    local_part,
    positive_size,
)
from torchyard.trainer.strategies.pipeline.split import (
    build_stage_modules,
    check_schedule,
    microbatch_count,
    resolve_schedule,
    runs_one_stage,
    schedule_for,
    split_batch,
    stage_ownership,
    stage_placement,
    unused_steps,
    unused_steps_warning,
    v_style,
)
from torchyard.trainer.strategies.pipeline.stage_state import (
    full_model_state,
    full_optimizer_state,
    load_stage_optimizer_state,
    sendable,
)
from torchyard.trainer.strategies.process_group import ProcessGroupStrategy

if TYPE_CHECKING:
    from torchyard.trainer.compile.options import CompileOptions


class PipelineStrategy(ProcessGroupStrategy):
    """`Trainer(strategy="pipeline", devices=4)` or `PipelineStrategy(stages=2, microbatches=8, schedule="gpipe")`.

    stages: pipeline depth (processes per replica); default: every device, one replica.
    microbatches: micro-batches per batch; the training batch size must be a multiple.
    schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, and the zero-bubble ones torch has (available_schedules()).
    split_points: submodule names where a new stage begins, e.g. ["blocks.2", "blocks.4"].
    stages_per_rank: model chunks per process, for interleaved and zero-bubble schedules (V ones need 2).
    backend: torch.distributed backend (default: nccl on CUDA, gloo on CPU).
    tensor_parallel: ranks that split each parallelized layer of a stage (configure_model applies the plan on
    `self.device_mesh["tp"]`). data_parallel: how the replicas share the work: 'ddp' (each holds its stages whole,
    gradients all-reduced) or 'fsdp' (each stage sharded over the replicas with fully_shard).
    """

    name = "pipeline"
    # Its schedule receives shapes from the other stages and reads micro-batch indexes from tensors: a fake process
    # group answers neither (docs/planning.md).
    plannable = False

    def __init__(self, stages: int | None = None, microbatches: int = 4, schedule: str = "1f1b",
                 split_points: list[str] | None = None, stages_per_rank: int = 1, backend: str | None = None,
                 tensor_parallel: int = 1, data_parallel: str = "ddp") -> None:
        super().__init__(backend)
        self.tensor_parallel = positive_size("PipelineStrategy", "tensor_parallel", tensor_parallel)
        if data_parallel not in ("ddp", "fsdp"):
            raise MisconfigurationError(f"PipelineStrategy(data_parallel={data_parallel!r}) is not known; use 'ddp' "
                                        "(replicas all-reduce gradients) or 'fsdp' (replicas shard each stage).")
        self.data_parallel = data_parallel
        self.layout = MeshLayout(tp=tensor_parallel)  # completed by configure
        self._dp_rank = 0
        for label, value in (("microbatches", microbatches), ("stages_per_rank", stages_per_rank), ("stages", stages)):
            if (value is not None or label != "stages") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise MisconfigurationError(f"pipeline {label}={value!r} must be a positive integer.")
        if split_points is not None and not all(isinstance(p, str) for p in split_points):
            raise MisconfigurationError(f"split_points={split_points!r} must be a list of submodule names.")
        self.schedule_name, self.schedule_class = resolve_schedule(schedule)
        self.requested_stages, self.microbatches, self.stages_per_rank = stages, microbatches, stages_per_rank
        self.split_points = list(split_points) if split_points else None
        if backend is not None and backend not in ("gloo", "nccl", "mpi"):
            raise MisconfigurationError(
                f"pipeline backend={backend!r} is not known; use 'gloo', 'nccl', 'mpi' or leave it unset."
            )
        self.stages = 1
        self._sync_gradients = True
        self._schedules: dict[Any, Any] = {}
        self._local: list[tuple[int, torch.nn.Module]] = []
        self._owned_keys: set[str] = set()
        self._owned_params: set[int] = set()
        self._pp_group: Any = None
        self._dp_group: Any = None

    # ------------------------------------------------------------------ the world
    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        if self.precision.scaler is not None:
            raise MisconfigurationError(
                "precision='16-mixed' is not supported with strategy='pipeline' (each stage would skip overflowing "
                "steps on its own); use precision='bf16-mixed' or '32'."
            )
        world = devices * num_nodes
        chunks_from_points = len(self.split_points) + 1 if self.split_points else None
        if self.requested_stages is not None:
            self.stages = self.requested_stages
        elif chunks_from_points is not None:
            self.stages = max(1, chunks_from_points // self.stages_per_rank)
        else:
            self.stages = max(1, world // self.tensor_parallel)
        if world % self.stages:
            raise MisconfigurationError(
                f"devices x num_nodes = {world} is not divisible by pipeline stages={self.stages}; "
                f"use a multiple of {self.stages} devices (devices = stages x replicas)."
            )
        if chunks_from_points is not None and chunks_from_points != self.num_chunks:
            raise MisconfigurationError(
                f"{len(self.split_points)} split_points make {chunks_from_points} stages, but stages={self.stages} x "
                f"stages_per_rank={self.stages_per_rank} = {self.num_chunks}; give {self.num_chunks - 1} split points."
            )
        check_schedule(self.schedule_name, self.schedule_class, self.microbatches, self.stages, self.stages_per_rank)
        self.layout = layout_for(world, "PipelineStrategy", tensor_parallel=self.tensor_parallel, pipeline=self.stages,
                                 shard=self.data_parallel == "fsdp")

    @property
    def num_chunks(self) -> int:
        """Model chunks across the pipeline (stages x stages_per_rank)."""
        return self.stages * self.stages_per_rank

    @property
    def replicas(self) -> int:
        return max(1, self.devices * self.num_nodes // (self.stages * self.tensor_parallel))

    @override
    def setup_environment(self, environment: ClusterEnvironment) -> None:
        """Join the job, then lay its ranks out as a (replicas, stages, tensor parallel) mesh: without tensor
        parallel, rank r is stage r % stages."""
        super().setup_environment(environment)
        self.device_mesh = mesh = build_mesh(self.root_device.type, self.layout, order=PIPELINE_ORDER)
        dp_dim = "dp_shard" if self.data_parallel == "fsdp" else "dp_replicate"
        self._pp_group, self._dp_group = mesh.get_group("pp"), mesh.get_group(dp_dim)
        self.pp_rank, self._dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank(dp_dim)

    @override
    def teardown(self) -> None:
        """Drop the stages and schedules (they hold the groups), then the groups."""
        groups = [g for g in (self._pp_group, self._dp_group) if g is not None and g != dist.GroupMember.WORLD]
        self._schedules.clear()
        self._local = []
        self._pp_group = self._dp_group = None
        gc.collect()
        # Kept where the module's DTensors (tensor parallel, fsdp) live on them: the script goes on using it.
        # Else, where the default group is not left now (which takes them along), they go now.
        if (not self._owns_group or self.keeps_process_group) and self.layout.tp * self.layout.dp_shard == 1:
            for group in groups:
                dist.destroy_process_group(group)
        super().teardown()

    @property
    @override
    def data_parallel_size(self) -> int:
        return self.replicas

    @property
    @override
    def data_parallel_rank(self) -> int:
        return self._dp_rank

    @override
    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        kinds = [type(optimizer).__name__ for optimizer in optimizers if needs_closure(optimizer)]
        if kinds:
            raise MisconfigurationError(
                f"strategy='pipeline' cannot step {kinds[0]}: it evaluates the loss again and again, and how often "
                "would be decided by each stage from its own parameters alone; use an optimizer whose step takes no "
                "closure "
                "(SGD, Adam, AdamW, ...) or strategy='ddp'."
            )
        return optimizers

    # ------------------------------------------------------------------ the model
    @override
    def validates(self, module: TrainModule) -> bool:
        return True  # without a pipeline_validation_step the last stage logs val/loss from pipeline_loss

    @override
    def missing_metric_hint(self, module: TrainModule) -> str:
        unused = unused_steps(module)
        if not unused:
            return ""
        return (f" strategy='pipeline' does not call {type(module).__name__}.{' or '.join(unused)}, so what "
                f"{'they log is' if len(unused) > 1 else 'it logs is'} not logged: the fit logs train/loss and "
                "val/loss from pipeline_loss. Log the value in pipeline_validation_step(output, batch, batch_idx), "
                "which runs on the last stage.")

    @override
    def check_module(self, module: TrainModule, stage: str) -> None:
        if stage == "fit" and (unused := unused_steps_warning(module)):
            warnings.warn(unused, stacklevel=4)
        if stage == "fit" and not module.automatic_optimization:
            raise MisconfigurationError(
                "strategy='pipeline' runs its schedule's backward; set automatic_optimization = True."
            )
        if stage == "fit" and type(module).backward is not TrainModule.backward:
            raise MisconfigurationError(f"strategy='pipeline' runs its schedule's backward, stage by stage, so "
                                        f"{type(module).__name__}.backward would never be called; remove it.")
        own_step = {"validate": "pipeline_validation_step", "test": "pipeline_test_step"}.get(stage)
        needs_loss = stage == "fit" or (own_step is not None and not hasattr(module, own_step))
        if needs_loss and type(module).pipeline_loss is TrainModule.pipeline_loss:
            module.pipeline_loss(None, None)  # raises the explanatory error naming the hook
        if stage == "predict" and type(module).predict_step is not TrainModule.predict_step:
            raise MisconfigurationError(
                f"{type(module).__name__}.predict_step cannot run under strategy='pipeline': each process holds one "
                "stage of the model, and pipeline's predict returns the last stage's output for pipeline_input(batch). "
                "Predict with strategy='single' or 'ddp': a pipeline run's checkpoints load into any strategy."
            )
        # The cut itself (split points, pipeline_stages, tied weights), so that it fails before processes start;
        # a module that builds layers in its setup(stage) or configure_model is cut once it has them, in the workers.
        builds_later = type(module).configure_model is not TrainModule.configure_model
        check_plan_hook("PipelineStrategy", self.tensor_parallel, module, builds_later)
        if type(module).setup is TrainModule.setup and not builds_later:
            stage_ownership(module, build_stage_modules(module, self.num_chunks, self.split_points))

    @override
    def setup_module(self, module: TrainModule) -> None:
        """Cut the module into stages, keep this rank's on its device (the rest stays where it was); with
        data_parallel='fsdp', shard each over the replicas."""
        check_plan_applied("PipelineStrategy", self.tensor_parallel, module)
        chunks = build_stage_modules(module, self.num_chunks, self.split_points, self.precision.autocast)
        owned = stage_ownership(module, chunks)
        placements = [
            stage_placement(r, self.stages, self.stages_per_rank, self.schedule_name) for r in range(self.stages)
        ]
        self._local = [(index, chunks[index].to(self.root_device)) for index in placements[self.pp_rank]]
        for _, chunk in self._local if self.data_parallel == "fsdp" else ():
            fully_shard(chunk, mesh=self.device_mesh["dp_shard"])
        self._first_here = 0 in placements[self.pp_rank]
        self._last_here = self.num_chunks - 1 in placements[self.pp_rank]
        last_pp_rank = next(r for r, held in enumerate(placements) if self.num_chunks - 1 in held)
        self._last_global_rank = dist.get_global_rank(self._pp_group, last_pp_rank)
        self._owned_keys = set().union(*(owned[index] for index, _ in self._local))
        self._owned_params = {id(p) for _, chunk in self._local for p in chunk.parameters()}
        self.module = self.model = module

    @override
    def compile_module(self, options: CompileOptions | None, cache_dir: Path) -> None:
        """Each stage of this rank compiles its own part (its regions, else the stage's forward)."""
        self.compile_record = start_compile([chunk for _, chunk in self._local], options, self.module, cache_dir,
                                            self.is_global_zero)

    def _stage_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, chunk in self._local for p in chunk.parameters()]

    def _schedule(self, train: bool, chunks: int, inputs: tuple[torch.Tensor, ...]) -> Any:
        """One schedule (with its own PipelineStages) per mode and input shape: torch sizes its receive
        buffers from the first micro-batch it sees, so a new shape needs new stages."""
        from torch.distributed.pipelining import PipelineStage

        key = (train, chunks, tuple((tuple(t.shape), t.dtype) for t in inputs))
        if key not in self._schedules:
            stages = [PipelineStage(chunk, index, self.num_chunks, self.root_device, group=self._pp_group)
                      for index, chunk in self._local]
            cls = schedule_for(
                self.schedule_name, self.schedule_class, train, chunks, self.stages, self.stages_per_rank
            )
            target = stages[0] if runs_one_stage(cls) else stages
            try:
                self._schedules[key] = cls(
                    target, chunks, loss_fn=self._micro_loss if train else None, scale_grads=False
                )
            except ValueError as err:
                raise MisconfigurationError(
                    f"pipeline schedule {self.schedule_name!r} with {chunks} micro-batches: {err}"
                ) from err
        return self._schedules[key]

    def _inputs(self, batch: Any) -> tuple[torch.Tensor, ...]:
        inputs = self.module.pipeline_input(batch)
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) and t.ndim for t in inputs):
            raise MisconfigurationError(
                f"pipeline_input(batch) must return a tensor (or tuple of tensors) with a batch dimension; got "
                f"{type(inputs[0]).__name__ if inputs else 'nothing'}. Override pipeline_input on the TrainModule."
            )
        return inputs

    def _micro_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn: `target` holds the micro-batch's index into the batch we split the same way."""
        with self.precision.autocast():  # as training_step would be on one device
            loss = self.module.pipeline_loss(output, self._micro_batches[int(target.reshape(-1)[0])])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise MisconfigurationError(f"pipeline_loss must return a scalar tensor; got {type(loss).__name__}.")
        self._micro_losses.append(loss.detach())
        # Each micro-batch's mean loss weighs 1/m, so gradients equal the whole batch's (scale_grads=False:
        # torch's own rescaling would also shrink gradients accumulated over earlier batches).
        return loss * self._loss_weight

    # ------------------------------------------------------------------ the steps
    @override
    def forward_backward(self, batch: Any, batch_idx: int, loss_scale: float,
                         before_backward: Callable[[torch.Tensor], None] | None) -> Any:
        """One schedule step (forward and backward of every micro-batch); the batch's mean loss on every rank."""
        inputs = self._inputs(batch)
        size = inputs[0].shape[0]
        chunks = microbatch_count(size, self.microbatches)
        schedule = self._schedule(True, chunks, inputs)
        self._micro_batches = split_batch(batch, size, chunks) if self._last_here else []
        self._micro_losses, self._loss_weight = [], loss_scale / chunks
        self.marker.enter("send/recv", "the stages' activations and gradients")  # the schedule's, inside it
        schedule.step(*(inputs if self._first_here else ()),
                      target=torch.arange(chunks) if self._last_here else None, return_outputs=False)
        self.marker.leave()
        if self._last_here:
            loss = torch.stack(self._micro_losses[-chunks:]).mean().float()  # earlier calls were shape inference
        else:
            loss = torch.zeros((), device=self.root_device)
        if self.stages > 1:
            dist.broadcast(loss, src=self._last_global_rank, group=self._pp_group)
        if self._sync_gradients and self.replicas > 1 and self.data_parallel == "ddp":  # fsdp reduced them itself
            self._average_gradients()
        if before_backward is not None:
            before_backward(loss)
        self.module.log("train/loss", loss, prog_bar=True)
        return loss

    def _average_gradients(self) -> None:
        """Average this stage's gradients over the replicas in one flat all-reduce."""
        grads = [local_part(p.grad) for p in self._stage_parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._dp_group)
        flat /= self.replicas
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    @override
    @contextlib.contextmanager
    def no_backward_sync(self) -> Iterator[None]:
        saved, self._sync_gradients = self._sync_gradients, False
        try:
            yield
        finally:
            self._sync_gradients = saved

    @override
    def eval_step(self, step_name: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        """Forward-only through the stages; the last stage's logging is replayed on its replica's ranks."""
        if v_style(self.schedule_name):
            raise MisconfigurationError(
                f"schedule={self.schedule_name!r} cannot run forward-only in torch.distributed.pipelining (its V "
                "placement passes backward inputs between a rank's stages), so validation, test and predict are "
                "unavailable with it; set limit_val_batches=0 and num_sanity_val_steps=0, or use another schedule."
            )
        inputs = self._inputs(batch)
        size = inputs[0].shape[0]
        chunks = microbatch_count(size, self.microbatches)
        output = self._schedule(False, chunks, inputs).step(*(inputs if self._first_here else ()))
        if step_name == "predict_step":
            output = move_to_device(output, torch.device("cpu")) if self._last_here else None
            return distributed.broadcast_object(output, src=self._last_global_rank, group=self._pp_group)
        result, records = (
            self._last_stage_eval(step_name, output, batch, batch_idx, dataloader_idx)
            if self._last_here
            else (None, None)
        )
        records = distributed.broadcast_object(records, src=self._last_global_rank, group=self._pp_group)
        self.module.trainer.metrics.replay(records)
        return result

    def _last_stage_eval(self, step_name: str, output: Any, batch: Any, batch_idx: int,
                         dataloader_idx: int | None) -> tuple[Any, list[tuple[str, Any, tuple[Any, ...]]]]:
        # What the step logs is computed here alone: recorded, then sent to the replica's ranks to log.
        with self.module.trainer.metrics.recording(sendable) as records:
            with self.precision.autocast():
                hook = getattr(self.module, f"pipeline_{step_name}", None)
                if hook is not None:
                    extra = (dataloader_idx,) if dataloader_idx is not None else ()
                    return hook(output, batch, batch_idx, *extra), records
                loss = self.module.pipeline_loss(output, batch)
            prefix = "val" if step_name == "validation_step" else "test"
            self.module.log(f"{prefix}/loss", loss, prog_bar=True, sync_dist=True)
            return loss, records

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> None:
        """By norm: the norm of the WHOLE model's gradients (every stage's share summed), as on one device."""
        if algorithm != "norm":
            super().clip_gradients(optimizer, value, algorithm)
            return
        self.precision.unscale(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # This stage's norm (over its TP and FSDP shards too: mesh.global_grad_norm), then the stages' together.
        squared = global_grad_norm(grads).float().to(self.root_device).pow(2)
        dist.all_reduce(squared, group=self._pp_group)
        # The same rule as torch.nn.utils.clip_grad_norm_, applied with the global norm.
        scale = torch.clamp(value / (squared.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            local_part(grad).mul_(scale.to(grad.device, grad.dtype))

    # ------------------------------------------------------------------ data
    @override
    def prepare_loader(self, loader: DataLoader, train: bool, seed: int) -> DataLoader:
        """Shard by replica; training batches (the last one included) must split into micro-batches."""
        prepared = super().prepare_loader(loader, train, seed)
        size, chunks = loader.batch_size, self.microbatches
        if not train or size is None:
            return prepared
        if size % chunks:
            raise MisconfigurationError(
                f"batch_size={size} is not divisible by microbatches={chunks}; use a batch size that is a multiple "
                f"of {chunks}, or microbatches that divides {size}."
            )
        sampler = getattr(prepared.batch_sampler, "sampler", None)
        tail = len(sampler) % size if sampler is not None and hasattr(sampler, "__len__") else 0
        if tail and not loader.drop_last and tail % chunks and v_style(self.schedule_name):
            raise MisconfigurationError(
                f"the last training batch of each epoch holds {tail} samples per replica, which schedule="
                f"{self.schedule_name!r} cannot cut into microbatches={chunks}; pass drop_last=True to the "
                "DataLoader or use a dataset size that fits."
            )
        return prepared

    # ------------------------------------------------------------------ collectives (the rest: ProcessGroupStrategy's)
    @override
    def reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce over every rank. Every stage of a replica holds the same logged values, so mean, max and
        min are those over replicas, and a sum is divided by the stages to count each replica once."""
        result = distributed.all_reduce(tensor.to(self.collective_device), "sum" if op == "sum" else op)
        if op == "sum":
            result = result / (self.stages * self.tensor_parallel)
        return result.to(tensor.device)

    @override
    def gather_data_parallel(self, obj: Any) -> list[Any]:
        """From the same stage of every replica: every rank of a pipeline holds its outputs."""
        return distributed.all_gather_object(obj, group=self._dp_group) if self.replicas > 1 else [obj]

    @override
    def gather_module(self) -> None:
        assert self.module is not None
        load_whole_state(self.module, self.model_state_dict())  # the other stages' weights, from their ranks

    # ------------------------------------------------------------------ checkpoints
    @override
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model under single-device keys, on CPU: every stage's share gathered (a collective)."""
        assert self.module is not None
        self._reshard()
        return full_model_state(self.module, self._owned_keys, self._pp_group)

    @override
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """As on one device: the param groups plus every stage's per-parameter state (a collective)."""
        self._reshard()
        return full_optimizer_state(optimizer, self._pp_group)

    @override
    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load the per-parameter state of this rank's stage parameters only."""
        load_stage_optimizer_state(optimizer, state, self._owned_params)

    @override
    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Whole weights into the module, each rank keeping its slices of tensor-parallel and sharded ones."""
        assert self.module is not None
        load_whole_state(self.module, state_dict, strict)

    def _reshard(self) -> None:
        """Every FSDP stage back to its shards (a forward-only evaluation leaves a root's weights gathered)."""
        for _, chunk in self._local:
            if hasattr(chunk, "reshard"):
                chunk.reshard()
