"""An elastic torchrun job (--nnodes=1:2) that loses one of its two nodes mid-epoch goes on with the other, from
the last checkpoint, with the rest of the epoch dealt again over the ranks it has: the sample ledger shows
every sample of every epoch trained once. One launch per test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from test_ddp_launches import TORCHRUN, launch

from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.data.ledger import read_ledger, report

FAULTS = Path(__file__).parents[1] / "faults"
sys.path.insert(0, str(FAULTS))
import fault_script  # noqa: E402  (tests/faults: the run the fault tests use)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_that_leaves_mid_epoch_leaves_the_job_on_one_node_training_each_sample_once(tmp_path):
    # The rendezvous store lives in the test, so that either agent may go; the dead node's heartbeats lapse in
    # 2 s, and a round waits 1 s for more nodes once it has the one it needs.
    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    conf = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
    log = tmp_path / "samples.txt"
    agent = [*TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf={conf}", "--rdzv-id=scale-in", "--monitor-interval=0.2",
             str(Path(fault_script.__file__)), str(tmp_path), "ddp_node", "--num-nodes=2", "--leave-at=4",
             f"--sample-log={log}"]
    try:
        (code, output, _), (left, _, _) = launch([(agent, {}), (agent, {})], tmp_path, timeout=110,
                                                 pythonpath=[FAULTS])
    finally:
        del store
    assert code == 0 and left != 0, output[-3000:]
    assert "restart 1: resuming from" in output and "(global step 3)" in output, output[-3000:]
    trained = fault_script.committed_samples(log)
    # Steps 1-3 on two nodes (the checkpoint), then one node: epoch 0's 24 samples left in 6 steps, epoch 1 in 12.
    assert [world for _, world, _ in trained.values()] == [2] * 3 + [1] * 18
    run = tmp_path / "default" / "version_0"
    ledger = read_ledger(run)
    fault_script.assert_each_sample_trained_once(ledger, log)
    assert report(ledger) == ([f"epoch {e}: 48 of 48 samples trained, each exactly once" for e in (0, 1)], True)
