"""Starting the processes of a job (torch's elastic agent, in the calling process) when no launcher did.
What that asks of a script (the `__main__` guard, picklable objects) is in docs/strategies.md#launching."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from torchyard.trainer.cluster import node_checks
from torchyard.trainer.cluster.environment import (
    ClusterEnvironment,
    detect_environment,
    find_free_port,
    node_rendezvous,
    worker_threads,
)
from torchyard.trainer.cluster.script_guard import (
    GUARD_HINT,
    ScriptCall,
    in_spawn_bootstrap,
    names_bound_only_under_the_guard,
    script_call,
)
from torchyard.trainer.diagnosis.doctor import NoLiveJobError, examine
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.launch import warm_start
from torchyard.trainer.launch.script_launch import start_script_ranks
from torchyard.trainer.loop import faults
from torchyard.trainer.loop.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer



class WorkerTraceback(Exception):
    """A worker's traceback, attached as the cause of the exception re-raised in the launching process."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def decide_run_folder(trainer: Trainer) -> None:
    """Fix the run folder (every logger's version, the log_dir) in the launching process, before any worker starts:
    every worker, and every restarted one, then writes to that one folder."""
    for logger in trainer.loggers:
        _ = logger.version
    _ = trainer.log_dir


def launch(trainer: Trainer, stage: str, *run_args: Any) -> dict[str, Any]:
    """Run `trainer._run(stage, *run_args)` on every process of the job; return rank 0's outcome (on another
    node, the outcome of that node's first rank, with the same weights). A script whose main guard holds the
    call spawns its workers; one without a guard re-runs its command line for the other ranks and this process
    runs rank 0 (its outcome then carries no state to adopt: the module trained here)."""
    strategy = trainer.strategy
    script = _calling_script()
    if script is not None and not script.guarded:
        return _run_as_rank_zero(trainer, stage, run_args, script)
    nproc, num_nodes = strategy.processes_per_node(), strategy.num_nodes
    first_node = num_nodes == 1 or _check_master_before_rendezvous(trainer)
    if first_node:
        # The other nodes' workers take rank 0's folder (RunFolder.settle) and claim none: on a shared disk it would
        # stay empty.
        decide_run_folder(trainer)
    payload = _pickle_job(trainer, stage, run_args)
    if warm_start.available():
        warm_start.start()  # already running when the Trainer started it early
    workdir = Path(tempfile.mkdtemp(prefix="trainer-launch-"))
    config, node_rank = _launch_config(trainer, nproc, num_nodes, workdir)
    threads = worker_threads(nproc)
    try:
        with _restored_process_state(), _quiet_agent_logs():
            _report_on_sigusr1(trainer.log_dir if first_node else None)  # the other nodes do not know the folder
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            # Every worker starts from this process's RNG state (seed_everything's seed, or whatever state it has),
            # as the script's code after this call would: the workers do not run the script's main block.
            returns = elastic_launch(config, run_worker)(
                payload, str(workdir), threads, rng_state(), warm_start.LaunchingProcessState()
            )
    except SignalException as err:
        shutil.rmtree(workdir, ignore_errors=True)
        if err.sigval not in faults.STOP_SIGNALS:
            raise
        # Preempted, Ctrl-C or the terminal gone (SIGHUP): the agent forwarded the signal and waited for the
        # workers, which saved last.ckpt.
        raise faults.Terminated(128 + int(err.sigval)) from None
    except ChildFailedError as err:
        if all(f.exitcode in faults.STOPPED_EXIT_CODES for f in err.failures.values()):
            shutil.rmtree(workdir, ignore_errors=True)  # the workers alone got SIGTERM and saved
            raise faults.Terminated(max(f.exitcode for f in err.failures.values())) from None
        failure, keep_output = _job_failure(err, workdir, nproc * num_nodes, strategy.reporting_rank)
        if not keep_output:
            shutil.rmtree(workdir, ignore_errors=True)
        raise failure from failure.__cause__  # the worker's traceback, not the agent's report
    except (RendezvousError, torch.distributed.DistError) as err:
        shutil.rmtree(workdir, ignore_errors=True)
        raise MisconfigurationError(
            f"node {node_rank} could not meet the other nodes at {config.rdzv_endpoint} ({_first_line(err)}); "
            "check MASTER_ADDR, MASTER_PORT and NODE_RANK on every node."
        ) from err
    shutil.rmtree(workdir, ignore_errors=True)
    # The reporting rank's (rank 0 unless the loop's rank 0 lives elsewhere, as ps's chief) when it ran on
    # this node, else this node's first rank that carries a final state (a ps server carries none).
    outcomes = {rank: pickle.loads(data) for rank, data in sorted(returns.items()) if data is not None}
    if strategy.reporting_rank in outcomes:
        return outcomes[strategy.reporting_rank]
    return next((o for o in outcomes.values() if "state" in o), next(iter(outcomes.values()), {"result": None}))


