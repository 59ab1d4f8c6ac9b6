"""The built-in callbacks on real (tiny) fits: files on disk, stop epochs, logged rates, printed tables."""

from __future__ import annotations

import csv
import io
import math
import re
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchyard.callbacks.checkpoint as checkpoint_module
import torchyard.callbacks.progress as progress_module
from torchyard.callbacks import (
    BasePredictionWriter,
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    RichProgressBar,
    Timer,
)
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.config import parse_duration
from torchyard.trainer.errors import CheckpointError, MisconfigurationError

BATCHES_PER_EPOCH = 4


class Scripted(TrainModule):
    """Linear regression whose validation logs a scripted score: scores[epoch], or scores[validation index]."""

    def __init__(self, scores=(), name="val/score", per_validation=False, sleep=0.0, sanity_score=-100.0):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.scores, self.name, self.per_validation = list(scores), name, per_validation
        self.sanity_score = sanity_score  # logged while sanity checking: the best score, were it ever used
        self.validations = 0  # validations run in this process, sanity checks excluded
        self.sleep = sleep

    def training_step(self, batch, batch_idx):
        if self.sleep:
            time.sleep(self.sleep)
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        if not self.scores:
            return
        if self.trainer.sanity_checking:
            value = self.sanity_score
        else:
            value = self.scores[self.validations if self.per_validation else self.trainer.current_epoch]
        self.log(self.name, value, prog_bar=True)

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            self.validations += 1

    def test_step(self, batch, batch_idx):
        """Logs nothing: tests restore checkpoints through it."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loaders(samples=16, batch_size=4):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 4, generator=generator), torch.randn(samples, 1, generator=generator))
    return DataLoader(data, batch_size=batch_size), DataLoader(data, batch_size=batch_size)


def make_trainer(tmp_path, callbacks=(), **options):
    bar_given = any(isinstance(c, RichProgressBar) for c in callbacks)
    settings = dict(default_root_dir=str(tmp_path), enable_progress_bar=bar_given, enable_model_summary=False,
                    logger=False, num_sanity_val_steps=0)
    settings.update(options)
    return Trainer(callbacks=list(callbacks), **settings)


def checkpoint_names(folder) -> set[str]:
    return {p.name for p in Path(folder).glob("*.ckpt")}


def load(path):
    return torch.load(path, weights_only=True)


# --------------------------------------------------------------------------- ModelCheckpoint


@pytest.mark.filterwarnings("error::UserWarning")  # a save attempted while sanity checking would warn
@pytest.mark.parametrize("mode", ["min", "max"])
def test_top_k_keeps_exactly_the_k_best_files(tmp_path, mode):
    scores = [0.5, math.nan, 0.8, 0.1, 0.4, math.inf, 0.2, 0.3]
    k = 3
    # Independently: the k best finite scores, named by the template ('/' in the metric name becomes '_').
    finite = [(s, epoch) for epoch, s in enumerate(scores) if math.isfinite(s)]
    ranked = sorted(finite, reverse=mode == "max")[:k]
    expected = {f"epoch={epoch}-val_score={s:.2f}.ckpt" for s, epoch in ranked}
    best_score, best_epoch = ranked[0]

    checkpoint = ModelCheckpoint(monitor="val/score", mode=mode, save_top_k=k, save_last=True,
                                 filename="{epoch}-{val/score:.2f}")
    module = Scripted(scores, sanity_score=-100.0 if mode == "min" else 100.0)
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=len(scores), num_sanity_val_steps=1)
    trainer.fit(module, *loaders())

    folder = Path(checkpoint.dirpath)
    assert folder == tmp_path / "default" / "version_0" / "checkpoints"
    assert checkpoint_names(folder) == expected | {"last.ckpt"}
    assert set(map(str, (folder / name for name in expected))) == set(checkpoint.best_k_models)
    assert Path(checkpoint.best_model_path).name == f"epoch={best_epoch}-val_score={best_score:.2f}.ckpt"
    assert float(checkpoint.best_model_score) == pytest.approx(best_score)
    assert Path(checkpoint.kth_best_model_path).name == f"epoch={ranked[-1][1]}-val_score={ranked[-1][0]:.2f}.ckpt"

    best = load(checkpoint.best_model_path)
    assert best["loops"]["progress"]["epoch"] == best_epoch
    assert set(best["state_dict"]) == set(module.state_dict())
    last = load(checkpoint.last_model_path)
    assert Path(checkpoint.last_model_path).name == "last.ckpt"
    for name, tensor in module.state_dict().items():
        assert torch.equal(last["state_dict"][name], tensor)
    # The checkpoint holds the bookkeeping as it was after this file was added.
    saved = last["callbacks"][checkpoint.state_key]
    assert set(saved["best_k_models"]) == set(checkpoint.best_k_models)


def test_every_n_train_steps_saves_once_per_optimizer_step(tmp_path):
    # 8 micro-batches per epoch, 2 per optimizer step: 4 steps per epoch, 8 in all; a save every 3 steps.
    checkpoint = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=2, accumulate_grad_batches=2)
    trainer.fit(Scripted(), *loaders(batch_size=2))
    steps_per_epoch = 4
    expected = {f"epoch={(step - 1) // steps_per_epoch}-step={step}.ckpt" for step in (3, 6)}
    assert checkpoint_names(checkpoint.dirpath) == expected
    for path in checkpoint.best_k_models:
        assert load(path)["loops"]["progress"]["global_step"] == int(Path(path).stem.split("step=")[1])


def test_mid_epoch_validation_saves_at_validation_and_epoch_end(tmp_path):
    checkpoint = ModelCheckpoint(save_top_k=-1)
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=2, val_check_interval=0.5)
    trainer.fit(Scripted([0.0] * 4, per_validation=True), *loaders())
    assert checkpoint_names(checkpoint.dirpath) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                    "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt"}
    mid = load(Path(checkpoint.dirpath) / "epoch=1-step=6.ckpt")["loops"]["progress"]
    assert (mid["epoch_batches"], mid["epoch_done"]) == (2, False)
    end = load(Path(checkpoint.dirpath) / "epoch=1-step=8.ckpt")["loops"]["progress"]
    assert (end["epoch_batches"], end["epoch_done"]) == (4, True)


class TickingClock:
    """Stands in for the `time` module of callbacks.checkpoint: each reading is one second after the last."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("interval", [2.5, timedelta(seconds=2.5)])
