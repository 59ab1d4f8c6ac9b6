"""Starting the processes of a job as Ray actors (`Trainer(launcher="ray")`), on an existing Ray cluster or a
local one. How to use it, and what it asks of the cluster: docs/ray.md.

Each actor runs one rank. Ranks are numbered node by node, so that a node's ranks are contiguous as under
torchrun; rank 0's actor picks the rendezvous port on its node and every actor gets the variables torchrun would
set, which environment.py reads. The rest is the self-launch's contract: the caller adopts the reporting rank's
final state (launcher.adopt), the first failure ends the job with its error, and `max_restarts` starts every
rank again, resuming from the run's newest checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchyard.trainer.cluster.environment import ClusterEnvironment, detect_environment, find_free_port
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.launch.elastic import WorkerTraceback, decide_run_folder
from torchyard.trainer.loop import faults

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer

INSTALL_HINT = "pip install 'torchyard[ray]'"
#: Seconds to reach a Ray address before calling it unreachable: ray.init itself retries for minutes.
CONNECT_TIMEOUT = 5.0
#: After a first failure, seconds the other ranks get to report theirs: a rank killed by a signal reports
#: after the peers it left behind, whose errors (a closed connection) are only its consequences.
SETTLE_SECONDS = 2.0


def import_ray() -> Any:
    """The ray module, or a one-line error saying how to install it."""
    if not sys.stdout.isatty():
        # Ray prefixes each line of the workers' output it prints here with "(rank 0 pid=...)" in colour codes,
        # also into a file or a pipe; Ray's documented RAY_COLOR_PREFIX=0 leaves them out (a user's choice wins).
        # Its de-duplication of lines repeated within seconds ("[repeated 2x across cluster]", after a restart
        # say) writes colour codes whatever that says, and hides lines a log file should keep: off too (Ray reads
        # RAY_DEDUP_LOGS on import, so it is set before).
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        import ray  # optional: only launcher="ray" needs it
    except ImportError as err:
        raise MisconfigurationError(f"launcher='ray' needs Ray, which is not installed: {INSTALL_HINT}.") from err
    return ray


def launch(trainer: Trainer, stage: str, *run_args: Any) -> dict[str, Any]:
    """Run `trainer._run(stage, *run_args)` on every rank of the job, each a Ray actor; return the reporting
    rank's outcome (what launcher.adopt takes)."""
    ray = import_ray()
    started_here = connect(ray, trainer.config.ray_address)  # first: a bad address leaves no run folder behind
    try:
        decide_run_folder(trainer)  # every rank, and every restarted attempt, writes to it
        return _run_job(ray, trainer, _pickle_job(ray, trainer, stage, run_args))
    finally:
        if started_here:
            ray.shutdown()  # a local cluster ray.init started goes with it; a cluster it joined stays up


