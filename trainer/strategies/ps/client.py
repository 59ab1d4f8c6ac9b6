"""The worker side of strategy="ps": the link to the parameter servers, the optimizer the loop steps, and
batches handed out on demand.

- `plan_shards` places each parameter tensor on a server, balanced by number of values;
- `ShardClient` pulls a worker's parameters before a step, pushes its gradients after, and reads and
  writes the servers' state for checkpoints;
- `RemoteOptimizer` is what the loop (or manual optimization) steps: its step() pushes the gradients, its
  state_dict() is the servers' optimizer state in the layout of the user's optimizer;
- `ClaimedBatches` is a batch sampler whose batches go to whichever worker claims them first.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed import rpc
from torch.futures import Future
from torch.optim import Optimizer

from torchyard.trainer.data.samplers import ResumableBatchSampler
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.optim import needs_closure
from torchyard.trainer.strategies.ps.server import on_shard, pull_from_shard, rebuild_optimizer

STALE_KEYS = ("staleness", "dropped", "scaled")


def group_options(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (everything but its parameters)."""
    return [
        {key: value for key, value in group.items() if key not in ("params", "param_names")} for group in param_groups
    ]


def check_optimizer(optimizers: list[Optimizer]) -> Optimizer:
    """The one optimizer a server can rebuild as `type(opt)(param_groups, **opt.defaults)`, or a clear error."""
    if len(optimizers) != 1:
        raise MisconfigurationError(
            f"strategy='ps' keeps one optimizer on the servers, but configure_optimizers returned {len(optimizers)}; "
            "put every parameter in one optimizer (param groups may differ in lr, weight decay, ...) or use "
            "strategy='ddp'."
        )
    optimizer = optimizers[0]
    kind = type(optimizer).__name__
    if needs_closure(optimizer):
        raise MisconfigurationError(
            f"strategy='ps' cannot hold {kind}: its step needs a closure that recomputes the loss, which only a "
            "worker can do, while the update runs on the servers; use an optimizer whose step takes no closure "
            "(SGD, Adam, AdamW, ...) or strategy='ddp'."
        )
    options = group_options(optimizer.param_groups)
    device = optimizer.param_groups[0]["params"][0].device
    try:
        pickle.dumps((type(optimizer), optimizer.defaults, options))
        rebuild_optimizer(type(optimizer), [{**group, "params": [torch.zeros(1, device=device, requires_grad=True)]}
                                            for group in options], optimizer.defaults)
    except Exception as err:  # noqa: BLE001 - any failure to rebuild it means a server cannot hold it
        raise MisconfigurationError(
            f"strategy='ps' rebuilds the optimizer on each server as {kind}(param_groups, **defaults), which fails "
            f"here ({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); use a torch.optim "
            "optimizer, or one whose constructor takes its defaults as keyword arguments, or strategy='ddp'."
        ) from err
    return optimizer


def plan_shards(sizes: list[int], servers: int) -> list[int]:
    """The server of each parameter tensor: largest first, each to the least loaded server (by values)."""
    if len(sizes) < servers:
        raise MisconfigurationError(
            f"ps_servers={servers}, but the optimizer holds only {len(sizes)} parameter tensor(s) to share out; "
            f"use ps_servers={len(sizes)} or fewer."
        )
    loads, shard_of = [0] * servers, [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(servers), key=lambda k: (loads[k], k))
        shard_of[index], loads[server] = server, loads[server] + sizes[index]
    return shard_of


def _gradient(param: torch.Tensor) -> torch.Tensor | None:
    # RPC payloads travel on CPU, so no device map is needed between a worker's GPU and a server's.
    return None if param.grad is None else param.grad.detach().cpu()