def final_state(trainer: Trainer) -> dict[str, Any]:
    """What the reporting rank hands back to the script that started the job. Every rank calls it: gathering
    a split model's weights (pipeline) is a collective."""
    return {
        "state_dict": {k: v.detach().cpu() for k, v in trainer.strategy.model_state_dict().items()},
        "progress": trainer.progress.state_dict(),
        "callbacks": {c.state_key: _callback_attributes(c, trainer) for c in trainer.callbacks},
        "callback_metrics": {k: v.detach().cpu() for k, v in trainer.callback_metrics.items()},
        "logged_metrics": dict(trainer.logged_metrics),
        "progress_bar_metrics": trainer.progress_bar_metrics,
        "loggers": [logger.state_dict() for logger in trainer.loggers],
        "version": trainer.version,  # a resume may have continued an earlier run's folder
        "world_size": trainer.world_size,
        "data_wait": trainer.data_wait,
    }


class _WorkerObjects(pickle.Pickler):
    """Pickles with the run's trainer, module, submodules and parameters as references by name, which the
    launching script's own objects replace (`_CallerObjects`)."""

    def __init__(self, file: io.BytesIO, trainer: Trainer) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        module = trainer.module
        self.names: dict[int, tuple[str, str]] = {id(trainer): ("trainer", "")}
        if module is not None:
            self.names.update((id(part), ("module", name)) for name, part in module.named_modules())
            self.names.update((id(parameter), ("parameter", name)) for name, parameter in module.named_parameters())

    def persistent_id(self, obj: Any) -> tuple[str, str] | None:
        return self.names.get(id(obj))


class _CallerObjects(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, trainer: Trainer, module: TrainModule) -> None:
        super().__init__(file)
        self.trainer, self.module = trainer, module

    def persistent_load(self, pid: tuple[str, str]) -> Any:
        kind, name = pid
        if kind == "trainer":
            return self.trainer
        return self.module.get_submodule(name) if kind == "module" else self.module.get_parameter(name)


def _callback_attributes(callback: Any, trainer: Trainer) -> bytes:
    """The callback's attributes as rank 0 left them, for the launching script's copy of the callback (a
    user's callback that collects values has them after a self-launched fit too). What does not pickle (a
    console, a lock, a file) is left out: the caller's copy keeps its own."""
    def dumps(value: Any) -> bytes:
        buffer = io.BytesIO()
        _WorkerObjects(buffer, trainer).dump(value)
        return buffer.getvalue()

    portable = {}
    for name, value in vars(callback).items():
        try:
            dumps(value)
        except Exception:  # noqa: BLE001 - whatever pickle raises for an object it cannot carry
            continue
        portable[name] = value
    return dumps(portable)  # together, so that attributes sharing an object still share it


