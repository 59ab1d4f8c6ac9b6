"""`trainer scale`: one recipe measured at several layouts of processes, scale-up against scale-out.

    trainer scale RECIPE [...] --devices 1,2,4 [--nodes 1,2] [--steps S | --epochs E] [--target val/acc=0.97]
                  [--variants ddp,ddp:sync_every=8]

--devices lists total process counts; --nodes the node counts to spread each over. A count N on M nodes (M dividing
N) is the layout MxN/M: 1x2 puts both processes on one node (scale-up), 2x1 one on each of two nodes (scale-out).
Each node of a layout is its own torch elastic agent (`torchrun --nnodes M --node-rank i`) meeting the others
through the static rendezvous at 127.0.0.1, so the processes of a simulated node share a node rank and a
LOCAL_RANK numbering, as on a cluster. The one-process baseline runs the recipe with strategy 'single'.

Every run is a short fit in a folder of its own (<default_root_dir>/scale_<name>/version_<n>/<layout>/), measured
by the StepTiming callback after a warm-up; runs.md / runs.json / scale.png there hold the study (scale_report.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from torchyard.callbacks.step_timing import parse_target
from torchyard.trainer.cli.recipe import Recipe, load_recipe
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.runs import next_version
from torchyard.trainer.scaling.report import Row, row_from_timing, write_study
from torchyard.trainer.strategies import build_strategy
from torchyard.trainer.strategies.base import resolve_accelerator

DEFAULT_STEPS = 30
RAISED = re.compile(r"\b\w*(Error|Exception)\b:")  # an exception's last traceback line, e.g. "RuntimeError: ..."
# Strategies whose gradient all-reduce StepTiming can time (their `time_communication` option).
TIMED_STRATEGIES = ("ddp",)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of training at each layout: a strategy name with options, as `ddp:sync_every=8` spells it."""

    label: str
    strategy: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Layout:
    """`nodes` simulated nodes with `per_node` processes each, trained with `variant` (None: the baseline)."""

    nodes: int
    per_node: int
    variant: Variant | None

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node} {self.variant.label if self.variant else 'single'}"

    @property
    def folder_name(self) -> str:
        return self.label.replace(" ", "_").replace(":", "-").replace("/", "-")


@dataclasses.dataclass
class StudyPlan:
    """Everything checked before the first run starts."""

    sources: list[str]
    recipe: Recipe
    layouts: list[Layout]
    accelerator: str
    steps: int | None
    epochs: int | None
    target: str | None
    warmup_steps: int
    timeout_s: float
    root: Path


def parse_counts(text: str, flag: str) -> list[int]:
    """[1, 2, 4] from '1,2,4'; a one-line error for anything but positive integers."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise MisconfigurationError(f"{flag} {text!r} must list positive integers, e.g. {flag} 1,2,4.")
    return counts


def parse_variants(text: str) -> list[Variant]:
    """[Variant('ddp', ...), Variant('ddp:sync_every=8', ...)] from 'ddp,ddp:sync_every=8'; each one built once
    here, so an unknown strategy or option (sync_every=0) is an error before any run."""
    variants = []
    for spec in (part.strip() for part in text.split(",") if part.strip()):
        name, *options = spec.split(":")
        strategy: dict[str, Any] = {"name": name}
        for option in options:
            key, found, value = option.partition("=")
            if not found or not key:
                raise MisconfigurationError(f"--variants {spec!r}: options are written name:key=value[:key=value], "
                                            "e.g. ddp:sync_every=8:sync_warmup_steps=20.")
            strategy[key] = yaml.safe_load(value)
        build_strategy(strategy)
        variants.append(Variant(spec, strategy))
    if not variants:
        raise MisconfigurationError("--variants lists no strategy; e.g. --variants ddp,ddp:sync_every=8.")
    return variants


def plan_layouts(devices: list[int], nodes: list[int], variants: list[Variant]) -> list[Layout]:
    """The one-process baseline, then every count spread over every node count that divides it, per variant."""
    layouts = [Layout(1, 1, None)]
    for count in devices:
        for node_count in nodes:
            if count > 1 and count % node_count == 0:
                layouts += [Layout(node_count, count // node_count, variant) for variant in variants]
    return layouts


def check_target_logged(recipe: Recipe, target: str) -> None:
    """A target metric must be one the model logs: its name appears as a string in the model class's source."""
    name = parse_target(target)[0]
    sources = []
    for cls in recipe.model.cls.__mro__:
        if cls.__module__.startswith("torchyard.trainer") or cls in (object, torch.nn.Module):
            continue
        try:
            sources.append(inspect.getsource(cls))
        except (OSError, TypeError):
            return  # no source to read (a compiled class): let the run show it
    if not any(f'"{name}"' in text or f"'{name}'" in text for text in sources):
        raise MisconfigurationError(f"--target {target!r}: {recipe.model.cls.__name__} never logs {name!r} "
                                    "(no self.log of that name in its source); name a metric it logs, e.g. val/acc.")