def connect(ray: Any, address: str | None) -> bool:
    """Join the Ray cluster at `address` (None: Ray's own choice, RAY_ADDRESS or a new local cluster); True when
    this call connected (and so should disconnect). An address nothing answers at is a one-line error."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is not None and address not in ("auto", "local"):
        check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
    except ConnectionError as err:
        if address is None or address in ("auto", "local"):
            raise MisconfigurationError(f"no Ray cluster at {address!r}: {_first_line(err)}") from None
        raise MisconfigurationError(refused_connection(address, _first_line(err), os.environ)) from None
    return True


def ray_token_source(env: Mapping[str, str]) -> str | None:
    """Where Ray would read this process's authentication token, in Ray's order (RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token), or None where it has none."""
    if env.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if env.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH ({env['RAY_AUTH_TOKEN_PATH']})"
    default = Path(env.get("HOME") or Path.home()) / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def refused_connection(address: str, reason: str, env: Mapping[str, str]) -> str:
    """The error for a Ray address that answers (check_reachable passed) but that ray.init could not join. Since
    Ray 2.52 the usual cause is token authentication: a cluster started with it (RAY_AUTH_MODE=token, or
    `ray start --head` where ~/.ray/auth_token exists) refuses a process that sends no token or another one, and
    Ray sends one to an address given explicitly only under RAY_AUTH_MODE=token (docs/ray.md#token-authentication)."""
    source, mode = ray_token_source(env), env.get("RAY_AUTH_MODE", "").lower()
    said = f"the Ray cluster at {address} answers but did not let this process join ({reason})"
    if mode == "token" and source is not None:
        return (f"{said}. This process sends the token from {source}: if the cluster refused it, give this process "
                "the cluster's token (`ray get-auth-token` on its head prints it) in RAY_AUTH_TOKEN; else check that "
                "the cluster's head started (`ray status --address` there).")
    if mode != "token" and source is not None:
        return (f"{said}. If the cluster uses token authentication, this process sent no token: Ray sends one to an "
                f"address given explicitly only with RAY_AUTH_MODE=token; set RAY_AUTH_MODE=token here (the token is "
                f"then read from {source}).")
    return (f"{said}. If the cluster uses token authentication (Ray 2.52 and later), this process has no token: set "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head prints "
            "it), or copy the head's ~/.ray/auth_token here.")


def check_reachable(address: str) -> None:
    """A one-line error unless something listens at the Ray address 'host:port' (its format checked in config.py)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise MisconfigurationError(
            f"no Ray cluster at {address} ({reason}); start one there with `ray start --head --port={port}`, "
            "or leave ray_address unset to start a local one."
        ) from None


def _pickle_job(ray: Any, trainer: Trainer, stage: str, run_args: tuple[Any, ...]) -> bytes:
    # Ray's cloudpickle: classes of the calling script travel by value, since the actors never import it.
    try:
        return ray.cloudpickle.dumps((trainer, stage, run_args))
    except Exception as err:  # noqa: BLE001 - pickling raises many types
        raise MisconfigurationError(
            f"the Ray workers need a pickled copy of the job, which cannot be pickled ({_first_line(err)}); keep "
            "open files, locks and sockets out of the module, datamodule and callbacks."
        ) from err


# --------------------------------------------------------------------------- the actors


class RayWorker:
    """One rank of the job, as a Ray actor (wrapped with ray.remote by the launching process)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:
        return f"rank {self.rank}"  # Ray prefixes the actor's output with it: "(rank 0 pid=...)"

    def where(self) -> dict[str, Any]:
        """This node's address, a port free on it (the rendezvous point when this is rank 0) and the GPUs Ray
        gave this actor."""
        import ray  # the actor runs in a Ray worker process, where Ray is imported already

        return {"ip": ray.util.get_node_ip_address(), "port": find_free_port(),
                "gpus": [str(gpu) for gpu in ray.get_gpu_ids()]}

    def run(self, payload: bytes, env: dict[str, str], log_path: str | None, sys_path: list[str]) -> dict[str, Any]:
        """Run this rank's stage; the outcome, or {"failure": record} for the launching process to raise."""
        os.environ.update(env)
        # The caller's import path, as a spawned child of the self-launch has it: the job names its modules.
        sys.path[:0] = [entry for entry in sys_path if entry not in sys.path]
        if log_path is not None:
            _redirect_output(log_path)
        environment = detect_environment()
        try:
            trainer, stage, run_args = pickle.loads(payload)
            outcome = trainer._run(stage, *run_args, hand_back=True)
        except faults.Terminated as stopped:  # SIGTERM: the checkpoint is saved, there is no failure to report
            return {"failure": {"rank": self.rank, "terminated": stopped.code, "time": time.time()}}
        except BaseException as err:  # noqa: BLE001 - every failure must reach the launching process
            return {"failure": failure_record(self.rank, err, log_path)}
        if log_path is not None:  # kept only where a failure names it, as the self-launch keeps its output
            _remove_log(log_path)
        return outcome if "state" in outcome or environment.global_rank == 0 else {"result": None}


def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr to `path`: only the reporting rank's output reaches the caller."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)


def _remove_log(path: str) -> None:
    """Remove a rank's log file, and its attempt's and job's folders once empty."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.remove(path)
        os.rmdir(os.path.dirname(path))
        os.rmdir(os.path.dirname(os.path.dirname(path)))


def failure_record(rank: int, err: BaseException, log_path: str | None) -> dict[str, Any]:
    """What the launching process needs to raise a worker's exception: its text, and itself when it pickles."""
    record: dict[str, Any] = {
        "rank": rank, "time": time.time(), "type": type(err).__name__, "message": str(err), "log": log_path,
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)),
    }
    try:
        pickled = pickle.dumps(err)
        pickle.loads(pickled)  # only an exception that survives the round trip can be re-raised as is
        record["exception"] = pickled
    except Exception:  # noqa: BLE001 - whatever pickling the exception raises, its text still travels
        pass
    return record