def test_train_time_interval_saves_after_the_first_step_that_ends_the_interval(tmp_path, monkeypatch, interval):
    monkeypatch.setattr(checkpoint_module, "time", TickingClock())
    # Read once at the start of training, then once per optimizer step (not per micro-batch): steps 1 and 2 end
    # 1 and 2 seconds after the start, step 3 ends 3 seconds after it and saves; then steps 6 and 9 save.
    checkpoint = ModelCheckpoint(train_time_interval=interval, save_top_k=-1, filename="{step}", save_last=True)
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=5, accumulate_grad_batches=2)
    trainer.fit(Scripted(), *loaders(batch_size=2))  # 8 micro-batches, 4 steps per epoch: 20 steps
    assert checkpoint_names(checkpoint.dirpath) == {f"step={step}.ckpt" for step in (3, 6, 9, 12, 15, 18)} | {
        "last.ckpt"
    }
    # every epoch end, as in Lightning
    assert load(checkpoint.last_model_path)["loops"]["progress"]["global_step"] == 20
    for step in (3, 6):
        progress = load(Path(checkpoint.dirpath) / f"step={step}.ckpt")["loops"]["progress"]
        assert (progress["global_step"], progress["epoch_batches"]) == (step, 2 * step % 8)  # at a step boundary


def test_checkpoint_save_triggers_are_checked(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint got every_n_epochs=2 and "
                                                    r"train_time_interval='00:01:00:00'; set only one of them\."):
        ModelCheckpoint(every_n_epochs=2, train_time_interval="00:01:00:00")
    with pytest.raises(MisconfigurationError, match=r"train_time_interval=0\) would save after every step"):
        ModelCheckpoint(train_time_interval=0)
    with pytest.raises(MisconfigurationError, match=r"ModelCheckpoint\(train_time_interval='1h'\): a string must read"):
        ModelCheckpoint(train_time_interval="1h")
    with pytest.raises(MisconfigurationError, match=r"save_on_train_epoch_end='yes'\) takes True, False or None"):
        ModelCheckpoint(save_on_train_epoch_end="yes")
    timed = ModelCheckpoint(train_time_interval={"minutes": 30})
    assert (timed.train_time_interval, timed.every_n_epochs) == (1800.0, 0)  # no epoch-end saves of its own
    assert timed.state_key != ModelCheckpoint().state_key


@pytest.mark.parametrize("save_on_train_epoch_end, expected", [
    (None, {"step=2.ckpt", "step=4.ckpt", "step=6.ckpt", "step=8.ckpt"}),
    (True, {"step=4.ckpt", "step=8.ckpt"}),  # the mid-epoch validations save nothing
])
def test_save_on_train_epoch_end_leaves_mid_epoch_validations_unsaved(tmp_path, save_on_train_epoch_end, expected):
    checkpoint = ModelCheckpoint(save_top_k=-1, filename="{step}", save_on_train_epoch_end=save_on_train_epoch_end)
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=2, val_check_interval=0.5)
    trainer.fit(Scripted([0.0] * 4, per_validation=True), *loaders())
    assert checkpoint_names(checkpoint.dirpath) == expected


@pytest.mark.parametrize("save_on_train_epoch_end, expected", [
    (None, {"step=4.ckpt", "step=8.ckpt", "step=12.ckpt", "step=16.ckpt"}),
    (False, {"step=8.ckpt", "step=16.ckpt"}),  # only the epochs that validated
])
def test_save_on_train_epoch_end_false_saves_after_validations_only(tmp_path, save_on_train_epoch_end, expected):
    checkpoint = ModelCheckpoint(save_top_k=-1, filename="{step}", save_on_train_epoch_end=save_on_train_epoch_end)
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=4, check_val_every_n_epoch=2)
    trainer.fit(Scripted([0.0] * 4), *loaders())
    assert checkpoint_names(checkpoint.dirpath) == expected


@pytest.mark.filterwarnings("error::UserWarning")  # nor warned about: the monitor is missing there by design
def test_epochs_without_validation_are_not_ranked_by_an_older_validations_score(tmp_path):
    checkpoint = ModelCheckpoint(monitor="val/score", save_top_k=2, save_last=True, filename="{epoch}-{val/score:.1f}")
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=4, check_val_every_n_epoch=2)
    trainer.fit(Scripted([9.0, 0.5, 9.0, 0.7]), *loaders())  # validated after epochs 1 and 3 only
    assert checkpoint_names(checkpoint.dirpath) == {"epoch=1-val_score=0.5.ckpt", "epoch=3-val_score=0.7.ckpt",
                                                    "last.ckpt"}
    assert load(checkpoint.last_model_path)["loops"]["progress"]["epoch"] == 3  # last.ckpt is still every epoch's


def test_without_monitor_the_latest_k_are_kept(tmp_path):
    checkpoint = ModelCheckpoint(save_top_k=2)
    make_trainer(tmp_path, [checkpoint], max_epochs=4).fit(Scripted(), *loaders())
    assert checkpoint_names(checkpoint.dirpath) == {"epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"}
    assert Path(checkpoint.best_model_path).name == "epoch=3-step=16.ckpt"
    assert checkpoint.best_model_score is None


def test_last_ckpt_is_a_second_name_for_the_checkpoint_of_the_same_step(tmp_path):
    # The Trainer's default keeps the newest epoch file and last.ckpt.
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    module = Scripted()
    make_trainer(tmp_path, [checkpoint], max_epochs=1).fit(module, *loaders())
    last, newest = Path(checkpoint.last_model_path), Path(checkpoint.best_model_path)
    assert checkpoint_names(tmp_path / "ckpts") == {"epoch=0-step=4.ckpt", "last.ckpt"}
    assert newest.samefile(last)  # one write at the epoch's end, not two
    saved = load(last)
    assert saved["loops"]["progress"]["global_step"] == 4
    for name, tensor in module.state_dict().items():
        assert torch.equal(saved["state_dict"][name], tensor)
    # The file's copy of the callback state already names last.ckpt, so a resume keeps writing there.
    assert saved["callbacks"][checkpoint.state_key]["last_model_path"] == str(last)

    resumed = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    make_trainer(tmp_path, [resumed], max_epochs=2).fit(Scripted(), *loaders(), ckpt_path=str(last))
    assert checkpoint_names(tmp_path / "ckpts") == {"epoch=1-step=8.ckpt", "last.ckpt"}
    assert Path(resumed.best_model_path).samefile(resumed.last_model_path) and resumed.last_model_path == str(last)
    assert load(last)["loops"]["progress"]["global_step"] == 8


class EpochEndScored(Scripted):
    """Logs its score in on_train_epoch_end, and counts the epochs it ended in a buffer (saved state)."""

    def __init__(self, scores):
        super().__init__()
        self.epoch_scores = scores
        self.register_buffer("epochs_ended", torch.zeros(()))

    def on_train_epoch_end(self):
        self.epochs_ended += 1
        self.log("epoch_score", self.epoch_scores[self.current_epoch])


