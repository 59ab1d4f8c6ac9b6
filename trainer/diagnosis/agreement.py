"""diagnosis='debug': before each collective, the framework's and the user's own, the ranks agree on what it is (the
operation, the tensors' shapes and dtypes, and where it was called) through the job's TCPStore, so that the first
collective that differs stops every rank with both sides named, instead of a crash in the backend (gloo aborts on
mismatched sizes) or a hang until the timeout.

Each collective costs a store write and a read per other rank, so this is for finding a bug, not for long runs.
torch's own check (TORCH_DISTRIBUTED_DEBUG=DETAIL, which wraps the process group) would do the comparison without
the call sites; on this torch (2.13) DistributedDataParallel's constructor crashed (SIGSEGV) on a group it wraps.

The user's collectives are the torch.distributed functions below, called (through the module, `dist.all_reduce`)
from the user's code while the stage runs; the framework's are those its marker names (markers.py).
"""

from __future__ import annotations

import functools
import json
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from torchyard.trainer.diagnosis.markers import Marker, is_user_file
from torchyard.trainer.errors import CollectiveMismatchError

CHECKED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
           "barrier", "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather", "scatter")


def _shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    found = []
    for value in [*args, *kwargs.values()]:
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tensor, torch.Tensor):
                found.append(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}")
    return found


class CollectiveAgreement:
    """Compares every collective's fingerprint across the ranks, numbered by the marker's count."""

    def __init__(self, marker: Marker, store: Any, rank: int, world_size: int) -> None:
        self.marker, self.store, self.rank, self.world_size = marker, store, rank, world_size

    def framework(self, operation: str, purpose: str) -> None:
        """Called by the marker as a framework collective begins (its count already taken)."""
        self._agree({"operation": operation, "what": f"{operation} #{self.marker.count} ({purpose} of step "
                     f"{self.marker.step()})", "by": "the framework"})

    def user(self, operation: str, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any) -> None:
        """Called as the user's code calls torch.distributed's `operation`."""
        self.marker.count += 1
        code = caller.f_code
        line = linecache.getline(code.co_filename, caller.f_lineno).strip()
        shapes = _shapes(args, kwargs)
        self._agree({"operation": operation, "what": f"{operation}" + (f" of {', '.join(shapes)}" if shapes else ""),
                     "by": f"the user's code, in {code.co_name} at {os.path.basename(code.co_filename)}:"
                           f"{caller.f_lineno} ({line})"})

    def _agree(self, fingerprint: dict[str, str]) -> None:
        number = self.marker.count
        self.store.set(f"agree/{number}/rank{self.rank}", json.dumps(fingerprint))
        if number > 2:  # every rank has read number - 2's by now (each read number - 1's before writing this)
            self.store.delete_key(f"agree/{number - 2}/rank{self.rank}")
        others = {rank: json.loads(self.store.get(f"agree/{number}/rank{rank}"))  # waits for it (up to timeout)
                  for rank in range(self.world_size) if rank != self.rank}
        if all(_same(fingerprint, other) for other in others.values()):
            return
        sides = {self.rank: fingerprint, **others}
        raise CollectiveMismatchError(
            f"the ranks called different collectives as their collective #{number}: " + "; ".join(
                f"rank {rank} called {side['what']} ({side['by']})" for rank, side in sorted(sides.items()))
            + ". Every rank must call the same collectives in the same order: one under `if self.global_rank == "
            "...`, or in a branch only some ranks take, breaks that.")


def _same(one: dict[str, str], other: dict[str, str]) -> bool:
    """The same collective: the same operation from the same side, with the same shapes for the user's."""
    if one["by"] == "the framework" or other["by"] == "the framework":
        return one["by"] == other["by"] and one["operation"] == other["operation"]
    return one["what"] == other["what"]


@contextmanager
def checking_user_collectives(agreement: CollectiveAgreement) -> Iterator[None]:
    """While it lasts, the torch.distributed functions in CHECKED agree first when the user's code calls them."""
    originals: dict[str, Callable[..., Any]] = {name: getattr(dist, name) for name in CHECKED if hasattr(dist, name)}

    def checked(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)  # the code that called dist.<name>
            if is_user_file(caller.f_code.co_filename):
                agreement.user(name, args, kwargs, caller)
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, checked(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
