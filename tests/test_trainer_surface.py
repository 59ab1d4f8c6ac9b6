"""The Trainer's entry points and options: what runs, how often, in which order, and what comes back."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback, EarlyStopping, ModelCheckpoint, RichProgressBar
from torchyard.trainer import DataModule, Trainer, TrainModule
from torchyard.trainer.errors import MisconfigurationError, NonFiniteLossError
from torchyard.trainer.optim import check_closure_optimizer

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
             accelerator="cpu")


def dataset(samples: int = 20) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 3, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def loader(samples: int = 20, batch_size: int = 4) -> DataLoader:
    return DataLoader(dataset(samples), batch_size=batch_size)


class Counting(TrainModule):
    """Counts its step calls and logs a loss per stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.calls = {"train": 0, "val": 0, "test": 0, "predict": 0}

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        self.calls["train"] += 1
        return F.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.calls["val"] += 1
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.calls["test"] += 1
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self.calls["predict"] += 1
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class CountValidations(Callback):
    def __init__(self) -> None:
        self.at: list[tuple[int, int]] = []  # (epoch, global_step) of each validation outside the sanity check

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.at.append((trainer.current_epoch, trainer.global_step))


def test_validate_and_test_print_a_results_table_unless_verbose_is_false_and_take_lightnings_argument_order(
        tmp_path, capsys):
    module = Counting()
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(module, loader())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    capsys.readouterr()
    # Lightning: (model, dataloaders, ckpt_path)
    [tested] = trainer.test(module, loader(batch_size=6), tmp_path / "a.ckpt")
    table = capsys.readouterr().out
    assert "test results" in table and "test_loss" in table and f"{tested['test_loss']:.6g}" in table
    trainer.validate(module, [loader(8), loader(4)], verbose=False)
    assert capsys.readouterr().out == ""
    trainer.validate(module, [loader(8), loader(4)])
    table = capsys.readouterr().out
    assert "dataloader 0" in table and "dataloader 1" in table and "val_loss/dataloader_idx_1" in table


def test_validate_and_test_return_metric_dicts_and_predict_keeps_order(tmp_path):
    module = Counting()
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(module, loader())
    x, y = dataset().tensors
    with torch.no_grad():
        expected = F.mse_loss(module(x), y)
    [validated] = trainer.validate(module, loader(batch_size=6))  # 6, 6, 6, 2: weighted by batch size
    [tested] = trainer.test(module, loader(batch_size=6))
    assert validated == {"val_loss": pytest.approx(float(expected), rel=1e-5)}
    assert tested == {"test_loss": pytest.approx(float(expected), rel=1e-5)}

    predictions = trainer.predict(module, loader(batch_size=6))
    assert [len(p) for p in predictions] == [6, 6, 6, 2]
    with torch.no_grad():  # batch by batch: a matmul's rounding may depend on its batch size
        assert torch.equal(torch.cat(predictions), torch.cat([module(x[i:i + 6]) for i in range(0, len(x), 6)]))
    assert len(trainer.predict(module, [loader(8), loader(4)])) == 2  # one list per loader

    # test(ckpt_path=...) evaluates the checkpoint's weights, not the module's current ones.
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    with torch.no_grad():
        module.layer.weight.add_(10.0)
    assert trainer.test(module, loader(batch_size=6), ckpt_path=tmp_path / "a.ckpt") == [tested]


