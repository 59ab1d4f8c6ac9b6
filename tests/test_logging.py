"""self.log: epoch values are whole-epoch values (Metrics computed over the epoch, tensor means weighted by
batch size), on_step/on_epoch naming, and what the CSV logger writes."""

from __future__ import annotations

import csv
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from torchyard.callbacks import Callback
from torchyard.trainer import DataModule, Trainer, TrainModule
from torchyard.trainer.errors import MisconfigurationError

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")


def classification_data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator)
    return TensorDataset(x, torch.randint(0, 3, (samples,), generator=generator))


class Classifier(TrainModule):
    def __init__(self, hidden: int = 8, note: str = "plain text") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))
        self.train_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.seen: list[tuple[int, float, int, int]] = []  # (epoch, loss, correct, batch size) per train batch

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.seen.append((self.current_epoch, loss.item(), int((logits.argmax(1) == y).sum()), len(y)))
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("plain", loss)  # training_step default: on_step only
        self.log("seen", float(len(y)), reduce_fx="sum", on_step=False, on_epoch=True)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)
        self.log("val_loss", F.cross_entropy(logits, y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.fixture(scope="module")
def datasets():
    return classification_data(20, seed=1), classification_data(22, seed=2)  # batches of 8: 8, 8, 4 and 8, 8, 6


def fit_classifier(datasets, **options) -> tuple[Classifier, Trainer]:
    train, val = datasets
    torch.manual_seed(0)
    module = Classifier()
    trainer = Trainer(**{"max_epochs": 2, **QUIET, **options})
    trainer.fit(module, DataLoader(train, batch_size=8), DataLoader(val, batch_size=8))
    return module, trainer


def test_validation_metric_is_computed_over_the_whole_set(datasets):
    module, trainer = fit_classifier(datasets, logger=False)
    _, val = datasets
    x, y = val.tensors
    with torch.no_grad():
        logits = module(x)
    accuracy = (logits.argmax(1) == y).float().mean()
    batch_accuracies = torch.stack([(logits[i:i + 8].argmax(1) == y[i:i + 8]).float().mean() for i in (0, 8, 16)])
    assert not torch.isclose(batch_accuracies.mean(), accuracy)  # the uneven last batch makes them differ
    torch.testing.assert_close(trainer.callback_metrics["val_acc"], accuracy)
    # Tensor values: the mean weighted by batch size, i.e. the loss over the whole set.
    batch_losses = torch.stack([F.cross_entropy(logits[i:i + 8], y[i:i + 8]) for i in (0, 8, 16)])
    assert not torch.isclose(batch_losses.mean(), F.cross_entropy(logits, y))
    torch.testing.assert_close(trainer.callback_metrics["val_loss"], F.cross_entropy(logits, y))

    results = trainer.validate(module, DataLoader(val, batch_size=8))
    assert results[0].keys() == {"val_acc", "val_loss"}
    assert results[0]["val_acc"] == pytest.approx(float(accuracy))
    assert results[0]["val_loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-6)


# 1: a validation after every training batch, which must leave the training epoch's running values alone.
@pytest.mark.parametrize("val_check_interval", [1.0, 1])
def test_train_epoch_values_and_names(datasets, val_check_interval):
    module, trainer = fit_classifier(datasets, logger=False, val_check_interval=val_check_interval)
    last_epoch = [row for row in module.seen if row[0] == 1]
    assert [row[3] for row in last_epoch] == [8, 8, 4]
    weighted = sum(loss * size for _, loss, _, size in last_epoch) / 20
    metrics = trainer.callback_metrics
    assert float(metrics["train_loss_epoch"]) == pytest.approx(weighted, rel=1e-6)
    assert float(metrics["train_loss"]) == float(metrics["train_loss_epoch"])
    assert float(metrics["train_loss_step"]) == pytest.approx(last_epoch[-1][1], rel=1e-6)
    assert float(metrics["train_acc_epoch"]) == pytest.approx(sum(row[2] for row in last_epoch) / 20)
    assert float(metrics["train_acc_step"]) == pytest.approx(last_epoch[-1][2] / 4)
    assert float(metrics["seen"]) == 20.0  # reduce_fx="sum" over the epoch
    assert "plain_step" not in metrics and "plain_epoch" not in metrics and "plain" in metrics


def read_csv(path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_csv_rows_columns_and_hparams(datasets):
    module, trainer = fit_classifier(datasets, log_every_n_steps=2)
    folder = Path(trainer.log_dir)
    assert folder.name == "version_0"
    columns, rows = read_csv(folder / "metrics.csv")
    assert set(columns) == {"step", "epoch", "train_loss_step", "plain", "train_acc_step", "val_acc", "val_loss",
                            "train_loss_epoch", "train_acc_epoch", "seen"}

    def steps_with(column):
        return [(int(row["step"]), int(float(row["epoch"]))) for row in rows if row[column] != ""]

    # 3 optimizer steps per epoch; step rows every 2 steps; the sanity check writes nothing.
    assert steps_with("train_loss_step") == [(2, 0), (4, 1), (6, 1)]
    assert steps_with("val_loss") == [(3, 0), (6, 1)]
    assert steps_with("train_loss_epoch") == [(3, 0), (6, 1)]
    losses = [loss for _, loss, _, _ in module.seen]
    assert [float(row["train_loss_step"]) for row in rows if row["train_loss_step"]] == [
        pytest.approx(losses[i], rel=1e-6) for i in (1, 3, 5)
    ]
    assert OmegaConf.to_container(OmegaConf.load(folder / "hparams.yaml")) == {"hidden": 8, "note": "plain text"}


class Configured(Classifier):
    def __init__(self, hidden: int = 8, settings: dict | None = None) -> None:
        super().__init__(hidden)
        self.save_hyperparameters()


class Loaders(DataModule):
    def __init__(self, train: TensorDataset, batch_size: int = 8, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters(ignore="train")
        self.train = train

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size)


def test_hparams_yaml_holds_the_datamodules_too_and_values_yaml_cannot_hold_as_their_repr(datasets, tmp_path):
    train, _ = datasets
    settings = {"dtype": torch.bfloat16, "layers": [nn.ReLU(), 2]}
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), log_every_n_steps=1, **QUIET)
    trainer.fit(Configured(settings=settings), datamodule=Loaders(train, batch_size=4))
    assert OmegaConf.to_container(OmegaConf.load(Path(trainer.log_dir) / "hparams.yaml")) == {
        "hidden": 8, "note": "plain text", "settings": {"dtype": "torch.bfloat16", "layers": ["ReLU()", 2]},
        "batch_size": 4}
    with pytest.raises(
        MisconfigurationError, match=r"the hparams \['hidden'\] are saved by both Configured and Loaders"
    ):
        Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET).fit(
            Configured(), datamodule=Loaders(train, hidden=3)
        )


def test_a_resumed_fit_keeps_the_rows_of_a_validation_run_after_its_checkpoint(datasets, tmp_path):
    train, val = datasets
    options = dict(**QUIET, default_root_dir=str(tmp_path), log_every_n_steps=2)
    options["enable_checkpointing"] = True
    trainer = Trainer(max_epochs=1, **options)
    trainer.fit(Classifier(), DataLoader(train, batch_size=8), DataLoader(val, batch_size=8))
    trainer.validate(trainer.module, DataLoader(val, batch_size=8))  # after the fit's last checkpoint, at its step
    metrics = Path(trainer.log_dir) / "metrics.csv"
    before = read_csv(metrics)[1]
    assert [row["step"] for row in before if row["val_loss"]] == ["3", "3"]
    Trainer(max_epochs=2, **options).fit(Classifier(), DataLoader(train, batch_size=8), DataLoader(val, batch_size=8),
                                         ckpt_path="last")
    after = read_csv(metrics)[1]
    assert after[:len(before)] == before
    assert [row["step"] for row in after if row["val_loss"]] == ["3", "3", "6"]


@pytest.mark.parametrize("logger", [True, False])
def test_a_checkpoint_of_another_run_starts_a_new_run_folder_and_leaves_the_others_alone(datasets, tmp_path, logger):
    train, val = datasets
    loaders = DataLoader(train, batch_size=8), DataLoader(val, batch_size=8)
    options = {**QUIET, "default_root_dir": str(tmp_path), "enable_checkpointing": True, "logger": logger,
               "log_every_n_steps": 1}
    other = Trainer(name="a", max_epochs=1, **options)
    other.fit(Classifier(), *loaders)
    ours = Trainer(name="b", max_epochs=2, **options)
    ours.fit(Classifier(), *loaders)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()}
    again = Trainer(name="b", max_epochs=2, **options)
    with pytest.warns(UserWarning, match="the checkpoint folder changed"):  # a's top-k files are not b's
        again.fit(Classifier(), *loaders, ckpt_path=other.checkpoint_callback.last_model_path)
    assert Path(again.log_dir) == tmp_path / "b" / "version_1"  # as in Lightning: a new run, from a's weights
    assert again.global_step == 6  # a's epoch, then one more
    assert {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "b" / "version_0").rglob("*")
            if p.is_file()} == before
    # The same run's checkpoint still continues in its own folder.
    resumed = Trainer(name="b", max_epochs=3, **options)
    resumed.fit(Classifier(), *loaders, ckpt_path=again.checkpoint_callback.last_model_path)
    assert Path(resumed.log_dir) == Path(again.log_dir)
    # So does a checkpoint written before checkpoints recorded their run's folder.
    old_style = torch.load(resumed.checkpoint_callback.last_model_path, weights_only=True)
    del old_style["loops"]["folder"]
    for state in old_style["loggers"]:
        del state["folder"]
    torch.save(old_style, tmp_path / "old_style.ckpt")
    older = Trainer(name="b", max_epochs=4, **options)
    older.fit(Classifier(), *loaders, ckpt_path=tmp_path / "old_style.ckpt")
    assert Path(older.log_dir) == Path(again.log_dir)


