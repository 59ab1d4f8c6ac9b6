"""User mistakes raise one clear error that says what was given, what is allowed, and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.errors import CheckpointError, MisconfigurationError

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
             accelerator="cpu")


class Tiny(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(samples: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(samples, 2)), batch_size=2)


def fit(module: TrainModule, data=None, **options) -> Trainer:
    trainer = Trainer(**{"max_epochs": 1, **QUIET, **options})
    trainer.fit(module, loader() if data is None else data)
    return trainer


def test_missing_configure_optimizers():
    class NoOptimizer(Tiny):
        configure_optimizers = TrainModule.configure_optimizers

    with pytest.raises(
        MisconfigurationError, match=r"NoOptimizer has no configure_optimizers\(\).*return torch\.optim"
    ):
        fit(NoOptimizer())


def test_training_step_returning_none():
    class ReturnsNothing(Tiny):
        def training_step(self, batch, batch_idx):
            self.layer(batch[0]).sum()

    with pytest.raises(MisconfigurationError, match=r"training_step returned None.*automatic_optimization = False"):
        fit(ReturnsNothing())


def test_missing_training_step():
    class NoStep(TrainModule):
        def configure_optimizers(self):
            return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)

    with pytest.raises(MisconfigurationError, match=r"NoStep must define training_step"):
        fit(NoStep())


def test_ckpt_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(MisconfigurationError, match=r"ckpt_path '.*nope\.ckpt' does not exist"):
        Trainer(max_epochs=1, **QUIET).fit(Tiny(), loader(), ckpt_path=missing)
    with pytest.raises(CheckpointError, match=r"nope\.ckpt' does not exist"):
        Tiny.load_from_checkpoint(missing)
    with pytest.raises(
        MisconfigurationError, match=r"ckpt_path '.*' is a folder; give a checkpoint file in it, or 'last'"
    ):
        Trainer(max_epochs=1, **QUIET).fit(Tiny(), loader(), ckpt_path=tmp_path)


def test_empty_dataloader():
    no_samples = "training dataloader yields no batches: its dataset has no samples"
    with pytest.raises(MisconfigurationError, match=no_samples):
        fit(Tiny(), loader(samples=0))
    for zero in (0, 0.0):  # refused when the Trainer is built, before anything starts
        with pytest.raises(MisconfigurationError, match="limit_train_batches=0(.0)? would train on nothing"):
            Trainer(limit_train_batches=zero)


@pytest.mark.parametrize("key", ["enable_checkpointing", "enable_progress_bar", "deterministic", "inference_mode"])
def test_a_switch_given_a_string_is_refused(key):
    with pytest.raises(MisconfigurationError, match=f"trainer option {key}='false' must be True or False"):
        Trainer(**{key: "false"})
    assert Trainer(deterministic="warn").config.deterministic is True  # Lightning's spelling of ours
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert Trainer(devices="auto").config.devices == expected  # Lightning's default


class Nothing(IterableDataset):
    def __iter__(self):
        return iter(())


def test_iterable_dataloader_that_yields_nothing():
    with pytest.raises(MisconfigurationError, match="yielded no batches"):
        fit(Tiny(), DataLoader(Nothing(), batch_size=2))


def test_fp16_mixed_on_cpu():
    with pytest.raises(MisconfigurationError, match=r"precision='16-mixed' is not supported on CPU.*bf16-mixed"):
        Trainer(precision="16-mixed", accelerator="cpu")
    with pytest.raises(MisconfigurationError, match=r"precision='8' is not known; use one of 32, bf16-mixed, 16-mixed"):
        Trainer(precision="8")


@pytest.mark.parametrize(
    "spelling, name", [(32, "32"), ("32-true", "32"), ("bf16", "bf16-mixed"), ("bf16-mixed", "bf16-mixed")]
)
def test_lightning_spellings_of_precision(spelling, name):
    assert Trainer(precision=spelling, accelerator="cpu").config.precision == name


@pytest.mark.parametrize(
    "spelling, advice",
    [
        (16, "'16-mixed' is not supported on CPU"),
        ("bf16-true", r"the whole model in bf16\) is not supported; use 'bf16-mixed'"),
        (64, r"the whole model in 64\) is not supported; use precision='32' with"),
    ],
)
def test_precisions_this_framework_lacks_say_what_to_use(spelling, advice):
    with pytest.raises(MisconfigurationError, match=advice):
        Trainer(precision=spelling, accelerator="cpu")


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(MisconfigurationError, match=r"strategy='horovod' is not known.*known strategies: .*single"):
        Trainer(strategy="horovod")
    with pytest.raises(MisconfigurationError, match=r"did you mean 'single'"):
        Trainer(strategy="singel")


def test_unknown_option_suggests_the_closest():
    with pytest.raises(MisconfigurationError, match=r"unknown trainer option 'max_epoch' \(did you mean 'max_epochs'"):
        Trainer(max_epoch=3)
    with pytest.raises(MisconfigurationError, match=r"'gradient_clip_value' \(did you mean 'gradient_clip_val'"):
        Trainer(gradient_clip_value=1.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"devices": 0}, r"devices=0 must be at least 1"),
        ({"max_epochs": -2}, r"max_epochs=-2 must be an integer >= -1 \(-1: no limit\)"),
        ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches=0 must be at least 1"),
        ({"limit_train_batches": 1.5}, r"limit_train_batches=1.5 must be a fraction in \[0.0, 1.0\] or a batch count"),
        ({"limit_val_batches": -1}, r"limit_val_batches=-1 must be a fraction"),
        ({"max_steps": -5}, r"max_steps=-5 must be >= -1"),
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val=-1.0 must be a positive number"),
        ({"gradient_clip_algorithm": "l2"}, r"gradient_clip_algorithm='l2'; use 'norm' or 'value'"),
        ({"val_check_interval": 0}, r"val_check_interval=0 would never validate"),
        ({"max_epochs": 2.5}, r"max_epochs=2.5 must be an integer"),
        ({"log_every_n_steps": 0}, r"log_every_n_steps=0 must be at least 1"),
        ({"seed": "abc"}, r"seed='abc' must be an integer or unset"),
        ({"fast_dev_run": -1}, r"fast_dev_run=-1 must be true/false or a number of batches \(>= 0\)"),
        (
            {"logger": ["csv", "wandb"]},
            r"logger='wandb' is not known; use true, false, 'csv', 'tensorboard' or a Logger",
        ),
    ],
)
def test_out_of_range_options(options, message):
    with pytest.raises(MisconfigurationError, match=message):
        Trainer(**options)


def test_fit_inputs():
    with pytest.raises(MisconfigurationError, match="Trainer.fit needs a TrainModule; got Linear"):
        Trainer(**QUIET).fit(nn.Linear(2, 1), loader())
    with pytest.raises(
        MisconfigurationError, match=r"Trainer.fit needs dataloaders, a datamodule, or a Tiny.train_dataloader\(\)"
    ):
        Trainer(**QUIET).fit(Tiny())
    with pytest.raises(
        MisconfigurationError, match="train_dataloaders must be a DataLoader, a list of them, or an iterable of batches"
    ):
        Trainer(**QUIET).fit(Tiny(), TensorDataset(torch.randn(4, 2)))
    with pytest.raises(MisconfigurationError, match="callbacks must be Callback instances; got function"):
        Trainer(callbacks=[lambda: None], **QUIET)


def test_bad_log_values():
    class LogsAVector(Tiny):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("vector", torch.ones(3))
            return loss

    with pytest.raises(MisconfigurationError, match=r"self.log\('vector'\) got a tensor of shape \(3,\); log scalars"):
        fit(LogsAVector())

    class BadReduce(Tiny):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("x", loss, reduce_fx="median")
            return loss

    with pytest.raises(MisconfigurationError, match=r"reduce_fx='median'\): use one of"):
        fit(BadReduce())


def test_bad_configure_optimizers_return():
    class ReturnsParams(Tiny):
        def configure_optimizers(self):
            return list(self.parameters())

    with pytest.raises(
        MisconfigurationError, match="configure_optimizers returned a Parameter where an optimizer belongs"
    ):
        fit(ReturnsParams())

    class PlateauWithoutMonitor(Tiny):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)

    with pytest.raises(
        MisconfigurationError, match="ReduceLROnPlateau steps on a monitored value: it needs a 'monitor' key"
    ):
        fit(PlateauWithoutMonitor())


def test_learning_rate_monitor_does_nothing_under_fast_dev_run(tmp_path):
    from torchyard.callbacks import LearningRateMonitor

    # fast_dev_run turned the loggers off, not the user: the smoke test runs, and writes nothing.
    trainer = Trainer(fast_dev_run=True, callbacks=[LearningRateMonitor()], enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu")
    trainer.fit(Tiny(), loader())
    assert trainer.global_step == 1 and trainer.loggers == []
    assert not list(tmp_path.iterdir())
    # Without fast_dev_run, a monitor with nowhere to write is still a mistake.
    with pytest.raises(MisconfigurationError, match="LearningRateMonitor writes to the trainer's loggers"):
        fit(Tiny(), callbacks=[LearningRateMonitor()])


def test_a_warning_from_inside_a_fit_is_shown_without_a_framework_location():
    import warnings

    with pytest.warns(UserWarning, match="fewer than log_every_n_steps") as record:
        Trainer(max_epochs=1, **{**QUIET, "logger": True}).fit(Tiny(), loader())
    caught = next(w for w in record if "log_every_n_steps" in str(w.message))
    shown = warnings.formatwarning(caught.message, caught.category, caught.filename, caught.lineno)
    assert shown == f"UserWarning: {caught.message}\n"  # no trainer/loop/loops.py:NNN, no source line
    # A warning located in the user's code keeps Python's format: file, line and source.
    with pytest.warns(UserWarning) as record:
        warnings.warn("the user's own warning", stacklevel=1)  # located here, in the test
    shown = warnings.formatwarning(record[0].message, record[0].category, record[0].filename, record[0].lineno)
    assert shown.startswith(f"{__file__}:{record[0].lineno}: UserWarning: the user's own warning\n")


def test_drop_last_with_a_batch_larger_than_the_dataset_names_drop_last():
    data = DataLoader(TensorDataset(torch.randn(5, 2)), batch_size=8, drop_last=True)
    with pytest.raises(MisconfigurationError) as caught:
        fit(Tiny(), data)
    assert str(caught.value) == (
        "the training dataloader yields no batches: drop_last=True drops the only batch, a partial one: batch_size=8 "
        "is larger than the 5 samples; lower batch_size to at most 5, or set drop_last=False."
    )


def test_none_from_training_step_under_data_parallel_names_a_missing_return_on_the_first_batch_only():
    """The message TrainStep raises on one of 2 data-parallel ranks (a real 2-process run of the first case is in
    tests/strategies/test_ddp.py): a None before any batch trained is a training_step without `return` (every
    rank raises it alike); later, one rank skipping a batch would leave the others waiting."""
    from types import SimpleNamespace

    from torchyard.trainer.loop.step import TrainStep

    progress = SimpleNamespace(epoch=1, epoch_batches=3, batches_stepped=7)
    step = SimpleNamespace(progress=progress, start=(1, 3, 7), skipped=(-1, 0),
                           strategy=SimpleNamespace(data_parallel_size=2, global_rank=1, world_size=2))
    with pytest.raises(MisconfigurationError) as first:
        TrainStep._skipped_batch(step, 3, False)
    assert str(first.value) == (
        "training_step returned None (nothing) for the fit's first batch (batch 3 of epoch 1 on rank 1 of 2); "
        "under automatic optimization it must return the loss tensor or a dict with key 'loss' (is its `return` "
        "missing?), or set `automatic_optimization = False`."
    )
    progress.epoch_batches, progress.batches_stepped = 5, 9  # two batches trained since the fit started
    with pytest.raises(MisconfigurationError) as later:
        TrainStep._skipped_batch(step, 5, False)
    assert str(later.value) == (
        "training_step returned None for batch 5 of epoch 1 on rank 1 of 2, which skips the batch on that process "
        "only; the other processes would wait for it in the gradient all-reduce. Return a loss on every process "
        "(e.g. loss * 0 to skip)."
    )


def resume(module: TrainModule, ckpt_path, **options) -> Trainer:
    trainer = Trainer(**{"max_epochs": 3, **QUIET, **options})
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer


def checkpoints_of(module: TrainModule, folder) -> None:
    from torchyard.callbacks import ModelCheckpoint

    trainer = Trainer(max_epochs=2, **{**QUIET, "enable_checkpointing": True},
                      callbacks=[ModelCheckpoint(dirpath=str(folder), filename="{epoch}", save_top_k=-1)])
    trainer.fit(module, loader())


def test_a_missing_ckpt_path_suggests_the_checkpoints_of_its_folder(tmp_path):
    checkpoints_of(Tiny(), tmp_path / "ckpts")  # epoch=0.ckpt, epoch=1.ckpt
    with pytest.raises(MisconfigurationError) as close:
        resume(Tiny(), tmp_path / "ckpts" / "epoch=2.ckpt")
    assert str(close.value) == (
        f"ckpt_path '{tmp_path / 'ckpts' / 'epoch=2.ckpt'}' does not exist (did you mean 'epoch=1.ckpt', "
        "'epoch=0.ckpt'?)."
    )
    with pytest.raises(MisconfigurationError) as far:
        resume(Tiny(), tmp_path / "ckpts" / "best_model.pt")
    assert str(far.value) == (
        f"ckpt_path '{tmp_path / 'ckpts' / 'best_model.pt'}' does not exist; its folder '{tmp_path / 'ckpts'}' "
        "holds 'epoch=0.ckpt', 'epoch=1.ckpt'."
    )
    with pytest.raises(MisconfigurationError, match=r"does not exist \(nor does its folder '.*nowhere'\)\.$"):
        resume(Tiny(), tmp_path / "nowhere" / "last.ckpt")


class Wide(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 4)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.head(self.body(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_checkpoint_of_another_model_class_names_it_before_anything_is_resumed(tmp_path, capsys):
    checkpoints_of(Tiny(), tmp_path)
    capsys.readouterr()
    with pytest.raises(CheckpointError) as caught:
        resume(Wide(), tmp_path / "epoch=1.ckpt")
    assert str(caught.value) == (
        f"checkpoint 'epoch=1.ckpt' holds a {Tiny.__module__}.Tiny (module_class), whose weights do not fit "
        "Wide: missing body.weight, body.bias, head.weight, ... (4 in all); unexpected layer.weight, layer.bias. "
        "Give the fit a Tiny (or Tiny.load_from_checkpoint(path) to rebuild it from its hparams), or a checkpoint "
        "of Wide."
    )
    assert "resumes from" not in capsys.readouterr().err

    class TinyWithAHook(Tiny):  # another class whose weights fit resumes as before
        pass

    trainer = resume(TinyWithAHook(), tmp_path / "epoch=1.ckpt")
    assert trainer.current_epoch == 3
    assert "fit resumes from epoch=1.ckpt" in capsys.readouterr().err