class Logits(TrainModule):
    """TrainModule's own predict_step; a validation_step that does not take dataloader_idx."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def forward(self, x):
        return self.layer(x)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))


def test_several_evaluation_loaders_keep_their_metrics_apart_as_in_lightning():
    module, trainer = Counting(), Trainer(**QUIET)
    sets = [dataset(20), TensorDataset(torch.randn(10, 3), torch.randn(10, 1))]
    with torch.no_grad():
        expected = [float(F.mse_loss(module(data.tensors[0]), data.tensors[1])) for data in sets]
    results = trainer.validate(module, [DataLoader(data, batch_size=6) for data in sets])
    assert results == [{"val_loss/dataloader_idx_0": pytest.approx(expected[0], rel=1e-5)},
                       {"val_loss/dataloader_idx_1": pytest.approx(expected[1], rel=1e-5)}]
    inputs = [data.tensors[0] for data in sets]
    predictions = trainer.predict(Logits(), [DataLoader(x, batch_size=8) for x in inputs])  # the default step
    assert [len(batches) for batches in predictions] == [3, 2]
    with pytest.raises(MisconfigurationError, match=r"2 dataloaders were given, but Logits.validation_step takes no "
                                                    r"dataloader_idx; define it as validation_step\(self, batch, "
                                                    r"batch_idx, dataloader_idx=0\)"):
        trainer.validate(Logits(), [DataLoader(data, batch_size=6) for data in sets])


def test_fast_dev_run_runs_one_batch_and_writes_nothing(tmp_path):
    module = Counting()
    trainer = Trainer(fast_dev_run=True, max_epochs=5, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader(), loader())
    assert module.calls == {"train": 1, "val": 1, "test": 0, "predict": 0}
    assert trainer.global_step == 1
    trainer.test(module, loader())
    assert module.calls["test"] == 1
    assert os.listdir(tmp_path) == []  # the test runs in tmp_path: no runs/, no checkpoint, no metrics


@pytest.mark.parametrize(("limit", "batches"), [(3, 3), (0.5, 2), (1.0, 5), (100, 5)])
def test_limit_batches(limit, batches):
    module = Counting()
    trainer = Trainer(max_epochs=2, num_sanity_val_steps=0, limit_train_batches=limit, limit_val_batches=limit,
                      limit_test_batches=limit, limit_predict_batches=limit, **QUIET)
    trainer.fit(module, loader(), loader())
    trainer.test(module, loader())
    trainer.predict(module, loader())
    assert module.calls == {"train": 2 * batches, "val": 2 * batches, "test": batches, "predict": batches}


@pytest.mark.parametrize(
    ("interval", "steps_of_validation"),
    [
        (1.0, [5, 10]),
        (0.5, [2, 4, 5, 7, 9, 10]),  # every int(5 * 0.5) = 2 batches, and at each epoch end
        (2, [2, 4, 5, 7, 9, 10]),
        (5, [5, 10]),
    ],
)
def test_val_check_interval(interval, steps_of_validation):
    counter = CountValidations()
    module = Counting()
    Trainer(max_epochs=2, val_check_interval=interval, callbacks=[counter], **QUIET).fit(module, loader(), loader(8))
    assert [step for _, step in counter.at] == steps_of_validation
    assert module.calls["val"] == 2 * len(steps_of_validation) + 2  # 2 batches each, plus 2 sanity batches


def test_check_val_every_n_epoch():
    counter = CountValidations()
    Trainer(max_epochs=4, check_val_every_n_epoch=2, callbacks=[counter], **QUIET).fit(Counting(), loader(), loader())
    assert counter.at == [(1, 10), (3, 20)]


@pytest.mark.parametrize(("accumulate", "max_steps", "batches"), [(1, 7, 7), (2, 4, 7), (2, 3, 5)])
def test_max_steps_stops_exactly(accumulate, max_steps, batches):
    # 5 batches per epoch; with accumulate 2 an epoch makes 3 steps (after batches 2, 4 and the tail batch 5).
    module = Counting()
    trainer = Trainer(max_steps=max_steps, accumulate_grad_batches=accumulate, **QUIET)
    trainer.fit(module, loader())
    assert trainer.global_step == max_steps
    assert module.calls["train"] == batches


class SkipsFromThirdBatch(Counting):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 2 else None


def test_on_train_batch_start_returning_minus_one_skips_the_rest_of_that_epoch_only():
    module, validations = SkipsFromThirdBatch(), CountValidations()
    trainer = Trainer(max_epochs=3, callbacks=[validations], num_sanity_val_steps=0, **QUIET)
    trainer.fit(module, loader(), loader())
    assert module.calls["train"] == 6 and trainer.global_step == 6  # batches 0 and 1 of each of the 3 epochs
    assert trainer.current_epoch == 3 and validations.at == [(0, 2), (1, 4), (2, 6)]  # each epoch ended and validated


class StopAtFirstEpochEnd(Callback):
    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = True


@pytest.mark.parametrize(("min_epochs", "epochs"), [(0, 1), (3, 3)])
def test_min_epochs_overrides_should_stop(min_epochs, epochs):
    module = Counting()
    trainer = Trainer(max_epochs=10, min_epochs=min_epochs, callbacks=[StopAtFirstEpochEnd()], **QUIET)
    trainer.fit(module, loader())
    assert trainer.current_epoch == epochs
    assert module.calls["train"] == 5 * epochs


def test_max_epochs_minus_one_runs_until_max_steps():
    trainer = Trainer(max_epochs=-1, max_steps=23, **QUIET)
    trainer.fit(Counting(), loader())
    assert (trainer.global_step, trainer.current_epoch) == (23, 4)


class RecordingDataModule(DataModule):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")

    def train_dataloader(self):
        self.calls.append("train_dataloader")
        return loader()

    def val_dataloader(self):
        self.calls.append("val_dataloader")
        return loader()

    def test_dataloader(self):
        self.calls.append("test_dataloader")
        return loader()


def test_datamodule_hook_order():
    datamodule = RecordingDataModule()
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(Counting(), datamodule=datamodule)
    assert datamodule.calls == ["prepare_data", "setup:fit", "train_dataloader", "val_dataloader", "teardown:fit"]
    datamodule.calls.clear()
    trainer.test(datamodule=datamodule)  # the module from fit, the datamodule given here
    assert datamodule.calls == ["prepare_data", "setup:test", "test_dataloader", "teardown:test"]


class OwnData(Counting):
    """A LightningModule-style module that brings its own data; records its data hooks in order."""

    def __init__(self) -> None:
        super().__init__()
        self.data_calls: list[str] = []

    def prepare_data(self):
        self.data_calls.append("prepare_data")

    def setup(self, stage):
        self.data_calls.append(f"setup:{stage}")

    def train_dataloader(self):
        self.data_calls.append("train_dataloader")
        return loader(samples=16)

    def val_dataloader(self):
        self.data_calls.append("val_dataloader")
        return loader(samples=8)

    def test_dataloader(self):
        self.data_calls.append("test_dataloader")
        return loader(samples=12)

    def predict_dataloader(self):
        self.data_calls.append("predict_dataloader")
        return loader(samples=4)


def test_a_module_that_brings_its_own_dataloaders_runs_every_stage_on_them():
    module, given = OwnData(), Counting()
    given.load_state_dict(module.state_dict())
    trainer = Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET)
    trainer.fit(module)
    assert module.data_calls == ["prepare_data", "setup:fit", "train_dataloader", "val_dataloader"]
    assert module.calls["train"] == 2 * 4 and module.calls["val"] == 2 * 2
    # The same loaders passed in train the same weights.
    Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET).fit(given, loader(samples=16), loader(samples=8))
    assert torch.equal(module.layer.weight, given.layer.weight)

    module.data_calls.clear()
    trainer.test(module)
    trainer.predict(module)
    assert module.data_calls == ["prepare_data", "setup:test", "test_dataloader",
                                 "prepare_data", "setup:predict", "predict_dataloader"]
    assert module.calls["test"] == 3 and module.calls["predict"] == 1

    # Loaders passed in win; the one not passed (validation) still comes from the module, as in Lightning.
    module.data_calls.clear()
    Trainer(max_epochs=1, num_sanity_val_steps=0, **QUIET).fit(module, loader(samples=4))
    assert module.data_calls == ["prepare_data", "setup:fit", "val_dataloader"]
    # A datamodule wins over the module's own loaders.
    module.data_calls.clear()
    datamodule = RecordingDataModule()
    Trainer(max_epochs=1, **QUIET).fit(module, datamodule=datamodule)
    assert datamodule.calls[:3] == ["prepare_data", "setup:fit", "train_dataloader"]
    assert module.data_calls == ["prepare_data", "setup:fit"]  # after the datamodule's, as in Lightning


class Recorder(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []


def _recording(name: str):
    def hook(self, trainer, module, *args):
        self.calls.append(name)

    return hook


for _name in [n for n in vars(Callback) if n.startswith("on_") or n in ("setup", "teardown")]:
    setattr(Recorder, _name, _recording(_name))

VALIDATION = ["on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
              "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end"]
MICRO_BATCH = ["on_train_batch_start", "on_before_backward", "on_after_backward"]
STEP = ["on_before_optimizer_step", "on_before_zero_grad"]


def test_callback_hook_order_matches_the_documented_loop():
    recorder = Recorder()
    trainer = Trainer(max_epochs=1, accumulate_grad_batches=2, num_sanity_val_steps=1, callbacks=[recorder], **QUIET)
    trainer.fit(Counting(), loader(samples=8), loader(samples=4))
    assert recorder.calls == [
        "setup", "on_fit_start",
        "on_sanity_check_start", *VALIDATION, "on_sanity_check_end",
        "on_train_start", "on_train_epoch_start",
        *MICRO_BATCH, "on_train_batch_end",
        *MICRO_BATCH, *STEP, "on_train_batch_end",
        *VALIDATION,
        "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
    ]


def test_a_step_calls_only_the_hooks_in_use():
    trainer = Trainer(max_epochs=1, callbacks=[ModelCheckpoint()], **{**QUIET, "enable_checkpointing": True})
    trainer.fit(Counting(), loader())
    # ModelCheckpoint overrides on_train_batch_end, but saves at epoch ends only: it is not called per batch.
    hooks = ("train_batch_start", "after_backward", "train_batch_end")
    assert [trainer.hooks.bound(f"on_{name}") for name in hooks] == [None] * 3
    every_step = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    recorder = Recorder()
    trainer = Trainer(max_epochs=1, callbacks=[every_step, recorder], **{**QUIET, "enable_checkpointing": True})
    trainer.fit(Counting(), loader())
    assert recorder.calls.count("on_train_batch_end") == 5
    assert {Path(p).name for p in every_step.best_k_models} == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}


class FailingStep(Counting):
    def training_step(self, batch, batch_idx):
        raise KeyError("boom")


def test_exception_reaches_callbacks_and_teardown_still_runs():
    recorder = Recorder()
    with pytest.raises(KeyError, match="boom"):
        Trainer(max_epochs=1, callbacks=[recorder], **QUIET).fit(FailingStep(), loader())
    assert recorder.calls[-2:] == ["on_exception", "teardown"]


class ManualSteps(Counting):
    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
        optimizer.step()


@pytest.mark.parametrize(("options", "named"), [
    ({"gradient_clip_val": 1.0}, "gradient_clip_val=1.0 (clip in training_step"),
    ({"accumulate_grad_batches": 2}, "accumulate_grad_batches=2 (step every n batches"),
])
def test_options_that_manual_optimization_would_ignore_are_refused_before_it_starts(options, named):
    module = ManualSteps()
    with pytest.raises(
        MisconfigurationError, match=r"ManualSteps sets automatic_optimization=False.*" + re.escape(named)
    ):
        Trainer(max_epochs=1, **QUIET, **options).fit(module, loader())
    assert module.calls["train"] == 0


def test_one_callback_may_be_given_without_a_list():
    checkpoint = ModelCheckpoint(save_last=True)
    assert Trainer(callbacks=checkpoint, **{**QUIET, "enable_checkpointing": True}).checkpoint_callback is checkpoint


@pytest.mark.parametrize(("option", "callback"), [("enable_checkpointing", ModelCheckpoint()),
                                                  ("enable_progress_bar", RichProgressBar())])
def test_a_callback_its_own_option_turns_off_is_refused(option, callback):
    with pytest.raises(MisconfigurationError, match=rf"{option}=False, but callbacks has a {type(callback).__name__}; "
                                                    "drop one of the two"):
        Trainer(callbacks=[callback], **{**QUIET, option: False})


def test_fast_dev_run_leaves_a_given_checkpoint_callback_and_early_stopping_idle(tmp_path):
    # Outside fast_dev_run, an EarlyStopping on a key never logged is an error at the first check.
    checkpoint, stopping = ModelCheckpoint(dirpath=tmp_path / "ckpts"), EarlyStopping("never_logged")
    trainer = Trainer(fast_dev_run=2, callbacks=[checkpoint, stopping], enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(Counting(), loader(), loader())
    assert trainer.global_step == 2
    assert not (tmp_path / "ckpts").exists()


def test_a_stage_called_after_fit_without_a_module_evaluates_the_best_checkpoint(tmp_path):
    class WorseEachEpoch(Counting):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val_score", float(self.current_epoch))  # the best checkpoint is epoch 0's

    checkpoint = ModelCheckpoint(monitor="val_score", mode="min")
    trainer = Trainer(max_epochs=3, callbacks=[checkpoint], **{**QUIET, "enable_checkpointing": True},
                      default_root_dir=str(tmp_path))
    module = WorseEachEpoch()
    trainer.fit(module, loader(), loader())
    final = module.layer.weight.detach().clone()
    best = torch.load(checkpoint.best_model_path, weights_only=True)["state_dict"]["layer.weight"]
    assert not torch.equal(best, final)
    with pytest.warns(UserWarning, match=r"Trainer.test was called without a module: it uses the previous fit's best "
                                         r"checkpoint, .*epoch=0"):
        trainer.test(dataloaders=loader(), verbose=False)
    assert torch.equal(module.layer.weight, best)
    trainer.test(module, loader(), verbose=False)  # a module given: its own weights, no warning


def test_limit_val_batches_zero_turns_validation_off_and_the_sanity_check_follows_the_limit():
    module = Counting()
    Trainer(max_epochs=2, limit_val_batches=0, **QUIET).fit(module, loader(), loader())
    assert module.calls["val"] == 0 and module.calls["train"] == 10
    module = Counting()
    trainer = Trainer(max_epochs=1, limit_val_batches=3, num_sanity_val_steps=-1, **QUIET)
    trainer.fit(module, loader(), loader())
    assert module.calls["val"] == 3 + 3  # the sanity check's (all a validation runs: 3), then the epoch's


def test_training_does_not_depend_on_whether_a_sanity_check_ran():
    class Dropping(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.layer(self.drop(x))

        def on_validation_epoch_end(self):
            torch.rand(1)  # a hook that draws from the global RNG too

    weights = []
    for sanity in (0, 2):
        torch.manual_seed(0)
        module = Dropping()
        val = DataLoader(dataset(20), batch_size=4, shuffle=True)  # its iterator draws a seed from the global RNG
        Trainer(max_epochs=2, seed=1, num_sanity_val_steps=sanity, **QUIET).fit(module, loader(), val)
        weights.append(module.layer.weight.detach().clone())
    assert torch.equal(*weights)


def test_a_ctrl_c_that_comes_after_the_last_step_still_stops_the_script():
    class InterruptedInLastValidation(Counting):
        def on_validation_start(self):
            if self.trainer.current_epoch == 1:
                os.kill(os.getpid(), signal.SIGINT)  # after the fit's last step boundary

    handler = signal.getsignal(signal.SIGINT)
    trainer = Trainer(max_epochs=2, num_sanity_val_steps=0, **QUIET)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(InterruptedInLastValidation(), loader(), loader())
    assert trainer.global_step == 10 and signal.getsignal(signal.SIGINT) is handler


def test_lightning_calls_and_names_port_unchanged(tmp_path):
    """The forms Lightning's docs and tutorials use: model=, a DataModule in the loaders' place, steps without
    batch_idx, estimated_stepping_batches for OneCycleLR, module.logger/print/freeze/all_gather, and Lightning's
    names for the Trainer's settings."""
    class Tutorial(Counting):
        def training_step(self, batch):  # no batch_idx, as in Lightning's GAN tutorial
            return super().training_step(batch, None)

        def validation_step(self, batch):
            self.calls["val"] += 1
            self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
            self.total_steps = self.trainer.estimated_stepping_batches
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.total_steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class Data(DataModule):
        def train_dataloader(self):
            return loader(samples=20)

        def val_dataloader(self):
            return loader(samples=8)

        def test_dataloader(self):
            return loader(samples=8)

    module = Tutorial()
    trainer = Trainer(max_epochs=3, accumulate_grad_batches=2, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
                      log_every_n_steps=1, **{**QUIET, "logger": True})
    trainer.fit(model=module, train_dataloaders=Data())  # Lightning's keyword, and a DataModule in the loaders' place
    assert module.total_steps == 3 * 3 == trainer.global_step  # 5 batches, accumulated in 2s: 3 steps an epoch
    assert module.calls == {"train": 15, "val": 3 * 2, "test": 0, "predict": 0}
    assert trainer.test(module, Data(), verbose=False)[0].keys() == {"test_loss"}
    # loaders beat the fit's datamodule
    assert trainer.predict(model=module, dataloaders=loader(samples=4))[0].shape == (4, 1)
    assert module.logger is trainer.logger is trainer.loggers[0] and module.loggers == trainer.loggers
    assert (trainer.lightning_module, trainer.model, trainer.precision, trainer.accumulate_grad_batches) == (
        module,
        module,
        "32",
        2,
    )
    assert trainer.num_val_batches == [2] and trainer.default_root_dir == str(tmp_path)
    assert torch.equal(module.all_gather(torch.ones(2)), torch.ones(2))  # one process: unchanged
    module.freeze()
    assert not module.training and not any(p.requires_grad for p in module.parameters())
    module.unfreeze()
    assert module.training and all(p.requires_grad for p in module.parameters())
    with pytest.raises(MisconfigurationError, match="pass the module once"):
        trainer.fit(Counting(), loader(), module=Counting())