def test_monitors_run_after_the_modules_on_train_epoch_end_and_see_what_it_logged(tmp_path):
    checkpoint = ModelCheckpoint(monitor="epoch_score", save_top_k=1, save_last=True, filename="{epoch}")
    stopper = EarlyStopping("epoch_score", patience=2)
    module = EpochEndScored([0.3, 0.1, 0.2, 0.4, 0.5])
    make_trainer(tmp_path, [checkpoint, stopper], max_epochs=5).fit(module, loaders()[0])
    assert stopper.stopped_epoch == 3  # 0.2 and 0.4 do not beat 0.1
    assert checkpoint_names(checkpoint.dirpath) == {"epoch=1.ckpt", "last.ckpt"}
    # Each checkpoint holds what the module's hook changed at that epoch's end.
    assert float(load(checkpoint.best_model_path)["state_dict"]["epochs_ended"]) == 2
    assert float(load(checkpoint.last_model_path)["state_dict"]["epochs_ended"]) == 4


def test_last_after_a_fit_is_this_runs_newest_checkpoint_never_an_older_runs(tmp_path):
    make_trainer(tmp_path, [ModelCheckpoint(save_last=True)], max_epochs=1).fit(Scripted(), loaders()[0])
    checkpoint = ModelCheckpoint(monitor="val/score", save_top_k=1)  # this run writes no last.ckpt
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=2)
    module = Scripted([0.5, 0.2])
    trainer.fit(module, *loaders())
    with torch.no_grad():
        module.layer.weight.add_(1.0)
    trainer.test(module, loaders()[1], ckpt_path="last")
    assert torch.equal(module.layer.weight, load(checkpoint.best_model_path)["state_dict"]["layer.weight"])

    unsaved = make_trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    unsaved.fit(Scripted(), loaders()[0])
    with pytest.raises(MisconfigurationError, match='ckpt_path="last": the run of this Trainer saved no checkpoint'):
        unsaved.test(ckpt_path="last", dataloaders=loaders()[1])


def test_name_collisions_get_version_suffixes(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="fixed", save_top_k=-1)
    make_trainer(tmp_path, [checkpoint], max_epochs=3).fit(Scripted(), *loaders())
    assert checkpoint_names(tmp_path / "ckpts") == {"fixed.ckpt", "fixed-v1.ckpt", "fixed-v2.ckpt"}


def test_without_version_counter_a_taken_name_is_overwritten(tmp_path):
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", filename="fixed", save_top_k=-1, enable_version_counter=False
    )
    module = Scripted()
    make_trainer(tmp_path, [checkpoint], max_epochs=3).fit(module, *loaders())
    assert checkpoint_names(tmp_path / "ckpts") == {"fixed.ckpt"}
    saved = load(tmp_path / "ckpts" / "fixed.ckpt")
    assert saved["loops"]["progress"]["epoch"] == 2  # the last epoch's save replaced the others
    assert torch.equal(saved["state_dict"]["layer.weight"], module.layer.weight)
    assert list(checkpoint.best_k_models) == [str(tmp_path / "ckpts" / "fixed.ckpt")]


def test_weights_only_checkpoints_evaluate_and_load_but_do_not_resume(tmp_path):
    checkpoint = ModelCheckpoint(monitor="val/score", save_top_k=1, save_last=True, save_weights_only=True)
    module = Scripted([0.3, 0.1, 0.2])
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=3)
    trainer.fit(module, *loaders())
    best, last = load(checkpoint.best_model_path), load(checkpoint.last_model_path)
    assert Path(checkpoint.best_model_path).name == "epoch=1-step=8.ckpt"
    for saved in (best, last):
        assert not {"optimizer_states", "loops", "callbacks", "rng"} & saved.keys()
        assert saved["state_dict"].keys() == module.state_dict().keys()
    assert last["global_step"] == 12 and torch.equal(last["state_dict"]["layer.weight"], module.layer.weight)
    assert best["epoch"] == 1 and not torch.equal(best["state_dict"]["layer.weight"], module.layer.weight)

    trainer.test(module, loaders()[1], ckpt_path="best")  # evaluation needs the weights alone
    assert torch.equal(module.layer.weight, best["state_dict"]["layer.weight"])
    evaluated = Scripted([0.0] * 4)
    trainer.validate(evaluated, loaders()[1], ckpt_path="last")  # "last" finds weights-only files for evaluation
    assert torch.equal(evaluated.layer.weight, last["state_dict"]["layer.weight"])
    assert torch.equal(
        Scripted.load_from_checkpoint(checkpoint.last_model_path).layer.weight, last["state_dict"]["layer.weight"]
    )

    with pytest.raises(CheckpointError, match="holds only the model's weights .* a fit cannot resume from it"):
        make_trainer(tmp_path, max_epochs=4).fit(Scripted([0.3] * 4), *loaders(), ckpt_path=checkpoint.last_model_path)
    with pytest.raises(CheckpointError, match='ckpt_path="last": no checkpoint in .* can be used: .*weights-only ones'):
        make_trainer(tmp_path, max_epochs=4).fit(Scripted([0.3] * 4), *loaders(), ckpt_path="last")


def test_two_checkpoint_callbacks_on_one_monitor_keep_their_own_files_across_a_resume(tmp_path):
    def callbacks():
        return [ModelCheckpoint(monitor="val/score", save_top_k=1, filename="best-{epoch}"),
                ModelCheckpoint(monitor="val/score", save_top_k=3, filename="top3-{epoch}", save_last=True)]

    scores = [0.5, 0.4, 0.3, 0.2, 0.1]
    first = callbacks()
    make_trainer(tmp_path, first, max_epochs=3).fit(Scripted(scores), *loaders())
    second = callbacks()
    make_trainer(tmp_path, second, max_epochs=5).fit(Scripted(scores), *loaders(), ckpt_path=first[1].last_model_path)
    names = checkpoint_names(second[0].dirpath)
    assert names == {"best-epoch=4.ckpt", "top3-epoch=2.ckpt", "top3-epoch=3.ckpt", "top3-epoch=4.ckpt", "last.ckpt"}
    assert [Path(p).name for p in second[0].best_k_models] == ["best-epoch=4.ckpt"]
    assert sorted(Path(p).name for p in second[1].best_k_models) == [
        "top3-epoch=2.ckpt",
        "top3-epoch=3.ckpt",
        "top3-epoch=4.ckpt",
    ]


