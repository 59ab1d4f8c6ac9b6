"""Trainer(seed=...) seeds the calling process when the Trainer is built, as seed_everything at a script's top does
(issue 51), and says once when the module it fits was built before, in a process nothing had seeded."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule, seed_everything

QUIET = dict(max_epochs=2, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
             logger=False, accelerator="cpu")
UNSEEDED = ("Net was built before Trainer(seed=0) seeded this process, so its initial weights are not seeded and two "
            "runs start from different weights; build the Trainer first (`trainer = Trainer(seed=0, ...)`, then "
            "`Net(...)`), or call seed_everything(0) before building the module.")


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                       torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randint(0, 2, (32,), generator=generator))
    return DataLoader(data, batch_size=8, shuffle=True)


def fresh_process_rng() -> None:
    """The generators as a new Python process has them: torch seeded from the OS's randomness."""
    torch.seed()


def test_two_runs_of_trainer_then_module_end_with_equal_weights():
    weights = []
    for _ in range(2):
        fresh_process_rng()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the module is built after the seeded Trainer: nothing to say
            trainer = Trainer(seed=0, **QUIET)
            module = Net()
            trainer.fit(module, loader())
        weights.append(module.state_dict())
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_a_module_built_before_a_seeded_trainer_is_named_once():
    fresh_process_rng()
    module = Net()
    trainer = Trainer(seed=0, **QUIET)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module, loader())
    assert [str(w.message) for w in caught if "was built before" in str(w.message)] == [UNSEEDED]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(module, loader())  # said once


@pytest.mark.parametrize("seed_first", [lambda: seed_everything(0), lambda: torch.manual_seed(5)])
def test_a_module_built_after_any_seed_is_not_named(seed_first):
    fresh_process_rng()
    seed_first()
    module = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(seed=0, **QUIET).fit(module, loader())


def test_building_the_trainer_seeds_the_process_as_seed_everything_does():
    fresh_process_rng()
    Trainer(seed=3, **QUIET)
    after_trainer = torch.randn(4)
    seed_everything(3)
    assert torch.equal(after_trainer, torch.randn(4))