def adopt(trainer: Trainer, module: TrainModule, outcome: dict[str, Any]) -> None:
    """Load the reporting rank's final state into the launching process's module and trainer, so that the
    caller's module holds the trained weights whatever the strategy."""
    state = outcome.get("state")
    if state is None:
        return
    module.load_state_dict(state["state_dict"])
    for callback in trainer.callbacks:
        if callback.state_key in state["callbacks"]:
            attributes = _CallerObjects(io.BytesIO(state["callbacks"][callback.state_key]), trainer, module).load()
            vars(callback).update(attributes)
    trainer.adopt_worker_state(module, state)


def run_worker(payload: bytes, workdir: str, threads: int, launch_rng: dict[str, Any] | None = None,
               launching_process: None = None) -> bytes | None:
    """The entry point of every worker: unpickle the job, take the launching process's RNG state, run the stage,
    hand back the outcome. (`launching_process`, a warm_start.LaunchingProcessState, took effect as it was
    unpickled, before torch's agent set the worker up.)"""
    environment = detect_environment()
    try:
        if threads:
            torch.set_num_threads(threads)
        trainer, stage, run_args = pickle.loads(payload)
        # A collective that hangs without raising ends this worker from its watchdog thread, with the report.
        trainer.strategy.on_hang = functools.partial(_end_hung_worker, Path(workdir), environment)
        if launch_rng is not None:
            set_rng_state(launch_rng)
        outcome = trainer._run(stage, *run_args, hand_back=True)
    except faults.Terminated:
        raise  # SIGTERM: the checkpoint is saved; exit with its code, there is no failure to report
    except BaseException as err:  # noqa: BLE001 - every failure must reach the launching process
        _record_failure(Path(workdir), environment, err)
        # Exit without printing: the launching process shows the first failure once.
        raise SystemExit(1) from None
    reports = "state" in outcome or environment.local_rank == 0
    return pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL) if reports else None


# --------------------------------------------------------------------------- before the launch


def _calling_script() -> ScriptCall | None:
    """Where the script called fit; a clear error when a worker's re-import of the script started it again."""
    if in_spawn_bootstrap():
        # We are a worker re-importing a script whose guard the check could not see.
        raise SystemExit(f"trainer: the script started the job again while a worker imported it; {GUARD_HINT}.")
    return script_call()


def _run_as_rank_zero(trainer: Trainer, stage: str, run_args: tuple[Any, ...], script: ScriptCall) -> dict[str, Any]:
    """Lightning's launch of an unguarded script: the other ranks run its command line, this process is rank 0."""
    restarts = trainer.config.max_restarts
    if restarts:
        raise MisconfigurationError(
            f"max_restarts={restarts} restarts workers that the script starts under its main guard, but "
            f"{script.path}:{script.line} starts a {trainer.strategy.job_size}-process job at its top level; "
            f"{GUARD_HINT}, or run it with `torchrun --max-restarts={restarts}`."
        )
    ranks, environment = start_script_ranks(trainer.strategy.processes_per_node(), trainer.strategy.num_nodes)
    return ranks.run_rank_zero(lambda: trainer._run(stage, *run_args, environment=environment))


