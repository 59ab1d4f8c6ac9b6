"""`trainer plot`: the logged metrics of one or more runs, one panel per metric, one line per run."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.evaluations import EVALUATOR_METRICS_FILE

# Columns of metrics.csv that are coordinates, not metrics.
NOT_METRICS = ("step", "epoch")
PANEL_SIZE = (4.8, 3.2)  # inches per panel
DPI = 100
MAX_COLUMNS = 3


def find_metrics_file(run_dir: str | Path) -> Path:
    """metrics.csv of a version folder; for a run-name folder, that of its newest version."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.csv").is_file():
        return run_dir / "metrics.csv"
    versions = sorted(run_dir.glob("version_*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if versions:
        return versions[-1]
    raise MisconfigurationError(
        f"{str(run_dir)!r} holds no metrics.csv; pass a run folder such as runs/digits/version_0."
    )


def read_metrics(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} from a CSV logger file, skipping the rows where a metric is empty."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                step = int(float(row["step"]))
                for name, text in row.items():
                    if name in NOT_METRICS or text in ("", None):
                        continue
                    steps, values = series.setdefault(name, ([], []))
                    steps.append(step)
                    values.append(float(text))
    except UnicodeDecodeError as err:  # read in blocks: the line it counted may not be the bad one
        raise MisconfigurationError(f"{path} is not a metrics.csv the CSV logger wrote (not UTF-8 text).") from err
    except (ValueError, KeyError, TypeError) as err:
        detail = "no 'step' column" if isinstance(err, KeyError) else f"line {reader.line_num}: {err}"
        raise MisconfigurationError(f"{path} is not a metrics.csv the CSV logger wrote ({detail}).") from err
    return series


def read_run(metrics_file: Path) -> dict[str, tuple[list[int], list[float]]]:
    """read_metrics of a run's metrics.csv, with the rows of its evaluator side process merged in by step: they
    stand for the run's validation (other evaluations of the run, metrics_<stage>.csv, are not drawn)."""
    series = read_metrics(metrics_file)
    evaluated = metrics_file.with_name(EVALUATOR_METRICS_FILE)
    if not evaluated.is_file():
        return series
    for name, (steps, values) in read_metrics(evaluated).items():
        old_steps, old_values = series.get(name, ([], []))
        merged = sorted(zip(old_steps + steps, old_values + values), key=lambda pair: pair[0])
        series[name] = ([step for step, _ in merged], [value for _, value in merged])
    return series


def panel_grid(count: int) -> tuple[int, int]:
    """(rows, columns) of the figure for `count` panels."""
    columns = min(MAX_COLUMNS, max(count, 1))
    return math.ceil(max(count, 1) / columns), columns


def output_file(output: str | Path, formats: Sequence[str]) -> Path:
    """The file to write: `output`, `<output>.png` without a suffix, `<output>/curves.png` for a folder;
    a format matplotlib cannot write is refused before anything is drawn."""
    path = Path(output)
    if path.is_dir():
        return path / "curves.png"
    if not path.suffix:
        return path.with_name(path.name + ".png")
    if path.suffix[1:].lower() not in formats:
        raise MisconfigurationError(f"-o {str(path)!r}: matplotlib cannot write {path.suffix!r} files; use one of "
                                    f"{', '.join('.' + f for f in sorted(formats))}.")
    return path


def pyplot(needed_by: str) -> Any:
    """matplotlib.pyplot on its file-only backend, or a one-line error naming what `needed_by` needs installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise MisconfigurationError(
            f"{needed_by} needs matplotlib: pip install 'torchyard[plot]' (or pip install matplotlib)."
        ) from err
    return plt


def save_figure(figure: Any, output: Path, header: str) -> Path:
    """Title `figure` with `header`, lay it out, write it to `output` and free it; returns `output`."""
    figure.suptitle(header, fontsize="small")
    figure.tight_layout()
    try:
        figure.savefig(output)
    finally:
        pyplot("a figure").close(figure)
    return output


def plot_runs(run_dirs: Sequence[str | Path], output: str | Path) -> Path:
    """Draw every metric of every run to an image at `output` (a PNG unless its suffix says otherwise);
    returns the path written."""
    plt = pyplot("trainer plot")
    from matplotlib.backend_bases import FigureCanvasBase

    output = output_file(output, list(FigureCanvasBase.get_supported_filetypes()))
    runs = {str(run_dir): read_run(find_metrics_file(run_dir)) for run_dir in run_dirs}
    metrics = sorted({name for series in runs.values() for name in series})
    if not metrics:
        raise MisconfigurationError(
            f"no metrics logged yet in {', '.join(runs)}; plot after a run has logged some steps."
        )
    rows, columns = panel_grid(len(metrics))
    figure, axes = plt.subplots(rows, columns, figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows),
                                dpi=DPI, squeeze=False)
    for axis, metric in zip(axes.flat, metrics):
        for label, series in runs.items():
            if metric in series:
                steps, values = series[metric]
                axis.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
        axis.set_title(metric)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if len(runs) > 1:
            axis.legend(fontsize="small")
    for axis in list(axes.flat)[len(metrics):]:
        axis.set_visible(False)
    figure.tight_layout()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(output)
    except OSError as err:
        raise MisconfigurationError(f"cannot write {str(output)!r}: {err.strerror or err}.") from err
    finally:
        plt.close(figure)
    return output
