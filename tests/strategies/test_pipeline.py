"""strategy="pipeline" against a hand-written single-device torch loop: same initial weights, same batches.

Workers are real gloo processes with torchrun's variables set, so `Trainer.fit` runs in-process on each
rank. They are forked from a forkserver that imported torch and the trainer once, so each pipeline run
costs about a second instead of a fresh interpreter's imports. Every run writes what rank 0 saw (losses,
the gathered weights, logged metrics) to a file that the test compares with the reference.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from torchyard.callbacks import ModelCheckpoint
from torchyard.callbacks.base import Callback
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import build_strategy
from torchyard.trainer.strategies.pipeline.split import build_stage_modules, stage_ownership
from torchyard.trainer.strategies.pipeline.strategy import PipelineStrategy

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, accelerator="cpu")
BATCH = 8


def dataset(samples: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 4, generator=generator), torch.randint(0, 3, (samples,), generator=generator)
    )


class ChainNet(TrainModule):
    """embed -> blocks -> head, as the charlm recipe is laid out."""

    def __init__(self, depth: int = 4, optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def pipeline_loss(self, output, batch):
        return F.cross_entropy(output, batch[1])

    def configure_optimizers(self):
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SequentialNet(ChainNet):
    """A plain nn.Sequential; validation logs a torchmetrics accuracy from the last stage."""

    def __init__(self, depth: int = 3, optimizer: str = "sgd") -> None:
        TrainModule.__init__(self)
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(4, 16), nn.Tanh()]
        for _ in range(depth - 2):
            layers += [nn.Linear(16, 16), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(16, 3))
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")  # not a pipeline unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def pipeline_validation_step(self, output, batch, batch_idx):
        self.val_acc(output.argmax(-1), batch[1])
        self.log("val_acc", self.val_acc, prog_bar=True)


MODELS = {"chain": ChainNet, "sequential": SequentialNet}


# --------------------------------------------------------------------------- the reference


def reference_fit(model: nn.Module, *, epochs: int, replicas: int = 1, clip: float | None = None,
                  accumulate: int = 1, samples: int = 32) -> dict[str, Any]:
    """Single-device training on the batches the Trainer draws: replica r's batch t comes from
    DistributedSampler(rank=r, shuffle=True, seed=0); a step averages the replicas' mean losses."""
    data = dataset(samples)
    optimizer = model.configure_optimizers()
    losses = []
    for epoch in range(epochs):
        shards = []
        for rank in range(replicas):
            sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for batch, start in enumerate(range(0, len(shards[0]), BATCH)):
            loss = torch.stack(
                [
                    F.cross_entropy(
                        model(data.tensors[0][shard[start : start + BATCH]]),
                        data.tensors[1][shard[start : start + BATCH]],
                    )
                    for shard in shards
                ]
            ).mean()
            (loss * (1.0 / accumulate)).backward()
            losses.append(loss.item())
            if (batch + 1) % accumulate:
                continue
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "state": model.state_dict(), "optimizer": optimizer}


def fresh(kind: str = "chain", **kwargs: Any) -> ChainNet:
    torch.manual_seed(0)
    return MODELS[kind](**kwargs)


# --------------------------------------------------------------------------- the workers


class Record(Callback):
    """Every rank: the replica-averaged loss per step; at the end, the gathered weights (a collective)."""

    def __init__(self, path: str) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"], "mean")))

    def on_fit_end(self, trainer, module):
        state = trainer.strategy.model_state_dict()
        if trainer.is_global_zero:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            torch.save({"losses": self.losses, "state": state, "metrics": metrics}, self.path)


