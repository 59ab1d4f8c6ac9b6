"""A PyTorch training framework: subclass TrainModule, hand it to a Trainer, pick a strategy."""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from torchyard.trainer.errors import format_warning

if TYPE_CHECKING:
    from torchyard.trainer.datamodule import DataModule
    from torchyard.trainer.loop.rng import seed_everything
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer

__all__ = ["DataModule", "TrainModule", "Trainer", "seed_everything"]
# Imported on first use, not with the package: these import torch (seconds), and the `trainer` command's
# --help and `config --reference` run inside this package without needing it.
_LAZY = {
    "DataModule": "torchyard.trainer.datamodule",
    "TrainModule": "torchyard.trainer.module",
    "seed_everything": "torchyard.trainer.loop.rng",
    "Trainer": "torchyard.trainer.trainer",
}
warnings.formatwarning = format_warning  # the framework's warnings show no framework file:line (see format_warning)


def __getattr__(name: str) -> Any:
    """`trainer.Trainer` and the other public names, imported when first used."""
    if name not in _LAZY:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
