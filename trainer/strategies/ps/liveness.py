"""Whether the other processes of a ps job are still there, and a graceful RPC shutdown that does not wait for one
that is gone.

torch's graceful `rpc.shutdown` gathers every rank of the job before any leaves, with no timeout: one process that
died (killed, out of memory) leaves the others waiting in it until something kills them (torch's elastic agent
does after 30 s). Here it runs on a thread of its own while the calling thread asks a `watch` function, a few
times a second, whether a process the job still needs stopped answering; if one did, this process leaves at once
and raises `PeerGone` naming it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from torch.distributed import rpc

POLL_S = 0.25  # how often the watch runs while the shutdown waits
# An RPC to a process that is gone fails at once (refused, or its pipe closed); one that runs out of time met a
# process too busy to answer (a loaded machine), which is no reason to stop the job.
PROBE_TIMEOUT_S = 10.0
GRACE_S = 2.0  # a process that left as the shutdown completed is no loss: the shutdown gets this long to end

_ABORTED: list[str] = []  # why the job was stopped, as a server told this worker (tell_aborted)


class PeerGone(RuntimeError):
    """A process the job needs stopped answering, so this one left without waiting for it."""


def answer() -> bool:
    """RPC entry point of a probe: that this process answers."""
    return True


def first_gone(names: Iterable[str]) -> str | None:
    """The first of the RPC workers `names` that does not answer a probe, else None."""
    for name in names:
        asked = time.monotonic()
        try:
            rpc.rpc_sync(name, answer, timeout=PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - refused, pipe closed: it is not there to answer
            if time.monotonic() - asked < PROBE_TIMEOUT_S / 2:  # else it timed out: busy, not gone
                return name
    return None


def aborted(reason: str) -> None:
    """RPC entry point: a server stopped the job (`reason`); this worker's watched shutdown leaves at once."""
    _ABORTED[:] = [reason]


def abort_reason() -> str | None:
    """Why a server stopped the job, if one told this process."""
    return _ABORTED[0] if _ABORTED else None


def tell_aborted(names: Iterable[str], reason: str) -> None:
    """Tell the workers `names` that the job stopped (best effort: one gone too is not waited for)."""
    futures = []
    for name in names:
        try:
            futures.append(rpc.rpc_async(name, aborted, args=(reason,), timeout=PROBE_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - it cannot be reached: nothing to tell
            continue
    for future in futures:
        try:
            future.wait()
        except Exception:  # noqa: BLE001 - as above
            continue


def graceful_shutdown_watched(watch: Callable[[], str | None]) -> None:
    """rpc.shutdown(graceful=True), unless `watch` names a reason (a process gone) before it ends: then shut down
    at once and raise PeerGone(reason)."""
    failures: list[BaseException] = []

    def leave() -> None:
        try:
            rpc.shutdown(graceful=True)
        except BaseException as err:  # noqa: BLE001 - handed to the calling thread
            failures.append(err)

    _ABORTED.clear()
    leaving = threading.Thread(target=leave, name="ps-graceful-shutdown", daemon=True)
    leaving.start()
    while leaving.is_alive():
        leaving.join(POLL_S)
        reason = watch() if leaving.is_alive() else None
        if reason is not None:
            leaving.join(GRACE_S)
            if leaving.is_alive():
                # The thread stays blocked in the gather that can no longer complete; as a daemon it ends with us.
                rpc.shutdown(graceful=False)
                raise PeerGone(reason)
    if failures:
        raise failures[0]
