"""Code from Lightning's documentation pages (docs/source-pytorch: starter, common/*, model/*, data/*,
extensions/*) ported by import swap, each snippet completed into the smallest run that shows its outcome."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from port_data import QUIET, fake_mnist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from torchyard.callbacks import (
    Callback,
    EarlyStopping,
    EarlyStoppingReason,
    GradientAccumulationScheduler,
    ModelCheckpoint,
    TQDMProgressBar,
)
from torchyard.trainer import DataModule as LightningDataModule
from torchyard.trainer import Trainer, seed_everything
from torchyard.trainer import TrainModule as LightningModule
from torchyard.trainer.data.combined import CombinedLoader  # lightning.pytorch.utilities.CombinedLoader
from torchyard.trainer.loggers import CSVLogger  # lightning.pytorch.loggers
from torchyard.trainer.strategies.ddp import DDPStrategy

# --------------------------------------------------------------------------- starter/introduction.rst


class LitAutoEncoder(LightningModule):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def test_starter_introduction(tmp_path):
    seed_everything(0)
    encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))
    decoder = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))
    autoencoder = LitAutoEncoder(encoder, decoder)
    train_loader = DataLoader(fake_mnist(), batch_size=8)
    trainer = Trainer(limit_train_batches=100, max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(model=autoencoder, train_dataloaders=train_loader)
    checkpoint = Path(trainer.log_dir) / "checkpoints" / "epoch=0-step=8.ckpt"
    autoencoder = LitAutoEncoder.load_from_checkpoint(checkpoint, encoder=encoder, decoder=decoder)
    encoder = autoencoder.encoder
    encoder.eval()
    fake_image_batch = torch.rand(4, 28 * 28, device=autoencoder.device)
    embeddings = encoder(fake_image_batch)
    assert embeddings.shape == (4, 3)


# --------------------------------------------------------------------------- data/iterables.rst


class Summing(LightningModule):
    """Its training_step reads whatever batch structure the loaders make."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.batches = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch)
        return self.weight.sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_data_iterables():
    model = Summing()
    Trainer(max_epochs=1, **QUIET, logger=False, enable_checkpointing=False).fit(model, list(range(5)))
    assert model.batches == [0, 1, 2, 3, 4]  # `return list(range(1000))`: a list is a loader of its items

    model = Summing()
    loaders = {"a": DataLoader(torch.arange(4), batch_size=2), "b": DataLoader(torch.arange(10, 16), batch_size=2)}
    Trainer(max_epochs=1, **QUIET, logger=False, enable_checkpointing=False).fit(model, loaders)
    assert [{k: v.tolist() for k, v in b.items()} for b in model.batches] == [
        {"a": [0, 1], "b": [10, 11]}, {"a": [2, 3], "b": [12, 13]}, {"a": [0, 1], "b": [14, 15]}]

    model = Summing()
    combined_loader = CombinedLoader(loaders, mode="min_size")
    Trainer(max_epochs=1, **QUIET, logger=False, enable_checkpointing=False).fit(model, combined_loader)
    assert len(model.batches) == 2


# --------------------------------------------------------------------------- common/evaluation_intermediate.rst


class MultiVal(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_several_validation_loaders():
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, generator=generator), torch.randn(16, 1, generator=generator))
    model = MultiVal()
    trainer = Trainer(max_epochs=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False, **QUIET)
    trainer.fit(model, DataLoader(data, batch_size=4), [DataLoader(data, batch_size=4), DataLoader(data, batch_size=8)])
    metrics = trainer.callback_metrics
    with torch.no_grad():
        full = F.mse_loss(model.layer(data.tensors[0]), data.tensors[1])
    # both loaders see the whole set: each mean over its (equal-sized) batches is the full-set loss
    assert metrics["val_loss/dataloader_idx_0"] == pytest.approx(full.item(), rel=1e-5)
    assert metrics["val_loss/dataloader_idx_1"] == pytest.approx(full.item(), rel=1e-5)


# --------------------------------------------------------------------------- model/manual_optimization.rst

N = 2


class ManualAccumulation(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)

    def compute_loss(self, batch):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.compute_loss(batch) / N
        self.manual_backward(loss)
        if (batch_idx + 1) % N == 0:
            opt.step()
            opt.zero_grad()
        self.log("loss", loss * N)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.1, patience=0)
        return [optimizer], [scheduler]

    def on_train_epoch_end(self):
        sch = self.lr_schedulers()
        sch.step(self.trainer.callback_metrics["loss"] * 0 + 1.0)  # a constant: no improvement after epoch 0


