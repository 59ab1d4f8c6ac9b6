"""Run folders: runs started at the same moment get a version folder each."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import reaped

from torchyard.trainer.logs.runs import VersionClaim

SCRIPT = Path(__file__).parent / "version_race" / "race_script.py"
RUNS = 4  # enough to race for the same folder names; each one more is another interpreter importing torch


def test_a_claim_takes_the_next_free_number_and_gives_back_only_what_it_created(tmp_path):
    (tmp_path / "exp" / "version_0").mkdir(parents=True)
    (tmp_path / "exp" / "version_2").mkdir()
    first, second = VersionClaim(tmp_path, "exp"), VersionClaim(tmp_path, "exp")
    assert (first.version, second.version) == (3, 4)  # after the highest, as before; never one already made
    (tmp_path / "exp" / "version_4" / "metrics.csv").write_text("step\n")
    first.release()
    second.release()
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["version_0", "version_2", "version_4"]
    fresh = VersionClaim(tmp_path / "new", "exp")
    assert (tmp_path / "new" / "exp" / "version_0").is_dir()
    fresh.release()
    assert not (tmp_path / "new").exists()  # a run that wrote nothing leaves no folder behind


@pytest.mark.timeout(300)
def test_four_fits_started_at_once_get_four_folders_and_four_whole_metrics_files(tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), str(tmp_path / "root"), str(go)]
    procs = [subprocess.Popen([*command, str(tmp_path / f"ready{i}")], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for i in range(RUNS)]
    with reaped(procs):
        deadline = time.time() + 240
        while not all((tmp_path / f"ready{i}").exists() for i in range(RUNS)):
            failed = [proc for proc in procs if proc.poll() is not None]
            if failed or time.time() > deadline:
                output = failed[0].communicate()[0][-3000:] if failed else "timeout"
                pytest.fail(f"a run ended before the start:\n{output}")
            time.sleep(0.05)
        go.write_text("go")  # every run asks for its folder now
        outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * RUNS, outputs
    folders = {output.strip().splitlines()[-1] for output in outputs}
    assert len(folders) == RUNS
    assert sorted(Path(folder).name for folder in folders) == [f"version_{i}" for i in range(RUNS)]
    for folder in folders:
        with open(Path(folder) / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [int(row["step"]) for row in rows if row.get("loss")] == [1, 2, 3, 4]  # every step of its own run
