"""`trainer submit`: run a recipe (or a script) as a SLURM batch job, one srun task per device.

    trainer submit RECIPE [RECIPE ...] [key=value ...] --nodes N [--gpus-per-node G | --devices-per-node D]
                   [--partition P] [--time T] [--account A] [--sbatch=--OPTION=VALUE ...] [--dry-run]
    trainer submit --nodes N [...] SCRIPT.py -- [the script's own arguments]

The batch script it writes (docs/slurm.md explains each line) starts `trainer fit` under srun with
trainer.num_nodes and trainer.devices set to the job's shape, in a run root of its own,
<default_root_dir>/slurm-<job id>, with ckpt_path=last: SLURM's warning signal before the time limit makes
every task save a checkpoint and exit 143, the script then requeues the job, and the requeued job (same id,
same folder) resumes from that checkpoint. The submitting process builds nothing and starts no process group.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from torchyard.trainer.errors import MisconfigurationError

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # what a run that saved on SIGTERM exits with (trainer.faults; no torch here)

#: Seconds before the time limit at which SLURM sends SIGTERM: time to finish a step and write a checkpoint
#: (SLURM may send it up to a minute earlier than asked).
SIGNAL_BEFORE_LIMIT_S = 120
#: Left unquoted in the script: the batch shell expands it to ckpt_path=last in a requeued job, to nothing before.
RESUME_WHEN_REQUEUED = "${SLURM_RESTART_COUNT:+ckpt_path=last}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `trainer submit`."""
    parser.add_argument("sources", nargs="+", metavar="RECIPE|SCRIPT.py|KEY=VALUE",
                        help="recipe files and dotted.key=value overrides, or a Python script and its arguments")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node; one task each")
    parser.add_argument("--devices-per-node", type=int,
                        help="tasks (devices) per node; default: --gpus-per-node, else 1")
    parser.add_argument("--partition", help="sbatch --partition")
    parser.add_argument("--time", help="sbatch --time (the limit; SIGTERM comes 2 minutes before it)")
    parser.add_argument("--account", help="sbatch --account")
    parser.add_argument("--job-name", help="sbatch --job-name (default: the recipe's trainer.name)")
    parser.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                        help="any other sbatch option, written --sbatch=--mem=16G (repeat for several)")
    parser.add_argument("--resume", metavar="RUN_ROOT",
                        help="continue the run of an earlier job in its folder (e.g. runs/slurm-1234)")
    parser.add_argument("--dry-run", action="store_true", help="print the batch script; submit nothing")
    parser.set_defaults(handler=submit_command)


def submit_command(args: argparse.Namespace) -> int:
    """Write the batch script, then print it (--dry-run) or submit it and print the job id and run folder."""
    tasks_per_node = _tasks_per_node(args)
    script_source = _script_of(args.sources)
    if script_source is None:
        name, root, absolute = _recipe_name_and_root(args.sources)
        run_root = Path(args.resume).resolve() if args.resume else root / "slurm-${SLURM_JOB_ID}"
        command = _fit_command(absolute, args.nodes, tasks_per_node, run_root, resume=bool(args.resume))
    else:
        name, root, run_root = Path(script_source).stem, Path.cwd(), None
        command = [sys.executable, str(Path(script_source).resolve()), *args.sources[1:]]
    log = root / "slurm-%j.out"
    script = batch_script(command, job_name=args.job_name or name, nodes=args.nodes, tasks_per_node=tasks_per_node,
                          log=log, gpus_per_node=args.gpus_per_node, options=_sbatch_options(args))
    if args.dry_run:
        print(script, end="")
        return 0
    root.mkdir(parents=True, exist_ok=True)  # SLURM opens the log there before the script runs
    job_id = sbatch(script)
    (root / f"slurm-{job_id}.sbatch").write_text(script)
    print(f"submitted batch job {job_id}")
    if run_root is not None:
        print(f"run folder: {str(run_root).replace('${SLURM_JOB_ID}', job_id)}/{name}/version_0")
    print(f"log: {str(log).replace('%j', job_id)}")
    return 0


