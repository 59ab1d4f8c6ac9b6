"""Workers that start warm: a forkserver with torch, torch._dynamo (which DDP imports on its first use), the
framework and the script already imported, started as soon as a Trainer knows it will spawn workers, so that its
start-up overlaps the script's own set-up and each worker is a fork of it instead of a fresh interpreter that
imports all of that again (torchrun's workers do: here they start sooner than torchrun's)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import forkserver, reduction
from typing import Any

from torchyard.trainer.cluster.script_guard import in_spawn_bootstrap, script_call

#: What every worker needs imported; `__main__` is the script (re-imported as `__mp_main__`, as spawn does).
PRELOAD = ["__main__", "torch", "torch.distributed", "torch._dynamo", "torchyard.trainer",
           "torchyard.trainer.launch.elastic"]


def available() -> bool:
    """Whether this platform has a forkserver (Linux and macOS do; Windows spawns)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


def start_early() -> None:
    """Start the forkserver now, for a job whose workers will be spawned (the script calls fit under its main guard,
    or from no script); it imports in the background while the caller goes on."""
    if not available() or in_spawn_bootstrap():
        return
    call = script_call()
    if call is not None and not call.guarded:
        return  # the job's other ranks will run the script's command line instead (script_launch.py)
    start()


def start() -> None:
    """Make sure the forkserver runs (with the preloads); a no-op when it already does."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    with _hangup_ignored():
        forkserver.ensure_running()  # and multiprocessing's resource tracker, which it starts first


@contextlib.contextmanager
def _hangup_ignored() -> Iterator[None]:
    """SIGHUP ignored while the forkserver and the resource tracker start, which keep that (an ignored signal stays
    ignored across exec): a closed terminal sends SIGHUP to its whole process group, and the fit saves last.ckpt on
    it (loop/faults.py), but these two would die of it, and a resource tracker started again says KeyError on its
    first release of a lock the dead one had counted. Workers forked from the forkserver install the fit's handler."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
        yield
        return
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous if previous is not None else signal.SIG_DFL)


class LaunchingProcessState:
    """What a forked worker must take from the launching process at launch time rather than from the forkserver,
    which started earlier: the environment variables, and the standard output and error it writes to (a terminal
    or, under pytest's capture, a file)."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)

    def __reduce__(self) -> tuple[Any, ...]:
        # Called while the worker's start is pickled: under a forkserver, DupFd hands these descriptors to the child.
        streams = [reduction.DupFd(fd) for fd in (1, 2)] if _spawning_with_forkserver() else None
        return _adopt_in_worker, (self.environ, streams)


def _spawning_with_forkserver() -> bool:
    popen = multiprocessing.context.get_spawning_popen()
    return popen is not None and getattr(popen, "method", "") == "forkserver"


def _adopt_in_worker(environ: dict[str, str], streams: list[Any] | None) -> None:
    """In the worker, as it is unpickled (before torch's agent sets the worker's own variables and redirects its
    output): the launching process's variables and standard streams."""
    os.environ.clear()
    os.environ.update(environ)
    for target, stream in zip((1, 2), streams or ()):
        fd = stream.detach()
        os.dup2(fd, target)
        os.close(fd)
