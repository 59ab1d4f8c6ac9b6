"""Real launches of a user's script (ddp_script.py): torchrun, srun-like variables, and `python script.py`.

One launch per test. Every process is started in its own session and killed with its children when a
test ends, whatever happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import ddp_script
import pytest
import torch
import torch.nn.functional as F
from processes import reaped

from torchyard.trainer.cluster.environment import find_free_port

SCRIPT = Path(ddp_script.__file__)
STRATEGY_TESTS = SCRIPT.parents[1] / "strategies"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def launch(
    commands: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout: float = 150, pythonpath: list[Path] = ()
) -> list[tuple[int, str, float]]:
    """Run the commands side by side; (exit code, output, seconds since start at exit) for each."""
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    paths = [str(SCRIPT.parent), *map(str, pythonpath), base.get("PYTHONPATH", "")]
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    start = time.time()
    procs = [subprocess.Popen(command, env={**base, **env}, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for command, env in commands]
    results = []
    with reaped(procs):
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1.0, timeout - (time.time() - start)))
            results.append((proc.returncode, output, time.time()))
    return results


def load_rank(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


def assert_trained_like_the_reference(state: dict[str, torch.Tensor]) -> None:
    reference = ddp_script.concatenated_reference()
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)


def full_set_loss(state: dict[str, torch.Tensor]) -> float:
    module = ddp_script.Line()
    module.load_state_dict(state)
    x, y = ddp_script.data().tensors
    with torch.no_grad():
        return F.mse_loss(module.layer(x), y).item()


@pytest.mark.timeout(180)
def test_two_torchrun_agents_as_two_nodes_train_one_model(tmp_path):
    endpoint = f"127.0.0.1:{find_free_port()}"
    agent = [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
             "--rdzv-id=two-nodes", str(SCRIPT), "train", str(tmp_path), "1", "2"]
    results = launch([(agent, {}), (agent, {})], tmp_path)
    assert [code for code, _, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    ranks = [load_rank(tmp_path, rank) for rank in (0, 1)]
    assert_trained_like_the_reference(ranks[0]["state_dict"])
    assert_trained_like_the_reference(ranks[1]["state_dict"])
    # validate() ran in the same processes; every sample counted once.
    assert (
        ranks[0]["val_loss"] == ranks[1]["val_loss"] == pytest.approx(full_set_loss(ranks[0]["state_dict"]), rel=1e-5)
    )
    assert ranks[0]["rank_sum"] == ranks[1]["rank_sum"] == 1.0  # the script's own all_reduce after fit


@pytest.mark.timeout(180)
def test_srun_variables_launch_two_ranks_that_build_their_own_rendezvous(tmp_path):
    # What `srun -n 2` sets on one node (step 0 of job 4242; tests/test_environment.py has a real capture).
    slurm = {
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "MASTER_PORT": str(find_free_port()),
    }
    command = [sys.executable, str(SCRIPT), "train", str(tmp_path)]
    results = launch([(command, {**slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in (0, 1)], tmp_path)
    assert [code for code, _, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    ranks = [load_rank(tmp_path, rank) for rank in (0, 1)]
    assert_trained_like_the_reference(ranks[0]["state_dict"])
    assert (
        ranks[0]["val_loss"] == ranks[1]["val_loss"] == pytest.approx(full_set_loss(ranks[1]["state_dict"]), rel=1e-5)
    )
    assert ranks[0]["rank_sum"] == ranks[1]["rank_sum"] == 1.0  # the script's own all_reduce after fit


@pytest.mark.timeout(180)
def test_a_rank_that_raises_under_torchrun_ends_the_job_within_seconds(tmp_path):
    command = [*TORCHRUN, "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{find_free_port()}",
               str(SCRIPT), "fail", str(tmp_path)]
    [(code, output, ended)] = launch([(command, {})], tmp_path)
    assert code != 0
    assert "rank 1 fails on purpose" in output
    elapsed = ended - float((tmp_path / "raised_at").read_text())
    # Rank 0 waits in an all-reduce whose timeout is 1800 s; the job must not wait for it.
    assert elapsed < 30, f"torchrun took {elapsed:.1f} s to exit after rank 1 raised"


@pytest.mark.timeout(180)
def test_a_torchrun_restart_resumes_from_the_checkpoints_of_the_jobs_earlier_attempt(tmp_path):
    agent = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", str(SCRIPT), "restart", str(tmp_path)]
    [(code, output, _)] = launch([(agent, {})], tmp_path)
    assert code == 0, output[-3000:]
    assert (tmp_path / "raised_at").exists()  # the first attempt failed at its third step
    # The restart continued the first attempt's run folder from its step-2 checkpoint, not from scratch.
    assert "restart 1: resuming from" in output and "(global step 2)" in output, output[-3000:]
    assert [p.name for p in (tmp_path / "default").iterdir()] == ["version_0"]
    assert_trained_like_the_reference(load_rank(tmp_path, 0)["state_dict"])


@pytest.mark.timeout(180)
def test_python_script_starts_its_own_workers_and_gets_the_trained_module_back(tmp_path):
    [(code, output, _)] = launch([([sys.executable, str(SCRIPT), "train", str(tmp_path)], {})], tmp_path)
    assert code == 0, output[-3000:]
    assert_trained_like_the_reference(torch.load(tmp_path / "caller.pt", weights_only=True))
    assert "Traceback" not in output


@pytest.mark.timeout(180)
def test_two_nodes_started_by_the_trainer_itself_meet_at_master_addr(tmp_path):
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    outs = [tmp_path / f"node{n}" for n in (0, 1)]
    for out in outs:
        out.mkdir()
    commands = [([sys.executable, str(SCRIPT), "train", str(outs[n]), "1", "2"], {**rendezvous, "NODE_RANK": str(n)})
                for n in (0, 1)]
    results = launch(commands, tmp_path)
    assert [code for code, _, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    # The script on each node gets the trained weights back, not only node 0's (which holds global rank 0).
    for out in outs:
        assert_trained_like_the_reference(torch.load(out / "caller.pt", weights_only=True))


UNGUARDED_WITH_RESTARTS = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchyard.trainer import Trainer
from ddp_script import Line

data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu", logger=False, max_restarts=2)
trainer.fit(Line(), DataLoader(data, batch_size=4))
"""


