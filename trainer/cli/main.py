"""The `trainer` command: run a recipe, print its resolved config, or plot runs.

    trainer fit|validate|test|predict RECIPE [RECIPE ...] [dotted.key=value ...]
    trainer config RECIPE [...] [dotted.key=value ...]      the resolved recipe as YAML
    trainer config --reference [--readme README.md]         every trainer option (and the README table)
    trainer plot RUN_DIR [RUN_DIR ...] -o curves.png
    trainer evaluate RUN_DIR [--watch] [--accelerator A] [--device N] [--every-n N]   score a run's checkpoints
    trainer submit RECIPE [...] --nodes N [--gpus-per-node G] [--dry-run]   a SLURM batch job (launch/slurm_submit.py)
    trainer launch --hosts H1,H2 [--nproc-per-node N] RECIPE|SCRIPT.py [...]  one node per host over ssh
    trainer checkpoint convert FOLDER FILE                   a sharded (fsdp) checkpoint as one full file
    trainer ledger RUN_DIR                                   which samples each epoch trained, and any twice or missed
    trainer doctor RUN_DIR [--stacks]                        where every rank of a running job is now, live
    trainer scale RECIPE [...] --devices 1,2,4 [--nodes 1,2] [--steps S | --epochs E] [--target val/acc=0.97]
                  [--variants ddp,ddp:sync_every=8]    scale-up vs scale-out study (trainer/scaling/study.py)

A mistake in the command or the recipe prints one line on stderr and exits with status 2 before any
process starts (`--verbose` adds the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException, ValidationError

from torchyard.trainer.cli.options_table import reference_table, update_readme
from torchyard.trainer.config import EvaluatorConfig, TrainerConfig, evaluator_config
from torchyard.trainer.errors import CheckpointError, MisconfigurationError
from torchyard.trainer.launch.slurm_submit import add_arguments as add_submit_arguments
from torchyard.trainer.launch.ssh_hosts import add_arguments as add_launch_arguments

STAGES = ("fit", "validate", "test", "predict")
USAGE_ERROR = 2
VERBOSE_FLAGS = ("-v", "--verbose")
#: The subcommands whose sources may be a Python script followed by its own arguments.
SCRIPT_COMMANDS = ("submit", "launch")
# The shell's status for a run ended by Ctrl-C, as trainer.faults.SIGINT_EXIT_CODE (that module imports torch,
# which `trainer --help` must not wait for).
SIGINT_EXIT_CODE = 128 + signal.SIGINT


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `trainer` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # --verbose may stand anywhere, even between a recipe and its overrides, where argparse would
    # take it for the end of the positional arguments: read it here, let argparse document it.
    verbose = any(token in VERBOSE_FLAGS for token in argv)
    dashed = next((token for token in argv if token.startswith("--") and "." in token.partition("=")[0]), None)
    if dashed is not None:  # LightningCLI's spelling
        print(f"trainer: error: {dashed!r}: overrides are written key=value, without dashes: "
              f"{dashed[2:] if '=' in dashed else dashed[2:] + '=VALUE'}", file=sys.stderr)
        return USAGE_ERROR
    try:
        args = parse_command_line(build_parser(), [token for token in argv if token not in VERBOSE_FLAGS])
    except SystemExit as exit_:  # argparse's own usage errors (status 2) and --help (status 0)
        return int(exit_.code or 0)
    args.verbose = verbose
    with warnings.catch_warnings():  # restores the default format when main returns (tests call it in-process)
        warnings.showwarning = show_warning
        return run_command(args.handler, args)


def parse_command_line(parser: argparse.ArgumentParser, tokens: list[str]) -> argparse.Namespace:
    """The command line, with a subcommand's recipe files and KEY=VALUE overrides allowed anywhere among its
    options, in every subcommand (argparse alone ends a positional list at the first option and sends what follows
    it to the top-level usage as "unrecognized arguments"). After a SCRIPT.py (submit, launch) the rest is the
    script's own arguments, as torchrun reads them; a `--` right after the script is dropped."""
    subcommands: dict[str, argparse.ArgumentParser] = parser.get_default("subcommands")
    command = next((token for token in tokens if not token.startswith("-")), None)
    if command not in subcommands:  # --help, no command, or one argparse names the choices for
        return parser.parse_args(tokens)
    sub, options = subcommands[command], tokens[tokens.index(command) + 1:]
    script_arguments: list[str] = []
    if command in SCRIPT_COMMANDS:
        options, script_arguments = _split_at_script(sub, options)
    args = sub.parse_intermixed_args(options)
    args.command = command
    if script_arguments:
        args.sources = [*args.sources, *script_arguments]
    return args


