"""The training step's two paths: TrainStep.plain_step, taken where a fit uses none of the general path's branches,
must do exactly what the general path does; and self.log's shortcut for a value it has checked before must store
what its checks would have."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.errors import MisconfigurationError, NonFiniteLossError
from torchyard.trainer.loop.step import TrainStep

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
             num_sanity_val_steps=0)


def data(samples: int = 40) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 5, generator=generator)
    return TensorDataset(x, torch.randint(0, 3, (samples,), generator=generator))


class Classifier(TrainModule):
    def __init__(self, returns: str = "tensor", skip_batch: int | None = None, nan_at_step: int | None = None) -> None:
        super().__init__()
        self.returns, self.skip_batch, self.nan_at_step = returns, skip_batch, nan_at_step
        self.net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))

    def training_step(self, batch, batch_idx):
        if batch_idx == self.skip_batch:
            return None
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.global_step == self.nan_at_step:
            loss = loss * math.nan
        self.log("loss", loss, prog_bar=True)
        self.log("twice", loss * 2, on_step=True, on_epoch=True)
        return {"loss": loss, "size": len(y)} if self.returns == "dict" else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class NoOpZeroGradHook(Callback):
    """Overrides a per-step hook, which sends every step down the general path."""

    def on_before_zero_grad(self, trainer, module, optimizer):
        pass


@pytest.fixture
def plain_steps(monkeypatch):
    """The batches TrainStep.plain_step ran."""
    calls = []
    plain_step = TrainStep.plain_step

    def counted(self, batch, batch_idx, is_last):
        calls.append(batch_idx)
        return plain_step(self, batch, batch_idx, is_last)

    monkeypatch.setattr(TrainStep, "plain_step", counted)
    return calls


def fit(tmp_path, name: str, module_options: dict, general: bool, **options) -> tuple[Classifier, Trainer]:
    torch.manual_seed(3)
    module = Classifier(**module_options)
    trainer = Trainer(max_epochs=2, seed=5, default_root_dir=str(tmp_path / name), log_every_n_steps=2,
                      callbacks=[NoOpZeroGradHook()] if general else [], **QUIET, **options)
    trainer.fit(module, DataLoader(data(), batch_size=8, shuffle=True))
    return module, trainer


def csv_rows(trainer: Trainer) -> list[dict[str, str]]:
    with open(f"{trainer.logger.log_dir}/metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize(
    ("module_options", "options"),
    [
        pytest.param({}, {}, id="loss"),
        pytest.param({"returns": "dict"}, {}, id="dict"),
        pytest.param({"skip_batch": 2}, {}, id="a-skipped-batch"),
        pytest.param({"nan_at_step": 3}, {"nonfinite_loss": "skip"}, id="a-skipped-nan-step"),
    ],
)
def test_the_plain_step_trains_what_the_general_step_trains(tmp_path, plain_steps, module_options, options):
    general, general_trainer = fit(tmp_path, "general", module_options, general=True, **options)
    assert plain_steps == []
    plain, plain_trainer = fit(tmp_path, "plain", module_options, general=False, **options)
    assert plain_steps == [0, 1, 2, 3, 4] * 2  # every batch of both epochs

    for key, value in general.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    general_state = general_trainer.optimizers[0].state_dict()["state"]
    plain_state = plain_trainer.optimizers[0].state_dict()["state"]
    assert all(torch.equal(plain_state[i]["momentum_buffer"], general_state[i]["momentum_buffer"])
               for i in general_state)
    assert plain_trainer.global_step == general_trainer.global_step
    assert plain_trainer.callback_metrics.keys() == general_trainer.callback_metrics.keys()
    assert all(torch.allclose(plain_trainer.callback_metrics[k], v, rtol=0, atol=0, equal_nan=True)
               for k, v in general_trainer.callback_metrics.items())
    assert str(plain_trainer.progress_bar_metrics) == str(general_trainer.progress_bar_metrics)  # nan != nan
    assert csv_rows(plain_trainer) == csv_rows(general_trainer)


def test_a_nonfinite_loss_stops_the_plain_step_before_its_optimizer_step(tmp_path, plain_steps):
    torch.manual_seed(3)
    module = Classifier(nan_at_step=3)
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), **QUIET)
    before: list[dict[str, torch.Tensor]] = []

    class KeepWeights(Callback):
        def on_train_epoch_start(self, trainer, module):
            before.append({k: v.clone() for k, v in module.state_dict().items()})

    trainer.callbacks.append(KeepWeights())
    with pytest.raises(NonFiniteLossError, match="at global step 3"):
        trainer.fit(module, DataLoader(data(), batch_size=8))
    assert plain_steps == [0, 1, 2, 3]
    assert trainer.global_step == 3
    assert all(torch.isfinite(value).all() for value in module.state_dict().values())


def test_a_fit_with_accumulation_or_a_step_hook_takes_the_general_path(tmp_path, plain_steps):
    fit(tmp_path, "accumulate", {}, general=False, accumulate_grad_batches=2)
    fit(tmp_path, "clip", {}, general=False, gradient_clip_val=1.0)
    fit(tmp_path, "hook", {}, general=True)
    assert plain_steps == []


class LogsVariously(TrainModule):
    """Logs `value` with each step's own options and type, so that self.log's shortcut must step aside."""

    STEPS = [
        ({"prog_bar": True}, torch.tensor(1.0, requires_grad=True) * 1),
        ({"prog_bar": True}, torch.tensor(2.0, requires_grad=True) * 1),  # the shortcut
        ({"prog_bar": True}, 3),  # a Python number
        ({"prog_bar": True}, torch.tensor(4.0, dtype=torch.float16)),  # kept as float32
        ({"prog_bar": False}, torch.tensor(5.0)),  # other options: the first call's prog_bar and logger hold
        ({"prog_bar": True}, torch.tensor(6.0, dtype=torch.float64)),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[tuple[float, torch.dtype, bool, bool]] = []

    def training_step(self, batch, batch_idx):
        options, value = self.STEPS[batch_idx]
        self.log("value", value, **options)
        metrics = self.trainer.callback_metrics
        self.seen.append((float(metrics["value"]), metrics["value"].dtype, metrics["value"].requires_grad,
                          "value" in self.trainer.progress_bar_metrics))
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_self_log_stores_what_its_checks_would_whatever_a_repeated_call_changes(tmp_path):
    module = LogsVariously()
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), log_every_n_steps=1, **QUIET)
    trainer.fit(module, DataLoader(TensorDataset(torch.ones(6, 1)), batch_size=1))
    assert module.seen == [
        (1.0, torch.float32, False, True),
        (2.0, torch.float32, False, True),
        (3.0, torch.float32, False, True),
        (4.0, torch.float32, False, True),
        (5.0, torch.float32, False, True),
        (6.0, torch.float64, False, True),
    ]
    assert [float(row["value"]) for row in csv_rows(trainer)] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


class BadRepeat(TrainModule):
    def __init__(self, bad: dict) -> None:
        super().__init__()
        self.layer, self.bad = nn.Linear(1, 1), bad

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).sum()
        self.log("value", loss)
        self.log("value", loss)  # the shortcut from here on
        if batch_idx == 1:
            self.log("value", **self.bad)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"value": torch.ones(2)}, "got a tensor of shape"),
        ({"value": torch.tensor(1.0), "reduce_fx": "median"}, "reduce_fx='median'"),
        ({"value": "text"}, "got str"),
    ],
)
def test_a_bad_value_logged_under_a_checked_name_is_still_refused(tmp_path, bad, message):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    with pytest.raises(MisconfigurationError, match=message):
        trainer.fit(BadRepeat(bad), DataLoader(TensorDataset(torch.ones(3, 1)), batch_size=1))


class LogsSometimes(TrainModule):
    """Logs `every` each step; `even` (not to the logger), `shown` (to the bar) and `sometimes` on even steps only;
    at step 4 `every` once more inside a recording (the pipeline's last stage records what it logs for other ranks),
    where it must be recorded, not stored."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.records: list[tuple[str, float, tuple]] = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).sum()
        self.log("every", loss * 1)
        if batch_idx % 2 == 0:
            self.log("sometimes", loss * 2)
            self.log("even", loss * 3, logger=False)
            self.log("shown", loss * 4, prog_bar=True, rank_zero_only=True, sync_dist=True)
        if batch_idx == 4:  # `every` takes self.log's shortcut by now, which must not bypass the recording
            with self.trainer.metrics.recording(lambda value: float(value.detach())) as records:
                self.log("every", loss * 5)
            self.records = records
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_step_row_holds_only_what_that_step_logged_shortcut_or_not(tmp_path):
    module = LogsSometimes()
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), log_every_n_steps=1, **QUIET)
    trainer.fit(module, DataLoader(TensorDataset(torch.arange(6.0).unsqueeze(1)), batch_size=1))
    weight, bias = module.layer.weight.item(), module.layer.bias.item()  # lr=0: each step's loss is x * w + b
    loss = [x * weight + bias for x in range(6)]
    rows = [{name: float(value) for name, value in row.items() if value and name not in ("epoch", "step")}
            for row in csv_rows(trainer)]
    assert rows == [
        {"every": pytest.approx(loss[i]), **({"sometimes": pytest.approx(2 * loss[i]),
                                              "shown": pytest.approx(4 * loss[i])} if i % 2 == 0 else {})}
        for i in range(6)
    ]
    # The last values stay visible where each went: callbacks see all, the bar only `shown`.
    assert {name: float(value) for name, value in trainer.callback_metrics.items()} == pytest.approx(
        {"every": loss[5], "sometimes": 2 * loss[4], "even": 3 * loss[4], "shown": 4 * loss[4]})
    assert trainer.progress_bar_metrics == pytest.approx({"shown": 4 * loss[4]})
    assert module.records == [("every", pytest.approx(5 * loss[4]), (False, True, None, None, "mean", False, None,
                                                                      True))]