class _GuardedDefinitionCheck(pickle.Pickler):
    """Pickles as usual, refusing a class or function of the script that only its main guard defines: the
    workers import the script without running that block, so it would fail there with torch's traceback."""

    def __init__(self, file: io.BytesIO, path: str, guarded: set[str]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.path, self.guarded = path, guarded

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            name = obj.__qualname__.split(".")[0]
            if name in self.guarded:
                raise MisconfigurationError(
                    f"{name} is defined inside `if __name__ == \"__main__\":` of {self.path}, but the worker "
                    "processes import the script without running that block; define it above the guard."
                )
        return NotImplemented


def _pickle_job(trainer: Trainer, stage: str, run_args: tuple[Any, ...]) -> bytes:
    """The job as bytes for the workers; a clear error naming the part that cannot be pickled."""
    try:
        path, guarded = names_bound_only_under_the_guard()
        if not guarded:
            return pickle.dumps((trainer, stage, run_args), protocol=pickle.HIGHEST_PROTOCOL)
        buffer = io.BytesIO()
        _GuardedDefinitionCheck(buffer, path, guarded).dump((trainer, stage, run_args))
        return buffer.getvalue()
    except MisconfigurationError:
        raise
    except Exception as err:  # noqa: BLE001 - pickling raises many types (TypeError, PicklingError, AttributeError)
        module, datamodule, _ckpt, *loaders = run_args
        parts = {"module": module, "datamodule": datamodule, **{f"dataloader {i}": v for i, v in enumerate(loaders)},
                 **{f"callback {type(c).__name__}": c for c in trainer.callbacks},
                 **{f"logger {type(lg).__name__}": lg for lg in trainer.loggers}, "strategy": trainer.strategy}
        culprit = next((name for name, part in parts.items() if not _picklable(part)), "trainer")
        raise MisconfigurationError(
            f"the worker processes need a pickled copy of the {culprit}, which cannot be pickled ({_first_line(err)}); "
            "define classes at module level and keep lambdas, open files and locks out of its attributes."
        ) from err


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001
        return False
    return True


def _check_master_before_rendezvous(trainer: Trainer) -> bool:
    """trainer/cluster/node_checks.py's check of the master address, before the agents meet; whether this is node 0."""
    addr, port, node_rank = node_rendezvous()
    node_checks.check_master(addr, port, serves=node_rank == 0, wait_s=trainer.config.timeout,
                             who=f"node {node_rank}")
    return node_rank == 0


def _launch_config(trainer: Trainer, nproc: int, num_nodes: int, workdir: Path) -> tuple[LaunchConfig, int]:
    """The elastic agent's settings, and this node's rank."""
    if num_nodes == 1:
        node_rank, backend, endpoint, rdzv_configs = 0, "c10d", f"127.0.0.1:{find_free_port()}", {}
        run_id = f"trainer-{uuid.uuid4().hex[:12]}"
    else:
        # The static rendezvous honours NODE_RANK (c10d would number nodes by arrival), so the node at
        # MASTER_ADDR holds global rank 0, where checkpoints and logs are written.
        addr, port, node_rank = node_rendezvous()
        backend, endpoint = "static", f"{addr}:{port}"
        rdzv_configs = {"rank": node_rank, "timeout": int(trainer.config.timeout)}
        run_id = f"trainer-{addr}-{port}"  # the agents' keys live under the run id: the same on every node
    shown = trainer.strategy.reporting_rank - node_rank * nproc  # this node's local rank of it, if here
    quiet = [local for local in range(nproc) if local != shown]
    options: dict[str, Any] = {}
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        options["shutdown_timeout"] = 10  # seconds a stopped worker gets before SIGKILL
    config = LaunchConfig(
        min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs,
        max_restarts=trainer.config.max_restarts, monitor_interval=0.1,  # torchrun's: a job's end is seen sooner
        start_method="forkserver" if warm_start.available() else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(workdir / "output"), redirects={r: Std.ALL for r in quiet}),
        **options,
    )
    return config, node_rank


@contextlib.contextmanager
def _restored_process_state() -> Iterator[None]:
    """Give the caller back its environment variables and signal handlers, which the agent changes."""
    saved_env = dict(os.environ)
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
    saved_handlers = {sig: signal.getsignal(sig) for name in names if (sig := getattr(signal, name, None)) is not None}
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        for sig, handler in saved_handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _report_on_sigusr1(run_folder: str | None) -> None:
    """While the job runs, `kill -USR1 <this process>` prints `trainer doctor`'s report of it on this process's
    stderr (trainer/diagnosis/doctor.py); _restored_process_state puts the caller's handler back afterwards."""
    if run_folder is None or not hasattr(signal, "SIGUSR1"):  # Windows has none
        return

    def report(signum: int, frame: Any) -> None:  # asked from a thread: the agent's loop runs on meanwhile
        threading.Thread(target=_print_report, args=(run_folder,), name="trainer-sigusr1", daemon=True).start()

    signal.signal(signal.SIGUSR1, report)


