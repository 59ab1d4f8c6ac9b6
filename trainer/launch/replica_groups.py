"""The Trainer's own launch of a live-recovery job (strategies/ft): one group of processes per replica group, each
restarted on its own when it dies (up to max_restarts times per group) while the others train on, beside the torchft
lighthouse this process serves where none was given. Each group's rendezvous store lives here too, so that it
outlives the group's processes. The workers are elastic.py's (run_worker, the pickled job), started with torch's
elastic multiprocessing, group by group; group 0's output is shown, the others' kept in files."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std, start_processes
from torch.distributed.elastic.multiprocessing.api import PContext, RunProcsResult
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from torchyard.trainer.cluster.environment import worker_threads
from torchyard.trainer.cluster.script_guard import GUARD_HINT
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.launch import elastic, warm_start
from torchyard.trainer.loop import faults
from torchyard.trainer.loop.rng import rng_state

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer

#: How often the launcher looks at its groups' processes.
POLL_S = 0.1


class ReplicaGroup:
    """One replica group's processes, started again (its next attempt) after each death."""

    def __init__(self, index: int, processes: int, variables: dict[str, str], worker_args: tuple[Any, ...],
                 workdir: Path, start_method: str, max_restarts: int) -> None:
        self.index, self.processes, self.variables = index, processes, variables
        self.worker_args, self.workdir, self.start_method = worker_args, workdir, start_method
        self.restarts_left, self.attempt = max_restarts, 0
        self.max_restarts = max_restarts
        # The group's rendezvous store (its processes are its clients, as under torchrun's agent): here, it survives
        # them, and a restarted attempt meets in it again under its own key prefix (TORCHELASTIC_RESTART_COUNT).
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.context: PContext | None = None

    def start(self) -> None:
        envs = {local: {**self.variables, "RANK": str(local), "LOCAL_RANK": str(local), "GROUP_RANK": "0",
                        "WORLD_SIZE": str(self.processes), "LOCAL_WORLD_SIZE": str(self.processes),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(self.attempt),
                        "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                        "TORCHELASTIC_RUN_ID": f"replica_group_{self.index}"}
                for local in range(self.processes)}
        shown = {} if self.index == 0 else {local: Std.ALL for local in range(self.processes)}
        self.context = start_processes(
            name=f"replica_group_{self.index}", entrypoint=elastic.run_worker,
            args={local: (*self.worker_args[:1], str(self.workdir), *self.worker_args[1:])
                  for local in range(self.processes)},
            envs=envs, logs_specs=DefaultLogsSpecs(log_dir=str(self.workdir / "output"), redirects=shown),
            start_method=self.start_method)

    def poll(self) -> RunProcsResult | None:
        assert self.context is not None
        return self.context.wait(timeout=0)

    def close(self, signal_number: Any = None) -> None:
        if self.context is not None:
            self.context.close(death_sig=signal_number) if signal_number is not None else self.context.close()
            self.context = None


def launch(trainer: Trainer, stage: str, *run_args: Any) -> dict[str, Any]:
    """Run `trainer._run(stage, *run_args)` in every replica group, restarting each group on its own; return group
    0's outcome (a group that died last returns nothing, and another's stands in: they hold the same state)."""
    strategy = trainer.strategy
    script = elastic._calling_script()
    if script is not None and not script.guarded:
        raise MisconfigurationError(f"fault_tolerance starts each replica group as a process of its own, which "
                                    f"imports {script.path}; {GUARD_HINT}.")
    elastic.decide_run_folder(trainer)  # every group, and a restarted one, writes to it
    payload = elastic._pickle_job(trainer, stage, run_args)
    if warm_start.available():
        warm_start.start()
    workdir = Path(tempfile.mkdtemp(prefix="trainer-replica-groups-"))
    nproc = strategy.processes_per_node() // strategy.replica_groups
    worker_args = (payload, worker_threads(nproc * strategy.replica_groups), rng_state(),
                   warm_start.LaunchingProcessState())
    server, lighthouse = strategy.launch_lighthouse()
    groups: list[ReplicaGroup] = []
    keep_output = False
    try:
        with elastic._restored_process_state(), elastic._quiet_agent_logs():
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            start_method = "forkserver" if warm_start.available() else "spawn"
            groups = [ReplicaGroup(index, nproc, strategy.group_variables(index, lighthouse), worker_args,
                                   workdir / f"group{index}", start_method, trainer.config.max_restarts)
                      for index in range(strategy.replica_groups)]
            for group in groups:
                group.start()
            try:
                outcomes = _supervise(groups, float(strategy.ft.timeout))
            except SignalException as err:
                for group in groups:
                    group.close(err.sigval)  # as the elastic agent does: forwarded, then waited for
                if err.sigval not in faults.STOP_SIGNALS:
                    raise
                raise faults.Terminated(128 + int(err.sigval)) from None
    except _GroupFailed as failed:
        error, keep_output = failed.error, failed.keep_output
        raise error from error.__cause__
    finally:
        for group in groups:
            group.close()
        if server is not None:
            server.shutdown()
        if not keep_output:
            shutil.rmtree(workdir, ignore_errors=True)
    return outcomes


class _GroupFailed(Exception):
    def __init__(self, error: BaseException, keep_output: bool) -> None:
        super().__init__(str(error))
        self.error, self.keep_output = error, keep_output


def _supervise(groups: list[ReplicaGroup], grace_s: float) -> dict[str, Any]:
    """Watch the groups until every one has ended; restart a group that dies while its peers still train (one out
    of restarts is left out, and the others train on without it). Once one group has finished, the others get
    `grace_s` to finish too (a group restarted then would have no peer to heal from). A job whose groups all died
    raises the first one's failure."""
    running, outcomes = {group.index: group for group in groups}, {}
    failures: list[tuple[ReplicaGroup, RunProcsResult]] = []
    first_done: float | None = None
    while running:
        for index, group in list(running.items()):
            result = group.poll()
            if result is None:
                continue
            del running[index]
            if not result.is_failed():
                outcomes[index] = {rank: pickle.loads(data) for rank, data in result.return_values.items() if data}
                first_done = first_done or time.monotonic()
                continue
            codes = [failure.exitcode for failure in result.failures.values()]
            if all(code in faults.STOPPED_EXIT_CODES for code in codes):
                raise faults.Terminated(max(codes))
            if _restarted(group, result, first_done is None):
                running[index] = group
            else:
                failures.append((group, result))
        if first_done is not None and running and time.monotonic() - first_done > grace_s:
            break  # the groups still running wait for peers that have ended
        time.sleep(POLL_S)
    reported = outcomes.get(0) or next((o for o in outcomes.values() if o), None)
    if reported:
        return reported.get(0) or next(iter(reported.values()))
    if failures:
        group, result = failures[0]
        error, keep = elastic._job_failure(ChildFailedError(f"replica group {group.index}", result.failures),
                                           group.workdir, group.processes, 0)
        raise _GroupFailed(error, keep)
    return {"result": None}


def _restarted(group: ReplicaGroup, result: RunProcsResult, peers_train: bool) -> bool:
    """Start a dead group's next attempt where it has restarts left and peers to heal from; say what happened."""
    how = _how(group, result)
    if not (peers_train and group.restarts_left > 0):
        print(f"trainer: replica group {group.index} {how}; not restarted ("
              + ("max_restarts used up" if peers_train else "its peers have finished")
              + "); the other groups train on without it.", file=sys.stderr, flush=True)
        return False
    group.restarts_left, group.attempt = group.restarts_left - 1, group.attempt + 1
    print(f"trainer: replica group {group.index} {how}; restarting it ({group.attempt} of {group.max_restarts} "
          "restarts); the other groups train on.", file=sys.stderr, flush=True)
    group.close()
    group.start()
    return True


def _how(group: ReplicaGroup, result: RunProcsResult) -> str:
    """'lost process 0 to SIGKILL', or the exception its worker recorded (elastic._record_failure)."""
    rank, failure = next(iter(result.failures.items()))
    if failure.exitcode < 0:
        return f"lost process {rank} to {failure.signal_name()}"
    record = group.workdir / f"failure_attempt{group.attempt}_rank{rank}.pkl"
    if record.is_file():
        recorded = pickle.loads(record.read_bytes())
        return f"lost process {rank} to {recorded['type']}: {elastic._first_line(Exception(recorded['message']))}"
    return f"lost process {rank} (exit code {failure.exitcode})"