def test_a_checkpoint_from_before_the_filename_joined_the_state_key_still_restores_its_state(tmp_path):
    def callback():
        return ModelCheckpoint(monitor="val/score", save_top_k=2, filename="best-{epoch}", save_last=True)

    first = callback()
    make_trainer(tmp_path, [first], max_epochs=3).fit(Scripted([0.5, 0.4, 0.3]), *loaders())
    saved = load(first.last_model_path)
    saved["callbacks"] = {first.legacy_state_key: saved["callbacks"][first.state_key]}  # the old layout
    torch.save(saved, tmp_path / "old.ckpt")
    second = callback()
    make_trainer(tmp_path, [second], max_epochs=4).fit(
        Scripted([0.5, 0.4, 0.3, 0.2]), *loaders(), ckpt_path=tmp_path / "old.ckpt"
    )
    assert sorted(Path(p).name for p in second.best_k_models) == ["best-epoch=2.ckpt", "best-epoch=3.ckpt"]

    class Counter(Callback):
        def state_dict(self):
            return {"n": 1}

    with pytest.warns(UserWarning, match=r"the checkpoint holds no state for the callback .*Counter .*starts afresh"):
        make_trainer(tmp_path, [Counter()], max_epochs=4, enable_checkpointing=False).fit(
            Scripted([0.0] * 4), *loaders(), ckpt_path=tmp_path / "old.ckpt")


def test_callbacks_whose_states_would_share_a_checkpoint_entry_are_refused():
    class Counter(Callback):
        def __init__(self):
            self.batches = 0

        def state_dict(self):
            return {"batches": self.batches}

    with pytest.raises(
        MisconfigurationError, match="two Counter callbacks have the same state_key '.*Counter'.*override state_key"
    ):
        Trainer(callbacks=[Counter(), Counter()], logger=False)
    with pytest.raises(MisconfigurationError, match="two ModelCheckpoint callbacks have the same state_key"):
        Trainer(callbacks=[ModelCheckpoint(monitor="a", save_top_k=1), ModelCheckpoint(monitor="a", save_top_k=3)])
    Trainer(callbacks=[Timer(duration="00:01:00:00"), LearningRateMonitor(), LearningRateMonitor()], logger=False)


def test_format_checkpoint_name():
    checkpoint = ModelCheckpoint(filename="{epoch:02d}-{val/acc:.3f}-train.loss={train.loss:.1f}-{absent}")
    values = {"epoch": 3, "step": 7, "val/acc": torch.tensor(0.91234), "train.loss": 1.25}
    assert checkpoint.format_checkpoint_name(values) == "epoch=03-val_acc=0.912-train.loss=1.2-absent=0.ckpt"
    # As in Lightning, a metric not logged yet is 0; a count logged as a float takes an integer format.
    counted = ModelCheckpoint(filename="{epoch}-{n_correct:03d}-{val/acc:.2f}")
    assert counted.format_checkpoint_name({"epoch": 1}) == "epoch=1-n_correct=000-val_acc=0.00.ckpt"
    assert (
        counted.format_checkpoint_name({"epoch": 1, "n_correct": 7.0, "val/acc": 0.5})
        == "epoch=1-n_correct=007-val_acc=0.50.ckpt"
    )
    with pytest.raises(
        MisconfigurationError,
        match=r"filename='\{epoch\}-\{n_correct:03d\}-\{val/acc:.2f\}'\): n_correct=7.5 "
        r"cannot be formatted as '03d'",
    ):
        counted.format_checkpoint_name({"epoch": 1, "n_correct": 7.5})
    assert checkpoint.format_checkpoint_name(values, "epoch={epoch}-step={step}") == "epoch=3-step=7.ckpt"
    assert ModelCheckpoint(auto_insert_metric_name=False).format_checkpoint_name(values) == "3-7.ckpt"


def test_missing_monitor_names_the_key_and_the_logged_keys(tmp_path):
    trainer = make_trainer(tmp_path, [ModelCheckpoint(monitor="val_acc")], max_epochs=1)
    with pytest.raises(MisconfigurationError) as error:
        trainer.fit(Scripted([0.5]), *loaders())
    assert "'val_acc'" in str(error.value)
    assert str(["train_loss", "val/score"]) in str(error.value)

    # With save_last the epoch's work is in last.ckpt before the error stops the run.
    checkpoint = ModelCheckpoint(monitor="val_acc", save_last=True)
    with pytest.raises(
        MisconfigurationError, match=r"found no such logged metric.*The run so far is saved in .*last\.ckpt"
    ):
        make_trainer(tmp_path, [checkpoint], max_epochs=2).fit(Scripted([0.5, 0.5]), *loaders())
    assert load(checkpoint.last_model_path)["loops"]["progress"]["global_step"] == 4


def test_a_misspelled_monitor_in_a_fit_without_validation_is_an_error_after_last_ckpt_is_saved(tmp_path):
    checkpoint = ModelCheckpoint(monitor="train_los", save_last=True)
    with pytest.raises(MisconfigurationError, match=r"monitor='train_los'\) found no such logged metric; logged: "
                                                    r"\['train_loss'\].*saved in .*last\.ckpt"):
        make_trainer(tmp_path, [checkpoint], max_epochs=2).fit(Scripted(), loaders()[0])
    assert checkpoint_names(checkpoint.dirpath) == {"last.ckpt"}


def test_a_validation_monitor_with_validation_off_warns_and_keeps_last(tmp_path):
    checkpoint = ModelCheckpoint(monitor="val/score", save_last=True)
    trainer = make_trainer(tmp_path, [checkpoint], max_epochs=2, limit_val_batches=0)
    with pytest.warns(UserWarning, match="monitor='val/score'.*found no such logged metric.*Skipping top-k saving"):
        trainer.fit(Scripted([0.5, 0.5]), *loaders())
    assert checkpoint_names(checkpoint.dirpath) == {"last.ckpt"} and trainer.global_step == 8


def test_resume_keeps_top_k_bookkeeping(tmp_path):
    scores = [0.5, 0.3, 0.9, 0.4, 0.2, 0.8, 0.35, 0.6]

    def run(max_epochs, ckpt_path=None):
        checkpoint = ModelCheckpoint(monitor="val/score", save_top_k=2, save_last=True)
        trainer = make_trainer(tmp_path, [checkpoint], max_epochs=max_epochs, logger=True, log_every_n_steps=1)
        trainer.fit(Scripted(scores), *loaders(), ckpt_path=ckpt_path)
        return checkpoint

    first = run(4)
    assert sorted(float(s) for s in first.best_k_models.values()) == pytest.approx([0.3, 0.4])
    second = run(8, ckpt_path=first.last_model_path)
    assert second.dirpath == first.dirpath  # the CSV logger resumed the same version folder
    # Over both runs the two best are epoch 4 (0.2) and epoch 1 (0.3); run 1's epoch 3 file was evicted.
    assert checkpoint_names(second.dirpath) == {"epoch=1-step=8.ckpt", "epoch=4-step=20.ckpt", "last.ckpt"}
    assert Path(second.best_model_path).name == "epoch=4-step=20.ckpt"


