"""glibc's malloc set for training: the host memory a step frees stays in the process for the next step.

By default glibc hands the free memory at the top of its heap back to the OS once more than a threshold lies
there (128 KiB at first, raised as large blocks are freed), and serves blocks above a second threshold with
fresh mmaps. A training step frees its activations and gradients and asks for the same sizes again at once, so
on the CPU each step faults the pages it just gave back in again, zeroed by the kernel: recipes/digits.yaml's CNN
took 10 to 22 thousand page faults an epoch, and its epochs ran 8-22% faster without them
(benchmarks/digits_fit.py --processes). Fixed thresholds keep those pages. Torch's own CPU launcher
(torch.backends.xeon.run_cpu) gets the same by preloading jemalloc or tcmalloc with their decay turned off.

A block over 32 MiB (glibc's largest mmap threshold) is still mapped and unmapped each time; free memory beyond
1 GiB at the heap's top still goes back; and at the end of each stage `release_freed_memory` hands back what
the stage left free.
"""

from __future__ import annotations

import ctypes
import functools
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from <malloc.h>
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes on a 64-bit host
# A user who set these, or preloaded another allocator, has chosen already.
_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_kept = False  # set in this process


def keep_freed_memory() -> str | None:
    """Set glibc's trim and mmap thresholds for this process, which keeps them. Returns why they were left as
    they are, or None where they are set: not glibc, the user's own MALLOC_* settings or GLIBC_TUNABLES for
    malloc, or another allocator in LD_PRELOAD."""
    global _kept
    reason = _users_choice()
    if reason is not None:
        return reason
    libc = _glibc()
    if libc is None:
        return "the C library is not glibc"
    if not _kept:
        if not (libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)):
            return "glibc refused the thresholds"
        _kept = True
    return None


def release_freed_memory() -> None:
    """Hand the memory the process holds free back to the OS (glibc's malloc_trim), where `keep_freed_memory`
    kept it: a script or notebook that goes on after a stage does not hold on to the stage's peak."""
    libc = _glibc()
    if _kept and libc is not None:
        libc.malloc_trim(0)


def _users_choice() -> str | None:
    env = os.environ
    chosen = [name for name in _MALLOC_VARIABLES if name in env]
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"{', '.join(chosen)} set"
    preloaded = env.get("LD_PRELOAD", "")
    other = [name for name in _OTHER_ALLOCATORS if name in preloaded]
    return f"{other[0]} preloaded" if other else None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    # "glibc 2.36" on glibc; an unknown name elsewhere (macOS, musl).
    libc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) else None
    if not libc or not libc.startswith("glibc"):
        return None
    return ctypes.CDLL(None)  # the process's own symbols: glibc's mallopt and malloc_trim
