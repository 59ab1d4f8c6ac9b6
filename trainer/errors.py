"""The framework's exception types (a user mistake is a MisconfigurationError, so callers, the CLI above all, can print
one line), and how the framework's warnings are shown."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable
from pathlib import Path

# The framework's own source folders: a warning located there is shown without its file and line.
FRAMEWORK_DIRS = tuple(Path(__file__).resolve().parents[1] / name for name in ("trainer", "callbacks"))


class MisconfigurationError(ValueError):
    """A user input is wrong: the message says what was given, what is allowed, and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: missing, truncated, corrupt or not weights-only."""


class Terminated(SystemExit):
    """Raised out of fit once a SIGTERM's (SIGINT's, SIGHUP's) checkpoint is saved; exits the process with
    128 + the signal: 143 (130, 129)."""


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or inf (nonfinite_loss='error')."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within Trainer(timeout=...): another rank is stuck or gone."""


class StartupTimeoutError(RuntimeError):
    """Some ranks of the job did not arrive at its rendezvous within Trainer(timeout=...)."""


class CollectiveMismatchError(RuntimeError):
    """The ranks called different collectives (operation, shapes) at the same point (diagnosis='debug')."""


def closest(name: str, choices: Iterable[str]) -> str:
    """A ' (did you mean ...?)' suffix naming the closest choices, or '' when none is close."""
    matches = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   line: str | None = None) -> str:
    """warnings.formatwarning that names a warning's location only when it is the user's code.

    A warning raised deep inside a fit has no user line to point at; the framework line it would show
    instead (with its source) means nothing to the user, so such a warning reads `Category: message`.
    """
    location = Path(filename).resolve()
    if any(location.is_relative_to(folder) for folder in FRAMEWORK_DIRS):
        return f"{category.__name__}: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning
