"""`trainer launch` (trainer/launch/ssh_hosts.py): its input checks, what each host runs, and the guard around a node.
The launches over a real sshd are in tests/cluster/test_hosts_over_ssh.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchyard.trainer.cli.main import main
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.launch import ssh_hosts as hosts

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('trained')\n")
    return path


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainer launch: error: "), err
    return err


@pytest.mark.parametrize("options, said", [
    (["--hosts", "a,b,A"], "host 'A' is listed twice; each host runs one node"),
    (["--hosts", "a,,b"], "--hosts 'a,,b' has an empty name"),
    (["--hosts", "a,b", "--nproc-per-node", "0"], "--nproc-per-node 0: give 1 or more."),
    ([], "give the hosts with --hosts h1,h2 or --hostfile FILE"),
    (["--hosts", "a", "--hostfile", "hostfile"], "give the hosts with --hosts h1,h2 or --hostfile FILE"),
    (["--hostfile", "nope"], "hostfile 'nope' does not exist."),
    (["--hosts", "a,b", "--master-port", "0"], "--master-port 0: give a port number from 1 to 65535."),
])
def test_bad_host_lists_are_one_line_errors(capsys, script, options, said):
    assert said in one_line_error(capsys, ["launch", *options, str(script)])


def test_a_missing_script_or_recipe_is_one_line(capsys):
    assert "script 'nope.py' does not exist." in one_line_error(capsys, ["launch", "--hosts", "a", "nope.py"])
    assert "recipe file 'nope.yaml' does not exist." in one_line_error(capsys, ["launch", "--hosts", "a", "nope.yaml"])
    assert "give a recipe (and overrides) or a script.py" in one_line_error(capsys, ["launch", "--hosts", "a"])


def test_a_hostfile_is_read_as_deepspeed_and_mpi_write_it(tmp_path, capsys, script):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=4\n\nnode2 slots=4 max_slots=8  # MPI's cap\n")
    assert hosts.read_hostfile(hostfile) == [("node1", 4), ("node2", 4)]
    names, slots = hosts.read_hosts(None, str(hostfile))
    assert (names, hosts.processes_per_node(None, slots)) == (["node1", "node2"], 4)
    assert hosts.processes_per_node(2, slots) == 2  # --nproc-per-node wins
    assert hosts.processes_per_node(None, []) == 1
    hostfile.write_text("node1 slots=4\nnode2 slots=2\n")
    assert "the hostfile gives different slots (4, 2)" in one_line_error(
        capsys, ["launch", "--hostfile", str(hostfile), str(script)])
    hostfile.write_text("node1 slots=4\nnode2 gpus=2\n")
    assert f"{hostfile}:2: cannot read 'gpus=2'; a hostfile line is `HOST slots=N`" in one_line_error(
        capsys, ["launch", "--hostfile", str(hostfile), str(script)])
    hostfile.write_text("node1 slots=0\n")
    assert "cannot read 'slots=0'" in one_line_error(capsys, ["launch", "--hostfile", str(hostfile), str(script)])
    hostfile.write_text("# nobody\n")
    assert "names no host" in one_line_error(capsys, ["launch", "--hostfile", str(hostfile), str(script)])


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs an OpenSSH client")
@pytest.mark.timeout(60)
def test_an_unreachable_host_is_one_line_and_nothing_is_left_running(capsys, script):
    err = one_line_error(capsys, ["launch", "--hosts", "no-such-host.invalid", str(script)])
    assert "cannot log in to no-such-host.invalid over ssh (ssh: Could not resolve hostname" in err
    assert "ssh -o BatchMode=yes no-such-host.invalid true" in err
    assert not [line for line in _ps() if "no-such-host.invalid" in line]


def _ps() -> list[str]:
    return subprocess.run(["ps", "axww", "-o", "args="], capture_output=True, text=True, check=True).stdout.splitlines()


def test_each_host_runs_the_guard_around_its_node_in_this_directory_with_the_jobs_variables(monkeypatch, script):
    monkeypatch.setenv("TORCHYARD_TEST_MARK", "x y")
    monkeypatch.setenv("UNRELATED", "1")
    torchrun = hosts.node_command([str(script), "--lr", "0.1"], num_nodes=2, nproc=4)(1, "node1", 29400)
    assert torchrun == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1",
                        "--nproc-per-node=4", "--master-addr=node1", "--master-port=29400", str(script), "--lr", "0.1"]
    line = hosts.remote_command({"MASTER_ADDR": "node1", "NODE_RANK": "1"}, torchrun)
    assert line.startswith(f"cd {os.getcwd()} && exec env ")
    assert "TORCHYARD_TEST_MARK='x y'" in line and "MASTER_ADDR=node1 NODE_RANK=1" in line
    assert "UNRELATED" not in line
    guard = f"{sys.executable} -m torchyard.trainer.launch.ssh_hosts"
    assert f"{guard} -- {sys.executable} -m torch.distributed.run" in line


def test_a_recipe_runs_as_the_trainer_command_with_the_jobs_shape(capsys):
    recipe = [str(RECIPES / "digits.yaml"), str(RECIPES / "digits_ddp.yaml"), "trainer.max_epochs=1"]
    command = hosts.node_command(["test", *recipe], num_nodes=3, nproc=2)(2, "node1", 29400)
    assert command == [sys.executable, "-m", "torchyard.trainer", "test", *recipe, "trainer.num_nodes=3",
                       "trainer.devices=2"]
    assert "max_epochs=-3 must be an integer" in one_line_error(
        capsys, ["launch", "--hosts", "a", *recipe[:2], "trainer.max_epochs=-3"])


def start_guard(command: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "NODE_RANK": "0"}
    return subprocess.Popen([sys.executable, "-m", "torchyard.trainer.launch.ssh_hosts", "--", *command], env=env,
                            cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


# A node that starts a child of its own (which carries the node's marker argument too) and reports a SIGINT.
NODE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, lambda *_: (open("got_int", "w").close(), sys.exit(130)))
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", sys.argv[1]])
open("started", "w").close()
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_the_guard_passes_a_signal_to_the_node_and_leaves_none_of_its_processes(tmp_path):
    guard = start_guard([sys.executable, "-c", NODE, "ctrl-c-test"], tmp_path)
    wait_for(tmp_path / "started")
    guard.stdin.write("INT\n")
    guard.stdin.flush()
    assert guard.wait(timeout=30) == 130
    assert (tmp_path / "got_int").exists()
    assert not [line for line in _ps() if "ctrl-c-test" in line]


@pytest.mark.timeout(60)
def test_when_the_launcher_is_gone_the_guard_ends_the_nodes_whole_process_group(tmp_path):
    guard = start_guard([sys.executable, "-c", NODE, "hang-up-test"], tmp_path)
    wait_for(tmp_path / "started")
    assert len([line for line in _ps() if "hang-up-test" in line]) == 3  # the guard, the node, the node's child
    guard.stdin.close()  # what ssh does to the guard when the launcher or the connection dies
    assert guard.wait(timeout=30) == 128 + signal.SIGTERM
    assert not [line for line in _ps() if "hang-up-test" in line]