# --------------------------------------------------------------------------- the job


@dataclass
class _Placement:
    """The job's reserved resources (a placement group of one bundle per rank), ranks numbered node by node."""

    group: Any
    bundle_of_rank: list[int]  # the placement group bundle each rank's actor takes
    node_of_rank: list[str]  # Ray node ids
    node_order: list[str]  # the job's nodes, node rank = index

    def coordinates(self, rank: int, master_addr: str, master_port: int) -> ClusterEnvironment:
        """`rank`'s place in the job, its ranks numbered node by node."""
        node = self.node_of_rank[rank]
        return ClusterEnvironment("torchrun", global_rank=rank, local_rank=self.node_of_rank[:rank].count(node),
                                  world_size=len(self.node_of_rank), local_world_size=self.node_of_rank.count(node),
                                  node_rank=self.node_order.index(node), master_addr=master_addr,
                                  master_port=master_port)

    def same_node(self, rank: int) -> list[int]:
        """The ranks on `rank`'s node, in local-rank order."""
        return [other for other, node in enumerate(self.node_of_rank) if node == self.node_of_rank[rank]]


def _run_job(ray: Any, trainer: Trainer, payload: bytes) -> dict[str, Any]:
    """Every attempt (1 + max_restarts) until one succeeds; the last failure's error otherwise."""
    strategy, max_restarts = trainer.strategy, trainer.config.max_restarts
    placement = _reserve(ray, strategy.job_size, strategy.accelerator == "cuda", float(trainer.config.timeout))
    run_id = f"trainer-ray-{uuid.uuid4().hex[:12]}"
    attempt = 0
    try:
        while True:
            outcomes, failure = _run_attempt(ray, placement, payload, (attempt, run_id), strategy.reporting_rank)
            if failure is None:
                return outcomes.get(strategy.reporting_rank) or next(iter(outcomes.values()), {"result": None})
            error = _job_failure(failure, len(placement.bundle_of_rank), strategy.reporting_rank)
            # A stop asked for (SIGTERM) or a misconfiguration would end a restarted attempt the same way.
            if attempt == max_restarts or isinstance(error, (faults.Terminated, MisconfigurationError)):
                raise error
            attempt += 1
            print(f"trainer: {_first_line(error)} Restarting every rank ({attempt} of {max_restarts}).",
                  file=sys.stderr, flush=True)
    finally:
        ray.util.remove_placement_group(placement.group)


def _reserve(ray: Any, world_size: int, gpus: bool, timeout: float) -> _Placement:
    """A bundle of one CPU (and one GPU) per rank, packed onto as few nodes as fit; a one-line error when the
    cluster does not have them in all."""
    bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
    total = ray.cluster_resources()
    short = [name for name, amount in bundle.items() if total.get(name, 0) < amount * world_size]
    if short:
        have = ", ".join(f"{total.get(name, 0):g} {name}" for name in bundle)
        raise MisconfigurationError(
            f"the Ray cluster has {have}, but {world_size} ranks need {world_size} of each of {', '.join(bundle)}; "
            "add nodes (`ray start --address=...` on each) or lower devices/num_nodes."
        )
    group = ray.util.placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise MisconfigurationError(
            f"the Ray cluster did not free {world_size} x {bundle} within timeout={timeout:g} s; other jobs hold them."
        ) from None
    nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
    # Node by node, the nodes in order of their first bundle: a node's ranks are contiguous, as torchrun's.
    order = list(dict.fromkeys(nodes[index] for index in range(world_size)))
    bundles = sorted(range(world_size), key=lambda index: (order.index(nodes[index]), index))
    return _Placement(group, bundles, [nodes[index] for index in bundles], order)


