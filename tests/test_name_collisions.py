"""A user's own trainer.py, callbacks.py and recipes/ beside their script never shadow the framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import REPO, read_blocks, run_block

SHADOWS = ("trainer.py", "callbacks.py", "recipes/__init__.py", "recipes/models.py")


def add_colliding_modules(folder: Path) -> None:
    """The names a training project commonly has, each failing loudly if the framework imported it."""
    for name in SHADOWS:
        path = folder / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"raise ImportError('the user\\'s own {name} was imported by the framework')\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_example_runs_beside_a_users_trainer_callbacks_and_recipes(tmp_path: Path) -> None:
    add_colliding_modules(tmp_path)
    quickstart = next(block for block in read_blocks(REPO / "README.md") if block.file_name == "quickstart.py")
    done = run_block(tmp_path, quickstart)
    assert done.returncode == 0, done.stdout[-3000:]
    run = tmp_path / "runs" / "default" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shipped_recipe_runs_beside_a_users_trainer_callbacks_and_recipes(tmp_path: Path) -> None:
    add_colliding_modules(tmp_path)
    command = [sys.executable, "-m", "torchyard.trainer", "fit", str(REPO / "recipes" / "digits.yaml"),
               "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
               "trainer.enable_progress_bar=false"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "runs").rglob("last.ckpt"))
