"""Trainer(strategy={"name": "fsdp", "tensor_parallel": 2}) on 4 CPU processes (gloo): per-rank memory against fsdp
alone at the same world size, step time against a hand-written DTensor loop.

    python benchmarks/tensor_parallel.py [--steps 20] [--rounds 2] [--width 256] [--blocks 6] [--batch 16]

Memory: the bytes each rank holds in parameters, gradients and AdamW state, counted from the tensors' local shards
just before the third optimizer step, under fsdp on 4 ranks (dp_shard=4) and under fsdp x tp (dp_shard=2 x tp=2).
Both hold about a quarter of the MLPs' weights; the norms and the head, which the plan leaves whole, are sharded
4 ways under fsdp and 2 ways under fsdp x tp, so the second holds a little more: tensor parallel's gain is the
activations (each rank computes a quarter-width slice of every MLP's hidden layer), not the weights.
Time: the Trainer and the textbook loop (init_device_mesh (dp_shard, tp), parallelize_module per block, fully_shard
per block then the root over dp_shard, DistributedSampler over the data-parallel rank, AdamW, zero_grad / forward /
backward / step) run in the same four processes, interleaved round by round; prints the median time per step of each
and their ratio (target <= 1.03).
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
from fsdp import Probe, make_data
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster.environment import find_free_port

WARMUP, WORLD, TP = 3, 4, 2
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make_net(width: int, blocks: int) -> nn.Sequential:
    return nn.Sequential(*(MLPBlock(width) for _ in range(blocks)), nn.Linear(width, 10))


class Classifier(TrainModule):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.net = make_net(width, blocks)

    def configure_model(self) -> None:
        tp = self.device_mesh["tp"]
        for block in self.net[:-1]:
            if tp.size() > 1 and not isinstance(block.up.weight, DTensor):
                parallelize_module(block, tp, PLAN)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def hand_written(rank: int, port: int, data, args: argparse.Namespace) -> list[tuple[float, float]]:
    """The textbook fsdp x tp loop on a (dp_shard, tp) mesh."""
    # One group for the whole benchmark: a launched Trainer leaves its group up for the script (as Lightning does)
    # and joins the one it finds. (Destroying it and meshing a new one of the same shape was seen here to leave
    # parallelize_module's hooks on a group torch no longer resolves.)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    model = make_net(args.width, args.blocks)
    for block in model[:-1]:
        parallelize_module(block, mesh["tp"], PLAN)
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, num_replicas=WORLD // TP, rank=mesh.get_local_rank("dp_shard"), seed=0)
    stamps = []
    for step, (x, y) in enumerate(DataLoader(data, batch_size=args.batch, sampler=sampler)):
        if step >= args.steps + WARMUP + 1:
            break
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        stamps.append(stamp())
    del model, optimizer
    return step_times(stamps, WARMUP)


def with_trainer(data, args: argparse.Namespace, strategy: dict) -> tuple[list, dict[str, int]]:
    probe = Probe()
    torch.manual_seed(0)
    trainer = Trainer(strategy=strategy, devices=WORLD, accelerator="cpu", max_steps=args.steps + WARMUP + 1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, default_root_dir=tempfile.mkdtemp(), callbacks=[probe])
    trainer.fit(Classifier(args.width, args.blocks), DataLoader(data, batch_size=args.batch, shuffle=True))
    return step_times(probe.stamps, WARMUP), probe.bytes


def worker(rank: int, ports: list[int], args: argparse.Namespace, out: str) -> None:
    # The processes look torchrun-launched to the Trainer; the hand-written loop uses its own ports.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    torch.set_num_threads(1)
    data = make_data(WORLD * args.batch * (args.steps + WARMUP + 2), args.width)
    fsdp_tp = {"name": "fsdp", "shard_units": ["MLPBlock"], "tensor_parallel": TP}
    results: dict[str, object] = {"hand": [], "trainer": []}
    for round_index in range(args.rounds):
        order = ["hand", "trainer"] if round_index % 2 == 0 else ["trainer", "hand"]  # neither always goes first
        for name in order:
            if name == "hand":
                results["hand"] += hand_written(rank, ports[1 + round_index], data, args)
            else:
                times, results["tp_bytes"] = with_trainer(data, args, fsdp_tp)
                results["trainer"] += times
    _, results["fsdp_bytes"] = with_trainer(data, args, {"name": "fsdp", "shard_units": ["MLPBlock"]})
    if rank == 0:
        torch.save(results, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "results.pt"
    ports = [find_free_port() for _ in range(args.rounds + 1)]
    mp.spawn(worker, args=(ports, args, str(out)), nprocs=WORLD, join=True)
    results = torch.load(out)
    parameters = sum(p.numel() for p in make_net(args.width, args.blocks).parameters())
    print(f"model: {args.blocks} MLP blocks of {args.width} -> {4 * args.width} -> {args.width} + head, "
          f"{parameters / 1e6:.2f} M parameters, AdamW, batch {args.batch} per data-parallel rank, {WORLD} processes")
    fsdp, tp = results["fsdp_bytes"], results["tp_bytes"]
    print(f"per-rank MB (rank 0)     fsdp (dp_shard={WORLD})   fsdp x tp (dp_shard={WORLD // TP} x tp={TP})")
    for part in ("parameters", "gradients", "optimizer"):
        print(f"  {part:<22} {fsdp[part] / 1e6:9.2f}  {tp[part] / 1e6:18.2f}")
    print(f"  {'total':<22} {sum(fsdp.values()) / 1e6:9.2f}  {sum(tp.values()) / 1e6:18.2f}")
    print(f"memory ratio fsdp x tp / fsdp:      {sum(tp.values()) / sum(fsdp.values()):8.3f}")
    (hand, hand_cpu), (ours, ours_cpu) = (
        (statistics.median(w for w, _ in results[name]) * 1e3, statistics.median(c for _, c in results[name]) * 1e3)
        for name in ("hand", "trainer"))
    print(f"{args.rounds} rounds x {args.steps} steps, interleaved     wall ms/step   CPU ms/step (rank 0)")
    print(f"hand-written fsdp x tp loop:        {hand:10.2f}    {hand_cpu:10.2f}")
    print(f"Trainer(fsdp, tensor_parallel=2):   {ours:10.2f}    {ours_cpu:10.2f}")
    print(f"ratio Trainer / hand-written:       {ours / hand:10.3f}    {ours_cpu / hand_cpu:10.3f}   (target <= 1.03)")


if __name__ == "__main__":
    main()
