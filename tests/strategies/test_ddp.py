"""strategy="ddp" on 2 CPU processes (gloo) against hand-written references.

One 2-process fit, started by the Trainer from this pytest process, is shared by the tests that read its
outcome (weights, metrics, checkpoints): a hand-written torch DDP loop and a one-process loop over the
concatenated batches must land on the same weights, and the caller's module must hold them.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
import weakref
from pathlib import Path

import ddp_reference
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchyard.callbacks import BasePredictionWriter, Callback, ModelCheckpoint
from torchyard.trainer import DataModule, Trainer, TrainModule
from torchyard.trainer.cluster.environment import ClusterEnvironment, find_free_port
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import build_strategy, distributed
from torchyard.trainer.strategies.ddp import DDPStrategy

SEED, BATCH, EPOCHS, BASE_LR = 3, 4, 2, 0.05
QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)


def dataset(samples: int, offset: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(100 + offset)
    x = torch.randn(samples, 5, generator=generator)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


TRAIN = dataset(40)
VAL = dataset(21, offset=1)  # 21 does not divide by 2 ranks: rank 0 sees 11 samples, rank 1 sees 10


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        self.val_mse = torchmetrics.MeanSquaredError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        prediction = self(x)
        self.log("val_loss", F.mse_loss(prediction, y), sync_dist=True, prog_bar=True)
        self.val_mse.update(prediction, y)
        self.log("val_mse", self.val_mse)
        self.log("rank1_batches", float(self.global_rank), reduce_fx="sum", sync_dist=True)
        self.log("max_rank", float(self.global_rank), reduce_fx="max", sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=BASE_LR, momentum=0.9)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Net().state_dict()


class Collect(Callback):
    """What a user's callback gathers during a run, and references it keeps to the run's objects."""

    def __init__(self) -> None:
        self.val_losses: list[float] = []
        self.held: dict = {}

    def setup(self, trainer, module, stage):
        self.held = {"trainer": trainer, "module": module, "layer": module.net[0], "bias": module.net[0].bias}

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


def ddp_trainer(root: Path, *extra: Callback, **options) -> Trainer:
    callbacks = [ModelCheckpoint(save_top_k=-1, filename="{epoch}", save_last=True), *extra]
    return Trainer(strategy="ddp", devices=2, max_epochs=EPOCHS, seed=SEED, lr_scaling="linear",
                   default_root_dir=str(root), callbacks=callbacks, **{**QUIET, **options})


def loaders() -> tuple[DataLoader, DataLoader]:
    return DataLoader(TRAIN, batch_size=BATCH, shuffle=True), DataLoader(VAL, batch_size=BATCH)


def full_set_mse(state: dict[str, torch.Tensor], data: TensorDataset) -> float:
    module = Net()
    module.load_state_dict(state)
    with torch.no_grad():
        return F.mse_loss(module(data.tensors[0]), data.tensors[1]).item()


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One 2-process fit started from this process: the module, the trainer and its run folder."""
    root = tmp_path_factory.mktemp("ddp_run")
    module = Net()
    module.load_state_dict(initial_state())
    trainer = ddp_trainer(root, Collect())
    trainer.fit(module, *loaders())
    return module, trainer, root


# --------------------------------------------------------------------------- the references


def concatenated_batch_reference(init: dict, lr: float) -> dict[str, torch.Tensor]:
    """One process, each step on both ranks' batches at once (a mean loss, so the same gradient)."""
    model = Net()
    model.load_state_dict(init)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    samplers = [DistributedSampler(TRAIN, num_replicas=2, rank=r, shuffle=True, seed=SEED) for r in range(2)]
    for epoch in range(EPOCHS):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH):
            index = torch.tensor([i for shard in shards for i in shard[start:start + BATCH]])
            optimizer.zero_grad()
            F.mse_loss(model(TRAIN.tensors[0][index]), TRAIN.tensors[1][index]).backward()
            optimizer.step()
    return model.state_dict()


# --------------------------------------------------------------------------- the shared 2-process fit