def test_checkpoint_state_round_trips_through_a_weights_only_file(tmp_path):
    by_score = ModelCheckpoint(monitor="val/score", save_top_k=2, save_last=True)
    latest = ModelCheckpoint(every_n_train_steps=4, save_top_k=1)
    assert by_score.state_key != latest.state_key
    make_trainer(tmp_path, [by_score, latest], max_epochs=3).fit(Scripted([0.3, 0.1, 0.2]), *loaders())
    states = load(by_score.last_model_path)["callbacks"]
    assert {by_score.state_key, latest.state_key} <= set(states)

    restored = ModelCheckpoint(monitor="val/score", save_top_k=2, save_last=True)
    restored.load_state_dict(states[by_score.state_key])
    assert restored.best_k_models.keys() == by_score.best_k_models.keys()
    assert restored.best_model_path == by_score.best_model_path
    assert float(restored.best_model_score) == pytest.approx(0.1)
    assert restored.last_model_path == by_score.last_model_path


# --------------------------------------------------------------------------- EarlyStopping


@pytest.mark.parametrize("min_delta, stop_epoch", [
    # best 1.0 (e0); 0.97 is not below 1.0 - 0.05 (wait 1); 0.96 is not below either (wait 2 = patience).
    (0.05, 2),
    # every value improves until 0.5 (e3); 0.6 (wait 1), 0.7 (wait 2 = patience).
    (0.0, 5),
])
def test_early_stopping_patience_and_min_delta(tmp_path, min_delta, stop_epoch):
    scores = [1.0, 0.97, 0.96, 0.5, 0.6, 0.7, 0.1, 0.1]
    stopper = EarlyStopping("val/score", min_delta=min_delta, patience=2)
    checkpoint = ModelCheckpoint(save_top_k=0, save_last=True)
    module = Scripted(scores)
    make_trainer(tmp_path, [checkpoint, stopper], max_epochs=len(scores)).fit(module, *loaders())
    assert stopper.stopped_epoch == stop_epoch
    assert module.validations == stop_epoch + 1  # no epoch ran after the stop
    assert stopper.wait_count == 2
    # ModelCheckpoint runs after EarlyStopping, so the last checkpoint holds the counters of its epoch.
    saved = load(checkpoint.last_model_path)["callbacks"][stopper.state_key]
    assert (saved["wait_count"], saved["stopped_epoch"]) == (2, stop_epoch)


def test_early_stopping_checks_after_each_mid_epoch_validation(tmp_path):
    # Validations after batches 2 and 4 of each epoch; the third (epoch 1, batch 2) is the second miss.
    stopper = EarlyStopping("val/score", patience=1)
    trainer = make_trainer(tmp_path, [stopper], max_epochs=5, val_check_interval=0.5)
    trainer.fit(Scripted([1.0, 0.95, 0.97, 0.0], per_validation=True), *loaders())
    assert stopper.stopped_epoch == 1
    assert trainer.global_step == BATCHES_PER_EPOCH + 2


def test_early_stopping_stops_on_a_non_finite_value(tmp_path, capsys):
    stopper = EarlyStopping("val/score", patience=10)
    module = Scripted([1.0, 0.8, math.nan, 0.5])
    make_trainer(tmp_path, [stopper], max_epochs=4).fit(module, *loaders())
    assert stopper.stopped_epoch == 2 and module.validations == 3
    assert "not finite" in stopper.stopping_reason_message
    assert "not finite" in capsys.readouterr().out


def test_early_stopping_missing_key(tmp_path):
    with pytest.raises(MisconfigurationError, match=r"'val_acc'.*\['train_loss', 'val/score'\]"):
        make_trainer(tmp_path, [EarlyStopping("val_acc")], max_epochs=2).fit(Scripted([1.0, 1.0]), *loaders())
    module = Scripted([1.0, 1.0])
    with pytest.warns(UserWarning, match="val_acc"):
        make_trainer(tmp_path, [EarlyStopping("val_acc", strict=False)], max_epochs=2).fit(module, *loaders())
    assert module.validations == 2


def test_early_stopping_state_round_trip(tmp_path):
    stopper = EarlyStopping("val/score", patience=3)
    make_trainer(tmp_path, [stopper], max_epochs=3).fit(Scripted([0.5, 0.6, 0.7]), *loaders())
    torch.save(stopper.state_dict(), tmp_path / "state.pt")
    restored = EarlyStopping("val/score", patience=3)
    restored.load_state_dict(load(tmp_path / "state.pt"))
    assert (restored.wait_count, restored.best_score) == (2, pytest.approx(0.5))
    # One more miss is the third in a row only because the count came back with the state.
    stopper_trainer = make_trainer(tmp_path, [restored], max_epochs=5)
    module = Scripted([0.9] * 5)
    stopper_trainer.fit(module, *loaders())
    assert restored.stopped_epoch == 0 and module.validations == 1


# --------------------------------------------------------------------------- Timer


@pytest.mark.parametrize("duration", [90, 90.0, timedelta(minutes=1, seconds=30), {"minutes": 1, "seconds": 30},
                                      "00:00:01:30"])
def test_timer_durations(duration):
    assert parse_duration(duration) == 90.0


@pytest.mark.parametrize("duration", ["1:30", -1, {"minute": 1}, True, [1]])
def test_timer_rejects_bad_durations(duration):
    with pytest.raises(MisconfigurationError, match="Timer"):
        Timer(duration)


class ElapsedRecorder(Callback):
    """Records the timer's reading after each step, just before the timer itself checks."""

    def __init__(self, timer):
        self.timer, self.readings = timer, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.readings.append(self.timer.time_elapsed("train"))


def test_timer_stops_a_run(tmp_path):
    budget = 0.03
    timer = Timer(duration=timedelta(seconds=budget))
    recorder = ElapsedRecorder(timer)
    trainer = make_trainer(tmp_path, [recorder, timer], max_epochs=1000)
    trainer.fit(Scripted(sleep=0.005), *loaders())
    assert trainer.should_stop and trainer.global_step == len(recorder.readings)
    # It ran on while the budget lasted and stopped after the first step that spent it.
    assert all(reading < budget for reading in recorder.readings[:-1])
    assert timer.time_elapsed("train") >= budget


def test_max_time_stops_a_run_as_a_timer_does(tmp_path):
    budget = 0.03
    trainer = make_trainer(tmp_path, max_time={"seconds": budget}, max_epochs=1000)
    timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
    recorder = ElapsedRecorder(timer)
    trainer.callbacks.insert(0, recorder)
    trainer.fit(Scripted(sleep=0.005), *loaders())
    assert trainer.should_stop and trainer.global_step == len(recorder.readings)
    assert all(reading < budget for reading in recorder.readings[:-1]) and timer.time_elapsed("train") >= budget


@pytest.mark.parametrize("max_time, message", [("1:30", r"max_time='1:30': a string must read 'DD:HH:MM:SS'"),
                                               (-5, "max_time=-5 is negative"), (True, "max_time=True: use seconds")])
