"""Checkpoints: a resumed run ends bitwise where the uninterrupted one did; files are written atomically
and read without running code; load_from_checkpoint rebuilds the module."""

from __future__ import annotations

import csv
import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.checkpointing import files as checkpoint_io
from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.errors import CheckpointError, MisconfigurationError

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")


def regression_data(samples: int = 40) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 6, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=generator))


class DropoutRegressor(TrainModule):
    """Adam + StepLR (epoch interval) + dropout: resuming must restore optimizer, scheduler and RNG state."""

    def __init__(self, hidden: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


class SaveAt(Callback):
    """Saves once, right after optimizer step `step` (or at the end of epoch `epoch`), then may crash."""

    def __init__(self, path: Path, step: int | None = None, epoch: int | None = None, crash_at_step: int | None = None):
        self.path, self.step, self.epoch, self.crash_at_step = path, step, epoch, crash_at_step
        self.saved = False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.step is not None and trainer.global_step == self.step and not self.saved:
            trainer.save_checkpoint(self.path)
            self.saved = True
        if self.crash_at_step is not None and trainer.global_step == self.crash_at_step:
            raise RuntimeError("simulated crash")

    def on_train_epoch_end(self, trainer, module):
        if self.epoch is not None and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)
            self.saved = True


def fit(root: Path, callbacks=(), ckpt_path=None, **options) -> DropoutRegressor:
    torch.manual_seed(0)  # the same initial weights in every run; a resumed run overwrites them anyway
    module = DropoutRegressor()
    data = regression_data()
    options.setdefault("max_epochs", 3)
    trainer = Trainer(default_root_dir=str(root), seed=3, log_every_n_steps=1, callbacks=list(callbacks),
                      **{**QUIET, **options})
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=16),
                ckpt_path=ckpt_path)
    return module


def metrics_rows(path: Path) -> list[dict[str, float]]:
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (key, left), right in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(left, right), f"{key} differs from the uninterrupted run"


# 40 samples / 8 = 5 batches per epoch, accumulate 2 -> steps after batches 1, 3 and the tail batch 4.
# Step 4 is taken after batch 1 of epoch 1: mid-epoch, and the next micro-batch does not step.
def test_resume_mid_epoch_is_bitwise_identical(tmp_path):
    full = fit(tmp_path / "full", accumulate_grad_batches=2)
    ckpt = tmp_path / "mid.ckpt"
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(tmp_path / "crashed", [SaveAt(ckpt, step=4, crash_at_step=6)], accumulate_grad_batches=2)
    whole = load_checkpoint_file(ckpt)
    saved = whole["loops"]["progress"]
    assert (saved["epoch"], saved["global_step"], saved["epoch_batches"]) == (1, 4, 2)
    assert (whole["epoch"], whole["global_step"]) == (1, 4) and whole["hyper_parameters"] == whole[
        "hparams"
    ]  # Lightning's

    resumed = fit(tmp_path / "crashed", ckpt_path=ckpt, accumulate_grad_batches=2)
    assert resumed.trainer.global_step == full.trainer.global_step == 9
    assert_same_weights(resumed, full)
    # The crashed run's rows after the checkpoint are dropped, nothing is duplicated or missing.
    full_rows = metrics_rows(tmp_path / "full/default/version_0/metrics.csv")
    resumed_rows = metrics_rows(tmp_path / "crashed/default/version_0/metrics.csv")
    assert [row["step"] for row in resumed_rows] == [row["step"] for row in full_rows]
    assert resumed_rows == full_rows
    full_text = (tmp_path / "full/default/version_0/metrics.csv").read_text()
    assert (tmp_path / "crashed/default/version_0/metrics.csv").read_text() == full_text


class ValidationPositions(Callback):
    def __init__(self) -> None:
        self.positions: list[tuple[int, int]] = []

    def on_validation_start(self, trainer, module):
        if not trainer.sanity_checking:
            self.positions.append((trainer.current_epoch, trainer.progress.epoch_batches))


@pytest.mark.filterwarnings("ignore:ModelCheckpoint. the checkpoint folder changed")
def test_mid_epoch_validation_waits_for_the_accumulation_window_so_its_checkpoint_resumes_exactly(tmp_path):
    from torchyard.callbacks import ModelCheckpoint

    options = dict(accumulate_grad_batches=2, val_check_interval=3, max_epochs=2, enable_checkpointing=True)
    positions = ValidationPositions()
    full = fit(tmp_path / "full", [positions, ModelCheckpoint(save_top_k=-1)], **options)
    # Batch 3 ends inside a window (steps follow batches 2, 4 and the tail 5): validation waits for batch 4.
    assert positions.positions == [(0, 4), (0, 5), (1, 4), (1, 5)]
    mid_epoch = tmp_path / "full/default/version_0/checkpoints/epoch=0-step=2.ckpt"
    assert load_checkpoint_file(mid_epoch)["loops"]["progress"]["epoch_batches"] == 4
    resumed = fit(tmp_path / "resumed", ckpt_path=mid_epoch, **options)
    assert_same_weights(resumed, full)


