"""The Callback base class and the built-in callbacks."""

from callbacks.base import Callback
from callbacks.checkpoint import ModelCheckpoint
from callbacks.early_stopping import EarlyStopping
from callbacks.lr_monitor import LearningRateMonitor
from callbacks.prediction_writer import BasePredictionWriter
from callbacks.progress import RichProgressBar
from callbacks.summary import ModelSummary
from callbacks.timer import Timer

__all__ = ["BasePredictionWriter", "Callback", "EarlyStopping", "LearningRateMonitor", "ModelCheckpoint", "ModelSummary", "RichProgressBar", "Timer"]