def _worker(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(out)
        module = fresh(spec.get("model", "chain"), **spec.get("model_args", {}))
        callbacks = [Record(f"{out}/result.pt")]
        if spec.get("checkpoints"):
            callbacks.append(ModelCheckpoint(dirpath=f"{out}/ckpts", filename="{epoch}", save_top_k=-1, save_last=True))
        trainer = Trainer(
            strategy=PipelineStrategy(**spec["strategy"]),
            devices=world,
            max_epochs=spec.get("epochs", 2),
            callbacks=callbacks,
            **{**QUIET, "enable_checkpointing": bool(spec.get("checkpoints")), **spec.get("trainer", {})},
        )
        val = DataLoader(dataset(), batch_size=12) if spec.get("validate") else None
        train = DataLoader(dataset(spec.get("samples", 32)), batch_size=BATCH, shuffle=True)
        trainer.fit(module, train, val, ckpt_path=spec.get("resume"))
        torch.save(module.state_dict(), f"{out}/module-{rank}.pt")  # what each rank's script holds after fit
        if spec.get("predict"):
            predictions = trainer.predict(module, DataLoader(dataset(), batch_size=12))
            if rank == 0:
                torch.save(torch.cat(predictions), f"{out}/predictions.pt")
    except BaseException:
        Path(f"{out}/error-{rank}.txt").write_text(traceback.format_exc())
        raise


def run_pipeline(tmp_path: Path, world: int, spec: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """Run `spec` on `world` worker processes; return rank 0's record (workers must all exit cleanly)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "trainer", "callbacks", "torch.distributed.pipelining"])
    port = find_free_port()
    workers = [context.Process(target=_worker, args=(rank, world, port, spec, str(tmp_path))) for rank in range(world)]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join(timeout)
    finally:
        hung = [w for w in workers if w.is_alive()]
        for worker in hung:
            worker.kill()
            worker.join()
    errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("error-*.txt")))
    assert not hung, f"{len(hung)} pipeline workers did not exit within {timeout}s\n{errors}"
    assert all(w.exitcode == 0 for w in workers), f"exit codes {[w.exitcode for w in workers]}\n{errors}"
    return torch.load(tmp_path / "result.pt", weights_only=True)


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)


# --------------------------------------------------------------------------- equivalence


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_matches_single_device(tmp_path, schedule, stages):
    record = run_pipeline(tmp_path, stages, {"strategy": {"schedule": schedule, "microbatches": 4}})
    reference = reference_fit(fresh(), epochs=2)
    assert len(record["losses"]) == 8
    torch.testing.assert_close(record["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
    assert_same_weights(record["state"], reference["state"])
    for rank in range(stages):  # each rank's script holds the whole trained model, not only its stage
        assert_same_weights(torch.load(tmp_path / f"module-{rank}.pt", weights_only=True), reference["state"])


@pytest.mark.timeout(120)
def test_pipeline_times_data_parallel_matches_single_device(tmp_path):
    """2 stages x 2 replicas: each replica takes half of every global batch; gradients are averaged
    (over two accumulated batches per optimizer step). Each replica predicts every other sample; rank 0
    gets them all back in order."""
    spec = {"strategy": {"stages": 2, "schedule": "1f1b", "microbatches": 2}, "trainer": {"accumulate_grad_batches": 2},
            "predict": True}
    record = run_pipeline(tmp_path, 4, spec)
    model = fresh()
    reference = reference_fit(model, epochs=2, replicas=2, accumulate=2)
    assert len(record["losses"]) == 4
    torch.testing.assert_close(record["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
    assert_same_weights(record["state"], reference["state"])
    with torch.no_grad():
        outputs = model(dataset().tensors[0])
    torch.testing.assert_close(torch.load(tmp_path / "predictions.pt"), outputs, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
def test_sequential_interleaved_with_clipping_validation_and_predict(tmp_path):
    """A plain nn.Sequential, two stages per process, clipped by the global norm, an epoch ending in a
    6-sample batch (3 micro-batches); the last stage's validation logs and predictions reach rank 0."""
    spec = {"model": "sequential", "model_args": {"depth": 4}, "validate": True, "predict": True, "samples": 30,
            "strategy": {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 4},
            "trainer": {"gradient_clip_val": 0.05, "logger": True, "log_every_n_steps": 1}}
    record = run_pipeline(tmp_path, 2, spec)
    model = fresh("sequential", depth=4)
    reference = reference_fit(model, epochs=2, clip=0.05, samples=30)
    torch.testing.assert_close(record["losses"], reference["losses"], rtol=1e-4, atol=1e-5)
    assert_same_weights(record["state"], reference["state"])
    x, y = dataset().tensors
    with torch.no_grad():
        outputs = model(x)
    assert record["metrics"]["val_acc"] == pytest.approx((outputs.argmax(-1) == y).float().mean().item(), abs=1e-6)
    torch.testing.assert_close(torch.load(tmp_path / "predictions.pt"), outputs, rtol=1e-4, atol=1e-5)
    rows = (tmp_path / "runs/default/version_0/metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    train_losses = [
        float(r.split(",")[header.index("train/loss")]) for r in rows[1:] if r.split(",")[header.index("train/loss")]
    ]
    assert train_losses == pytest.approx(reference["losses"], abs=1e-5)


# --------------------------------------------------------------------------- checkpoints


def pipeline_ordered_loader() -> DataLoader:
    """The pipeline's batch order on one process: there a loader keeps its own sampler (drawing a shuffle from the
    global RNG, as a plain loop), while pipeline stages, which must agree on one order, draw it seeded."""
    data = dataset()
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))


