"""Output read in a log (a SLURM .out file, a pipe): a fit's run summary keeps each path whole on one line, however
long, and carries no ANSI escape codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from processes import reaped

SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import ModelCheckpoint
from torchyard.trainer import Trainer, TrainModule


class Tiny(TrainModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    trainer = Trainer(max_epochs=1, accelerator="cpu", log_every_n_steps=1, default_root_dir="runs",
                      callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True)])
    trainer.fit(Tiny(), data, data)
"""


@pytest.mark.timeout(120)
def test_a_piped_fit_keeps_each_checkpoint_path_on_one_line_without_escape_codes(tmp_path):
    folder = tmp_path / ("a_folder_whose_name_is_long_enough_to_push_paths_past_eighty_columns" * 2)
    folder.mkdir()
    (folder / "fit.py").write_text(SCRIPT)
    env = {key: value for key, value in os.environ.items() if key not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(COLUMNS="80", TERM="xterm-256color", PYTHONPATH=os.pathsep.join(sys.path))  # a colour terminal's env
    process = subprocess.Popen([sys.executable, "fit.py"], cwd=folder, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    with reaped([process]):
        out, err = process.communicate(timeout=100)
    assert process.returncode == 0, err
    assert "\x1b" not in out and "\x1b" not in err
    last = folder / "runs" / "default" / "version_0" / "checkpoints" / "last.ckpt"
    [best] = (last.parent).glob("epoch=*.ckpt")
    rows = [[cell.strip() for cell in line.split("│")[1:3]] for line in out.splitlines()]
    assert ["last checkpoint", str(last)] in rows, out
    assert ["val_loss best checkpoint", str(best)] in rows, out
    assert len(str(last)) > 200  # the table would have cut it at 80 columns
