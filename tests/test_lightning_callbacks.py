"""Lightning's callback names and enums: EarlyStoppingReason, GradientAccumulationScheduler, TQDMProgressBar,
LightningOptimizer."""

from __future__ import annotations

import pytest
import torch
from lightning_helpers import QUIET, Linear, batches
from torch import nn

from torchyard.callbacks import (
    EarlyStopping,
    EarlyStoppingReason,
    GradientAccumulationScheduler,
    RichProgressBar,
    TQDMProgressBar,
)
from torchyard.trainer import Trainer
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.optim import LightningOptimizer


class LogsConstant(Linear):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = values

    def validation_step(self, batch, batch_idx):
        self.log("score", self.values[min(self.current_epoch, len(self.values) - 1)])


@pytest.mark.parametrize(("values", "options", "reason"), [
    ([1.0], dict(patience=2), EarlyStoppingReason.PATIENCE_EXHAUSTED),
    ([1.0, 0.5, 0.01], dict(stopping_threshold=0.1), EarlyStoppingReason.STOPPING_THRESHOLD),
    ([1.0, 5.0], dict(divergence_threshold=2.0), EarlyStoppingReason.DIVERGENCE_THRESHOLD),
    ([1.0, float("nan")], dict(), EarlyStoppingReason.NON_FINITE_METRIC),
])
def test_early_stopping_reason(values, options, reason):
    stopper = EarlyStopping("score", **options)
    trainer = Trainer(max_epochs=10, callbacks=[stopper], **QUIET)
    trainer.fit(LogsConstant(values), batches(1), batches(1))
    assert stopper.stopping_reason is reason
    assert trainer.current_epoch < 10 and stopper.stopping_reason_message
    restored = EarlyStopping("score")
    assert restored.stopping_reason is EarlyStoppingReason.NOT_STOPPED
    restored.load_state_dict(stopper.state_dict())
    assert restored.stopping_reason is reason


def test_gradient_accumulation_scheduler_matches_a_hand_written_loop():
    train = batches(4)
    module = Linear()
    trainer = Trainer(max_epochs=3, callbacks=[GradientAccumulationScheduler({1: 2, 2: 4})], **QUIET)
    trainer.fit(module, train)
    assert trainer.global_step == 4 + 2 + 1

    reference = Linear()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for factor in (1, 2, 4):
        for index, (x, y) in enumerate(train):
            (nn.functional.mse_loss(reference.layer(x), y) * (1.0 / factor)).backward()
            if (index + 1) % factor == 0:
                optimizer.step()
                optimizer.zero_grad()
    assert torch.equal(module.layer.weight, reference.layer.weight)
    assert torch.equal(module.layer.bias, reference.layer.bias)


def test_gradient_accumulation_scheduler_bad_input():
    with pytest.raises(MisconfigurationError, match="factors must be integers >= 1"):
        GradientAccumulationScheduler({0: 0})
    with pytest.raises(MisconfigurationError, match="needs a non-empty dict"):
        GradientAccumulationScheduler({})
    with pytest.raises(MisconfigurationError, match="both set the accumulation"):
        Trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[GradientAccumulationScheduler({1: 2})],
                **QUIET).fit(Linear(), batches(2))


def test_tqdm_progress_bar_is_the_rich_bar_under_lightnings_name():
    bar = TQDMProgressBar(refresh_rate=0)
    trainer = Trainer(max_epochs=1, callbacks=[bar], **{**QUIET, "enable_progress_bar": True})
    assert [c for c in trainer.callbacks if isinstance(c, RichProgressBar)] == [bar]
    trainer.fit(Linear(), batches(2))
    assert trainer.global_step == 2
    with pytest.warns(UserWarning, match="process_position=1.* has no effect"):
        TQDMProgressBar(process_position=1)


class Manual(Linear):
    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        assert isinstance(optimizer, LightningOptimizer)
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


def test_manual_optimization_hands_out_a_lightning_optimizer():
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(Manual(), batches(3))
    assert trainer.global_step == 3


class EarlyStoppingAtTrainEnd(EarlyStopping):
    """Lightning's documented override: check once, at the end of training, instead of after validation."""

    def on_validation_end(self, trainer, module):
        pass

    def on_train_end(self, trainer, module):
        self._run_early_stopping_check(trainer)


def test_early_stopping_checked_from_on_train_end_through_lightnings_override_point():
    stopper = EarlyStoppingAtTrainEnd("score", stopping_threshold=1.5, check_on_train_epoch_end=False)
    trainer = Trainer(max_epochs=3, callbacks=[stopper], **QUIET)
    trainer.fit(LogsConstant([3.0, 2.0, 1.0]), batches(1), batches(1))
    assert trainer.current_epoch == 3  # no check stopped the fit: the epochs' validations were not checked
    assert stopper.stopping_reason is EarlyStoppingReason.STOPPING_THRESHOLD  # the one check, at the end, saw 1.0
    assert stopper.stopping_reason_message == "'score' = 1 passed stopping_threshold=1.5. Stopping."
    assert stopper.stopped_epoch == 3
