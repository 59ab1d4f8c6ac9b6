"""The Ray launcher (trainer/launch/ray_actors.py) on a real Ray cluster of two nodes on this machine (conftest.py's
`ray_cluster`): ddp through Ray, with a rank SIGKILLed and max_restarts=1, resumes from the last checkpoint and
ends on the self-launch's weights and metrics bitwise; an address with no cluster, and options that do not fit
together, are one-line errors before anything starts.

The runs are tests/faults/fault_script.py's (dropout, Adam, StepLR, a shuffled loader, a checkpoint every 3
steps), the reference its self-launched ddp run (tests/conftest.py), so equal weights mean the ranks, the data
order, the RNG and the resume all matched.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from faults.fault_script import KillAt, Net, fit, loaders, metrics_rows, starts

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer
from torchyard.trainer.cli.main import main
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.errors import MisconfigurationError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


class KillNoted(KillAt):
    """KillAt that first writes the time of the kill to `path`, so the test can tell how soon the job ended."""

    def __init__(self, step: int, rank: int, path: str) -> None:
        super().__init__(step, rank)
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            Path(self.path).write_text(str(time.time()))
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)


class RestartNoted(Callback):
    """Rank 0 writes the time to `path` when a restarted attempt starts training."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, module):
        if trainer.is_global_zero and trainer.strategy.environment.restart_count > 0:
            Path(self.path).write_text(str(time.time()))


def children_of_this_process() -> list[int]:
    own = str(os.getpid())
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "stat").read_text().rsplit(")", 1)[1].split()[1] == own:
                found.append(int(proc.name))
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_on_two_ray_nodes_resumes_after_a_sigkill_to_the_self_launchs_weights(ray_cluster, ddp_reference,
                                                                                  tmp_path, capfd):
    killed_at, restarted_at = tmp_path / "killed_at", tmp_path / "restarted_at"
    module = fit(tmp_path, "ddp", [KillNoted(4, 1, str(killed_at)), RestartNoted(str(restarted_at))],
                 launcher="ray", ray_address=ray_cluster.address, max_restarts=1)
    out, err = capfd.readouterr()
    assert "trainer: 2 ranks as Ray actors on 2 node(s)" in err  # one CPU per node: one rank on each
    assert "\x1b[" not in out + err  # piped: Ray's "(rank 1 pid=...)" prefixes come without colour codes
    # The failure that ends a job without restarts left (`raise` of the same error), announced here instead.
    assert "trainer: rank 1 of 2 died on Ray node " in err and "Restarting every rank (1 of 1)." in err
    # Issue 28's bound on noticing a dead rank and acting on it (a liveness bound, not a speed measurement).
    assert float(restarted_at.read_text()) - float(killed_at.read_text()) < 60
    assert starts(tmp_path) == ["0 0", "1 3"]  # the second attempt began at the checkpoint of step 3
    reference_weights, reference_root = ddp_reference
    # One run folder for both attempts, logged by rank 0 as the self-launch logs it.
    assert [p.name for p in (tmp_path / "default").iterdir()] == ["version_0"]
    assert metrics_rows(tmp_path) == metrics_rows(reference_root)
    actual = module.state_dict()  # the caller's module holds rank 0's trained weights
    assert actual.keys() == reference_weights.keys()
    for key in reference_weights:
        assert torch.equal(actual[key], reference_weights[key]), f"{key} differs from the self-launched run"


def test_a_ray_address_with_no_cluster_is_one_line_before_anything_starts(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    address = f"127.0.0.1:{find_free_port()}"
    trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu", launcher="ray", ray_address=address,
                      default_root_dir=str(tmp_path / "runs"))
    children = children_of_this_process()
    with pytest.raises(MisconfigurationError) as raised:
        trainer.fit(Net(), *loaders())
    message = str(raised.value)
    assert message.startswith(f"no Ray cluster at {address} (Connection refused); start one there with "), message
    assert "\n" not in message
    assert not ray.is_initialized() and children_of_this_process() == children
    assert not (tmp_path / "runs").exists()