def test_a_logger_version_given_as_a_string_is_the_folders_name(datasets, tmp_path):
    from torchyard.trainer.loggers import CSVLogger

    train, _ = datasets
    trainer = Trainer(max_epochs=1, logger=CSVLogger(tmp_path, name="x", version="baseline"), log_every_n_steps=1,
                      **QUIET)
    trainer.fit(Classifier(), DataLoader(train, batch_size=8))
    assert (tmp_path / "x" / "baseline" / "metrics.csv").is_file()


def test_a_loggers_prefix_goes_before_every_metric_name(datasets, tmp_path):
    from torchyard.trainer.loggers import CSVLogger

    train, val = datasets
    plain, prefixed = CSVLogger(tmp_path, name="plain"), CSVLogger(tmp_path, name="prefixed", prefix="exp")
    for logger in (plain, prefixed):
        trainer = Trainer(max_epochs=1, logger=logger, log_every_n_steps=1, **QUIET)
        trainer.fit(Classifier(), DataLoader(train, batch_size=8), DataLoader(val, batch_size=8))
    with open(plain.metrics_path) as f:
        names = next(csv.reader(f))
    with open(prefixed.metrics_path) as f:
        assert next(csv.reader(f)) == ["step"] + [f"exp-{name}" for name in names[1:]]
    assert len(names) > 2

    # A resume reads the rows back and rewrites them: the prefixed epoch column stays whole numbers.
    resumed = CSVLogger(tmp_path, name="prefixed", prefix="exp")
    resumed.load_state_dict(prefixed.state_dict())
    resumed.log_metrics({"epoch": 1, "loss": 0.5}, step=99)
    resumed.save()
    with open(prefixed.metrics_path) as f:
        epochs = [row["exp-epoch"] for row in csv.DictReader(f) if row["exp-epoch"]]
    assert epochs and all(epoch in ("0", "1") for epoch in epochs), epochs


