"""The Trainer's schedule facts (batches_this_epoch, validates_at_epoch_end, ...), read at the hooks where the
shipped callbacks read them, against each fit's schedule worked out by hand."""

from __future__ import annotations

import csv

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule

BATCHES = 4  # training batches per epoch: 16 samples, 4 a batch


class Regression(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class TwoOptimizers(Regression):
    """Manual optimization stepping two optimizers a batch, as a GAN does."""

    automatic_optimization = False

    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for optimizer, layer in zip(self.optimizers(), (self.layer, self.other)):
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(layer(x), y))
            optimizer.step()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layer.parameters(), lr=0.01), torch.optim.SGD(self.other.parameters(), lr=0.01)]


class FactRecorder(Callback):
    """(hook, epoch, batches_this_epoch, epoch_batches_done, batches_stepped, global_step, logs_this_step) at
    each hook where a shipped callback reads a fact; on_train_epoch_end after the module's, as ModelCheckpoint."""

    monitors = True

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.setup_facts: tuple[bool, bool] | None = None  # (validates_at_epoch_end, validates_only_at_epoch_end)
        self.validated_since_last_batch = False
        self.epoch_ends: list[tuple[bool, bool]] = []  # (validates_at_epoch_end, a validation just preceded it)

    def _note(self, hook: str, trainer: Trainer) -> None:
        self.seen.append((hook, trainer.current_epoch, trainer.batches_this_epoch, trainer.epoch_batches_done,
                          trainer.batches_stepped, trainer.global_step, trainer.logs_this_step))

    def setup(self, trainer, module, stage):
        if stage == "fit":
            self.setup_facts = (trainer.validates_at_epoch_end, trainer.validates_only_at_epoch_end)

    def on_train_epoch_start(self, trainer, module):
        self._note("epoch_start", trainer)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._note("batch_start", trainer)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._note("batch_end", trainer)
        self.validated_since_last_batch = False

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self._note("validation_end", trainer)
            self.validated_since_last_batch = True

    def on_train_epoch_end(self, trainer, module):
        self._note("epoch_end", trainer)
        self.epoch_ends.append((trainer.validates_at_epoch_end, self.validated_since_last_batch))

    def on_train_end(self, trainer, module):
        self._note("train_end", trainer)

    def facts(self, hook: str, *fields: int) -> list[tuple]:
        """The recorded tuples of `hook`, each cut to `fields` (indices into the tuple, 1 = epoch)."""
        return [tuple(entry[i] for i in fields) for entry in self.seen if entry[0] == hook]


def loaders() -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    samples = BATCHES * 4
    data = TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples, 1, generator=generator))
    return DataLoader(data, batch_size=4), DataLoader(data, batch_size=4)


def fit(tmp_path, module=None, ckpt_path=None, **options) -> tuple[Trainer, FactRecorder]:
    recorder = FactRecorder()
    settings = dict(default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, logger=False, num_sanity_val_steps=0, max_epochs=2)
    trainer = Trainer(callbacks=[recorder], **{**settings, **options})
    trainer.fit(module or Regression(), *loaders(), ckpt_path=ckpt_path)
    return trainer, recorder


EPOCH, BATCHES_THIS_EPOCH, DONE, STEPPED, GLOBAL_STEP, LOGS = 1, 2, 3, 4, 5, 6


def test_batches_this_epoch_and_epoch_batches_done_through_a_fit_with_mid_epoch_validation(tmp_path):
    _, recorder = fit(tmp_path, val_check_interval=2)
    one_epoch = [("epoch_start", 0, False), ("batch_end", 1, False), ("batch_end", 2, False),
                 ("validation_end", 2, False),  # mid-epoch: ModelCheckpoint saves here, not at the epoch's end
                 ("batch_end", 3, False), ("batch_end", 4, False),
                 ("validation_end", 4, True), ("epoch_end", 4, True)]  # the epoch's end, then its checkpoint
    expected = one_epoch + one_epoch + [("train_end", 0, False)]  # the loop has moved to the next epoch
    seen = [(hook, batches, done) for hook, _, batches, done, *_ in recorder.seen if hook != "batch_start"]
    assert seen == expected


