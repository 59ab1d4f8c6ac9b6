"""trainer/loop/host_memory.py: glibc keeps the memory a step frees, so the next step does not fault it in again.

malloc's settings hold for the whole process, so each case runs in a fresh one and counts its own page faults
while it frees 72 MiB and asks for it again. On its defaults glibc trims the top of its heap once more than
twice its mmap threshold (at most 32 MiB) lies free there, so it gives those pages back whatever it did before.
(Torch's own allocations are not used: where their blocks land depends on the addresses it was given, and so
does whether glibc's defaults fault them in again.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from torchyard.trainer.loop import host_memory

pytestmark = pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's; this C library is not glibc")

_STEPS = """
import ctypes, json, resource

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
BLOCK = 6 << 20

def step():  # 72 MiB in 6 MiB blocks, written, then freed together, as a step's activations are
    blocks = [libc.malloc(BLOCK) for _ in range(12)]
    for block in blocks:
        libc.memset(block, 1, BLOCK)
    for block in blocks:
        libc.free(block)

def faults_of_a_step():
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20
"""


# Where a user chooses malloc's settings; the child processes here start without any of them.
_ALLOCATOR_VARIABLES = (*host_memory._MALLOC_VARIABLES, "GLIBC_TUNABLES", "LD_PRELOAD")


def _run(body: str) -> dict:
    environment = {key: value for key, value in os.environ.items() if key not in _ALLOCATOR_VARIABLES}
    environment["OMP_NUM_THREADS"] = "1"
    script = _STEPS + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_freed_memory_is_kept_for_the_next_step_and_released_on_request():
    plain = _run("print(json.dumps({'faults': faults_of_a_step()}))")
    kept = _run("""
        from torchyard.trainer.loop.host_memory import keep_freed_memory, release_freed_memory
        reason = keep_freed_memory()
        faults = faults_of_a_step()
        held = resident_mib()
        release_freed_memory()
        print(json.dumps({'reason': reason, 'faults': faults, 'held': held, 'released': resident_mib()}))
    """)
    # glibc's defaults hand the 72 MiB back after each step, and the next faults its 18,432 pages in again.
    assert plain["faults"] > 18_000
    assert kept["reason"] is None
    assert kept["faults"] < 100
    assert kept["held"] - kept["released"] > 60  # MiB: the end of a stage gives the free memory back


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("tune_malloc", [True, False])
def test_a_fit_sets_malloc_unless_told_not_to(tune_malloc):
    result = _run(f"""
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        from torchyard.trainer import Trainer, TrainModule

        class Tiny(TrainModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                return self.layer(batch[0]).pow(2).mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
        Trainer(max_epochs=1, tune_malloc={tune_malloc}, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, accelerator="cpu").fit(Tiny(), data)
        print(json.dumps({{'faults': faults_of_a_step()}}))
    """)
    if tune_malloc:
        assert result["faults"] < 100
    else:
        assert result["faults"] > 18_000


@pytest.mark.parametrize(("variable", "value", "reason"), [
    ("MALLOC_TRIM_THRESHOLD_", "65536", "MALLOC_TRIM_THRESHOLD_ set"),
    ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=65536", "GLIBC_TUNABLES set"),
    ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc preloaded"),
])
def test_a_users_own_allocator_settings_are_left_alone(monkeypatch, variable, value, reason):
    for name in _ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    # Returns before any mallopt call, so this process's malloc stays as it was.
    assert host_memory.keep_freed_memory() == reason
