"""torch's flight recorder, read into the stuck-job report: the last collective torch itself recorded on this rank in
each process group. torch keeps it for NCCL and, since 2.7 or so, for gloo too; a watched job turns it on
(`TORCH_FR_BUFFER_SIZE`, which torch 2.8 took over from `TORCH_NCCL_TRACE_BUFFER_SIZE`). Recording costs one ring-buffer
entry per collective, without stacks (torch captures none unless asked)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

#: The variable that sizes torch's record (entries kept per process), and the one NCCL read before torch 2.8, which
#: later releases still read but warn about on every rank.
BUFFER_VARIABLE, NCCL_BUFFER_VARIABLE = "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"
ENTRIES = 2000


def enable() -> None:
    """Turn the recorder on for the process groups this process creates from now on (torch reads the variables
    when it creates its first group); a size the user set, under either name, wins."""
    if BUFFER_VARIABLE in os.environ or NCCL_BUFFER_VARIABLE in os.environ:
        return
    os.environ[BUFFER_VARIABLE] = str(ENTRIES)
    if torch.__version__ < (2, 8):  # a TorchVersion: it compares with a tuple
        os.environ[NCCL_BUFFER_VARIABLE] = str(ENTRIES)


def entries() -> list[dict[str, Any]]:
    """This process's recorded collectives, oldest first; none where torch keeps no record (turned off, or a build
    without it). torch keeps two records: NCCL's (its entries hold CUDA events) and every other backend's."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:  # a build without torch.distributed
        return []
    recorded: list[dict[str, Any]] = []
    for dump in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):  # the first in CUDA builds only
        if not hasattr(c10d, dump):
            continue
        try:
            recorded += json.loads(getattr(c10d, dump)(True, False)).get("entries") or []  # collectives, no stacks
        except (RuntimeError, ValueError):
            continue
    return sorted(recorded, key=lambda entry: entry.get("time_created_ns", 0))


def describe(recorded: list[dict[str, Any]], rank: int, now_ns: int | None = None) -> str | None:
    """One line for the report: the last collective torch recorded in each process group on `rank`, how long ago it
    was issued and its state as torch keeps it ("torch's flight recorder on rank 0, the last collective of each
    group: default_pg: gloo:all_reduce #7 (Float[2, 5]), issued 5.0 s ago, scheduled, retired"); None when it
    recorded nothing. gloo records no start or completion (every entry reads 'scheduled') and retires a collective
    that failed too, so there the time since it was issued is what tells the stuck one; NCCL records both."""
    if not recorded:
        return None
    now_ns = time.time_ns() if now_ns is None else now_ns
    last: dict[str, dict[str, Any]] = {}
    for entry in recorded:  # oldest first: the last one of a group wins
        last[_group(entry)] = entry
    shown = "; ".join(
        f"{group}: {entry.get('profiling_name', '?')} #{_number(entry)}{_tensors(entry)}, issued "
        f"{(now_ns - entry['time_created_ns']) / 1e9:.1f} s ago, {entry.get('state', '?')}"
        + (", retired" if entry.get("retired") else ", not retired")
        for group, entry in last.items())
    return f"torch's flight recorder on rank {rank}, the last collective of each group: {shown}"


def _group(entry: dict[str, Any]) -> str:
    name, description = (list(entry.get("process_group") or []) + ["?", "?"])[:2]
    return description if description not in ("", "undefined", "?") else f"group {name}"


def _number(entry: dict[str, Any]) -> Any:
    return entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")


def _tensors(entry: dict[str, Any]) -> str:
    tensors = ", ".join(f"{dtype}{list(size)}" for dtype, size in zip(entry.get("input_dtypes") or [],
                                                                       entry.get("input_sizes") or []))
    return f" ({tensors})" if tensors else ""
