"""Lightning's Trainer facts under its names and meanings: state (fn, status, stage), interrupted, ckpt_path,
num_devices, device_ids, num_nodes, node_rank, and logger.log_dir a str equal to trainer.log_dir."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning_helpers import QUIET, Linear, batches

from torchyard.callbacks import Callback, ModelCheckpoint
from torchyard.trainer import Trainer
from torchyard.trainer.loop.progress import RunningStage, TrainerFn, TrainerStatus


class WithValidation(Linear):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch))


class StateRecorder(Callback):
    """(hook, fn, status, stage, interrupted) wherever a hook reads trainer.state."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, str, str | None, bool]] = []

    def record(self, hook: str, trainer: Trainer) -> None:
        state = trainer.state
        self.seen.append((hook, state.fn, state.status, state.stage, trainer.interrupted))

    def on_sanity_check_start(self, trainer, module):
        self.record("sanity", trainer)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 0:
            self.record("train_batch", trainer)

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and not trainer.sanity_checking:
            self.record("val_batch", trainer)

    def on_test_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self.record("test_batch", trainer)

    def on_exception(self, trainer, module, exception):
        self.record("exception", trainer)


def test_state_says_which_entry_point_runs_which_loop_and_how_it_ended():
    recorder = StateRecorder()
    trainer = Trainer(max_epochs=1, callbacks=[recorder], **{**QUIET, "num_sanity_val_steps": 1})
    assert (trainer.state.status, trainer.state.fn, trainer.state.stage) == ("initializing", None, None)
    trainer.fit(WithValidation(), batches(2), batches(1))
    assert recorder.seen == [
        ("sanity", "fit", "running", "sanity_check", False),
        ("train_batch", "fit", "running", "train", False),
        ("val_batch", "fit", "running", "validate", False),
    ]
    state = trainer.state
    assert (state.fn, state.status, state.stage, state.finished, state.stopped) == (
        TrainerFn.FITTING, TrainerStatus.FINISHED, None, True, True)
    assert not trainer.interrupted
    trainer.test(WithValidation(), batches(1), verbose=False)
    assert recorder.seen[-1] == ("test_batch", "test", "running", RunningStage.TESTING, False)
    assert (trainer.state.fn, trainer.state.status) == ("test", "finished")


class Breaks(Linear):
    def training_step(self, batch, batch_idx):
        raise KeyboardInterrupt  # Ctrl-C in the middle of a step


def test_an_entry_point_ended_by_an_exception_is_interrupted_before_on_exception_runs():
    recorder = StateRecorder()
    trainer = Trainer(max_epochs=1, callbacks=[recorder], **QUIET)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(Breaks(), batches(2))
    assert recorder.seen[-1] == ("exception", "fit", "interrupted", None, True)
    assert trainer.interrupted and trainer.state.stopped and not trainer.state.finished
    trainer.fit(Linear(), batches(2))  # the next entry point starts afresh
    assert not trainer.interrupted and trainer.state.finished


def test_ckpt_path_is_the_file_the_entry_point_loaded(tmp_path):
    options = {**QUIET, "enable_checkpointing": True, "default_root_dir": str(tmp_path)}
    first = Trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_last=True)], **options)
    first.fit(Linear(), batches(2))
    assert first.ckpt_path is None
    resumed = Trainer(max_epochs=2, callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_last=True)], **options)
    resumed.fit(Linear(), batches(2), ckpt_path="last")
    assert resumed.ckpt_path == str(tmp_path / "last.ckpt")  # "last" resolved to the file
    resumed.test(WithValidation(), batches(1), ckpt_path=str(tmp_path / "last.ckpt"), verbose=False)
    assert Path(resumed.ckpt_path) == tmp_path / "last.ckpt"
    resumed.test(WithValidation(), batches(1), verbose=False)
    assert resumed.ckpt_path is None


def test_devices_and_nodes_under_lightnings_names():
    one = Trainer(**QUIET)
    assert (one.num_devices, one.device_ids, one.num_nodes, one.node_rank) == (1, [0], 1, 0)
    several = Trainer(strategy="ddp", devices=2, num_nodes=3, **QUIET)
    assert (several.num_devices, several.device_ids, several.num_nodes, several.node_rank) == (2, [0, 1], 3, 0)


def test_the_loggers_log_dir_is_a_str_equal_to_the_trainers(tmp_path):
    trainer = Trainer(max_epochs=1, **{**QUIET, "logger": True, "default_root_dir": str(tmp_path)})
    trainer.fit(WithValidation(), batches(2), batches(1))
    assert isinstance(trainer.logger.log_dir, str)
    assert trainer.logger.log_dir == trainer.log_dir == str(tmp_path / "default" / "version_0")
    assert (Path(trainer.logger.log_dir) / "metrics.csv").is_file()
