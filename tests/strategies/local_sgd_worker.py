"""The 2-process runs the local SGD tests read: each process runs several fits in a row, as a torchrun-started script
would, so that one start of processes serves them all.

It imports the framework in spawned processes only; the test reads what rank 0 (and each rank) wrote to `out`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from torchyard.callbacks import Callback, ModelCheckpoint
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer

QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False)


class ReplicaCheck(Callback):
    """After every optimizer step: whether every rank holds the same parameters (a collective, for the test only)."""

    def __init__(self) -> None:
        self.equal_after_step: list[bool] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        gathered = trainer.strategy.all_gather(flat)
        self.equal_after_step.append(bool(all(torch.equal(gathered[0], other) for other in gathered[1:])))


def digits_fit(root: Path, strategy: dict, epochs: int, *callbacks: Callback, ckpt_path: str | None = None) -> Trainer:
    torch.manual_seed(0)
    module = DigitsCNN()
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=epochs, seed=0, default_root_dir=str(root),
                      callbacks=list(callbacks), **QUIET)
    trainer.fit(module, datamodule=DigitsData(), ckpt_path=ckpt_path)
    return trainer


def worker(rank: int, port: int, out: str, epochs: int, local_epochs: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    out_dir = Path(out)
    weights = {}
    for name, strategy in (("ddp", {"name": "ddp"}), ("sync_every_1", {"name": "ddp", "sync_every": 1})):
        weights[name] = digits_fit(out_dir / name, strategy, epochs).lightning_module.state_dict()
    local = {"name": "ddp", "sync_every": 8, "sync_warmup_steps": 0}
    check = ReplicaCheck()
    every_epoch = ModelCheckpoint(save_top_k=-1, filename="{epoch}", monitor=None)
    trainer = digits_fit(out_dir / "local", local, local_epochs, check, every_epoch)
    weights["local"] = trainer.lightning_module.state_dict()
    val_acc = float(trainer.callback_metrics["val/acc"])
    checkpoint = Path(every_epoch.dirpath) / "epoch=4.ckpt"  # step 50: two steps after the averaging at step 48
    weights["resumed"] = digits_fit(out_dir / "resumed", local, local_epochs,
                                    ckpt_path=str(checkpoint)).lightning_module.state_dict()
    torch.save({"weights": weights, "equal_after_step": check.equal_after_step, "val_acc": val_acc,
                "checkpoint": str(checkpoint)}, out_dir / f"rank{rank}.pt")
