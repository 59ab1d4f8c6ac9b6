"""The README's table of every trainer option, generated from the option schema (`trainer config --reference`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torchyard.trainer.config import TrainerConfig
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.runs import atomic_write_text

README_BEGIN = "<!-- trainer-options:begin (generated: `trainer config --reference --readme README.md`) -->"
README_END = "<!-- trainer-options:end -->"


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else repr(value)


def reference_table() -> str:
    """A Markdown table of every trainer option (key, type, default, meaning), generated from TrainerConfig."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for item in dataclasses.fields(TrainerConfig):
        default = item.default_factory() if item.default is dataclasses.MISSING else item.default  # type: ignore[misc]
        kind = item.metadata["type"] or ("any" if item.type == "Any" else str(item.type))
        # Escaped for Markdown: a bare <name> would render as an (invisible) HTML tag.
        meaning = str(item.metadata["help"]).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        rows.append(f"| `{item.name}` | {kind} | `{_yaml_value(default)}` | {meaning} |")
    return "\n".join(rows) + "\n"


def readme_reference(text: str) -> str | None:
    """The generated table between the README's markers, or None when the markers are missing."""
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin == -1 or end < begin:
        return None
    return text[begin + len(README_BEGIN): end].strip("\n") + "\n"


def update_readme(path: str | Path) -> bool:
    """Rewrite the table between the README's markers; True when it changed."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise MisconfigurationError(
            f"--readme {str(path)!r} cannot be read ({reason}); give the README file to update."
        ) from err
    if readme_reference(text) is None:
        raise MisconfigurationError(
            f"{path} has no {README_BEGIN!r} ... {README_END!r} markers to write the table between."
        )
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    updated = f"{head}{README_BEGIN}\n{reference_table()}{README_END}{tail}"
    if updated != text:
        atomic_write_text(path, updated)
    return updated != text
