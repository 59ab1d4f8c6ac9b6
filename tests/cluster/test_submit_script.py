"""`trainer submit --dry-run` and its refusals: the batch script as text, without SLURM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchyard.trainer.cli.main import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def submit(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["submit", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_prints_a_script_that_starts_one_task_per_gpu(capsys, tmp_path):
    code, script, _ = submit(capsys, str(RECIPES / "digits.yaml"), "trainer.max_epochs=3", "--nodes", "2",
                             "--gpus-per-node", "4", "--partition", "gpu", "--time", "01:00:00", "--account", "proj",
                             "--sbatch=--mem=16G", "--sbatch=--qos=high", "--dry-run")
    assert code == 0
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=digits", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
        f"#SBATCH --output={tmp_path / 'runs' / 'slurm-%j.out'}", "#SBATCH --open-mode=append",
        "#SBATCH --signal=TERM@120", "#SBATCH --requeue", "#SBATCH --partition=gpu", "#SBATCH --time=01:00:00",
        "#SBATCH --account=proj", "#SBATCH --mem=16G", "#SBATCH --qos=high",
    ]
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    assert srun == (f"srun --kill-on-bad-exit=1 {sys.executable} -m torchyard.trainer fit {RECIPES / 'digits.yaml'} "
                    f'trainer.max_epochs=3 trainer.num_nodes=2 trainer.devices=4 "trainer.default_root_dir='
                    f'{tmp_path / "runs"}/slurm-${{SLURM_JOB_ID}}" ${{SLURM_RESTART_COUNT:+ckpt_path=last}}')
    assert "if [ $status -eq 143 ]; then" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0


def test_the_batch_shell_expands_the_run_root_and_resumes_only_when_requeued(capsys, tmp_path):
    _, script, _ = submit(capsys, str(RECIPES / "digits.yaml"), "--devices-per-node", "2", "--dry-run")
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    echo = srun.replace("srun --kill-on-bad-exit=1", "printf '%s\\n'", 1)
    first = subprocess.run(["bash", "-c", echo], capture_output=True, text=True, env={"SLURM_JOB_ID": "77"}).stdout
    again = subprocess.run(["bash", "-c", echo], capture_output=True, text=True,
                           env={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}).stdout
    assert first.splitlines()[-2:] == ["trainer.devices=2", f"trainer.default_root_dir={tmp_path / 'runs'}/slurm-77"]
    assert again.splitlines()[-1] == "ckpt_path=last"


def test_resume_continues_an_earlier_jobs_run_folder(capsys, tmp_path):
    _, script, _ = submit(capsys, str(RECIPES / "digits.yaml"), "--resume", "runs/slurm-12", "--dry-run")
    assert f"trainer.default_root_dir={tmp_path / 'runs' / 'slurm-12'} ckpt_path=last" in script


def test_a_python_script_runs_under_srun_with_its_arguments(capsys, tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    # submit's options first; the script's own follow `--`.
    _, script, _ = submit(capsys, "--nodes", "2", "--devices-per-node", "3", "--dry-run",
                          "train.py", "--", "--lr", "0.1")
    assert f"srun --kill-on-bad-exit=1 {sys.executable} {tmp_path / 'train.py'} --lr 0.1" in script
    assert "#SBATCH --job-name=train" in script and "#SBATCH --ntasks-per-node=3" in script


@pytest.mark.parametrize("args, message", [
    (["digits.yaml", "--nodes", "0"], "--nodes 0: give 1 or more."),
    (["digits.yaml", "--gpus-per-node", "4", "--devices-per-node", "2"], "srun starts one task per GPU"),
    (["missing.yaml"], "recipe file 'missing.yaml' does not exist."),
    (["missing.py"], "script 'missing.py' does not exist."),
    (["digits.yaml", "--sbatch=mem=4G"], "give an sbatch option, e.g. --sbatch=--mem=16G"),
    (["digits.yaml", "trainer.max_epochs=-5"], "max_epochs"),
])
def test_bad_input_is_one_line_and_submits_nothing(capsys, monkeypatch, tmp_path, args, message):
    (tmp_path / "digits.yaml").write_text((RECIPES / "digits.yaml").read_text())
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # an sbatch call would fail differently
    code, out, err = submit(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("trainer submit: error: ") and message in err


def test_without_sbatch_on_path_it_says_where_to_submit_from(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, _, err = submit(capsys, str(RECIPES / "digits.yaml"))
    assert code == 2 and "sbatch is not on PATH" in err
