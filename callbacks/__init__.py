"""The Callback base class and the built-in callbacks."""

from torchyard.callbacks.base import Callback
from torchyard.callbacks.checkpoint import ModelCheckpoint
from torchyard.callbacks.early_stopping import EarlyStopping, EarlyStoppingReason
from torchyard.callbacks.gradient_accumulation import GradientAccumulationScheduler
from torchyard.callbacks.lr_monitor import LearningRateMonitor
from torchyard.callbacks.prediction_writer import BasePredictionWriter
from torchyard.callbacks.progress import RichProgressBar, TQDMProgressBar
from torchyard.callbacks.step_timing import StepTiming
from torchyard.callbacks.summary import ModelSummary
from torchyard.callbacks.timer import Timer

__all__ = [
    "BasePredictionWriter",
    "Callback",
    "EarlyStopping",
    "EarlyStoppingReason",
    "GradientAccumulationScheduler",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "RichProgressBar",
    "TQDMProgressBar",
    "StepTiming",
    "Timer",
]
