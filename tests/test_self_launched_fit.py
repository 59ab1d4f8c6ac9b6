"""After a ddp fit whose processes the Trainer started itself (issue 51): its csv and tensorboard loggers wrote one
run into one folder, and the calling process's trainer reports the job's world size and saves a checkpoint of the
trained weights, as a Lightning script calls trainer.save_checkpoint after fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.checkpointing.files import load_checkpoint_file


class Net(TrainModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.timeout(240)
def test_a_self_launched_ddp_fit_keeps_one_run_folder_and_hands_back_its_world_size_and_weights(tmp_path):
    pytest.importorskip("tensorboard")
    trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=1, logger=["csv", "tensorboard"],
                      log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, seed=0)
    module = Net(width=8)
    initial = {name: value.clone() for name, value in module.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randint(0, 2, (32,), generator=generator))
    trainer.fit(module, DataLoader(data, batch_size=4))

    run = tmp_path / "runs" / "default" / "version_0"
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]  # one run, one folder
    assert (run / "metrics.csv").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    assert [Path(logger.log_dir).resolve() for logger in trainer.loggers] == [run.resolve()] * 2

    assert trainer.world_size == 2  # the job's, as Lightning reports it in the launching process
    path = tmp_path / "final.ckpt"
    with pytest.warns(UserWarning) as caught:
        trainer.save_checkpoint(path)
    [note] = [str(w.message) for w in caught if "save_checkpoint" in str(w.message)]
    assert note.startswith("trainer.save_checkpoint after a fit whose 2 processes this script started saves the "
                           "trained weights and hparams (load_from_checkpoint, validate and test read them), not the "
                           "optimizers' state")
    last = trainer.checkpoint_callback.last_model_path
    assert Path(last).resolve() == (run / "checkpoints" / "last.ckpt").resolve()
    assert note.endswith(f"pass the run's own checkpoint as ckpt_path ({last}). weights_only=True saves the same "
                         "without this note.")
    reloaded = Net.load_from_checkpoint(path)
    assert reloaded.hparams.width == 8 and load_checkpoint_file(path)["global_step"] == trainer.global_step == 4
    for name, value in module.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    assert any(not torch.equal(initial[name], value) for name, value in module.state_dict().items())  # trained
