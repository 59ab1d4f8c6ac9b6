"""`trainer launch --hosts` over a real sshd (sshd.sh): two "hosts", localhost and 127.0.0.1, are two ssh logins to
this machine. Each launch gets a marker variable, which the launcher passes on to every node (TORCHYARD_*), so that
`ps` can tell whether any process of it is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from processes import reaped

from torchyard.trainer.checkpointing.files import load_checkpoint_file

pytestmark = pytest.mark.slow
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TRAINER = str(Path(sys.executable).with_name("trainer"))
DIGITS_DDP = [str(RECIPES / "digits.yaml"), str(RECIPES / "digits_ddp.yaml")]
SHORT = ["trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
TWO_HOSTS = ["--hosts", "localhost,127.0.0.1"]


def start(command: list[str], cwd: Path, mark: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHYARD_TEST_MARK": mark}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen, timeout: float) -> str:
    with reaped([process]):
        return process.communicate(timeout=timeout)[0]


def processes_marked(mark: str) -> list[str]:
    """`ps` lines (with each process's environment) of the processes that carry the marker."""
    shown = subprocess.run(["ps", "axeww", "-o", "pid=,args="], capture_output=True, text=True, check=True)
    return [line[:200] for line in shown.stdout.splitlines() if f"TORCHYARD_TEST_MARK={mark}" in line]


def assert_none_left(mark: str) -> None:
    deadline = time.monotonic() + 10  # sshd may still be tearing a session down
    while processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_marked(mark) == []


@pytest.mark.timeout(300)
def test_two_hosts_train_bitwise_like_two_processes_on_one_node(sshd, tmp_path):
    mark = uuid.uuid4().hex
    epochs = ["trainer.max_epochs=2", *SHORT]
    # Side by side: the two runs share nothing but the recipe.
    over_ssh = start([TRAINER, "launch", *TWO_HOSTS, "--ssh-config", sshd, *DIGITS_DDP, *epochs,
                      f"trainer.default_root_dir={tmp_path / 'hosts'}"], tmp_path, mark)
    one_node = start([TRAINER, "fit", *DIGITS_DDP, *epochs, f"trainer.default_root_dir={tmp_path / 'one'}"],
                     tmp_path, uuid.uuid4().hex)
    said, reference_said = finish(over_ssh, 240), finish(one_node, 240)
    assert over_ssh.returncode == 0, said[-3000:]
    assert one_node.returncode == 0, reference_said[-3000:]
    assert "trainer launch: 2 nodes x 1 processes" in said
    assert "gloo uses network interface" in said and "GLOO_SOCKET_IFNAME" in said  # node 0's output, shown here
    runs = tmp_path / "hosts" / "digits_ddp"
    assert [p.name for p in runs.iterdir()] == ["version_0"]  # node 1 claimed no folder of its own
    trained, reference = (load_checkpoint_file(root / "digits_ddp" / "version_0" / "checkpoints" / "last.ckpt")
                          for root in (tmp_path / "hosts", tmp_path / "one"))
    assert trained["loops"]["progress"]["global_step"] == reference["loops"]["progress"]["global_step"] == 6
    assert trained["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert torch.equal(trained["state_dict"][key], value), f"{key} differs from the one-node run"
    assert_none_left(mark)


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_node_and_leaves_no_process(sshd, tmp_path):
    mark = uuid.uuid4().hex
    launch = start([TRAINER, "launch", *TWO_HOSTS, "--ssh-config", sshd, *DIGITS_DDP, "trainer.max_epochs=1000",
                    *SHORT, f"trainer.default_root_dir={tmp_path}"], tmp_path, mark)
    checkpoints = tmp_path / "digits_ddp" / "version_0" / "checkpoints"
    try:
        deadline = time.monotonic() + 200
        while not list(checkpoints.glob("epoch=*.ckpt")):  # well into training on both nodes
            assert launch.poll() is None and time.monotonic() < deadline, finish(launch, 10)[-3000:]
            time.sleep(0.2)
        assert len(processes_marked(mark)) >= 6  # per node: the guard, the node's trainer, its worker
        launch.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends the launch command
    finally:
        said = finish(launch, 120)
    assert launch.returncode == 130, said[-3000:]
    assert "trainer launch: SIGINT: every node was told to stop" in said
    assert (checkpoints / "last.ckpt").is_file()  # the nodes stopped as a Ctrl-C stops a run: saved first
    assert_none_left(mark)


@pytest.mark.timeout(120)
def test_an_unresolvable_master_stops_every_node_with_the_one_line_cause(sshd, tmp_path):
    mark = uuid.uuid4().hex
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the node checks come first: this never runs')\n")
    launch = start([TRAINER, "launch", *TWO_HOSTS, "--ssh-config", sshd, "--master-addr", "no-such-host.invalid",
                    str(script)], tmp_path, mark)
    said = finish(launch, 100)
    assert launch.returncode == 2, said
    errors = [line for line in said.splitlines() if "error:" in line]
    assert errors[0].startswith("trainer launch: error: ")
    assert "cannot resolve the master address 'no-such-host.invalid'" in errors[0]
    assert "fix DNS or /etc/hosts on" in errors[0]
    assert "never runs" not in said
    assert_none_left(mark)


# Under torchrun on each node: node 1 fails once both nodes run, node 0 would go on for ten minutes.
FAILING_SCRIPT = """
import os, sys, time
if os.environ["GROUP_RANK"] == "1":
    time.sleep(1)
    sys.exit("node 1 gives up")
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_a_failing_node_stops_the_others_and_leaves_no_process(sshd, tmp_path):
    mark = uuid.uuid4().hex
    script = tmp_path / "train.py"
    script.write_text(FAILING_SCRIPT)
    launch = start([TRAINER, "launch", *TWO_HOSTS, "--ssh-config", sshd, str(script)], tmp_path, mark)
    said = finish(launch, 150)
    assert launch.returncode == 1, said[-3000:]
    assert "trainer launch: node 1 (127.0.0.1) exited with status 1; the other nodes were stopped" in said
    assert "node 1 gives up" in said  # from the end of node 1's output, shown here
    assert_none_left(mark)