@pytest.mark.timeout(120)
def test_checkpoints_move_between_pipeline_and_single_device(tmp_path):
    reference_epoch1 = reference_fit(fresh(optimizer="adam"), epochs=1)
    reference = reference_fit(fresh(optimizer="adam"), epochs=2)

    # pipeline -> file: the whole model and Adam state under single-device keys
    pipeline_dir = tmp_path / "pipeline"
    pipeline_dir.mkdir()
    spec = {"model_args": {"optimizer": "adam"}, "checkpoints": True, "strategy": {"stages": 2, "schedule": "gpipe"}}
    run_pipeline(pipeline_dir, 2, spec)
    checkpoint = torch.load(pipeline_dir / "ckpts/epoch=0.ckpt", weights_only=True)
    assert_same_weights(checkpoint["state_dict"], reference_epoch1["state"])
    expected_optimizer = reference_epoch1["optimizer"].state_dict()
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == sorted(expected_optimizer["state"])
    for index, state in expected_optimizer["state"].items():
        torch.testing.assert_close(checkpoint["optimizer_states"][0]["state"][index]["exp_avg_sq"], state["exp_avg_sq"])

    # pipeline checkpoint -> single-device resume
    module = fresh(optimizer="adam")
    Trainer(max_epochs=2, enable_checkpointing=False, **QUIET).fit(
        module, pipeline_ordered_loader(), ckpt_path=pipeline_dir / "ckpts/epoch=0.ckpt")
    assert_same_weights(module.state_dict(), reference["state"])

    # single-device checkpoint -> pipeline resume
    single_dir = tmp_path / "single"
    single = Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    single.fit(fresh(optimizer="adam"), pipeline_ordered_loader())
    single.save_checkpoint(single_dir / "epoch0.ckpt")
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    record = run_pipeline(resume_dir, 2, {**spec, "checkpoints": False, "resume": str(single_dir / "epoch0.ckpt")})
    torch.testing.assert_close(record["losses"], reference["losses"][4:], rtol=1e-4, atol=1e-5)
    assert_same_weights(record["state"], reference["state"])


@pytest.mark.timeout(120)
def test_pipeline_run_resumes_from_its_checkpoint(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    spec = {"model": "chain", "checkpoints": True, "strategy": {"stages": 2, "schedule": "1f1b"}}
    run_pipeline(first, 2, {**spec, "epochs": 1})
    record = run_pipeline(second, 2, {**spec, "checkpoints": False, "resume": str(first / "ckpts/last.ckpt")})
    reference = reference_fit(fresh(), epochs=2)
    torch.testing.assert_close(record["losses"], reference["losses"][4:], rtol=1e-4, atol=1e-5)
    assert_same_weights(record["state"], reference["state"])


# --------------------------------------------------------------------------- cutting the model


def test_even_split_by_parameters_keeps_full_model_names():
    module = fresh(depth=4)
    stages = build_stage_modules(module, 3, None)
    owned = stage_ownership(module, stages)
    assert set().union(*owned) == set(module.state_dict())
    assert owned[0] == {"embed.weight", "embed.bias", "blocks.0.0.weight", "blocks.0.0.bias"}
    assert owned[2] == {"blocks.3.0.weight", "blocks.3.0.bias", "head.weight", "head.bias"}
    x = torch.randn(5, 4)
    out = x
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, module(x))


def test_split_points_and_plain_sequential():
    module = fresh(depth=4)
    owned = stage_ownership(module, build_stage_modules(module, 2, ["blocks.3"]))
    assert "blocks.3.0.weight" in owned[1] and "blocks.2.0.weight" in owned[0]
    sequential = fresh("sequential", depth=4)
    stages = build_stage_modules(sequential, 4, None)
    assert [sorted(keys) for keys in stage_ownership(sequential, stages)] == [
        [f"net.{i}.bias", f"net.{i}.weight"] for i in (0, 2, 4, 6)
    ]


