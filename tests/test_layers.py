"""The framework's import layers, its function-local imports and its file and function sizes, checked over the tree.

The layers are written down once, in LAYERS; a module imports only modules of a lower layer, so the import graph
has no cycle. Each rule's checker is also fed a deliberately broken source, to show that it fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"trainer": "torchyard.trainer", "callbacks": "torchyard.callbacks"}  # the framework, checked here
RECIPES = "torchyard.recipes"  # may import the framework; the framework never imports it

T, C = "torchyard.trainer", "torchyard.callbacks"
LAYERS: dict[str, int] = {
    # 0: the framework's exception types and message helpers every file raises with; the folders' docstring-only
    #    packages
    f"{T}.errors": 0, **{f"{T}.{folder}": 0 for folder in (
        "checkpointing", "cli", "cluster", "data", "evaluation", "launch", "logs", "loop", "scaling", "strategies.ps",
        "strategies.pipeline", "compile", "diagnosis", "strategies.ft")},
    # 1: leaf helpers that import nothing of the framework but errors: the process environment, seeding, run
    #    folders, fault signals, checkpoint files, batch order and device moves, the Callback interface, where
    #    the running script called us (under its main guard or not), and glibc's malloc settings
    f"{T}.cluster.environment": 1, f"{T}.loop.rng": 1, f"{T}.logs.runs": 1, f"{T}.loop.faults": 1,
    f"{T}.checkpointing.files": 1, f"{T}.data.batches": 1, f"{C}.base": 1, f"{T}.data.combined": 1,
    f"{T}.checkpointing.hparams": 1, f"{T}.cluster.script_guard": 1, f"{T}.data.samplers": 1,
    f"{T}.loop.host_memory": 1, f"{T}.diagnosis.markers": 1,
    #    and the sample ledger over the samplers' deals
    f"{T}.data.ledger": 2,
    #    torch.compile's option (no torch import: the schema reads it) and the record of what compiling cost
    f"{T}.compile.options": 1, f"{T}.compile.report": 1,
    # 2: the metric writers (CSV, TensorBoard, MLflow), and Lightning's import path for them; the forkserver that the
    #    workers of a spawned job fork from (it asks where the script called us); the checks every node of a
    #    multi-node job runs before the nodes meet; the evaluator's record of a run
    f"{T}.logs.loggers": 2, f"{T}.loggers": 3, f"{T}.launch.warm_start": 2, f"{T}.cluster.node_checks": 2,
    f"{T}.logs.evaluations": 3, f"{T}.diagnosis.watchdog": 2, f"{T}.diagnosis.stragglers": 2,
    f"{T}.diagnosis.agreement": 2, f"{T}.diagnosis.arrival": 1, f"{T}.diagnosis.doctor": 3,
    f"{T}.diagnosis.flight_recorder": 0,
    #    torch.compile applied to a module's regions (the strategies call it after wrapping the module)
    f"{T}.compile.regions": 2,
    # 3: the option schema: every Trainer option and its checks
    f"{T}.config": 3,
    # 4: optimizers/schedulers and precision, which read their value sets from the schema; the README options table;
    #    plots of finished runs (matplotlib is imported when a plot is drawn)
    f"{T}.optim": 4, f"{T}.precision": 4, f"{T}.cli.options_table": 4, f"{T}.logs.plot": 4,
    # 5: the user's base classes
    f"{T}.module": 5, f"{T}.datamodule": 6,
    # 6: the loaders built from the user's
    f"{T}.data.loaders": 7,
    # 7: what is built on the loaders: metric collection, and prediction outputs merged across ranks
    f"{T}.logs.metrics": 8, f"{T}.evaluation.predictions": 8,
    # 8-12: the strategies: how they call the user's steps, shared pieces, then the strategies, each above the ones
    #       it extends
    f"{T}.strategies.user_steps": 8,
    f"{T}.strategies.distributed": 9, f"{T}.strategies.pipeline.split": 9, f"{T}.strategies.base": 9,
    f"{T}.strategies.comm_timing": 9, f"{T}.strategies.mesh": 9,
    f"{T}.strategies": 10, f"{T}.strategies.process_group": 10, f"{T}.strategies.single": 10,
    f"{T}.strategies.dp": 10, f"{T}.strategies.ps.server": 10, f"{T}.strategies.ps.liveness": 10,
    f"{T}.strategies.pipeline.stage_state": 10,
    f"{T}.strategies.fsdp_checkpoint": 10,
    f"{T}.strategies.ddp": 11, f"{T}.strategies.ps.client": 11, f"{T}.strategies.fsdp": 11,
    f"{T}.strategies.ps.strategy": 12, f"{T}.strategies.pipeline.strategy": 12,
    #     live recovery on torchft: the lighthouse and torchft itself, each step's global batch dealt over the
    #     replicas alive, then ddp over replica groups
    f"{T}.strategies.ft.lighthouse": 1, f"{T}.strategies.ft.slices": 2, f"{T}.strategies.ft.strategy": 12,
    # 13: the pieces of a run: loop counters, one step, checkpoint state, hook dispatch, resuming
    f"{T}.loop.progress": 13, f"{T}.loop.step": 13, f"{T}.checkpointing.state": 13, f"{T}.loop.hooks": 13,
    f"{T}.checkpointing.resume": 13,
    # 14: the fit / evaluation / predict loops
    f"{T}.loop.loops": 14,
    # 15-16: the built-in callbacks, then their package (trainer.py builds the default ones)
    f"{C}.checkpoint": 15, f"{C}.early_stopping": 15, f"{C}.lr_monitor": 15, f"{C}.prediction_writer": 15,
    f"{C}.progress": 15, f"{C}.gradient_accumulation": 15, f"{C}.compile_report": 15, f"{C}.profilers": 15,
    f"{C}.summary": 15, f"{C}.timer": 15,
    #     and the evaluator side process's callback (it validates with the Trainer class it is handed, not imports)
    f"{T}.evaluation.evaluator": 15, f"{C}.step_timing": 15,
    C: 16,
    # 16: a script without a main guard re-run for the job's other ranks (Lightning's launch), which launcher uses
    f"{T}.launch.script_launch": 16,
    # 17: what the Trainer calls before a stage (option and module checks, default callbacks), to start processes,
    #     and the read-only state it shows
    f"{T}.preflight": 17, f"{T}.launch.elastic": 17, f"{T}.launch.ray_actors": 17, f"{T}.trainer_properties": 17,
    #     and the launch of a live-recovery job's replica groups, each restarted on its own
    f"{T}.launch.replica_groups": 17,
    # 18: the Trainer
    f"{T}.trainer": 18,
    # 19: the package's public names (lazily), recipe class checks
    T: 19, f"{T}.cli.signatures": 19,
    # 20-24: the YAML recipes and the command line on top of them
    f"{T}.cli.recipe": 20, f"{T}.launch.slurm_submit": 21, f"{T}.launch.ssh_hosts": 21, f"{T}.cli.main": 23,
    f"{T}.__main__": 24,
    # 19-21: the report of a scaling study, then the study itself (runs recipes at layouts: the recipe layer)
    f"{T}.scaling.report": 19, f"{T}.scaling.study": 21,
    #     and `trainer plan`: one step on fake tensors (it loads recipes), its report, the plan (it reuses the study's
    #     input parsing)
    f"{T}.scaling.fake_step": 19, f"{T}.scaling.plan_report": 20, f"{T}.scaling.plan": 22,
    f"{T}.scaling.measure": 21,
}

# Same-layer imports that are allowed, (importer, imported): reason.
SAME_LAYER: dict[tuple[str, str], str] = {
    (f"{T}.launch.ray_actors", f"{T}.launch.elastic"): "a Ray worker's failure is raised as a self-launched one's",
    (f"{T}.launch.replica_groups", f"{T}.launch.elastic"): "each replica group's workers are the self-launch's",
}

CLI_REASON = "the CLI imports the framework (and with it torch) inside a command, so that `trainer --help` is fast"
FUNCTION_LOCAL: dict[tuple[str, str], str] = {
    (f"{T}.cli.main", T): CLI_REASON,
    (f"{T}.cli.main", f"{T}.cli.recipe"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.checkpointing.resume"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.data.batches"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.data.ledger"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.checkpointing.files"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.strategies.fsdp_checkpoint"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.logs.plot"): "matplotlib, needed only by `trainer plot`",
    (f"{T}.launch.slurm_submit", f"{T}.cli.recipe"): CLI_REASON,
    (f"{T}.launch.ssh_hosts", f"{T}.cli.recipe"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.scaling.study"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.scaling.plan"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.scaling.plan_report"): CLI_REASON,
    (f"{T}.trainer", f"{T}.launch.elastic"): "torch's elastic agent takes 150 ms to import; only a started job needs "
                                            "it",
    (f"{T}.cli.main", f"{T}.evaluation.evaluator"): CLI_REASON,
    (f"{T}.cli.main", f"{T}.diagnosis.doctor"): CLI_REASON,
    (f"{T}.trainer", f"{T}.launch.ray_actors"): "it imports the elastic agent's launcher; only launcher='ray' needs it",
    (f"{T}.trainer", f"{T}.launch.replica_groups"): "it imports the elastic agent's launcher; only fault_tolerance "
                                                   "needs it",
    (f"{T}.config", f"{T}.logs.loggers"): "every folder reads the option schema, so it sits below the loggers it names",
}

# Which folder's modules may import which other folder's, at module level (TYPE_CHECKING and listed function-local
# imports exempt). "root" is trainer/'s own files: the user-facing classes (Trainer, TrainModule, DataModule), the
# option schema, optimizers, precision and the exception types. The module layers above keep the import graph free of
# cycles; this table says which concern may lean on which, so that a new edge is a decision, not an accident.
# Folders importing only downwards in it: cluster and data know no loop, strategy or launcher; strategies know no
# loop or launcher (a strategy never touches the loop); nothing but the command line and scaling imports cli.
FOLDER_IMPORTS: dict[str, set[str]] = {
    "root": {"callbacks", "checkpointing", "cli", "compile", "data", "diagnosis", "evaluation", "launch", "logs",
             "loop", "strategies"},
    "compile": {"root"},
    "cluster": {"root"},
    "data": {"root", "cluster"},
    "logs": {"root", "data"},
    "checkpointing": {"root", "data", "logs", "loop"},  # data: the sample ledger a checkpoint keeps
    "strategies": {"root", "checkpointing", "cluster", "compile", "data", "diagnosis", "logs"},
    "diagnosis": {"root", "callbacks", "logs"},  # logs: the run folder's atomic write (doctor.py's live_job.json)
    "evaluation": {"root", "callbacks", "checkpointing", "cluster", "data", "logs", "strategies"},
    "loop": {"root", "callbacks", "data", "evaluation", "strategies"},
    "callbacks": {"root", "checkpointing", "data", "logs"},
    "launch": {"root", "cluster", "loop", "diagnosis"},  # diagnosis: SIGUSR1 prints trainer doctor's report
    "cli": {"root", "callbacks", "checkpointing", "cluster", "data", "launch", "logs", "strategies"},
    "scaling": {"root", "callbacks", "cli", "cluster", "logs", "strategies"},
}
MAX_FOLDER_MODULES = 12  # a folder of more is two ideas: split it


def folder_of(module: str) -> str:
    """The concern a module belongs to: its folder under trainer/, 'callbacks', or 'root'."""
    if module == C or module.startswith(C + "."):
        return "callbacks"
    parts = module.split(".")
    if len(parts) > 3 or (len(parts) == 3 and parts[2] in FOLDER_IMPORTS):
        return parts[2]
    return "root"


def check_folders(module: str, source: str, where: str | None = None, known: set[str] | None = None) -> list[str]:
    """Every module-level import of `source` from a folder that FOLDER_IMPORTS does not let `module`'s folder import."""
    where = where or module
    known = set(LAYERS) if known is None else known
    mine, problems = folder_of(module), []
    for node, in_function in _imports(ast.parse(source)):
        if in_function:
            continue
        for target, _ in _targets(node, module, where.endswith("__init__.py"), known):
            if not target.startswith("torchyard.") or target.startswith(RECIPES):
                continue
            theirs = folder_of(target)
            if theirs != mine and theirs not in FOLDER_IMPORTS.get(mine, set()):
                problems.append(f"{where}:{node.lineno}: {module} ({mine}/) imports {target} ({theirs}/), which "
                                f"FOLDER_IMPORTS does not allow {mine}/ (folder rule)")
    return problems


MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 500
# Files over MAX_FILE_LINES, with the reason they still are. Remove an entry once its file is split.
LONG_FILES: dict[str, str] = {}


def module_name(path: Path) -> str:
    """The import name of a file under one of FOLDERS."""
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    if rest and rest[-1] == "__init__":
        rest = rest[:-1]
    return ".".join([FOLDERS[folder], *rest])


def framework_files() -> dict[str, Path]:
    """{module name: path} of every file of the framework."""
    return {module_name(path): path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import outside `if TYPE_CHECKING:`, with whether it runs inside a function."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: set[str]) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for each name `node` imports, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [(alias.name, None) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
    found = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        found.append((submodule, None) if submodule in known else (base, alias.name))
    return found


def check_source(module: str, source: str, where: str | None = None, known: set[str] | None = None) -> list[str]:
    """Every broken rule in one file's source: layering, function-local imports, private names, shape."""
    where = where or module
    known = set(LAYERS) if known is None else known
    lines = source.splitlines()
    tree = ast.parse(source)
    problems = []
    if module not in LAYERS:
        problems.append(f"{where}: {module} has no layer: add it to LAYERS in tests/test_layers.py (layering rule)")
    is_package = where.endswith("__init__.py")
    imports = _imports(tree)
    import_lines = {line for node, _ in imports for line in range(node.lineno, node.end_lineno + 1)}
    for node, in_function in imports:
        checked: set[str] = set()
        for target, name in _targets(node, module, is_package, known):
            if target == RECIPES or target.startswith(RECIPES + "."):
                problems.append(f"{where}:{node.lineno}: {module} imports {target}: the framework never imports "
                                "the recipes (layering rule)")
                continue
            if not target.startswith("torchyard."):
                continue
            while target not in LAYERS and "." in target:  # a name imported from a module: that module
                target = target.rsplit(".", 1)[0]
            if name and name.startswith("_") and not name.startswith("__") and target != module:
                problems.append(f"{where}:{node.lineno}: {module} imports the private name {name} from {target}: "
                                "make it public where it is shared (private-name rule)")
            if target in checked:  # several names from one module: its rules once
                continue
            checked.add(target)
            problems += _layering(where, node.lineno, module, target)
            if in_function:
                problems += _function_local(where, node, module, target, lines, import_lines)
    problems += _shape(where, module, tree, len(lines))
    return problems


def _layering(where: str, line: int, module: str, target: str) -> list[str]:
    if target == module or module not in LAYERS:
        return []
    if target not in LAYERS:
        return [f"{where}:{line}: {module} imports {target}, which has no layer in LAYERS (layering rule)"]
    mine, theirs = LAYERS[module], LAYERS[target]
    if theirs < mine or (theirs == mine and (module, target) in SAME_LAYER):
        return []
    return [f"{where}:{line}: {module} (layer {mine}) imports {target} (layer {theirs}): a module imports only "
            "lower layers (layering rule)"]


def _function_local(where: str, node: ast.AST, module: str, target: str, lines: list[str],
                    import_lines: set[int]) -> list[str]:
    if (module, target) not in FUNCTION_LOCAL:
        return [f"{where}:{node.lineno}: {module} imports {target} inside a function: import it at the top, or add "
                "(file, module) with its reason to FUNCTION_LOCAL (function-local import rule)"]
    above = node.lineno - 1
    # One comment above a group of imports covers the group (isort may part it with blank lines).
    while above in import_lines or (above >= 1 and not lines[above - 1].strip()):
        above -= 1
    own = lines[node.lineno - 1:node.end_lineno]
    if any("#" in line for line in own) or (above >= 1 and lines[above - 1].strip().startswith("#")):
        return []
    return [f"{where}:{node.lineno}: {module} imports {target} inside a function without a comment saying why "
            "(function-local import rule)"]


def _shape(where: str, module: str, tree: ast.AST, line_count: int) -> list[str]:
    problems = []
    if line_count > MAX_FILE_LINES and module not in LONG_FILES:
        problems.append(f"{where}: {line_count} lines, over {MAX_FILE_LINES} (shape rule)")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{where}:{node.lineno}: function {node.name} has {length} lines, over "
                                f"{MAX_FUNCTION_LINES} (shape rule)")
    return problems


