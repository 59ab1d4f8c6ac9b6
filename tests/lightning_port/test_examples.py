"""Lightning's examples (examples/pytorch/*, lightning.pytorch.demos) ported by import swap.

Each test holds the user code a Lightning user wrote, re-typed with this framework's imports
(`LightningModule` -> `TrainModule`, `LightningDataModule` -> `DataModule`, `lightning.pytorch.callbacks` ->
`torchyard.callbacks`); datasets that need a download are synthetic tensors of the same shapes. Each asserts its
own outcome. What was left out of an example, and why, is in docs/porting-from-lightning.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from port_data import QUIET, fake_mnist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, random_split

from torchyard.callbacks import Callback, ModelCheckpoint
from torchyard.trainer import DataModule as LightningDataModule
from torchyard.trainer import Trainer, seed_everything
from torchyard.trainer import TrainModule as LightningModule

# --------------------------------------------------------------------------- examples/pytorch/bug_report


class RandomDataset(Dataset):
    def __init__(self, size, length):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


class BoringModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("train_loss", loss)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", self(batch).sum())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self(batch).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def test_bug_report_model(tmp_path):
    seed_everything(0)
    train_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    val_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    test_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    model = BoringModel()
    before = model.layer.weight.detach().clone()
    trainer = Trainer(default_root_dir=str(tmp_path), limit_train_batches=1, limit_val_batches=1,
                      limit_test_batches=1, num_sanity_val_steps=0, max_epochs=1, enable_model_summary=False,
                      enable_progress_bar=False, accelerator="cpu")
    trainer.fit(model, train_dataloaders=train_data, val_dataloaders=val_data)
    results = trainer.test(model, dataloaders=test_data, verbose=False)
    assert trainer.global_step == 1 and not torch.equal(before, model.layer.weight)
    with torch.no_grad():
        expected = model(next(iter(test_data))).sum().item()
    assert results == [{"test_loss": expected}]


# --------------------------------------------------------------------------- examples/pytorch/basics/autoencoder.py


class LitAutoEncoder(LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 28 * 28))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x = self._prepare_batch(batch)
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage: str):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        dataset = fake_mnist(320)
        self.mnist_test = fake_mnist(64, seed=1)
        self.mnist_train, self.mnist_val = random_split(dataset, [256, 64], generator=torch.Generator().manual_seed(42))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.mnist_train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.mnist_val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.mnist_test, batch_size=self.batch_size)


def test_autoencoder(tmp_path):
    seed_everything(0)
    model, datamodule = LitAutoEncoder(), MyDataModule()
    trainer = Trainer(max_epochs=3, default_root_dir=str(tmp_path), log_every_n_steps=1,
                      callbacks=[ModelCheckpoint(monitor="val_loss")], **QUIET)
    trainer.fit(model, datamodule=datamodule)
    tested = trainer.test(ckpt_path="best", datamodule=datamodule, verbose=False)
    predictions = trainer.predict(ckpt_path="best", datamodule=datamodule)
    assert [p.shape for p in predictions] == [torch.Size([32, 784])] * 2
    best = LitAutoEncoder.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    with torch.no_grad():
        x = torch.cat([x for x, _ in datamodule.test_dataloader()]).view(64, -1)
        assert torch.allclose(torch.cat(predictions), best(x))
        assert tested[0]["test_loss_epoch"] == pytest.approx(F.mse_loss(x, best(x)).item(), rel=1e-5)
    losses = [float(r["train_loss"]) for r in _csv_rows(trainer.log_dir) if r.get("train_loss")]
    assert len(losses) == 24 and sum(losses[-4:]) < 0.7 * sum(losses[:4])


def _csv_rows(log_dir: str) -> list[dict[str, str]]:
    import csv

    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


# --------------------------------------------------------------------------- basics/backbone_image_classifier.py


class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim=128):
        super().__init__()
        self.l1 = torch.nn.Linear(28 * 28, hidden_dim)
        self.l2 = torch.nn.Linear(hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        return self.l2(torch.relu(self.l1(x)))


class LitClassifier(LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.001):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone if backbone is not None else Backbone()

    def forward(self, x):
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("valid_loss", F.cross_entropy(self(x), y), on_step=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def test_backbone_image_classifier(tmp_path):
    seed_everything(0)
    datamodule = MyDataModule(batch_size=32)
    model = LitClassifier(Backbone())
    trainer = Trainer(max_epochs=3, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(model, datamodule=datamodule)
    tested = trainer.test(model, datamodule=datamodule, verbose=False)
    predictions = torch.cat(trainer.predict(model, datamodule=datamodule))
    labels = torch.cat([y for _, y in datamodule.predict_dataloader()])
    assert (predictions.argmax(1) == labels).float().mean() > 0.9  # the planted row is learned
    assert dict(model.hparams) == {"learning_rate": 0.001}  # the backbone is left out, as the example asks
    assert tested[0]["test_loss"] < 0.5


# ------------------------------------------------------------- domain_templates/generative_adversarial_net.py


class Generator(nn.Module):
    def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.img_shape = img_shape
        self.model = nn.Sequential(nn.Linear(latent_dim, 64), nn.LeakyReLU(0.2), nn.Linear(64, math.prod(img_shape)),
                                   nn.Tanh())

    def forward(self, z):
        return self.model(z).view(z.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(math.prod(img_shape), 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, img):
        return self.model(img.view(img.size(0), -1))


class GAN(LightningModule):
    def __init__(self, img_shape: tuple = (1, 28, 28), lr: float = 0.0002, b1: float = 0.5, b2: float = 0.999,
                 latent_dim: int = 100):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)
        self.validation_z = torch.randn(8, self.hparams.latent_dim)
        self.sampled_epochs = []

    def forward(self, z):
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch):
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim).type_as(imgs)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d

    def on_train_epoch_end(self):
        z = self.validation_z.type_as(self.generator.model[0].weight)
        self.sampled_epochs.append(self(z).shape)


def test_generative_adversarial_net(tmp_path):
    seed_everything(0)
    model = GAN(img_shape=(1, 8, 8), latent_dim=16)
    generator_before = [p.detach().clone() for p in model.generator.parameters()]
    discriminator_before = [p.detach().clone() for p in model.discriminator.parameters()]
    images = TensorDataset(torch.rand(64, 1, 8, 8) * 2 - 1, torch.zeros(64))
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(model, DataLoader(images, batch_size=16))
    assert trainer.global_step == 2 * 4 * 2  # two optimizer steps a batch, as Lightning counts them
    assert all(not torch.equal(a, b) for a, b in zip(generator_before, model.generator.parameters()))
    assert all(not torch.equal(a, b) for a, b in zip(discriminator_before, model.discriminator.parameters()))
    assert all(p.requires_grad for p in model.parameters())  # untoggle_optimizer gave every flag back
    assert model.sampled_epochs == [torch.Size([8, 1, 8, 8])] * 2
    assert math.isfinite(trainer.callback_metrics["d_loss"]) and math.isfinite(trainer.callback_metrics["g_loss"])


# --------------------------------------------------------------------------- basics/profiler_example.py


def test_profiler_example(tmp_path, capsys):
    seed_everything(0)
    trainer = Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=2, profiler="simple",
                      default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(LitClassifier(), datamodule=MyDataModule())
    report = capsys.readouterr().out
    assert "SimpleProfiler report (fit)" in report and "run_training_batch" in report
    assert len(trainer.profiler.recorded_durations["run_training_batch"]) == 4


# --------------------------------------------------------------------------- lightning.pytorch.demos


class SequenceSampler(Sampler):
    """demos/lstm.py: batches of consecutive sequences, so that the LSTM's hidden state carries across batches."""

    def __init__(self, dataset, batch_size: int) -> None:
        super().__init__()
        self.dataset, self.batch_size = dataset, batch_size
        self.chunk_size = len(self.dataset) // self.batch_size

    def __iter__(self):
        n = len(self.dataset)
        ids = [list(range(i, i + self.chunk_size)) for i in range(0, n - n % self.batch_size, self.chunk_size)]
        return iter(zip(*ids))

    def __len__(self) -> int:
        return self.chunk_size


