"""A job that goes wrong says who and where (trainer/diagnosis/): the report of a stuck rank, read off real stacks,
and the jobs of tests/diagnosis/cases.py run for real on every strategy."""

from __future__ import annotations

import csv
import inspect
import os
import re
import socket
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch
from diagnosis import cases

from torchyard.trainer.cluster.environment import ClusterEnvironment, find_free_port
from torchyard.trainer.diagnosis import flight_recorder
from torchyard.trainer.diagnosis.flight_recorder import describe
from torchyard.trainer.diagnosis.markers import Marker, Position, live_frames, position_of
from torchyard.trainer.diagnosis.stragglers import StragglerWatch, slowest_rank
from torchyard.trainer.diagnosis.watchdog import HANG_GRACE_S, format_report
from torchyard.trainer.errors import CollectiveMismatchError, CollectiveTimeoutError, StartupTimeoutError
from torchyard.trainer.strategies import distributed

TIMEOUT = 5.0


def line_of(function, text: str) -> int:
    """The line number of the first line of `function` that holds `text`."""
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def position(rank: int, **fields) -> Position:
    base = dict(rank=rank, host="node0", pid=100 + rank, step=5, count=57, operation=None, purpose="",
                torch_call=None, in_user_code=False, innermost="wait at x.py:1", function=None, file=None, line=None,
                code=None, still_since=time.time() - 30, stack="")
    return Position(**{**base, **fields})


def test_the_report_names_the_rank_that_never_reached_the_collective_and_its_line():
    waiting = position(0, operation="all_reduce", purpose="gradients")
    stuck = position(1, count=56, in_user_code=True, function="training_step", file="/home/me/train.py", line=25,
                     code="time.sleep(600)")
    report = format_report({0: waiting, 1: stuck, 2: None}, timeout_s=20)
    lines = report.splitlines()
    assert lines[0] == (
        "rank 1 never reached all_reduce #57 (gradients of step 5): it is in training_step at train.py:25 "
        "(time.sleep(600)); rank 2 told nothing (gone, or running code that holds the GIL). No rank advanced for "
        "20 s (Trainer(timeout=...)). Every rank:")
    assert lines[1] == "  rank 0 (node0, pid 100): waits in all_reduce #57 (gradients of step 5); still for 30 s"
    assert lines[2] == ("  rank 1 (node0, pid 101): runs the user's code, in training_step at /home/me/train.py:25 "
                        "(time.sleep(600)); still for 30 s")
    assert lines[3] == "  rank 2: no position published"


def test_ranks_all_in_collectives_report_the_ones_that_entered_fewer_as_behind():
    ahead = position(0, operation="barrier", purpose="save_checkpoint", count=58)
    behind = position(1, operation="all_reduce", purpose="gradients", count=57)
    headline = format_report({0: ahead, 1: behind}, timeout_s=20).splitlines()[0]
    assert headline.startswith("rank 1 never reached barrier #58 (save_checkpoint of step 5): it waits in "
                               "all_reduce #57 (gradients of step 5)")


def _sleeps_in_user_code(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(30)  # the line the position must name


def test_a_position_read_off_a_live_stack_names_the_innermost_user_frame_and_its_source_line():
    started, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=_sleeps_in_user_code, args=(started, release))
    thread.start()
    try:
        started.wait(10)
        marker = Marker()
        marker.enter("all_reduce", "gradients")  # the marker alone does not put a rank that runs user code in it
        frames, lines = live_frames(thread.ident)
        found = position_of(frames, lines, marker, rank=3, still_since=time.time())
    finally:
        release.set()
        thread.join()
    assert (found.function, Path(found.file).name, found.code) == (
        "_sleeps_in_user_code", "test_diagnosis.py", "release.wait(30)  # the line the position must name")
    assert found.line == line_of(_sleeps_in_user_code, "release.wait(30)")
    assert found.in_user_code and not found.in_collective


