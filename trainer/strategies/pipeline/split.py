"""Building a pipeline: cutting a TrainModule into consecutive stages (without tracing), placing them, naming schedules.

A stage is a `StageModule` that holds the user's ORIGINAL submodules (no copies), so every parameter
keeps its full-model name and a gathered checkpoint has the same keys as a single-device run. Three
ways to cut, first match wins:

1. the module's own hook `pipeline_stages(self, num_stages) -> list[nn.Module]`, for models whose
   forward is more than a chain of children;
2. `split_points`: names of the submodules where a new stage begins ("blocks.2");
3. evenly by parameter count over the module's "units": its top-level children in registration
   order, with nn.Sequential / nn.ModuleList containers (such as `blocks`) flattened into their items.
   torchmetrics Metrics and torch loss modules registered on the module are not units. Registration
   order must be forward order, and the forward must be the plain chain `unit_n(...unit_1(input))`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchyard.trainer.errors import MisconfigurationError, closest
from torchyard.trainer.logs.metrics import is_metric
from torchyard.trainer.module import TrainModule

# torch places these as a V (rank r holds stages r and 2p-1-r), and cannot run them forward-only.
V_STYLE_PLACEMENT = ("zbv_zero_bubble", "dualpipev")


class StageModule(nn.Module):
    """Consecutive submodules run in order, like nn.Sequential, under the run's autocast."""

    def __init__(
        self, parts: list[nn.Module], autocast: Callable[[], contextlib.AbstractContextManager] | None = None
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._autocast = autocast or contextlib.nullcontext

    def forward(self, *args: Any) -> Any:
        parts = iter(self.parts)  # not self.parts[1:]: slicing a ModuleList builds a new one every call
        with self._autocast():
            output = next(parts)(*args)
            for part in parts:
                output = part(output)
        return output


# Our names -> torch's (get_schedule_class); a name the installed torch lacks is left out. torch.distributed
# .pipelining is imported only when a pipeline is used: it pulls in torch._dynamo (seconds at import).
_TORCH_SCHEDULES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble", "zbv_zero_bubble": "ZBVZeroBubble", "dualpipev": "DualPipeV",
}


@functools.cache
def available_schedules() -> dict[str, type]:
    """Our schedule name -> torch's schedule class, for the schedules the installed torch has."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    found = {}
    for name, torch_name in _TORCH_SCHEDULES.items():
        try:
            found[name] = get_schedule_class(torch_name)
        except ValueError:
            continue
    return found


def schedule_key(name: str) -> str:
    """'Interleaved1F1B', 'interleaved_1f1b' and 'interleaved-1f1b' all read as one name."""
    return name.lower().replace("_", "").replace("-", "")


def resolve_schedule(name: str) -> tuple[str, type]:
    """(our name, torch schedule class) for a name in any case, with or without underscores ("1F1B", "GPipe")."""
    schedules = available_schedules()
    by_key = {schedule_key(ours): ours for ours in schedules}
    ours = by_key.get(schedule_key(str(name)))
    if ours is None:
        raise MisconfigurationError(
            f"pipeline schedule={name!r} is not known{closest(str(name), schedules)}; known: {', '.join(schedules)}."
        )
    return ours, schedules[ours]


def runs_one_stage(schedule_class: type) -> bool:
    """True for schedules built on one PipelineStage per process (gpipe, 1f1b)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(schedule_class, PipelineScheduleSingle)


