"""The report of `trainer plan`, in the style of `trainer scale`'s (report.py): one row per layout and world size,
a rich table, plan.md / plan.json and plan.png (per-rank memory by part; samples/s and scaling efficiency against
the world size, scale-up and scale-out apart)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.plot import pyplot, save_figure
from torchyard.trainer.logs.runs import atomic_write_text
from torchyard.trainer.scaling.fake_step import StepMemory
from torchyard.trainer.scaling.report import markdown, rich_table

MIB = 2**20
PART_COLORS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer": "tab:green",
               "activations": "tab:red", "temporaries": "tab:gray"}


@dataclasses.dataclass
class PlanRow:
    """One layout at one world size, as rank 0 of it sees the step."""

    layout: str
    nodes: int
    per_node: int
    micro_batch: int
    memory: StepMemory
    largest_micro_batch: int | None
    compute_ms: float
    communication_ms: float
    communication_mb: float
    collectives: int
    samples_per_s: float
    efficiency: float = math.nan
    measured: dict[str, int] | None = None  # --measure: rank 0's parts from a real run here, in bytes

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node} {self.layout}"

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.communication_ms


def add_efficiency(rows: list[PlanRow]) -> None:
    """Samples/s per rank against the one-process row's."""
    baseline = next((row for row in rows if row.ranks == 1), None)
    for row in rows:
        if baseline is not None:
            row.efficiency = row.samples_per_s / (row.ranks * baseline.samples_per_s)


COLUMNS = ("layout", "ranks", f"params {'MiB'}", "grads MiB", "optimizer MiB", "activations MiB", "temporaries MiB",
           "peak MiB/rank", "largest micro-batch", "compute ms", "comm ms", "comm MiB/step", "samples/s", "efficiency")


def cells(row: PlanRow) -> list[str]:
    memory = row.memory
    fits = "-" if row.largest_micro_batch is None else (
        f"{row.largest_micro_batch:,}" if row.largest_micro_batch else "does not fit")
    return [row.label, f"{row.ranks:,}", *(f"{getattr(memory, part) / MIB:,.1f}" for part in PART_COLORS),
            f"{memory.total / MIB:,.1f}", fits, f"{row.compute_ms:.1f}", f"{row.communication_ms:.2f}",
            f"{row.communication_mb:,.1f}", f"{row.samples_per_s:,.0f}",
            "-" if math.isnan(row.efficiency) else f"{100 * row.efficiency:.0f}%"]


def write_plan(rows: list[PlanRow], root: Path, console: Console, header: str) -> Path:
    """Print the table; write plan.md, plan.json and plan.png (when matplotlib is there) to `root`."""
    add_efficiency(rows)
    table = rich_table(f"trainer plan: {header}", COLUMNS)
    for row in rows:
        table.add_row(*cells(row), style="red" if row.largest_micro_batch == 0 else None)
    console.print(table)
    compared = measured_table(rows)
    if compared:
        console.print(compared)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / "plan.md", f"{header}\n\n{markdown(COLUMNS, map(cells, rows))}\n{measured_markdown(rows)}")
    atomic_write_text(root / "plan.json", json.dumps([row_json(row) for row in rows], indent=1))
    try:
        console.print(f"wrote {draw_plan(rows, root / 'plan.png', header)}, plan.md and plan.json in {root}")
    except MisconfigurationError as err:
        console.print(f"no PNG: {err}")
    return root


MEASURED_COLUMNS = ("layout", *PART_COLORS, "sum of the parts")


def measured_cells(row: PlanRow) -> list[str]:
    """Each part as 'predicted / measured MiB (error)', rank 0, for a row measured with --measure."""
    assert row.measured is not None
    pairs = [(getattr(row.memory, part), row.measured[part]) for part in PART_COLORS]
    pairs.append((sum(p for p, _ in pairs), sum(m for _, m in pairs)))
    return [row.label, *(f"{p / MIB:.2f} / {m / MIB:.2f}" + (f" ({100 * (p - m) / m:+.0f}%)" if m else "")
                         for p, m in pairs)]


def measured_table(rows: list[PlanRow]) -> Table | None:
    """Predicted / measured per part, for the rows --measure ran; None when it ran none."""
    measured = [row for row in rows if row.measured is not None]
    if not measured:
        return None
    table = rich_table("predicted / measured MiB per part, rank 0 (--measure: real gloo runs here)", MEASURED_COLUMNS)
    for row in measured:
        table.add_row(*measured_cells(row))
    return table


def measured_markdown(rows: list[PlanRow]) -> str:
    measured = [row for row in rows if row.measured is not None]
    if not measured:
        return ""
    return "predicted / measured MiB per part, rank 0:\n\n" + markdown(MEASURED_COLUMNS, map(measured_cells, measured))


def row_json(row: PlanRow) -> dict[str, Any]:
    data = dataclasses.asdict(row)
    data.update(ranks=row.ranks, step_ms=row.step_ms, peak_bytes=row.memory.total)
    return data


def draw_plan(rows: list[PlanRow], output: Path, header: str) -> Path:
    """Two panels: per-rank memory by part (one bar per layout and size), samples/s against ranks per layout."""
    plt = pyplot("the PNG")
    figure, (memory, speed) = plt.subplots(1, 2, figsize=(15, 5), dpi=80)
    labels = [row.label.replace(" ", "\n", 1).replace(":", "\n") for row in rows]
    bottom = [0.0] * len(rows)
    for part, color in PART_COLORS.items():
        values = [getattr(row.memory, part) / MIB for row in rows]
        memory.bar(labels, values, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    memory.set_title("predicted peak memory per rank (MiB)")
    memory.legend(fontsize="x-small")
    memory.tick_params(axis="x", labelsize="x-small")
    for (layout, scale_out), group in _series(rows).items():
        where = "across nodes" if scale_out else "one node"
        line = speed.plot([r.ranks for r in group], [r.samples_per_s for r in group], marker="o",
                          linestyle="--" if scale_out else "-", label=f"{layout} ({where})")
        for row in group:
            if not math.isnan(row.efficiency):
                speed.annotate(f"{100 * row.efficiency:.0f}%", (row.ranks, row.samples_per_s), fontsize="x-small",
                               color=line[0].get_color(), textcoords="offset points", xytext=(3, 3))
    speed.set_xscale("log", base=2)
    speed.set_yscale("log")
    speed.set_title("predicted samples/s (scaling efficiency)")
    speed.set_xlabel("ranks")
    speed.legend(fontsize="x-small")
    for axis in (memory, speed):
        axis.grid(alpha=0.3)
    return save_figure(figure, output, header)


def _series(rows: list[PlanRow]) -> dict[tuple[str, bool], list[PlanRow]]:
    """Rows by layout and by whether they span nodes, each in order of ranks (the one-process row starts each)."""
    series: dict[tuple[str, bool], list[PlanRow]] = {}
    baseline = [row for row in rows if row.ranks == 1]
    for row in rows:
        if row.ranks > 1:
            series.setdefault((row.layout, row.nodes > 1), list(baseline)).append(row)
    return {key: sorted(group, key=lambda r: r.ranks) for key, group in series.items()}
