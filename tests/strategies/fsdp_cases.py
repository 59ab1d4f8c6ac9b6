"""The fsdp cases of tests/strategies/test_fsdp.py, run as one 2-process job so that processes start once (the test
forks its ranks with tests/processes.run_ranks; by hand, as torchrun would start them):

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python fsdp_cases.py OUT_DIR [CASE ...]

Each rank runs every case in turn (a launched job: the Trainer starts no processes, the group lives until exit) and
rank 0 writes OUT_DIR/results.pt: per case, the final weights (gathered) and the callback metrics. A ddp run and an
fsdp run of each setting share data, seed and initial weights, so their weights must agree to rounding.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import ModelCheckpoint
from torchyard.trainer import Trainer, TrainModule

SEED, BATCH, EPOCHS, LR = 3, 4, 2, 0.05
QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def dataset(samples: int, offset: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(100 + offset)
    x = torch.randn(samples, 5, generator=generator)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


TRAIN, VAL = dataset(40), dataset(21, offset=1)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(TrainModule):
    """Two Blocks (fsdp's shard units in most cases) between an input and an output layer."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer = optimizer
        self.net = nn.Sequential(nn.Linear(5, 8), Block(8), Block(8), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)
        ranks = self.all_gather(torch.tensor(float(self.global_rank)))
        self.log("gathered_ranks", ranks.sum(), reduce_fx="max")

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class ManualNet(Net):
    """Manual optimization: backward, clip, step, zero_grad by hand."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        self.manual_backward(F.mse_loss(self(x), y))
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()


def initial_state(cls: type[Net] = Net, *args: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return cls(*args).state_dict()


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights whole (fsdp leaves them sharded as DTensors in the processes that trained)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in module.state_dict().items()}


def fsdp(**options: Any) -> dict[str, Any]:
    return {"name": "fsdp", **options}


ACCUMULATE = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
UNITS = ["Block"]
#: name -> (strategy, module class and arguments, Trainer options, ckpt_path (a case's checkpoint), saves checkpoints)
CASES: dict[str, tuple[Any, tuple, dict, tuple | None, bool]] = {
    "ddp_sgd": ("ddp", (Net,), {}, None, True),
    "ddp_adamw": ("ddp", (Net, "adamw"), ACCUMULATE, None, False),
    # What ManualNet does by hand, automatically: the reference for fsdp_manual (under ddp, manual_backward runs inside
    # DDP's forward, before its reducer is prepared for a backward, so ddp is no reference for manual optimization).
    "ddp_clipped": ("ddp", (Net, "adamw"), dict(gradient_clip_val=0.05), None, False),
    # Saving sharded folders at each epoch's end; then resumed on 2 ranks from its first epoch's folder.
    "fsdp_sgd": (fsdp(shard_units=UNITS, checkpoint="sharded"), (Net,), {}, None, True),
    "fsdp_adamw": (fsdp(min_params=50, reshard_after_forward=False), (Net, "adamw"), ACCUMULATE, None, False),
    "fsdp_manual": (fsdp(shard_units=UNITS, activation_checkpointing=UNITS), (ManualNet,), {}, None, False),
    "fsdp_sharded_resumed": (fsdp(shard_units=UNITS, checkpoint="sharded"), (Net,), {},
                             ("fsdp_sgd", "epoch=0.ckpt"), False),
    # ddp's full file resumed under fsdp: lands on ddp_sgd's weights; saves full files (gathered on rank 0).
    "fsdp_from_ddp": (fsdp(shard_units=UNITS), (Net,), {}, ("ddp_sgd", "epoch=0.ckpt"), True),
}


def checkpoint_folder(out: Path, case: str) -> Path:
    return out / case / "default" / "version_0" / "checkpoints"


def run_case(out: Path, name: str) -> dict[str, Any]:
    strategy, (cls, *args), options, resume, saving = CASES[name]
    module = cls(*args)
    module.load_state_dict(initial_state(cls, *args))
    callbacks = [ModelCheckpoint(save_top_k=-1, filename="{epoch}", save_last=True)] if saving else []
    trainer = Trainer(strategy=strategy, devices=2, max_epochs=EPOCHS, seed=SEED, default_root_dir=str(out / name),
                      enable_checkpointing=saving, callbacks=callbacks, logger=False,
                      **QUIET, **options)
    ckpt_path = checkpoint_folder(out, resume[0]) / resume[1] if resume else None
    trainer.fit(module, DataLoader(TRAIN, batch_size=BATCH, shuffle=True), DataLoader(VAL, batch_size=BATCH),
                ckpt_path=ckpt_path)
    return {"weights": gathered(module), "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "global_step": trainer.global_step}


def main(arguments: list[str]) -> None:
    """`arguments`: OUT_DIR [CASE ...]."""
    torch.set_num_threads(1)
    out = Path(arguments[0])
    results = {name: run_case(out, name) for name in arguments[1:] or CASES}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