def test_second_run_gets_next_version_folder(datasets):
    _, first = fit_classifier(datasets, max_epochs=1, log_every_n_steps=1)
    _, second = fit_classifier(datasets, max_epochs=1, log_every_n_steps=1)
    assert (Path(first.log_dir).name, Path(second.log_dir).name) == ("version_0", "version_1")
    assert (Path(second.log_dir) / "metrics.csv").is_file()


class ExplicitBatchSize(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        # Weights 1, 3: the epoch mean is (10 * 1 + 20 * 3) / 4, not (10 + 20) / 2.
        self.log("weighted", 10.0 * (batch_idx + 1), batch_size=2 * batch_idx + 1)
        self.log("largest", 10.0 * (batch_idx + 1), reduce_fx="max")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_explicit_batch_size_weights_the_mean():
    data = DataLoader(TensorDataset(torch.ones(4, 1)), batch_size=2)
    results = Trainer(logger=False, **QUIET).validate(ExplicitBatchSize(), data)
    assert results == [{"weighted": pytest.approx(17.5), "largest": 20.0}]


class EpochValues(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_train_epoch_end(self, trainer, module):
        self.seen.append((trainer.current_epoch, float(trainer.callback_metrics["seen"])))


@pytest.mark.filterwarnings("error:ModelCheckpoint. the checkpoint folder changed")  # resumed in the same folder
def test_a_run_stopped_mid_epoch_by_max_steps_resumes_with_the_epochs_running_values(datasets, tmp_path):
    train, _ = datasets  # 20 samples: batches of 8, 8, 4
    options = dict(**QUIET, logger=False, default_root_dir=str(tmp_path))
    options["enable_checkpointing"] = True
    first = EpochValues()
    Trainer(max_steps=2, callbacks=[first], **options).fit(Classifier(), DataLoader(train, batch_size=8))
    resumed = EpochValues()
    Trainer(max_steps=6, callbacks=[resumed], **options).fit(
        Classifier(), DataLoader(train, batch_size=8), ckpt_path="last"
    )
    assert first.seen == [(0, 16.0)]  # what the stopped run had seen of epoch 0
    assert resumed.seen == [(0, 20.0), (1, 20.0)]  # epoch 0 whole, as if never stopped
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["version_0"]  # no logger, same run folder


# -------------------------------------------------------------------------- Lightning's logging semantics, hook by hook


class Probe(TrainModule):
    """A linear model whose hooks log what each test needs; `hooks` maps a hook name to a function(module, ...)."""

    def __init__(self, hooks=None, plateau=False) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.hooks, self.plateau = hooks or {}, plateau

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        if "training_step" in self.hooks:
            self.hooks["training_step"](self, batch_idx, loss)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        if "validation_step" in self.hooks:
            self.hooks["validation_step"](self, batch, batch_idx, dataloader_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if "on_train_batch_end" in self.hooks:
            self.hooks["on_train_batch_end"](self, batch_idx)

    def on_train_epoch_start(self):
        if "on_train_epoch_start" in self.hooks:
            self.hooks["on_train_epoch_start"](self)

    def on_train_epoch_end(self):
        if "on_train_epoch_end" in self.hooks:
            self.hooks["on_train_epoch_end"](self)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.plateau:
            return optimizer
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "epoch_score"}}


def probe_fit(tmp_path, module, train, val=None, **options):
    trainer = Trainer(
        **{"max_epochs": 2, **QUIET, "default_root_dir": str(tmp_path), "log_every_n_steps": 1, **options}
    )
    trainer.fit(module, DataLoader(train, batch_size=8), DataLoader(val, batch_size=8) if val is not None else None)
    return trainer, read_csv(Path(trainer.log_dir) / "metrics.csv")[1]


def test_monitors_see_logger_false_values_and_the_plain_name_of_step_and_epoch_values(datasets, tmp_path):
    from torchyard.callbacks import EarlyStopping, ModelCheckpoint

    seen = []

    class Look(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(sorted(trainer.callback_metrics))

    def log(module, batch_idx, loss):
        module.log("quiet", loss, logger=False)
        module.log("both", loss, on_step=True, on_epoch=True)

    stopping, every_step = EarlyStopping("quiet", patience=5), ModelCheckpoint(monitor="both", every_n_train_steps=1,
                                                                               save_top_k=1, dirpath=tmp_path / "ckpts")
    trainer, rows = probe_fit(
        tmp_path,
        Probe({"training_step": log}),
        *datasets,
        callbacks=[Look(), stopping, every_step],
        enable_checkpointing=True,
    )
    assert seen[0] == ["both", "both_step", "quiet"]  # as Lightning: the step value also under its plain name
    assert stopping.best_score is not None and every_step.best_model_path  # both could monitor
    assert all("quiet" not in row or row["quiet"] == "" for row in rows)  # logger=False stays out of the file


def test_values_logged_in_on_train_batch_end_are_written_with_their_step(datasets, tmp_path):
    class FromCallback(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            module.log("from_callback", float(trainer.global_step))

    def hook(module, batch_idx):
        module.log("from_module", float(module.global_step))

    _, rows = probe_fit(tmp_path, Probe({"on_train_batch_end": hook}), datasets[0], callbacks=[FromCallback()])
    step_rows = [row for row in rows if row.get("from_module")]
    assert [(row["step"], float(row["from_module"]), float(row["from_callback"])) for row in step_rows] == [
        (str(s), float(s), float(s)) for s in range(1, 7)]


def test_a_checkpoint_saved_in_on_train_batch_end_counts_its_steps_row_and_keeps_later_values(datasets, tmp_path):
    from torchyard.callbacks import ModelCheckpoint

    def loss(module, batch_idx, value):
        module.log("loss", value)

    def hook(module, batch_idx):  # the module's hook runs after the callbacks', so after the checkpoint
        module.log("from_module", float(module.global_step))

    every_step = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, filename="{step}", dirpath=tmp_path / "ckpts")
    _, rows = probe_fit(tmp_path, Probe({"training_step": loss, "on_train_batch_end": hook}), datasets[0],
                        callbacks=[every_step], enable_checkpointing=True)
    for step in range(1, 7):  # both of the step's values are in the file, at that step
        at_step = [row for row in rows if row["step"] == str(step)]
        assert any(row.get("loss") for row in at_step) and any(row.get("from_module") == f"{step}.0" for row in at_step)
    saved = torch.load(tmp_path / "ckpts" / "step=3.ckpt", weights_only=True)["loggers"][0]["rows"]
    assert rows[saved - 1]["step"] == "3" and rows[saved - 1]["loss"]  # the checkpoint counts step 3's loss row


def test_evaluation_step_values_are_written_per_batch_and_epoch_start_values_per_epoch(datasets, tmp_path):
    def per_batch(module, batch, batch_idx, dataloader_idx):
        module.log("val_batch", float(batch_idx), on_step=True, on_epoch=False)

    def at_epoch_start(module):
        module.log("epoch_start", float(module.current_epoch + 10))  # Lightning's default here: on_epoch

    trainer, rows = probe_fit(tmp_path, Probe({"validation_step": per_batch, "on_train_epoch_start": at_epoch_start}),
                              *datasets)
    assert [(row["step"], row["val_batch"]) for row in rows if row.get("val_batch")] == [
        ("3", "0.0"), ("3", "1.0"), ("3", "2.0"), ("6", "0.0"), ("6", "1.0"), ("6", "2.0")]  # the sanity check's: none
    assert all(not row.get("val_batch") for row in rows if row.get("train_loss") or row.get("epoch_start"))
    assert [(row["step"], row["epoch_start"]) for row in rows if row.get("epoch_start")] == [
        ("3", "10.0"),
        ("6", "11.0"),
    ]
    assert "val_batch" not in trainer.callback_metrics  # evaluation step values are written, never monitored
    # logged_metrics holds what was logged, last values; the epoch column is added for the loggers only
    assert trainer.logged_metrics["epoch_start"] == 11.0 and "epoch" not in trainer.logged_metrics


@pytest.mark.parametrize("hook, options", [("on_train_epoch_end", dict(on_step=True)),
                                           ("on_train_epoch_start", dict(on_epoch=False))])
def test_step_values_logged_in_a_once_per_epoch_hook_are_refused_with_the_options_to_use(
    datasets, tmp_path, hook, options
):
    def log(module):
        module.log("value", 1.0, **options)

    with pytest.raises(
        MisconfigurationError,
        match=r"self.log\('value', on_step=(True|False), on_epoch=(True|False)\) in a hook "
        r"that runs once per epoch.*use on_step=False, on_epoch=True",
    ):
        probe_fit(tmp_path, Probe({hook: log}), *datasets)


def test_an_epoch_end_writes_one_row_with_the_epoch_values_and_what_on_train_epoch_end_logs(datasets, tmp_path):
    def per_epoch(module, batch_idx, loss):
        module.log("train_mean", float(batch_idx), on_step=False, on_epoch=True, batch_size=1)

    def at_epoch_end(module):
        module.log("end_value", float(module.current_epoch))

    _, rows = probe_fit(tmp_path, Probe({"training_step": per_epoch, "on_train_epoch_end": at_epoch_end}), datasets[0])
    epoch_rows = [(row["step"], row["epoch"], row["train_mean"], row["end_value"]) for row in rows
                  if row.get("train_mean") or row.get("end_value")]
    assert epoch_rows == [("3", "0", "1.0", "0.0"), ("6", "1", "1.0", "1.0")]  # batch_idx 0, 1, 2: mean 1


def test_progress_bar_metrics_are_floats_named_as_in_lightning(datasets, tmp_path):
    def log(module, batch_idx, loss):
        module.log("both", float(batch_idx), on_step=True, on_epoch=True, prog_bar=True, batch_size=1)
        module.log("plain", 2.0, prog_bar=True)

    trainer, _ = probe_fit(tmp_path, Probe({"training_step": log}), datasets[0], max_epochs=1)
    assert trainer.progress_bar_metrics == {"both_step": 2.0, "plain": 2.0, "both_epoch": 1.0}
    assert all(type(value) is float for value in trainer.progress_bar_metrics.values())


def test_sync_dist_reduces_training_step_values_but_leaves_evaluation_step_values_to_their_rank():
    """Evaluation ranks may run one batch more or fewer than each other: a per-batch reduction there could
    wait forever for a rank that has finished, so it is taken per epoch only."""
    from torchyard.trainer.logs.metrics import MetricCollector

    reduced = []
    metrics = MetricCollector(lambda tensor, op: reduced.append(op) or tensor * 2)
    metrics.log("train_value", torch.tensor(1.0), sync_dist=True)
    metrics.stage = "validation"
    metrics.log("val_value", torch.tensor(1.0), on_step=True, on_epoch=True, sync_dist=True, batch_size=1)
    for_logger, _ = metrics.take_eval_step_values()
    assert metrics.rows.step_values == {"train_value": torch.tensor(2.0)} and reduced == ["mean"]
    assert for_logger == {"val_value_step": torch.tensor(1.0)}
    assert metrics.epoch_values()[0] == {"val_value_epoch": torch.tensor(1.0)}
    assert reduced == ["mean", "sum"]  # the epoch value is reduced: (total, weight) summed over the ranks


def test_half_precision_values_average_in_float32_and_batch_sizes_skip_strings(tmp_path):
    class Half(TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(1, 1)

        def validation_step(self, batch, batch_idx):
            self.log("bf16", torch.tensor(1.0, dtype=torch.bfloat16))
            self.log("fp16", torch.tensor(100.0, dtype=torch.float16))
            self.log("numpy", np.float32(1.5))
            self.log("x_mean", batch["x"].mean())  # weighted by the batch's size, 4, 4 and 2: not by the strings

    samples = [{"text": f"sample {i}", "x": torch.tensor([float(i)])} for i in range(10)]
    for _ in range(49):
        samples += samples[:10]
    [result] = Trainer(**QUIET, logger=False).validate(Half(), DataLoader(samples[:10], batch_size=4))
    assert result == {"bf16": 1.0, "fp16": 100.0, "numpy": 1.5, "x_mean": pytest.approx(4.5)}
    [long] = Trainer(**QUIET, logger=False).validate(Half(), DataLoader(samples, batch_size=1))  # 500 batches
    assert (long["bf16"], long["fp16"]) == (1.0, 100.0)  # bf16 sums stall at 256, fp16 sums overflow


def test_a_fit_too_short_for_its_logging_interval_says_so(datasets, tmp_path):
    def fit(**options):
        Trainer(**{**QUIET, "max_epochs": 2, "default_root_dir": str(tmp_path), **options}).fit(
            Probe({}), DataLoader(datasets[0], batch_size=8))

    with pytest.warns(UserWarning, match=r"this fit takes 6 optimizer steps, fewer than log_every_n_steps=50, so its "
                                         r"loggers get only its last step's per-step values, and its epoch values"):
        fit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(log_every_n_steps=3)
        fit(logger=False)


def test_a_torchrun_jobs_folder_is_the_one_its_run_id_marked_last(tmp_path):
    from torchyard.trainer.logs.runs import RUN_ID_FILE, version_of_job

    for version, when in (("version_0", 1_000), ("version_1", 2_000), ("version_2", 3_000)):
        (tmp_path / "exp" / version).mkdir(parents=True)
        marker = tmp_path / "exp" / version / RUN_ID_FILE
        marker.write_text("reused-id" if version != "version_2" else "other-id")
        os.utime(marker, ns=(when * 10**9,) * 2)
    assert version_of_job(tmp_path, "exp", "reused-id") == 1  # the newer of the two jobs that reused the id
    assert version_of_job(tmp_path, "exp", "other-id") == 2 and version_of_job(tmp_path, "exp", "unseen") is None


def test_half_precision_step_values_are_float32_as_in_lightning():
    from torchyard.trainer.logs.metrics import MetricCollector

    metrics = MetricCollector(lambda tensor, op: tensor)
    metrics.log("loss", torch.tensor(0.5, dtype=torch.bfloat16, requires_grad=True) * 1, prog_bar=True, on_epoch=True)
    metrics.log("fp16", torch.tensor(2.0, dtype=torch.float16))
    shown = metrics.rows.callback_metrics
    assert {name: value.dtype for name, value in {**metrics.rows.step_values, **shown}.items()} == {
        "loss_step": torch.float32, "loss": torch.float32, "fp16": torch.float32}
    assert float(shown["loss"]) == 0.5 and metrics.rows.bar_values["loss_step"].dtype == torch.float32


def test_several_loaders_name_step_and_epoch_values_as_lightning_does(datasets):
    def both(module, batch, batch_idx, dataloader_idx):
        module.log("vl", float(dataloader_idx * 10 + 1), on_step=True, on_epoch=True)

    train, val = datasets
    results = Trainer(**QUIET, logger=False).validate(Probe({"validation_step": both}),
                                                     [DataLoader(val, batch_size=8), DataLoader(train, batch_size=8)])
    assert results == [{"vl_epoch/dataloader_idx_0": 1.0}, {"vl_epoch/dataloader_idx_1": 11.0}]

    def own_names(module, batch, batch_idx, dataloader_idx):  # Lightning's add_dataloader_idx=False
        module.log(f"vl{dataloader_idx}", float(dataloader_idx * 10 + 1), add_dataloader_idx=False, rank_zero_only=True)

    results = Trainer(**QUIET, logger=False).validate(Probe({"validation_step": own_names}),
                                                     [DataLoader(val, batch_size=8), DataLoader(train, batch_size=8)])
    assert results == [{"vl0": 1.0, "vl1": 11.0}] * 2  # no suffix, so neither name says which loader it is


def test_plateau_schedulers_see_what_on_train_epoch_end_logged(datasets, tmp_path):
    scores = iter([1.0, 2.0, 3.0])

    def log_score(module):
        module.log("epoch_score", next(scores))  # worse every epoch: patience 0 cuts the rate after each but the first

    trainer, _ = probe_fit(tmp_path, Probe({"on_train_epoch_end": log_score}, plateau=True), datasets[0], max_epochs=3)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**2)


def test_a_metric_logged_per_step_restarts_each_epoch_after_the_epoch_end_hooks(datasets, tmp_path):
    from torchmetrics.aggregation import SumMetric

    computed = []

    def count(module, batch_idx, loss):
        module.counter(1.0)
        module.log("count", module.counter)  # on_step only

    def read(module):
        computed.append(float(module.counter.compute()))

    module = Probe({"training_step": count, "on_train_epoch_end": read})
    module.counter = SumMetric()
    probe_fit(tmp_path, module, datasets[0], max_epochs=3)
    assert computed == [3.0, 3.0, 3.0]  # 3 batches an epoch; readable in on_train_epoch_end, reset after it


def test_each_stage_reports_only_its_own_values(datasets, tmp_path):
    def log(module, batch_idx, loss):
        module.log("train_only", loss)

    train, val = datasets
    trainer, _ = probe_fit(tmp_path, Probe({"training_step": log,
                                            "validation_step": lambda m, b, i, d: m.log("val_value", 1.0)}), train, val)
    assert {"train_only", "val_value"} <= set(trainer.callback_metrics)
    trainer.validate(dataloaders=DataLoader(val, batch_size=8), verbose=False)
    assert set(trainer.callback_metrics) == {"val_value"}


def readme_quickstart() -> dict:
    """The names README.md's quickstart.py defines (Net, Data), as a user importing it gets them."""
    from test_docs import REPO, read_blocks

    block = next(block for block in read_blocks(REPO / "README.md") if block.file_name == "quickstart.py")
    names: dict = {"__name__": "quickstart"}
    exec(compile(block.code, "quickstart.py", "exec"), names)
    return names


def test_the_readme_quickstart_writes_its_metrics_though_shorter_than_log_every_n_steps(tmp_path):
    quickstart = readme_quickstart()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="fewer than log_every_n_steps=50") as record:
        quickstart["Trainer"](max_epochs=3).fit(quickstart["Net"](), datamodule=quickstart["Data"]())
    shown = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in record]
    assert not [line for line in shown if "trainer/" in line or ".py:" in line]  # no framework file and line
    columns, rows = read_csv(tmp_path / "runs" / "default" / "version_0" / "metrics.csv")
    # 256 samples in batches of 32: 8 steps an epoch, 24 in all; the last one's loss, in the last epoch.
    assert [(row["step"], row["epoch"]) for row in rows] == [("24", "2")] and 0 < float(rows[0]["train/loss"]) < 5


