"""tests/processes.py: what a test starts does not outlive it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from processes import reaped


def test_a_failing_test_leaves_no_child_nor_grandchild_running():
    group_leader = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                                    start_new_session=True)
    plain = subprocess.Popen(["sleep", "60"])
    grandchild = int(group_leader.stdout.readline())
    with pytest.raises(AssertionError), reaped([group_leader, plain]):
        raise AssertionError("the test failed while its processes ran")
    assert group_leader.returncode is not None and plain.returncode is not None
    for _ in range(100):  # the grandchild is reparented, not waited for by us: give the kernel a moment
        if not running(grandchild):
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the grandchild {grandchild} of a group leader outlived the test")


def running(pid: int) -> bool:
    """Whether `pid` runs: gone, or a zombie its new parent has yet to reap, it does not."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
