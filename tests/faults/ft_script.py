"""The digits recipe under live recovery (strategy ddp with fault_tolerance): 3 replica groups of one process each,
which tests/test_fault_tolerance.py runs in a subprocess and benchmarks/fault_tolerance.py times.

    python ft_script.py <root> [--kill-at STEP] [--epochs N] [--groups N] [--step-sleep S] [--accelerator cuda]
                         [--max-restarts N] [--ckpt-path last]

--kill-at: replica group 1 SIGKILLs itself inside its training step (after that step's quorum, before its gradient
all-reduce) at global step STEP or the first after it that all groups train, on its first attempt; the launcher
restarts it and it heals from a live peer.
--step-sleep: seconds each training step sleeps while a replica group is away (not started yet, or dead), so that the
job lasts until the restarted one is back.
Every group appends '<group> <attempt> <global step> <unix time>' to <root>/commits.txt after each committed step.
Prints 'accuracy <val/acc>' of the trained weights that the launching process adopted.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import sklearn.datasets  # noqa: F401  (imported here, the forkserver preloads it for every replica group's worker)
from torch.utils.data import DataLoader

from torchyard.callbacks import Callback
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer
from torchyard.trainer.data.samplers import EpochSampler

BATCH, LR, EPOCHS, GROUPS = 32, 0.005, 5, 3


class KilledDigits(DigitsCNN):
    """DigitsCNN whose replica group 1 dies by SIGKILL in the training step of global step `kill_at` (first attempt)."""

    kill_at = -1
    step_sleep = 0.0

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        if strategy.manager.num_participants() < strategy.replica_groups:
            time.sleep(self.step_sleep)  # while a group is away: the job lasts until the restarted one is back
        if (0 <= self.kill_at <= self.trainer.global_step and strategy.replica_group == 1
                and strategy.environment.restart_count == 0
                and strategy.manager.num_participants() == strategy.replica_groups):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


class CommitLog(Callback):
    """Each replica group appends '<group> <attempt> <global step> <time>' to `path` after every committed step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        with open(self.path, "a") as f:
            f.write(f"{strategy.replica_group} {strategy.environment.restart_count} {trainer.global_step} "
                    f"{time.time():.4f}\n")


def fault_tolerant_trainer(root: Path, epochs: int, groups: int, accelerator: str = "cpu", max_restarts: int = 2,
                           **options) -> Trainer:
    strategy = {"name": "ddp", "fault_tolerance": {"replica_groups": groups, "min_replicas": 2, "timeout": 10.0}}
    return Trainer(strategy=strategy, accelerator=accelerator, devices=1, max_epochs=epochs, seed=0,
                   max_restarts=max_restarts,
                   default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, check_val_every_n_epoch=epochs, **options)


def accuracy(module: DigitsCNN, data: DigitsData) -> float:
    """val/acc of `module`'s weights over the whole validation set, in this process."""
    evaluator = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    return float(evaluator.validate(module, datamodule=data, verbose=False)[0]["val/acc"])


def reference_accuracy(epochs: int = EPOCHS, groups: int = GROUPS) -> float:
    """The undisturbed run in this process, on the same global batches in the same order: one process trains
    batches of groups x BATCH samples in the seeded order that the replica groups deal (data/samplers.EpochSampler,
    which the loop reseeds each epoch), from the same seeded weights, without dropout (as the script's run)."""
    trainer = Trainer(max_epochs=epochs, seed=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, check_val_every_n_epoch=epochs)
    module, data = DigitsCNN(lr=LR, dropout=0.0), DigitsData(batch_size=BATCH)
    data.setup("fit")
    order = EpochSampler(data.train_set, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(module, DataLoader(data.train_set, batch_size=groups * BATCH, sampler=order),
                data.val_dataloader())
    return accuracy(module, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--groups", type=int, default=GROUPS)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--ckpt-path", default=None)
    args = parser.parse_args()
    trainer = fault_tolerant_trainer(args.root, args.epochs, args.groups, args.accelerator, args.max_restarts,
                                     callbacks=[CommitLog(str(args.root / "commits.txt"))])
    module, data = KilledDigits(lr=LR, dropout=0.0), DigitsData(batch_size=BATCH)
    module.kill_at, module.step_sleep = args.kill_at, args.step_sleep  # on the instance: the workers get it pickled
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt_path)
    print(f"accuracy {accuracy(module, data):.4f}", flush=True)


if __name__ == "__main__":
    main()
