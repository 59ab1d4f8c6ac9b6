"""What the evaluator side process found, as files in the run: which checkpoint scored what (evaluations.json in
the run folder), and the marker a fit leaves in its checkpoint folder once no more checkpoints will come.

Both are small JSON files written through a temporary file and a rename, so a reader (EarlyStopping, ModelCheckpoint,
another evaluator) never sees half of one. This module is the only one that knows their layout.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchyard.trainer.logs.runs import atomic_write_text

RECORD_FILE = "evaluations.json"
# The evaluator's metric rows, beside the run's metrics.csv (which the training owns while it runs): CSVLogger's
# file for an evaluation logged into the run it evaluates, metrics_<stage>.csv, under the stage "evaluator".
EVALUATOR_STAGE = "evaluator"
EVALUATOR_METRICS_FILE = f"metrics_{EVALUATOR_STAGE}.csv"
ENDED_FILE = "training_ended.json"
RECORD_VERSION = 1
SCORED, DELETED, SKIPPED = "scored", "deleted", "skipped"


@dataclass
class Evaluation:
    """One training state the evaluator saw: the checkpoint files that held it and what it scored."""

    step: int  # the loggers' step when it was saved (batches that stepped): the x of its metrics rows
    global_step: int  # optimizer steps taken
    epoch: int
    checkpoints: list[str]  # file names in the checkpoint folder that held this state (last.ckpt may be one)
    status: str = SCORED  # or DELETED: removed (top-k) before the evaluator got to it; SKIPPED: every_n left it out
    metrics: dict[str, float] = field(default_factory=dict)


def record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / RECORD_FILE


def read_record(run_dir: str | Path) -> list[Evaluation]:
    """The evaluations recorded in `run_dir`, by step; none where the evaluator has written nothing yet."""
    path = record_path(run_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    return sorted((Evaluation(**entry) for entry in data.get("evaluations", [])), key=lambda e: e.step)


def write_record(run_dir: str | Path, evaluations: list[Evaluation]) -> None:
    """Replace the record in `run_dir` with `evaluations` (atomically)."""
    entries = [asdict(evaluation) for evaluation in sorted(evaluations, key=lambda e: e.step)]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(record_path(run_dir), json.dumps({"version": RECORD_VERSION, "evaluations": entries}, indent=1))


def scores(evaluations: list[Evaluation], monitor: str) -> list[tuple[int, float]]:
    """(step, value of `monitor`) of every scored evaluation that logged it, by step."""
    return [(e.step, e.metrics[monitor]) for e in evaluations if e.status == SCORED and monitor in e.metrics]


def best_evaluation(evaluations: list[Evaluation], monitor: str, mode: str) -> Evaluation | None:
    """The scored evaluation with the best finite `monitor` ('min' or 'max'); the earliest among equals."""
    candidates = [e for e in evaluations if e.status == SCORED and math.isfinite(e.metrics.get(monitor, math.nan))]
    if not candidates:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(candidates, key=lambda e: (sign * e.metrics[monitor], e.step))


def mark_training_ended(checkpoint_dir: str | Path, global_step: int) -> None:
    """Say, in the checkpoint folder, that the fit writing there has ended: no more checkpoints will come. A fit
    that wrote no checkpoint (no folder) leaves none: there is nothing to evaluate, and no folder to create."""
    folder = Path(checkpoint_dir)
    if folder.is_dir():
        atomic_write_text(folder / ENDED_FILE, json.dumps({"global_step": global_step}))


def clear_training_ended(checkpoint_dir: str | Path) -> None:
    """A fit (or a resumed one) starts writing to the folder again."""
    (Path(checkpoint_dir) / ENDED_FILE).unlink(missing_ok=True)


def training_ended(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """What the ended fit left (its global step), or None while a fit writes there or none has ended."""
    try:
        return json.loads((Path(checkpoint_dir) / ENDED_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