def test_max_time_refuses_what_is_not_a_duration(max_time, message):
    with pytest.raises(MisconfigurationError, match=message):
        Trainer(max_time=max_time)


def test_a_run_resumed_with_its_time_budget_spent_trains_no_further(tmp_path):
    first = make_trainer(tmp_path, max_time={"seconds": 0.02}, max_epochs=1000)
    first.fit(Scripted(sleep=0.005), *loaders())
    stopped_at = first.global_step
    resumed = make_trainer(tmp_path, max_time={"seconds": 0.02}, max_epochs=1000)
    resumed.fit(Scripted(sleep=0.005), *loaders(), ckpt_path="last")
    assert resumed.global_step == stopped_at and resumed.should_stop


def test_max_time_and_a_timer_callback_are_refused_together():
    with pytest.raises(MisconfigurationError, match="max_time and a Timer callback both time the run"):
        Trainer(max_time="00:01:00:00", callbacks=[Timer()])


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_timer_budget_survives_resume(tmp_path, interval):
    timer = Timer(duration=60, interval=interval)
    timer.load_state_dict({"time_elapsed": {"train": 60.0, "validate": 0.0, "test": 0.0}})
    assert timer.time_elapsed("train") == 60.0
    trainer = make_trainer(tmp_path, [timer], max_epochs=10)
    trainer.fit(Scripted(), *loaders())
    assert trainer.global_step == 0  # the budget was spent before this run: checked at fit start, as in Lightning
    assert timer.state_dict()["time_elapsed"]["train"] >= 60.0


# --------------------------------------------------------------------------- LearningRateMonitor


def read_lr_rows(log_dir) -> list[tuple[int, float]]:
    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        return [(int(row["step"]), float(row["lr-SGD"])) for row in csv.DictReader(f) if row.get("lr-SGD")]


class Scheduled(Scripted):
    def __init__(self, interval):
        super().__init__()
        self.interval = interval

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.interval is None:
            return optimizer
        if self.interval == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        else:
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


