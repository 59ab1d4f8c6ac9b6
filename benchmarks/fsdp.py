"""Trainer(strategy="fsdp") on 2 CPU processes (gloo): per-rank memory against ddp, step time against a
hand-written FSDP2 loop.

    python benchmarks/fsdp.py [--steps 30] [--rounds 4] [--width 512] [--blocks 12] [--batch 32]

Memory: the bytes each rank holds in parameters, gradients and AdamW state, counted from the tensors' local shards
just before an optimizer step (the state is there from the second step on), under fsdp and under ddp, and their
ratio (target <= 0.55 on 2 processes). Time: the Trainer and the
textbook FSDP2 loop (fully_shard per block and on the root, AdamW, zero_grad / forward / backward / step) run in
the same two processes, interleaved round by round (each goes first in every other round); prints the median
time per step of each and their ratio (target <= 1.03).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from ddp import stamp, step_times  # the same clocks as the ddp benchmark
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster.environment import find_free_port

WARMUP = 3


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


def make_net(width: int, blocks: int) -> nn.Module:
    return nn.Sequential(*(Block(width) for _ in range(blocks)), nn.Linear(width, 10))


def make_data(samples: int, width: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, width, generator=generator),
                         torch.randint(0, 10, (samples,), generator=generator))


class Classifier(TrainModule):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.net = make_net(width, blocks)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds: parameters, gradients and optimizer state, from the local shards."""
    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"parameters": sum(local_bytes(p) for p in params),
            "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(v) for v in state)}


class Probe(Callback):
    """Step times (end of one batch to the end of the next), and the bytes held before the third step."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []
        self.bytes: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if trainer.global_step == 2:
            self.bytes = held_bytes(module, optimizer)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.stamps.append(stamp())


def hand_written(rank: int, port: int, data: TensorDataset, args: argparse.Namespace) -> list[tuple[float, float]]:
    """The textbook FSDP2 loop: a mesh, fully_shard per block then the root, DistributedSampler, AdamW."""
    if dist.is_initialized():  # a launched Trainer leaves its group up for the script, as Lightning does
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = make_net(args.width, args.blocks)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
    stamps = []
    for step, (x, y) in enumerate(DataLoader(data, batch_size=args.batch, sampler=sampler)):
        if step >= args.steps + WARMUP + 1:
            break
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        stamps.append(stamp())
    del model, optimizer
    dist.destroy_process_group()
    return step_times(stamps, WARMUP)


def with_trainer(data: TensorDataset, args: argparse.Namespace, strategy: object) -> tuple[list, dict[str, int]]:
    probe = Probe()
    torch.manual_seed(0)
    trainer = Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=args.steps + WARMUP + 1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, default_root_dir=tempfile.mkdtemp(), callbacks=[probe])
    trainer.fit(Classifier(args.width, args.blocks), DataLoader(data, batch_size=args.batch, shuffle=True))
    return step_times(probe.stamps, WARMUP), probe.bytes


def worker(rank: int, ports: list[int], args: argparse.Namespace, out: str) -> None:
    # Both processes look torchrun-launched to the Trainer; the hand-written loop uses its own ports.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    torch.set_num_threads(1)
    data = make_data(2 * args.batch * (args.steps + WARMUP + 2), args.width)
    fsdp = {"name": "fsdp", "shard_units": ["Block"]}
    results: dict[str, object] = {"hand": [], "trainer": []}
    for round_index in range(args.rounds):
        order = ["hand", "trainer"] if round_index % 2 == 0 else ["trainer", "hand"]  # neither always goes first
        for name in order:
            if name == "hand":
                results["hand"] += hand_written(rank, ports[1 + round_index], data, args)
            else:
                times, results["fsdp_bytes"] = with_trainer(data, args, fsdp)
                results["trainer"] += times
    _, results["ddp_bytes"] = with_trainer(data, args, "ddp")
    if rank == 0:
        torch.save(results, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "results.pt"
    ports = [find_free_port() for _ in range(args.rounds + 1)]
    mp.spawn(worker, args=(ports, args, str(out)), nprocs=2, join=True)
    results = torch.load(out)
    parameters = sum(p.numel() for p in make_net(args.width, args.blocks).parameters())
    print(f"model: {args.blocks} blocks of {args.width}x{args.width} + head, {parameters / 1e6:.2f} M parameters, "
          f"AdamW, batch {args.batch} per process, 2 processes")
    fsdp, ddp = results["fsdp_bytes"], results["ddp_bytes"]
    print("per-rank MB (rank 0)        fsdp        ddp")
    for part in ("parameters", "gradients", "optimizer"):
        print(f"  {part:<22} {fsdp[part] / 1e6:9.2f}  {ddp[part] / 1e6:9.2f}")
    print(f"  {'total':<22} {sum(fsdp.values()) / 1e6:9.2f}  {sum(ddp.values()) / 1e6:9.2f}")
    print(f"memory ratio fsdp / ddp:            {sum(fsdp.values()) / sum(ddp.values()):8.3f}   (target <= 0.55)")
    (hand, hand_cpu), (ours, ours_cpu) = (
        (statistics.median(w for w, _ in results[name]) * 1e3, statistics.median(c for _, c in results[name]) * 1e3)
        for name in ("hand", "trainer"))
    print(f"{args.rounds} rounds x {args.steps} steps, interleaved     wall ms/step   CPU ms/step (rank 0)")
    print(f"hand-written FSDP2 loop:            {hand:10.2f}    {hand_cpu:10.2f}")
    print(f"Trainer(strategy='fsdp'):           {ours:10.2f}    {ours_cpu:10.2f}")
    print(f"ratio Trainer / hand-written:       {ours / hand:10.3f}    {ours_cpu / hand_cpu:10.3f}   (target <= 1.03)")


if __name__ == "__main__":
    main()