def test_a_short_fit_writes_every_epoch_value_and_its_last_step(datasets, tmp_path):
    with pytest.warns(UserWarning, match="fewer than log_every_n_steps=50, so its loggers get only its last step's"):
        module, trainer = fit_classifier(datasets, logger=True, default_root_dir=str(tmp_path))
    _, rows = read_csv(Path(trainer.log_dir) / "metrics.csv")
    epoch_rows = [row for row in rows if row.get("train_loss_epoch")]
    assert [row["epoch"] for row in epoch_rows] == ["0", "1"]
    assert [row["epoch"] for row in rows if row.get("val_acc")] == ["0", "1"]
    step_rows = [row for row in rows if row.get("plain")]
    last_loss = module.seen[-1][1]  # batches of 8, 8, 4: the last step is the sixth, in epoch 1
    assert [(row["step"], row["epoch"]) for row in step_rows] == [("6", "1")]
    assert float(step_rows[0]["plain"]) == pytest.approx(last_loss, rel=1e-5)


class EvaluatedClassifier(Classifier):
    test_step = Classifier.validation_step


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_an_evaluation_of_a_runs_checkpoint_logs_into_that_run(datasets, tmp_path, capsys, stage):
    train, val = datasets
    options = {**QUIET, "max_epochs": 2, "logger": True, "enable_checkpointing": True, "default_root_dir": ".",
               "log_every_n_steps": 1}
    fitted = Trainer(**options)
    fitted.fit(EvaluatedClassifier(), DataLoader(train, batch_size=8), DataLoader(val, batch_size=8))
    run = tmp_path / "default" / "version_0"
    before = {name: (run / name).read_text() for name in ("metrics.csv", "hparams.yaml")}
    checkpoint = next(path for path in (run / "checkpoints").glob("*.ckpt") if not path.name.startswith("last"))
    capsys.readouterr()
    for ckpt_path in (str(checkpoint), "last"):
        evaluator = Trainer(**options)
        module = EvaluatedClassifier(hidden=8, note="other")
        [results] = getattr(evaluator, stage)(module, DataLoader(val, batch_size=8), ckpt_path=ckpt_path, verbose=False)
        assert Path(evaluator.log_dir) == Path("default/version_0")
        assert capsys.readouterr().err.count(f"trainer: {stage} loads default/version_0/checkpoints/") == 1
    # Each evaluation's rows in the stage's file of the run; the run's own files as it wrote them.
    _, rows = read_csv(run / f"metrics_{stage}.csv")
    assert [float(row["val_acc"]) for row in rows] == [pytest.approx(results["val_acc"])] * 2
    assert {name: (run / name).read_text() for name in before} == before
    assert sorted(path.name for path in tmp_path.glob("default/*")) == ["version_0"]
    # A fresh module, no checkpoint: a run of its own, as before.
    fresh = Trainer(**options)
    getattr(fresh, stage)(EvaluatedClassifier(), DataLoader(val, batch_size=8), verbose=False)
    assert Path(fresh.log_dir) == Path("default/version_1") and (Path(fresh.log_dir) / "metrics.csv").is_file()
