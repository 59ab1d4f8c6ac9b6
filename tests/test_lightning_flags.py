"""Trainer flags Lightning documents: min_steps, overfit_batches, profiler, sync_batchnorm, use_distributed_sampler,
barebones, enable_autolog_hparams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from torchyard.callbacks import Callback
from torchyard.callbacks.profilers import AdvancedProfiler, PyTorchProfiler, SimpleProfiler
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.errors import MisconfigurationError

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
             logger=False, accelerator="cpu", num_sanity_val_steps=0)


def dataset(samples: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 3, generator=generator), torch.randn(samples, 1, generator=generator))


class Linear(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)
        self.seen: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(y.flatten().tolist())
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAtOnce(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.should_stop = True


def test_min_steps_outlasts_a_request_to_stop():
    trainer = Trainer(max_epochs=10, min_steps=6, callbacks=[StopAtOnce()], **QUIET)
    trainer.fit(Linear(), DataLoader(dataset(), batch_size=4))
    assert trainer.global_step == 6
    trainer = Trainer(max_epochs=10, callbacks=[StopAtOnce()], **QUIET)
    trainer.fit(Linear(), DataLoader(dataset(), batch_size=4))
    assert trainer.global_step == 1
    with pytest.raises(MisconfigurationError, match="min_steps=-1 must be an integer >= 0 or unset"):
        Trainer(min_steps=-1)


def test_overfit_batches_trains_on_the_same_unshuffled_batches():
    module = Linear()
    loader = DataLoader(dataset(), batch_size=4, shuffle=True)
    trainer = Trainer(max_epochs=3, overfit_batches=2, **QUIET)
    with pytest.warns(UserWarning, match="overfit_batches .* read in order"):
        trainer.fit(module, loader, DataLoader(dataset(), batch_size=4))
    first_two = [dataset()[0:4][1].flatten().tolist(), dataset()[4:8][1].flatten().tolist()]
    assert module.seen == first_two * 3
    assert trainer.num_val_batches == [2]
    assert isinstance(loader.sampler, RandomSampler)  # the user's loader is left as it was


@pytest.mark.parametrize(("name", "kind", "marker"), [
    ("simple", SimpleProfiler, "run_training_batch"),
    ("advanced", AdvancedProfiler, "cumulative"),
    ("pytorch", PyTorchProfiler, "aten::"),
])
def test_profiler_reports_at_the_end_of_fit(name, kind, marker, capsys):
    trainer = Trainer(max_epochs=2, profiler=name, **QUIET)
    trainer.fit(Linear(), DataLoader(dataset(), batch_size=4), DataLoader(dataset(), batch_size=8))
    assert isinstance(trainer.profiler, kind)
    printed = capsys.readouterr().out
    assert f"{kind.__name__} report (fit):" in printed and marker in printed
    if name == "simple":
        durations = trainer.profiler.recorded_durations
        assert len(durations["run_training_batch"]) == 8 and len(durations["run_training_epoch"]) == 2
        assert len(durations["run_validation_batch"]) == 4


def test_profiler_writes_its_report_to_dirpath(tmp_path):
    profiler = SimpleProfiler(dirpath=tmp_path, filename="perf")
    Trainer(max_epochs=1, profiler=profiler, **QUIET).fit(Linear(), DataLoader(dataset(), batch_size=4))
    assert "run_training_epoch" in (tmp_path / "fit-perf.txt").read_text()
    with pytest.raises(MisconfigurationError, match="profiler='fast' is not known"):
        Trainer(profiler="fast")


class WithBatchNorm(Linear):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)


def test_sync_batchnorm_needs_cuda_and_warns_on_one_process():
    with pytest.raises(MisconfigurationError, match="sync_batchnorm=True needs CUDA devices"):
        Trainer(sync_batchnorm=True, strategy="ddp", devices=2, accelerator="cpu")
    with pytest.warns(UserWarning, match="sync_batchnorm=True has no effect on one process"):
        Trainer(sync_batchnorm=True, **QUIET)


def test_use_distributed_sampler_false_keeps_the_loader():
    loader = DataLoader(dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    trainer = Trainer(max_epochs=1, use_distributed_sampler=False, **QUIET)
    module = Linear()
    trainer.fit(module, loader)
    assert trainer.train_dataloader is loader
    expected = [y.flatten().tolist() for _, y in DataLoader(dataset(), batch_size=4, shuffle=True,
                                                            generator=torch.Generator().manual_seed(3))]
    assert module.seen == expected


def test_barebones_turns_off_loggers_checkpoints_and_bars(tmp_path):
    trainer = Trainer(barebones=True, max_epochs=1, default_root_dir=str(tmp_path), accelerator="cpu")
    assert trainer.loggers == [] and trainer.checkpoint_callback is None
    trainer.fit(Linear(), DataLoader(dataset(), batch_size=4))
    assert not any(tmp_path.iterdir())
    with pytest.raises(MisconfigurationError, match="barebones=True runs without .* enable_checkpointing=True"):
        Trainer(barebones=True, enable_checkpointing=True)


def test_enable_autolog_hparams(tmp_path):
    class WithHparams(Linear):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()

    for autolog in (True, False):
        trainer = Trainer(max_epochs=1, enable_autolog_hparams=autolog, default_root_dir=str(tmp_path / str(autolog)),
                          **{**QUIET, "logger": True})
        trainer.fit(WithHparams(), DataLoader(dataset(), batch_size=4))
        hparams = Path(trainer.log_dir) / "hparams.yaml"
        assert ("width: 3" in hparams.read_text()) if autolog else not hparams.exists()


def test_a_profiler_of_a_stage_that_failed_before_setup_reports_nothing(capsys):
    class NoOptimizer(Linear):
        def configure_optimizers(self):
            raise RuntimeError("broken configure_optimizers")

    with pytest.raises(RuntimeError, match="broken configure_optimizers"):
        Trainer(max_epochs=1, profiler="simple", **QUIET).fit(NoOptimizer(), DataLoader(dataset(), batch_size=4))
    assert "SimpleProfiler report" not in capsys.readouterr().out
