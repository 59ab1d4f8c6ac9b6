"""Scoring outside the training loop: the evaluator side process and predictions merged across ranks."""
