"""`trainer doctor RUN_DIR`: the stuck-job report of watchdog.py, on demand, for a job that still runs.

While a stage of a job whose ranks are watched runs, its global rank 0 keeps `live_job.json` in the run folder
(written atomically once the folder is known, removed when the stage ends): the address of the job's TCPStore, the
key prefix of this attempt's diagnosis there, the number of ranks and the job's timeout. The doctor connects to that
store as one more client and counts one more request there; each rank's watchdog thread sees it at its next look (at
most LOOK_EVERY_S later) and answers with where its training thread is now. The training threads are not interrupted, so
asking does not disturb the job.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchyard.trainer.diagnosis.markers import Position
from torchyard.trainer.diagnosis.watchdog import LOOK_EVERY_S, REQUESTS_KEY, answer_key, format_report
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.runs import atomic_write_text

LIVE_JOB_FILE = "live_job.json"
#: How long the doctor tries to reach the job's store.
CONNECT_TIMEOUT_S = 3.0
#: How long the doctor waits for the ranks' answers: a watchdog looks every LOOK_EVERY_S, plus a busy machine's delay.
ANSWER_WAIT_S = LOOK_EVERY_S + 4.0
_POLL_S = 0.05


class NoLiveJobError(Exception):
    """No job answers for a run folder (none runs there, it ended, or it is out of reach): one line for the user."""


def announce(folder: str | Path, job: dict[str, Any]) -> Path:
    """Leave `job` (Strategy.live_job's address of the watchdogs), this host and pid in `folder`; the file's path."""
    path = Path(folder) / LIVE_JOB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({**job, "host": socket.gethostname(), "pid": os.getpid(),
                                        "started": time.time()}, indent=1) + "\n")
    return path


def withdraw(path: Path) -> None:
    """The stage ended: its job no longer answers there."""
    path.unlink(missing_ok=True)


def examine(run_dir: str | Path, stacks: bool = False, wait_s: float = ANSWER_WAIT_S) -> str:
    """The report of where every rank of the job running in `run_dir` is now (watchdog.format_report's, `live`);
    raises NoLiveJobError when no job there answers, MisconfigurationError when `run_dir` is not a folder."""
    folder = Path(run_dir)
    if folder.name == LIVE_JOB_FILE:
        folder = folder.parent
    if not folder.is_dir():
        raise MisconfigurationError(f"{str(run_dir)!r} is not a folder; give the run folder of a running job, e.g. "
                                    "runs/<name>/version_0.")
    path = _job_file(folder)
    folder, job = path.parent, _read_job(path)
    store = _connect(job, folder)
    try:
        request = store.add(REQUESTS_KEY, 1)
        answers = _collect(store, request, range(int(job["world_size"])), wait_s)
    except dist.DistError as err:  # the store went with the job
        raise NoLiveJobError(f"the job running in {folder} ended while it was asked ({err.__class__.__name__}: "
                             f"{str(err).splitlines()[0]}).") from None
    if not any(answers.values()):
        raise NoLiveJobError(
            f"the job running in {folder} (pid {job['pid']} on {job['host']}, store {job['store']}) did not answer "
            f"within {wait_s:g} s: its ranks have ended or are stopping (a stale {LIVE_JOB_FILE}), or each one holds "
            "the GIL; its own timeout report comes at Trainer(timeout=...).")
    return format_report(answers, float(job["timeout_s"]), stacks, live=True)


def _job_file(folder: Path) -> Path:
    """`folder`'s live_job.json, or, given the folder of a run name (runs/<name>), that of its one running version."""
    path = folder / LIVE_JOB_FILE
    below = [] if path.exists() else sorted(folder.glob(f"*/{LIVE_JOB_FILE}"))
    if len(below) > 1:
        raise NoLiveJobError(f"{folder} holds several running jobs: {', '.join(str(p.parent) for p in below)}; give "
                             "the run folder of one.")
    return below[0] if below else path


def _read_job(path: Path) -> dict[str, Any]:
    """The job `path` names; NoLiveJobError when there is none, or its writer has ended on this host."""
    try:
        job = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoLiveJobError(
            f"no job runs in {path.parent}: it holds no {LIVE_JOB_FILE} (the job ended, has not reached its first "
            "step yet, or runs a single process or diagnosis='off', which have no watchdogs to ask).") from None
    except (OSError, ValueError) as err:
        raise NoLiveJobError(f"cannot read {path}: {err}") from None
    if job.get("host") == socket.gethostname():
        try:
            os.kill(int(job["pid"]), 0)
        except ProcessLookupError:
            raise NoLiveJobError(f"no job runs in {path.parent}: the process that wrote its {LIVE_JOB_FILE} (pid "
                                 f"{job['pid']}) has ended without removing it (it was killed).") from None
        except PermissionError:
            pass  # another user's process: alive
    return job


def _connect(job: dict[str, Any], folder: Path) -> dist.Store:
    """A client of the job's store, under its diagnosis prefix; NoLiveJobError when it cannot be reached."""
    host, _, port = str(job["store"]).rpartition(":")
    if _is_loopback(host) and job["host"] != socket.gethostname():
        raise NoLiveJobError(f"the job running in {folder} keeps its store at {job['store']} on {job['host']}, "
                             f"which only that host reaches: run `trainer doctor` on {job['host']}.")
    try:  # a plain socket first: TCPStore's own failed connect logs C++ tracebacks before it raises
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
        store = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S),
                              wait_for_workers=False)
    except (OSError, dist.DistError) as err:
        raise NoLiveJobError(f"the job running in {folder} (pid {job['pid']} on {job['host']}) does not answer at "
                             f"its store {job['store']} ({err.__class__.__name__}: {err}): it has ended (a stale "
                             f"{LIVE_JOB_FILE}), or this host cannot reach that address.") from None
    return dist.PrefixStore(job["prefix"], store)


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _collect(store: dist.Store, request: int, ranks: range, wait_s: float) -> dict[int, Position | None]:
    """Each rank's answer to `request` that came within `wait_s` (None: none came); the keys read are removed."""
    answers: dict[int, Position | None] = dict.fromkeys(ranks)
    deadline = time.monotonic() + wait_s
    while True:
        for rank in [rank for rank, answer in answers.items() if answer is None]:
            key = answer_key(request, rank)
            if store.check([key]):
                answers[rank] = Position.from_json(store.get(key))
                store.delete_key(key)
        if all(answers.values()) or time.monotonic() > deadline:
            return answers
        time.sleep(_POLL_S)
