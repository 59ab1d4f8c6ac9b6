"""Live recovery on torchft (strategy ddp with fault_tolerance, trainer/strategies/ft/): the one-line refusals before
any process starts, the deal of a global batch over a quorum, and a real run of 3 replica groups that loses one to
SIGKILL mid-epoch, goes on, heals the restarted group from a live peer and trains every sample exactly once."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import reaped

from torchyard.trainer import Trainer
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.data.ledger import read_ledger, report
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.ft.slices import replica_part

pytest.importorskip("torchft")
FAULTS = Path(__file__).parent / "faults"
SCRIPT = FAULTS / "ft_script.py"


def fault_tolerant(**options):
    return {"name": "ddp", "fault_tolerance": {"replica_groups": 3, **options}}


@pytest.mark.parametrize("name", ["pipeline", "ps", "dp", "fsdp"])
def test_fault_tolerance_on_a_strategy_it_cannot_serve_is_one_line(name):
    with pytest.raises(MisconfigurationError) as error:
        Trainer(strategy={"name": name, "fault_tolerance": {"replica_groups": 3}})
    assert str(error.value) == (
        f"strategy {name!r} cannot run fault_tolerance (live recovery on torchft runs on ddp; fsdp is not built yet); "
        "use strategy={'name': 'ddp', 'fault_tolerance': {...}} or drop fault_tolerance.")


def test_a_lighthouse_that_does_not_answer_is_one_line():
    port = find_free_port()  # nothing listens there
    with pytest.raises(MisconfigurationError,
                       match=r"^fault_tolerance lighthouse='127.0.0.1:\d+' does not answer \(.*\); start it first "
                             r"\(torchft_lighthouse --min_replicas N --bind \[::\]:PORT\) or leave lighthouse unset "
                             r"and the Trainer starts one\.$"):
        Trainer(strategy=fault_tolerant(lighthouse=f"127.0.0.1:{port}"))


def test_fewer_replica_groups_than_min_replicas_is_one_line():
    with pytest.raises(MisconfigurationError) as error:
        Trainer(strategy=fault_tolerant(min_replicas=4))
    assert str(error.value) == ("fault_tolerance replica_groups=3 is fewer than min_replicas=4, so no step could ever "
                                "commit; raise replica_groups or lower min_replicas.")


def test_torchft_missing_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def without_torchft(name, *args, **kwargs):
        if name == "torchft" or name.startswith("torchft."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_torchft)
    with pytest.raises(MisconfigurationError) as error:
        Trainer(strategy=fault_tolerant())
    assert str(error.value) == ("strategy fault_tolerance needs torchft, which is not installed (No module named "
                                "'torchft'); install it with pip install 'torchyard[ft]'.")


@pytest.mark.parametrize(("options", "message"), [
    ({"devices": 2}, "fault_tolerance runs one process per replica group for now, but devices=2 and num_nodes=1 ask "
                     "for 2; set devices=1 and num_nodes=1 (replica_groups=3 sets how many groups, and processes, the "
                     "job runs)."),
    ({"accumulate_grad_batches": 2}, "strategy ddp with fault_tolerance cannot run with accumulate_grad_batches: each "
                                     "step's quorum commits one optimizer step on one batch of every replica; leave it "
                                     "at its default."),
])
def test_options_live_recovery_cannot_run_with_are_one_line(options, message):
    with pytest.raises(MisconfigurationError) as error:
        Trainer(strategy=fault_tolerant(), **options)
    assert str(error.value) == message


def test_a_global_batch_is_dealt_over_any_quorum_once():
    batch = list(range(100, 196))
    for participants in (1, 2, 3, 5):
        parts = [replica_part(batch, place, participants) for place in range(participants)]
        assert sorted(index for part in parts for index in part) == batch
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    # A short last batch with fewer samples than replicas: the one left without repeats the last sample (padding).
    assert [replica_part([7, 8], place, 3) for place in range(3)] == [[8], [7], [8]]


def commit_pauses(commits: list[list[str]], groups: set[str], since: float) -> float:
    """The longest wait between two consecutive commits of any of `groups` from `since` on."""
    longest = 0.0
    for group in groups:
        times = sorted(float(row[3]) for row in commits if row[0] == group)
        times = [t for t in times if t >= since - 1.0]
        longest = max([longest, *(later - earlier for earlier, later in zip(times, times[1:]))])
    return longest


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_three_replica_groups_lose_one_go_on_heal_it_and_train_each_sample_once(tmp_path):
    sys.path.insert(0, str(FAULTS))
    from ft_script import reference_accuracy

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "--kill-at", "15", "--step-sleep", "0.25"],
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    with reaped([proc]):
        # While the groups start: the undisturbed run, on the same global batches in the same order, in this process.
        undisturbed = reference_accuracy()
        output, _ = proc.communicate(timeout=130)
    assert proc.returncode == 0, output[-4000:]
    assert "trainer: replica group 1 lost process 0 to SIGKILL; restarting it (1 of 2 restarts)" in output, output
    commits = [line.split() for line in (tmp_path / "commits.txt").read_text().splitlines()]
    killed_after = max(int(row[2]) for row in commits if row[:2] == ["1", "0"])
    died = max(float(row[3]) for row in commits if row[:2] == ["1", "0"])
    back = [int(row[2]) for row in commits if row[:2] == ["1", "1"]]
    # The restarted group took up at the peers' step (healed from one, no checkpoint read) and trained on with them.
    assert back and back[0] > killed_after + 1 and back == list(range(back[0], back[-1] + 1)), (killed_after, back)
    assert back[-1] == max(int(row[2]) for row in commits)
    returned = min(float(row[3]) for row in commits if row[:2] == ["1", "1"])
    for survivor in ("0", "2"):  # both kept committing while group 1 was away
        assert sum(died < float(row[3]) < returned for row in commits if row[0] == survivor) >= 3, commits
    pause = commit_pauses(commits, {"0", "2"}, died)
    print(f"survivors' longest pause between commits from the kill on: {pause:.2f} s")
    assert pause < 5.0
    ledger = read_ledger(tmp_path / "default" / "version_0")
    assert report(ledger) == ([f"epoch {e}: 1258 of 1258 samples trained, each exactly once" for e in range(5)], True)
    accuracy = float(output.split("accuracy ")[-1].split()[0])
    print(f"accuracy {accuracy:.4f}, undisturbed {undisturbed:.4f}")
    assert abs(accuracy - undisturbed) <= 0.01


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two replica groups on NCCL need two GPUs")
def test_two_replica_groups_on_gpus_train_each_sample_once(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "--groups", "2", "--epochs", "2",
                             "--accelerator", "cuda"], cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    with reaped([proc]):
        output, _ = proc.communicate(timeout=130)
    assert proc.returncode == 0, output[-4000:]
    ledger = read_ledger(tmp_path / "default" / "version_0")
    assert report(ledger) == ([f"epoch {e}: 1258 of 1258 samples trained, each exactly once" for e in range(2)], True)
