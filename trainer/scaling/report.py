"""The report of a `trainer scale` study: one row per run, a rich table, runs.md / runs.json, scale.png, and the
verdict naming the fastest layout and why."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.plot import pyplot, save_figure
from torchyard.trainer.logs.runs import atomic_write_text

MB = "MiB"


@dataclasses.dataclass
class Row:
    """One run of the study; `error` set (and the numbers NaN) where it failed."""

    label: str
    nodes: int
    per_node: int
    variant: str
    samples_per_s: float = math.nan
    speedup: float = math.nan
    efficiency: float = math.nan
    epoch_s: float = math.nan
    compute_ms: float = math.nan
    communication_ms: float = math.nan  # the wait in collectives, as the step pays it
    imbalance_ms: float = math.nan  # the part of communication_ms spent waiting for slower ranks to arrive
    data_ms: float = math.nan
    peak_memory_mb: list[float] = dataclasses.field(default_factory=list)
    target_s: float | None = None
    target_epochs: float | None = None
    run_seconds: float = math.nan
    error: str | None = None

    @property
    def processes(self) -> int:
        return self.nodes * self.per_node

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.communication_ms + self.data_ms


def row_from_timing(label: str, nodes: int, per_node: int, variant: str, timing: dict[str, Any],
                    seconds: float) -> Row:
    """A row from StepTiming's JSON: throughput over every rank's samples, per-step means over the ranks."""
    ranks = timing["ranks"]
    steps = [rank["steps"] for rank in ranks]
    if min(steps) == 0:
        return Row(label, nodes, per_node, variant, run_seconds=seconds,
                   error="no step was measured after the warm-up: give more --steps or --epochs")
    wall = max(rank["wall_s"] for rank in ranks)

    def per_step_ms(key: str) -> float:
        return 1000 * sum(rank[key] / rank["steps"] for rank in ranks) / len(ranks)

    step_ms, wait_ms, data_ms = per_step_ms("step_s"), per_step_ms("communication_s"), per_step_ms("data_wait_s")
    transfer_ms = per_step_ms("transfer_s")  # the same on every rank
    reached = timing.get("target")
    return Row(
        label, nodes, per_node, variant,
        samples_per_s=sum(rank["samples"] for rank in ranks) / wall if wall > 0 else math.nan,
        epoch_s=(step_ms + data_ms) / 1000 * timing["steps_per_epoch"],
        compute_ms=step_ms - wait_ms, communication_ms=wait_ms, imbalance_ms=wait_ms - transfer_ms, data_ms=data_ms,
        peak_memory_mb=[rank["peak_memory_mb"] for rank in ranks],
        target_s=reached["seconds"] if reached else None, target_epochs=reached["epochs"] if reached else None,
        run_seconds=seconds,
    )


def add_speedups(rows: list[Row]) -> None:
    """Speed-up against the one-process row, and efficiency (speed-up per process)."""
    baseline = next((row for row in rows if row.processes == 1 and row.error is None), None)
    for row in rows:
        if baseline is not None and row.error is None:
            row.speedup = row.samples_per_s / baseline.samples_per_s
            row.efficiency = row.speedup / row.processes


def verdict(rows: list[Row], by_target: bool) -> str:
    """Which layout is fastest, and why, in a few sentences."""
    done = [row for row in rows if row.error is None]
    if by_target:
        done = [row for row in done if row.target_s is not None]
        if not done:
            return "No layout reached the target."
    if not done:
        return "Every run failed; see the error column and each run's node*.log."
    best = min(done, key=lambda r: r.target_s) if by_target else max(done, key=lambda r: r.samples_per_s)
    lines = [f"Fastest: {best.label} ({best.processes} process(es) on {best.nodes} node(s)) at "
             f"{best.samples_per_s:,.0f} samples/s, {best.speedup:.2f}x one process"
             + (f", reaching the target in {best.target_s:.1f} s" if by_target else "") + "."]
    baseline = next((row for row in done if row.processes == 1), None)
    widest = max(done, key=lambda r: (r.processes, r.step_ms))
    explained = [row for row in (best, widest) if row.processes > 1]
    if best.processes == 1:  # why did no multi-process layout win?
        multi = [row for row in done if row.processes > 1]
        explained = [max(multi, key=lambda r: r.samples_per_s)] if multi else []
    for row in dict((id(row), row) for row in explained).values():
        lines.append(explain_step(row, baseline))
    return " ".join(lines)


def explain_step(row: Row, baseline: Row | None) -> str:
    """Where the step time of a multi-process row goes, against the one-process step."""
    share = 100 * row.communication_ms / row.step_ms if row.step_ms > 0 else math.nan
    text = (f"At {row.label} a step takes {row.step_ms:.1f} ms: communication is {share:.0f}% of it "
            f"({row.communication_ms:.1f} ms, of which {row.imbalance_ms:.1f} ms waiting for slower ranks), data wait "
            f"{row.data_ms:.1f} ms, compute {row.compute_ms:.1f} ms")
    if baseline is not None and baseline.compute_ms > 0:
        ratio = row.compute_ms / baseline.compute_ms
        text += f" ({ratio:.1f}x one process's {baseline.compute_ms:.1f} ms"
        text += ": the processes compete for cores)" if ratio > 1.3 else ")"
    return text + f"; efficiency {100 * row.efficiency:.0f}%."


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


TABLE_COLUMNS = ("layout", "procs", "samples/s", "speed-up", "efficiency", "s/epoch", "compute ms", "comm ms",
                 "of which rank wait ms", "data ms", f"peak {MB}/rank", "s to target", "epochs to target", "error")
TARGET_COLUMNS = ("s to target", "epochs to target")


def table_cells(row: Row) -> list[str]:
    """The row as the table's strings."""
    peak = _number(max(row.peak_memory_mb), ".0f") if row.peak_memory_mb else "-"
    return [row.label, str(row.processes), _number(row.samples_per_s, ",.0f"), _number(row.speedup, ".2f"),
            _number(100 * row.efficiency, ".0f") + ("%" if not math.isnan(row.efficiency) else ""),
            _number(row.epoch_s, ".2f"), _number(row.compute_ms, ".1f"), _number(row.communication_ms, ".1f"),
            _number(row.imbalance_ms, ".1f"), _number(row.data_ms, ".1f"), peak, _number(row.target_s, ".1f"),
            _number(row.target_epochs, ".2f"), row.error or ""]