class ShardClient:
    """One worker's link to the servers: where each parameter lives, pull before a step, push after it."""

    def __init__(
        self, worker: int, servers: list[str], optimizer: Optimizer, shard_of: list[int], is_chief: bool
    ) -> None:
        self.worker, self.servers, self.is_chief = worker, servers, is_chief
        self.params: list[nn.Parameter] = [p for group in optimizer.param_groups for p in group["params"]]
        self.group_of = [index for index, group in enumerate(optimizer.param_groups) for _ in group["params"]]
        self.shards = [[i for i, server in enumerate(shard_of) if server == k] for k in range(len(servers))]
        self.versions = [0] * len(servers)  # the version of each shard this worker last computed on
        self.clock = 0  # gradients pushed
        self.fresh = False  # the local parameters are those of the next step
        self._opened = False

    def _call(self, shard: int, method: str, *args: Any) -> Future:
        return rpc.rpc_async(self.servers[shard], on_shard, args=(method, *args))

    def _pull(self, clock: int | None) -> list[tuple[int, list[torch.Tensor]]]:
        # The chief's first request opens the shards: by then it has initialised them and restored a checkpoint.
        opens, self._opened = self.is_chief and not self._opened, True
        futures = [rpc.rpc_async(server, pull_from_shard, args=(self.worker, clock, opens)) for server in self.servers]
        return [future.wait() for future in futures]

    def _write(self, shard: int, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for index, value in zip(self.shards[shard], values):
                self.params[index].copy_(value)

    def initialize(self, optimizer: Optimizer) -> list[int]:
        """(Chief) Hand each server its parameters and the optimizer to rebuild; returns tensors per server."""
        options = group_options(optimizer.param_groups)
        futures = [self._call(k, "initialize", [self.params[i].detach().cpu() for i in shard],
                              [self.group_of[i] for i in shard], type(optimizer), optimizer.defaults, options)
                   for k, shard in enumerate(self.shards)]
        return [future.wait() for future in futures]

    def refresh(self) -> None:
        """Pull the parameters of this worker's next step (waiting as long as its staleness bound asks)."""
        if self.fresh:
            return
        for shard, (version, values) in enumerate(self._pull(self.clock)):
            self.versions[shard] = version
            self._write(shard, values)
        self.fresh = True

    def push(self, param_groups: list[dict[str, Any]]) -> dict[str, int]:
        """Send this step's gradients; the reply says how stale they were and what the servers counted."""
        options = group_options(param_groups)
        futures = [
            self._call(k, "push", self.worker, self.versions[k], [_gradient(self.params[i]) for i in shard], options)
            for k, shard in enumerate(self.shards)
        ]
        replies = [future.wait() for future in futures]
        self.clock, self.fresh = self.clock + 1, False
        return {key: max(reply[key] for reply in replies) for key in STALE_KEYS}

    def read(self) -> list[torch.Tensor]:
        """The servers' current values, in the optimizer's parameter order."""
        values: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for shard, (_, shard_values) in enumerate(self._pull(None)):
            for index, value in zip(self.shards[shard], shard_values):
                values[index] = value
        return values

    def state_dict_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module.state_dict()` with the server-held parameters at their servers' values."""
        held = {id(param): value for param, value in zip(self.params, self.read())}
        return {name: held[id(tensor)].to(tensor.device, tensor.dtype) if id(tensor) in held else tensor.detach()
                for name, tensor in module.state_dict(keep_vars=True).items()}

    def upload(self) -> None:
        """(Chief) Overwrite the servers' values with this worker's parameters (after loading a checkpoint)."""
        futures = [self._call(k, "load", [self.params[i].detach().cpu() for i in shard], None)
                   for k, shard in enumerate(self.shards)]
        for future in futures:
            future.wait()

    def optimizer_state(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The servers' optimizer state as `state_dict()` of the user's optimizer on one device would give it."""
        replies = [future.wait() for future in [self._call(k, "optimizer_state") for k in range(len(self.servers))]]
        state = {self.shards[k][pos]: entry for k, reply in enumerate(replies) for pos, entry in reply.items()}
        groups, start = [], 0
        for options, group in zip(group_options(param_groups), param_groups):
            groups.append({**options, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_optimizer_state(self, state: dict[int, dict[str, Any]]) -> None:
        """(Chief) Send each server the state of its parameters (`state` keyed as in the user's optimizer)."""
        futures = [self._call(k, "load", None, {pos: state[i] for pos, i in enumerate(shard) if i in state})
                   for k, shard in enumerate(self.shards)]
        for future in futures:
            future.wait()

    def finish(self) -> list[dict[str, int]]:
        """Take the final values into the local parameters, leave the servers' bookkeeping; their counts."""
        with torch.no_grad():
            for param, value in zip(self.params, self.read()):
                param.copy_(value)
        for future in [self._call(k, "finish", self.worker) for k in range(len(self.servers))]:
            future.wait()
        return [future.wait() for future in [self._call(k, "report") for k in range(len(self.servers))]]


class RemoteOptimizer(Optimizer):
    """What the loop steps under strategy="ps": step() pushes the gradients, and the servers update.

    It shares its param-group dicts with the optimizer configure_optimizers built, so learning-rate
    schedulers built on that one (and the trainer's lr scaling and warm-up) set the rates pushed with
    each gradient. state_dict() is the servers' state in that optimizer's layout, so a checkpoint's
    optimizer state loads into a single-device run.
    """

    steps_with_closure = False  # see optim.takes_closure: the update runs on the servers

    def __init__(self, optimizer: Optimizer, client: ShardClient) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer, self.client = optimizer, client
        self.last_push: dict[str, int] = {}

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise MisconfigurationError("strategy='ps' updates on the servers, which cannot run an optimizer closure; "
                                        "call optimizer.step() without one.")
        self.last_push = self.client.push(self.param_groups)
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None
        # The update happened on the servers; stepping the user's optimizer without gradients changes
        # nothing, but counts as its step for schedulers built on it (which warn of a scheduler step
        # before any optimizer step otherwise) and runs the step hooks registered on it.
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.client.optimizer_state(self.param_groups)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "the saved optimizer state has other parameter groups (or group sizes) than this optimizer"
            )
        for group, options in zip(self.param_groups, group_options(saved)):
            group.update(options)
        if self.client.is_chief:
            self.client.load_optimizer_state({int(key): value for key, value in state_dict["state"].items()})


class ClaimedBatches:
    """A batch sampler over one shared epoch order: each batch goes to the worker that claims it first.

    Workers iterate the same seeded order (that of one process) and skip the batches others claimed, so
    a fast worker trains on more of the epoch than a slow one, and every batch is used once per epoch.
    It has no length (how many batches a worker gets is known only at the epoch's end).
    """

    def __init__(self, batches: ResumableBatchSampler, claim: Callable[[int, int], int | None]) -> None:
        self.batches, self.claim = batches, claim
        self.epoch = 0
        self.generator_seed = batches.generator_seed  # trainer.data.set_epoch reseeds the loader from it

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batches.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        total, taken = len(self.batches), -1
        order = iter(self.batches)
        while (index := self.claim(self.epoch, total)) is not None:
            # Claims only move forward, so the shared order is walked once, skipping others' batches.
            batch = next(itertools.islice(order, index - taken - 1, None))
            taken = index
            yield batch