def check_schedule(name: str, schedule_class: type, microbatches: int, stages: int, stages_per_rank: int) -> None:
    """The schedule's own requirements, checked before any process starts."""
    m, chunks = microbatches, stages * stages_per_rank
    single = runs_one_stage(schedule_class)
    if single and stages_per_rank != 1:
        raise MisconfigurationError(
            f"schedule={name!r} runs one stage per process, but stages_per_rank={stages_per_rank}; "
            "use schedule='interleaved_1f1b' for several, or stages_per_rank=1."
        )
    if v_style(name) and stages_per_rank != 2:
        raise MisconfigurationError(f"schedule={name!r} places 2 stages per process; set stages_per_rank=2.")
    if name in ("1f1b", "dualpipev") and m < chunks:
        raise MisconfigurationError(
            f"schedule={name!r} needs at least as many micro-batches as stages: microbatches={m}, "
            f"stages={chunks}; raise microbatches to {chunks} or more, or use schedule='gpipe'."
        )
    rounds = max(1, m // stages)
    if name in ("interleaved_1f1b", "interleaved_zero_bubble") and m % rounds:
        raise MisconfigurationError(
            f"schedule={name!r} needs microbatches to be a multiple of microbatches // stages = {rounds}; "
            f"got microbatches={m}; use a multiple of stages={stages}."
        )


def schedule_for(name: str, schedule_class: type, train: bool, chunks: int, stages: int, stages_per_rank: int) -> type:
    """The configured schedule, unless it cannot take `chunks` micro-batches (an epoch's short last batch,
    an evaluation batch): then GPipe, or looped BFS for several stages per rank. Forward-only with one
    stage per rank it is GPipe anyway: 1F1B's ordering only saves activation memory in training."""
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleLoopedBFS

    one_stage = runs_one_stage(schedule_class)
    if not train and one_stage:
        return ScheduleGPipe
    try:
        check_schedule(name, schedule_class, chunks, stages, stages_per_rank)
    except MisconfigurationError:
        if v_style(name):
            raise  # no other torch schedule runs stages placed as a V
        return ScheduleGPipe if one_stage else ScheduleLoopedBFS
    return schedule_class


def microbatch_count(batch_size: int, microbatches: int) -> int:
    """`microbatches`, or for a batch it does not divide (an epoch's last one, an evaluation batch) the
    largest count below it that cuts the batch evenly: torch sizes its buffers for equal micro-batches."""
    return max(d for d in range(1, min(microbatches, batch_size) + 1) if batch_size % d == 0)


def v_style(name: str) -> bool:
    """Whether torch places this schedule's stages as a V; such schedules cannot run forward-only."""
    return name in V_STYLE_PLACEMENT


def _is_unit(module: nn.Module) -> bool:
    return not is_metric(module) and type(module).__module__ != "torch.nn.modules.loss"


def _flatten(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    if isinstance(module, nn.ModuleList) or type(module) is nn.Sequential:
        return [
            unit for child_name, child in module.named_children() for unit in _flatten(f"{name}.{child_name}", child)
        ]
    return [(name, module)]


def stage_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module's chain of units (top-level children, containers flattened), named as in its state_dict."""
    return [unit for name, child in module.named_children() if _is_unit(child) for unit in _flatten(name, child)]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def split_at(units: list[tuple[str, nn.Module]], split_points: list[str]) -> list[list[tuple[str, nn.Module]]]:
    """Cut before each named submodule (a unit, or a container of units such as "blocks.2")."""
    names = [name for name, _ in units]
    valid = list(dict.fromkeys(".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)))
    cuts = []
    for point in split_points:
        starts = [i for i, name in enumerate(names) if name == point or name.startswith(point + ".")]
        if not starts:
            raise MisconfigurationError(
                f"split point {point!r} is not a submodule of the stage chain{closest(point, valid)}; "
                f"valid names: {', '.join(valid)}."
            )
        cuts.append(starts[0])
    if cuts != sorted(set(cuts)) or 0 in cuts:
        raise MisconfigurationError(
            f"split_points {split_points} must be distinct, in forward order, and not the first unit {names[0]!r}."
        )
    bounds = [0, *cuts, len(units)]
    return [units[start:end] for start, end in zip(bounds, bounds[1:])]


def split_evenly(units: list[tuple[str, nn.Module]], num_stages: int) -> list[list[tuple[str, nn.Module]]]:
    """`num_stages` contiguous groups whose largest parameter count is as small as possible.

    Units without parameters (activations, dropout) ride with the layer before them.
    """
    layers: list[list[tuple[str, nn.Module]]] = []
    for unit in units:
        if layers and (_numel(unit[1]) == 0 or not any(_numel(m) for _, m in layers[-1])):
            layers[-1].append(unit)  # parameter-free units (and leading ones) join their neighbour
        else:
            layers.append([unit])
    if len(layers) < num_stages:
        raise MisconfigurationError(
            f"the model has {len(layers)} layers with parameters ({', '.join(g[0][0] for g in layers)}) but "
            f"{num_stages} pipeline stages were asked for; use at most {len(layers)} stages, or define "
            "pipeline_stages(self, num_stages) on the TrainModule."
        )
    sizes = [sum(_numel(m) for _, m in layer) for layer in layers]
    groups = _balanced_partition(sizes, num_stages)
    return [[unit for index in group for unit in layers[index]] for group in groups]


def _balanced_partition(sizes: list[int], parts: int) -> list[list[int]]:
    """Contiguous index groups, exactly `parts` of them, minimising the largest sum (binary search + greedy)."""

    def greedy(limit: int) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        load = 0
        for index, size in enumerate(sizes):
            if groups[-1] and load + size > limit:
                groups.append([])
                load = 0
            groups[-1].append(index)
            load += size
        return groups

    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if len(greedy(middle)) <= parts:
            high = middle
        else:
            low = middle + 1
    groups = greedy(low)
    while len(groups) < parts:  # fewer groups than asked: split the largest splittable one (never raises the max)
        splittable = max((g for g in groups if len(g) > 1), key=lambda g: sum(sizes[i] for i in g))
        at = groups.index(splittable)
        groups[at:at + 1] = [splittable[:-1], splittable[-1:]]
    return groups


def build_stage_modules(module: TrainModule, num_stages: int, split_points: list[str] | None,
                        autocast: Callable[[], contextlib.AbstractContextManager] | None = None) -> list[nn.Module]:
    """The module cut into `num_stages` StageModules, by hook, split points, or evenly by parameters."""
    hook = getattr(module, "pipeline_stages", None)
    if hook is not None:
        stages = list(hook(num_stages))
        if len(stages) != num_stages or not all(isinstance(s, nn.Module) for s in stages):
            raise MisconfigurationError(
                f"{type(module).__name__}.pipeline_stages({num_stages}) must return a list of {num_stages} "
                f"nn.Modules; it returned {len(stages)} items."
            )
        return [StageModule([stage], autocast) for stage in stages]
    units = stage_units(module)
    if not units:
        raise MisconfigurationError(
            f"{type(module).__name__} has no submodules to cut into pipeline stages; register its layers as "
            "attributes (e.g. embed, blocks, head) or define pipeline_stages(self, num_stages)."
        )
    if split_points:
        if len(split_points) != num_stages - 1:
            raise MisconfigurationError(
                f"{len(split_points)} split_points make {len(split_points) + 1} stages, but {num_stages} are "
                f"needed; give {num_stages - 1} split points."
            )
        groups = split_at(units, split_points)
    else:
        groups = split_evenly(units, num_stages)
    return [StageModule([part for _, part in group], autocast) for group in groups]


def stage_ownership(module: nn.Module, stage_modules: list[nn.Module]) -> list[set[str]]:
    """For each stage, the full-model state_dict keys it holds; raises on shared or orphaned parameters."""
    keys_of: dict[int, list[str]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        keys_of.setdefault(id(tensor), []).append(key)
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    owner: dict[int, int] = {}
    owned: list[set[str]] = []
    for index, stage in enumerate(stage_modules):
        keys: set[str] = set()
        for tensor in stage.state_dict(keep_vars=True).values():
            if isinstance(tensor, nn.Parameter) and owner.get(id(tensor), index) != index:
                raise MisconfigurationError(
                    f"parameter {names.get(id(tensor), '?')!r} is used by pipeline stages {owner[id(tensor)]} and "
                    f"{index} (tied weights); untie it or keep its users in one stage (split_points or "
                    "pipeline_stages)."
                )
            owner[id(tensor)] = index
            keys.update(keys_of.get(id(tensor), []))
        owned.append(keys)
    orphans = [name for name, p in module.named_parameters() if id(p) not in owner and p.requires_grad]
    if orphans:
        raise MisconfigurationError(
            f"parameters {orphans[:5]} belong to no pipeline stage and would never train; move them into a "
            "stage submodule or define pipeline_stages(self, num_stages) on the TrainModule."
        )
    return owned


def stage_placement(pp_rank: int, pp_size: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Indices of the stages this pipeline rank runs (loop order r, r+p, ...; or a V for ZBV/DualPipeV)."""
    if v_style(schedule):
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def split_batch(batch: Any, batch_size: int, chunks: int) -> list[Any]:
    """`batch` cut along dim 0 into `chunks` micro-batches the way the schedule cuts its inputs
    (torch.tensor_split); tensors whose first dimension is not the batch size are repeated."""
    if isinstance(batch, torch.Tensor) and batch.ndim and batch.shape[0] == batch_size:
        return list(torch.tensor_split(batch, chunks))
    if isinstance(batch, dict):
        split = {k: split_batch(v, batch_size, chunks) for k, v in batch.items()}
        return [type(batch)({k: v[i] for k, v in split.items()}) for i in range(chunks)]
    if isinstance(batch, (list, tuple)):
        split_items = [split_batch(v, batch_size, chunks) for v in batch]
        rebuild = (lambda items: type(batch)(*items)) if hasattr(batch, "_fields") else type(batch)
        return [rebuild([items[i] for items in split_items]) for i in range(chunks)]
    return [batch] * chunks


def unused_steps(module: TrainModule) -> list[str]:
    """The module's own training_step and validation_step (without a pipeline_validation_step in its place),
    which a pipeline fit does not call."""
    unused = ["training_step"] if type(module).training_step is not TrainModule.training_step else []
    own_validation = type(module).validation_step is not TrainModule.validation_step
    if own_validation and not hasattr(module, "pipeline_validation_step"):
        unused.append("validation_step")
    return unused


def unused_steps_warning(module: TrainModule) -> str | None:
    """What a pipeline fit says once when the module defines steps that it does not call, or None."""
    unused = unused_steps(module)
    if not unused:
        return None
    return (f"strategy='pipeline' does not call {type(module).__name__}.{' or '.join(unused)}: the stages run "
            "pipeline_input(batch) forward, and the last stage's pipeline_loss(output, batch) is the loss, "
            "logged as train/loss (val/loss in validation). Define pipeline_loss, and "
            "pipeline_validation_step(output, batch, batch_idx) to log values of your own in validation "
            "(it runs on the last stage).")
