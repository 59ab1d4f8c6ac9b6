"""Local SGD in ddp (strategy={"name": "ddp", "sync_every": H}): torch's post-local-SGD hook and model averager.

One start of 2 gloo processes (local_sgd_worker.py) runs four digits fits in a row: ordinary ddp, sync_every=1,
sync_every=8 watched step by step and checkpointed every epoch, and a resume of that run from its epoch-4 checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from torchyard.trainer import Trainer
from torchyard.trainer.cli.main import main
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import build_strategy

SYNC_EVERY, EPOCHS, LOCAL_EPOCHS = 8, 1, 6


@pytest.mark.parametrize(("options", "message"), [
    ({"sync_every": 0}, "sync_every=0) must be an integer of at least 1"),
    ({"sync_every": -3}, "sync_every=-3) must be an integer of at least 1"),
    ({"sync_every": 2.5}, "sync_every=2.5) must be an integer of at least 1"),
    ({"sync_every": True}, "sync_every=True) must be an integer of at least 1"),
    ({"sync_every": 4, "sync_warmup_steps": -1}, "sync_warmup_steps=-1) must be an integer of at least 0"),
    ({"sync_every": 4, "comm_hook": "fp16"}, "local SGD installs its own communication hook"),
])
def test_local_sgd_options_that_cannot_run_are_one_line_errors(options, message):
    with pytest.raises(MisconfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        build_strategy({"name": "ddp", **options})
    assert "\n" not in str(caught.value)


def test_sync_every_below_one_stops_the_trainer_before_any_process_starts():
    with pytest.raises(MisconfigurationError, match="sync_every=0"):
        Trainer(strategy={"name": "ddp", "sync_every": 0}, devices=2, accelerator="cpu")


def test_a_recipe_with_sync_every_below_one_is_one_line_exit_2(tmp_path, capsys):
    digits = str(Path(__file__).resolve().parents[2] / "recipes" / "digits.yaml")
    assert main(["fit", digits, "trainer.strategy={name: ddp, sync_every: 0}", "trainer.devices=2"]) == 2
    err = capsys.readouterr().err
    assert "sync_every=0) must be an integer of at least 1" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """What each rank of the 2-process runs wrote: weights per fit, replica equality per step, val acc."""
    import local_sgd_worker  # beside this file; spawned processes import it by name

    out = tmp_path_factory.mktemp("local_sgd")
    mp.spawn(local_sgd_worker.worker, args=(find_free_port(), str(out), EPOCHS, LOCAL_EPOCHS), nprocs=2)
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.mark.timeout(360)  # about 25 s on 2 idle cores
def test_local_sgd_on_two_processes(runs):
    rank0, rank1 = runs
    # sync_every=1 is ordinary DDP, bit for bit.
    for key, value in rank0["weights"]["ddp"].items():
        assert torch.equal(value, rank0["weights"]["sync_every_1"][key]), key
    # sync_every=8: the replicas agree right after each averaging (the first step, then every 8th) and not between.
    equal = rank0["equal_after_step"]
    assert len(equal) == 60  # 6 epochs x 10 batches per rank
    assert [step for step, same in enumerate(equal) if same] == list(range(0, 60, SYNC_EVERY))
    # ...and the replicas end apart (the last step, 59, is no averaging step), yet digits still learns.
    assert any(not torch.equal(rank0["weights"]["local"][k], rank1["weights"]["local"][k]) for k in
               rank0["weights"]["local"])
    assert rank0["val_acc"] >= 0.95
    # A resume from mid-period (epoch 4 ends at step 50) continues every replica exactly where it was.
    for rank in runs:
        for key, value in rank["weights"]["local"].items():
            assert torch.equal(value, rank["weights"]["resumed"][key]), key
    saved = torch.load(rank0["checkpoint"], weights_only=True)["strategy"]
    assert saved["hook_iter"] == 0 and saved["averager_steps"] == [50]
    assert len(saved["replicas"]) == 2