def check_devices(accelerator: str, most: int) -> None:
    """More processes than the machine's devices: an error on CUDA, a warning naming the sharing on CPU."""
    if accelerator == "cuda":
        if most > torch.cuda.device_count():
            raise MisconfigurationError(
                f"--devices up to {most} needs {most} CUDA devices on this machine, which has "
                f"{torch.cuda.device_count()}; list at most {torch.cuda.device_count()}.")
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if most > cores:
        warnings.warn(f"--devices up to {most} starts {most} processes on {cores} CPU core(s): up to "
                      f"{-(-most // cores)} processes share each core, so speed-up flattens beyond {cores}.",
                      stacklevel=2)


def plan_study(sources: Sequence[str], devices: str, nodes: str, variants: str, steps: int | None,
               epochs: int | None, target: str | None, warmup_steps: int, timeout_s: float) -> StudyPlan:
    """Check every input and load the recipe; nothing starts here."""
    if steps is not None and target is not None:
        raise MisconfigurationError("--target trains each layout until it reaches the target: give the most epochs "
                                    "to try with --epochs, not --steps.")
    for value, flag in ((steps, "--steps"), (epochs, "--epochs"), (timeout_s, "--timeout")):
        if value is not None and value < 1:
            raise MisconfigurationError(f"{flag} {value} must be at least 1.")
    if warmup_steps < 0:
        raise MisconfigurationError(f"--warmup-steps {warmup_steps} must be at least 0.")
    recipe = load_recipe(list(sources))
    if target is not None:
        parse_target(target)
        check_target_logged(recipe, target)
    layouts = plan_layouts(parse_counts(devices, "--devices"), parse_counts(nodes, "--nodes"),
                           parse_variants(variants))
    accelerator = resolve_accelerator(recipe.trainer.accelerator)
    check_devices(accelerator, max(layout.world_size for layout in layouts))
    base = Path(recipe.trainer.default_root_dir) / f"scale_{recipe.trainer.name}"
    root = base / f"version_{next_version(base.parent, base.name)}"
    if steps is None and epochs is None and target is None:
        steps = DEFAULT_STEPS
    return StudyPlan(list(sources), recipe, layouts, accelerator, steps, epochs, target, warmup_steps, timeout_s, root)


# --------------------------------------------------------------------------- one run


def layout_recipe(plan: StudyPlan, layout: Layout, folder: Path) -> dict[str, Any]:
    """The recipe of one measured run: the study's recipe at this layout, timed by StepTiming. The recipe's own
    callbacks are left out: checkpoints and early stopping would measure the disk and cut runs short."""
    resolved = plan.recipe.to_dict(with_ckpt_path=False)
    trainer = resolved["trainer"]
    strategy: Any = "single"
    if layout.variant is not None:
        strategy = dict(layout.variant.strategy)
        if strategy["name"] in TIMED_STRATEGIES:
            strategy["time_communication"] = True
    trainer.update(devices=layout.per_node, num_nodes=layout.nodes, strategy=strategy, default_root_dir=str(folder),
                   name="run", enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   num_sanity_val_steps=0)
    if plan.steps is not None:
        trainer.update(max_steps=plan.warmup_steps + plan.steps, max_epochs=-1, limit_val_batches=0)
    elif plan.epochs is not None:
        trainer.update(max_epochs=plan.epochs, max_steps=-1)
    timing = {"output": str(folder / "timing.json"), "warmup_steps": plan.warmup_steps, "target": plan.target}
    resolved["callbacks"] = [{"class_path": "torchyard.callbacks.StepTiming", "init_args": timing}]
    return resolved


def agent_commands(layout: Layout, recipe_file: Path, port: int) -> list[list[str]]:
    """One command per simulated node: a torch elastic agent with that node rank (the baseline runs plainly)."""
    fit = ["-m", "torchyard.trainer", "fit", str(recipe_file)]
    if layout.variant is None:
        return [[sys.executable, *fit]]
    return [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={layout.nodes}", f"--node-rank={node}",
             f"--nproc-per-node={layout.per_node}", "--master-addr=127.0.0.1", f"--master-port={port}", *fit]
            for node in range(layout.nodes)]