def test_hook_provides_stages_and_tied_weights_are_refused():
    class Hooked(ChainNet):
        def pipeline_stages(self, num_stages):
            return [nn.Sequential(self.embed, *self.blocks[:2]), nn.Sequential(*self.blocks[2:], self.head)]

    module = Hooked()
    assert [len(keys) for keys in stage_ownership(module, build_stage_modules(module, 2, None))] == [6, 6]
    module.head.weight = module.embed.weight = nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(MisconfigurationError, match="tied weights"):
        stage_ownership(module, build_stage_modules(module, 2, None))


# --------------------------------------------------------------------------- errors before any process starts


def configured(devices: int = 2, **options: Any) -> PipelineStrategy:
    strategy = build_strategy({"name": "pipeline", **options})
    strategy.configure("cpu", devices, 1, "32")
    return strategy


@pytest.mark.parametrize(("options", "devices", "message"), [
    ({"schedule": "zigzag"}, 2, "known: gpipe, 1f1b, interleaved_1f1b"),
    ({"stages": 3}, 4, "not divisible by pipeline stages=3"),
    ({"stages": 2, "split_points": ["blocks.1", "blocks.2"]}, 2, "give 1 split points"),
    ({"schedule": "1f1b", "microbatches": 2}, 4, "raise microbatches to 4"),
    ({"schedule": "gpipe", "stages_per_rank": 2}, 2, "runs one stage per process"),
])
def test_configuration_errors(options, devices, message):
    with pytest.raises(MisconfigurationError, match=message):
        configured(devices, **options)


def test_an_optimizer_that_evaluates_the_loss_itself_is_refused():
    with pytest.raises(MisconfigurationError, match=r"strategy='pipeline' cannot step LBFGS: .* or strategy='ddp'"):
        configured().setup_optimizers([torch.optim.LBFGS(nn.Linear(2, 2).parameters())])


def test_schedule_names_match_torch_spelling_too():
    assert configured(schedule="1F1B").schedule_name == "1f1b"
    assert configured(schedule="Interleaved1F1B", stages_per_rank=2).schedule_name == "interleaved_1f1b"