def test_manual_optimization_accumulation_and_plateau():
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, generator=generator), torch.randn(16, 1, generator=generator))
    model = ManualAccumulation()
    trainer = Trainer(max_epochs=2, logger=False, enable_checkpointing=False, **QUIET)
    trainer.fit(model, DataLoader(data, batch_size=4))
    assert trainer.global_step == 4  # one step every N=2 batches
    reference = ManualAccumulation()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for epoch in range(2):
        for index, batch in enumerate(DataLoader(data, batch_size=4)):
            (reference.compute_loss(batch) / N).backward()
            if (index + 1) % N == 0:
                optimizer.step()
                optimizer.zero_grad()
        if epoch == 1:
            break
    assert torch.equal(model.layer.weight, reference.layer.weight)
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(0.01)


# --------------------------------------------------------------------------- common/early_stopping.rst,
# common/gradient_accumulation.rst, common/progress_bar.rst, extensions/callbacks.rst


class LitModel(LightningModule):
    def __init__(self, learning_rate: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = nn.Linear(28 * 28, 10)

    def forward(self, x):
        return self.layer(x.view(x.size(0), -1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))
        self.log("val_acc", (self(x).argmax(1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate)


class MyPrintingCallback(Callback):
    def __init__(self):
        self.events = []

    def on_train_start(self, trainer, pl_module):
        self.events.append("Training is starting")

    def on_train_end(self, trainer, pl_module):
        self.events.append("Training is ending")


def test_callbacks_early_stopping_accumulation_and_progress_bar(tmp_path):
    seed_everything(0)
    printing = MyPrintingCallback()
    early_stopping = EarlyStopping(monitor="val_acc", mode="max", stopping_threshold=0.99, patience=3)
    accumulator = GradientAccumulationScheduler(scheduling={0: 2, 2: 1})
    trainer = Trainer(max_epochs=30, callbacks=[printing, early_stopping, accumulator, TQDMProgressBar(refresh_rate=0)],
                      default_root_dir=str(tmp_path), enable_model_summary=False, accelerator="cpu")
    trainer.fit(LitModel(learning_rate=0.5), DataLoader(fake_mnist(64), batch_size=8),
                DataLoader(fake_mnist(32, 1), batch_size=8))
    assert printing.events == ["Training is starting", "Training is ending"]
    assert early_stopping.stopping_reason is EarlyStoppingReason.STOPPING_THRESHOLD
    assert trainer.current_epoch < 30 and trainer.callback_metrics["val_acc"] >= 0.99
    steps = [4 if epoch < 2 else 8 for epoch in range(trainer.current_epoch)]
    assert trainer.global_step == sum(steps)


# --------------------------------------------------------------------------- common/checkpointing_basic.rst,
# common/hyperparameters.rst, extensions/logging.rst


class LitNamespace(LightningModule):
    def __init__(self, hparams: Namespace):
        super().__init__()
        self.save_hyperparameters(hparams)
        self.layer = nn.Linear(28 * 28, self.hparams.classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x.view(x.size(0), -1)), y)
        self.log_dict({"train_loss": loss, "step_squared": float(batch_idx) ** 2})
        return loss

    def on_train_start(self):
        if self.logger is not None:
            self.logger.log_hyperparams(self.hparams, {"hp_metric": 0.0})
            self.logger.experiment.log_metrics({"custom": 1.0}, step=0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_checkpoints_hyperparameters_and_logging(tmp_path):
    seed_everything(0)
    model = LitNamespace(Namespace(classes=10, lr=0.1))
    checkpoint_callback = ModelCheckpoint(dirpath=tmp_path / "my" / "path", save_top_k=2, monitor="train_loss")
    logger = CSVLogger(save_dir=str(tmp_path), name="logs")
    trainer = Trainer(max_epochs=3, callbacks=[checkpoint_callback], logger=logger, log_every_n_steps=1, **QUIET)
    trainer.fit(model, DataLoader(fake_mnist(32), batch_size=8))
    assert len(list((tmp_path / "my" / "path").glob("*.ckpt"))) == 2
    best = LitNamespace.load_from_checkpoint(checkpoint_callback.best_model_path)
    assert best.hparams.classes == 10 and best.layer.out_features == 10
    hparams_file = Path(trainer.log_dir) / "hparams.yaml"
    reloaded = LitNamespace.load_from_checkpoint(checkpoint_callback.best_model_path, hparams_file=hparams_file)
    assert reloaded.hparams.lr == 0.1
    resumed = Trainer(max_epochs=4, logger=False, callbacks=[ModelCheckpoint(dirpath=tmp_path / "resumed")], **QUIET)
    resumed.fit(LitNamespace(Namespace(classes=10, lr=0.1)), DataLoader(fake_mnist(32), batch_size=8),
                ckpt_path=checkpoint_callback.last_model_path or checkpoint_callback.best_model_path)
    assert resumed.global_step == 16
    logged = (Path(trainer.log_dir) / "metrics.csv").read_text()
    assert "hp_metric" in logged and "custom" in logged and "step_squared" in logged


# --------------------------------------------------------------------------- data/datamodule.rst


class MNISTDataModule(LightningDataModule):
    def __init__(self, data_dir: str = "./", batch_size: int = 16):
        super().__init__()
        self.data_dir, self.batch_size = data_dir, batch_size
        self.prepared = 0

    def prepare_data(self):
        self.prepared += 1  # the download, once per node

    def setup(self, stage: str):
        if stage == "fit":
            self.mnist_train, self.mnist_val = random_split(fake_mnist(80), [64, 16],
                                                            generator=torch.Generator().manual_seed(42))
        if stage == "test":
            self.mnist_test = fake_mnist(32, seed=2)
        if stage == "predict":
            self.mnist_predict = fake_mnist(16, seed=3)

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_predict, batch_size=self.batch_size)


def test_datamodule(tmp_path):
    seed_everything(0)
    dm = MNISTDataModule()
    model = LitModel(learning_rate=0.5)
    trainer = Trainer(max_epochs=4, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(model, datamodule=dm)
    tested = trainer.test(model, datamodule=MNISTDataModule(), verbose=False)
    predictions = torch.cat(trainer.predict(model, datamodule=dm))
    labels = fake_mnist(16, seed=3).tensors[1]
    assert dm.prepared == 2 and (predictions.argmax(1) == labels).float().mean() > 0.9
    with torch.no_grad():
        x, y = fake_mnist(32, seed=2).tensors
        assert tested[0]["test_acc"] == pytest.approx((model(x).argmax(1) == y).float().mean().item())


# --------------------------------------------------------------------------- common/trainer.rst (flags)


def test_trainer_flags(tmp_path):
    assert isinstance(Trainer(devices=2, accelerator="cpu").strategy, DDPStrategy)  # "auto" with 2 devices
    seed_everything(0)
    trainer = Trainer(overfit_batches=2, max_epochs=3, min_steps=2, barebones=True, accelerator="cpu",
                      default_root_dir=str(tmp_path))
    trainer.fit(LitModel(), DataLoader(fake_mnist(64), batch_size=8), DataLoader(fake_mnist(32, 1), batch_size=8))
    assert trainer.global_step == 6 and trainer.num_val_batches == [2]
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------- extensions/callbacks_state.rst


class Counter(Callback):
    def __init__(self, what="epochs", verbose=True):
        self.what = what
        self.verbose = verbose
        self.state = {"epochs": 0, "batches": 0}

    @property
    def state_key(self) -> str:
        return f"Counter[what={self.what}]"

    def on_train_epoch_end(self, *args, **kwargs):
        if self.what == "epochs":
            self.state["epochs"] += 1

    def on_train_batch_end(self, *args, **kwargs):
        if self.what == "batches":
            self.state["batches"] += 1

    def load_state_dict(self, state_dict):
        self.state.update(state_dict)

    def state_dict(self):
        return self.state.copy()


def test_callbacks_state(tmp_path):
    seed_everything(0)
    trainer = Trainer(callbacks=[Counter(what="epochs"), Counter(what="batches")], max_epochs=2,
                      default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(LitModel(), DataLoader(fake_mnist(32), batch_size=8))
    last = trainer.checkpoint_callback.last_model_path
    saved = torch.load(last, weights_only=True)["callbacks"]
    assert saved["Counter[what=epochs]"] == {"epochs": 2, "batches": 0}
    assert saved["Counter[what=batches]"] == {"epochs": 0, "batches": 8}
    counters = [Counter(what="epochs"), Counter(what="batches")]
    Trainer(callbacks=counters, max_epochs=3, default_root_dir=str(tmp_path), **QUIET).fit(
        LitModel(), DataLoader(fake_mnist(32), batch_size=8), ckpt_path=last)
    assert [c.state for c in counters] == [{"epochs": 3, "batches": 0}, {"epochs": 0, "batches": 12}]


# --------------------------------------------------------------------------- common/checkpointing_intermediate.rst


def test_checkpointing_intermediate(tmp_path):
    seed_everything(0)
    checkpoint_callback = ModelCheckpoint(monitor="val_loss", dirpath=tmp_path / "my/path",
                                          filename="sample-mnist-{epoch:02d}-{val_loss:.2f}", save_top_k=3, mode="min")
    trainer = Trainer(callbacks=[checkpoint_callback], max_epochs=5, default_root_dir=str(tmp_path), **QUIET)
    model = LitModel()
    trainer.fit(model, DataLoader(fake_mnist(32), batch_size=8), DataLoader(fake_mnist(16, 1), batch_size=8))
    files = sorted(path.name for path in (tmp_path / "my/path").glob("*.ckpt"))
    assert len(files) == 3 and all(name.startswith("sample-mnist-epoch=0") for name in files)
    scores = {path: float(score) for path, score in checkpoint_callback.best_k_models.items()}
    assert checkpoint_callback.best_model_score == min(scores.values())
    best = LitModel.load_from_checkpoint(checkpoint_callback.best_model_path)
    with torch.no_grad():
        x, y = fake_mnist(16, 1).tensors
        assert F.cross_entropy(best(x), y).item() == pytest.approx(float(checkpoint_callback.best_model_score),
                                                                    rel=1e-5)