def batch_script(command: list[str], *, job_name: str, nodes: int, tasks_per_node: int, log: Path,
                 gpus_per_node: int | None = None, options: list[str] | None = None) -> str:
    """The sbatch script: #SBATCH lines, then srun starting `command` once per task and the requeue on SIGTERM."""
    lines = [
        "#!/bin/bash",
        f"# Written by `trainer submit` on {datetime.now():%Y-%m-%d %H:%M}; docs/slurm.md explains each line.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
        *([f"#SBATCH --gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        f"#SBATCH --output={log}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=TERM@{SIGNAL_BEFORE_LIMIT_S}",
        "#SBATCH --requeue",
        *(f"#SBATCH {option}" for option in options or []),
        "",
        'echo "trainer submit: job $SLURM_JOB_ID, attempt $((${SLURM_RESTART_COUNT:-0} + 1)), on $SLURM_JOB_NODELIST"',
        "srun --kill-on-bad-exit=1 " + " ".join(_quote(token) for token in command),
        "status=$?",
        f"if [ $status -eq {SIGTERM_EXIT_CODE} ]; then",
        '    echo "trainer submit: stopped by SIGTERM after saving a checkpoint; requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "fi",
        "exit $status",
    ]
    return "\n".join(lines) + "\n"


def sbatch(script: str) -> str:
    """Submit `script` on stdin; the job id. sbatch's own refusal becomes a one-line error."""
    if shutil.which("sbatch") is None:
        raise MisconfigurationError("sbatch is not on PATH: submit from a SLURM login node, or use --dry-run.")
    done = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        raise MisconfigurationError(said[-1] if said else f"sbatch exited with status {done.returncode}")
    return done.stdout.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"


def _tasks_per_node(args: argparse.Namespace) -> int:
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node),
                        ("--devices-per-node", args.devices_per_node)):
        if value is not None and value < 1:
            raise MisconfigurationError(f"{flag} {value}: give 1 or more.")
    if args.gpus_per_node and args.devices_per_node and args.gpus_per_node != args.devices_per_node:
        raise MisconfigurationError(f"--devices-per-node {args.devices_per_node} with --gpus-per-node "
                                    f"{args.gpus_per_node}: srun starts one task per GPU; give one of them.")
    return args.devices_per_node or args.gpus_per_node or 1


def _script_of(sources: list[str]) -> str | None:
    """The Python script to run, when the first source is one (its arguments follow it)."""
    if not sources[0].endswith(".py"):
        return None
    if not Path(sources[0]).is_file():
        raise MisconfigurationError(f"script {sources[0]!r} does not exist.")
    return sources[0]


def _recipe_name_and_root(sources: list[str]) -> tuple[str, Path, list[str]]:
    """The recipe's trainer.name and default_root_dir (absolute), and its sources with absolute paths; the whole
    recipe is checked on the way."""
    from torchyard.trainer.cli.recipe import load_recipe_to_run_elsewhere  # imports torch: `trainer --help` stays fast

    recipe, absolute = load_recipe_to_run_elsewhere(sources)
    return recipe.trainer.name, Path(recipe.trainer.default_root_dir).resolve(), absolute


def _fit_command(absolute: list[str], nodes: int, tasks_per_node: int, run_root: Path, resume: bool) -> list[str]:
    """`trainer fit` with the job's shape and run root; ckpt_path=last where there is a run to go on with."""
    # A requeued job (SLURM_RESTART_COUNT set) resumes; its first attempt has nothing to resume from.
    resume_from_last = "ckpt_path=last" if resume else RESUME_WHEN_REQUEUED
    return [sys.executable, "-m", "torchyard.trainer", "fit", *absolute, f"trainer.num_nodes={nodes}",
            f"trainer.devices={tasks_per_node}", f"trainer.default_root_dir={run_root}", resume_from_last]


def _sbatch_options(args: argparse.Namespace) -> list[str]:
    named = [f"--{flag}={value}" for flag, value in (("partition", args.partition), ("time", args.time),
                                                     ("account", args.account)) if value]
    for option in args.sbatch:
        if not option.startswith("-"):
            raise MisconfigurationError(f"--sbatch={option!r}: give an sbatch option, e.g. --sbatch=--mem=16G.")
    return [*named, *args.sbatch]


def _quote(token: str) -> str:
    """Shell quoting that leaves ${SLURM_JOB_ID} and ${SLURM_RESTART_COUNT} to the batch shell, which expands
    them when the job starts."""
    if token == RESUME_WHEN_REQUEUED:
        return token
    if "${SLURM_JOB_ID}" in token:
        return '"' + token.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'
    return shlex.quote(token)