def refused_script(tmp_path: Path, name: str, text: str) -> tuple[str, Path]:
    """Run the script `text`, which must fail before any worker starts: (its output's last line, its path)."""
    script = tmp_path / name
    script.write_text(text)
    [(code, output, _)] = launch([([sys.executable, str(script)], {})], tmp_path)
    assert code != 0
    assert "run_worker" not in output and "[rank1]" not in output  # no worker ever ran
    return output.strip().splitlines()[-1], script


@pytest.mark.timeout(240)
def test_a_script_without_a_main_guard_runs_on_every_rank_like_a_hand_written_torchrun_loop(tmp_path):
    """Lightning's launch: `python script.py` becomes rank 0 and rank 1 re-runs the command line; the weights
    equal the hand-written DDP loop's under torchrun bitwise, the code after fit runs on both ranks, and rank 1
    started training from rank 0's RNG state although nothing was seeded."""
    reference = [*TORCHRUN, "--standalone", "--nproc-per-node=2", str(STRATEGY_TESTS / "ddp_reference.py"),
                 str(tmp_path / "reference.pt")]
    script = [sys.executable, str(SCRIPT.parent / "unguarded_script.py"), str(tmp_path)]
    results = launch([(script, {}), (reference, {})], tmp_path, pythonpath=[STRATEGY_TESTS])
    assert [code for code, _, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert load_rank(tmp_path, 0)["draws"] == load_rank(tmp_path, 1)["draws"]
    for rank in (0, 1):
        after_fit = load_rank(tmp_path, rank)
        assert after_fit["world_size"] == 2 and after_fit["rank_sum"] == 1.0
        assert after_fit["state_dict"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(after_fit["state_dict"][key], value), f"rank {rank}: {key} differs from torchrun's"


@pytest.mark.timeout(120)
@pytest.mark.one_core
def test_max_restarts_with_a_script_without_a_main_guard_is_refused_before_any_worker_starts(tmp_path):
    last, script = refused_script(tmp_path, "unguarded.py", UNGUARDED_WITH_RESTARTS)
    assert last == (
        f"torchyard.trainer.errors.MisconfigurationError: max_restarts=2 restarts workers that the script starts "
        f"under its main guard, but {script}:9 starts a 2-process job at its top level; put the code that builds "
        'the Trainer and calls fit under `if __name__ == "__main__":`, or run it with `torchrun --max-restarts=2`.'
    )


GUARDED_CLASS = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchyard.trainer import Trainer
from ddp_script import Line

if __name__ == "__main__":
    class Local(Line):
        pass

    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    Trainer(strategy="ddp", devices=2, accelerator="cpu", logger=False).fit(Local(), DataLoader(data, batch_size=4))
"""


@pytest.mark.timeout(120)
@pytest.mark.one_core
def test_a_module_class_defined_under_the_main_guard_is_refused_before_any_worker_starts(tmp_path):
    last, script = refused_script(tmp_path, "guarded_class.py", GUARDED_CLASS)
    assert last == (
        f'torchyard.trainer.errors.MisconfigurationError: Local is defined inside `if __name__ == "__main__":` of '
        f"{script}, but the worker processes import the script without running that block; define it "
        "above the guard."
    )
