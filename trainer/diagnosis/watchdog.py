"""The watchdog of one rank: a side thread that notices when the rank stops advancing, publishes where it stands in
the job's TCPStore, and builds the report of a stuck job from every rank's published position.

The training thread pays nothing for it beyond the marker's attribute writes (markers.py): the thread wakes every
`timeout / 8` seconds (at most LOOK_EVERY_S), compares the marker with what it saw last, and writes to the store only
when the rank has not advanced for `timeout / 2` (and once more when it moves again). So by the time a collective
times out on one rank (at `timeout`), every rank that is stuck too, in a collective or in its own code, has left its
position there.

It also answers `trainer doctor` (doctor.py) while the job runs: each time it wakes (at least every LOOK_EVERY_S) it
reads the count of the doctor's requests (one store round trip) and, if there is a new one, leaves its position now
under that request's answer key.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from torchyard.trainer.diagnosis.markers import (
    Marker,
    Position,
    live_frames,
    now,
    position_of,
    traceback_frames,
)

#: A rank that waits in a collective this long past `timeout` without an error (a collective that never raises on
#: its own, an RPC; or gloo's own timeout, late on a machine too busy to run it) is ended by its watchdog, with the
#: same report.
HANG_GRACE_S = 5.0
#: A stuck rank's whole stack is printed with the report where this environment variable is 1.
STACKS_VARIABLE = "TORCHYARD_DIAGNOSIS_STACKS"
#: A watchdog looks at its rank at least this often: also how long `trainer doctor` waits for it at most.
LOOK_EVERY_S = 1.0


def _key(rank: int) -> str:
    return f"position/rank{rank}"


#: The count of `trainer doctor`'s requests to this attempt's ranks: each request adds one, and its number names
#: where the ranks answer it (so that two doctors asking at once each get their answers).
REQUESTS_KEY = "doctor/requests"


def answer_key(request: int, rank: int) -> str:
    """Where `rank`'s watchdog leaves its position for the doctor's request number `request`."""
    return f"doctor/answer/{request}/rank{rank}"


class Watchdog:
    """Watches `marker` from a daemon thread: `start()` once the rank joined the job's `store`, `stop()` at teardown.

    `on_hang(report)` ends the process when a collective waits past `timeout` + HANG_GRACE_S without raising (the
    default prints the report and exits with code 1); a self-launched worker records it for the launching process.
    """

    def __init__(self, marker: Marker, store: Any, rank: int, world_size: int, timeout_s: float,
                 on_hang: Callable[[str], None] | None = None) -> None:
        self.marker, self.store, self.rank, self.world_size = marker, store, rank, world_size
        self.timeout_s = timeout_s
        self.interval_s = min(max(timeout_s / 8, 0.05), LOOK_EVERY_S)
        self.publish_after_s = timeout_s / 2
        self.on_hang = on_hang or _print_and_exit
        self._main_thread = threading.main_thread().ident or 0
        self._stopped = threading.Event()
        self._still_since = now()
        self._thread: threading.Thread | None = None
        self._answered = 0  # the doctor's requests answered so far (REQUESTS_KEY)

    def start(self) -> None:
        # Requests made before this watchdog (an earlier stage's) are not its to answer.
        self._answered = self._try(lambda: self.store.add(REQUESTS_KEY, 0)) or 0
        self._thread = threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self._thread = None

    def still_seconds(self) -> float:
        """How long this rank has not advanced, as of the watchdog's last look."""
        return now() - self._still_since

    def _watch(self) -> None:
        seen, published, hung = self.marker.state(), None, False
        while not self._stopped.wait(self.interval_s):
            state = self.marker.state()
            moved = state != seen
            if moved:
                seen, self._still_since = state, now()
                if published is not None:  # it moved again: its old position no longer says where it is
                    self._try(lambda: self.store.delete_key(_key(self.rank)))
                    published = None
            self._answer_doctor()
            still = self.still_seconds()
            if moved or still < self.publish_after_s:
                continue
            position = self.position()
            if published != state:
                self._try(functools.partial(self.store.set, _key(self.rank), position.to_json()))
                published = state
            if not hung and position.in_collective and still >= self.timeout_s + HANG_GRACE_S:
                hung = True  # the collective did not raise on its own: end the job with the report
                self.on_hang(self.report(position))

    def _answer_doctor(self) -> None:
        """Leave this rank's position now where `trainer doctor` asked for it (doctor.py), if it asked since the last
        look: one store round trip when it did not."""
        requests = self._try(lambda: self.store.add(REQUESTS_KEY, 0)) or 0
        if requests > self._answered:
            answer = self.position().to_json()
            for request in range(self._answered + 1, requests + 1):
                self._try(functools.partial(self.store.set, answer_key(request, self.rank), answer))
            self._answered = requests

    def _try(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception:  # noqa: BLE001 - the store went with the job (rank 0 ended): nothing left to tell
            return None

    def position(self) -> Position:
        """This rank's position now, read off the training thread's live stack."""
        frames, lines = live_frames(self._main_thread)
        return position_of(frames, lines, self.marker, self.rank, self._still_since)

    def error_position(self, error: BaseException) -> Position:
        """This rank's position where `error` (a collective's timeout) was raised."""
        frames, lines = traceback_frames(error)
        return position_of(frames, lines, self.marker, self.rank, self._still_since)

    def positions(self, own: Position) -> dict[int, Position | None]:
        """Every rank's published position (None: it published none), this rank's being `own`."""
        found: dict[int, Position | None] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                found[rank] = own
                continue
            key = _key(rank)
            data = self._try(lambda key=key: self.store.get(key) if self.store.check([key]) else None)
            found[rank] = Position.from_json(data) if data else None
        return found

    def report(self, own: Position) -> str:
        """The report of a stuck job: a headline naming the ranks behind and where they are, then every rank."""
        return format_report(self.positions(own), self.timeout_s, os.environ.get(STACKS_VARIABLE) == "1")


def format_report(positions: dict[int, Position | None], timeout_s: float, stacks: bool = False,
                  live: bool = False) -> str:
    """One headline ("rank 1 never reached all_reduce #57 (gradients of step 5): it is in training_step at
    train.py:25 (time.sleep(600))"), then one line per rank; each stuck rank's stack with `stacks`.

    `live`: the report `trainer doctor` prints of a job that runs on (it names where each rank is now, and with
    `stacks` every rank's stack), instead of the one of a job that stood still for `timeout_s`."""
    waiting = [p for p in positions.values() if p is not None and p.in_collective]
    behind = [p for p in positions.values() if p is not None and not p.in_collective]
    silent = [rank for rank, p in positions.items() if p is None]
    if waiting and not behind:  # all in collectives: those that entered fewer are behind the others
        most = max(p.count for p in waiting)
        behind = [p for p in waiting if p.count < most]
        waiting = [p for p in waiting if p.count == most]
    headline = _headline(waiting, behind if waiting or not live else [], silent, live)
    if live:
        lines = [f"{headline}. The job runs on (Trainer(timeout={timeout_s:g})); where every rank is now:"]
    else:
        lines = [f"{headline}. No rank advanced for {timeout_s:g} s (Trainer(timeout=...)). Every rank:"]
    for rank, p in sorted(positions.items()):
        if p is None:
            lines.append(f"  rank {rank}: " + ("no answer" if live else "no position published"))
            continue
        state = (f"waits in {p.collective()}" if p.in_collective
                 else "runs the user's code" if p.in_user_code else f"runs the framework's code ({p.innermost})")
        user = p.user_line(short=False)
        lines.append(f"  rank {rank} ({p.host}, pid {p.pid}): {state}" + (f", in {user}" if user else "")
                     + f"; still for {max(0.0, now() - p.still_since):.0f} s")
    shown = [p for p in positions.values() if p is not None] if live else behind
    if stacks:
        for p in shown:
            lines.append(f"  rank {p.rank}'s stack (innermost last):\n" + p.stack.rstrip())
    else:
        hint = "add --stacks to print every rank's whole stack" if live else (
            f"set {STACKS_VARIABLE}=1 to print the stuck ranks' whole stacks")
        lines.append(f"  ({hint})")
    return "\n".join(lines)


def _headline(waiting: list[Position], behind: list[Position], silent: list[int], live: bool) -> str:
    """'rank 1 never reached all_reduce #57 (...): it is in ...' for each rank behind; the silent ranks."""
    target = max(waiting, key=lambda p: p.count).collective() if waiting else "the next collective"
    reached = "has not reached" if live else "never reached"
    parts = []
    for p in behind:
        if p.in_collective:
            where = f"waits in {p.collective()}" + (f", called from {p.user_line()}" if p.file else "")
        else:
            where = f"is in {p.user_line() or 'the framework' + chr(39) + 's code (innermost: ' + p.innermost + ')'}"
        parts.append(f"rank {p.rank} {reached} {target}: it {where}")
    if silent:
        told = "did not answer (gone, or running code that holds the GIL)" if live else (
            "told nothing (gone, or running code that holds the GIL)")
        parts.append(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} {told}")
    if live and not waiting:
        return "; ".join(["no rank waits in a collective", *parts])
    return "; ".join(parts) or f"every rank waits in {target}"


def _print_and_exit(report: str) -> None:
    print(f"trainer: the job is stuck: {report}", file=sys.stderr, flush=True)
    os._exit(1)