def test_model_errors_name_the_fix(monkeypatch):
    with pytest.raises(MisconfigurationError, match="valid names: embed, blocks, blocks.0, blocks.0.0"):
        build_stage_modules(fresh(depth=2), 2, ["block.1"])
    with pytest.raises(MisconfigurationError, match="4 layers with parameters .* but 5 pipeline stages"):
        build_stage_modules(fresh(depth=2), 5, None)

    class NoLoss(TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 2)

    class Sampling(TrainModule):
        def __init__(self):
            super().__init__()
            self.layer, self.head = nn.Linear(2, 2), nn.Linear(2, 2)

        def pipeline_loss(self, output, batch):
            return output.sum()

        def predict_step(self, batch, batch_idx):
            return "text"

    # Refused in the calling process, before any worker starts.
    started = []
    monkeypatch.setattr("torchyard.trainer.launch.elastic.launch", lambda *args: started.append(args))
    trainer = Trainer(strategy={"name": "pipeline"}, devices=2, accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(MisconfigurationError, match="must define pipeline_loss"):
        trainer.fit(NoLoss(), DataLoader(dataset(), batch_size=8))
    with pytest.raises(MisconfigurationError, match=r"Sampling.predict_step cannot run under strategy='pipeline'.*"
                                                    r"Predict with strategy='single' or 'ddp'"):
        trainer.predict(Sampling(), DataLoader(dataset(), batch_size=8))
    split = Trainer(strategy={"name": "pipeline", "split_points": ["blocks.9"]}, devices=2, accelerator="cpu",
                    logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(MisconfigurationError, match=r"split point 'blocks.9' is not a submodule"):
        split.fit(fresh(), DataLoader(dataset(), batch_size=8))
    class OwnBackward(Sampling):
        def backward(self, loss):
            loss.backward(retain_graph=True)

    with pytest.raises(
        MisconfigurationError,
        match=r"schedule's backward, stage by stage, so OwnBackward.backward would "
        r"never be called",
    ):
        trainer.fit(OwnBackward(), DataLoader(dataset(), batch_size=8))
    assert started == []
    configured().check_module(Sampling(), "fit")  # trains and validates on pipeline_loss


def test_batch_size_must_split_into_microbatches():
    strategy = configured(microbatches=3)
    with pytest.raises(MisconfigurationError, match="batch_size=8 is not divisible by microbatches=3"):
        strategy.prepare_loader(DataLoader(dataset(), batch_size=8), train=True, seed=0)
    zero_bubble_v = configured(schedule="zbv_zero_bubble", stages_per_rank=2, microbatches=4)
    with pytest.raises(MisconfigurationError, match="last training batch .* holds 6 samples"):
        zero_bubble_v.prepare_loader(DataLoader(dataset(30), batch_size=8), train=True, seed=0)


def test_v_shaped_schedules_refuse_forward_only_runs():
    strategy = configured(schedule="zbv_zero_bubble", stages_per_rank=2)
    with pytest.raises(MisconfigurationError, match="cannot run forward-only.*limit_val_batches=0"):
        strategy.eval_step("validation_step", (torch.zeros(4, 4),), 0)


@pytest.mark.timeout(150)
def test_fit_from_the_caller_starts_the_stages_and_returns_the_trained_model(tmp_path):
    """No launcher around pytest: the Trainer starts both stage processes itself and `module` ends
    up holding the whole trained model."""
    module = fresh()
    trainer = Trainer(strategy="pipeline", devices=2, max_epochs=2, enable_checkpointing=False, **QUIET)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    reference = reference_fit(fresh(), epochs=2)
    assert_same_weights(module.state_dict(), reference["state"])
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(reference["losses"][-1], abs=1e-5)


# --------------------------------------------------------------------------- what a pipeline fit does not call


class LogsInItsSteps(ChainNet):
    """A module written for one device: it logs val_mse in validation_step, which a pipeline fit never calls."""

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", F.cross_entropy(self(batch[0]), batch[1]))


def test_a_pipeline_fit_warns_once_at_its_start_which_steps_it_does_not_call(monkeypatch):
    started = []  # in this process: the launch that would start the stages is recorded, and nothing starts
    monkeypatch.setattr("torchyard.trainer.launch.warm_start.start_early", lambda: None)
    monkeypatch.setattr("torchyard.trainer.launch.elastic.launch", lambda *a: started.append(a) or {"result": None})
    monkeypatch.setattr("torchyard.trainer.launch.elastic.adopt", lambda *args: None)
    trainer = Trainer(strategy="pipeline", devices=2, enable_checkpointing=False, **QUIET)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(LogsInItsSteps(), DataLoader(dataset(), batch_size=BATCH))
    assert [str(w.message) for w in caught] == [
        "strategy='pipeline' does not call LogsInItsSteps.training_step or validation_step: the stages run "
        "pipeline_input(batch) forward, and the last stage's pipeline_loss(output, batch) is the loss, logged as "
        "train/loss (val/loss in validation). Define pipeline_loss, and pipeline_validation_step(output, batch, "
        "batch_idx) to log values of your own in validation (it runs on the last stage)."
    ]
    assert len(started) == 1  # a warning, not an error: the stages would start

    class PipelineOnly(SequentialNet):  # pipeline_loss and pipeline_validation_step: nothing left uncalled
        training_step = TrainModule.training_step

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(PipelineOnly(), DataLoader(dataset(), batch_size=BATCH))
    assert configured().missing_metric_hint(PipelineOnly()) == ""
    assert configured().missing_metric_hint(SequentialNet()) == (
        " strategy='pipeline' does not call SequentialNet.training_step, so what it logs is not logged: the fit logs "
        "train/loss and val/loss from pipeline_loss. Log the value in pipeline_validation_step(output, batch, "
        "batch_idx), which runs on the last stage.")


@pytest.mark.timeout(150)
def test_a_monitor_that_a_pipeline_fit_never_logs_is_refused_saying_why(tmp_path):
    monitor = ModelCheckpoint(monitor="val_mse")
    trainer = Trainer(strategy="pipeline", devices=2, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                      num_sanity_val_steps=0, callbacks=[monitor], default_root_dir=str(tmp_path),
                      **{**QUIET, "logger": False})
    with pytest.raises(MisconfigurationError) as caught, pytest.warns(UserWarning, match="does not call"):
        trainer.fit(LogsInItsSteps(), DataLoader(dataset(), batch_size=BATCH), DataLoader(dataset(), batch_size=12))
    assert re.fullmatch(re.escape(
        "ModelCheckpoint(monitor='val_mse') found no such logged metric; logged: ['train/loss', 'val/loss']. "
        "Log it with self.log('val_mse', value) or fix the name. strategy='pipeline' does not call "
        "LogsInItsSteps.training_step or validation_step, so what they log is not logged: the fit logs train/loss "
        "and val/loss from pipeline_loss. Log the value in pipeline_validation_step(output, batch, batch_idx), "
        "which runs on the last stage. (raised on rank ") + r"[01]\)", str(caught.value)), str(caught.value)
