"""`trainer plan --measure`: the planned layouts that fit on this machine, run for real (gloo processes on CPU, one
thread each) with the plan's own steps (fake_step.run_step with fake=False), so that the table shows every part
predicted beside measured."""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchyard.trainer.cli.recipe import load_recipe
from torchyard.trainer.cluster.environment import find_free_port, usable_cores
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.scaling.fake_step import run_step, sample_batch

TIMEOUT_S = 600.0


def fits_here(ranks: int) -> bool:
    """A layout runs for real here when each rank has a core of its own."""
    return ranks <= usable_cores()


def measure_layout(sources: Sequence[str], strategy: dict[str, Any], world_size: int) -> list[dict[str, int]]:
    """Every rank's peak by part (bytes) from a real run of `world_size` gloo processes started here."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter per rank: no state of the planner's
    results = context.Queue()
    port = find_free_port()
    ranks = [context.Process(target=_measure_rank, args=(list(sources), strategy, world_size, rank, port, results))
             for rank in range(world_size)]
    for process in ranks:
        process.start()
    try:
        measured = [results.get(timeout=TIMEOUT_S) for _ in ranks]
    except queue.Empty as err:
        raise MisconfigurationError(f"--measure: {strategy['name']} on {world_size} process(es) gave no result "
                                    f"within {TIMEOUT_S:g} s; plan without --measure.") from err
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    failed = [item["error"] for item in measured if "error" in item]
    if failed:
        raise MisconfigurationError(f"--measure: {strategy['name']} on {world_size} process(es) failed: {failed[0]}")
    return [item["memory"] for item in sorted(measured, key=lambda item: item["rank"])]


def _measure_rank(sources: list[str], strategy: dict[str, Any], world_size: int, rank: int, port: int,
                  results: Any) -> None:
    """One rank of a measured run: join the group, take the plan's steps on real tensors, report its peak."""
    torch.set_num_threads(1)
    try:
        recipe = load_recipe(sources)
        batch = sample_batch(recipe)
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            memory = run_step(recipe, strategy, world_size, rank, batch, fake=False).memory
            dist.barrier()  # rank 0 serves the store: it leaves last
        finally:
            dist.destroy_process_group()
        results.put({"rank": rank, "memory": vars(memory)})
    except Exception as err:  # noqa: BLE001 (reported to the planner, which raises it as one line)
        results.put({"rank": rank, "error": f"{type(err).__name__}: {err}"})
