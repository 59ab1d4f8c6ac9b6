"""Models and data modules the shipped recipes name: small, readable examples to copy.

    digits.py   a CNN on scikit-learn's 8x8 digits (recipes/digits.yaml)
    charlm.py   a character-level transformer on the Python standard library's source (recipes/charlm.yaml)
"""

from __future__ import annotations

from torchyard.trainer.errors import MisconfigurationError


def check_loader_args(owner: str, batch_size: int, num_workers: int) -> None:
    """Reject DataLoader arguments torch would only refuse once the fit starts, with a traceback."""
    if batch_size < 1:
        raise MisconfigurationError(f"{owner}: batch_size={batch_size} must be at least 1 "
                                    "(data.init_args.batch_size in a recipe).")
    if num_workers < 0:
        raise MisconfigurationError(f"{owner}: num_workers={num_workers} must be 0 or more "
                                    "(data.init_args.num_workers in a recipe).")


def check_optimizer_args(owner: str, lr: float, weight_decay: float) -> None:
    """Reject optimizer arguments torch would only refuse once the fit starts, with a traceback."""
    if not lr > 0:  # also catches NaN
        raise MisconfigurationError(f"{owner}: lr={lr} must be a positive learning rate "
                                    "(model.init_args.lr in a recipe).")
    if not weight_decay >= 0:
        raise MisconfigurationError(f"{owner}: weight_decay={weight_decay} must be 0 or more "
                                    "(model.init_args.weight_decay in a recipe).")
