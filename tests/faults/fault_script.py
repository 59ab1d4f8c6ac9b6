"""A small training run that tests/test_faults.py starts, kills and resumes, in a subprocess or in pytest.

    python fault_script.py <root> <single|ddp|fsdp> [--kill-at STEP] [--slow-from STEP] [--slow-write-at STEP]
                           [--seed-from trainer|seed_everything]

fsdp runs on 2 processes, as ddp, saving sharded checkpoint folders.
--kill-at: the process SIGKILLs itself right after optimizer step STEP (rank 1 under ddp and fsdp).
--slow-from: from step STEP on, rank 0 writes <root>/marker and then sleeps 0.5 s per batch, leaving the
test time to signal the run while it trains.
--slow-write-at: at step STEP the checkpoint write stalls half-way, after writing <root>/marker.
--seed-from: the run's seed is Trainer(seed=) (the default), or seed_everything in the script (no Trainer seed),
which the workers get from the launching process's RNG state.
--leave-at: under torchrun, one process per node (strategy ddp_node, --num-nodes N): rank 1 SIGKILLs its node's
torchrun agent and then itself right after optimizer step STEP, on the job's first attempt: its node leaves.
--sample-log: every rank appends which samples each batch held to this file (SampleLog).

The run: dropout, Adam and a StepLR, a shuffled loader, step and epoch metrics in metrics.csv, and a
ModelCheckpoint every 3 steps keeping every file plus last.ckpt, so a resume must restore RNG, optimizer,
scheduler, data position and logger rows to land on the uninterrupted run's weights bitwise.
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback, ModelCheckpoint
from torchyard.trainer import Trainer, TrainModule, seed_everything

SAMPLES, BATCH, EPOCHS, SEED = 48, 4, 2, 7  # one process: 12 steps an epoch; ddp on 2: 6
#: The strategy each name runs, and on how many processes.
STRATEGIES = {"single": ("single", 1), "ddp": ("ddp", 2), "fsdp": ({"name": "fsdp", "checkpoint": "sharded"}, 2),
              "ddp_node": ("ddp", 1)}


def dataset(samples: int = SAMPLES, offset: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(10 + offset)
    x = torch.randn(samples, 6, generator=generator)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=generator))


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


class KillAt(Callback):
    """SIGKILL this process right after optimizer step `step` on `rank`, on the job's first attempt only."""

    def __init__(self, step: int, rank: int = 0, with_agent: bool = False) -> None:
        self.step, self.rank, self.with_agent = step, rank, with_agent

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        first_attempt = trainer.strategy.environment.restart_count == 0
        if trainer.global_step == self.step and trainer.global_rank == self.rank and first_attempt:
            if self.with_agent:  # the torchrun agent that started this process: the whole node goes
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class SlowFrom(Callback):
    """From step `step` on, rank 0 leaves `marker` and sleeps after each batch (the others wait for it)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step and trainer.is_global_zero:
            Path(self.marker).touch()
            time.sleep(0.5)


class StartLog(Callback):
    """Rank 0 appends '<restart count> <global step>' to `path` when training starts: where each attempt began."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, module):
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(f"{trainer.strategy.environment.restart_count} {trainer.global_step}\n")


