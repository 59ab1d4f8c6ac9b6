"""A script without a main guard, launched as Lightning launches it: this process becomes rank 0 and the job's
other ranks on this node run the same command line with their rank in the environment, so all of the script,
code after `fit` included, runs on every rank. (A guarded script is spawned instead: trainer/launch/elastic.py.)"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from torchyard.trainer.cluster.environment import (
    ClusterEnvironment,
    detect_environment,
    find_free_port,
    node_rendezvous,
    worker_threads,
)
from torchyard.trainer.loop import faults
from torchyard.trainer.loop.rng import rng_state, set_rng_state

#: Seconds rank 0 gets to fail on its own once another rank died, before the watcher ends it (a rank that died
#: before the rendezvous leaves rank 0 waiting for it until the collective timeout).
FAILURE_GRACE_S = 10.0
_STOPPED_EXIT_CODES = (0, *faults.STOPPED_EXIT_CODES)
#: The file holding rank 0's RNG state as its stage started, for the other ranks to start their first stage from.
LAUNCH_RNG_VARIABLE = "TORCHYARD_LAUNCH_RNG"


def adopt_rank_zero_rng() -> None:
    """On a rank this module started: take rank 0's RNG state at its stage's start, once (the first stage), so that
    every rank draws as rank 0 does whether or not the script seeded (a seed, Trainer's or the script's, gives the
    same state anyway)."""
    path = os.environ.pop(LAUNCH_RNG_VARIABLE, None)
    if path:
        set_rng_state(torch.load(path, weights_only=True))


def rerun_command() -> list[str]:
    """This process's command line: `python script.py args` or `python -m package.module args`."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", name, *sys.argv[1:]]
    return [sys.executable, os.path.abspath(main.__file__), *sys.argv[1:]]


class ScriptRanks:
    """The other ranks of this node, each running this command line; watched until this script ends."""

    def __init__(self, processes: dict[int, subprocess.Popen], world_size: int) -> None:
        self.processes, self.world_size = processes, world_size
        self._stopping = False
        self._main_done = threading.Event()
        threading.Thread(target=self._watch, name="trainer-script-ranks", daemon=True).start()
        self._excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught_exception
        atexit.register(self._wait_at_exit)

    def failure(self, wait_s: float = 0.0) -> tuple[int, int] | None:
        """(rank, exit code) of the first rank that failed; None while none did."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in self.processes.items():
                code = process.poll()
                if code is not None and code not in _STOPPED_EXIT_CODES and not self._stopping:
                    return rank, code
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def stop(self) -> None:
        """End the other ranks (this rank failed, so they would wait for it in a collective)."""
        self._stopping = True
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait()

    def run_rank_zero(self, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run this process's stage; a failure ends the other ranks, and names the rank that failed first."""
        try:
            return run()
        except faults.Terminated:
            raise  # SIGTERM or Ctrl-C: every rank saved and stops by itself
        except BaseException as err:
            failed = self.failure(wait_s=1.0)  # a peer's death reaches this rank as a closed connection
            self.stop()
            if failed is None:
                raise
            rank, code = failed
            raise RuntimeError(
                f"rank {rank} of {self.world_size} exited with code {code} (its output is above), so the job was "
                "stopped."
            ) from err

    def _watch(self) -> None:
        while not self._main_done.is_set():
            failed = self.failure()
            if failed is not None:
                if not self._main_done.wait(FAILURE_GRACE_S) and not self._stopping:
                    rank, code = failed
                    self._report(f"rank {rank} of {self.world_size} exited with code {code}; stopping the job.")
                    self.stop()
                    os._exit(1)
                return
            time.sleep(0.2)

    def _on_uncaught_exception(self, *exc_info: Any) -> None:
        self.stop()  # before the traceback: the other ranks may be waiting for this one in a collective
        self._excepthook(*exc_info)

    def _wait_at_exit(self) -> None:
        """The script ends when every rank has ended; a rank's failure becomes its exit code."""
        self._main_done.set()
        for process in self.processes.values():
            process.wait()
        failed = self.failure()
        if failed is not None:
            rank, code = failed
            self._report(f"rank {rank} of {self.world_size} exited with code {code}.")
            sys.stdout.flush()
            os._exit(1)

    @staticmethod
    def _report(line: str) -> None:
        print(f"trainer: {line}", file=sys.stderr, flush=True)


def start_script_ranks(processes_per_node: int, num_nodes: int) -> tuple[ScriptRanks, ClusterEnvironment]:
    """Start this node's other ranks as copies of this command line and make this process its node's first rank
    (global rank 0 on node 0); returns them and this process's environment."""
    if num_nodes == 1:
        addr, port, node_rank = "127.0.0.1", find_free_port(), 0
    else:
        addr, port, node_rank = node_rendezvous()
    world_size = processes_per_node * num_nodes
    threads = worker_threads(processes_per_node)
    omp_num_threads = os.environ.get("OMP_NUM_THREADS") or str(threads)  # a user's nested setting goes on as it is

    def rank_env(local_rank: int) -> dict[str, str]:
        rank = ClusterEnvironment("torchrun", global_rank=node_rank * processes_per_node + local_rank,
                                  local_rank=local_rank, world_size=world_size, local_world_size=processes_per_node,
                                  node_rank=node_rank, master_addr=addr, master_port=port)
        return {**rank.variables(), "OMP_NUM_THREADS": omp_num_threads}

    command = rerun_command()
    carried = {LAUNCH_RNG_VARIABLE: _saved_rng_state()}
    processes = {
        node_rank * processes_per_node + local: subprocess.Popen(
            command, env={**os.environ, **rank_env(local), **carried}
        )
        for local in range(1, processes_per_node)
    }
    # As Lightning does, this process keeps its rank's variables: a later stage of the script joins the same job.
    os.environ.update(rank_env(0))
    torch.set_num_threads(threads)
    return ScriptRanks(processes, world_size), detect_environment()


def _saved_rng_state() -> str:
    """This process's RNG state in a file (removed when the script ends, after the other ranks): its path."""
    fd, path = tempfile.mkstemp(prefix="trainer-rng-", suffix=".pt")
    with os.fdopen(fd, "wb") as file:
        torch.save(rng_state(), file)
    atexit.register(_remove_quietly, path)
    return path


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
