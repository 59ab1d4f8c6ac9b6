"""SIGHUP (the terminal closed, an ssh session dropped) is a stop like SIGTERM (issue 51): the run saves last.ckpt at
its next step boundary and exits with 129 (128 + SIGHUP), as docs/fault-tolerance.md says. A real process: the
tests' fault script (tests/faults/fault_script.py), started and signalled as tests/test_faults.py does."""

from __future__ import annotations

import os
import signal

import pytest
from test_faults import finish, run_folder, saved_step, start_script, wait_for

from torchyard.trainer.loop.faults import SIGHUP_EXIT_CODE


@pytest.mark.timeout(180)
def test_a_closed_terminal_s_sighup_to_a_ddp_job_saves_a_checkpoint_at_the_next_step_and_exits_129(tmp_path):
    proc = start_script(tmp_path, "ddp", "--slow-from", "2")
    wait_for(tmp_path / "marker", proc)
    # As a closed terminal does: its whole process group (the launching process, the elastic agent's workers, the
    # forkserver and multiprocessing's resource tracker) gets SIGHUP.
    os.killpg(proc.pid, signal.SIGHUP)
    code, output = finish(proc)
    assert code == SIGHUP_EXIT_CODE == 129, output[-3000:]
    last = run_folder(tmp_path) / "checkpoints" / "last.ckpt"
    assert f"trainer: SIGHUP: saved {last} at global step " in output, output[-3000:]
    assert "exiting with code 129. fit(ckpt_path='last') resumes from it." in output
    assert "Traceback" not in output, output[-3000:]  # nothing died of it on the way (the resource tracker did)
    assert 2 <= saved_step(last) < 12  # where the signal landed; the run had 12 steps to go