def shown_columns(rows: list[Row], by_target: bool) -> list[int]:
    """Indexes of the columns worth showing: the target's only with a target, the error's only with a failure."""
    hidden = set(TARGET_COLUMNS if not by_target else ()) | ({"error"} if all(r.error is None for r in rows) else set())
    return [index for index, column in enumerate(TABLE_COLUMNS) if column not in hidden]


def markdown(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table of `rows` of cells; a '|' inside a cell is written '/' so that it does not split the cell."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def rich_table(title: str, columns: Sequence[str], wrapped: Sequence[str] = ()) -> Table:
    """A report's rich table: the layout (and `wrapped`) columns left-aligned, numbers right; only `wrapped` wrap."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="left" if column in ("layout", *wrapped) else "right",
                         no_wrap=column not in wrapped)
    return table


def markdown_table(rows: list[Row], columns: list[int]) -> str:
    return markdown([TABLE_COLUMNS[i] for i in columns],
                    ([cells[i] for i in columns] for cells in map(table_cells, rows)))


def write_study(rows: list[Row], root: Path, console: Console, header: str, by_target: bool) -> Path:
    """Print the table and verdict; write runs.md, runs.json and scale.png (when matplotlib is there) to `root`."""
    add_speedups(rows)
    columns = shown_columns(rows, by_target)
    table = rich_table(f"trainer scale: {header}", [TABLE_COLUMNS[i] for i in columns], wrapped=("error",))
    for row in rows:
        cells = table_cells(row)
        table.add_row(*(cells[i] for i in columns), style="red" if row.error else None)
    console.print(table)
    summary = verdict(rows, by_target)
    console.print(summary)
    atomic_write_text(root / "runs.md", f"{header}\n\n{markdown_table(rows, columns)}\n{summary}\n")
    atomic_write_text(root / "runs.json", json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    try:
        png = draw_study(rows, root / "scale.png", header)
        console.print(f"wrote {png}, runs.md and runs.json in {root}")
    except MisconfigurationError as err:
        console.print(f"no PNG: {err}")
    return root


def draw_study(rows: list[Row], output: Path, header: str) -> Path:
    """Three panels: samples/s with speed-up, the step split (compute / communication / data wait), peak memory."""
    plt = pyplot("the PNG")
    done = [row for row in rows if row.error is None]
    labels = [row.label.replace(" ", "\n", 1).replace(":", "\n") for row in done]  # narrow enough not to overlap
    reached = any(row.target_s is not None for row in done)
    figure, axes = plt.subplots(1, 4 if reached else 3, figsize=(20 if reached else 15, 4.6), dpi=80)
    speed, split, memory = axes[:3]
    bars = speed.bar(labels, [row.samples_per_s for row in done], color="tab:blue")
    for bar, row in zip(bars, done):
        speed.annotate(f"{row.speedup:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize="small")
    speed.set_title("samples/s (speed-up vs 1 process)")
    bottom = [0.0] * len(done)
    # communication_ms holds imbalance_ms: the red bar is the transfer, the orange one the wait for slower ranks
    for name, values, color in (
            ("compute", [row.compute_ms for row in done], "tab:green"),
            ("communication: transfer", [row.communication_ms - row.imbalance_ms for row in done], "tab:red"),
            ("communication: waiting for slower ranks", [row.imbalance_ms for row in done], "tab:orange"),
            ("data wait", [row.data_ms for row in done], "tab:gray")):
        split.bar(labels, values, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    split.set_title("time per step (ms), mean over ranks")
    split.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    memory.bar(labels, [max(row.peak_memory_mb) for row in done], color="tab:purple")
    memory.set_title(f"peak memory per rank ({MB}, highest rank)")
    if reached:
        axes[3].bar(labels, [row.target_s if row.target_s is not None else 0.0 for row in done], color="tab:olive")
        axes[3].set_title("seconds of training to the target (0: not reached)")
    for axis in axes:
        axis.tick_params(axis="x", labelsize="small" if len(done) <= 5 else "x-small")
        axis.grid(axis="y", alpha=0.3)
    return save_figure(figure, output, header)
