"""`trainer plan`: per-rank memory and step time of layouts at any scale, predicted on this machine.

    trainer plan RECIPE [overrides] --devices 8,64,512 [--nodes 1,8] --layouts ddp,fsdp:shard_units=[Block]
                 [--device-memory 80GB] [--network 400Gbps:5us] [--node-network 900GB/s:1us] [--compute-ms 12]

For every layout and world size, one training step of the recipe's model runs on fake tensors and torch's fake
process group as rank 0 of that many ranks (fake_step.py): the per-rank peak by part, and the collectives the
strategy issued. Micro-batches: activations and temporaries grow in proportion to the micro-batch, the model state
does not, so the largest micro-batch that fits --device-memory follows from one step. Step time: the compute time
of one step (measured here on the recipe's batch, or --compute-ms for the target device) plus the collectives
over the links: within a node --node-network, between nodes --network (bandwidth as a ring moves the bytes,
latency as a tree does). docs/planning.md has the method, its limits and how it was checked.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from torchyard.trainer.cli.recipe import Recipe, load_recipe
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.runs import next_version
from torchyard.trainer.scaling.fake_step import (
    Collective,
    StepMemory,
    fake_process_group,
    resize_batch,
    run_step,
    sample_batch,
    time_steps,
)
from torchyard.trainer.scaling.measure import fits_here, measure_layout
from torchyard.trainer.scaling.plan_report import PlanRow
from torchyard.trainer.scaling.study import Variant, parse_counts, parse_variants
from torchyard.trainer.strategies import build_strategy

BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
BANDWIDTH_UNITS = {"bps": 1 / 8, "Kbps": 1e3 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8, "Tbps": 1e12 / 8,
                   "B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "GiB/s": 2**30}
LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")
DEFAULT_NETWORK = "400Gbps:5us"  # one 400 Gb/s NIC per device between nodes (InfiniBand NDR, RoCE)
DEFAULT_NODE_NETWORK = "900GB/s:1us"  # within a node (NVLink 4 on an H100 board)


@dataclasses.dataclass(frozen=True)
class Link:
    """A network path: bytes per second each way for one rank, and the latency of one message."""

    bandwidth: float
    latency: float

    def describe(self) -> str:
        return f"{self.bandwidth * 8 / 1e9:g} Gb/s, {self.latency * 1e6:g} us"


@dataclasses.dataclass
class PlanInputs:
    """Everything `trainer plan` checked before the first step runs."""

    recipe: Recipe
    layouts: list[Variant]
    shapes: list[tuple[int, int]]  # (nodes, ranks per node)
    device_memory: int | None
    network: Link
    node_network: Link
    compute_ms: float | None
    root: Path
    sources: list[str]
    measure: bool = False


# --------------------------------------------------------------------------- input


def parse_quantity(text: str, units: dict[str, float], flag: str, example: str, given: str | None = None) -> float:
    """The number times its unit, from '80GB'; a one-line error naming the units for anything else (quoting
    `given`, the whole flag's value, where `text` is part of it)."""
    match = QUANTITY.match(text)
    unit = match.group(2) if match else ""
    if match is None or unit not in units:
        problem = f"unknown unit {unit!r}" if match else "not a number with a unit"
        raise MisconfigurationError(f"{flag} {given or repr(text)}: {problem}; use one of {', '.join(units)}, "
                                    f"e.g. {flag} {example}.")
    return float(match.group(1)) * units[unit]


def parse_bytes(text: str, flag: str = "--device-memory") -> int:
    """Bytes from '80GB' (decimal) or '80GiB' (binary)."""
    return int(parse_quantity(text, BYTE_UNITS, flag, "80GB"))


def parse_link(text: str, flag: str) -> Link:
    """A Link from 'BANDWIDTH:LATENCY', e.g. '400Gbps:5us' or '900GB/s:1us'."""
    bandwidth, found, latency = text.partition(":")
    if not found:
        raise MisconfigurationError(f"{flag} {text!r}: give BANDWIDTH:LATENCY, e.g. {flag} 400Gbps:5us.")
    link = Link(parse_quantity(bandwidth, BANDWIDTH_UNITS, flag, "400Gbps:5us", repr(text)),
                parse_quantity(latency, LATENCY_UNITS, flag, "400Gbps:5us", repr(text)))
    if link.bandwidth <= 0:
        raise MisconfigurationError(f"{flag} {text!r}: the bandwidth must be above 0.")
    return link


def parse_layouts(text: str) -> list[Variant]:
    """Variants as `trainer scale --variants` spells them, each a strategy that can be planned on fake tensors."""
    try:
        variants = parse_variants(text)
    except MisconfigurationError as err:  # its messages name scale's flag
        raise MisconfigurationError(str(err).replace("--variants", "--layouts")) from err
    for variant in variants:
        strategy = build_strategy(variant.strategy)
        if not strategy.plannable:
            raise MisconfigurationError(
                f"--layouts {variant.label!r}: strategy {strategy.name!r} cannot be planned on fake tensors yet "
                "(docs/planning.md says why); plan single, ddp or fsdp.")
    return variants


def layout_shapes(counts: list[int], nodes: list[int]) -> list[tuple[int, int]]:
    """(nodes, per node) for every count spread over every node count dividing it; a count none divides is an
    error."""
    shapes = []
    for count in counts:
        spread = [(node_count, count // node_count) for node_count in nodes if count % node_count == 0]
        if not spread:
            raise MisconfigurationError(f"--devices {count} cannot be spread evenly over --nodes "
                                        f"{','.join(map(str, nodes))}; give node counts that divide it.")
        shapes += spread
    return shapes


def check_layouts(recipe: Recipe, layouts: list[Variant], shapes: list[tuple[int, int]]) -> None:
    """Each layout configured at each shape as a Trainer would (a strategy that cannot divide the world, single on
    several ranks): the strategy's own one-line error, before any step runs."""
    for variant in layouts:
        for nodes, per_node in shapes:
            strategy = build_strategy(variant.strategy, nodes * per_node)
            try:
                strategy.configure("cpu", per_node, nodes, str(recipe.trainer.precision))
            except MisconfigurationError as err:
                raise MisconfigurationError(f"--layouts {variant.label} at {nodes}x{per_node}: {err}") from err


def plan_inputs(sources: Sequence[str], devices: str, nodes: str, layouts: str, device_memory: str | None,
                network: str, node_network: str, compute_ms: float | None, measure: bool = False) -> PlanInputs:
    """Check every input and load the recipe; nothing runs here."""
    memory = parse_bytes(device_memory) if device_memory is not None else None
    links = parse_link(network, "--network"), parse_link(node_network, "--node-network")
    if compute_ms is not None and not compute_ms > 0:
        raise MisconfigurationError(f"--compute-ms {compute_ms} must be above 0 (milliseconds of one step).")
    shapes = layout_shapes(parse_counts(devices, "--devices"), parse_counts(nodes, "--nodes"))
    variants = parse_layouts(layouts)
    recipe = load_recipe(list(sources))
    check_layouts(recipe, variants, shapes)
    base = Path(recipe.trainer.default_root_dir) / f"plan_{recipe.trainer.name}"
    root = base / f"version_{next_version(base.parent, base.name)}"
    return PlanInputs(recipe, variants, shapes, memory, *links, compute_ms, root, list(sources), measure)


# --------------------------------------------------------------------------- the model of a step


def collective_seconds(collective: Collective, link: Link) -> float:
    """Bandwidth as a ring moves the bytes (all-reduce: 2(n-1)/n of them per rank; all-gather and reduce-scatter of
    the full tensor: (n-1)/n), latency as a tree (log2 n hops each way), as NCCL picks per message size."""
    ranks = collective.group_size
    if ranks <= 1:
        return 0.0
    hops = math.ceil(math.log2(ranks))
    if collective.op.startswith("allreduce"):
        moved, hops = 2 * (ranks - 1) / ranks, 2 * hops
    elif "gather" in collective.op or "scatter" in collective.op or "alltoall" in collective.op:
        moved = (ranks - 1) / ranks
    else:  # broadcast, send/recv: the tensor once
        moved = 1.0
    return moved * collective.bytes / link.bandwidth + hops * link.latency


def plan_row(inputs: PlanInputs, variant: Variant, nodes: int, per_node: int, batch: Any, micro_batch: int,
             compute_ms: float) -> PlanRow:
    """One layout at one shape: the fake step, the micro-batch that fits, the step time over the links."""
    world = nodes * per_node
    with fake_process_group(world):
        record = run_step(inputs.recipe, variant.strategy, world, 0, batch)
    link = inputs.network if nodes > 1 else inputs.node_network
    comm_ms = 1000 * sum(collective_seconds(c, link) for c in record.collectives)
    step_ms = compute_ms + comm_ms
    return PlanRow(
        layout=variant.label, nodes=nodes, per_node=per_node, micro_batch=micro_batch, memory=record.memory,
        largest_micro_batch=largest_micro_batch(record.memory, micro_batch, inputs.device_memory),
        compute_ms=compute_ms, communication_ms=comm_ms,
        communication_mb=sum(c.bytes for c in record.collectives) / 2**20, collectives=len(record.collectives),
        samples_per_s=1000 * world * micro_batch / step_ms)


def largest_micro_batch(memory: StepMemory, micro_batch: int, device_memory: int | None) -> int | None:
    """The most samples per rank whose peak fits `device_memory`: the model state stays, activations and
    temporaries scale with the micro-batch. None without --device-memory; 0 when not even the state fits."""
    if device_memory is None:
        return None
    per_sample = (memory.activations + memory.temporaries) / micro_batch
    room = device_memory - memory.model_state
    if room <= 0:
        return 0
    return int(room // per_sample) if per_sample > 0 else micro_batch


def make_plan(inputs: PlanInputs, progress: Any = None) -> list[PlanRow]:
    """Every layout at every shape, rank 0's view of each; the one-process row first, as the reference."""
    batch = sample_batch(inputs.recipe)
    micro_batch = int(next(t for t in _tensors(batch)).shape[0])
    compute_ms = inputs.compute_ms if inputs.compute_ms is not None else 1000 * time_steps(inputs.recipe, batch)
    baseline = Variant("single", {"name": "single"})
    rows = []
    for variant, (nodes, per_node) in [(baseline, (1, 1))] + [(v, s) for v in inputs.layouts for s in inputs.shapes]:
        if progress is not None:
            progress(f"{nodes}x{per_node} {variant.label}")
        rows.append(plan_row(inputs, variant, nodes, per_node, resize_batch(batch, micro_batch), micro_batch,
                             compute_ms))
        if inputs.measure and fits_here(nodes * per_node):
            if progress is not None:
                progress(f"measuring {nodes}x{per_node} {variant.label} on {nodes * per_node} process(es)")
            rows[-1].measured = measure_layout(inputs.sources, variant.strategy, nodes * per_node)[0]
    return rows


def plan_title(inputs: PlanInputs) -> str:
    """What the plan assumed, for the table's title and the PNG's."""
    memory = f", device memory {inputs.device_memory / 1e9:g} GB" if inputs.device_memory else ""
    compute = "given" if inputs.compute_ms is not None else "measured here"
    return (f"{inputs.recipe.trainer.name}: rank 0's view, network between nodes {inputs.network.describe()}, within "
            f"a node {inputs.node_network.describe()}, compute {compute}{memory}")


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
