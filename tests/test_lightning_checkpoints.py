"""Checkpoints and hyperparameters as ported Lightning code uses them: strict_loading, hparams_file=,
save_hyperparameters(namespace)."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch
from torch import nn

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.errors import CheckpointError

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, accelerator="cpu",
             num_sanity_val_steps=0)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(count)]


class Linear(TrainModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=self.hparams.lr)


class WithFrozenHead(Linear):
    """A part that checkpoints leave out (e.g. a frozen pretrained backbone): loads need strict=False."""

    strict_loading = False

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.head = nn.Linear(1, 1)


def test_strict_loading_false_is_honoured_by_fit_and_load_from_checkpoint(tmp_path):
    trained = Linear()
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(trained, batches(3))
    path = tmp_path / "linear.ckpt"
    trainer.save_checkpoint(path)

    resumed = WithFrozenHead()
    Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET).fit(resumed, batches(3), ckpt_path=path)
    assert resumed.trainer.global_step == 6  # went on from the checkpoint's 3 steps

    loaded = WithFrozenHead.load_from_checkpoint(path)
    assert torch.equal(loaded.layer.weight, trained.layer.weight)
    with pytest.raises(CheckpointError, match="does not fit WithFrozenHead: .*head"):
        WithFrozenHead.load_from_checkpoint(path, strict=True)
    with pytest.raises(CheckpointError, match="do not fit"):
        strict = WithFrozenHead()
        strict.strict_loading = True
        Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET).fit(strict, batches(3), ckpt_path=path)


def test_hparams_file_wins_over_the_checkpoint_and_keywords_over_both(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(Linear(lr=0.1), batches(2))
    path = tmp_path / "linear.ckpt"
    trainer.save_checkpoint(path)
    hparams_file = tmp_path / "hparams.yaml"
    hparams_file.write_text("lr: 0.5\n")
    assert Linear.load_from_checkpoint(path).hparams.lr == 0.1
    assert Linear.load_from_checkpoint(path, hparams_file=hparams_file).hparams.lr == 0.5
    assert Linear.load_from_checkpoint(path, hparams_file=str(hparams_file), lr=0.7).hparams.lr == 0.7
    hparams_file.write_text("- a list\n")
    with pytest.raises(CheckpointError, match="holds a list, not a mapping"):
        Linear.load_from_checkpoint(path, hparams_file=hparams_file)


class FromNamespace(TrainModule):
    def __init__(self, args: Namespace) -> None:
        super().__init__()
        self.save_hyperparameters(args)
        self.layer = nn.Linear(args.width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x[:, : self.hparams.width]), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_save_hyperparameters_of_a_namespace_reloads(tmp_path):
    module = FromNamespace(Namespace(width=2, lr=0.05))
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(module, batches(2))
    path = tmp_path / "ns.ckpt"
    trainer.save_checkpoint(path)
    loaded = FromNamespace.load_from_checkpoint(path)
    assert dict(loaded.hparams) == {"width": 2, "lr": 0.05}
    assert torch.equal(loaded.layer.weight, module.layer.weight)
