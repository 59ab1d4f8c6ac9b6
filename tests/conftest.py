"""Isolation for every test: no process group, environment variable or cwd leaks into the next."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    saved_env = dict(os.environ)
    # Ray's driver swaps builtins.print for its progress-bar-safe one once a worker's bar is relayed; a later test
    # that compiles a print would see a graph break in Ray's file instead of its own.
    monkeypatch.setattr(builtins, "print", builtins.print)
    monkeypatch.chdir(tmp_path)
    # Child processes started by a test must not oversubscribe CI's two cores.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved_env)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that starts processes as slow: by the project's rule each one carries a timeout."""
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory) -> tuple[dict, Path]:
    """tests/faults/fault_script.py's uninterrupted ddp run on 2 processes the Trainer starts itself: its final
    weights and its root folder. Once per session: the fault tests and the Ray launcher's compare with it."""
    from faults.fault_script import fit  # the tests' shared script, imported only by the tests that use it

    root = tmp_path_factory.mktemp("ddp_reference")
    return fit(root, "ddp").state_dict(), root