def test_a_run_stopped_by_max_steps_and_resumed_with_more_matches_one_that_never_stopped(tmp_path):
    from torchyard.callbacks import ModelCheckpoint

    full = fit(tmp_path / "full")
    # Step 7 is batch 2 of epoch 1, not a validation point: the stop validates there, drawing from the RNG.
    fit(tmp_path / "stopped", [ModelCheckpoint(save_last=True)], max_steps=7, enable_checkpointing=True)
    resumed = fit(tmp_path / "stopped", [ModelCheckpoint(save_last=True)], ckpt_path="last", enable_checkpointing=True)
    assert resumed.trainer.global_step == full.trainer.global_step == 15
    assert_same_weights(resumed, full)


class SaveInValidation(Callback):
    """Saves at the end of the first validation after optimizer step `step`, then crashes at the next batch."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step, self.saved = path, step, False

    def on_validation_end(self, trainer, module):
        if trainer.global_step == self.step and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path)
            self.saved = True

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.saved:
            raise RuntimeError("simulated crash")


class ValidationSteps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.steps.append(trainer.global_step)


# 5 batches an epoch, validation after batches 2 and 4 and at the epoch's end. Step 7 is batch 2 of epoch 1,
# step 5 the last batch of epoch 0: a checkpoint there comes before the epoch's validation and metrics.
@pytest.mark.parametrize("save", ["before its validation", "during its validation", "before the epoch's end"])
def test_resume_at_a_validation_point_validates_once_and_logs_each_row_once(tmp_path, save):
    fit(tmp_path / "full", val_check_interval=2)
    ckpt = tmp_path / "mid.ckpt"
    saver = {"before its validation": SaveAt(ckpt, step=7, crash_at_step=8),
             "during its validation": SaveInValidation(ckpt, step=7),
             "before the epoch's end": SaveAt(ckpt, step=5, crash_at_step=6)}[save]
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(tmp_path / "crashed", [saver], val_check_interval=2)
    validations = ValidationSteps()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" among them
        fit(tmp_path / "crashed", [validations], ckpt_path=ckpt, val_check_interval=2)
    # The resumed fit runs the validation its checkpoint came before (its callbacks see it), and no other twice.
    first = {"before its validation": 7, "during its validation": 9, "before the epoch's end": 5}[save]
    assert validations.steps == [step for step in [5, 7, 9, 10, 12, 14, 15] if step >= first]
    full_rows = metrics_rows(tmp_path / "full/default/version_0/metrics.csv")
    resumed_rows = metrics_rows(tmp_path / "crashed/default/version_0/metrics.csv")
    assert [row["step"] for row in resumed_rows if "val_loss" in row] == [2, 4, 5, 7, 9, 10, 12, 14, 15]
    assert resumed_rows == full_rows


def test_a_fit_stopped_by_max_steps_at_a_validation_point_resumes_without_validating_it_again(tmp_path):
    fit(tmp_path / "full", val_check_interval=2, max_steps=9)
    stopped = fit(tmp_path / "split", val_check_interval=2, max_steps=7)  # step 7: batch 2 of epoch 1, validated
    ckpt = tmp_path / "stopped.ckpt"
    stopped.trainer.save_checkpoint(ckpt)
    validations = ValidationSteps()
    fit(tmp_path / "split", [validations], ckpt_path=ckpt, val_check_interval=2, max_steps=9)
    assert validations.steps == [9]
    # (The stopped fit also wrote its partial epoch's values at step 7, as a stop by max_steps does.)
    rows = {run: [row for row in metrics_rows(tmp_path / run / "default/version_0/metrics.csv") if "val_loss" in row]
            for run in ("full", "split")}
    assert [row["step"] for row in rows["split"]] == [2, 4, 5, 7, 9] and rows["split"] == rows["full"]


class BatchCount(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.batches += 1


def test_last_is_the_furthest_trained_checkpoint_whatever_the_files_times(tmp_path):
    from torchyard.callbacks import ModelCheckpoint
    from torchyard.trainer.checkpointing.resume import ranked_checkpoints

    def run(max_epochs, ckpt_path=None):
        counted = BatchCount()
        options = {**QUIET, "enable_checkpointing": True}
        trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=max_epochs, logger=False, **options,
                          callbacks=[ModelCheckpoint(save_top_k=-1, save_last=True), counted])
        trainer.fit(DropoutRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path=ckpt_path)
        return trainer, counted

    first, _ = run(3)
    folder = Path(first.checkpoint_callback.dirpath)
    oldest = folder / "epoch=0-step=5.ckpt"
    os.utime(oldest, ns=(oldest.stat().st_mtime_ns + 10**12,) * 2)  # touched, or copied without its times
    assert ranked_checkpoints([folder])[0][0].name == "last.ckpt"
    resumed, counted = run(4, ckpt_path="last")
    assert counted.batches == 5 and resumed.global_step == 20  # one more epoch after the third, not three


def test_last_means_last_ckpt_even_where_an_abandoned_branch_trained_further(tmp_path):
    from torchyard.callbacks import ModelCheckpoint

    def run(max_epochs, ckpt_path=None):
        counted = BatchCount()
        trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=max_epochs, logger=False,
                          **{**QUIET, "enable_checkpointing": True},
                          callbacks=[ModelCheckpoint(save_top_k=-1, save_last=True), counted])
        trainer.fit(DropoutRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path=ckpt_path)
        return trainer, counted

    first, _ = run(3)  # epochs 0-2, 5 steps each; last.ckpt at step 15
    folder = Path(first.checkpoint_callback.dirpath)
    run(2, ckpt_path=folder / "epoch=0-step=5.ckpt")  # rolled back to epoch 0 and went on to step 10
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 10
    resumed, counted = run(3, ckpt_path="last")
    assert counted.batches == 5 and resumed.global_step == 15  # the branch's third epoch, not step 15's file


def test_a_stale_last_ckpt_gives_way_to_newer_files_trained_further(tmp_path):
    from torchyard.callbacks import ModelCheckpoint
    from torchyard.trainer.checkpointing.resume import ranked_checkpoints

    trainer = Trainer(
        default_root_dir=str(tmp_path),
        max_epochs=2,
        logger=False,
        **{**QUIET, "enable_checkpointing": True},
        callbacks=[ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(DropoutRegressor(), DataLoader(regression_data(), batch_size=8))
    folder = Path(trainer.checkpoint_callback.dirpath)
    # As a SIGTERM leaves it when the files written after the resume that followed do not update it.
    stale = folder / "last.ckpt"
    stale.write_bytes((folder / "epoch=0-step=2.ckpt").read_bytes())
    os.utime(stale, ns=(stale.stat().st_mtime_ns - 10**11,) * 2)
    assert ranked_checkpoints([folder])[0][0].name == "epoch=1-step=10.ckpt"
    os.utime(stale, ns=(stale.stat().st_mtime_ns + 10**12,) * 2)  # now the newest file: the run's latest state
    assert ranked_checkpoints([folder])[0][0].name == "last.ckpt"


def test_last_looks_in_a_given_checkpoint_folder_and_logger_folder(tmp_path):
    from torchyard.callbacks import ModelCheckpoint
    from torchyard.trainer.loggers import CSVLogger

    def run(max_epochs, ckpt_path=None, **where):
        counted = BatchCount()
        checkpoint = ModelCheckpoint(dirpath=where.get("dirpath"), save_last=True)
        trainer = Trainer(default_root_dir=str(tmp_path / "elsewhere"), max_epochs=max_epochs,
                          **{**QUIET, "enable_checkpointing": True, "logger": where.get("logger", False)},
                          callbacks=[checkpoint, counted], log_every_n_steps=1)
        trainer.fit(DropoutRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path=ckpt_path)
        return trainer, counted

    run(1, dirpath=tmp_path / "mine")
    resumed, counted = run(2, "last", dirpath=tmp_path / "mine")
    assert counted.batches == 5 and resumed.global_step == 10
    run(1, logger=CSVLogger(tmp_path / "logs", name="exp"))
    resumed, counted = run(2, "last", logger=CSVLogger(tmp_path / "logs", name="exp"))
    assert counted.batches == 5 and resumed.global_step == 10
    assert Path(resumed.log_dir) == tmp_path / "logs" / "exp" / "version_0"


def test_fit_from_last_with_nothing_saved_starts_afresh_and_says_so(tmp_path):
    counted = BatchCount()
    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=1, callbacks=[counted], log_every_n_steps=1, **QUIET)
    with pytest.warns(
        UserWarning, match='ckpt_path="last": no checkpoint matches .*, so this fit starts from the beginning'
    ):
        trainer.fit(DropoutRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path="last")
    assert counted.batches == 5
    with pytest.raises(MisconfigurationError, match='ckpt_path="last": no checkpoint matches'):
        Trainer(default_root_dir=str(tmp_path / "none"), **QUIET).predict(
            DropoutRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path="last")


def test_a_mid_epoch_checkpoint_of_a_loader_that_cannot_skip_resumes_by_running_the_epoch_again(tmp_path):
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):  # no sampler to skip with: its batches come as they are read
        def __iter__(self):
            return iter(regression_data(20))

    def run(callbacks, **options):
        torch.manual_seed(0)
        trainer = Trainer(
            default_root_dir=str(tmp_path), max_epochs=2, logger=False, callbacks=callbacks, **QUIET, **options
        )
        trainer.fit(DropoutRegressor(), DataLoader(Stream(), batch_size=4))
        return trainer

    ckpt = tmp_path / "mid.ckpt"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run([SaveAt(ckpt, step=2, crash_at_step=3)])
    counted = BatchCount()
    torch.manual_seed(0)
    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=2, logger=False, callbacks=[counted], **QUIET)
    with pytest.warns(UserWarning, match="cannot skip the 2 batches of epoch 0 trained before the checkpoint, so the "
                                         "epoch starts over"):
        trainer.fit(DropoutRegressor(), DataLoader(Stream(), batch_size=4), ckpt_path=ckpt)
    assert counted.batches == 5 + 5 and trainer.global_step == 2 + 10  # epoch 0 whole again, then epoch 1


def test_a_mid_epoch_resume_on_another_number_of_processes_continues_after_the_samples_trained(tmp_path):
    ckpt = tmp_path / "mid.ckpt"
    fit(tmp_path / "saved", [SaveAt(ckpt, step=2)], max_epochs=1)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["loops"]["data_parallel_size"] == 1 and saved["loops"]["progress"]["epoch_batches"] == 2
    saved["loops"]["data_parallel_size"] = 2  # as if two ddp processes had trained 2 batches each
    torch.save(saved, ckpt)
    counted = BatchCount()
    with pytest.warns(UserWarning, match=r"resuming mid-epoch on 1 data-parallel process\(es\) from a checkpoint of "
                                         r"2: epoch 0 goes on after 4 batches per process"):
        resumed = fit(tmp_path / "saved", [counted], ckpt_path=ckpt, max_epochs=2)
    assert counted.batches == 1 + 5  # epoch 0's last batch of 5, then epoch 1
    assert resumed.trainer.global_step == 2 + 6


def test_resume_from_epoch_end_is_bitwise_identical(tmp_path):
    full = fit(tmp_path / "full")
    ckpt = tmp_path / "epoch0.ckpt"
    fit(tmp_path / "first", [SaveAt(ckpt, epoch=0)], max_epochs=1)
    resumed = fit(tmp_path / "first", ckpt_path=ckpt)
    assert resumed.trainer.current_epoch == 3 and resumed.trainer.global_step == 15
    assert_same_weights(resumed, full)
    # StepLR stepped once per finished epoch, not once more or less across the resume.
    assert resumed.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.7**3)
    assert metrics_rows(tmp_path / "first/default/version_0/metrics.csv") == metrics_rows(
        tmp_path / "full/default/version_0/metrics.csv"
    )


def trained_checkpoint(path: Path) -> DropoutRegressor:
    torch.manual_seed(0)
    module = DropoutRegressor(hidden=12, lr=0.02)
    trainer = Trainer(max_epochs=1, logger=False, **QUIET)
    trainer.fit(module, DataLoader(regression_data(), batch_size=8))
    trainer.save_checkpoint(path)
    return module


def test_load_from_checkpoint_rebuilds_from_hparams_and_weights(tmp_path):
    module = trained_checkpoint(tmp_path / "a.ckpt")
    loaded = DropoutRegressor.load_from_checkpoint(tmp_path / "a.ckpt")
    assert dict(loaded.hparams) == {"hidden": 12, "lr": 0.02}
    assert loaded.net[0].out_features == 12
    assert_same_weights(loaded, module)
    assert DropoutRegressor.load_from_checkpoint(tmp_path / "a.ckpt", lr=0.5).hparams.lr == 0.5


def test_a_checkpoint_that_does_not_fit_the_model_says_what_differs_in_one_line(tmp_path):
    trained_checkpoint(tmp_path / "h12.ckpt")  # hidden=12
    differs = (
        r"other shapes: net.0.weight \[12, 6\] in the checkpoint, \[16, 6\] in the model, net.0.bias \[12\] "
        r"in the checkpoint, \[16\] in the model, net.3.weight \[1, 12\] in the checkpoint, \[1, 16\] in the model"
    )
    with pytest.raises(CheckpointError, match=r"the checkpoint's weights do not fit DropoutRegressor: " + differs):
        Trainer(max_epochs=2, logger=False, **QUIET).fit(
            DropoutRegressor(hidden=16), DataLoader(regression_data(), batch_size=8), ckpt_path=tmp_path / "h12.ckpt"
        )
    with pytest.raises(CheckpointError, match=r"does not fit DropoutRegressor: " + differs):
        DropoutRegressor.load_from_checkpoint(tmp_path / "h12.ckpt", hidden=16)

    class Deeper(DropoutRegressor):
        def __init__(self, hidden: int = 16, lr: float = 0.01) -> None:
            super().__init__(hidden, lr)
            self.extra = nn.Linear(1, 1)

    with pytest.raises(CheckpointError, match=r"does not fit Deeper: missing extra.weight, extra.bias\.$"):
        Deeper.load_from_checkpoint(tmp_path / "h12.ckpt")


class Wrapped(TrainModule):
    """A user's own submodule called `module`: its keys must survive the round trip unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(6, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.module(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_saved_keys_are_the_modules_own(tmp_path):
    module = trained_checkpoint(tmp_path / "a.ckpt")
    assert list(load_checkpoint_file(tmp_path / "a.ckpt")["state_dict"]) == list(module.state_dict())

    data = DataLoader(regression_data(), batch_size=8)
    trainer = Trainer(max_epochs=1, logger=False, **QUIET)
    trainer.fit(Wrapped(), data)
    trainer.save_checkpoint(tmp_path / "w.ckpt")
    assert list(load_checkpoint_file(tmp_path / "w.ckpt")["state_dict"]) == ["module.weight", "module.bias"]
    Trainer(max_epochs=2, logger=False, **QUIET).fit(Wrapped(), data, ckpt_path=tmp_path / "w.ckpt")


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    module = trained_checkpoint(path)
    before, saved_weight = path.read_bytes(), module.net[0].weight.detach().clone()
    with torch.no_grad():
        module.net[0].weight.add_(1.0)  # the next save would differ

    def torch_save_that_dies(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", torch_save_that_dies)
    with pytest.raises(OSError, match="No space left"):
        module.trainer.save_checkpoint(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert torch.equal(load_checkpoint_file(path)["state_dict"]["net.0.weight"], saved_weight)


class NamingCheckedSGD(torch.optim.SGD):
    """SGD that notes, as each step begins, whether the newest checkpoint ModelCheckpoint saved is under its name."""

    steps_with_closure = False  # as torch's SGD: the Trainer's plain step may step it

    def __init__(self, module: TrainModule) -> None:
        super().__init__(module.parameters(), lr=0.01)
        self.module, self.named = module, []

    def step(self, closure=None):
        newest = self.module.trainer.checkpoint_callback.last_model_path
        if newest:
            self.named.append(Path(newest).exists())
        return super().step(closure)


class NamingCheckedRegressor(DropoutRegressor):
    def configure_optimizers(self):
        self.sgd = NamingCheckedSGD(self)
        return self.sgd


class ManuallyOptimized(NamingCheckedRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        return loss


class HookedStep(Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer):
        pass  # overridden: the step takes its general path rather than its plain one


@pytest.mark.parametrize(("module_class", "callbacks"),
                         [(NamingCheckedRegressor, []), (NamingCheckedRegressor, [HookedStep()]),
                          (ManuallyOptimized, [])],
                         ids=["plain-step", "general-step", "manual-optimization"])
def test_a_checkpoint_is_synced_off_the_training_thread_and_named_before_the_next_optimizer_step(tmp_path,
                                                                                                 monkeypatch,
                                                                                                 module_class,
                                                                                                 callbacks):
    synced_on = []
    real_sync = checkpoint_io._sync_into_place

    def sync_into_place(file, path):
        synced_on.append((Path(path).name, threading.current_thread().name))
        time.sleep(0.2)  # a slow disk: the next step must still not pass a checkpoint that is not under its name
        real_sync(file, path)

    monkeypatch.setattr(checkpoint_io, "_sync_into_place", sync_into_place)
    module = module_class()
    Trainer(default_root_dir=str(tmp_path), max_epochs=2, callbacks=callbacks, logger=False,
            **{**QUIET, "enable_checkpointing": True}).fit(module, DataLoader(regression_data(), batch_size=8))
    assert synced_on == [("epoch=0-step=5.ckpt", "checkpoint-files"), ("epoch=1-step=10.ckpt", "checkpoint-files")]
    assert module.sgd.named == [True] * 5  # epoch 1's steps, each after epoch 0's file and its last.ckpt landed
    folder = Path(module.trainer.checkpoint_callback.dirpath)
    assert sorted(path.name for path in folder.glob("*.ckpt*")) == ["epoch=1-step=10.ckpt", "last.ckpt"]
    assert load_checkpoint_file(folder / "last.ckpt")["global_step"] == 10


def test_a_checkpoint_that_cannot_be_named_stops_the_fit_and_the_one_before_it_stays(tmp_path, monkeypatch):
    real_replace = os.replace

    def replace(source, destination):
        if str(destination).endswith("step=10.ckpt"):
            raise OSError(28, "No space left on device")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointError, match=r"saving .*epoch=1-step=10\.ckpt failed: .*No space left on device; "
                                              r"the checkpoint before it is intact"):
        fit(tmp_path, enable_checkpointing=True, max_epochs=2)
    # Neither last.ckpt's new name nor the removal of epoch 0's file, queued behind the failed save, happened.
    folder = tmp_path / "default/version_0/checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    assert load_checkpoint_file(folder / "last.ckpt")["global_step"] == 5


class Planted:
    """Unpickling this object opens (creates) the marker file: code run by merely loading a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_checkpoint_with_pickled_callable_is_refused(tmp_path):
    path = tmp_path / "planted.ckpt"
    torch.save({"state_dict": {}, "payload": Planted(tmp_path / "control")}, path)
    torch.load(path, weights_only=False)  # proves the payload is live: full unpickling runs it
    assert (tmp_path / "control").exists()

    torch.save({"state_dict": {}, "payload": Planted(tmp_path / "marker")}, path)
    with pytest.raises(
        CheckpointError,
        match=r"planted.ckpt.*refused \(WeightsUnpickler error: Unsupported global: "
        r"GLOBAL io.open was not an allowed global by default\)",
    ):
        load_checkpoint_file(path)
    with pytest.raises(CheckpointError, match="refused"):
        DropoutRegressor.load_from_checkpoint(path)
    with pytest.raises(CheckpointError, match="refused"):
        Trainer(max_epochs=1, logger=False, **QUIET).fit(
            DropoutRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path=path
        )
    assert not (tmp_path / "marker").exists()


def test_state_a_checkpoint_could_not_be_loaded_from_is_refused_when_saving(tmp_path):
    import collections

    import numpy as np

    class BestSoFar(Callback):
        def __init__(self, best):
            self.best = best

        def state_dict(self):
            return {"history": [1.0, {"best": self.best}]}

    for value, kind in ((np.float64(0.5), "numpy.float64"), (collections.deque([1]), "collections.deque")):
        trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=1, callbacks=[BestSoFar(value)],
                          log_every_n_steps=1, **{**QUIET, "enable_checkpointing": True})
        with pytest.raises(
            MisconfigurationError,
            match=rf"the checkpoint's callbacks\['.*BestSoFar'\]\['history'\]\[1\]"
            rf"\['best'\] is a {kind}, which checkpoints cannot hold",
        ):
            trainer.fit(DropoutRegressor(), DataLoader(regression_data(), batch_size=8))
        assert not list(tmp_path.rglob("*.ckpt"))
    from torchyard.trainer.checkpointing.files import unloadable

    assert unloadable({"layout": torch.strided, "size": torch.Size([2]), "kind": torch.float16, "n": {1, 2}}) is None
    fine = BestSoFar(torch.tensor(0.5))
    Trainer(default_root_dir=str(tmp_path), max_epochs=1, callbacks=[fine], log_every_n_steps=1,
            **{**QUIET, "enable_checkpointing": True}).fit(
        DropoutRegressor(), DataLoader(regression_data(), batch_size=8))
    assert len(list(tmp_path.rglob("*.ckpt"))) == 2  # the epoch's file and last.ckpt


def test_checkpoints_a_fit_cannot_resume_from_say_why_before_training(tmp_path):
    trained_checkpoint(tmp_path / "adam.ckpt")

    class WithSGD(DropoutRegressor):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def resume(module, path):
        counted = BatchCount()
        with pytest.raises(CheckpointError) as error:
            Trainer(max_epochs=2, logger=False, callbacks=[counted], **QUIET).fit(
                module, DataLoader(regression_data(), batch_size=8), ckpt_path=path)
        assert counted.batches == 0
        return str(error.value)

    message = resume(WithSGD(hidden=12, lr=0.02), tmp_path / "adam.ckpt")
    assert message.startswith(
        "the checkpoint's optimizer 0 has no dampening, momentum, which configure_optimizers' SGD needs"
    )
    whole = load_checkpoint_file(tmp_path / "adam.ckpt")
    for layout in ({k: v for k, v in whole.items() if k != "loops"}, {**whole, "loops": {"fit_loop": {}}}):
        torch.save(layout, tmp_path / "foreign.ckpt")
        assert "no training position in this framework's layout (loops.progress)" in resume(
            DropoutRegressor(hidden=12, lr=0.02), tmp_path / "foreign.ckpt"
        )
    with pytest.raises(CheckpointError, match="is a folder; give a checkpoint file in it"):
        DropoutRegressor.load_from_checkpoint(tmp_path)


def test_truncated_checkpoint_names_the_file(tmp_path):
    trained_checkpoint(tmp_path / "good.ckpt")
    data = (tmp_path / "good.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.ckpt.*truncated or corrupt"):
        load_checkpoint_file(tmp_path / "cut.ckpt")
    with pytest.raises(CheckpointError, match=r"cut\.ckpt"):
        Trainer(max_epochs=1, logger=False, **QUIET).fit(
            DropoutRegressor(), DataLoader(regression_data(), batch_size=8), ckpt_path=tmp_path / "cut.ckpt"
        )


def test_checkpoint_is_weights_only_loadable(tmp_path):
    trained_checkpoint(tmp_path / "a.ckpt")
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert {
        "version",
        "state_dict",
        "optimizer_states",
        "lr_schedulers",
        "loops",
        "callbacks",
        "rng",
        "hparams",
    } <= set(checkpoint)
    assert checkpoint["hparams"] == {"hidden": 12, "lr": 0.02}
    assert checkpoint["loops"]["progress"]["global_step"] == 5


def test_garbage_file_is_a_checkpoint_error_naming_it(tmp_path):
    # Files that are no zip archive nor pickle: torch's weights-only unpickler fails on them with KeyError,
    # IndexError, struct.error or an UnpicklingError about an "unsupported operand", not a CheckpointError.
    (tmp_path / "text.ckpt").write_text("hello world")
    generator = torch.Generator().manual_seed(0)
    for index in range(20):
        noise = torch.randint(0, 256, (64 * (index + 1),), generator=generator, dtype=torch.uint8)
        noise[0] = ord("!")  # garbage that begins like a pickle (0x80) or a zip ("PK") is another case
        (tmp_path / f"noise{index}.ckpt").write_bytes(noise.numpy().tobytes())
    for path in [tmp_path / "text.ckpt", *sorted(tmp_path.glob("noise*.ckpt"))]:
        message = rf"checkpoint '.*{path.name}' is truncated or corrupt .*neither a zip archive nor a pickle"
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint_file(path)
        with pytest.raises(CheckpointError, match=message):
            DropoutRegressor.load_from_checkpoint(path)


def test_plain_pickle_with_code_is_still_refused_as_unsafe(tmp_path):
    import pickle

    path = tmp_path / "pickled.ckpt"  # pickle.dump, not torch.save: no zip archive around it
    path.write_bytes(pickle.dumps({"state_dict": {}, "payload": Planted(tmp_path / "marker")}, protocol=2))
    with pytest.raises(CheckpointError, match=r"pickled\.ckpt.*refused") as refused:
        load_checkpoint_file(path)
    assert "Unsupported global" in str(refused.value.__cause__)  # refused for the callable, not as garbage
    assert not (tmp_path / "marker").exists()


def save_plain_checkpoint(path: Path, module: TrainModule) -> None:
    """What load_from_checkpoint reads: the weights and the hparams as the module holds them."""
    torch.save({"state_dict": module.state_dict(), "hparams": dict(module.hparams)}, path)


class Parent(TrainModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(6, width)


class Child(Parent):
    """Takes no `width`, but its parent saved one."""

    def __init__(self, depth: int = 2) -> None:
        super().__init__(width=3)
        self.save_hyperparameters()
        self.extra = nn.Linear(3, depth)


class Forwarding(Parent):
    """Takes any keyword, forwarded to a parent that takes only `width`."""

    def __init__(self, depth: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.hparams.note = "set after save_hyperparameters"


class Swallowing(TrainModule):
    def __init__(self, **options) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen = dict(options)


def test_load_from_checkpoint_passes_only_the_hparams_init_takes(tmp_path):
    child = Child(depth=5)
    child.hparams.extra_note = 2  # set after save_hyperparameters, as Lightning users do
    assert dict(child.hparams) == {"width": 3, "depth": 5, "extra_note": 2}
    save_plain_checkpoint(tmp_path / "child.ckpt", child)
    loaded = Child.load_from_checkpoint(tmp_path / "child.ckpt")
    assert loaded.extra.out_features == 5
    assert_same_weights(loaded, child)

    # **kwargs that reach a parent taking only `width`: the keys of the whole chain pass, no others.
    forwarding = Forwarding(depth=1, width=7)
    assert dict(forwarding.hparams) == {"width": 7, "depth": 1, "note": "set after save_hyperparameters"}
    save_plain_checkpoint(tmp_path / "forwarding.ckpt", forwarding)
    loaded = Forwarding.load_from_checkpoint(tmp_path / "forwarding.ckpt")
    assert loaded.layer.out_features == 7
    # Overrides win over the saved values.
    with pytest.raises(
        CheckpointError, match=r"does not fit Forwarding: other shapes: layer.weight \[7, 6\] in the checkpoint"
    ):
        Forwarding.load_from_checkpoint(tmp_path / "forwarding.ckpt", width=8)

    # An __init__ that takes any keyword gets every saved key.
    swallowing = Swallowing(a=1, b="two")
    save_plain_checkpoint(tmp_path / "swallowing.ckpt", swallowing)
    assert Swallowing.load_from_checkpoint(tmp_path / "swallowing.ckpt", b=3).seen == {"a": 1, "b": 3}

    with pytest.raises(
        MisconfigurationError, match=r"Child does not take 'dept' \(did you mean 'depth'\?\); it takes depth"
    ):
        Child.load_from_checkpoint(tmp_path / "child.ckpt", dept=3)


class Activated(DropoutRegressor):
    """An hparam that is a module: checkpoints can only hold its repr."""

    def __init__(self, hidden: int = 16, lr: float = 0.01, act: nn.Module | None = None) -> None:
        super().__init__(hidden, lr)
        self.save_hyperparameters()
        self.net[1] = act if act is not None else nn.ReLU()


def test_hparams_that_are_not_plain_warn_once_and_must_be_passed_again(tmp_path):
    torch.manual_seed(0)
    module = Activated(hidden=5, act=nn.Tanh())
    trainer = Trainer(max_epochs=1, logger=False, **QUIET)
    with pytest.warns(
        UserWarning,
        match=r"hparams\['act'\] holds Tanh.*repr 'Tanh\(\)'.*"
        r"Activated.load_from_checkpoint\(path, act=...\).*ignore=\['act'\]",
    ) as caught:
        trainer.fit(module, DataLoader(regression_data(), batch_size=8))
        trainer.save_checkpoint(tmp_path / "a.ckpt")
        trainer.save_checkpoint(tmp_path / "b.ckpt")
    assert sum("hparams['act']" in str(w.message) for w in caught) == 1

    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert checkpoint["hparams"] == {"hidden": 5, "lr": 0.01, "act": "Tanh()"}
    assert checkpoint["hparams_repr"] == ["act"]
    with pytest.raises(MisconfigurationError, match=r"a\.ckpt' holds hparams\['act'\] only as its repr 'Tanh\(\)'.*"
                                                    r"Activated.load_from_checkpoint\(path, act=...\)"):
        Activated.load_from_checkpoint(tmp_path / "a.ckpt")
    loaded = Activated.load_from_checkpoint(tmp_path / "a.ckpt", act=nn.Tanh())
    assert isinstance(loaded.net[1], nn.Tanh) and loaded.hparams.hidden == 5
    assert_same_weights(loaded, module)

    # Plain hparams are recorded as such, and a checkpoint from before the record loads as it did.
    trained_checkpoint(tmp_path / "plain.ckpt")
    checkpoint = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert checkpoint["hparams_repr"] == []
    del checkpoint["hparams_repr"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    assert dict(DropoutRegressor.load_from_checkpoint(tmp_path / "old.ckpt").hparams) == {"hidden": 12, "lr": 0.02}


@pytest.mark.parametrize("crash", [False, True])
def test_files_are_fsynced_before_their_rename_and_the_folder_once_as_the_fit_ends(tmp_path, monkeypatch, crash):
    """Each file's data is on disk before a name points at it (a hard link shares its inode); the folder, which
    makes the names durable, is synced once, last, also when the fit crashes."""
    synced: list[tuple[str, int]] = []  # (path, inode) of each fsync, in order
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        assert os.stat(src).st_ino in {inode for _, inode in synced}, f"{src} renamed before its data was fsynced"
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    callbacks = [SaveAt(tmp_path / "unused.ckpt", crash_at_step=11)] if crash else []
    try:
        fit(tmp_path, callbacks, max_epochs=3, enable_checkpointing=True)
    except RuntimeError:
        assert crash
    folder = tmp_path / "default/version_0/checkpoints"
    epochs = 2 if crash else 3  # 5 steps an epoch: the crash comes in the third
    assert sorted(p.name for p in folder.iterdir()) == [f"epoch={epochs - 1}-step={5 * epochs}.ckpt", "last.ckpt",
                                                        *([] if crash else ["training_ended.json"])]
    folder_syncs = [i for i, (path, _) in enumerate(synced) if path == str(folder)]
    last_file_sync = max(i for i, (path, _) in enumerate(synced) if path.startswith(str(folder) + "/"))
    assert len(folder_syncs) == 1 and folder_syncs[0] > last_file_sync


def test_a_corrupt_checkpoint_message_ends_with_whole_sentences(tmp_path):
    # torch's reason is a page of advice; the message keeps its first sentence whole, never a cut-off one.
    torch.save({"state_dict": {"weight": torch.zeros(1000)}}, tmp_path / "small.ckpt")
    data = (tmp_path / "small.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint_file(tmp_path / "cut.ckpt")
    assert str(caught.value) == (
        f"checkpoint {str(tmp_path / 'cut.ckpt')!r} is truncated or corrupt and cannot be read "
        "(RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory).")
    trained_checkpoint(tmp_path / "trained.ckpt")
    data = (tmp_path / "trained.ckpt").read_bytes()
    (tmp_path / "cut_trained.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint_file(tmp_path / "cut_trained.ckpt")
    cause = caught.value.__cause__
    first_sentence = " ".join(str(cause).split()).split(". ")[0].rstrip(".")
    assert str(caught.value).endswith(f"cannot be read ({type(cause).__name__}: {first_sentence}).")
    # A torch file whose pickled part is damaged is corrupt too, not "objects that need full unpickling".
    start = data.index(b"data.pkl") + 40
    (tmp_path / "bitrot.ckpt").write_bytes(data[:start] + b"\xff" * 16 + data[start + 16:])
    with pytest.raises(CheckpointError, match=r"bitrot\.ckpt' is truncated or corrupt and cannot be read \(.*\)\.$"):
        load_checkpoint_file(tmp_path / "bitrot.ckpt")


class NoisyRows(torch.utils.data.Dataset):
    """Each row with noise drawn where it is loaded, from its loader worker's seed (which the loader's iterator drew
    from the global RNG) and the row's index: not from the worker's running stream, which a resumed epoch, skipping
    the batches trained before its checkpoint, could not replay."""

    def __init__(self) -> None:
        self.rows = regression_data()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        x, y = self.rows[index]
        noise = torch.Generator().manual_seed(torch.initial_seed() + index)
        return x + 0.1 * torch.randn(x.shape, generator=noise), y


def test_a_mid_epoch_resume_draws_the_epochs_shuffle_and_worker_seeds_again(tmp_path):
    """The loader's own shuffle and its workers' base seed are drawn from the global RNG as the epoch starts; the
    checkpoint keeps that state, so the resumed epoch gets the same order and the same per-row noise."""

    def noisy_fit(root: Path, callbacks=(), ckpt_path=None) -> DropoutRegressor:
        torch.manual_seed(0)
        module = DropoutRegressor()
        loader = DataLoader(NoisyRows(), batch_size=8, shuffle=True, num_workers=1)
        Trainer(default_root_dir=str(root), seed=3, max_epochs=2, callbacks=list(callbacks), **QUIET).fit(
            module, loader, ckpt_path=ckpt_path)
        return module

    full = noisy_fit(tmp_path / "full")
    ckpt = tmp_path / "mid.ckpt"
    with pytest.raises(RuntimeError, match="simulated crash"):
        noisy_fit(tmp_path / "crashed", [SaveAt(ckpt, step=7, crash_at_step=8)])
    assert load_checkpoint_file(ckpt)["loops"]["progress"]["epoch_batches"] == 2  # epoch 1, mid-way
    assert_same_weights(noisy_fit(tmp_path / "resumed", ckpt_path=ckpt), full)
