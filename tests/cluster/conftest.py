"""Real services for the cluster tests, each started once per session only when a test asks for its fixture, and
stopped at the end if this session started it: a one-node SLURM (slurm.sh, `slurm`) for the tests that submit jobs,
and an sshd with a test key (sshd.sh, `sshd`) for `trainer launch --hosts`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
        ended_early: float | None = None  # when it was seen ended with fewer requeues than expected
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields["JobState"] in FINAL_STATES:
                if int(fields.get("Restarts", 0)) >= restarts:
                    return fields
                ended_early = ended_early or time.monotonic()
                if time.monotonic() - ended_early > 15:  # no requeue is coming (before MinJobAge purges the job)
                    pytest.fail(f"job {job_id} ended {fields['JobState']} after {fields.get('Restarts', 0)} "
                                f"requeue(s), not {restarts}")
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
# --------------------------------------------------------------------------- Ray


#: For the cluster's processes: no usage report, and no token authentication (seen with Ray 2.60: once a local
#: `ray.init()` had written ~/.ray/auth_token, a second node joining a fresh head failed with InvalidAuthToken).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


class RayCluster:
    """Two Ray nodes on this machine, one CPU each: a job's two ranks (one CPU each) land one on each node.
    Started in the background: a test first asks for what else it needs (a reference run), then for `address`."""

    def __init__(self, temp_dir: Path, port: int) -> None:
        self.temp_dir, self.port = temp_dir, port
        # Both at once: the second node waits for the head's GCS to answer, which saves one start-up's time.
        self._starts = [
            _ray_start("--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false",
                       temp_dir=temp_dir),
            _ray_start(f"--address=127.0.0.1:{port}", temp_dir=temp_dir),
        ]
        self._failure: str | None = None

    @property
    def address(self) -> str:
        """The head's address once both nodes are up; skips the test, saying why, where they did not start."""
        if self._starts:
            self._failure = self._wait()
            self._starts = []
        if self._failure is not None:
            pytest.skip(f"Ray could not be started: {self._failure}")
        return f"127.0.0.1:{self.port}"

    def _wait(self) -> str | None:
        try:
            outputs = [start.communicate(timeout=300)[0] for start in self._starts]
        except subprocess.TimeoutExpired:
            return "`ray start` took over 300 s"
        failed = [output for start, output in zip(self._starts, outputs) if start.returncode != 0]
        if failed:
            return (failed[0].strip().splitlines() or ["?"])[-1]
        if not _wait_for_nodes(f"127.0.0.1:{self.port}", 2, timeout=60):
            return "the second node did not join the head within 60 s"
        return None

    def stop(self) -> None:
        """End the `ray start` commands still running, then the cluster's processes."""
        for start in self._starts:
            start.kill()
            start.wait()
        _stop_ray_cluster(self.temp_dir, self.port)


def _ray_start(*args: str, temp_dir: Path) -> subprocess.Popen:
    ray = Path(sys.executable).with_name("ray")
    env = {**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(ray), "start", "--num-cpus=1", "--disable-usage-stats", *args], text=True, env=env,
                            cwd=temp_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for_nodes(address: str, count: int, timeout: float) -> bool:
    """True once `ray status` lists `count` active nodes (a node that `ray start` reported may register later)."""
    ray = Path(sys.executable).with_name("ray")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run([str(ray), "status", f"--address={address}"], capture_output=True, text=True,
                               timeout=timeout, env={**os.environ, **RAY_ENV})
        active = shown.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        if shown.returncode == 0 and active.count(" node_") >= count:
            return True
        time.sleep(1)
    return False


def _cluster_processes(temp_dir: Path, port: int) -> list[int]:
    """The processes of the cluster under `temp_dir` (its daemons name their session folder) and their children, and
    the head's client server, which names only the head's address: Ray gives it the machine's own IP even for a
    127.0.0.1 head (it resolves loopback to a reachable address), and `ray start` has left it to init."""
    parents: dict[int, int] = {}
    ours = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        head = re.search(rf"ray\.util\.client\.server --address=\S+:{port} ", cmdline)
        if (str(temp_dir) in cmdline or head) and int(proc.name) != os.getpid():
            ours.add(int(proc.name))
    grown = True
    while grown:  # workers and agents are the raylets' children, with process titles that name no folder
        children = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= children
        grown = bool(children)
    return sorted(ours)


def _stop_ray_cluster(temp_dir: Path, port: int) -> None:
    """End this cluster's processes only, by their ids (`ray stop` would end every Ray on the machine); SIGKILL at
    once, as `ray stop --force` does: a test cluster holds nothing to save."""
    deadline = time.monotonic() + 10
    while (pids := _cluster_processes(temp_dir, port)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster():
    """`ray start --head` and a second `ray start --address` once per session, stopped at its end; a test that reads
    its address is skipped, saying why, where Ray is not installed or does not start."""
    # Looked up, not imported: the launcher imports Ray first, as in `trainer fit`, once it has set how Ray logs.
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    # Short and under /tmp: Ray's socket paths must stay under the 107-byte limit of a Unix socket name.
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    with socket.socket() as sock:  # Ray's worker processes take ports 10002-19999; the OS picks above them
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cluster = RayCluster(temp_dir, port)
    try:
        yield cluster
    finally:
        cluster.stop()
