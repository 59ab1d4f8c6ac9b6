"""Loop semantics ported Lightning code relies on: on_train_batch_end's outputs, a required dataloader_idx,
trainer.is_last_batch, module.on_gpu, ReduceLROnPlateau without a monitor under manual optimization."""

from __future__ import annotations

import pytest
import torch
from lightning_helpers import QUIET, Linear, batches

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer
from torchyard.trainer.errors import MisconfigurationError


class KeepsOutputs(Linear):
    def __init__(self, returns_dict: bool) -> None:
        super().__init__()
        self.returns_dict, self.outputs, self.losses = returns_dict, [], []

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.losses.append(loss.item())
        return {"loss": loss, "extra": batch_idx} if self.returns_dict else loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.outputs.append(outputs)


@pytest.mark.parametrize("returns_dict", [False, True])
def test_on_train_batch_end_gets_a_dict_with_the_detached_loss(returns_dict):
    module = KeepsOutputs(returns_dict)
    Trainer(max_epochs=1, **QUIET).fit(module, batches(3))
    assert [sorted(o) for o in module.outputs] == [["extra", "loss"] if returns_dict else ["loss"]] * 3
    assert [o["loss"].item() for o in module.outputs] == module.losses
    assert not any(o["loss"].requires_grad for o in module.outputs)
    if returns_dict:
        assert [o["extra"] for o in module.outputs] == [0, 1, 2]


class RequiredLoaderIndex(Linear):
    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def validation_step(self, batch, batch_idx, dataloader_idx):  # no default, as some Lightning examples write it
        self.calls.append((batch_idx, dataloader_idx))
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch, batch_idx, dataloader_idx):
        self.calls.append(("test", batch_idx, dataloader_idx))


def test_a_required_dataloader_idx_is_given_for_one_loader():
    module = RequiredLoaderIndex()
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(module, batches(2), batches(2, seed=1))
    assert module.calls == [(0, 0), (1, 0)]
    trainer.test(module, batches(1), verbose=False)
    assert module.calls[-1] == ("test", 0, 0)


class LastBatchSeen(Callback):
    def __init__(self) -> None:
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append((trainer.current_epoch, batch_idx, trainer.is_last_batch))


def test_is_last_batch():
    seen = LastBatchSeen()
    Trainer(max_epochs=2, callbacks=[seen], **QUIET).fit(Linear(), batches(3))
    assert seen.seen == [(e, i, i == 2) for e in range(2) for i in range(3)]


def test_on_gpu_on_the_cpu():
    module = Linear()
    assert module.on_gpu is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_gpu_on_a_gpu():
    class Checks(Linear):
        def training_step(self, batch, batch_idx):
            assert self.on_gpu
            return self.loss(batch)

    Trainer(max_epochs=1, accelerator="cuda", enable_progress_bar=False, logger=False,
            enable_checkpointing=False).fit(Checks(), batches(2))


class ManualPlateau(Linear):
    automatic_optimization = False

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)]

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.loss(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.lr_schedulers().step(1.0)  # the same value every time: no improvement after the first


def test_reduce_lr_on_plateau_without_monitor_under_manual_optimization():
    module = ManualPlateau()
    Trainer(max_epochs=1, **QUIET).fit(module, batches(3))
    # the first step sets the best value; each of the two after it halves the rate
    assert module.optimizers().optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4)


def test_reduce_lr_on_plateau_without_monitor_under_automatic_optimization_is_refused():
    class AutomaticPlateau(Linear):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)]

    with pytest.raises(MisconfigurationError, match="ReduceLROnPlateau steps on a monitored value: it needs a"):
        Trainer(max_epochs=1, **QUIET).fit(AutomaticPlateau(), batches(3))