def test_lightning_hooks_this_trainer_does_not_call_are_refused_not_ignored():
    class Sharded(Counting):
        def configure_sharded_model(self):
            self.extra = nn.Linear(3, 1)

    with pytest.raises(
        MisconfigurationError,
        match=r"Sharded defines configure_sharded_model, Lightning hook\(s\) this "
        r"Trainer does not call, so they would silently do nothing. Instead: "
        r"configure_sharded_model: rename it configure_model",
    ):
        Trainer(**QUIET).fit(Sharded(), loader())


class OwnOptimizerHooks(Counting):
    """Lightning's three optimizer hooks overridden: a learning-rate warm-up in optimizer_step, gradients kept
    over pairs of steps by optimizer_zero_grad, and clipping by value in configure_gradient_clipping."""

    def __init__(self) -> None:
        super().__init__()
        self.closure_losses: list[float] = []
        self.clip_arguments: set[tuple] = set()
        self.rates_before_step: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        self.rates_before_step.append(optimizer.param_groups[0]["lr"])

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * min(1.0, (self.trainer.global_step + 1) / 3)
        self.closure_losses.append(float(optimizer.step(closure=optimizer_closure)))

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if self.trainer.global_step % 2 == 1:  # called before global_step counts this step
            optimizer.zero_grad()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_arguments.add((gradient_clip_val, gradient_clip_algorithm))
        self.clip_gradients(optimizer, 0.1, "value")


