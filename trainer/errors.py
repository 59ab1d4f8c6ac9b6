"""The one exception type for user mistakes, so callers (the CLI above all) can print one line."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MisconfigurationError(ValueError):
    """A user input is wrong: the message says what was given, what is allowed, and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: missing, truncated, corrupt or not weights-only."""


def closest(name: str, choices: Iterable[str]) -> str:
    """A ' (did you mean ...?)' suffix naming the closest choices, or '' when none is close."""
    matches = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""