def check_tree() -> list[str]:
    """Every broken rule over the framework's files."""
    files = framework_files()
    problems = []
    for module, path in files.items():
        problems += check_source(module, path.read_text(), str(path.relative_to(ROOT)), set(files))
    return problems


# ----------------------------------------------------------------------------------------------- the real tree


def test_every_framework_file_has_a_layer_and_every_listed_layer_a_file():
    assert set(framework_files()) == set(LAYERS)


def test_the_framework_keeps_its_layers_its_function_local_imports_and_its_shape():
    problems = check_tree()
    assert not problems, "\n".join(problems)


def test_each_folder_imports_only_the_folders_it_may_and_holds_at_most_a_dozen_modules():
    files = framework_files()
    problems = [problem for module, path in files.items()
                for problem in check_folders(module, path.read_text(), str(path.relative_to(ROOT)), set(files))]
    assert not problems, "\n".join(problems)
    assert set(FOLDER_IMPORTS) == {folder_of(module) for module in files}
    for folder in (ROOT / "trainer").rglob("*/"):
        if (folder / "__init__.py").exists():
            modules = [path for path in folder.glob("*.py") if path.name != "__init__.py"]
            assert len(modules) <= MAX_FOLDER_MODULES, f"trainer/{folder.name}/ holds {len(modules)} modules"
    assert len([path for path in (ROOT / "trainer").glob("*.py")]) <= MAX_FOLDER_MODULES + 2  # + __init__, __main__


def test_every_allowed_function_local_import_is_still_there():
    used = set()
    for module, path in framework_files().items():
        for node, in_function in _imports(ast.parse(path.read_text())):
            if in_function:
                for target, _ in _targets(node, module, path.name == "__init__.py", set(LAYERS)):
                    while target not in LAYERS and "." in target:
                        target = target.rsplit(".", 1)[0]
                    used.add((module, target))
    assert set(FUNCTION_LOCAL) <= used  # an entry whose import has gone is stale: remove it


# ----------------------------------------------------------------------------------------------- broken cases


@pytest.mark.parametrize(("module", "source", "expected"), [
    (f"{T}.module", "from torchyard.trainer.trainer import Trainer\n",
     f"{T}.module:1: {T}.module (layer 5) imports {T}.trainer (layer 18): a module imports only lower layers "
     "(layering rule)"),
    (f"{T}.config", "from torchyard.trainer.loop import loops\n",
     f"{T}.config:1: {T}.config (layer 3) imports {T}.loop.loops (layer 14)"),
    (f"{T}.data.loaders", "from .. import module as m\nfrom ..strategies import base\n",
     f"{T}.data.loaders:2: {T}.data.loaders (layer 7) imports {T}.strategies.base (layer 9)"),
    (f"{T}.trainer", "from torchyard.recipes.digits import DigitsModule\n",
     f"{T}.trainer:1: {T}.trainer imports {RECIPES}.digits: the framework never imports the recipes"),
    (f"{T}.newfile", "x = 1\n", f"{T}.newfile: {T}.newfile has no layer"),
    (f"{T}.loop.step", "from torchyard.trainer.data.loaders import _private_helper\n",
     f"{T}.loop.step:1: {T}.loop.step imports the private name _private_helper from {T}.data.loaders: make it public"),
])
def test_the_layering_checker_reports_an_upward_import(module, source, expected):
    problems = check_source(module, source, known=set(LAYERS))
    assert any(problem.startswith(expected) for problem in problems), problems


