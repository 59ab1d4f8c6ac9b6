"""Seeding and the RNG states a checkpoint carries so a resumed run draws the same numbers."""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, deterministic: bool = False, workers: bool = True) -> int:
    """Seed python, numpy and torch (all devices); optionally ask torch for deterministic kernels.
    DataLoader workers are always seeded from it (`workers` is Lightning's switch for that, taken as given)."""
    _seed_generators(seed)
    os.environ["PL_GLOBAL_SEED"] = str(seed)  # read by DataLoader workers started later
    if deterministic:
        set_determinism(True)
    return seed


#: torch seeds its generator at start-up from the OS's randomness, with 64 random bits; seeds that people give
#: (seed_everything, torch.manual_seed) are below 2**32, numpy's limit. A module built on a seed at or above it was
#: built before anything seeded the process.
UNSEEDED_FROM = 2**32


def warn_if_weights_unseeded(module: Any, seed: int | None) -> None:
    """Once per module: a Trainer(seed=...) seeds the process when it is built, so a module built before it, in a
    process nothing had seeded, starts from unseeded weights, and two runs of the script differ."""
    built_with = getattr(module, "_built_with_seed", None)
    unseeded = built_with is not None and built_with >= UNSEEDED_FROM
    if seed is None or not unseeded or getattr(module, "_unseeded_warned", False):
        return
    module._unseeded_warned = True
    name = type(module).__name__
    warnings.warn(
        f"{name} was built before Trainer(seed={seed}) seeded this process, so its initial weights are not seeded "
        f"and two runs start from different weights; build the Trainer first (`trainer = Trainer(seed={seed}, ...)`, "
        f"then `{name}(...)`), or call seed_everything({seed}) before building the module.", stacklevel=3)


def _seed_generators(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block on generators seeded with `seed`, and give them back their states afterwards: what it
    draws is the same wherever it runs, and what follows draws as if it had not run."""
    saved = rng_state()
    _seed_generators(seed)
    try:
        yield
    finally:
        set_rng_state(saved)


def set_determinism(deterministic: bool, benchmark: bool | None = None) -> None:
    """Ask torch for deterministic kernels (warning where one has none) and set cuDNN's autotuner (`benchmark`;
    None leaves it as it is, or off when deterministic), as Lightning's options of those names do."""
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # cuBLAS needs this to be deterministic; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if benchmark is not None or deterministic:
        torch.backends.cudnn.benchmark = bool(benchmark)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as weights-only-loadable containers. Python's state is one tensor rather than 625
    ints, each of which the checkpoint's pickler would visit on every save."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": py_gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() returned (its tensors may have been mapped to a GPU on load)."""
    py = state["python"]
    py_state = py["state"].tolist() if isinstance(py["state"], torch.Tensor) else py["state"]  # older: a list
    random.setstate((py["version"], tuple(py_state), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].cpu().numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