class SampleLog(Callback):
    """Each rank appends '<restart count> <world size> <global step> <dataset indices>' to `path` after every batch:
    which samples it trained, found by matching the batch's inputs to the dataset's rows (the sample ledger's
    reference, computed without it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        rows = {tuple(row.tolist()): index for index, row in enumerate(dataset().tensors[0])}
        indices = [rows[tuple(row.tolist())] for row in batch[0]]
        with open(self.path, "a") as f:
            f.write(f"{trainer.strategy.environment.restart_count} {trainer.world_size} {trainer.current_epoch} "
                    f"{trainer.global_step} {','.join(map(str, indices))}\n")


def committed_samples(path: str | Path) -> dict[int, tuple[int, int, list[int]]]:
    """SampleLog's lines as what each optimizer step trained in the end, {step: (epoch, world size, samples)}: a
    step redone by a later attempt (after a resume from a checkpoint before it) counts as that attempt did it."""
    latest: dict[int, tuple[int, int, int, list[int]]] = {}
    for line in Path(path).read_text().splitlines():
        restart, world, epoch, step, indices = line.split()
        attempt, samples = int(restart), [int(i) for i in indices.split(",")]
        kept = latest.get(int(step))
        if kept is None or attempt > kept[0]:
            latest[int(step)] = (attempt, int(epoch), int(world), samples)
        elif attempt == kept[0]:
            kept[3].extend(samples)
    return {step: (epoch, world, samples) for step, (_, epoch, world, samples) in sorted(latest.items())}


def assert_each_sample_trained_once(ledger: dict, log: str | Path) -> None:
    """Each epoch trained each sample once, by SampleLog's account from the batches' inputs, and the ledger's
    dataset indices (drawn again from its seeded order) are those same ones."""
    trained = committed_samples(log)
    assert sorted(trained) == list(range(1, len(trained) + 1))  # every step, once
    for epoch in range(EPOCHS):
        reference = Counter(index for in_epoch, _, samples in trained.values() if in_epoch == epoch
                            for index in samples)
        assert reference == Counter(range(SAMPLES)), f"epoch {epoch}: {reference}"
        meta = ledger["epochs"][str(epoch)]
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(meta["order"]["seed"] + epoch))
        recorded = Counter(order[position].item() for s in ledger["segments"] if s[0] == epoch
                           for position in range(s[5], s[6], s[7]) if position < SAMPLES)
        assert recorded == reference, f"epoch {epoch}: the ledger differs from the batches' samples"


def metrics_rows(root: str | Path) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv (`root`/default/version_0), for comparing two runs: the ranks' time split
    (diagnosis/*, trainer/diagnosis/stragglers.py) is timing, which differs from run to run, so it is left out, and
    so is a row that held only it."""
    with open(Path(root) / "default" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    kept = [{key: value for key, value in row.items() if not key.startswith("diagnosis/")} for row in rows]
    return [row for row in kept if any(value for key, value in row.items() if key != "step")]


def starts(root: str | Path) -> list[str]:
    """The lines StartLog wrote under `root`: one per training start."""
    return Path(root, "starts.txt").read_text().splitlines()


class StallingFile:
    """Passes writes through until half of `size` bytes are written, then leaves `marker` and stalls."""

    def __init__(self, file, size: int, marker: str) -> None:
        self.file, self.size, self.marker, self.written = file, size, marker, 0

    def write(self, data) -> int:
        if self.written + len(data) > self.size // 2:
            self.file.write(bytes(data)[: self.size // 2 - self.written])
            self.file.flush()
            Path(self.marker).touch()
            time.sleep(600)  # killed here, with half a file on disk
        self.written += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class StallCheckpointWriteAt(Callback):
    """From step `step` on, torch.save into a checkpoint's temporary file stalls half-way (last.ckpt is then
    a second name for that file, made once it is whole)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        real_save, marker = torch.save, self.marker

        def stalling_save(obj, f, *args, **kwargs):
            if not str(getattr(f, "name", "")).endswith(".ckpt.tmp"):
                return real_save(obj, f, *args, **kwargs)
            import io

            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            return real_save(obj, StallingFile(f, buffer.tell(), marker), *args, **kwargs)

        torch.save = stalling_save


def loaders() -> tuple[DataLoader, DataLoader]:
    return DataLoader(dataset(), batch_size=BATCH, shuffle=True), DataLoader(dataset(20, offset=1), batch_size=BATCH)


def make_trainer(root: str | Path, strategy: str, callbacks=(), seed: int | None = SEED, **options) -> Trainer:
    checkpoints = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1, save_last=True)
    spec, devices = STRATEGIES[strategy]
    return Trainer(
        strategy=spec, devices=devices, accelerator="cpu", max_epochs=EPOCHS, seed=seed,
        deterministic=True, log_every_n_steps=1, num_sanity_val_steps=0, default_root_dir=str(root),
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, StartLog(str(Path(root, "starts.txt").absolute())), checkpoints], **options,
    )


def fit(root: str | Path, strategy: str, callbacks=(), ckpt_path=None, seed_from: str = "trainer", **options) -> Net:
    """One fit; the module (same initial weights every time; a resumed run overwrites them anyway). `seed_from`:
    Trainer(seed=SEED), or seed_everything(SEED) before the module is built and no Trainer seed."""
    if seed_from == "seed_everything":
        seed_everything(SEED)
        options["seed"] = None
    else:
        torch.manual_seed(0)
    module = Net()
    make_trainer(root, strategy, callbacks, **options).fit(module, *loaders(), ckpt_path=ckpt_path)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("strategy", choices=list(STRATEGIES))
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--slow-from", type=int)
    parser.add_argument("--slow-write-at", type=int)
    parser.add_argument("--seed-from", choices=["trainer", "seed_everything"], default="trainer")
    parser.add_argument("--leave-at", type=int)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--sample-log")
    args = parser.parse_args()
    marker = str(Path(args.root) / "marker")
    callbacks: list[Callback] = []
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at, rank=1 if STRATEGIES[args.strategy][1] > 1 else 0))
    if args.leave_at is not None:
        callbacks.append(KillAt(args.leave_at, rank=1, with_agent=True))
    if args.sample_log is not None:
        callbacks.append(SampleLog(args.sample_log))
    if args.slow_from is not None:
        callbacks.append(SlowFrom(args.slow_from, marker))
    if args.slow_write_at is not None:
        callbacks.append(StallCheckpointWriteAt(args.slow_write_at, marker))
    options = {"num_nodes": args.num_nodes} if args.num_nodes > 1 else {}
    fit(args.root, args.strategy, callbacks, seed_from=args.seed_from, **options)


if __name__ == "__main__":
    main()
