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
    # 0: the exception types and message helpers every file raises with
    f"{T}.errors": 0,
    # 1: leaf helpers that import nothing of the framework but errors: the process environment, seeding, run
    #    folders, fault signals, checkpoint files, batch order and device moves, the Callback interface, where
    #    the running script called us (under its main guard or not), and glibc's malloc settings
    f"{T}.environment": 1, f"{T}.rng": 1, f"{T}.runs": 1, f"{T}.faults": 1, f"{T}.checkpoint": 1,
    f"{T}.batches": 1, f"{C}.base": 1, f"{T}.combined": 1, f"{T}.hparams": 1, f"{T}.script_guard": 1,
    f"{T}.samplers": 1, f"{T}.host_memory": 1,
    # 2: the metric writers (CSV, TensorBoard); the option schema checks a `loggers` entry against their base class;
    #    the forkserver that the workers of a spawned job fork from (it asks where the script called us)
    f"{T}.loggers": 2, f"{T}.warm_start": 2,
    #    and the checks every node of a multi-node job runs before the nodes meet
    f"{T}.node_checks": 2,
    # 3: the option schema: every Trainer option, its checks, the run's config.yaml; the evaluator's record of a run
    f"{T}.config": 3, f"{T}.evaluation_record": 3,
    # 4: optimizers/schedulers and precision, which read their value sets from the schema; the README options table
    f"{T}.optim": 4, f"{T}.precision": 4, f"{T}.options_table": 4,
    # 5: the user's base class
    f"{T}.module": 5,
    # 6: the user's DataModule and the loaders built from it
    f"{T}.data": 6,
    # 7: what is built on the loaders: metric collection, and prediction outputs merged across ranks
    f"{T}.logging": 7, f"{T}.predictions": 7,
    # 8-11: the strategies: shared pieces, then the strategies, each above the ones it extends
    f"{T}.strategies.distributed": 8, f"{T}.strategies.pipeline_split": 8, f"{T}.strategies.base": 8,
    f"{T}.strategies.comm_timing": 8,
    f"{T}.strategies": 9, f"{T}.strategies.process_group": 9, f"{T}.strategies.single": 9,
    f"{T}.strategies.dp": 9, f"{T}.strategies.ps_server": 9,
    f"{T}.strategies.fsdp_checkpoint": 9,
    f"{T}.strategies.ddp": 10, f"{T}.strategies.ps_client": 10, f"{T}.strategies.fsdp": 10,
    f"{T}.strategies.ps": 11, f"{T}.strategies.pipeline": 11,
    # 12: the pieces of a run: loop counters, one step, checkpoint state, hook dispatch, resuming
    f"{T}.loop_state": 12, f"{T}.step": 12, f"{T}.state": 12, f"{T}.hooks": 12, f"{T}.resume": 12,
    # 13: the fit / evaluation / predict loops
    f"{T}.loop": 13,
    # 14-15: the built-in callbacks, then their package (trainer.py builds the default ones)
    f"{C}.checkpoint": 14, f"{C}.early_stopping": 14, f"{C}.lr_monitor": 14, f"{C}.prediction_writer": 14,
    f"{C}.progress": 14, f"{C}.gradient_accumulation": 14, f"{C}.profilers": 14, f"{C}.summary": 14, f"{C}.timer": 14,
    #     and the evaluator side process's callback (it validates with the Trainer class it is handed, not imports)
    f"{T}.evaluator": 14, f"{C}.step_timing": 14,
    C: 15,
    # 15: a script without a main guard re-run for the job's other ranks (Lightning's launch), which launcher uses
    f"{T}.script_launch": 15,
    # 16: what the Trainer calls before a stage (option and module checks, default callbacks), to start processes,
    #     and the read-only state it shows
    f"{T}.preflight": 16, f"{T}.launcher": 16, f"{T}.ray_launcher": 16, f"{T}.trainer_properties": 16,
    # 17: the Trainer
    f"{T}.trainer": 17,
    # 18: the package's public names (lazily), recipe class checks, plots of finished runs
    T: 18, f"{T}.signatures": 18, f"{T}.plot": 18,
    # 19-22: the YAML recipes and the command line on top of them
    f"{T}.recipe": 19, f"{T}.submit": 20, f"{T}.hosts": 20, f"{T}.cli": 21, f"{T}.__main__": 22,
    # 18-20: the report of a scaling study, then the study itself (runs recipes at layouts: the recipe layer)
    f"{T}.scale_report": 18, f"{T}.scale": 20,
}

