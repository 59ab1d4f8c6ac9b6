"""Who launched this process, and so its rank, local rank, world size and master address.

The environment is read once, here, and passed down; nothing else in the framework reads these variables.
Detection order: torchrun (and the Trainer's own launcher, which is torchrun's agent), SLURM, MPI, local.
A launcher that started a single process (`srun -n 1`, `mpirun -np 1`) has not started the job's processes,
nor has an `sbatch` script's or an `salloc` shell, whatever task count they set: the Trainer may start them
itself. To force one answer, give the strategy an environment: `DDPStrategy(environment="slurm")` or
`DDPStrategy(environment=ClusterEnvironment(...))`.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torchyard.trainer.errors import MisconfigurationError


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
    #: The master port is a TCPStore that torch's elastic agent already serves (torchrun's c10d/static
    #: rendezvous); every rank is then a client of it, rank 0 included.
    use_agent_store: bool = False
    #: How many times an elastic agent restarted this job (0 on the first attempt).
    restart_count: int = 0
    #: How many restarts the elastic agent allows (torchrun --max-restarts, or Trainer(max_restarts)): above 0, an
    #: attempt may run on fewer or more nodes than the last (torchrun --nnodes=MIN:MAX).
    max_restarts: int = 0
    #: torchrun's rendezvous id (--rdzv-id, or a fresh one per --standalone job): the same in every attempt of
    #: one job. None for its default "none", which tells one job from another no more than no id does.
    run_id: str | None = None
    #: Torch threads for this process where its launcher left them at torch's default, every core of the node in
    #: each task (srun, mpirun): a share of the node's cores, as the Trainer's own launcher gives its workers.
    #: None: leave them as they are (OMP_NUM_THREADS was set; torchrun sets it).
    threads: int | None = None

    @property
    def launched(self) -> bool:
        """True when a launcher already started every process of the job (no self-spawn needed)."""
        return self.name != "local"

    def variables(self) -> dict[str, str]:
        """These coordinates under the names torchrun sets, which torch.distributed's env:// rendezvous, user code
        and torchrun_environment read: what a launcher hands each process it starts."""
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port), "RANK": str(self.global_rank),
                "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "NODE_RANK": str(self.node_rank)}

    def export(self) -> None:
        """Set this process's variables (see variables)."""
        os.environ.update(self.variables())


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
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
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
        run_id=env.get("TORCHELASTIC_RUN_ID") if env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none") else None,
    )


def _split_top_level(hostlist: str) -> list[str]:
    """'a[1-2,5],b' -> ['a[1-2,5]', 'b']: commas inside brackets do not separate hosts."""
    parts, depth, current = [], 0, ""
    for char in hostlist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _bracket_values(ranges: str, hostlist: str) -> list[str]:
    """'07-09,12' -> ['07', '08', '09', '12']: a range keeps the zero padding of its lower bound."""
    values = []
    for item in ranges.split(","):
        low, dash, high = item.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise MisconfigurationError(f"cannot read the SLURM host list {hostlist!r}: {item!r} is not a range.")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host of a SLURM host list, in order: 'node[01-03,07],gpu-a[1-2]' -> node01 node02 node03 node07
    gpu-a1 gpu-a2 (several brackets in one name, 'rack[1-2]-gpu[1-2]', vary the last one fastest)."""
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        pieces = re.split(r"\[([^\[\]]*)\]", part.strip())  # text, ranges, text, ranges, ..., text
        if not part.strip() or any(c in piece for piece in pieces[::2] for c in "[]"):
            raise MisconfigurationError(
                f"cannot read the SLURM host list {hostlist!r}; set MASTER_ADDR to the first node.")
        names = [pieces[0]]
        for ranges, text in zip(pieces[1::2], pieces[2::2]):
            names = [name + value + text for name in names for value in _bracket_values(ranges, hostlist)]
        hosts += names
    return hosts


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as 'gpu[07-09,12],cpu3' -> 'gpu07'."""
    try:
        return expand_hostlist(_split_top_level(nodelist.strip())[0])[0]
    except MisconfigurationError:
        raise MisconfigurationError(
            f"cannot read SLURM_NODELIST={nodelist!r}; set MASTER_ADDR to the first node.") from None


def expand_tasks_per_node(counts: str) -> list[int]:
    """SLURM's per-node task counts, '2(x3),1' -> [2, 2, 2, 1]."""
    expanded = []
    for item in counts.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise MisconfigurationError(f"cannot read the SLURM tasks per node {counts!r}: {item!r} is not N or N(xM).")
        expanded += [int(match.group(1))] * int(match.group(2) or 1)
    return expanded


#: Step ids of the job's own steps that run no srun task: the batch script (an sbatch shell), the extern step
#: and salloc's interactive step (which also runs one task). Anything above this is one of them.
_LAST_TASK_STEP_ID = 0xFFFFFFF0


