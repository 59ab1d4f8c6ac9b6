"""One run, one folder (issue 51): loggers of one Trainer share its version_<n>; a run that saves nothing neither
names a folder nor leaves one behind (the restart marker alone included); fast_dev_run says what it ran."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.logs.loggers import CSVLogger, share_run_folders
from torchyard.trainer.logs.runs import RUN_ID_FILE, VersionClaim

QUIET = dict(enable_progress_bar=False, accelerator="cpu")


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FailsAtFirstStep(Net):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("broken training_step")


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,), generator=generator))
    return DataLoader(data, batch_size=4)


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.timeout(120)  # slow: tensorboard's import alone takes seconds
def test_csv_and_tensorboard_write_one_run_into_one_version_folder(tmp_path):
    pytest.importorskip("tensorboard")
    for run in range(2):
        trainer = Trainer(max_epochs=1, logger=["csv", "tensorboard"], log_every_n_steps=1, **QUIET)
        trainer.fit(Net(), loader())
        folder = tmp_path / "runs" / "default" / f"version_{run}"
        assert [Path(logger.log_dir).resolve() for logger in trainer.loggers] == [folder.resolve()] * 2
        assert trainer.log_dir == str(trainer.loggers[1].log_dir)
        assert (folder / "metrics.csv").is_file() and (folder / "checkpoints" / "last.ckpt").is_file()
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    assert sorted(p.name for p in (tmp_path / "runs" / "default").iterdir()) == ["version_0", "version_1"]


def test_loggers_share_a_folder_only_where_they_would_number_the_same_one(tmp_path):
    given = CSVLogger(tmp_path, "exp", version=7)
    loggers = [CSVLogger(tmp_path, "exp"), CSVLogger(tmp_path, "exp", prefix="b"), CSVLogger(tmp_path, "other"), given]
    share_run_folders(loggers)
    assert [logger.version for logger in loggers] == [0, 0, 0, 7]  # "other" numbers its own folder
    assert sorted(p.name for p in (tmp_path / "exp").iterdir()) == ["version_0"]
    loggers[0].load_state_dict({"version": 3})  # a resume restores the first: the second follows it there
    assert loggers[1].version == 3


def test_fast_dev_run_says_what_it_ran_and_names_no_folder(tmp_path, capsys):
    Trainer(fast_dev_run=2, **QUIET).fit(Net(), loader())
    assert last_line(capsys) == ("trainer: training stopped: fast_dev_run=2 ran 2 batches; no run folder "
                                 "(fast_dev_run writes no logs or checkpoints)")
    assert not (tmp_path / "runs").exists()


def test_a_run_without_logger_or_checkpoints_names_no_folder_and_leaves_none(tmp_path, capsys):
    Trainer(max_epochs=1, logger=False, enable_checkpointing=False, **QUIET).fit(Net(), loader())
    assert last_line(capsys) == ("trainer: training stopped: max_epochs=1 reached; no run folder (no logger, and "
                                 "nothing was saved in it)")
    assert not (tmp_path / "runs").exists()
    Trainer(max_epochs=1, logger=False, **QUIET).fit(Net(), loader())  # its checkpoints are there: named
    assert last_line(capsys) == "trainer: training stopped: max_epochs=1 reached; run folder runs/default/version_0"


def test_a_torchrun_job_that_fails_before_training_leaves_no_folder_holding_only_its_restart_marker(
        tmp_path, monkeypatch):
    # One process as torchrun starts it: the run writes its job's marker for restarts into the run folder.
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job-51"}.items():
        monkeypatch.setenv(key, value)
    for options in ({"logger": False}, {"logger": True}):
        with pytest.raises(RuntimeError, match="broken training_step"):
            Trainer(max_epochs=1, enable_checkpointing=False, enable_autolog_hparams=False, **QUIET, **options).fit(
                FailsAtFirstStep(), loader())
        assert not (tmp_path / "runs").exists(), options


def test_a_claim_gives_back_a_folder_holding_only_the_restart_marker(tmp_path):
    bare, written = VersionClaim(tmp_path, "exp"), VersionClaim(tmp_path, "exp")
    for claim in (bare, written):
        (tmp_path / "exp" / f"version_{claim.version}" / RUN_ID_FILE).write_text("job")
    (tmp_path / "exp" / "version_1" / "metrics.csv").write_text("step\n")
    bare.release()
    written.release()
    assert os.listdir(tmp_path / "exp") == ["version_1"]
    assert sorted(os.listdir(tmp_path / "exp" / "version_1")) == [RUN_ID_FILE, "metrics.csv"]
