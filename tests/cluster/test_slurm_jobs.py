"""Real jobs on the one-node SLURM of slurm.sh: what srun's tasks detect, and `trainer submit` end to end."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.cli.main import main

pytestmark = pytest.mark.slow
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DETECT = ("import json, os; from torchyard.trainer.cluster.environment import detect_environment as d; e = d(); "
          "print(json.dumps([e.name, e.global_rank, e.local_rank, e.world_size, e.local_world_size, e.node_rank, "
          "e.master_addr, 'SLURM_NTASKS_PER_NODE' in os.environ]))")
# digits.yaml trained by DDP in the two tasks srun starts.
DIGITS_DDP = [str(RECIPES / "digits.yaml"), str(RECIPES / "digits_ddp.yaml"), "trainer.enable_progress_bar=false"]
TWO_TASKS = ["--devices-per-node", "2"]


def submitted(capsys, *args: str) -> tuple[str, Path, str]:
    """`trainer submit`: the job id and the run folder it prints."""
    assert main(["submit", *args]) == 0
    out = capsys.readouterr().out
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return out.split()[3], Path(fields["run folder"]), out


@pytest.mark.timeout(600)
def test_srun_tasks_read_their_coordinates_from_real_srun(slurm, slurm_jobs):
    ran = subprocess.run(["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, "-c", DETECT],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    tasks = sorted(json.loads(line) for line in ran.stdout.splitlines())
    # (name, rank, local rank, world, local world, node rank, master, SLURM_NTASKS_PER_NODE set)
    assert tasks == [["slurm", rank, rank, 2, 2, 0, slurm.node, False] for rank in (0, 1)]


@pytest.mark.timeout(600)
def test_the_shells_of_sbatch_and_salloc_are_not_a_launch(slurm, slurm_jobs, tmp_path):
    out = tmp_path / "batch.json"
    batch = subprocess.run(["sbatch", "--wait", "-n", "2", "-o", str(tmp_path / "batch.log"),
                            f"--wrap={sys.executable} -c \"{DETECT}\" > {out}"],
                           capture_output=True, text=True, timeout=300)
    assert batch.returncode == 0, batch.stderr + (tmp_path / "batch.log").read_text()
    assert json.loads(out.read_text())[:4] == ["local", 0, 0, 1]
    shell = subprocess.run(["salloc", "-n", "2", sys.executable, "-c", DETECT],
                           capture_output=True, text=True, timeout=300)
    assert shell.returncode == 0, shell.stderr
    assert json.loads(shell.stdout.splitlines()[-1])[:4] == ["local", 0, 0, 1]


def metrics_epochs(run: Path) -> list[int]:
    with open(run / "metrics.csv", newline="") as f:
        return sorted({int(row["epoch"]) for row in csv.DictReader(f) if row.get("val/acc")})


@pytest.mark.timeout(900)
def test_a_submitted_recipe_trains_with_ddp_in_two_srun_tasks(slurm, slurm_jobs, capsys, tmp_path):
    job, run, out = submitted(capsys, *DIGITS_DDP, "trainer.max_epochs=2", *TWO_TASKS)
    slurm_jobs.append(job)
    assert run == tmp_path / "runs" / f"slurm-{job}" / "digits_ddp" / "version_0"
    fields = slurm.wait(job, timeout=800)
    log = (tmp_path / "runs" / f"slurm-{job}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert fields["NumTasks"] == "2"
    # srun's two tasks were the two DDP ranks: one run folder, and each rank saw half of each epoch.
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    last = load_checkpoint_file(run / "checkpoints" / "last.ckpt")
    assert metrics_epochs(run) == [0, 1]
    assert last["loops"]["progress"]["global_step"] == 20  # 2 epochs x ceil(1258 / 2 / 64) steps per rank
    assert (tmp_path / "runs" / f"slurm-{job}.sbatch").read_text().startswith("#!/bin/bash")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option, said", [("--sbatch=--partition=nope", "Invalid partition name specified"),
                                          ("--time=soon", "Invalid --time specification")])
def test_options_sbatch_refuses_are_its_one_line_and_submit_nothing(slurm, capsys, option, said):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    assert main(["submit", str(RECIPES / "digits.yaml"), option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainer submit: error: sbatch: error: ") and said in err
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


@pytest.mark.timeout(1200)
def test_sigterm_before_the_limit_saves_requeues_and_resumes_exactly(slurm, slurm_jobs, capsys, tmp_path):
    # Long enough that the SIGTERM sent at the first checkpoint lands mid-run (an epoch takes a fraction of a second).
    epochs = ["trainer.max_epochs=20"]
    job, reference_run, _ = submitted(capsys, *DIGITS_DDP, *epochs, *TWO_TASKS)
    slurm_jobs.append(job)
    assert slurm.wait(job, timeout=800)["JobState"] == "COMPLETED"
    job, run, _ = submitted(capsys, *DIGITS_DDP, *epochs, *TWO_TASKS)
    slurm_jobs.append(job)
    deadline = time.monotonic() + 600
    # The first checkpoint file (top-k may remove epoch 0's soon after): well into the run, far from its end.
    while not list((run / "checkpoints").glob("*.ckpt")):
        assert time.monotonic() < deadline and slurm.job(job)["JobState"] in ("PENDING", "RUNNING")
        time.sleep(0.2)
    # What --signal=TERM@120 sends before the time limit: SIGTERM to every task, not to the batch shell.
    subprocess.run(["scancel", "--signal=TERM", job], check=True)
    fields = slurm.wait(job, timeout=800, restarts=1)
    log = (tmp_path / "runs" / f"slurm-{job}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    assert "requeueing job" in log and "attempt 2" in log
    resumed, reference = (load_checkpoint_file(r / "checkpoints" / "last.ckpt") for r in (run, reference_run))
    steps = 20 * 10  # 20 epochs x ceil(1258 / 2 / 64) steps per rank
    assert resumed["loops"]["progress"]["global_step"] == reference["loops"]["progress"]["global_step"] == steps
    assert resumed["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), f"{key} differs from the uninterrupted run"
    assert metrics_epochs(run) == list(range(20))