def slurm_environment(env: Mapping[str, str]) -> ClusterEnvironment | None:
    """srun: one task per process. Only srun's tasks have a step id: the shell of an `sbatch` script or of an
    `salloc` (SLURM variables, but started by no srun) has none, and starts the job's processes itself."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if "SLURM_PROCID" not in env or not step.isdigit() or int(step) >= _LAST_TASK_STEP_ID:
        return None
    # The step's variables first: inside an allocation the job's may count more tasks or nodes than this step.
    world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    if world == 1:
        return None  # one task (`srun python train.py`): the Trainer starts the job's processes itself
    node_rank = _int(env, "SLURM_NODEID", 0)
    local_world = _slurm_tasks_on_node(env, node_rank)
    return ClusterEnvironment(
        name="slurm", global_rank=_int(env, "SLURM_PROCID"), local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=world, local_world_size=local_world, node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR") or _slurm_master(env),
        # One port per job, so two jobs sharing a node do not collide.
        master_port=_int(env, "MASTER_PORT", 15000 + _int(env, "SLURM_JOB_ID", 0) % 20000),
        threads=task_threads(env, local_world),
    )


def _slurm_tasks_on_node(env: Mapping[str, str], node_rank: int) -> int:
    """This node's task count: srun sets the per-node counts for every launch; SLURM_NTASKS_PER_NODE is only
    there when --ntasks-per-node was given."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if env.get(key):
            counts = expand_tasks_per_node(env[key])
            if key == "SLURM_NTASKS_PER_NODE" or node_rank < len(counts):
                return counts[min(node_rank, len(counts) - 1)]
            raise MisconfigurationError(
                f"{key}={env[key]!r} counts {len(counts)} nodes, but SLURM_NODEID is {node_rank}.")
    return 1


def _slurm_master(env: Mapping[str, str]) -> str:
    """The step's first node, where task 0 runs; the job's node list when the step's is not set."""
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(key):
            return first_slurm_host(env[key])
    raise MisconfigurationError("srun set no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST); set MASTER_ADDR.")


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
    if size == 1:
        return None  # `mpirun -np 1`: the Trainer starts the job's processes itself
    if "MASTER_ADDR" not in env and local_size < size:
        raise MisconfigurationError(
            "an MPI launch across nodes needs MASTER_ADDR (the host of rank 0), e.g. mpirun -x MASTER_ADDR=node01."
        )
    return ClusterEnvironment(
        name="mpi", global_rank=rank, local_rank=local_rank, world_size=size, local_world_size=local_size,
        node_rank=rank // max(local_size, 1), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500), threads=task_threads(env, local_size),
    )


def local_environment(env: Mapping[str, str]) -> ClusterEnvironment:
    """No launcher: one process, which may start the others itself (trainer/launch/elastic.py)."""
    return ClusterEnvironment(name="local", master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                              master_port=_int(env, "MASTER_PORT", 0) or find_free_port(),
                              node_rank=_int(env, "NODE_RANK", 0))


DETECTORS: dict[str, Callable[[Mapping[str, str]], ClusterEnvironment | None]] = {
    "torchrun": torchrun_environment, "slurm": slurm_environment, "mpi": mpi_environment,
}


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The first launcher whose variables are present, else a local single-process environment."""
    env = os.environ if env is None else env
    for detector in DETECTORS.values():
        found = detector(env)
        if found is not None:
            return found
    return local_environment(env)


def resolve_environment(
    choice: str | ClusterEnvironment | None, env: Mapping[str, str] | None = None
) -> ClusterEnvironment:
    """`choice` as given (an instance), the named launcher's reading, or detection when None."""
    if isinstance(choice, ClusterEnvironment):
        return choice
    if choice is None:
        return detect_environment(env)
    env = os.environ if env is None else env
    if choice == "local":
        return local_environment(env)
    if choice not in DETECTORS:
        raise MisconfigurationError(
            f"environment={choice!r} is not known; use one of {', '.join([*DETECTORS, 'local'])} or a "
            "ClusterEnvironment."
        )
    found = DETECTORS[choice](env)
    if found is None:
        raise MisconfigurationError(
            f"environment={choice!r} was asked for, but its variables are not set in this process."
        )
    return found


def node_rendezvous(env: Mapping[str, str] | None = None) -> tuple[str, int, int]:
    """(master address, master port, node rank) for a job the Trainer starts on several nodes itself."""
    env = os.environ if env is None else env
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not env.get(key)]
    if missing:
        raise MisconfigurationError(
            f"num_nodes > 1 without a launcher needs {', '.join(missing)} set on every node (the address and a free "
            "port of node 0, and this node's rank), or start the job with torchrun, srun or mpirun."
        )
    return env["MASTER_ADDR"], _int(env, "MASTER_PORT"), _int(env, "NODE_RANK")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which SLURM and containers narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worker_threads(processes_per_node: int) -> int:
    """Torch threads for each of this node's workers: the user's OMP_NUM_THREADS (its outer level when nested, as
    in "4,2"), else the usable cores shared among the workers. Set explicitly in each worker: one forked from the
    forkserver keeps the thread count the forkserver started with."""
    outer = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return max(1, int(outer)) if outer.isdigit() else max(1, usable_cores() // processes_per_node)


def task_threads(env: Mapping[str, str], tasks_on_node: int) -> int | None:
    """Torch threads for each of a node's tasks that srun or mpirun started: None where OMP_NUM_THREADS is set
    (torch read it as it started), else SLURM_CPUS_PER_TASK, else the usable cores shared among the node's tasks,
    at least one (under srun's CPU binding the usable cores are the task's own)."""
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    cpus = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpus.isdigit() and int(cpus) > 0:
        return int(cpus)
    return max(1, usable_cores() // max(tasks_on_node, 1))


def find_free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
