"""Child processes a test starts: none outlives it."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.launch import warm_start


@contextlib.contextmanager
def reaped(processes: Sequence[subprocess.Popen]) -> Iterator[None]:
    """`with reaped(processes):` on leaving (a timeout or a failed assertion included), each process still running
    is killed, with its whole process group where it leads one (started with start_new_session=True, so that its
    own children go too), and waited for."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(process.pid) == process.pid:
                    os.killpg(process.pid, signal.SIGKILL)
                else:
                    process.kill()
            process.wait()


def run_ranks(main: Callable[[list[str]], object], world_size: int, arguments: list[str], logs: Path,
              timeout: float) -> None:
    """`main(arguments)` in `world_size` processes that see torchrun's variables for their ranks (so the Trainer
    starts nothing), forked from the framework's warm forkserver as a self-launched job's workers are: torch and
    the framework are imported once, not once a rank (4-5 s of CPU each on a small machine). Each rank writes its
    output to `logs`/rank<r>.log; a rank that fails or outlives `timeout` fails the test with its output."""
    warm_start.start()
    context, port = multiprocessing.get_context("forkserver"), find_free_port()
    ranks = [context.Process(target=_rank, args=(main, arguments, rank, world_size, port, logs / f"rank{rank}.log",
                                                 warm_start.LaunchingProcessState(), timeout))
             for rank in range(world_size)]
    for rank in ranks:
        rank.start()
    deadline = time.monotonic() + timeout
    try:
        for rank in ranks:
            rank.join(max(0.0, deadline - time.monotonic()))
    finally:
        for rank in ranks:
            if rank.is_alive():
                rank.kill()
                rank.join()
    failed = [index for index, rank in enumerate(ranks) if rank.exitcode != 0]
    assert not failed, "\n".join(f"rank {index} ended with {ranks[index].exitcode}:\n{_tail(logs / f'rank{index}.log')}"
                                 for index in failed)


def _tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.is_file() else "(it wrote nothing)"


def _rank(main: Callable[[list[str]], object], arguments: list[str], rank: int, world_size: int, port: int,
          log: Path, launching_process: object, timeout: float) -> None:
    """One rank: the test process's variables (`launching_process` adopted them as it was unpickled), torchrun's,
    its output in its log, and its threads' stacks there too if it is still running just before the timeout."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for stream in (1, 2):
        os.dup2(output, stream)
    faulthandler.dump_traceback_later(max(1.0, timeout - 3), exit=False)
    main(arguments)