class SimpleLSTM(nn.Module):
    def __init__(self, vocab_size: int, ninp: int = 32, nhid: int = 32, nlayers: int = 1):
        super().__init__()
        self.nlayers, self.nhid = nlayers, nhid
        self.encoder = nn.Embedding(vocab_size, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, batch_first=True)
        self.decoder = nn.Linear(nhid, vocab_size)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return F.log_softmax(self.decoder(output), dim=-1), hidden

    def init_hidden(self, batch_size: int):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, batch_size, self.nhid), weight.new_zeros(self.nlayers, batch_size,
                                                                                       self.nhid))


class CountingSequences(Dataset):
    """Stands in for WikiText2 (a download): token i is followed by token (i + 1) % vocab, 20 tokens a sample."""

    def __init__(self, vocab: int = 16, samples: int = 32, length: int = 10):
        starts = torch.arange(samples) * length
        self.data = (starts[:, None] + torch.arange(length + 1)) % vocab

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index, :-1], self.data[index, 1:]


class LightningLSTM(LightningModule):
    def __init__(self, vocab_size: int = 16):
        super().__init__()
        self.model = SimpleLSTM(vocab_size=vocab_size)
        self.hidden = None

    def on_train_epoch_end(self):
        self.hidden = None

    def training_step(self, batch, batch_idx):
        input, target = batch
        if self.hidden is None:
            self.hidden = self.model.init_hidden(input.size(0))
        self.hidden = (self.hidden[0].detach(), self.hidden[1].detach())
        output, self.hidden = self.model(input, self.hidden)
        loss = F.nll_loss(output.view(-1, output.size(-1)), target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def train_dataloader(self):
        dataset = CountingSequences()
        return DataLoader(dataset, batch_sampler=SequenceSampler(dataset, batch_size=4))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class LossHistory(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def test_lstm_demo(tmp_path):
    seed_everything(0)
    history = LossHistory()
    trainer = Trainer(max_epochs=4, gradient_clip_val=0.25, callbacks=[history], default_root_dir=str(tmp_path),
                      **QUIET)
    trainer.fit(LightningLSTM())
    assert trainer.num_training_batches == 8
    assert history.losses[-1] < 0.5 * history.losses[0]


class TransformerLM(LightningModule):
    """demos/transformer.py's LightningTransformer, smaller: a causal nn.Transformer language model."""

    def __init__(self, vocab_size: int = 16, ninp: int = 32):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.transformer = nn.Transformer(d_model=ninp, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=64, dropout=0.0, batch_first=True)
        self.decoder = nn.Linear(ninp, vocab_size)

    def forward(self, inputs, target):
        mask = self.transformer.generate_square_subsequent_mask(target.size(1))
        output = self.transformer(self.embedding(inputs), self.embedding(target), tgt_mask=mask)
        return self.decoder(output)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        output = self(inputs, target)
        loss = F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def test_transformer_demo(tmp_path):
    seed_everything(0)
    history = LossHistory()
    trainer = Trainer(max_epochs=2, callbacks=[history], default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(TransformerLM(), DataLoader(CountingSequences(), batch_size=4, shuffle=True))
    assert history.losses[-1] < 0.5 * history.losses[0]