def test_a_modules_optimizer_hooks_step_zero_and_clip_as_a_hand_written_loop_does():
    torch.manual_seed(0)
    module = OwnOptimizerHooks()
    reference = nn.Linear(3, 1)
    reference.load_state_dict(module.layer.state_dict())
    trainer = Trainer(max_epochs=2, gradient_clip_val=5.0, **QUIET)
    trainer.fit(module, loader(20))  # 5 steps an epoch, in order

    optimizer, losses, step = torch.optim.SGD(reference.parameters(), lr=0.05), [], 0
    for _ in range(2):
        for x, y in loader(20):
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_value_(reference.parameters(), 0.1)
            optimizer.param_groups[0]["lr"] = 0.05 * min(1.0, (step + 1) / 3)
            optimizer.step()
            losses.append(loss.item())
            if step % 2 == 1:
                optimizer.zero_grad()
            step += 1
    assert module.closure_losses == losses  # the closure gives the step's loss
    # As in Lightning, inside the override's optimizer.step(): after its body set the warm-up's rate.
    assert module.rates_before_step == [0.05 * min(1.0, (step + 1) / 3) for step in range(10)]

    class SteppingTwice(Counting):
        def __init__(self):
            super().__init__()
            self.before_steps = 0

        def on_before_optimizer_step(self, optimizer):
            self.before_steps += 1

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            optimizer.step(closure=optimizer_closure)
            optimizer.step(closure=optimizer_closure)

    twice = SteppingTwice()
    Trainer(max_epochs=1, **QUIET).fit(twice, loader(20))
    assert (twice.calls["train"], twice.before_steps) == (10, 10)  # once per step() call, as in Lightning
    assert module.clip_arguments == {(5.0, "norm")}  # the Trainer's settings, which the override may ignore
    for name, tensor in reference.state_dict().items():
        assert torch.equal(module.layer.state_dict()[name], tensor), name


