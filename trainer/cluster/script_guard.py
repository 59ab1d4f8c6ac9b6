"""Where the running script called into the framework: under `if __name__ == "__main__":` or at its top level,
which decides how a job's other processes are started (trainer/launch/elastic.py)."""

from __future__ import annotations

import ast
import inspect
import multiprocessing
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GUARD_HINT = 'put the code that builds the Trainer and calls fit under `if __name__ == "__main__":`'


@dataclass(frozen=True)
class ScriptCall:
    """The line of the script's top-level code that led to the call, and whether a main guard holds it."""

    path: str
    line: int
    guarded: bool


def script_call() -> ScriptCall | None:
    """Where the `__main__` script's top-level code called us; None from an interactive session, `python -c`, a
    notebook or a script that cannot be read (nothing re-imports those)."""
    frame = inspect.currentframe()
    while frame is not None and not (
        frame.f_globals.get("__name__") == "__main__" and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None:
        return None
    path, line = frame.f_code.co_filename, frame.f_lineno
    del frame
    tree = script_tree(path)
    if tree is None:
        return None
    return ScriptCall(path, line, guard_holds(tree, line))


def guard_holds(tree: ast.Module, line: int) -> bool:
    """Whether `line` of the module's own code lies inside `if __name__ == "__main__":` (nested in other blocks
    too, e.g. in `if mode == "x":`)."""
    return any(guard.body[0].lineno <= line <= (guard.body[-1].end_lineno or line) for guard in _guards(tree.body))


def in_spawn_bootstrap() -> bool:
    """True while a spawned (or forkserver) child re-imports the parent's main module."""
    # multiprocessing flags such a child (and refuses to start processes then); the flag is private, so it is
    # read here only, defensively.
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def script_tree(path: str) -> ast.Module | None:
    """The script's syntax tree; None when it cannot be read or parsed (the checks on it are then skipped)."""
    try:
        return ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None


def names_bound_only_under_the_guard() -> tuple[str, set[str]]:
    """(the script's path, the classes and functions it defines only inside `if __name__ == "__main__":`)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    tree = script_tree(path) if path else None
    if tree is None:
        return "", set()
    definitions = _definitions(tree.body, guarded=False)
    return str(path), {name for name, guarded in definitions if guarded} - {
        name for name, guarded in definitions if not guarded
    }


def _tests_dunder_name(test: ast.expr) -> bool:
    return any(isinstance(node, ast.Name) and node.id == "__name__" for node in ast.walk(test))


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _guards(statements: list[ast.stmt]) -> list[ast.If]:
    """Every `if` testing `__name__` in the module's own code, nested in other blocks too (not in functions)."""
    found: list[ast.If] = []
    for node in statements:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and _tests_dunder_name(node.test):
            found.append(node)
        for block in _BLOCKS:
            found += _guards(getattr(node, block, []))
    return found


def _definitions(statements: list[Any], guarded: bool) -> list[tuple[str, bool]]:
    """(name, defined under a main guard) of each class and function the statements define, in blocks too."""
    found: list[tuple[str, bool]] = []
    for node in statements:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node.name, guarded))
            continue
        is_guard = isinstance(node, ast.If) and _tests_dunder_name(node.test)
        for block in _BLOCKS:
            found += _definitions(getattr(node, block, []), guarded or (is_guard and block == "body"))
    return found