def _print_report(run_folder: str) -> None:
    try:
        text = examine(run_folder)
    except (NoLiveJobError, MisconfigurationError) as err:
        text = str(err)
    print(f"trainer: SIGUSR1: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_agent_logs() -> Iterator[None]:
    """Silence the agent's own logging (each failing worker, each shutdown step); failures are raised here."""
    names = [
        name
        for name in logging.root.manager.loggerDict
        if name.startswith(("torch.distributed", "torch.multiprocessing"))
    ]
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, saved):
            logger.setLevel(level)


# --------------------------------------------------------------------------- after a failure


def _record_failure(workdir: Path, environment: ClusterEnvironment, err: BaseException) -> None:
    """Leave this worker's exception where the launching process looks for it."""
    rank = environment.global_rank
    record: dict[str, Any] = {
        "rank": rank,
        "attempt": environment.restart_count,
        "time": time.time(),
        "type": type(err).__name__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)),
    }
    with contextlib.suppress(Exception):
        pickled = pickle.dumps(err)
        pickle.loads(pickled)  # only an exception that survives the round trip can be re-raised as is
        record["exception"] = pickled
    path = workdir / f"failure_attempt{environment.restart_count}_rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(record))
    os.replace(tmp, path)


def _end_hung_worker(workdir: Path, environment: ClusterEnvironment, report: str) -> None:
    """Record a hung collective's report (trainer/diagnosis/watchdog.py) as this worker's failure, and exit: its
    training thread is stuck in the collective, so this runs on the watchdog's."""
    _record_failure(workdir, environment, faults.CollectiveTimeoutError(report))
    os._exit(1)


def _job_failure(err: ChildFailedError, workdir: Path, world_size: int, shown_rank: int) -> tuple[BaseException, bool]:
    """The exception to raise for a failed job (the first failing rank's, shown once); keep the output?"""
    records = [pickle.loads(path.read_bytes()) for path in workdir.glob("failure_*.pkl")]
    if records:  # after elastic restarts, the last attempt's failure is the one that ended the job
        last_attempt = max(r["attempt"] for r in records)
        records = [r for r in records if r["attempt"] == last_attempt]
    # A worker killed by a signal (out of memory, a kill from outside) leaves no record; the errors the
    # others then raise (a peer closed the connection) are consequences, so the signal is the cause.
    killed = sorted(rank for rank, failure in err.failures.items() if failure.exitcode < 0)
    output = f" Worker output: {workdir / 'output'}."
    if killed or not records:
        rank = killed[0] if killed else err.get_first_failure()[0]
        failure = err.failures[rank]
        how = (
            f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
        )
        return RuntimeError(f"rank {rank} of {world_size} {how}, so the job was stopped.{output}"), True
    record = min(records, key=lambda r: r["time"])
    rank = record["rank"]
    where = output if rank != shown_rank else ""  # a quiet rank's output is only in its log files
    remote = WorkerTraceback(f"rank {rank} of {world_size} failed; its traceback:\n\n{record['traceback'].rstrip()}")
    original = pickle.loads(record["exception"]) if "exception" in record else None
    if isinstance(original, MisconfigurationError):
        return MisconfigurationError(f"{original} (raised on rank {rank})"), False
    if isinstance(original, BaseException):
        original.__cause__ = remote
        if hasattr(original, "add_note"):
            original.add_note(f"(raised on rank {rank} of {world_size}; the other ranks were stopped.{where})")
        return original, bool(where)
    error = RuntimeError(f"rank {rank} of {world_size} failed with {record['type']}: {record['message']}.{where}")
    error.__cause__ = remote
    return error, bool(where)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]
