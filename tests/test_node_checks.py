"""trainer/cluster/node_checks.py: the checks every node of a multi-node job runs before the nodes meet."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from processes import reaped
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster import node_checks as checks
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.errors import MisconfigurationError


@pytest.mark.timeout(10)
def test_an_unresolvable_master_is_one_line_naming_this_host_and_the_fix():
    with pytest.raises(MisconfigurationError) as raised:
        checks.resolve_master("no-such-host.invalid", 29500)
    said = str(raised.value)
    assert "\n" not in said
    assert said.startswith(f"{socket.gethostname()} cannot resolve the master address 'no-such-host.invalid'")
    assert f"fix DNS or /etc/hosts on {socket.gethostname()}" in said


class _Line(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(10)
def test_a_node_of_a_self_launched_job_checks_the_master_before_any_process_starts(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    monkeypatch.setenv("NODE_RANK", "1")
    data = DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 2)), batch_size=2)
    trainer = Trainer(strategy="ddp", devices=1, num_nodes=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(MisconfigurationError, match="cannot resolve the master address 'no-such-host.invalid'"):
        trainer.fit(_Line(), data)


def test_the_master_port_answers_or_the_wait_ends_with_the_cause():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        checks.wait_for_master("127.0.0.1", server.getsockname()[1], wait_s=1)
    with pytest.raises(MisconfigurationError, match=r"node 1 could not reach the master at 127.0.0.1:\d+ within 0.3 s"
                                                    r" from .*connection refused"):
        checks.wait_for_master("127.0.0.1", find_free_port(), wait_s=0.3, who="node 1")


def test_facts_hold_versions_the_framework_and_the_runs_files_and_the_test_hook(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    monkeypatch.setattr(sys, "argv", [str(script), "--epochs", "3"])
    facts = checks.node_facts({checks.FAKE_VERSION_VARIABLE: "torch=0.0.0+fake"})
    assert facts["torch"] == "0.0.0+fake"
    assert facts["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(facts) == {"python", "torch", "torchyard", "torchyard source", "argument 0 (train.py)"}
    first = facts["argument 0 (train.py)"]
    script.write_text("print('changed')\n")
    assert checks.node_facts({})["argument 0 (train.py)"] != first


def report(node: int, host: str, **facts: str) -> dict:
    return {"node": node, "host": host, "facts": {"python": "3.11.7", "torch": "2.13.0", **facts},
            "interface": "eth0 10.0.0.1", "loopback": False}


def test_differences_are_rows_of_node_item_value_and_one_summary_line(capsys):
    reports = [report(0, "a"), report(1, "b", torch="2.5.0"), report(2, "c")]
    rows = checks.mismatch_rows(reports)
    assert rows == [("node 0 (a), node 2 (c)", "torch", "2.13.0"), ("node 1 (b)", "torch", "2.5.0")]
    assert checks.mismatch_summary(rows) == "torch (2.13.0 on node 0 (a), node 2 (c), 2.5.0 on node 1 (b))"
    assert checks.mismatch_rows([report(0, "a"), report(1, "b")]) == []
    checks.print_mismatch_table(rows)
    table = capsys.readouterr().err
    assert "The nodes of this job differ" in table
    assert all(word in table for word in ("node", "item", "value", "node 1 (b)", "2.5.0"))


def test_the_interface_line_names_the_variable_and_warns_of_a_loopback_across_hosts(capsys):
    on_lo = {**report(1, "b"), "interface": "lo 127.0.1.1 (the address of b)", "loopback": True}
    checks.print_interfaces([report(0, "a"), on_lo], "gloo")
    err = capsys.readouterr().err
    assert "gloo uses network interface eth0 10.0.0.1 on node 0 (a); set GLOO_SOCKET_IFNAME" in err
    assert "warning: node 1 (b) would use the loopback interface" in err
    checks.print_interfaces([report(0, "a"), report(1, "a")], "nccl")
    assert "on node 0 (a), node 1 (a); set NCCL_SOCKET_IFNAME" in capsys.readouterr().err


def test_the_interface_variable_wins_over_the_backends_own_choice():
    chosen = checks.network_interface("gloo", {"GLOO_SOCKET_IFNAME": "lo"})
    assert chosen == ("lo (GLOO_SOCKET_IFNAME) 127.0.0.1", False)
    assert checks.network_interface("nccl", {"NCCL_SOCKET_IFNAME": "lo"})[0].startswith("lo (NCCL_SOCKET_IFNAME)")
    chosen, loopback = checks.network_interface("gloo", {})
    assert loopback == chosen.startswith("lo ")


# Two processes with the variables torchrun sets for two nodes of one process each; node 1 reports a torch of
# another version through the test hook. A training step would write to the file given as argv[1].
TWO_NODE_CHILD = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from torchyard.trainer import Trainer, TrainModule

class Line(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        with open(sys.argv[1], "a") as steps:
            steps.write("step\\n")
        return ((self.layer(batch[0]) - batch[1]) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=2)
Trainer(strategy="ddp", devices=1, num_nodes=2, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False).fit(Line(), data)
"""


@pytest.mark.timeout(180)
def test_a_version_mismatch_is_one_table_on_rank_0_and_no_node_trains(tmp_path):
    steps, port = tmp_path / "steps.txt", str(find_free_port())
    processes = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "GROUP_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        if rank == 1:
            env[checks.FAKE_VERSION_VARIABLE] = "torch=0.0.0+fake"
        processes.append(subprocess.Popen([sys.executable, "-c", TWO_NODE_CHILD, str(steps)], env=env, cwd=tmp_path,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    with reaped(processes):
        outputs = [process.communicate(timeout=150)[0] for process in processes]
    assert [process.returncode for process in processes] == [1, 1], outputs
    rank0 = outputs[0]
    assert rank0.count("The nodes of this job differ") == 1 and "The nodes of this job differ" not in outputs[1]
    table = rank0[rank0.index("The nodes of this job differ"):]
    assert "torch" in table and "0.0.0+fake" in table and "node 1" in table
    assert "gloo uses network interface" in rank0
    for output in outputs:
        assert "MisconfigurationError: the nodes do not run the same software: torch (" in output
    assert not steps.exists()  # stopped before any training step
