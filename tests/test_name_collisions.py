"""A user's own trainer.py, callbacks.py and recipes/ beside their script never shadow the framework. (Every docs
block runs beside a trainer.py and a callbacks.py too: tests/test_docs.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import REPO, add_colliding_modules


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shipped_recipe_runs_beside_a_users_trainer_callbacks_and_recipes(tmp_path: Path) -> None:
    add_colliding_modules(tmp_path, ("trainer.py", "callbacks.py", "recipes/__init__.py", "recipes/models.py"))
    command = [sys.executable, "-m", "torchyard.trainer", "fit", str(REPO / "recipes" / "digits.yaml"),
               "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
               "trainer.enable_progress_bar=false"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "runs").rglob("last.ckpt"))