def test_the_recipe_keys_reach_the_launcher_and_a_bad_address_is_one_line_exit_2(tmp_path, capsys):
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    recipe = [str(RECIPES / "digits.yaml"), str(RECIPES / "digits_ddp.yaml"), "trainer.launcher=ray"]
    code = main(["fit", *recipe, f"trainer.ray_address=localhost:{find_free_port()}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("trainer fit: error: no Ray cluster at localhost:") and err.count("\n") == 1
    assert main(["fit", *recipe, "trainer.ray_address=head-node"]) == 2
    assert "ray_address='head-node' is not 'host:port'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("options", "message"), [
    ({"launcher": "mpi"}, "launcher='mpi' is not known; use one of auto, ray."),
    ({"ray_address": "10.0.0.1:6379"}, "ray_address='10.0.0.1:6379' is for launcher='ray', but launcher='auto'"),
    ({"launcher": "ray", "ray_address": "10.0.0.1"}, "ray_address='10.0.0.1' is not 'host:port'"),
])
def test_launcher_options_that_do_not_fit_are_refused_by_the_trainer(options, message):
    with pytest.raises(MisconfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Trainer(**options)


def fit_on_gpus(root: Path, **options) -> dict[str, torch.Tensor]:
    """fault_script's run on every GPU of this machine (its own fit() fixes accelerator="cpu")."""
    torch.manual_seed(0)
    module = Net()
    Trainer(strategy="ddp", devices=torch.cuda.device_count(), accelerator="cuda", max_epochs=2, seed=7,
            deterministic=True, num_sanity_val_steps=0, default_root_dir=str(root), enable_progress_bar=False,
            enable_model_summary=False, **options).fit(module, *loaders())
    return {key: value.cpu() for key, value in module.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ranks_on_gpus_through_a_local_ray_cluster_match_the_self_launch(tmp_path, capfd):
    """A rank per GPU of this machine (nccl): Ray's GPU bundles and CUDA_VISIBLE_DEVICES per node, on a new local
    cluster ("local"), which ends with the job."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    reference = fit_on_gpus(tmp_path / "self")
    through_ray = fit_on_gpus(tmp_path / "ray", launcher="ray", ray_address="local")
    gpus = torch.cuda.device_count()
    assert f"trainer: {gpus} ranks as Ray actors on 1 node(s)" in capfd.readouterr().err
    assert not ray.is_initialized()
    for key in reference:
        assert torch.equal(through_ray[key], reference[key]), f"{key} differs from the self-launched run"


def test_a_ranks_failure_is_raised_in_the_caller_as_the_rank_raised_it():
    """What ends the job when no restart is left: the record a rank's actor returns, turned into the exception raised
    in the calling script (the two-node test above sees the same error announced before its restart)."""
    from torchyard.trainer.launch import ray_actors as ray_launcher

    try:
        raise ValueError("batch 3 has no labels")
    except ValueError as err:
        record = ray_launcher.failure_record(1, err, "/tmp/trainer-ray-x/attempt0/rank1.log")
    error = ray_launcher._job_failure(record, 2, shown_rank=0)
    assert type(error) is ValueError and str(error) == "batch 3 has no labels"
    assert error.__notes__ == ["(raised on rank 1 of 2; the other ranks were stopped. Its output: "
                               "/tmp/trainer-ray-x/attempt0/rank1.log on its node.)"]
    assert "raise ValueError(\"batch 3 has no labels\")" in str(error.__cause__)  # the rank's traceback
    died = {"rank": 1, "died": "The actor died unexpectedly before finishing this task.", "ip": "10.0.0.2",
            "node": "c3a8d8c38e0f55685a0e", "time": 0.0}
    assert str(ray_launcher._job_failure(died, 2, shown_rank=0)) == (
        "rank 1 of 2 died on Ray node 10.0.0.2 (c3a8d8c3: killed by a signal, out of memory, or its node left), so "
        "the job was stopped. Ray: The actor died unexpectedly before finishing this task.")
    config_error = ray_launcher.failure_record(1, MisconfigurationError("devices=3 but 2 GPUs"), None)
    assert str(ray_launcher._job_failure(config_error, 2, shown_rank=0)) == "devices=3 but 2 GPUs (raised on rank 1)"


# --------------------------------------------------------------------------- token authentication (Ray 2.52 and later)


@pytest.mark.parametrize(("env", "advice"), [
    ({}, ". If the cluster uses token authentication (Ray 2.52 and later), this process has no token: set "
         "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head prints it), "
         "or copy the head's ~/.ray/auth_token here."),
    ({"token_file": True}, ". If the cluster uses token authentication, this process sent no token: Ray sends one to "
                           "an address given explicitly only with RAY_AUTH_MODE=token; set RAY_AUTH_MODE=token here "
                           "(the token is then read from {home}/.ray/auth_token)."),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "abc"},
     ". This process sends the token from RAY_AUTH_TOKEN: if the cluster refused it, give this process the cluster's "
     "token (`ray get-auth-token` on its head prints it) in RAY_AUTH_TOKEN; else check that the cluster's head "
     "started (`ray status --address` there)."),
])
def test_an_address_that_answers_but_refuses_names_the_missing_token(tmp_path, env, advice):
    """What ray.init's bare "Failed to connect" means since Ray's token authentication: the message says which token
    this process would send (Ray's order: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) and the fix."""
    from torchyard.trainer.launch.ray_actors import refused_connection

    home = tmp_path / "home"
    if env.pop("token_file", False):
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text("abc")
    message = refused_connection("127.0.0.1:6379", "Failed to connect to Ray cluster at 10.0.0.1:6379",
                                 {"HOME": str(home), **env})
    assert message == ("the Ray cluster at 127.0.0.1:6379 answers but did not let this process join (Failed to "
                       "connect to Ray cluster at 10.0.0.1:6379)" + advice.format(home=home))