def _split_at_script(sub: argparse.ArgumentParser, tokens: list[str]) -> tuple[list[str], list[str]]:
    """(the subcommand's part, the script's arguments): split after the first SCRIPT.py that the subcommand reads
    as a source (not as an option's value, as in `--ssh-config hosts.py`)."""
    for index, token in enumerate(tokens):
        if token.endswith(".py") and not token.startswith("-"):
            read, _ = sub.parse_known_intermixed_args(tokens[:index + 1])
            if read.sources and read.sources[-1] == token:
                rest = tokens[index + 1:]
                return tokens[:index + 1], rest[1:] if rest[:1] == ["--"] else rest
    return tokens, []


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
    """The command's warnings as `Warning: <message>`: a user of the command has no use for a Python file:line."""
    print(f"Warning: {message}", file=sys.stderr if file is None else file)


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """The one place user mistakes become one line on stderr and exit status 2."""
    try:
        return handler(args)
    except (MisconfigurationError, CheckpointError, OmegaConfBaseException, yaml.YAMLError) as err:
        if args.verbose:
            traceback.print_exc()
        print(f"trainer {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside training (the first one in fit saves and exits 130)
        if args.verbose:
            traceback.print_exc()
        print(f"trainer {args.command}: interrupted", file=sys.stderr)
        return SIGINT_EXIT_CODE


def _one_line(err: BaseException) -> str:
    text = describe_config_error(err) if isinstance(err, OmegaConfBaseException) else str(err)
    return " ".join(text.split())


def describe_config_error(err: OmegaConfBaseException) -> str:
    """One line for an omegaconf error: the key, what is wrong and what to do."""
    key = getattr(err, "full_key", None) or ""
    message = str(getattr(err, "msg", None) or err).strip().splitlines()[0]  # drop omegaconf's object_type lines
    prefix = f"{key}: " if key else ""
    if isinstance(err, InterpolationResolutionError):
        return (f"{prefix}cannot resolve an interpolation: {message}; point ${{...}} at a key of the recipe, or "
                "give environment variables a default: ${oc.env:VAR,default}.")
    if isinstance(err, ValidationError) and key.startswith("trainer."):
        field = {f.name: f for f in dataclasses.fields(TrainerConfig)}.get(key.split(".", 1)[1])
        if field is not None:
            return f"{prefix}{message}; {key} takes {field.type} (default {field.default!r})."
    return f"{prefix}{message}."


def build_parser() -> argparse.ArgumentParser:
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(*VERBOSE_FLAGS, action="store_true", help="show the traceback of an error")
    parser = argparse.ArgumentParser(prog="trainer", parents=[verbose],
                                     description="Train, evaluate and inspect PyTorch models from YAML recipes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sources_help = "recipe files (merged left to right) and dotted.key=value overrides (values parsed as YAML)"
    for stage in STAGES:
        sub = commands.add_parser(stage, parents=[verbose], help=f"{stage} with a recipe")
        sub.add_argument("sources", nargs="+", metavar="RECIPE|KEY=VALUE", help=sources_help)
        sub.set_defaults(handler=run_stage)
    config = commands.add_parser("config", parents=[verbose], help="print the resolved recipe as YAML")
    config.add_argument("sources", nargs="*", metavar="RECIPE|KEY=VALUE", help=sources_help)
    config.add_argument("--reference", action="store_true", help="print every trainer option as a Markdown table")
    config.add_argument("--readme", metavar="PATH", help="with --reference: rewrite the table in this README")
    config.set_defaults(handler=show_config)
    plot = commands.add_parser("plot", parents=[verbose], help="draw the logged metrics of runs to a PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="version folders holding metrics.csv")
    plot.add_argument("-o", "--output", default="curves.png", help="the PNG to write (default: curves.png)")
    plot.set_defaults(handler=plot_runs)
    checkpoint = commands.add_parser("checkpoint", parents=[verbose], help="convert checkpoints")
    checkpoint.add_argument("action", choices=["convert"], help="convert: a sharded folder to one full file")
    checkpoint.add_argument("folder", help="a sharded checkpoint folder (strategy fsdp, checkpoint: sharded)")
    checkpoint.add_argument("file", help="the full checkpoint file to write")
    checkpoint.set_defaults(handler=convert_checkpoint)
    ledger = commands.add_parser("ledger", parents=[verbose], help="show that every sample of every epoch trained "
                                 "exactly once (docs/fault-tolerance.md)")
    ledger.add_argument("run_dir", metavar="RUN_DIR", help="a fit's version folder (or its sample_ledger.json)")
    ledger.set_defaults(handler=show_ledger)
    doctor = commands.add_parser("doctor", parents=[verbose], help="where every rank of a running job is now, "
                                 "without stopping it (docs/diagnosis.md)")
    doctor.add_argument("run_dir", metavar="RUN_DIR", help="the run folder of the running job, e.g. "
                        "runs/<name>/version_0")
    doctor.add_argument("--stacks", action="store_true", help="also print every rank's whole Python stack")
    doctor.set_defaults(handler=run_doctor)
    add_submit_arguments(commands.add_parser("submit", parents=[verbose], help="run a recipe as a SLURM batch job"))
    add_launch_arguments(commands.add_parser("launch", parents=[verbose],
                                             help="run a recipe or script on several hosts over ssh, one node each"))
    add_evaluate_arguments(commands.add_parser("evaluate", parents=[verbose], help="score each checkpoint of a run "
                                               "with its validation_step (docs/evaluator.md)"))
    add_scale_arguments(commands.add_parser("scale", parents=[verbose], help="measure a recipe at several layouts"))
    add_plan_arguments(commands.add_parser("plan", parents=[verbose], help="predict per-rank memory and step time "
                                           "of layouts at any scale, without the hardware (docs/planning.md)"))
    parser.set_defaults(subcommands=commands.choices)  # parse_command_line parses the subcommand's part itself
    return parser


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EvaluatorConfig()
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's version folder, e.g. runs/digits/version_0")
    parser.add_argument("--watch", action="store_true", help="keep scoring new checkpoints until the training ends")
    parser.add_argument("--checkpoints", metavar="DIR", help="the checkpoint folder (default: RUN_DIR/checkpoints)")
    parser.add_argument("--accelerator", default=defaults.accelerator, help="cpu, cuda or auto (default: auto)")
    parser.add_argument("--device", type=int, default=None, help="the GPU index with cuda (default: 0)")
    parser.add_argument("--every-n", type=int, default=defaults.every_n, help="score every n-th checkpoint")
    parser.add_argument("--poll-interval", type=float, default=defaults.poll_interval, metavar="SECONDS",
                        help=f"seconds between looks at the folder (default: {defaults.poll_interval:g})")
    parser.add_argument("--limit-val-batches", type=float, default=defaults.limit_val_batches, metavar="LIMIT",
                        help="validation batches per checkpoint: a fraction, or a count (default: all)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="with --watch: stop after this long without a new checkpoint (default: never)")
    parser.set_defaults(handler=evaluate_checkpoints)


def add_scale_arguments(scale: argparse.ArgumentParser) -> None:
    """The options of `trainer scale` (trainer/scaling/study.py does the work)."""
    scale.add_argument("sources", nargs="+", metavar="RECIPE|KEY=VALUE", help="recipe files and overrides")
    scale.add_argument("--devices", required=True, help="total process counts to measure, e.g. 1,2,4")
    scale.add_argument("--nodes", default="1", help="node counts to spread each count over (default 1), e.g. 1,2")
    length = scale.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="measured optimizer steps per run after the warm-up (default 30)")
    length.add_argument("--epochs", type=int, help="epochs per run (with --target: the most to try)")
    scale.add_argument("--target", help="train each layout until METRIC=VALUE, e.g. val/acc=0.97 or val/loss<=1.2")
    scale.add_argument("--variants", default="ddp", help="strategies to compare, e.g. ddp,ddp:sync_every=8")
    scale.add_argument("--warmup-steps", type=int, default=5, help="optimizer steps left out of the timing")
    scale.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    scale.set_defaults(handler=run_scale)


def add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    """The options of `trainer plan` (trainer/scaling/plan.py does the work)."""
    plan.add_argument("sources", nargs="+", metavar="RECIPE|KEY=VALUE", help="recipe files and overrides")
    plan.add_argument("--devices", required=True, help="total ranks to plan, e.g. 8,64,512")
    plan.add_argument("--nodes", default="1", help="node counts to spread each over (default 1), e.g. 1,8")
    plan.add_argument("--layouts", default="ddp,fsdp", help="strategies, e.g. ddp,fsdp:shard_units=[Block]")
    plan.add_argument("--device-memory", help="memory of one device, e.g. 80GB or 141GiB: the largest micro-batch")
    plan.add_argument("--network", default="400Gbps:5us", help="between nodes, per rank: BANDWIDTH:LATENCY")
    plan.add_argument("--node-network", default="900GB/s:1us", help="within a node, per rank: BANDWIDTH:LATENCY")
    plan.add_argument("--compute-ms", type=float, help="one step's compute on the target device (default: "
                      "measured here)")
    plan.add_argument("--measure", action="store_true", help="also run the layouts that fit here for real and show "
                      "each part predicted beside measured")
    plan.set_defaults(handler=run_plan)


# --------------------------------------------------------------------------- commands


def run_stage(args: argparse.Namespace) -> int:
    """fit / validate / test / predict: build everything from the recipe, then run the stage."""
    # Here, not at the top: the framework imports torch, which `trainer --help` must not wait for.
    from torchyard.trainer import Trainer
    from torchyard.trainer.cli.recipe import import_from_cwd, load_recipe

    import_from_cwd()
    recipe = load_recipe(args.sources)  # every check happens here, before anything is built
    # The saved config.yaml reruns the recipe; its ckpt_path is left out so that a rerun starts afresh. The Trainer
    # seeds the process (trainer.seed) as it is built: the data and model built after it start seeded.
    trainer = Trainer(callbacks=[spec.instantiate() for spec in recipe.callbacks],
                      run_config=recipe.to_dict(with_ckpt_path=False), **recipe.trainer_options())
    datamodule, module = recipe.data.instantiate(), recipe.model.instantiate()
    ckpt_path = _run_of_recipe(args.sources) if recipe.ckpt_path == "last" else None
    if args.command == "fit":
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path or recipe.ckpt_path)
    elif args.command == "predict":
        _show_predictions(
            trainer.predict(module, datamodule=datamodule, ckpt_path=ckpt_path or recipe.ckpt_path), trainer
        )
    else:
        if recipe.ckpt_path is None:
            print(f"trainer {args.command}: note: no ckpt_path given; evaluating the model's initial weights.",
                  file=sys.stderr)
        run = trainer.validate if args.command == "validate" else trainer.test
        run(module, datamodule=datamodule, ckpt_path=ckpt_path or recipe.ckpt_path)  # prints the results table
    return 0


def show_config(args: argparse.Namespace) -> int:
    """Print the resolved recipe, or the reference of trainer options."""
    if args.reference:
        if args.readme:
            changed = update_readme(args.readme)
            print(f"{args.readme}: {'table updated' if changed else 'table already up to date'}")
        else:
            print(reference_table(), end="")
        return 0
    if args.readme:
        raise MisconfigurationError("--readme goes with --reference: `trainer config --reference --readme README.md`.")
    # Imports torch: here, not above, so that --reference stays fast.
    from torchyard.trainer.cli.recipe import import_from_cwd, load_recipe

    import_from_cwd()
    print(load_recipe(args.sources).to_yaml(), end="")
    return 0


def evaluate_checkpoints(args: argparse.Namespace) -> int:
    """Score each checkpoint of a run once, logging into that run (a backfill; with --watch, as they appear)."""
    # Imports torch: see run_stage.
    from torchyard.trainer import Trainer
    from torchyard.trainer.cli.recipe import import_from_cwd, load_recipe
    from torchyard.trainer.evaluation.evaluator import evaluate_run, wait_for_run

    limit = args.limit_val_batches
    options = evaluator_config({
        "accelerator": args.accelerator, "device": args.device, "every_n": args.every_n,
        "poll_interval": args.poll_interval, "limit_val_batches": int(limit) if limit > 1 else limit,
    })
    import_from_cwd()
    # The recipe the run saved builds its module and data (with --watch, once the job has written it).
    recipe = load_recipe([str(wait_for_run(Path(args.run_dir), args.watch, args.timeout, options.poll_interval))])
    record = evaluate_run(Trainer, recipe.model.instantiate(), recipe.data.instantiate(), recipe.trainer,
                          args.run_dir, options, watch=args.watch, checkpoint_dir=args.checkpoints,
                          idle_timeout=args.timeout)
    scored = sum(evaluation.status == "scored" for evaluation in record)
    print(f"evaluator: {scored} checkpoint(s) scored in all; the record is {Path(args.run_dir) / 'evaluations.json'}")
    return 0


def plot_runs(args: argparse.Namespace) -> int:
    from torchyard.trainer.logs.plot import plot_runs as draw  # matplotlib: only this command needs it

    path = draw(args.run_dirs, args.output)
    print(f"wrote {path}")
    return 0


def convert_checkpoint(args: argparse.Namespace) -> int:
    """A sharded checkpoint folder as one full file, which every strategy and load_from_checkpoint read."""
    from torchyard.trainer.strategies.fsdp_checkpoint import convert_to_file  # imports torch: see run_stage

    folder, out = Path(args.folder), Path(args.file)
    if not folder.is_dir():
        raise MisconfigurationError(f"{str(folder)!r} is not a folder; give a sharded checkpoint folder.")
    if out.exists() and out.is_dir():
        raise MisconfigurationError(f"{str(out)!r} is a folder; give the path of the file to write.")
    print(f"wrote {convert_to_file(folder, out)}")
    return 0


def show_ledger(args: argparse.Namespace) -> int:
    """Per epoch: how many samples trained, and each one trained twice or missed; status 1 if any was."""
    from torchyard.trainer.data.ledger import read_ledger, report  # imports torch: see run_stage

    lines, clean = report(read_ledger(args.run_dir))
    print("\n".join(lines))
    return 0 if clean else 1


def run_doctor(args: argparse.Namespace) -> int:
    """Print where every rank of the job running in RUN_DIR is now; status 1, one line, when no job there answers."""
    # torch's C++ side logs a warning with a traceback for a store connection that closes (a job that ends while
    # asked), before the error this command turns into one line: read at torch's import, so set before it.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from torchyard.trainer.diagnosis.doctor import NoLiveJobError, examine  # imports torch: see run_stage

    try:
        print(examine(args.run_dir, stacks=args.stacks))
    except NoLiveJobError as err:
        print(f"trainer doctor: {err}", file=sys.stderr)
        return 1
    return 0


def run_scale(args: argparse.Namespace) -> int:
    """Plan the study (every check first), then run it: the table, runs.md and scale.png in its folder."""
    from rich.console import Console

    from torchyard.trainer.cli.recipe import import_from_cwd  # imports torch: see run_stage
    from torchyard.trainer.scaling.study import plan_study, run_study  # imports torch: see run_stage

    import_from_cwd()
    plan = plan_study(args.sources, args.devices, args.nodes, args.variants, args.steps, args.epochs, args.target,
                      args.warmup_steps, args.timeout)
    console = Console()
    if not console.is_terminal:  # a log file or a pipe: the table's width, not 80 columns
        console = Console(width=200)
    rows, _ = run_study(plan, console)
    return 0 if any(row.error is None for row in rows) else 1


def run_plan(args: argparse.Namespace) -> int:
    """Check every input, then plan each layout at each size: the table, plan.md and plan.png."""
    from rich.console import Console

    from torchyard.trainer.cli.recipe import import_from_cwd  # imports torch: see run_stage
    from torchyard.trainer.scaling.plan import make_plan, plan_inputs, plan_title  # imports torch: see run_stage
    from torchyard.trainer.scaling.plan_report import write_plan  # imports torch: see run_stage

    import_from_cwd()
    inputs = plan_inputs(args.sources, args.devices, args.nodes, args.layouts, args.device_memory, args.network,
                         args.node_network, args.compute_ms, args.measure)
    console = Console() if Console().is_terminal else Console(width=220)
    rows = make_plan(inputs, progress=lambda label: console.print(f"planning {label}", style="dim"))
    write_plan(rows, inputs.root, console, plan_title(inputs))
    return 0


# --------------------------------------------------------------------------- helpers


def _run_of_recipe(sources: Sequence[str]) -> Any:
    """For `trainer fit <run>/config.yaml ckpt_path=last`: that run's checkpoints, not the newest run's."""
    from torchyard.trainer.checkpointing.resume import NewestCheckpoint  # imports torch: see run_stage

    first = Path(sources[0]) if sources else None
    if first is not None and first.name == "config.yaml" and (first.parent / "checkpoints").is_dir():
        return NewestCheckpoint(first.parent / "checkpoints")
    return None


def _show_predictions(outputs: list[Any], trainer: Any) -> None:
    """Text predictions are printed; anything else is saved next to the run's logs."""
    flat = _flatten(outputs)
    if flat and all(isinstance(item, str) for item in flat):
        for text in flat:
            print(text)
            print("-" * 72)
        return
    # Imports torch: see run_stage.
    import torch

    from torchyard.trainer.checkpointing.files import save_checkpoint_file
    from torchyard.trainer.data.batches import move_to_device

    # On the host, so the file loads anywhere without a map_location.
    path = save_checkpoint_file(move_to_device(outputs, torch.device("cpu")), Path(trainer.log_dir) / "predictions.pt")
    print(f"{len(outputs)} batches of predictions saved to {path}")


def _flatten(items: Any) -> list[Any]:
    if isinstance(items, (list, tuple)):
        return [leaf for item in items for leaf in _flatten(item)]
    return [items]
