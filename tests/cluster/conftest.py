"""Real services for the cluster tests, each started once per session only when a test asks for its fixture, and
stopped at the end if this session started it: a one-node SLURM (slurm.sh, `slurm`) for the tests that submit jobs,
and an sshd with a test key (sshd.sh, `sshd`) for `trainer launch --hosts`."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("slurm.sh")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes tens of seconds or more (real SLURM jobs, several processes)")


@dataclass(frozen=True)
class Slurm:
    """The running cluster: its config file, which its commands read through SLURM_CONF, and its one node."""

    conf: str
    node: str

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields of a job (kept for MinJobAge, 300 s, after it ends)."""
        shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True)
        return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)

    def wait(self, job_id: str, timeout: float, restarts: int = 0) -> dict[str, str]:
        """The job's fields once it has ended (after `restarts` requeues); fails the test past `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields["JobState"] in FINAL_STATES and int(fields.get("Restarts", 0)) >= restarts:
                return fields
            time.sleep(1)
        pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout:.0f} s")


@pytest.fixture(scope="session")
def slurm_cluster():
    """slurm.sh start: install, configure and start SLURM once per session, or skip saying why it cannot."""
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"SLURM could not be started: {err}")
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"slurm.sh start exited with {done.returncode}"])[-1]
        print(f"\nskipping the SLURM tests: {reason}")
        pytest.skip(f"SLURM could not be started: {reason}")
    values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    print(f"\nSLURM {done.stdout.split()[-1]} in {time.monotonic() - started:.1f} s ({values['SLURM_CONF']})")
    conf = values["SLURM_CONF"]
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True,
                           env={**os.environ, "SLURM_CONF": conf})
    yield Slurm(conf=conf, node=nodes.stdout.split()[0])
    if done.stdout.split()[-1] == "started":
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120, check=False)


@pytest.fixture
def slurm(slurm_cluster: Slurm, monkeypatch: pytest.MonkeyPatch) -> Slurm:
    """The cluster, with SLURM_CONF set for this test (and the jobs it submits)."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.conf)
    return slurm_cluster


@pytest.fixture
def slurm_jobs(slurm: Slurm):
    """Job ids a test appends here are cancelled after it, whatever its outcome."""
    jobs: list[str] = []
    yield jobs
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, check=False)


SSHD_SCRIPT = Path(__file__).with_name("sshd.sh")


@pytest.fixture(scope="session")
def sshd() -> Iterator[str]:
    """sshd.sh start: an sshd on this machine with a key made for the tests, once per session; the path of the ssh
    client config (`ssh -F`) that logs in to it as localhost and 127.0.0.1. Skips, saying why, where it cannot run."""
    try:
        done = subprocess.run(["bash", str(SSHD_SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"sshd could not be started: {err}")
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"sshd.sh start exited with {done.returncode}"])[-1]
        pytest.skip(f"sshd could not be started: {reason}")
    values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    yield values["SSH_CONFIG"]
    if done.stdout.split()[-1] == "started":
        subprocess.run(["bash", str(SSHD_SCRIPT), "stop"], capture_output=True, timeout=60, check=False)
