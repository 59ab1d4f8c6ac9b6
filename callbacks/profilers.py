"""Profilers (Trainer(profiler="simple" | "advanced" | "pytorch") or an instance): time a fit and report at its end.

Each is a callback: it measures between the hooks the loop fires anyway, so a fit without one pays nothing.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from torchyard.callbacks.base import Callback
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.runs import atomic_write_text

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer


class Profiler(Callback):
    """Profiles each stage from its setup to its teardown; the summary is printed on rank 0 then, or, with
    `dirpath`, written to `<dirpath>/<stage>-<filename>.txt` (every rank, `-rank<n>` added beyond rank 0)."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        self.dirpath, self.filename = dirpath, filename or "profile"
        self.last_summary = ""
        self.stage: str | None = None  # the stage being profiled, from its setup to its teardown

    def start_profiling(self, stage: str) -> None: ...

    def stop_profiling(self) -> None: ...

    def summary(self) -> str:
        """The report of what was profiled so far."""
        raise NotImplementedError

    @override
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self.stage = stage
        self.start_profiling(stage)

    @override
    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if self.stage is None:
            return  # the stage failed before its callbacks were set up: nothing was profiled
        self.stop_profiling()
        self.stage = None
        self.last_summary = f"{type(self).__name__} report ({stage}):\n{self.summary()}"
        if self.dirpath is None:
            if trainer.is_global_zero:
                print(self.last_summary, flush=True)
            return
        suffix = f"-rank{trainer.global_rank}" if trainer.global_rank else ""
        path = Path(self.dirpath) / f"{stage}-{self.filename}{suffix}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.last_summary + "\n")


#: (the action's name, the hook that starts it, the hook that ends it)
_TIMED = (("run_training_epoch", "on_train_epoch_start", "on_train_epoch_end"),
          ("run_training_batch", "on_train_batch_start", "on_train_batch_end"),
          ("run_validation", "on_validation_start", "on_validation_end"),
          ("run_validation_batch", "on_validation_batch_start", "on_validation_batch_end"),
          ("run_test_batch", "on_test_batch_start", "on_test_batch_end"),
          ("run_predict_batch", "on_predict_batch_start", "on_predict_batch_end"))


class SimpleProfiler(Profiler):
    """Wall time of the stage, its epochs, batches and validations: mean, calls, total and share, per action."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        super().__init__(dirpath, filename)
        self.recorded_durations: dict[str, list[float]] = defaultdict(list)
        self._started: dict[str, float] = {}
        for action, start, end in _TIMED:
            setattr(self, start, self._starter(action))
            setattr(self, end, self._stopper(action))

    def _starter(self, action: str) -> Any:
        def start(*_: Any) -> None:
            self._started[action] = time.perf_counter()
        return start

    def _stopper(self, action: str) -> Any:
        def stop(*_: Any) -> None:
            began = self._started.pop(action, None)
            if began is not None:
                self.recorded_durations[action].append(time.perf_counter() - began)
        return stop

    @override
    def start_profiling(self, stage: str) -> None:
        self._started[stage] = time.perf_counter()

    @override
    def stop_profiling(self) -> None:
        self._stopper(self.stage)()
        self._reported_stage = self.stage

    @override
    def summary(self) -> str:
        """Each action's durations; the share is of the last profiled stage's whole time."""
        total = sum(self.recorded_durations.get(getattr(self, "_reported_stage", None) or "", [])) or 1e-12
        rows = [f"{'Action':<24}| {'Mean (s)':>10} | {'Calls':>6} | {'Total (s)':>10} | {'Share':>7}"]
        ordered = sorted(self.recorded_durations.items(), key=lambda item: -sum(item[1]))
        for action, durations in ordered:
            spent = sum(durations)
            rows.append(f"{action:<24}| {spent / len(durations):>10.5f} | {len(durations):>6} | {spent:>10.4f} | "
                        f"{100 * spent / total:>6.1f}%")
        return "\n".join(rows)


class AdvancedProfiler(Profiler):
    """cProfile over the whole stage: the `line_count_restriction` functions with the most cumulative time."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None,
                 line_count_restriction: int = 20) -> None:
        super().__init__(dirpath, filename)
        self.line_count_restriction = line_count_restriction
        self.profile = cProfile.Profile()

    @override
    def start_profiling(self, stage: str) -> None:
        self.profile = cProfile.Profile()
        self.profile.enable()

    @override
    def stop_profiling(self) -> None:
        self.profile.disable()

    @override
    def summary(self) -> str:
        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats("cumulative").print_stats(self.line_count_restriction)
        return text.getvalue()


class PyTorchProfiler(Profiler):
    """torch.profiler over the whole stage (CPU, and CUDA where the run uses it): the operators with the most time."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, row_limit: int = 20,
                 sort_by_key: str = "self_cpu_time_total") -> None:
        super().__init__(dirpath, filename)
        self.row_limit, self.sort_by_key = row_limit, sort_by_key
        self.profiler: torch.profiler.profile | None = None

    @override
    def start_profiling(self, stage: str) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    @override
    def stop_profiling(self) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)

    @override
    def summary(self) -> str:
        if self.profiler is None:
            return ""
        return self.profiler.key_averages().table(sort_by=self.sort_by_key, row_limit=self.row_limit)


PROFILER_CLASSES = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}


def build_profiler(spec: Any) -> Profiler | None:
    """The profiler the `profiler` option names (a name or an instance), or None."""
    if spec is None:
        return None
    if isinstance(spec, Profiler):
        return spec
    if spec not in PROFILER_CLASSES:
        raise MisconfigurationError(f"profiler={spec!r} is not known; use one of {', '.join(PROFILER_CLASSES)}, a "
                                    "Profiler instance, or unset.")
    return PROFILER_CLASSES[spec]()
