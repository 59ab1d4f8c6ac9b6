"""Child processes a test starts: none outlives it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def reaped(processes: Sequence[subprocess.Popen]) -> Iterator[None]:
    """`with reaped(processes):` on leaving (a timeout or a failed assertion included), each process still running
    is killed, with its whole process group where it leads one (started with start_new_session=True, so that its
    own children go too), and waited for."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(process.pid) == process.pid:
                    os.killpg(process.pid, signal.SIGKILL)
                else:
                    process.kill()
            process.wait()