def with_reference_layer(module: Counting) -> tuple[Counting, nn.Linear]:
    """`module` and a plain layer holding its layer's weights, for a hand-written loop to train alike."""
    reference = nn.Linear(3, 1)
    reference.load_state_dict(module.layer.state_dict())
    return module, reference


class WithLBFGS(Counting):
    """LBFGS under automatic optimization, as Lightning allows: its step evaluates the loss several times."""

    def __init__(self, own_step: bool = False) -> None:
        super().__init__()
        self.own_step, self.before_steps, self.step_results, self.batch_end_losses = own_step, 0, [], []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.before_steps += 1

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_end_losses.append(float(outputs["loss"]))  # Lightning passes {"loss": the detached loss}

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=4, history_size=3)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if not self.own_step:
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.step_results.append(optimizer.step(closure=optimizer_closure))


@pytest.mark.parametrize("own_step", [False, True], ids=["trainer_steps", "module_optimizer_step"])
def test_lbfgs_evaluates_the_loss_again_through_the_closure_as_a_hand_written_loop_does(own_step):
    module, reference = with_reference_layer(WithLBFGS(own_step))
    trainer = Trainer(max_epochs=2, gradient_clip_val=0.5, **QUIET)
    trainer.fit(module, loader(20))

    optimizer = torch.optim.LBFGS(reference.parameters(), lr=0.1, max_iter=4, history_size=3)
    evaluations, first_losses, last_losses = 0, [], []
    for _ in range(2):
        for x, y in loader(20):
            step_losses = []

            def closure(x=x, y=y, step_losses=step_losses):
                nonlocal evaluations
                evaluations += 1
                optimizer.zero_grad()
                loss = F.mse_loss(reference(x), y)
                loss.backward()
                # after every evaluation, as Lightning
                torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5)
                step_losses.append(float(loss.detach()))
                return loss
            first_losses.append(float(optimizer.step(closure).detach()))
            last_losses.append(step_losses[-1])
    assert evaluations > 10  # LBFGS did evaluate again: the test covers the closure's later calls
    assert module.calls["train"] == module.before_steps == evaluations
    assert trainer.global_step == 10
    if own_step:
        assert [float(loss) for loss in module.step_results] == first_losses  # step returns the first evaluation's loss
    # on_train_batch_end gets the last evaluation's output, as in Lightning
    assert module.batch_end_losses == last_losses
    for name, tensor in reference.state_dict().items():
        assert torch.equal(module.layer.state_dict()[name], tensor), name


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as its users write it: the step moves the weights up the gradient, calls the
    closure for the gradient there, and steps from the original weights with it."""

    def __init__(self, params, lr=0.1, rho=0.05):
        super().__init__(params, {"lr": lr, "rho": rho})

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "SAM needs its closure"
        params = [p for group in self.param_groups for p in group["params"]]
        norm = torch.stack([p.grad.norm() for p in params]).norm()
        moves = [p.grad * self.defaults["rho"] / (norm + 1e-12) for p in params]
        for p, move in zip(params, moves):
            p.add_(move)
        with torch.enable_grad():
            loss = closure()
        for p, move in zip(params, moves):
            p.sub_(move).add_(p.grad, alpha=-self.defaults["lr"])
        return loss


class WithSAM(WithLBFGS):
    def configure_optimizers(self):
        return SAM(self.parameters())


@pytest.mark.parametrize("own_step", [False, True], ids=["trainer_steps", "module_optimizer_step"])
def test_an_optimizer_that_calls_its_closure_after_moving_the_weights_gets_a_new_evaluation(own_step):
    module, reference = with_reference_layer(WithSAM(own_step))
    Trainer(max_epochs=1, **QUIET).fit(module, loader(20))

    optimizer = SAM(reference.parameters())
    for x, y in loader(20):
        F.mse_loss(reference(x), y).backward()

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            return loss
        optimizer.step(closure)
        optimizer.zero_grad()
    # hooks after the closure's evaluation, as Lightning
    assert module.calls["train"] == 10 and module.before_steps == 5
    for name, tensor in reference.state_dict().items():
        assert torch.equal(module.layer.state_dict()[name], tensor), name


def test_a_closure_evaluated_again_with_several_optimizers_or_to_a_non_finite_loss_stops_with_the_reason():
    class Twice(Counting):
        def configure_optimizers(self):
            return [torch.optim.SGD([self.layer.weight], lr=0.1), torch.optim.SGD([self.layer.bias], lr=0.1)]

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            optimizer.step(closure=optimizer_closure)
            optimizer.step(closure=optimizer_closure)  # the second call evaluates again

    with pytest.raises(
        MisconfigurationError,
        match="SGD's closure was called again, which runs training_step and backward "
        "again; that needs one optimizer, and configure_optimizers returned 2",
    ):
        Trainer(max_epochs=1, **QUIET).fit(Twice(), loader(8))

    class Diverging(WithLBFGS):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if self.calls["train"] == 3 else loss

    with pytest.raises(
        NonFiniteLossError, match="the training loss was inf when the optimizer evaluated it again inside its step"
    ):
        Trainer(max_epochs=1, **QUIET).fit(Diverging(), loader(8))


def test_an_lbfgs_run_resumed_from_a_checkpoint_ends_where_the_uninterrupted_run_does(tmp_path):
    torch.manual_seed(0)
    uninterrupted = WithLBFGS()
    first = WithLBFGS()
    first.load_state_dict(uninterrupted.state_dict())
    Trainer(max_epochs=2, **QUIET).fit(uninterrupted, loader(20))
    stopped = Trainer(max_steps=3, **QUIET)
    stopped.fit(first, loader(20))
    stopped.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = WithLBFGS()
    Trainer(max_epochs=2, **QUIET).fit(resumed, loader(20), ckpt_path=tmp_path / "mid.ckpt")  # LBFGS's history too
    for name, tensor in uninterrupted.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_lbfgs_is_refused_where_its_evaluations_cannot_be_honoured():
    with pytest.raises(MisconfigurationError, match="accumulate_grad_batches=2 cannot be used with LBFGS"):
        Trainer(max_epochs=1, accumulate_grad_batches=2, **QUIET).fit(WithLBFGS(), loader(8))
    lbfgs = WithLBFGS().configure_optimizers()
    # CUDA only, so checked here
    with pytest.raises(MisconfigurationError, match="precision='16-mixed' cannot step LBFGS"):
        check_closure_optimizer([lbfgs], 1, "16-mixed")
    check_closure_optimizer([lbfgs], 1, "bf16-mixed")

    class WithTwo(WithLBFGS):
        def configure_optimizers(self):
            return [torch.optim.LBFGS([self.layer.weight]), torch.optim.SGD([self.layer.bias], lr=0.1)]

    with pytest.raises(
        MisconfigurationError,
        match="LBFGS evaluates the loss itself, again and again, so under automatic "
        "optimization it must be the only optimizer",
    ):
        Trainer(max_epochs=1, **QUIET).fit(WithTwo(), loader(8))


def test_a_modules_backward_and_configure_model_are_called_as_in_lightning():
    class Built(Counting):
        def __init__(self):
            super().__init__()
            self.head = None
            self.backwards = 0

        def configure_model(self):
            if self.head is None:  # idempotent: each stage calls it
                self.head = nn.Linear(1, 1)
                self.initial_head = self.head.weight.detach().clone()

        def forward(self, x):
            return self.head(self.layer(x))

        def backward(self, loss):
            self.backwards += 1
            loss.backward(retain_graph=True)

    module = Built()
    trainer = Trainer(max_epochs=2, **QUIET)
    trainer.fit(module, loader(8))
    head = module.head
    assert module.backwards == trainer.global_step == 4
    assert not torch.equal(head.weight, module.initial_head)  # built before configure_optimizers, so trained
    trainer.test(module, loader(8))
    assert module.head is head  # built once

    class Manual(Built):
        automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            x, y = batch
            self.manual_backward(F.mse_loss(self(x), y))
            optimizer.step()
            optimizer.zero_grad()

    manual = Manual()
    Trainer(max_epochs=1, **QUIET).fit(manual, loader(8))
    assert manual.backwards == 2


class Transferring(Counting):
    """Batch-transfer hooks that record their calls; the batch the steps see is y scaled by 10."""

    def __init__(self) -> None:
        super().__init__()
        self.transfers: list[tuple[str, int]] = []
        self.seen_y: list[torch.Tensor] = []
        self.stages: list[list[str]] = []  # the Trainer's flags set at each batch

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.transfers.append(("before", dataloader_idx))
        x, y = batch
        return x, y * 10

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.transfers.append((f"to {device}", dataloader_idx))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)  # Lightning's fallback idiom

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.transfers.append(("after", dataloader_idx))
        self.seen_y.append(batch[1])
        trainer = self.trainer
        self.stages.append([name for name in ("sanity_checking", "training", "validating", "testing", "predicting")
                            if getattr(trainer, name)])
        return batch

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        return super().validation_step(batch, batch_idx)


def test_batch_transfer_hooks_run_in_order_with_each_loaders_index_and_change_the_batch():
    module = Transferring()
    Trainer(max_epochs=1, num_sanity_val_steps=1, **QUIET).fit(module, loader(8), [loader(4), loader(4)])
    one = [("before", 0), ("to cpu", 0), ("after", 0)]
    # The sanity check's batch of each validation loader, two training batches (loader 0), then the validation.
    second_loader = [(event, 1) for event, _ in one]
    assert module.transfers == one + second_loader + one * 2 + one + second_loader
    assert torch.equal(torch.cat(module.seen_y[2:4]), dataset(8).tensors[1] * 10)  # the step's batch is the changed one
    predictions = Trainer(**QUIET).predict(module, loader(4))
    assert module.transfers[-3:] == one and len(predictions) == 1
    assert module.stages == [["sanity_checking"]] * 2 + [["training"]] * 2 + [["validating"]] * 2 + [["predicting"]]


@pytest.mark.filterwarnings("ignore:both Data and Transferring define")
def test_a_datamodules_batch_transfer_hook_is_called_instead_of_the_modules():
    class Data(DataModule):
        def train_dataloader(self):
            return loader(4)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            self.seen_y = batch[1]
            return batch

    module, data = Transferring(), Data()
    Trainer(max_epochs=1, **QUIET).fit(module, datamodule=data)
    assert module.transfers == [("before", 0), ("to cpu", 0)]  # the module's other two hooks still run
    assert torch.equal(data.seen_y, dataset(4).tensors[1] * 10) and module.seen_y == []


def test_a_hook_both_module_and_datamodule_define_is_the_datamodules_with_a_warning():
    class Data(DataModule):
        def train_dataloader(self):
            return loader(4)

        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch

    module = Transferring()
    with pytest.warns(
        UserWarning, match="both Data and Transferring define on_before_batch_transfer; the datamodule's"
    ):
        Trainer(max_epochs=1, **QUIET).fit(module, datamodule=Data())
    assert module.transfers == [("to cpu", 0), ("after", 0)]
    assert Trainer(**QUIET).predict(Counting(), loader(4))  # and a module without hooks moves batches itself


def test_configure_callbacks_replaces_the_trainers_callbacks_of_the_same_type_once_per_module(tmp_path):
    class Configured(Counting):
        def __init__(self):
            super().__init__()
            self.configured = 0

        def configure_callbacks(self):
            self.configured += 1
            return [ModelCheckpoint(dirpath=str(tmp_path / "mine"), monitor="val_loss", save_top_k=1),
                    EarlyStopping(monitor="val_loss", patience=0, min_delta=1e9)]  # no epoch improves that much

    given = CountValidations()
    trainer = Trainer(**{**QUIET, "enable_checkpointing": True}, default_root_dir=str(tmp_path), max_epochs=5,
                      callbacks=[given, ModelCheckpoint(dirpath=str(tmp_path / "default"))])
    module = Configured()
    trainer.fit(module, loader(), loader(8))
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds == [CountValidations, EarlyStopping, ModelCheckpoint] and trainer.callbacks[0] is given
    assert trainer.current_epoch == 2 and trainer.should_stop  # the module's EarlyStopping stopped the fit (of 5)
    best = trainer.checkpoint_callback.best_model_path
    assert Path(best).parent == tmp_path / "mine" and not (tmp_path / "default").exists()
    assert trainer.test(ckpt_path="best", dataloaders=loader(8), verbose=False)[0].keys() == {"test_loss"}
    assert module.configured == 1 and trainer.checkpoint_callback.best_model_path == best

    # A new module's own ModelCheckpoint comes in after ckpt_path="best" was read from the fit's, as in Lightning.
    assert trainer.test(Configured(), ckpt_path="best", dataloaders=loader(8), verbose=False)[0].keys() == {"test_loss"}

    class Wrong(Counting):
        def configure_callbacks(self):
            return [EarlyStopping]  # the class, not an instance

    with pytest.raises(
        MisconfigurationError, match="Wrong.configure_callbacks must return Callback instances; got type"
    ):
        Trainer(**QUIET).fit(Wrong(), loader())

    class MyCheckpoint(ModelCheckpoint):
        pass

    class Twice(Counting):
        def configure_callbacks(self):
            return [MyCheckpoint(dirpath=str(tmp_path / "sub")), EarlyStopping("val_loss"), EarlyStopping("val_loss")]

    trainer = Trainer(**{**QUIET, "enable_checkpointing": True}, default_root_dir=str(tmp_path), max_epochs=1)
    module = Twice()
    for _ in range(2):  # refused, and refused again: a failed configure_callbacks is not taken as done
        with pytest.raises(MisconfigurationError, match="two EarlyStopping callbacks have the same state_key"):
            trainer.fit(module, loader(), loader(8))
    Twice.configure_callbacks = lambda self: MyCheckpoint(dirpath=str(tmp_path / "sub"))
    trainer.fit(module, loader(), loader(8))
    assert [type(c) for c in trainer.callbacks] == [MyCheckpoint]  # a subclass replaces the Trainer's ModelCheckpoint


def test_deterministic_benchmark_and_detect_anomaly_do_what_lightnings_options_do():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    try:
        Trainer(**QUIET, max_epochs=1, deterministic=True).fit(Counting(), loader())  # without a seed, too
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark is False
        torch.use_deterministic_algorithms(False)
        Trainer(**QUIET, max_epochs=1, benchmark=True).fit(Counting(), loader())
        assert torch.backends.cudnn.benchmark is True and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]
    with pytest.raises(
        MisconfigurationError, match="benchmark=True lets cuDNN pick algorithms by speed, which deterministic"
    ):
        Trainer(benchmark=True, deterministic=True)

    class NaNGradient(Counting):
        def training_step(self, batch, batch_idx):  # a finite loss whose gradient is NaN: 0 * d sqrt(0)
            return super().training_step(batch, batch_idx) + (self.layer.bias * 0).sqrt().sum() * 0

    module = NaNGradient()
    Trainer(**QUIET, max_epochs=1, limit_train_batches=1).fit(module, loader())
    assert module.layer.bias.isnan().all()  # unnoticed without it
    # Anomaly mode warns with the forward's traceback (torch's own report), then the backward raises.
    with pytest.raises(RuntimeError, match="Function 'SqrtBackward0' returned nan values"), \
            pytest.warns(UserWarning, match="Error detected in SqrtBackward0"):
        Trainer(**QUIET, max_epochs=1, detect_anomaly=True).fit(NaNGradient(), loader())
    assert not torch.is_anomaly_enabled()


def test_callbacks_see_this_epochs_values_and_no_graph_in_evaluation_hooks():
    seen = []

    class Reader(Callback):
        def on_validation_epoch_end(self, trainer, module):
            seen.append((trainer.current_epoch, float(trainer.callback_metrics["val_loss"]), torch.is_grad_enabled()))

    class Logged(Counting):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", float(self.current_epoch))  # a value that tells the epochs apart

    Trainer(max_epochs=2, num_sanity_val_steps=0, callbacks=[Reader()], **QUIET).fit(Logged(), loader(), loader())
    assert seen == [(0, 0.0, False), (1, 1.0, False)]


def test_options_that_would_silently_do_nothing_are_refused():
    class NoTestStep(Counting):
        test_step = TrainModule.test_step

    with pytest.raises(
        MisconfigurationError, match=r"Trainer.test needs NoTestStep.test_step\(self, batch, batch_idx\)"
    ):
        Trainer(**QUIET).test(NoTestStep(), loader())
    with pytest.raises(MisconfigurationError, match=r"a batch limit of 0.05 is less than one of this dataloader's 5 "
                                                    r"batches; use at least 0.2"):
        Trainer(max_epochs=1, limit_val_batches=0.05, **QUIET).fit(Counting(), loader(), loader())
    with pytest.raises(MisconfigurationError, match=r"val_check_interval=20 batches is more than the 5 training "
                                                    r"batches of an epoch"):
        Trainer(max_epochs=1, val_check_interval=20, **QUIET).fit(Counting(), loader(), loader())


def test_a_datamodules_saved_state_is_back_before_it_builds_the_resumed_runs_loaders(tmp_path):
    class Curriculum(DataModule):
        """Its saved state says how many samples its training loader serves."""

        def __init__(self, samples: int = 8) -> None:
            super().__init__()
            self.samples = samples

        def train_dataloader(self):
            return loader(self.samples)

        def state_dict(self):
            return {"samples": 2 * self.samples}  # the next epochs' curriculum step

        def load_state_dict(self, state):
            self.samples = state["samples"]

    options = {**QUIET, "enable_checkpointing": True, "default_root_dir": str(tmp_path)}
    first = Trainer(max_epochs=1, **options)
    first.fit(Counting(), datamodule=Curriculum())
    resumed = Trainer(max_epochs=2, **options)
    resumed.fit(Counting(), datamodule=Curriculum(), ckpt_path=first.checkpoint_callback.last_model_path)
    assert (first.num_training_batches, resumed.num_training_batches) == (2, 4)


class GrowingData(DataModule):
    """A curriculum: built at epoch e (trainer.current_epoch), its training loader serves 4 * (e + 1) samples."""

    def __init__(self) -> None:
        super().__init__()
        self.built: list[tuple[str, int]] = []

    def train_dataloader(self):
        self.built.append(("train", self.trainer.current_epoch))
        chosen = torch.randperm(64)[: 4 * (self.trainer.current_epoch + 1)].tolist()  # a random subset
        return DataLoader(torch.utils.data.Subset(dataset(64), chosen), batch_size=4, shuffle=True)

    def val_dataloader(self):
        self.built.append(("val", self.trainer.current_epoch))
        return loader(8)


class EpochBatches(Callback):
    def __init__(self) -> None:
        self.batches: list[int] = []

    def on_train_epoch_start(self, trainer, module):
        self.batches.append(trainer.num_training_batches)


def test_reload_dataloaders_every_n_epochs_asks_the_datamodule_again_and_resumes_on_the_same_loaders(tmp_path):
    def fit(max_epochs, ckpt_path=None):
        torch.manual_seed(0)
        module, data, seen = Counting(), GrowingData(), EpochBatches()
        trainer = Trainer(max_epochs=max_epochs, reload_dataloaders_every_n_epochs=2, seed=0, callbacks=[seen],
                          **{**QUIET, "enable_checkpointing": True, "default_root_dir": str(tmp_path)})
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return trainer, module, data, seen.batches

    _, whole, data, batches = fit(5)
    assert data.built == [("train", 0), ("val", 0), ("train", 2), ("val", 2), ("train", 4), ("val", 4)]
    assert batches == [1, 1, 3, 3, 5]  # epoch e trains on the loader built at e - e % 2
    first, _, _, _ = fit(3)
    # Resumed at epoch 3, which trains on what the uninterrupted run built at epoch 2: built again as of epoch 2,
    # with the same random draws.
    _, resumed, data, batches = fit(5, ckpt_path=first.checkpoint_callback.last_model_path)
    assert data.built == [("train", 0), ("val", 0), ("train", 2), ("val", 2), ("train", 4), ("val", 4)]
    assert batches == [3, 5]
    for name, tensor in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name
    with pytest.raises(MisconfigurationError, match=r"reload_dataloaders_every_n_epochs=-1 must be >= 0"):
        Trainer(reload_dataloaders_every_n_epochs=-1)
