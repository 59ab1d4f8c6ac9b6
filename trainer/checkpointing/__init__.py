"""Checkpoints: the file format and its atomic IO, what a checkpoint holds of a run, which file a stage starts
from, and hyperparameters."""
