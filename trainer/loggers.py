"""The loggers under Lightning's import path (`lightning.pytorch.loggers` -> `torchyard.trainer.loggers`); they live
in trainer/logs/loggers.py with the rest of what a run records."""

from torchyard.trainer.logs.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "MLFlowLogger", "TensorBoardLogger"]