def test_a_stop_mid_epoch_leaves_the_epoch_not_done_and_its_resume_starts_at_the_stopping_batch(tmp_path):
    stopped, recorder = fit(tmp_path, max_steps=3, enable_checkpointing=True)
    # Stopped after 3 of 4 batches: not done, so ModelCheckpoint still writes last.ckpt to resume from.
    assert recorder.facts("epoch_end", EPOCH, BATCHES_THIS_EPOCH, DONE) == [(0, 3, False)]
    last = stopped.checkpoint_callback.last_model_path
    assert last.endswith("last.ckpt")
    _, resumed = fit(tmp_path, ckpt_path=last, max_epochs=1)
    # The resumed epoch starts at batch 3 (the bar and the summary count its batches from there) and ends done.
    assert resumed.facts("epoch_start", EPOCH, BATCHES_THIS_EPOCH, DONE) == [(0, 3, False)]
    assert resumed.facts("epoch_end", EPOCH, BATCHES_THIS_EPOCH, DONE) == [(0, 4, True)]


def test_batches_stepped_counts_batches_that_step_not_micro_batches(tmp_path):
    trainer, recorder = fit(tmp_path, accumulate_grad_batches=2)
    # 8 batches, stepping after every second: batch k starts after k // 2 steps and ends after (k + 1) // 2.
    assert recorder.facts("batch_start", STEPPED) == [(k // 2,) for k in range(2 * BATCHES)]
    assert recorder.facts("batch_end", STEPPED) == [((k + 1) // 2,) for k in range(2 * BATCHES)]
    assert trainer.batches_stepped == trainer.global_step == BATCHES


def test_batches_stepped_counts_a_batch_once_however_many_optimizers_it_steps(tmp_path):
    trainer, recorder = fit(tmp_path, module=TwoOptimizers())
    # Two optimizer steps a batch: global_step counts both, the loggers' step counts the batch.
    assert recorder.facts("batch_end", STEPPED, GLOBAL_STEP) == [(k + 1, 2 * (k + 1)) for k in range(2 * BATCHES)]
    assert (trainer.batches_stepped, trainer.global_step) == (2 * BATCHES, 4 * BATCHES)


def test_logs_this_step_marks_the_steps_whose_rows_metrics_csv_holds(tmp_path):
    _, recorder = fit(tmp_path, logger=True, log_every_n_steps=3)
    # Before batch k: step k, due for LearningRateMonitor at 0, 3, 6; after it: step k + 1, due at 3, 6.
    assert recorder.facts("batch_start", STEPPED, LOGS) == [(k, k % 3 == 0) for k in range(2 * BATCHES)]
    assert recorder.facts("batch_end", STEPPED, LOGS) == [(k, k % 3 == 0) for k in range(1, 2 * BATCHES + 1)]
    with open(tmp_path / "default" / "version_0" / "metrics.csv", newline="") as file:
        step_rows = [int(row["step"]) for row in csv.DictReader(file) if row["train_loss"]]
    assert step_rows == [step for _, step, due in recorder.facts("batch_end", 0, STEPPED, LOGS) if due] == [3, 6]


@pytest.mark.parametrize(("options", "expected", "validated"), [
    ({}, True, [True, True]),
    ({"val_check_interval": 2}, True, [True, True]),  # mid-epoch validations too, and one at each end
    ({"check_val_every_n_epoch": 2}, False, [False, True]),
    ({"limit_val_batches": 0}, False, [False, False]),  # validation off
])
def test_validates_at_epoch_end_follows_the_epoch_end_validations_of_the_fit(tmp_path, options, expected, validated):
    _, recorder = fit(tmp_path, **options)
    assert recorder.setup_facts[0] is expected
    assert recorder.epoch_ends == [(expected, ran) for ran in validated]


@pytest.mark.parametrize(("options", "expected", "validations"), [
    ({}, True, [(0, 4), (1, 4)]),
    ({"val_check_interval": 0.5}, False, [(0, 2), (0, 4), (1, 2), (1, 4)]),
    ({"val_check_interval": 1}, False, [(epoch, k) for epoch in range(2) for k in range(1, BATCHES + 1)]),  # a count
    ({"check_val_every_n_epoch": 2}, False, [(1, 4)]),
])
def test_validates_only_at_epoch_end_when_each_epoch_has_one_validation_at_its_end(tmp_path, options, expected,
                                                                                     validations):
    trainer, recorder = fit(tmp_path, **options)
    assert recorder.setup_facts[1] is expected  # read in setup, where EarlyStopping decides when to check
    assert recorder.facts("validation_end", EPOCH, BATCHES_THIS_EPOCH) == validations
    assert trainer.validates_only_at_epoch_end is expected  # a fact of the configuration: the same after the fit