def _start_actors(ray: Any, placement: _Placement) -> list[Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    worker = ray.remote(RayWorker)
    actors = []
    for rank, bundle in enumerate(placement.bundle_of_rank):
        where = PlacementGroupSchedulingStrategy(placement_group=placement.group, placement_group_bundle_index=bundle)
        gpus = placement.group.bundle_specs[bundle].get("GPU", 0)
        # max_restarts=0: a rank that dies is the job's failure to settle here, never restarted alone by Ray.
        actors.append(worker.options(num_cpus=1, num_gpus=gpus, scheduling_strategy=where, max_restarts=0)
                      .remote(rank))
    return actors


def _rank_env(placement: _Placement, rank: int, places: list[dict[str, Any]], attempt: int,
              run_id: str) -> dict[str, str]:
    """The variables torchrun sets (environment.torchrun_environment reads them) for `rank` of this attempt."""
    env = {**placement.coordinates(rank, places[0]["ip"], int(places[0]["port"])).variables(),
           "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_RUN_ID": run_id}
    if places[rank]["gpus"]:
        # Every rank of a node sees the node's GPUs of the job, in local-rank order, so cuda:<local rank> is its
        # own and NCCL sees its peers' devices (Ray alone shows each actor only its own GPU).
        same_node = placement.same_node(rank)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu for other in same_node for gpu in places[other]["gpus"])
    return env


def _run_attempt(ray: Any, placement: _Placement, payload: bytes, attempt_of_run: tuple[int, str],
                 shown_rank: int) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None]:
    """One attempt: start an actor per rank, run them, stop them. (outcomes by rank, the first failure or None).
    Only `shown_rank`'s output reaches the caller; the others' stays in a file on their node."""
    attempt, run_id = attempt_of_run
    actors = _start_actors(ray, placement)
    try:
        places = ray.get([actor.where.remote() for actor in actors])
        logs = os.path.join(tempfile.gettempdir(), run_id, f"attempt{attempt}")
        if attempt == 0:
            ranks = f"{len(actors)} rank{'s' if len(actors) != 1 else ''}"
            print(f"trainer: {ranks} as Ray actors on {len(placement.node_order)} node(s), rank 0 at "
                  f"{places[0]['ip']}; the other ranks' output: {os.path.dirname(logs)} on their nodes.",
                  file=sys.stderr, flush=True)
        refs = {
            actor.run.remote(payload, _rank_env(placement, rank, places, attempt, run_id),
                             None if rank == shown_rank else os.path.join(logs, f"rank{rank}.log"), sys.path): rank
            for rank, actor in enumerate(actors)
        }
        return _collect(ray, refs, placement, places)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def _collect(ray: Any, refs: dict[Any, int], placement: _Placement, places: list[dict[str, Any]]
             ) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None]:
    """Wait for every rank; at the first failure, give the others SETTLE_SECONDS to report theirs, then pick the
    one that caused the rest (a rank that died before any that raised)."""
    outcomes: dict[int, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    pending = list(refs)
    while pending:
        timeout = SETTLE_SECONDS if failures else None
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not done:
            break
        rank = refs[done[0]]
        try:
            outcome = ray.get(done[0])
        except ray.exceptions.RayActorError as err:
            failures.append({"rank": rank, "died": _first_line(err), "ip": places[rank]["ip"],
                             "node": placement.node_of_rank[rank],
                             "time": time.time()})
            continue
        if "failure" in outcome:
            failures.append(outcome["failure"])
        else:
            outcomes[rank] = outcome
    if not failures:
        return outcomes, None
    died = [f for f in failures if "died" in f]
    return outcomes, min(died or failures, key=lambda f: f["time"])


def _job_failure(failure: dict[str, Any], world_size: int, shown_rank: int) -> BaseException:
    """The exception the launching process raises for the failure that ended an attempt."""
    rank = failure["rank"]
    if "terminated" in failure:
        return faults.Terminated(failure["terminated"])
    if "died" in failure:
        return RuntimeError(f"rank {rank} of {world_size} died on Ray node {failure['ip']} ({failure['node'][:8]}: "
                            "killed by a signal, out of memory, or its node left), so the job was stopped. "
                            f"Ray: {failure['died']}")
    where = f" Its output: {failure['log']} on its node." if failure.get("log") and rank != shown_rank else ""
    remote = WorkerTraceback(f"rank {rank} of {world_size} failed; its traceback:\n\n{failure['traceback'].rstrip()}")
    original = pickle.loads(failure["exception"]) if "exception" in failure else None
    if isinstance(original, MisconfigurationError):
        return MisconfigurationError(f"{original} (raised on rank {rank})")
    if isinstance(original, BaseException):
        original.__cause__ = remote
        if hasattr(original, "add_note"):
            original.add_note(f"(raised on rank {rank} of {world_size}; the other ranks were stopped.{where})")
        return original
    error = RuntimeError(f"rank {rank} of {world_size} failed with {failure['type']}: {failure['message']}.{where}")
    error.__cause__ = remote
    return error


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]