@pytest.mark.parametrize(("module", "source", "expected"), [
    (f"{T}.strategies.ddp", "from torchyard.trainer.loop.step import run_step\n",
     f"{T}.strategies.ddp:1: {T}.strategies.ddp (strategies/) imports {T}.loop.step (loop/), which FOLDER_IMPORTS "
     "does not allow strategies/ (folder rule)"),
    (f"{T}.data.loaders", "from torchyard.trainer.launch import elastic\n",
     f"{T}.data.loaders:1: {T}.data.loaders (data/) imports {T}.launch.elastic (launch/)"),
    (f"{T}.cluster.environment", "import torchyard.trainer.cli.main\n",
     f"{T}.cluster.environment:1: {T}.cluster.environment (cluster/) imports {T}.cli.main (cli/)"),
])
def test_the_folder_checker_reports_an_import_its_folder_may_not_make(module, source, expected):
    problems = check_folders(module, source)
    assert any(problem.startswith(expected) for problem in problems), problems


def test_the_folder_checker_takes_its_own_folder_allowed_folders_and_type_checking_imports():
    source = ("from typing import TYPE_CHECKING\nfrom torchyard.trainer.loop import rng\n"
              "from torchyard.trainer.cluster.environment import ClusterEnvironment\n"
              "if TYPE_CHECKING:\n    from torchyard.trainer.trainer import Trainer\n")
    assert check_folders(f"{T}.launch.elastic", source) == []


