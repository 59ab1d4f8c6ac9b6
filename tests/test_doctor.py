"""`trainer doctor RUN_DIR` (trainer/diagnosis/doctor.py): where every rank of a running job is now, asked of the
ranks' watchdogs through the job's store without stopping the job; one line and a non-zero status when no job there
answers. SIGUSR1 to a self-launched job's launching process prints the same report."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from diagnosis import cases
from processes import reaped
from test_diagnosis import line_of, position

from torchyard.trainer.cli.main import main
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.diagnosis.doctor import LIVE_JOB_FILE, NoLiveJobError, examine
from torchyard.trainer.diagnosis.markers import Marker
from torchyard.trainer.diagnosis.watchdog import Watchdog, format_report

CASES = Path(cases.__file__).resolve()


@pytest.mark.timeout(120)
def test_trainer_doctor_names_where_each_rank_of_a_running_job_is_and_the_job_goes_on(tmp_path, capsys):
    dozing, root = tmp_path / "dozing", tmp_path / "root"
    run = root / "default" / "version_0"
    job = subprocess.Popen([sys.executable, str(CASES), "doze", "ddp", str(root), str(dozing), "30"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    printed: list[str] = []  # the job's output, read as it comes
    reader = threading.Thread(target=lambda: printed.extend(job.stdout), daemon=True)
    with reaped([job]):
        reader.start()
        until = time.monotonic() + 90
        while not dozing.exists():  # rank 1 has just started to sleep in training_step (until released)
            assert job.poll() is None and time.monotonic() < until, "".join(printed)
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # the launching process prints the same report (asked at the same time)
        code = main(["doctor", str(run)])
        out, err = capsys.readouterr()
        while not any(text.startswith("trainer: SIGUSR1: ") for text in printed) and time.monotonic() < until:
            time.sleep(0.05)
        Path(f"{dozing}.release").touch()  # rank 1 goes on
        job.wait(timeout=90)
        reader.join(10)
    assert code == 0, err
    line = line_of(cases.DozingRank.training_step, "time.sleep(0.2)")
    lines = out.splitlines()
    assert re.fullmatch(
        rf"rank 1 has not reached all_reduce #\d+ \(gradients of step 2\): it is in training_step at cases.py:{line} "
        r"\(time.sleep\(0.2\)\)\. The job runs on \(Trainer\(timeout=60\)\); where every rank is now:", lines[0]), out
    assert re.fullmatch(r"  rank 0 \(.+, pid \d+\): waits in all_reduce #\d+ \(gradients of step 2\); still for \d s",
                        lines[1]), out
    assert re.fullmatch(rf"  rank 1 \(.+, pid \d+\): runs the user's code, in training_step at {re.escape(str(CASES))}:"
                        rf"{line} \(time.sleep\(0.2\)\); still for \d s", lines[2]), out
    assert lines[3:] == ["  (add --stacks to print every rank's whole stack)"]
    output = "".join(printed)
    signalled = output.splitlines()
    at = next(i for i, text in enumerate(signalled) if text.startswith("trainer: SIGUSR1: "))
    assert signalled[at][len("trainer: SIGUSR1: "):].split(". The job")[0] == lines[0].split(". The job")[0], output
    assert signalled[at + 3] == lines[3]
    # The job was not disturbed: it trained to its end, saved its checkpoint, and took its file with it.
    assert job.returncode == 0, output
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert set(saved["state_dict"]) == set(cases.Net().state_dict())
    assert not (run / LIVE_JOB_FILE).exists()


def test_the_live_report_says_the_job_runs_on_and_names_a_rank_that_did_not_answer():
    waiting = position(0, operation="all_reduce", purpose="gradients")
    report = format_report({0: waiting, 1: None}, timeout_s=1800, live=True).splitlines()
    assert report[0] == ("rank 1 did not answer (gone, or running code that holds the GIL). The job runs on "
                         "(Trainer(timeout=1800)); where every rank is now:")
    assert report[2:] == ["  rank 1: no answer", "  (add --stacks to print every rank's whole stack)"]
    computing = position(0, in_user_code=True, function="training_step", file="/home/me/train.py", line=25,
                         code="loss = model(x)", stack='  File "train.py", line 25, in training_step\n')
    report = format_report({0: computing}, timeout_s=20, stacks=True, live=True).splitlines()
    assert report[0] == "no rank waits in a collective. The job runs on (Trainer(timeout=20)); where every rank is now:"
    assert report[2:] == ["  rank 0's stack (innermost last):", '  File "train.py", line 25, in training_step']


def test_a_watchdog_answers_the_doctor_through_the_store_and_a_silent_rank_is_named(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    prefix = "trainer/attempt_0/diagnosis/"
    watchdog = Watchdog(Marker(), dist.PrefixStore(prefix, server), rank=0, world_size=2, timeout_s=0.4)
    job = {"store": f"127.0.0.1:{server.port}", "prefix": prefix, "world_size": 2, "timeout_s": 0.4,
           "host": socket.gethostname(), "pid": os.getpid()}
    (tmp_path / LIVE_JOB_FILE).write_text(json.dumps(job))
    watchdog.start()
    try:
        report = examine(tmp_path, wait_s=0.5).splitlines()
        with pytest.raises(NoLiveJobError, match=r"did not answer within 0.2 s: its ranks have ended"):
            watchdog.stop()
            examine(tmp_path, wait_s=0.2)
    finally:
        watchdog.stop()
    assert report[0] == ("no rank waits in a collective; rank 1 did not answer (gone, or running code that holds the "
                         "GIL). The job runs on (Trainer(timeout=0.4)); where every rank is now:")
    # The test's own thread asked (in the doctor's code): the framework's code, not the user's.
    assert re.fullmatch(r"  rank 0 \(.+\): runs the framework's code \(_collect at doctor.py:\d+\); still for \d s",
                        report[1]), report


def _write_job(folder: Path, **fields) -> None:
    job = {"store": f"127.0.0.1:{find_free_port()}", "prefix": "p/", "world_size": 2, "timeout_s": 60,
           "host": socket.gethostname(), "pid": os.getpid(), **fields}
    (folder / LIVE_JOB_FILE).write_text(json.dumps(job))


def test_doctor_without_a_live_job_prints_one_line_and_fails(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == (f"trainer doctor: error: '{tmp_path / 'missing'}' is not a folder; give the run "
                                       "folder of a running job, e.g. runs/<name>/version_0.\n")
    assert main(["doctor", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"trainer doctor: no job runs in {tmp_path}: it holds no live_job.json (the job ended, has not reached its "
        "first step yet, or runs a single process or diagnosis='off', which have no watchdogs to ask).\n")
    ended = subprocess.Popen(["true"])
    ended.wait()
    _write_job(tmp_path, pid=ended.pid)
    assert main(["doctor", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"trainer doctor: no job runs in {tmp_path}: the process that wrote its live_job.json (pid {ended.pid}) has "
        "ended without removing it (it was killed).\n")
    run = tmp_path / "version_3"  # given the run name's folder, the doctor asks its one running version
    run.mkdir()
    (tmp_path / LIVE_JOB_FILE).rename(run / LIVE_JOB_FILE)
    assert main(["doctor", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(f"trainer doctor: no job runs in {run}: the process that wrote")
    _write_job(tmp_path, store="127.0.0.1:9", host="node7")
    assert main(["doctor", str(tmp_path / LIVE_JOB_FILE)]) == 1
    assert capsys.readouterr().err == (
        f"trainer doctor: the job running in {tmp_path} keeps its store at 127.0.0.1:9 on node7, which only that host "
        "reaches: run `trainer doctor` on node7.\n")
    _write_job(tmp_path, store=f"127.0.0.1:{find_free_port()}")
    started = time.monotonic()
    assert main(["doctor", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - started < 5
    assert re.fullmatch(rf"trainer doctor: the job running in {re.escape(str(tmp_path))} \(pid {os.getpid()} on .+\) "
                        r"does not answer at its store 127.0.0.1:\d+ \(ConnectionRefusedError: .*\): it has ended \(a "
                        r"stale live_job.json\), or this host cannot reach that address.\n", err), err