# Same-layer imports that are allowed, (importer, imported): reason.
SAME_LAYER: dict[tuple[str, str], str] = {
    (f"{T}.ray_launcher", f"{T}.launcher"): "a Ray worker's failure is raised as a self-launched one's",
}

CLI_REASON = "the CLI imports the framework (and with it torch) inside a command, so that `trainer --help` is fast"
FUNCTION_LOCAL: dict[tuple[str, str], str] = {
    (f"{T}.cli", T): CLI_REASON,
    (f"{T}.cli", f"{T}.recipe"): CLI_REASON,
    (f"{T}.cli", f"{T}.resume"): CLI_REASON,
    (f"{T}.cli", f"{T}.batches"): CLI_REASON,
    (f"{T}.cli", f"{T}.checkpoint"): CLI_REASON,
    (f"{T}.cli", f"{T}.strategies.fsdp_checkpoint"): CLI_REASON,
    (f"{T}.cli", f"{T}.plot"): "matplotlib, needed only by `trainer plot`",
    (f"{T}.submit", f"{T}.recipe"): CLI_REASON,
    (f"{T}.hosts", f"{T}.recipe"): CLI_REASON,
    (f"{T}.cli", f"{T}.scale"): CLI_REASON,
    (f"{T}.trainer", f"{T}.launcher"): "torch's elastic agent takes 150 ms to import; only a started job needs it",
    (f"{T}.cli", f"{T}.evaluator"): CLI_REASON,
    (f"{T}.trainer", f"{T}.ray_launcher"): "it imports the elastic agent's launcher; only launcher='ray' needs it",
}

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
     f"{T}.module:1: {T}.module (layer 5) imports {T}.trainer (layer 17): a module imports only lower layers "
     "(layering rule)"),
    (f"{T}.config", "from torchyard.trainer import loop\n",
     f"{T}.config:1: {T}.config (layer 3) imports {T}.loop (layer 13)"),
    (f"{T}.data", "from . import module as m\nfrom .strategies import base\n",
     f"{T}.data:2: {T}.data (layer 6) imports {T}.strategies.base (layer 8)"),
    (f"{T}.trainer", "from torchyard.recipes.digits import DigitsModule\n",
     f"{T}.trainer:1: {T}.trainer imports {RECIPES}.digits: the framework never imports the recipes"),
    (f"{T}.newfile", "x = 1\n", f"{T}.newfile: {T}.newfile has no layer"),
    (f"{T}.step", "from torchyard.trainer.data import _private_helper\n",
     f"{T}.step:1: {T}.step imports the private name _private_helper from {T}.data: make it public"),
])
def test_the_layering_checker_reports_an_upward_import(module, source, expected):
    problems = check_source(module, source, known=set(LAYERS))
    assert any(problem.startswith(expected) for problem in problems), problems


def test_the_layering_checker_takes_type_checking_imports_and_lower_layers():
    source = ("from typing import TYPE_CHECKING\nfrom torchyard.trainer.errors import MisconfigurationError\n"
              "if TYPE_CHECKING:\n    from torchyard.trainer.trainer import Trainer\n")
    assert check_source(f"{T}.module", source) == []


def test_the_function_local_checker_reports_an_unlisted_import():
    source = "def f():\n    from torchyard.trainer.errors import MisconfigurationError\n    return 1\n"
    assert check_source(f"{T}.data", source) == [
        f"{T}.data:2: {T}.data imports {T}.errors inside a function: import it at the top, or add (file, module) "
        "with its reason to FUNCTION_LOCAL (function-local import rule)"]


def test_the_function_local_checker_wants_a_comment_on_a_listed_import():
    bare = "def plot(args):\n    from torchyard.trainer.plot import plot_runs\n"
    commented = (
        "def plot(args):\n    # matplotlib: only this command needs it\n    from torchyard.trainer.plot import x\n"
    )
    assert check_source(f"{T}.cli", bare) == [
        f"{T}.cli:2: {T}.cli imports {T}.plot inside a function without a comment saying why "
        "(function-local import rule)"]
    assert check_source(f"{T}.cli", commented) == []


def test_the_shape_checker_reports_a_long_function_and_a_long_file():
    long_function = "def f():\n" + "    x = 1\n" * 59 + "    return x\n"  # 61 lines
    assert check_source(f"{T}.step", long_function) == [
        f"{T}.step:1: function f has 61 lines, over 60 (shape rule)"]
    assert check_source(f"{T}.step", "def f():\n" + "    x = 1\n" * 58 + "    return x\n") == []  # 60 lines
    assert check_source(f"{T}.step", "x = 1\n" * 501) == [f"{T}.step: 501 lines, over 500 (shape rule)"]