def agent_environment(plan: StudyPlan, layout: Layout, node: int) -> dict[str, str]:
    """On CPU each process is one device with one thread; on CUDA each simulated node sees its own GPUs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if plan.accelerator == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * layout.per_node + i) for i in range(layout.per_node))
    return env


def run_layout(plan: StudyPlan, layout: Layout) -> Row:
    """Run one layout to the end (or its timeout) and read what StepTiming wrote; a failure is a row with its error."""
    folder = plan.root / layout.folder_name
    folder.mkdir(parents=True, exist_ok=True)
    recipe_file = folder / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(layout_recipe(plan, layout, folder), sort_keys=False))
    port = find_free_port()
    agents, logs = [], []
    for node, command in enumerate(agent_commands(layout, recipe_file, port)):
        logs.append(open(folder / f"node{node}.log", "w"))  # noqa: SIM115 (closed below, after the agents end)
        agents.append(subprocess.Popen(command, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True,
                                       env=agent_environment(plan, layout, node)))
    started = time.monotonic()
    try:
        error = wait_for_agents(agents, plan.timeout_s)
    finally:
        stop_agents(agents)
        for log in logs:
            log.close()
    seconds = time.monotonic() - started
    timing_file = folder / "timing.json"
    if error is None and not timing_file.is_file():
        error = "the run wrote no timing.json"
    if error is not None:
        return Row(layout.label, layout.nodes, layout.per_node, layout_variant(layout), run_seconds=seconds,
                   error=f"{error}: {last_error_line(folder)}")
    return row_from_timing(layout.label, layout.nodes, layout.per_node, layout_variant(layout),
                           json.loads(timing_file.read_text()), seconds)


def layout_variant(layout: Layout) -> str:
    return layout.variant.label if layout.variant is not None else "single"


def wait_for_agents(agents: list[subprocess.Popen], timeout_s: float) -> str | None:
    """None when every agent exited 0; else what went wrong first (a non-zero exit, the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [agent.poll() for agent in agents]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return f"exit status {failed[0]}"
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)
    return f"timed out after {timeout_s:g} s"


def stop_agents(agents: list[subprocess.Popen]) -> None:
    """End what is left of a run: each agent's own process group (its workers), never anything else."""
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
    for agent in agents:
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def last_error_line(folder: Path) -> str:
    """The most telling line of the run's logs: the trainer's own one-line error, else the last exception a worker
    raised (not the agent's ChildFailedError that reports it), else the last line."""
    lines = [line.strip() for log in sorted(folder.glob("node*.log")) for line in log.read_text().splitlines()
             if line.strip()]
    own = [line for line in lines if line.startswith("trainer ") and ": error: " in line]
    raised = [line for line in lines if RAISED.search(line) and "torch.distributed.elastic" not in line]
    return (own or raised or lines or ["no output"])[-1][:300]


# --------------------------------------------------------------------------- the study


def run_study(plan: StudyPlan, console: Console) -> tuple[list[Row], Path]:
    """Every layout in turn, with progress; then the table, the PNG and the verdict (scale_report.py)."""
    plan.root.mkdir(parents=True, exist_ok=False)
    rows: list[Row] = []
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting", total=len(plan.layouts))
        for layout in plan.layouts:
            progress.update(task, description=f"running {layout.label}")
            row = run_layout(plan, layout)
            rows.append(row)
            outcome = f"failed: {row.error}" if row.error else f"{row.samples_per_s:,.0f} samples/s"
            progress.console.print(f"{layout.label}: {outcome} ({row.run_seconds:.0f} s)")
            progress.advance(task)
        progress.update(task, description="done")
    return rows, write_study(rows, plan.root, console, describe_plan(plan), plan.target is not None)


def describe_plan(plan: StudyPlan) -> str:
    """One line on how the runs were measured, for the report's header."""
    trainer = plan.recipe.trainer
    if plan.target is not None:
        length = f"until {plan.target} (at most {plan.epochs or trainer.resolved_max_epochs()} epochs)"
    elif plan.steps is not None:
        length = f"{plan.steps} steps"
    else:
        length = f"{plan.epochs} epochs"
    return (f"{' '.join(plan.sources)} on {plan.accelerator}: {length} after {plan.warmup_steps} warm-up steps per "
            f"run; lr_scaling={trainer.lr_scaling}; batch size per process as in the recipe")