def test_the_layering_checker_takes_type_checking_imports_and_lower_layers():
    source = ("from typing import TYPE_CHECKING\nfrom torchyard.trainer.errors import MisconfigurationError\n"
              "if TYPE_CHECKING:\n    from torchyard.trainer.trainer import Trainer\n")
    assert check_source(f"{T}.module", source) == []


def test_the_function_local_checker_reports_an_unlisted_import():
    source = "def f():\n    from torchyard.trainer.errors import MisconfigurationError\n    return 1\n"
    assert check_source(f"{T}.data.loaders", source) == [
        f"{T}.data.loaders:2: {T}.data.loaders imports {T}.errors inside a function: import it at the top, or add "
        "(file, module) with its reason to FUNCTION_LOCAL (function-local import rule)"]


def test_the_function_local_checker_wants_a_comment_on_a_listed_import():
    bare = "def plot(args):\n    from torchyard.trainer.logs.plot import plot_runs\n"
    commented = (
        "def plot(args):\n    # matplotlib: only this command needs it\n    from torchyard.trainer.logs.plot import x\n"
    )
    assert check_source(f"{T}.cli.main", bare) == [
        f"{T}.cli.main:2: {T}.cli.main imports {T}.logs.plot inside a function without a comment saying why "
        "(function-local import rule)"]
    assert check_source(f"{T}.cli.main", commented) == []


def test_the_shape_checker_reports_a_long_function_and_a_long_file():
    long_function = "def f():\n" + "    x = 1\n" * 59 + "    return x\n"  # 61 lines
    assert check_source(f"{T}.loop.step", long_function) == [
        f"{T}.loop.step:1: function f has 61 lines, over 60 (shape rule)"]
    assert check_source(f"{T}.loop.step", "def f():\n" + "    x = 1\n" * 58 + "    return x\n") == []  # 60 lines
    assert check_source(f"{T}.loop.step", "x = 1\n" * 501) == [f"{T}.loop.step: 501 lines, over 500 (shape rule)"]
