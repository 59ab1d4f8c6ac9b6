"""A start-up that stalls says who is missing: before the process group forms, every rank checks in at the job's
store, and the ranks that arrived wait for the others only until a deadline, then name the ranks that did not
arrive and the address they themselves used (torch's own wait would end in a bare store timeout)."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch.distributed as dist

from torchyard.trainer.errors import StartupTimeoutError

ALL_ARRIVED = "arrived/all"  # set by the last rank to arrive


def wait_for_ranks(store: Any, rank: int, world_size: int, deadline_s: float, address: str, launcher: str) -> None:
    """Check in as `rank` at `store` (the job's, at `address`, 'host:port'), then return once all `world_size` ranks
    have; past `deadline_s`, raise StartupTimeoutError naming who arrived (host, pid) and who did not."""
    store.set(f"arrived/rank{rank}", f"{socket.gethostname()}, pid {os.getpid()}")
    if store.add("arrived", 1) >= world_size:
        store.set(ALL_ARRIVED, "1")  # the last to arrive lets the others go at once
    else:
        try:  # the store answers when the key is set: no polling, no lag after the last rank arrived
            store.wait([ALL_ARRIVED], datetime.timedelta(seconds=deadline_s))
        except dist.DistStoreError:  # the deadline passed
            raise StartupTimeoutError(_missing(store, rank, world_size, deadline_s, address, launcher)) from None


def _missing(store: Any, rank: int, world_size: int, deadline_s: float, address: str, launcher: str) -> str:
    keys = {r: f"arrived/rank{r}" for r in range(world_size)}
    arrived = {r: store.get(key).decode() for r, key in keys.items() if store.check([key])}
    missing = [r for r in range(world_size) if r not in arrived]
    shown = ", ".join(map(str, missing[:16])) + (f" and {len(missing) - 16} more" if len(missing) > 16 else "")
    here = "; ".join(f"rank {r} ({where})" for r, where in sorted(arrived.items())[:8])
    return (f"rank {rank} waited {deadline_s:g} s at the job's rendezvous {address} (MASTER_ADDR:MASTER_PORT, from "
            f"{launcher}) for its {world_size} ranks, but rank{'s' if len(missing) > 1 else ''} {shown} never "
            f"arrived; {len(arrived)} did: {here}. Check that the missing ranks' processes started (their launcher's "
            "output), that they were given the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and that this address "
            "resolves and its port is open from their nodes; Trainer(timeout=...) sets how long ranks wait.")
