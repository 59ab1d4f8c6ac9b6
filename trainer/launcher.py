"""Starting the other processes of a job when the script was not started by a launcher."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer.errors import MisconfigurationError

if TYPE_CHECKING:
    from trainer.trainer import Trainer


def launch(trainer: Trainer, stage: str, *run_args: Any) -> dict[str, Any]:
    """Run `trainer._run(stage, *run_args)` on every process of the job; return rank 0's outcome."""
    raise MisconfigurationError(f"strategy {trainer.strategy.name!r} needs {trainer.strategy.job_size} processes, "
                                "but no multi-process launcher is available yet.")
