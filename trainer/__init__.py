"""A PyTorch training framework: subclass TrainModule, hand it to a Trainer, pick a strategy."""

from trainer.data import DataModule
from trainer.module import TrainModule
from trainer.rng import seed_everything
from trainer.trainer import Trainer

__all__ = ["DataModule", "TrainModule", "Trainer", "seed_everything"]
