"""strategy="ps": 3 CPU processes (servers + workers on torch.distributed.rpc) against hand-written references.

One synchronous fit (1 server, 2 workers), started by the Trainer from this pytest process, is shared by
the tests that read its outcome: it must land on the weights of one process trained on the concatenated
batches, and its checkpoints must hold the full model and the optimizer state as one device has them.
Its epoch-0 checkpoint is then resumed by 2 servers and 1 worker, and by a single-device run: both must
match the hand-written continuation. A third fit trains the digits CNN asynchronously. The server's
rules (rounds, staleness bound, stale gradients, batch claims) are checked in-process, without RPC.
"""

from __future__ import annotations

import os
import re
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import rpc
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchyard.callbacks import ModelCheckpoint, Timer
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.data.samplers import ResumableBatchSampler
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import build_strategy
from torchyard.trainer.strategies.ps.client import ClaimedBatches, check_optimizer, plan_shards
from torchyard.trainer.strategies.ps.server import ParameterShard
from torchyard.trainer.strategies.ps.strategy import ParameterServerStrategy

SEED, BATCH, EPOCHS = 3, 4, 2
QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)
SYNC_PS = {"name": "ps", "staleness": 0}


def dataset(samples: int, offset: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(100 + offset)
    x = torch.randn(samples, 5, generator=generator)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


TRAIN, VAL = dataset(40), dataset(21, offset=1)


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        # Two param groups with their own rates: the servers must rebuild both.
        return torch.optim.SGD([{"params": self.net[0].parameters(), "lr": 0.05},
                                {"params": self.net[2].parameters(), "lr": 0.1}], momentum=0.9)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Net().state_dict()


def train_loader() -> DataLoader:
    return DataLoader(TRAIN, batch_size=BATCH, shuffle=True)


def reference(state: dict[str, torch.Tensor], epochs: range, workers: int,
              optimizer_state: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """One process over the epochs' steps, each on every worker's batch at once (a mean loss: the same gradient)."""
    model = Net()
    model.load_state_dict(state)
    optimizer = model.configure_optimizers()
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    samplers = [
        DistributedSampler(TRAIN, num_replicas=workers, rank=r, shuffle=True, seed=SEED) for r in range(workers)
    ]
    for epoch in epochs:
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH):
            index = torch.tensor([i for shard in shards for i in shard[start:start + BATCH]])
            optimizer.zero_grad()
            F.mse_loss(model(TRAIN.tensors[0][index]), TRAIN.tensors[1][index]).backward()
            optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """Synchronous ps (1 server, 2 workers) for 2 epochs, with a checkpoint per epoch."""
    root = tmp_path_factory.mktemp("ps_sync")
    module = Net()
    module.load_state_dict(initial_state())
    trainer = Trainer(strategy=SYNC_PS, devices=3, max_epochs=EPOCHS, seed=SEED, default_root_dir=str(root),
                      callbacks=[ModelCheckpoint(save_top_k=-1, filename="{epoch}")], **QUIET)
    trainer.fit(module, train_loader(), DataLoader(VAL, batch_size=BATCH))
    return module, trainer, root


def checkpoint_of_epoch(root: Path, epoch: int) -> Path:
    (path,) = root.glob(f"**/checkpoints/epoch={epoch}*.ckpt")
    return path


# --------------------------------------------------------------------------- multi-process runs


@pytest.mark.timeout(300)
def test_synchronous_ps_equals_one_process_on_the_concatenated_batches(sync_run):
    module, trainer, _ = sync_run
    expected, _ = reference(initial_state(), range(EPOCHS), workers=2)
    assert_same_weights(module.state_dict(), expected)  # the chief's final state, adopted by the caller
    assert (trainer.global_step, trainer.current_epoch) == (EPOCHS * 5, EPOCHS)
    assert float(trainer.callback_metrics["ps/staleness"]) == 0.0  # synchronous: never stale
    assert "val_loss" in trainer.callback_metrics


@pytest.mark.timeout(300)
def test_checkpoints_hold_the_model_and_optimizer_as_one_device_has_them(sync_run):
    _, _, root = sync_run
    checkpoint = load_checkpoint_file(checkpoint_of_epoch(root, 0))
    expected_weights, expected_optimizer = reference(initial_state(), range(1), workers=2)
    assert_same_weights(checkpoint["state_dict"], expected_weights)
    # The optimizer state gathered from the server loads into the user's optimizer on one device.
    single = Net()
    single.load_state_dict(checkpoint["state_dict"])
    optimizer = single.configure_optimizers()
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert [g["lr"] for g in optimizer.param_groups] == [0.05, 0.1]
    for index, state in expected_optimizer["state"].items():
        torch.testing.assert_close(checkpoint["optimizer_states"][0]["state"][index]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
def test_a_ps_checkpoint_resumes_on_two_servers_and_on_one_device_alike(sync_run, tmp_path):
    _, _, root = sync_run
    path = checkpoint_of_epoch(root, 0)
    after_first, optimizer_after_first = reference(initial_state(), range(1), workers=2)
    expected, _ = reference(after_first, range(1, EPOCHS), workers=1, optimizer_state=optimizer_after_first)

    on_servers = Net()
    Trainer(
        strategy={**SYNC_PS, "ps_servers": 2},
        devices=3,
        max_epochs=EPOCHS,
        seed=SEED,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        **QUIET,
    ).fit(on_servers, train_loader(), ckpt_path=path)
    one_device = Net()
    # One process keeps a loader's own sampler (a shuffle from the global RNG, as a plain loop): given the order
    # that workers draw seeded, it trains on the same batches.
    seeded_order = DistributedSampler(TRAIN, num_replicas=1, rank=0, shuffle=True, seed=SEED)
    Trainer(max_epochs=EPOCHS, seed=SEED, enable_checkpointing=False, default_root_dir=str(tmp_path),
            **QUIET).fit(one_device, DataLoader(TRAIN, batch_size=BATCH, sampler=seeded_order), ckpt_path=path)

    assert_same_weights(on_servers.state_dict(), expected)
    assert_same_weights(one_device.state_dict(), expected)


@pytest.mark.timeout(300)
def test_asynchronous_ps_on_digits_reaches_95_percent(tmp_path):
    # Asynchronous runs differ in which worker takes which batch, so judge the best epoch, not the last.
    best = ModelCheckpoint(monitor="val/acc", mode="max")
    trainer = Trainer(strategy="ps", devices=3, max_epochs=8, seed=0, default_root_dir=str(tmp_path),
                      callbacks=[best], num_sanity_val_steps=0, **QUIET)
    trainer.fit(DigitsCNN(), datamodule=DigitsData(batch_size=64))
    assert float(best.best_model_score) >= 0.95
    assert torch.load(best.best_model_path, weights_only=True)["state_dict"].keys() == DigitsCNN().state_dict().keys()
    assert "ps/staleness" in trainer.callback_metrics


# --------------------------------------------------------------------------- the server's rules, in-process


def shard(workers: int, staleness: int | None, policy: str = "scale", lr: float = 1.0) -> ParameterShard:
    server = ParameterShard(0, workers, staleness, policy, torch.device("cpu"))
    server.initialize([torch.zeros(2)], [0], torch.optim.SGD, {"lr": lr}, [{"lr": lr}])
    server.ready = True
    return server


def value(server: ParameterShard) -> torch.Tensor:
    return server.params[0].detach().clone()


def test_a_synchronous_round_applies_the_average_once_every_worker_pushed():
    server = shard(workers=2, staleness=0)
    options = [{"lr": 1.0}]
    server.push(0, 0, [torch.tensor([1.0, 2.0])], options)
    waiting = server.pull(0, 1, False)  # step 1 needs round 0 applied
    assert not waiting.done() and torch.equal(value(server), torch.zeros(2))
    server.push(1, 0, [torch.tensor([3.0, 6.0])], options)
    version, values = waiting.wait()
    assert version == 1
    torch.testing.assert_close(values[0], torch.tensor([-2.0, -4.0]))  # 0 - lr * mean


def test_bounded_staleness_holds_back_a_worker_ahead_of_the_slowest_until_it_catches_up():
    server = shard(workers=2, staleness=1)
    grad, options = [torch.ones(2)], [{"lr": 1.0}]
    server.push(0, 0, grad, options)
    assert server.pull(0, 1, False).done()  # one step ahead of worker 1: allowed
    server.push(0, 1, grad, options)
    blocked = server.pull(0, 2, False)  # two steps ahead: waits for worker 1
    assert not blocked.done()
    server.push(1, 0, grad, options)
    assert blocked.done()
    server.push(0, 2, grad, options)
    blocked = server.pull(0, 3, False)
    assert not blocked.done()
    server.finish(1)  # a worker that finished training holds nobody back
    assert blocked.done()


@pytest.mark.parametrize("policy", ["drop", "scale"])
def test_gradients_older_than_the_bound_are_dropped_or_scaled_and_counted(policy):
    server = shard(workers=3, staleness=1, policy=policy)
    grad, options = [torch.ones(2)], [{"lr": 1.0}]
    for _ in range(3):
        server.push(0, server.version, grad, options)
    before = value(server)
    reply = server.push(1, 0, grad, options)  # computed on version 0, three updates ago
    assert reply["staleness"] == 3
    if policy == "drop":
        assert reply["dropped"] == 1 and torch.equal(value(server), before)
    else:
        assert reply["scaled"] == 1
        torch.testing.assert_close(value(server), before - 1.0 / 3)  # lr x S / staleness
    assert server.optimizer.param_groups[0]["lr"] == 1.0  # the scaled rate was for that step only


def test_each_worker_claims_its_own_first_batch_then_whoever_asks_first():
    server = shard(workers=2, staleness=None)
    claims = [server.claim(w, 0, 5) for w in (1, 1, 1, 0, 0)]
    assert claims == [1, 2, 3, 0, 4]
    assert server.claim(0, 0, 5) is None and server.claim(1, 0, 5) is None
    assert server.claim(0, 1, 5) == 0  # a new epoch starts over


def test_claimed_batches_follow_the_shared_order_and_skip_others_claims():
    batches = ResumableBatchSampler(range(10), batch_size=2, drop_last=False)
    claimed = iter([1, 3, 4, None])
    sampler = ClaimedBatches(batches, lambda epoch, total: next(claimed))
    assert list(sampler) == [[2, 3], [6, 7], [8, 9]]


def test_parameters_are_spread_over_servers_by_size():
    assert plan_shards([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # 110 values each
    with pytest.raises(MisconfigurationError, match="ps_servers=3, but the optimizer holds only 2"):
        plan_shards([4, 4], 3)


def test_roles_come_from_the_rank_layout_and_the_loop_sees_only_workers():
    strategy = ParameterServerStrategy(ps_servers=2)
    strategy.configure("cpu", 3, 2, "32")  # 2 nodes x 3 processes: ranks 0-1 serve, ranks 2-5 train
    roles = []
    for rank in range(6):
        strategy.environment = ClusterEnvironment("torchrun", global_rank=rank, local_rank=rank % 3, world_size=6,
                                                  local_world_size=3, node_rank=rank // 3)
        roles.append((strategy.is_server, strategy.global_rank, strategy.local_rank, strategy.is_global_zero))
    assert roles == [(True, 0, 0, False), (True, 1, 1, False), (False, 0, 0, True),
                     (False, 1, 0, False), (False, 2, 1, False), (False, 3, 2, False)]
    assert (strategy.world_size, strategy.reporting_rank) == (4, 2)
    printed = strategy._roles([2, 2], [48, 9])
    assert "rank 0: server ps0, 2 tensors, 48 values" in printed and "rank 2: worker 0 (chief" in printed


# --------------------------------------------------------------------------- errors


def test_as_many_servers_as_processes_is_refused_before_any_process_starts():
    with pytest.raises(MisconfigurationError, match="ps_servers=3 leaves no worker.*use at least 4 processes"):
        Trainer(strategy={"name": "ps", "ps_servers": 3}, devices=3, **QUIET)


def test_a_torch_without_rpc_is_refused(monkeypatch):
    monkeypatch.setattr(rpc, "is_available", lambda: False)
    with pytest.raises(MisconfigurationError, match=r"torch.distributed.rpc.is_available\(\) is False"):
        Trainer(strategy="ps", devices=3, **QUIET)


def test_optimizers_a_server_cannot_hold_are_named():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(MisconfigurationError, match="cannot hold LBFGS: its step needs a closure"):
        check_optimizer([torch.optim.LBFGS(params)])
    with pytest.raises(MisconfigurationError, match="configure_optimizers returned 2"):
        check_optimizer([torch.optim.SGD(params, lr=1.0), torch.optim.SGD(params, lr=1.0)])
    adamw = torch.optim.AdamW(params, weight_decay=0.1)  # its defaults hold a key its constructor does not take
    assert check_optimizer([adamw]) is adamw


def test_options_through_the_registry_and_their_errors():
    strategy = build_strategy({"name": "ps", "ps_servers": 2, "staleness": 3, "stale_gradients": "drop"})
    assert isinstance(strategy, ParameterServerStrategy)
    assert (strategy.ps_servers, strategy.staleness, strategy.dynamic_batches) == (2, 3, False)
    assert build_strategy("ps").dynamic_batches  # fully asynchronous: batches are claimed
    with pytest.raises(MisconfigurationError, match="stale_gradients='ignore' is not known"):
        ParameterServerStrategy(stale_gradients="ignore")
    with pytest.raises(MisconfigurationError, match="dynamic_batches=True needs staleness=None"):
        ParameterServerStrategy(staleness=2, dynamic_batches=True)
    # Refused as the Trainer is built: claimed batches give an epoch no length to take a fraction of.
    with pytest.raises(MisconfigurationError, match=r"limit_train_batches=0.5 is a fraction of an epoch, but "
                                                    r"strategy='ps' with dynamic_batches"):
        Trainer(strategy="ps", devices=3, accelerator="cpu", limit_train_batches=0.5)
    Trainer(strategy={"name": "ps", "staleness": 0}, devices=3, accelerator="cpu", limit_train_batches=0.5)
    # Workers that claim their own batches count different steps: a collective every n of them would hang.
    for what, options in (
        ("ModelCheckpoint(every_n_train_steps=4)", {"callbacks": [ModelCheckpoint(every_n_train_steps=4)]}),
        ("val_check_interval=10", {"val_check_interval": 10}),
        ("val_check_interval=0.5", {"val_check_interval": 0.5}),
        ("max_time", {"max_time": 60}),  # a time budget checked after every step
        (
            "ModelCheckpoint(train_time_interval=600.0s)",
            {"callbacks": [ModelCheckpoint(train_time_interval=timedelta(minutes=10))]},
        ),
        ("Timer(interval='step')", {"callbacks": [Timer(duration=60)]}),
    ):
        with pytest.raises(
            MisconfigurationError, match=rf"{re.escape(what)} needs every process to reach the same steps"
        ):
            Trainer(strategy="ps", devices=3, accelerator="cpu", **options)
        Trainer(strategy={"name": "ps", "staleness": 0}, devices=3, accelerator="cpu", **options)
    Trainer(strategy="ps", devices=3, accelerator="cpu", callbacks=[Timer(duration=60, interval="epoch")])


def test_synchronous_ps_says_once_that_it_clips_each_workers_gradient_before_the_average():
    strategy = ParameterServerStrategy(staleness=0)
    strategy.environment = ClusterEnvironment(name="torchelastic", global_rank=1, world_size=3)  # the chief
    layer = nn.Linear(2, 1)
    layer(torch.ones(1, 2)).sum().mul(100).backward()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="clips each worker's gradient before the servers average them"):
        strategy.clip_gradients(optimizer, 1.0, "norm")
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in layer.parameters()])) == pytest.approx(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.clip_gradients(optimizer, 1.0, "norm")  # once a run


# --------------------------------------------------------------------------- a worker that dies


class DiesOnItsFourthBatch(Net):
    """Worker 1 (rank 2) kills itself with SIGKILL at its fourth batch, as the out-of-memory killer would."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 3:
            Path(self.marker).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)  # the others are still training when it dies
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(120)
def test_a_killed_worker_ends_the_job_within_seconds_naming_it(tmp_path):
    marker = tmp_path / "killed_at"
    trainer = Trainer(strategy="ps", devices=3, max_epochs=20,
                      enable_checkpointing=False, **QUIET)
    with pytest.raises(RuntimeError) as caught:
        trainer.fit(DiesOnItsFourthBatch(str(marker)), train_loader())
    elapsed = time.time() - float(marker.read_text())
    # The server used to wait for the dead worker in RPC's graceful shutdown until torch's agent killed it (30 s).
    assert elapsed < 12, f"the job took {elapsed:.1f} s to end after worker 1 was killed"
    assert str(caught.value).startswith("rank 2 of 3 was killed by SIGKILL, so the job was stopped.")