@pytest.mark.timeout(240)
def test_fit_in_the_caller_matches_a_hand_written_ddp_loop(ddp_run, tmp_path):
    module, trainer, _ = ddp_run
    out = tmp_path / "reference.pt"
    init = {key.removeprefix("net."): value for key, value in initial_state().items()}
    # lr_scaling="linear" doubled the rate for 2 processes; the reference applies the doubled rate by hand.
    args = (find_free_port(), init, TRAIN.tensors, 2 * BASE_LR, BATCH, EPOCHS, SEED, str(out))
    mp.spawn(ddp_reference.ddp_worker, args=args, nprocs=2, join=True)
    reference = {f"net.{key}": value for key, value in torch.load(out).items()}
    assert_same_weights(module.state_dict(), reference, atol=1e-6)
    assert (trainer.global_step, trainer.current_epoch) == (EPOCHS * 5, EPOCHS)


@pytest.mark.timeout(240)
def test_ddp_equals_one_process_on_the_concatenated_batches(ddp_run):
    module, _, _ = ddp_run
    reference = concatenated_batch_reference(initial_state(), 2 * BASE_LR)
    assert_same_weights(module.state_dict(), reference, atol=1e-5)


class GatheringNet(Net):
    """Its loss is over every rank's batch, gathered with gradients (Lightning's all_gather(sync_grads=True))."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        gathered = self.all_gather({"prediction": self(x), "target": y, "rank": self.global_rank}, sync_grads=True)
        assert gathered["rank"] == [0, 1] and gathered["prediction"].shape == (2, *y.shape)
        plain = self.all_gather(
            [torch.tensor(self.global_rank), torch.full((2, 3), self.global_rank, dtype=torch.int64)]
        )
        assert torch.equal(plain[0], torch.tensor([0, 1])) and torch.equal(plain[1][:, 0, 0], torch.tensor([0, 1]))
        assert plain[1].shape == (2, 2, 3) and not gathered["target"].requires_grad
        return F.mse_loss(gathered["prediction"], gathered["target"])


class MismatchedGather(Net):
    def training_step(self, batch, batch_idx):
        self.all_gather(torch.zeros(self.global_rank + 1))
        return super().training_step(batch, batch_idx)


def fit_on_two_ranks(module: Net, tmp_path) -> Trainer:
    """Fit `module`, from the reference's initial weights, under ddp on 2 processes; the trainer that did."""
    module.load_state_dict(initial_state())
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=EPOCHS, seed=SEED, default_root_dir=str(tmp_path),
                      enable_checkpointing=False, logger=False, **QUIET)
    trainer.fit(module, DataLoader(TRAIN, batch_size=BATCH, shuffle=True))
    return trainer


@pytest.mark.timeout(240)
def test_all_gather_with_gradients_trains_as_one_process_on_the_concatenated_batches(tmp_path):
    module = GatheringNet()
    fit_on_two_ranks(module, tmp_path)
    # Each rank's loss is the mean over both batches; its gradient reaches each rank's own predictions.
    assert_same_weights(module.state_dict(), concatenated_batch_reference(initial_state(), BASE_LR), atol=1e-5)

    mismatched = Trainer(strategy="ddp", devices=2, max_steps=1, default_root_dir=str(tmp_path), logger=False, **QUIET)
    with pytest.raises(
        MisconfigurationError,
        match=re.escape(
            "all_gather got ((1,), torch.float32) on rank 0 and ((2,), "
            "torch.float32) on rank 1; every process must gather"
        ),
    ):
        mismatched.fit(MismatchedGather(), DataLoader(TRAIN, batch_size=BATCH))