# What the report says each strategy's waiting rank waits in, and where the stuck rank 1 blocks.
WAITS_IN = {
    "ddp": r"all_reduce #\d+ \(gradients of step 5\)",
    "fsdp": r"reduce_scatter #\d+ \(gradients of step 5\)",
    "pipeline": r"send/recv #\d+ \(the stages' activations and gradients of step 5\)",
    "ps": r"pull #\d+ \(the parameters from the servers of step [56]\)",  # the other worker may be a step ahead
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline", "ps"])
def test_a_stuck_rank_is_named_with_its_line_and_the_job_ends_soon_after_the_timeout(strategy, tmp_path):
    stuck_at = tmp_path / "stuck_at"
    with pytest.raises(CollectiveTimeoutError) as caught:
        cases.stuck(strategy, TIMEOUT, str(stuck_at))
    elapsed = time.time() - float(stuck_at.read_text())
    function = cases.StuckStage.pipeline_loss if strategy == "pipeline" else cases.StuckRank.training_step
    line = line_of(function, "time.sleep(600)")
    headline = str(caught.value).splitlines()[0]
    expected = (rf"rank 1 never reached {WAITS_IN[strategy]}: it is in {function.__name__} at cases.py:{line} "
                r"\(time.sleep\(600\)\)\. No rank advanced for 5 s")
    assert re.match(expected, headline), headline
    rank_lines = str(caught.value).splitlines()[1:3]
    assert re.match(rf"  rank 0 \(.*\): waits in {WAITS_IN[strategy]}; still for \d+ s", rank_lines[0])
    assert "rank 1 (" in rank_lines[1] and f"runs the user's code, in {function.__name__} at " in rank_lines[1]
    if strategy in ("ddp", "fsdp"):  # torch's own record of rank 0's collectives (gloo's, since torch 2.7 or so)
        # gloo records no completion and retires a failed collective too: the stuck one is the one issued `timeout`
        # seconds ago.
        expected = (r"^torch's flight recorder on rank 0, the last collective of each group: default_pg: gloo:\w+ #\d+ "
                    r"\(Float\[[^)]*\]\), issued (\d+\.\d) s ago")
        recorded = re.search(expected, str(caught.value), re.MULTILINE)
        assert recorded and float(recorded.group(1)) >= TIMEOUT - 0.5, str(caught.value)
    # gloo raises at the timeout (the watchdog ends a rank HANG_GRACE_S later when a busy machine delays that); ps: a
    # server still in its graceful RPC shutdown leaves `timeout` after the launcher's SIGTERM.
    slack = HANG_GRACE_S + (TIMEOUT if strategy == "ps" else 0) + 3
    assert elapsed < TIMEOUT + slack, f"the job took {elapsed:.0f} s to end after rank 1 got stuck"


@pytest.mark.parametrize("users", [{}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}, {"TORCH_FR_BUFFER_SIZE": "0"}])
def test_the_recorder_is_sized_by_the_variable_of_this_torch_and_a_users_size_wins(monkeypatch, users):
    for variable in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in users.items():
        monkeypatch.setenv(variable, value)
    flight_recorder.enable()
    # Since torch 2.8 the older name makes every rank print a deprecation warning (gloo's too)
    expected = users or {"TORCH_FR_BUFFER_SIZE": "2000",
                         **({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"} if torch.__version__ < (2, 8) else {})}
    assert {v: os.environ[v] for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE") if v in os.environ} \
        == expected


def test_the_flight_recorders_line_names_each_groups_last_collective_with_its_age_and_state():
    def entry(number: int, name: str, group: list, sizes: list, retired: bool, created_s: float, state: str) -> dict:
        return {"collective_seq_id": number, "p2p_seq_id": 0, "is_p2p": False, "profiling_name": name,
                "process_group": group, "input_dtypes": ["Float"] * len(sizes), "input_sizes": sizes,
                "retired": retired, "time_created_ns": int(created_s * 1e9), "state": state}

    default, side = ["0", "default_pg"], ["1", "undefined"]
    recorded = [entry(6, "nccl:all_reduce", default, [[3]], True, 1.0, "completed"),
                entry(2, "nccl:broadcast", side, [], True, 1.5, "completed"),
                entry(7, "nccl:all_reduce", default, [[2, 5]], False, 2.0, "started")]
    assert describe(recorded, 1, now_ns=7 * 10**9) == (
        "torch's flight recorder on rank 1, the last collective of each group: default_pg: nccl:all_reduce #7 "
        "(Float[2, 5]), issued 5.0 s ago, started, not retired; group 1: nccl:broadcast #2, issued 5.5 s ago, "
        "completed, retired")
    assert describe([], 0) is None


def test_the_slowest_rank_is_named_only_when_it_is_persistently_slower():
    step = [0.001, 0.002, 0.004, 0.001]  # data, training_step, backward, optimizer
    slow = [0.001, 0.032, 0.002, 0.001]  # 30 ms more in its training step; the others wait for it in backward
    waiting = [0.001, 0.002, 0.034, 0.001]
    assert slowest_rank([[waiting, slow, waiting]] * 6).startswith(
        "rank 1 is the slowest: +30 ms a step (in its training step), in 6 of 6 sampled steps; its step splits into "
        "data 1.0 ms, training_step 32.0 ms, backward 2.0 ms, optimizer 1.0 ms")
    assert slowest_rank([[step, step]] * 6) is None  # none slower
    assert slowest_rank([[waiting, slow]] * 4) is None  # too few samples to tell
    assert slowest_rank([[waiting, slow], [slow, waiting]] * 3) is None  # not persistently


@pytest.mark.timeout(120)
def test_a_rank_30_ms_slower_each_step_is_named_at_the_end_and_its_split_is_logged(tmp_path):
    trainer = cases.slow("ddp", str(tmp_path))
    watch = next(c for c in trainer.callbacks if isinstance(c, StragglerWatch))
    found = re.match(r"rank 1 is the slowest: \+(\d+) ms a step \(in its training step\), in (\d+) of (\d+) sampled",
                     watch.summary or "")
    assert found, watch.summary
    assert 25 <= int(found[1]) <= 80 and int(found[2]) >= int(found[3]) // 2
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("diagnosis/rank1_training_step_ms")]
    assert len(rows) == int(found[3])
    slow = statistics.median(float(row["diagnosis/rank1_training_step_ms"]) for row in rows)
    other = statistics.median(float(row["diagnosis/rank0_training_step_ms"]) for row in rows)
    assert 28 <= slow - other <= 80


@pytest.mark.timeout(120)
def test_with_diagnosis_debug_an_extra_collective_on_one_rank_stops_the_job_naming_both_call_sites():
    with pytest.raises(CollectiveMismatchError) as caught:
        cases.mismatch("ddp")
    line = line_of(cases.ExtraCollective.training_step, "all_reduce(torch.ones(3))")
    assert re.match(
        r"the ranks called different collectives as their collective #(\d+): rank 0 called all_reduce #\1 \(gradients "
        r"of step 3\) \(the framework\); rank 1 called all_reduce of float32\[3\] \(the user's code, in training_step "
        rf"at cases.py:{line} \(torch.distributed.all_reduce\(torch.ones\(3\)\)\)\)\. Every rank must call the same "
        "collectives in the same order", str(caught.value)), str(caught.value)


@pytest.mark.timeout(30)
def test_a_start_up_that_stalls_names_the_ranks_that_never_arrived_and_the_address_used(monkeypatch):
    monkeypatch.setattr(distributed, "_STORE", None)  # this test's store, gone with it
    port = find_free_port()
    environment = ClusterEnvironment(name="torchrun", global_rank=0, world_size=3, local_world_size=3, master_port=port)
    started = time.monotonic()
    with pytest.raises(StartupTimeoutError) as caught:
        distributed.init_process_group(environment, "gloo", timeout_s=1.0)
    assert time.monotonic() - started < 5
    assert str(caught.value).startswith(
        f"rank 0 waited 1 s at the job's rendezvous 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT, from torchrun) for its "
        f"3 ranks, but ranks 1, 2 never arrived; 1 did: rank 0 ({socket.gethostname()}, pid {os.getpid()}). Check "
        "that the missing ranks' processes started")
