"""Who launched this process, and so its rank, local rank, world size and master address.

The environment is read once, here, and passed down; nothing else in the framework reads these variables.
Detection order: torchrun (and the Trainer's own launcher, which is torchrun's agent), SLURM, MPI, local.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.errors import MisconfigurationError


@dataclass(frozen=True)
class ClusterEnvironment:
    """The coordinates of this process in its job."""

    name: str
    global_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    @property
    def launched(self) -> bool:
        """True when a launcher already started every process of the job (no self-spawn needed)."""
        return self.name != "local"

    def export(self) -> None:
        """Set the variables torch.distributed's env:// rendezvous reads."""
        os.environ.update(
            MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port), RANK=str(self.global_rank),
            WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
        )


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise MisconfigurationError(f"environment variable {key} is missing; the launcher should set it.")
        return default
    try:
        return int(raw)
    except ValueError as err:
        raise MisconfigurationError(f"environment variable {key}={raw!r} is not an integer.") from err


def torchrun_environment(env: Mapping[str, str]) -> ClusterEnvironment | None:
    """torchrun / torch.distributed.elastic (also the Trainer's own launcher)."""
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
    return ClusterEnvironment(
        name="torchrun", global_rank=_int(env, "RANK"), local_rank=_int(env, "LOCAL_RANK"),
        world_size=_int(env, "WORLD_SIZE"), local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", _int(env, "RANK") // max(local_world, 1)),
        master_addr=env["MASTER_ADDR"], master_port=_int(env, "MASTER_PORT"),
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM_NODELIST such as 'gpu[07-09,12],cpu3' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise MisconfigurationError(f"cannot read SLURM_NODELIST={nodelist!r}.")
    prefix, ranges = match.group(1), match.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def slurm_environment(env: Mapping[str, str]) -> ClusterEnvironment | None:
    """srun: one task per process. An interactive allocation (`salloc` shell, job name 'bash') is not a launch."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    job_id = _int(env, "SLURM_JOB_ID", 0)
    return ClusterEnvironment(
        name="slurm", global_rank=_int(env, "SLURM_PROCID"), local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=_int(env, "SLURM_NTASKS"), local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", 1)
        if env.get("SLURM_NTASKS_PER_NODE", "").isdigit() else 1,
        node_rank=_int(env, "SLURM_NODEID", 0),
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1")),
        # One port per job, so two jobs sharing a node do not collide.
        master_port=_int(env, "MASTER_PORT", 15000 + job_id % 20000),
    )


def mpi_environment(env: Mapping[str, str]) -> ClusterEnvironment | None:
    """mpirun / mpiexec (Open MPI's OMPI_COMM_WORLD_*, MPICH and Intel MPI's PMI_*)."""
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank, local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    elif "PMI_RANK" in env:
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank, local_size = _int(env, "MPI_LOCALRANKID", 0), _int(env, "MPI_LOCALNRANKS", 1)
    else:
        return None
    if "MASTER_ADDR" not in env and size > 1 and local_size < size:
        raise MisconfigurationError(
            "an MPI launch across nodes needs MASTER_ADDR (the host of rank 0), e.g. mpirun -x MASTER_ADDR=node01."
        )
    return ClusterEnvironment(
        name="mpi", global_rank=rank, local_rank=local_rank, world_size=size, local_world_size=local_size,
        node_rank=rank // max(local_size, 1), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),
    )


DETECTORS = (torchrun_environment, slurm_environment, mpi_environment)


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The first launcher whose variables are present, else a local single-process environment."""
    env = os.environ if env is None else env
    for detector in DETECTORS:
        found = detector(env)
        if found is not None and found.world_size >= 1:
            return found
    return ClusterEnvironment(name="local", master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                              master_port=_int(env, "MASTER_PORT", 0) or find_free_port())


def find_free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
