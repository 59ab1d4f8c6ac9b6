"""Defaults and loaders a Lightning user counts on: 'auto' picks ddp for several devices, a plain list of batches
is a loader, several training loaders are combined as Lightning's CombinedLoader combines them, and removed 1.x
options name their 2.x spelling."""

from __future__ import annotations

import pytest
import torch
from lightning_helpers import QUIET, Linear, batches
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer
from torchyard.trainer.data.combined import CombinedLoader
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies.ddp import DDPStrategy
from torchyard.trainer.strategies.single import SingleDeviceStrategy


class Validated(Linear):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y), batch_size=len(x))


def test_auto_strategy_is_ddp_for_several_devices():
    assert isinstance(Trainer(devices=2, **QUIET).strategy, DDPStrategy)
    assert isinstance(Trainer(devices=1, **QUIET).strategy, SingleDeviceStrategy)
    assert isinstance(Trainer(strategy="auto", devices=1, num_nodes=1, **QUIET).strategy, SingleDeviceStrategy)


def test_a_list_of_batches_trains_like_a_hand_written_loop():
    train, val = batches(5), batches(3, seed=1)
    module = Validated()
    trainer = Trainer(max_epochs=2, **QUIET)
    trainer.fit(module, train, val)

    reference = Linear()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in train:  # a plain list keeps its order, as Lightning iterates it
            loss = nn.functional.mse_loss(reference.layer(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert torch.equal(module.layer.weight, reference.layer.weight)
    with torch.no_grad():
        expected = torch.stack([nn.functional.mse_loss(reference.layer(x), y) for x, y in val]).mean()
    assert trainer.callback_metrics["val_loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    # the same list validates alone too
    assert trainer.validate(module, val, verbose=False)[0]["val_loss"] == pytest.approx(expected.item(), rel=1e-6)


def test_a_generator_of_batches_is_a_loader():
    module = Linear()
    before = module.layer.weight.detach().clone()
    Trainer(max_epochs=1, **QUIET).fit(module, (batch for batch in batches(3)))
    assert not torch.equal(before, module.layer.weight)
    assert module.trainer.global_step == 3


def test_val_loader_without_validation_step_warns_and_does_not_validate():
    with pytest.warns(UserWarning, match="Linear has no validation_step, so the fit does not validate"):
        trainer = Trainer(max_epochs=1, **QUIET)
        trainer.fit(Linear(), batches(2), batches(2))
    assert trainer.val_dataloaders == []


@pytest.mark.parametrize(("option", "spelling"), [
    ("gpus", "accelerator='gpu', devices=N"),
    ("progress_bar_refresh_rate", "TQDMProgressBar(refresh_rate=N)"),
    ("resume_from_checkpoint", "trainer.fit(model, ckpt_path=...)"),
    ("replace_sampler_ddp", "use_distributed_sampler"),
    ("checkpoint_callback", "enable_checkpointing"),
])
def test_removed_lightning_1_options_name_their_2x_spelling(option, spelling):
    with pytest.raises(MisconfigurationError, match=f"'{option}' was removed in Lightning 2.0; use .*") as raised:
        Trainer(**{option: 1})
    assert spelling in str(raised.value) and "\n" not in str(raised.value)


# --------------------------------------------------------------------------- several training loaders


class Recorder(Linear):
    """Trains on the "a" part of each combined batch and records what every batch held."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        parts = list(batch.values()) if isinstance(batch, dict) else batch
        self.seen.append([None if part is None else part[0].flatten().tolist() for part in parts])
        return self.layer(parts[0][0][:, None].float().expand(-1, 3)).sum() * 0.0


def numbered(count: int, batch_size: int, start: int = 0) -> DataLoader:
    values = torch.arange(start, start + count)
    return DataLoader(TensorDataset(values), batch_size=batch_size)


@pytest.mark.parametrize(("given", "expected"), [
    # a list: max_size_cycle, the shorter loader starts again
    (lambda: [numbered(4, 2), numbered(6, 2, 10)], [[[0, 1], [10, 11]], [[2, 3], [12, 13]], [[0, 1], [14, 15]]]),
    (lambda: {"a": numbered(4, 2), "b": numbered(6, 2, 10)},
     [[[0, 1], [10, 11]], [[2, 3], [12, 13]], [[0, 1], [14, 15]]]),
    (lambda: CombinedLoader([numbered(4, 2), numbered(6, 2, 10)], "min_size"),
     [[[0, 1], [10, 11]], [[2, 3], [12, 13]]]),
    (lambda: CombinedLoader({"a": numbered(6, 2), "b": numbered(4, 2, 10)}, "max_size"),
     [[[0, 1], [10, 11]], [[2, 3], [12, 13]], [[4, 5], None]]),
])
def test_several_training_loaders_combine_in_lightnings_modes(given, expected):
    module = Recorder()
    trainer = Trainer(max_epochs=2, **QUIET)
    trainer.fit(module, given())
    assert module.seen == expected + expected
    assert trainer.num_training_batches == len(expected)


def test_combined_loader_iterates_as_lightnings():
    loaders = {"a": DataLoader(range(6), batch_size=4), "b": DataLoader(range(15), batch_size=5)}
    rows = [(batch["a"], batch_idx) for batch, batch_idx, _ in CombinedLoader(loaders, "max_size")]
    assert [(None if a is None else a.tolist(), i) for a, i in rows] == [([0, 1, 2, 3], 0), ([4, 5], 1), (None, 2)]
    sequential = CombinedLoader(loaders, "sequential")
    assert len(sequential) == 5
    assert [(i, j) for _, i, j in sequential] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1)]
    with pytest.raises(MisconfigurationError, match="fit does not take a CombinedLoader with mode='sequential'"):
        Trainer(max_epochs=1, **QUIET).fit(Recorder(), sequential)
    with pytest.raises(MisconfigurationError, match="CombinedLoader mode='zip' is not known"):
        CombinedLoader(loaders, "zip")