class ManualNet(Net):
    """Manual optimization: its backward runs inside DDP's forward, where DDP has not readied its reducer yet."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
        optimizer.step()


@pytest.mark.timeout(240)
def test_manual_optimization_under_ddp_trains_as_one_process_on_the_concatenated_batches(tmp_path):
    module = ManualNet()
    trainer = fit_on_two_ranks(module, tmp_path)
    assert trainer.global_step == EPOCHS * 5
    assert_same_weights(module.state_dict(), concatenated_batch_reference(initial_state(), BASE_LR), atol=1e-5)


class LBFGSNet(Net):
    def training_step(self, batch, batch_idx):
        self.log("evaluations", 1.0, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)  # both ranks'
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4, history_size=3)


@pytest.mark.timeout(240)
def test_lbfgs_under_ddp_evaluates_in_step_on_every_rank_as_one_process_on_the_concatenated_batches(tmp_path):
    module = LBFGSNet()
    module.load_state_dict(initial_state())
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=EPOCHS, seed=SEED, default_root_dir=str(tmp_path),
                      log_every_n_steps=1, **QUIET)
    trainer.fit(module, DataLoader(TRAIN, batch_size=BATCH, shuffle=True))

    model = Net()  # each closure call: the mean loss and gradient of both ranks' batches, as every rank's LBFGS sees
    model.load_state_dict(initial_state())
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)
    samplers = [DistributedSampler(TRAIN, num_replicas=2, rank=r, shuffle=True, seed=SEED) for r in range(2)]
    evaluations = []
    for epoch in range(EPOCHS):
        evaluations.append(0)
        for sampler in samplers:
            sampler.set_epoch(epoch)
        shards = [list(sampler) for sampler in samplers]
        for start in range(0, len(shards[0]), BATCH):
            index = torch.tensor([i for shard in shards for i in shard[start:start + BATCH]])

            def closure(index=index):
                evaluations[-1] += 1
                optimizer.zero_grad()
                loss = F.mse_loss(model(TRAIN.tensors[0][index]), TRAIN.tensors[1][index])
                loss.backward()
                return loss
            optimizer.step(closure)
    assert evaluations[-1] > 5  # LBFGS evaluated again: 5 steps an epoch
    assert float(trainer.callback_metrics["evaluations"]) == 2 * evaluations[-1]
    # LBFGS's curvature estimates amplify the rounding of the all-reduce's mean (a sum over ranks, then halved).
    assert_same_weights(module.state_dict(), model.state_dict(), atol=2e-4)


@pytest.mark.timeout(240)
def test_epoch_metrics_count_every_validation_sample_once(ddp_run):
    module, trainer, _ = ddp_run
    expected = full_set_mse(module.state_dict(), VAL)
    metrics = trainer.callback_metrics
    assert metrics["val_loss"].item() == pytest.approx(expected, rel=1e-5)  # self.log(sync_dist=True)
    assert metrics["val_mse"].item() == pytest.approx(expected, rel=1e-5)  # a torchmetrics Metric
    assert metrics["rank1_batches"].item() == 3.0  # rank 1's 10 samples make 3 batches; summed over ranks
    assert metrics["max_rank"].item() == 1.0
    assert trainer.progress_bar_metrics == {"val_loss": pytest.approx(expected, rel=1e-5)}  # handed back as floats
    share, wait = trainer.data_wait  # rank 0's measurement of its loader, handed back with the weights
    assert 0 <= share <= 1 and wait >= 0


@pytest.mark.timeout(240)
def test_the_callers_callbacks_hold_what_rank_0s_gathered_and_refer_to_the_callers_objects(ddp_run):
    module, trainer, _ = ddp_run
    [collect] = [c for c in trainer.callbacks if isinstance(c, Collect)]
    assert len(collect.val_losses) == EPOCHS and collect.val_losses[-1] == float(trainer.callback_metrics["val_loss"])
    held = collect.held  # the worker's trainer, module and parameters stand for the caller's own
    assert held["trainer"] is trainer and held["module"] is module
    assert held["layer"] is module.net[0] and held["bias"] is module.net[0].bias
    checkpoint = trainer.checkpoint_callback  # no monitor: the newest is the best, as on rank 0
    assert Path(checkpoint.best_model_path).name == f"epoch={EPOCHS - 1}.ckpt"
    assert Path(checkpoint.last_model_path).name == "last.ckpt"


@pytest.mark.timeout(240)
def test_checkpoints_hold_plain_keys_and_load_into_one_process(ddp_run):
    module, trainer, root = ddp_run
    folder = Path(trainer.log_dir) / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    assert Path(trainer.log_dir).parent == root / "default"
    saved = torch.load(folder / "last.ckpt", weights_only=True)
    assert_same_weights(saved["state_dict"], module.state_dict(), atol=0)
    # The ddp checkpoint in a single-device run: the same weights, the same validation loss.
    single = Trainer(strategy="single", logger=False, **QUIET)
    result = single.validate(Net(), DataLoader(VAL, batch_size=BATCH), ckpt_path=folder / "last.ckpt")
    assert result[0]["val_loss"] == pytest.approx(full_set_mse(module.state_dict(), VAL), rel=1e-5)


@pytest.mark.timeout(240)
def test_resuming_a_ddp_run_lands_on_the_uninterrupted_weights(ddp_run, tmp_path):
    module, trainer, _ = ddp_run
    resumed = Net()  # fresh weights: everything must come from the checkpoint
    ddp_trainer(tmp_path).fit(resumed, *loaders(), ckpt_path=Path(trainer.log_dir) / "checkpoints" / "epoch=0.ckpt")
    assert_same_weights(resumed.state_dict(), module.state_dict(), atol=1e-7)


class RateAtStart(Callback):
    def on_train_start(self, trainer, module):
        self.rates = [group["lr"] for group in trainer.optimizers[0].param_groups]


@pytest.mark.slow  # its ddp_run fixture starts 2 processes
def test_a_ddp_checkpoint_resumed_in_one_process_rescales_its_learning_rate(ddp_run, tmp_path, capsys):
    _, trainer, _ = ddp_run
    rate = RateAtStart()
    # lr_scaling="linear" on 2 processes saved rates of 2 x BASE_LR; one process scales by 1.
    Trainer(
        strategy="single",
        max_epochs=EPOCHS,
        seed=SEED,
        lr_scaling="linear",
        logger=False,
        callbacks=[rate],
        enable_checkpointing=False,
        **QUIET,
    ).fit(Net(), *loaders(), ckpt_path=Path(trainer.log_dir) / "checkpoints" / "epoch=0.ckpt")
    assert rate.rates == [BASE_LR]
    assert "the checkpoint's rates were scaled x2, this run's are x1; rescaled" in capsys.readouterr().out


# --------------------------------------------------------------------------- other launches


class FailingNet(Net):
    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            Path(self.marker).write_text(repr(time.time()))
            raise ValueError("rank one broke on purpose")
        return super().training_step(batch, batch_idx)


@pytest.mark.timeout(240)
def test_a_rank_that_raises_stops_the_job_within_seconds_and_its_error_is_raised_here(tmp_path):
    marker = tmp_path / "raised_at"
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=3, logger=False, enable_checkpointing=False, **QUIET)
    with pytest.raises(ValueError, match="rank one broke on purpose") as caught:
        trainer.fit(FailingNet(str(marker)), DataLoader(TRAIN, batch_size=BATCH))
    elapsed = time.time() - float(marker.read_text())
    # Rank 0 waits in an all-reduce that would otherwise only time out after trainer.timeout (1800 s).
    assert elapsed < 30, f"the job took {elapsed:.1f} s to stop after rank 1 raised"
    cause = str(caught.value.__cause__)
    assert cause.startswith("rank 1 of 2 failed") and "in training_step" in cause
    assert cause.count("ValueError: rank one broke on purpose") == 1
    assert not (tmp_path / "runs").exists()  # no version folder holding only the job's restart marker (issue 51)
    notes = " ".join(getattr(caught.value, "__notes__", []))
    if notes:  # Python >= 3.11: the note names the quiet rank's output folder, kept for the user
        output = Path(re.search(r"Worker output: (\S+)\.\)", notes).group(1))
        assert output.is_dir()
        shutil.rmtree(output.parent)


class ReturnsNothing(Net):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)  # the loss computed, the `return` forgotten


@pytest.mark.timeout(240)
def test_a_training_step_without_return_under_ddp_is_named_as_such_not_as_one_rank_skipping(tmp_path):
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=1, logger=False, enable_checkpointing=False, **QUIET)
    with pytest.raises(MisconfigurationError) as caught:
        trainer.fit(ReturnsNothing(), DataLoader(TRAIN, batch_size=BATCH))
    message = str(caught.value)  # whichever rank raised first: each does, at its first batch
    assert re.fullmatch(
        r"training_step returned None \(nothing\) for the fit's first batch \(batch 0 of epoch 0 on rank (\d) of 2\); "
        r"under automatic optimization it must return the loss tensor or a dict with key 'loss' \(is its `return` "
        r"missing\?\), or set `automatic_optimization = False`\. \(raised on rank \1\)", message), message


class PredictingNet(Net):
    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"x": x, "y": self(x)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("limit", "sizes"), [(1.0, [4, 4, 4, 4, 4, 1]), (3, [4, 4, 4])])
def test_predict_returns_every_ranks_predictions_in_dataset_order(tmp_path, limit, sizes):
    """21 samples in batches of 4 over 2 ranks (11 and 10 samples each): the caller gets what one process
    would have returned, 5 batches of 4 and one of 1, in order; limit_predict_batches counts those batches."""
    module = PredictingNet()
    module.load_state_dict(initial_state())
    trainer = Trainer(strategy="ddp", devices=2, default_root_dir=str(tmp_path), logger=False,
                      limit_predict_batches=limit, **QUIET)
    predictions = trainer.predict(module, DataLoader(VAL, batch_size=BATCH))
    x = VAL.tensors[0]
    assert [len(batch["x"]) for batch in predictions] == sizes
    with torch.no_grad():
        for start, batch in zip(range(0, len(x), BATCH), predictions):
            assert torch.equal(batch["x"], x[start:start + BATCH])
            torch.testing.assert_close(batch["y"], module(x[start:start + BATCH]), rtol=0, atol=1e-6)


class RankFileWriter(BasePredictionWriter):
    """Writes each rank's predictions and their dataset indices to its own file, as a user's writer would."""

    def __init__(self, folder: str) -> None:
        super().__init__("epoch")
        self.folder = folder

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        torch.save(
            {"predictions": predictions, "indices": batch_indices[0]},
            Path(self.folder) / f"rank{trainer.global_rank}.pt",
        )


@pytest.mark.timeout(240)
def test_a_prediction_writer_writes_each_ranks_shuffled_share_with_the_indices_of_its_samples(tmp_path):
    module = PredictingNet()
    module.load_state_dict(initial_state())
    trainer = Trainer(strategy="ddp", devices=2, default_root_dir=str(tmp_path), logger=False,
                      callbacks=[RankFileWriter(str(tmp_path))], **QUIET)
    # Shuffled, with no seed given: every rank must still draw the same order, or their slices would overlap.
    assert trainer.predict(module, DataLoader(VAL, batch_size=BATCH, shuffle=True), return_predictions=False) is None
    shares = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    indices = [[i for batch in share["indices"] for i in batch] for share in shares]
    assert (len(indices[0]), len(indices[1])) == (11, 10) and sorted(indices[0] + indices[1]) == list(range(len(VAL)))
    for share, drawn in zip(shares, indices):
        assert torch.equal(torch.cat([batch["x"] for batch in share["predictions"]]), VAL.tensors[0][drawn])


# --------------------------------------------------------------------------- one process, in this process


def test_single_device_checkpoint_loads_into_the_ddp_wrapped_module(tmp_path):
    single = Trainer(strategy="single", max_epochs=1, default_root_dir=str(tmp_path), log_every_n_steps=1, **QUIET)
    trained = Net()
    single.fit(trained, DataLoader(TRAIN, batch_size=8))
    # The keys land in the module DDP wraps (a world of one process: loading does not depend on its size).
    result = Trainer(strategy="ddp", devices=1, logger=False, **QUIET).validate(
        Net(), DataLoader(VAL, batch_size=BATCH), ckpt_path=single.checkpoint_callback.last_model_path)
    assert result[0]["val_loss"] == pytest.approx(full_set_mse(trained.state_dict(), VAL), rel=1e-5)


def test_teardown_releases_the_ddp_wrapper_before_destroying_the_group(tmp_path, monkeypatch):
    seen = {}

    class Grab(Callback):
        def on_train_start(self, trainer, module):
            seen["wrapper"] = weakref.ref(trainer.strategy.model)

    destroy = distributed.destroy_process_group

    def checked_destroy():
        seen["wrapper_alive_at_destroy"] = seen["wrapper"]() is not None
        destroy()

    monkeypatch.setattr(distributed, "destroy_process_group", checked_destroy)
    Trainer(strategy="ddp", devices=1, max_epochs=1, logger=False, enable_checkpointing=False, callbacks=[Grab()],
            **QUIET).fit(Net(), DataLoader(TRAIN, batch_size=BATCH))
    assert seen["wrapper"]() is None
    assert seen["wrapper_alive_at_destroy"] is False
    assert not dist.is_initialized()


def test_accumulating_micro_batches_skip_the_gradient_all_reduce():
    syncing = []

    class Watch(Callback):
        def on_before_backward(self, trainer, module, loss):
            syncing.append(trainer.strategy.model.require_backward_grad_sync)

    Trainer(strategy="ddp", devices=1, max_epochs=1, limit_train_batches=4, accumulate_grad_batches=2, logger=False,
            enable_checkpointing=False, callbacks=[Watch()], **QUIET).fit(Net(), DataLoader(TRAIN, batch_size=BATCH))
    assert syncing == [False, True, False, True]


class HalfUsed(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(5, 1), nn.Linear(5, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.used(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_find_unused_parameters_reaches_torch_ddp():
    options = dict(devices=1, max_steps=3, logger=False, enable_checkpointing=False, **QUIET)
    with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
        Trainer(strategy="ddp", **options).fit(HalfUsed(), DataLoader(TRAIN, batch_size=BATCH))
    Trainer(strategy={"name": "ddp", "find_unused_parameters": True}, **options).fit(
        HalfUsed(), DataLoader(TRAIN, batch_size=BATCH))


class OneStep(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))

    def training_step(self, batch, batch_idx):
        return (self.weight * batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_fp16_comm_hook_sends_gradients_in_half_precision():
    grads = torch.tensor([[1.0001, 3.14159265, -2.7182818]])  # not representable in fp16
    module = OneStep()
    Trainer(strategy=DDPStrategy(comm_hook="fp16"), devices=1, max_steps=1, logger=False, enable_checkpointing=False,
            **QUIET).fit(module, DataLoader(TensorDataset(grads), batch_size=1))
    torch.testing.assert_close(module.weight.detach(), -grads[0].half().float(), rtol=0, atol=0)
    assert not torch.equal(module.weight.detach(), -grads[0])


def test_lr_scaling_is_logged_once_at_start(capsys):
    Trainer(strategy="ddp", devices=1, max_steps=1, accumulate_grad_batches=2, lr_scaling="linear", logger=False,
            enable_checkpointing=False, **QUIET).fit(Net(), DataLoader(TRAIN, batch_size=BATCH))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lr_scaling")]
    assert lines == ["lr_scaling=linear: learning rates x2 (data-parallel size 1 x accumulate_grad_batches 2) -> 0.1"]


# --------------------------------------------------------------------------- clear errors before training


def test_options_through_the_registry_and_their_errors():
    strategy = build_strategy({"name": "ddp", "find_unused_parameters": True, "comm_hook": "bf16"})
    assert isinstance(strategy, DDPStrategy) and strategy.find_unused_parameters and strategy.comm_hook == "bf16"
    with pytest.raises(MisconfigurationError, match="comm_hook='int8'.*'fp16', 'bf16' or 'noop'"):
        DDPStrategy(comm_hook="int8")
    with pytest.raises(MisconfigurationError, match="backend='nccl'\\) needs CUDA"):
        Trainer(strategy=DDPStrategy(backend="nccl"), accelerator="cpu")


def test_more_devices_than_the_machine_has_is_refused_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(MisconfigurationError, match="devices=4 but this machine has 2 CUDA"):
        Trainer(strategy="ddp", devices=4, accelerator="cuda")


def test_each_process_pins_its_local_rank_or_the_one_gpu_its_launcher_left_visible(monkeypatch):
    pinned = []
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    strategy = DDPStrategy()
    for visible, local_rank in ((4, 3), (1, 3)):  # srun --gpus-per-task=1 leaves one GPU per process
        monkeypatch.setattr(torch.cuda, "device_count", lambda visible=visible: visible)
        strategy._pin_cuda_device(ClusterEnvironment(name="slurm", local_rank=local_rank, world_size=4))
    assert pinned == [torch.device("cuda", 3), torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(MisconfigurationError, match="local rank 3 has no CUDA device \\(this process sees 2\\)"):
        strategy._pin_cuda_device(ClusterEnvironment(name="slurm", local_rank=3, world_size=4))


SLURM_RANK0 = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0",
               "SLURM_NODELIST": "localhost", "SLURM_JOB_NAME": "train", "MASTER_ADDR": "127.0.0.1",
               "SLURM_STEP_ID": "0"}  # srun's tasks carry a step id (an sbatch or salloc shell has none)


def set_env(monkeypatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_master_port_in_use_is_a_clear_error(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        set_env(monkeypatch, {**SLURM_RANK0, "MASTER_PORT": str(busy.getsockname()[1])})
        with pytest.raises(MisconfigurationError, match=f"port {busy.getsockname()[1]} on 127.0.0.1 is already in use"):
            Trainer(strategy="ddp", devices=2, logger=False, **QUIET).fit(Net(), DataLoader(TRAIN, batch_size=BATCH))


def test_unreachable_master_fails_within_the_timeout(monkeypatch):
    env = {**SLURM_RANK0, "SLURM_PROCID": "1", "MASTER_PORT": str(find_free_port())}  # nobody serves that port
    set_env(monkeypatch, env)
    started = time.monotonic()
    with pytest.raises(MisconfigurationError, match="rank 1 could not reach the master at 127.0.0.1:.* within 1 s"):
        Trainer(strategy="ddp", devices=2, timeout=1, logger=False, **QUIET).fit(
            Net(), DataLoader(TRAIN, batch_size=BATCH)
        )
    assert time.monotonic() - started < 20


def test_unresolvable_master_address_is_named(monkeypatch):
    env = {**SLURM_RANK0, "SLURM_PROCID": "1", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29511"}
    set_env(monkeypatch, env)
    said = "cannot resolve the master address 'no-such-host.invalid' \\(from slurm: .*fix DNS or /etc/hosts on"
    with pytest.raises(MisconfigurationError, match=said):
        Trainer(strategy="ddp", devices=2, logger=False, **QUIET).fit(Net(), DataLoader(TRAIN, batch_size=BATCH))


class Unpicklable(Net):
    def __init__(self) -> None:
        super().__init__()
        self.transform = lambda x: x


def test_a_module_that_cannot_be_pickled_is_named_before_any_process_starts():
    with pytest.raises(MisconfigurationError, match="pickled copy of the module"):
        Trainer(strategy="ddp", devices=2, logger=False, **QUIET).fit(
            Unpicklable(), DataLoader(TRAIN, batch_size=BATCH)
        )


class TrainOnly(DataModule):
    def train_dataloader(self):
        return DataLoader(TRAIN, batch_size=BATCH)


def test_after_a_fit_in_started_processes_the_caller_tests_on_its_datamodule_and_cannot_save_an_absent_state(
    monkeypatch,
):
    from torchyard.trainer.launch import elastic as launcher

    started = []
    monkeypatch.setattr(launcher, "launch", lambda trainer, stage, *run_args: started.append(stage) or {"result": None})
    trainer, datamodule = Trainer(strategy="ddp", devices=2, logger=False, **QUIET), TrainOnly()
    trainer.fit(Net(), datamodule=datamodule)
    assert started == ["fit"] and trainer.datamodule is datamodule and datamodule.trainer is trainer
    trainer.test()  # on the fit's datamodule, as after a fit in one process
    assert started == ["fit", "test"]
    with pytest.raises(MisconfigurationError, match="trainer.save_checkpoint needs a run's state in this process"):
        trainer.save_checkpoint("never.ckpt")
