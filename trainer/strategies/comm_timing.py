"""How long a DDP backward waits for its gradient all-reduce: a wrapper around any DDP communication hook."""

# No `from __future__ import annotations`: DDP's register_comm_hook compares the hook's annotations with the
# real dist.GradBucket and Future types, which strings are not.
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class CommunicationTimer:
    """Wraps a DDP communication hook and adds up, per backward, the seconds from handing the last gradient bucket
    to the hook until its all-reduce is done: the communication that backward's compute did not hide.

    DDP hands bucket 0 (`bucket.is_last()`) over once every gradient is computed, and the backward returns only when
    its all-reduce completes; earlier buckets overlap with the compute still going on. On CUDA the future completes
    when the collective is enqueued, so there the wait shows only with the profiler (`trainer scale` says so).
    """

    def __init__(self, hook: Hook, state: Any) -> None:
        self.hook = hook
        self.state = state
        self.seconds = 0.0  # this rank's total wait since set-up
        self.window_seconds = 0.0  # from each backward's first bucket to its all-reduce's end: overlap included
        self.backward_passes = 0
        self._first_handed_over: float | None = None

    def run(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The wrapped hook's future for `bucket`; timed when it is the backward's last bucket."""
        handed_over = time.perf_counter()
        if self._first_handed_over is None:
            self._first_handed_over = handed_over
        future = self.hook(self.state, bucket)
        if not bucket.is_last():
            return future
        first, self._first_handed_over = self._first_handed_over, None

        def done(finished: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            now = time.perf_counter()
            self.seconds += now - handed_over
            self.window_seconds += now - first
            self.backward_passes += 1
            return finished.value()

        return future.then(done)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Count a blocking collective outside backward too (local SGD's parameter averaging)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


def timed_hook(timer: CommunicationTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook DDP calls (`register_comm_hook(state=timer, hook=timed_hook)`): the timer runs the real one."""
    return timer.run(bucket)