def test_lr_monitor_follows_a_step_scheduler(tmp_path):
    trainer = make_trainer(tmp_path, [LearningRateMonitor()], max_epochs=2, logger=True, log_every_n_steps=1)
    trainer.fit(Scheduled("step"), *loaders())
    # Row s holds the rate of the step after it: halved every 2 steps.
    assert read_lr_rows(Path(trainer.log_dir)) == [(s, pytest.approx(0.1 * 0.5 ** (s // 2))) for s in range(8)]


def test_lr_monitor_follows_an_epoch_scheduler(tmp_path):
    trainer = make_trainer(tmp_path, [LearningRateMonitor()], max_epochs=3, logger=True, log_every_n_steps=1)
    trainer.fit(Scheduled("epoch"), *loaders())
    expected = [(BATCHES_PER_EPOCH * e, pytest.approx(0.1 * 0.9**e)) for e in range(3)]
    assert read_lr_rows(Path(trainer.log_dir)) == expected


def test_lr_monitor_logs_an_optimizer_without_a_scheduler_every_step_and_epoch(tmp_path):
    class ByHand(Scheduled):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.optimizers().param_groups[0]["lr"] += 0.1  # a rate no scheduler knows about

    trainer = make_trainer(tmp_path, [LearningRateMonitor()], max_epochs=2, logger=True, log_every_n_steps=1)
    trainer.fit(ByHand(None), *loaders())
    steps = 2 * BATCHES_PER_EPOCH  # each step's row, and each epoch start's (as in Lightning)
    expected = sorted([(s, pytest.approx(0.1 * (s + 1))) for s in range(steps)] +
                      [(e * BATCHES_PER_EPOCH, pytest.approx(0.1 * (e * BATCHES_PER_EPOCH + 1))) for e in range(2)],
                      key=lambda row: row[0])
    assert read_lr_rows(Path(trainer.log_dir)) == expected


def test_lr_monitor_logs_the_warmed_rate_during_lr_scaling_warmup(tmp_path):
    trainer = make_trainer(tmp_path, [LearningRateMonitor("step")], max_epochs=2, logger=True, log_every_n_steps=1,
                           accumulate_grad_batches=2, lr_scaling="linear", lr_warmup_steps=2)
    trainer.fit(Scheduled(None), *loaders())
    # x2 (accumulate 2), reached linearly over 2 steps: 0.1, 0.15, then 0.2.
    assert read_lr_rows(Path(trainer.log_dir)) == [(0, pytest.approx(0.1)), (1, pytest.approx(0.15)),
                                             (2, pytest.approx(0.2)), (3, pytest.approx(0.2))]


class ManyGroups(Scripted):
    def __init__(self):
        super().__init__()
        self.extra, self.more = nn.Linear(4, 1), nn.Linear(4, 1)

    def configure_optimizers(self):
        sgd = torch.optim.SGD([{"params": self.layer.parameters()}, {"params": self.extra.parameters(), "lr": 0.2,
                                                                     "name": "head"}], lr=0.1, momentum=0.9)
        adam = torch.optim.Adam(self.more.parameters(), lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)
        named = torch.optim.Adam(self.more.parameters(), lr=0.03)
        scheduler = torch.optim.lr_scheduler.StepLR(named, step_size=1)
        second = torch.optim.Adam(self.extra.parameters(), lr=0.04)
        return [sgd, adam, named, second], [{"scheduler": scheduler, "interval": "epoch", "name": "decoder-lr"}]


def test_lr_monitor_names_rates_as_lightning_does_and_logs_momentum_and_weight_decay(tmp_path):
    monitor = LearningRateMonitor(logging_interval="epoch", log_momentum=True, log_weight_decay=True)
    trainer = make_trainer(tmp_path, [monitor], max_epochs=1, logger=True, log_every_n_steps=1)
    module = ManyGroups()
    module.automatic_optimization = False  # four optimizers: stepped by hand (here: not at all)
    module.training_step = lambda batch, batch_idx: None
    trainer.fit(module, *loaders())
    with open(Path(trainer.log_dir) / "metrics.csv", newline="") as f:
        [row] = [{k: float(v) for k, v in row.items() if v and k not in ("step", "epoch")} for row in csv.DictReader(f)]
    assert row == {"lr-SGD/pg1": 0.1, "lr-SGD/pg1-momentum": 0.9, "lr-SGD/pg1-weight_decay": 0.0,
                   "lr-SGD/head": 0.2, "lr-SGD/head-momentum": 0.9, "lr-SGD/head-weight_decay": 0.0,
                   "lr-Adam": 0.01, "lr-Adam-momentum": 0.8, "lr-Adam-weight_decay": pytest.approx(0.1),
                   "decoder-lr": 0.03, "decoder-lr-momentum": 0.9, "decoder-lr-weight_decay": 0.0,
                   "lr-Adam-1": 0.04, "lr-Adam-1-momentum": 0.9, "lr-Adam-1-weight_decay": 0.0}


def test_lr_monitor_needs_a_logger(tmp_path):
    with pytest.raises(MisconfigurationError, match="logger"):
        make_trainer(tmp_path, [LearningRateMonitor()], max_epochs=1).fit(Scripted(), *loaders())


# --------------------------------------------------------------------------- ModelSummary


class WithFrozenPart(Scripted):
    def __init__(self, scores):
        super().__init__(scores)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.layer(self.body(x))


def test_model_summary_counts_and_run_summary(tmp_path, capsys):
    module = WithFrozenPart([0.4, 0.2])
    summary = ModelSummary(max_depth=2)
    checkpoint = ModelCheckpoint(monitor="val/score", save_last=True)
    make_trainer(tmp_path, [summary, checkpoint], max_epochs=2).fit(module, *loaders())

    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert (summary.total_parameters, summary.trainable_parameters) == (total, trainable)
    assert summary.non_trainable_parameters == module.frozen.weight.numel() + module.frozen.bias.numel()
    rows = {layer.name: layer.parameters for layer in summary.layers}
    assert rows["body"] == sum(p.numel() for p in module.body.parameters())
    assert rows["body.2"] == 8 * 4 + 4 and "body.1" in rows
    assert summary.model_size_mb == pytest.approx(total * 4 / 1e6)

    out = capsys.readouterr().out
    assert "Total params" in out and f"{total:,}" in out
    assert "Run summary" in out and "val/score best" in out
    assert summary.run_summary["val/score best"] == pytest.approx(0.2)
    assert summary.run_summary["val/score last"] == pytest.approx(0.2)
    assert summary.run_summary["val/score best checkpoint"] == checkpoint.best_model_path
    assert summary.run_summary["train samples"] == 2 * 16
    assert summary.run_summary["train samples/s"] > 0

    make_trainer(tmp_path, [ModelSummary(max_depth=0)], max_epochs=1).fit(WithFrozenPart([0.4]), *loaders())
    out = capsys.readouterr().out
    assert "Model summary" not in out and "Run summary" in out  # 0: no layer table, as in Lightning


# --------------------------------------------------------------------------- RichProgressBar


def test_progress_bar_prints_one_line_per_epoch_without_a_terminal(tmp_path, capsys):
    make_trainer(tmp_path, max_epochs=3, enable_progress_bar=True).fit(Scripted([0.1] * 3), *loaders())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 3
    assert lines[2].startswith("Epoch 2/2: 4/4 batches")
    assert "train_loss=" in lines[2] and "val/score=0.1" in lines[2] and "step=12" in lines[2]


def test_progress_bar_draws_on_a_terminal_and_throttles_refreshes(tmp_path, monkeypatch):
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    make_trainer(tmp_path, [RichProgressBar(refresh_interval=0, console=console)], max_epochs=2).fit(
        Scripted([0.1] * 2), *loaders())
    drawn = console.file.getvalue()
    assert "Epoch 1/1" in drawn and "train_loss=" in drawn and "it/s" in drawn
    last_frame = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn).rsplit("Epoch 1/1", 1)[1]
    assert " 4/4 " in last_frame  # the finished bar counts the whole epoch, not the next one's 0

    reads = []
    original = progress_module.metrics_text
    monkeypatch.setattr(progress_module, "metrics_text", lambda trainer: reads.append(1) or original(trainer))
    slow_console = Console(file=io.StringIO(), force_terminal=True, width=160)
    bar = RichProgressBar(refresh_interval=3600, console=slow_console)
    make_trainer(tmp_path, [bar], max_epochs=2).fit(Scripted(), *loaders(samples=256, batch_size=2))
    # 256 batches over 2 epochs, yet metrics are read only when the bar changes: an epoch's start and end and
    # its validation's start and end (rich redraws once more when it stops).
    assert 0 < len(reads) <= 4 * 2 + 1


class WaitsForTheBar(Scripted):
    """At batch 5, waits until the bar (redrawn by rich's thread, never by the loop) shows 5 batches done."""

    def __init__(self, bar):
        super().__init__()
        self.bar, self.seen = bar, None

    def training_step(self, batch, batch_idx):
        if batch_idx == 5:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.seen != 5:
                time.sleep(0.01)
                self.seen = self.bar._progress.tasks[0].completed
        return super().training_step(batch, batch_idx)


def test_progress_bar_is_drawn_by_richs_thread_with_no_work_per_batch(tmp_path):
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    bar = RichProgressBar(refresh_interval=0.02, console=console)
    module = WaitsForTheBar(bar)
    trainer = make_trainer(tmp_path, [bar], max_epochs=1)
    assert trainer.hooks.bound("on_train_batch_end") is None  # the step calls nothing for the bar
    trainer.fit(module, *loaders(samples=64, batch_size=2))
    assert module.seen == 5
    assert "5/32" in console.file.getvalue() and "32/32" in console.file.getvalue()


def test_progress_bar_takes_lightnings_arguments_with_lightnings_meaning(tmp_path, capsys):
    def frames(bar_options, epochs=2):
        console = Console(file=io.StringIO(), force_terminal=True, width=160)
        bar = RichProgressBar(refresh_interval=0, console=console, **bar_options)
        make_trainer(tmp_path, [bar], max_epochs=epochs).fit(
            Scripted([0.1] * epochs), *loaders(samples=32, batch_size=4)
        )
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())

    counts = set(re.findall(r" (\d)/8 ", frames({"refresh_rate": 3}, epochs=1)))
    assert counts == {"0", "3", "6", "8"}  # the count moves every 3 batches; the finished epoch shows all 8
    assert frames({"refresh_rate": 0}) == "" and capsys.readouterr().out == ""  # 0 hides the bar, as in Lightning
    for leave, bars in ((True, ["Epoch 0/2", "Epoch 1/2", "Epoch 2/2"]), (False, ["Epoch 2/2"])):
        console = Console(file=io.StringIO(), force_terminal=True, width=160)
        bar = RichProgressBar(leave=leave, console=console)

        class Shown(Callback):
            def __init__(self, bar):
                self.bar = bar

            def on_train_end(self, trainer, module):  # before the bar stops: the rows on screen
                self.rows = [task.description for task in self.bar._progress.tasks]

        shown = Shown(bar)
        make_trainer(tmp_path, [shown, bar], max_epochs=3).fit(Scripted([0.1] * 3), *loaders())
        assert shown.rows == bars  # with leave, each finished epoch's bar stays above the next one
    with pytest.raises(
        MisconfigurationError, match=r"refresh_rate=0.5\) must be a number of batches >= 0 \(0 hides the bar\)"
    ):
        RichProgressBar(refresh_rate=0.5)
    wide = RichProgressBar(console_kwargs={"width": 77})
    wide.setup(SimpleNamespace(is_global_zero=True), None, "fit")
    assert wide._console.width == 77


def test_progress_bar_draws_nothing_off_rank_zero(capsys):
    console = Console(file=io.StringIO(), force_terminal=True)
    bar = RichProgressBar(refresh_interval=0, console=console)
    other_rank = SimpleNamespace(is_global_zero=False, sanity_checking=False)
    bar.setup(other_rank, None, "fit")
    bar.on_train_epoch_start(other_rank, None)
    bar.on_validation_start(other_rank, None)
    bar.on_train_batch_end(other_rank, None, None, None, 0)
    bar.on_validation_end(other_rank, None)
    bar.on_train_epoch_end(other_rank, None)
    bar.teardown(other_rank, None, "fit")
    assert console.file.getvalue() == "" and capsys.readouterr().out == ""


class Echo(TrainModule):
    """predict_step returns its inputs, so a written prediction shows which samples it came from."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return batch[0] * 1.0


class KeepingWriter(BasePredictionWriter):
    """Keeps what it is asked to write (a real writer would torch.save it per rank)."""

    def __init__(self, write_interval: str) -> None:
        super().__init__(write_interval)
        self.batches: list[tuple] = []
        self.epochs: list[tuple] = []

    def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        self.batches.append((prediction, batch_indices, batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
        self.epochs.append((predictions, batch_indices))


def test_a_prediction_writer_gets_each_batch_with_the_dataset_indices_its_sampler_drew(tmp_path):
    data = TensorDataset(torch.arange(20.0).reshape(10, 2))
    shuffled = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5), num_workers=1)
    in_order = DataLoader(data, batch_size=3)
    writer = KeepingWriter("batch_and_epoch")
    trainer = Trainer(callbacks=[writer], accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path))
    assert trainer.predict(Echo(), [shuffled, in_order], return_predictions=False) is None  # kept by nobody

    assert [(batch_idx, loader) for _, _, batch_idx, loader in writer.batches] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
    ]
    drawn = [indices for _, indices, _, loader in writer.batches if loader == 0]
    assert sorted(i for indices in drawn for i in indices) == list(range(10)) and drawn[0] != [0, 1, 2, 3]
    for prediction, indices, _, _ in writer.batches:  # each row is the sample its index names
        assert torch.equal(prediction, data.tensors[0][indices])
    assert [indices for _, indices, _, loader in writer.batches if loader == 1] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9],
    ]
    (predictions, batch_indices), = writer.epochs  # per loader, as written batch by batch
    assert batch_indices == [drawn, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]]
    assert all(
        torch.equal(a, b) for a, b in zip(predictions[0], [p for p, _, _, loader in writer.batches if loader == 0])
    )

    returned = trainer.predict(Echo(), in_order)  # return_predictions defaults to True
    assert torch.equal(torch.cat(returned), data.tensors[0])
    with pytest.raises(
        MisconfigurationError, match=r"KeepingWriter\(write_interval='step'\) is not known; use one of batch, epoch"
    ):
        KeepingWriter("step")


# --------------------------------------------------------------------------- what a fit says at its start and end


def said(capsys, prefix: str) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith(prefix)]


class StopsAfterOneEpoch(Callback):
    """A user's stopping callback, which names its reason for the fit's last line."""

    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = True

    def stop_reason(self, trainer):
        return "one epoch was enough" if trainer.should_stop else None


@pytest.mark.parametrize(("options", "extra", "reason"), [
    ({"max_epochs": 2}, [], "max_epochs=2 reached"),
    ({"max_epochs": 5}, [StopsAfterOneEpoch()], "one epoch was enough"),
    ({"max_epochs": 5, "max_steps": 3}, [], "max_steps=3 reached"),
    ({"max_epochs": 5}, [EarlyStopping("val/score", patience=1)],
     "early stopping: 'val/score' did not improve by more than 0.0 in the last 1 checks (best 1)"),
    ({"max_epochs": 1000, "max_time": {"seconds": 0.02}}, [], "time limit reached (0:00:00.020000)"),
])
def test_a_fit_says_what_runs_it_and_at_its_end_why_it_stopped_and_where_its_run_is(tmp_path, capsys, options,
                                                                                        extra, reason):
    def module():  # steps slow enough for max_time to stop the run before its 5 scripted epochs run out
        return Scripted([1.0, 2.0, 3.0, 4.0, 5.0], sleep=0.005 if "max_time" in options else 0.0)

    make_trainer(tmp_path, [ModelSummary(max_depth=0), *extra], **options).fit(module(), *loaders())
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("trainer: ")] == [
        "trainer: fit with strategy single, 1 process on cpu",
        f"trainer: training stopped: {reason}; run folder default/version_0"]
    # Quiet without the summary, as the run summary is.
    make_trainer(tmp_path, extra, **options).fit(module(), *loaders())
    assert said(capsys, "trainer: ") == []


def test_a_finished_run_asked_to_resume_says_it_is_complete(tmp_path, capsys):
    checkpoint = ModelCheckpoint(save_top_k=0, save_last=True)
    make_trainer(tmp_path, [ModelSummary(0), checkpoint], max_epochs=1).fit(Scripted(), *loaders())
    capsys.readouterr()
    resumed = make_trainer(tmp_path, [ModelSummary(0), ModelCheckpoint(save_top_k=0, save_last=True)], max_epochs=1)
    resumed.fit(Scripted(), *loaders(), ckpt_path="last")
    out = capsys.readouterr().out
    assert "Run summary" not in out and "training stopped" not in out
    assert ("trainer: the run in default/version_0 is already complete (max_epochs=1 reached); nothing to train. "
            "Raise max_epochs, max_steps or max_time to train it further.") in out.splitlines()


class Endless(torch.utils.data.IterableDataset):
    """Batches without a length: a loader over it counts as math.inf batches an epoch."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(12):
            yield torch.randn(4, generator=generator), torch.randn(1, generator=generator)


def test_progress_lines_outside_a_terminal_count_unsized_loaders_and_come_every_line_interval(tmp_path, capsys):
    bar = RichProgressBar(line_interval=0.05)
    trainer = make_trainer(tmp_path, [bar], max_epochs=1)
    assert trainer.hooks.bound("on_train_batch_end") is None  # the lines cost the steps nothing
    trainer.fit(Scripted(sleep=0.02), DataLoader(Endless(), batch_size=1))
    lines = said(capsys, "Epoch 0/0: ")
    assert lines[-1].startswith("Epoch 0/0: 12 batches, ") and "inf" not in "".join(lines)
    counts = [int(line.split(": ")[1].split(" ")[0]) for line in lines[:-1]]
    assert counts and counts == sorted(counts) and counts[-1] <= 12  # lines while the epoch ran
    with pytest.raises(MisconfigurationError, match="line_interval"):
        RichProgressBar(line_interval=-1)
