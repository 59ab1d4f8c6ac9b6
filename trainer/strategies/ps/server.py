"""The server side of strategy="ps": one shard of the parameters with its optimizer, and the RPC entry points.
The staleness modes it applies, and why it keeps its shard in `_SERVED` rather than in RRefs: docs/strategies.md#ps."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed import rpc
from torch.futures import Future

Snapshot = tuple[int, list[torch.Tensor]]  # (version, parameter values on CPU)


@dataclass
class ShardStats:
    """What a shard counted: gradients received, updates applied, stale gradients dropped or scaled."""

    pushes: int = 0
    applied: int = 0
    dropped: int = 0
    scaled: int = 0
    staleness_total: int = 0
    staleness_max: int = 0


class ParameterShard:
    """One server's share of the parameters and the optimizer that updates them."""

    def __init__(self, index: int, num_workers: int, staleness: int | None, stale_gradients: str,
                 device: torch.device) -> None:
        self.index, self.num_workers, self.device = index, num_workers, device
        self.staleness, self.stale_gradients = staleness, stale_gradients
        self.lock = threading.Lock()
        self.params: list[torch.Tensor] = []
        self.local_order: list[int] = []  # shard position of each parameter in the optimizer's own order
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0  # updates applied
        self.clocks = [0] * num_workers  # gradients pushed, per worker
        self.training = set(range(num_workers))  # workers that have not finished
        self.ready = False  # opened by the chief's first request, after it initialised (and restored) the shard
        self.round: dict[int, list[torch.Tensor | None]] = {}
        self.waiting: list[tuple[int, Future]] = []  # pulls waiting for their step to be allowed
        self.cursors: dict[int, tuple[int, set[int]]] = {}  # epoch -> (next shared batch, workers served)
        self.stats = ShardStats()

    # ------------------------------------------------------------------ set-up (from the chief)
    def initialize(self, values: Sequence[torch.Tensor], group_of: Sequence[int], optimizer_class: type,
                   defaults: dict[str, Any], group_options: Sequence[dict[str, Any]]) -> int:
        """Hold `values` and build `optimizer_class` over them, in the worker optimizer's param groups."""
        with self.lock:
            self.params = [value.detach().to(self.device).clone().requires_grad_(True) for value in values]
            groups = [{**options, "params": [p for p, g in zip(self.params, group_of) if g == index]}
                      for index, options in enumerate(group_options)]
            self.local_order = [
                pos for index in range(len(group_options)) for pos, g in enumerate(group_of) if g == index
            ]
            self.optimizer = rebuild_optimizer(optimizer_class, groups, defaults)
            return len(self.params)

    def load(self, values: Sequence[torch.Tensor] | None, optimizer_state: dict[int, dict[str, Any]] | None) -> None:
        """Overwrite the parameters and/or the optimizer state (keyed by shard position), from a checkpoint."""
        with self.lock:
            if values is not None:
                with torch.no_grad():
                    for param, value in zip(self.params, values):
                        param.copy_(value)
            if optimizer_state is not None:
                assert self.optimizer is not None
                state = self.optimizer.state_dict()
                state["state"] = {local: optimizer_state[pos] for local, pos in enumerate(self.local_order)
                                  if pos in optimizer_state}
                self.optimizer.load_state_dict(state)

    # ------------------------------------------------------------------ the workers' requests
    def pull(self, worker: int, clock: int | None, opens: bool) -> Future:
        """The parameters for `worker`'s step `clock`, once that step is allowed (clock None: read now)."""
        future: Future = Future()
        with self.lock:
            self.ready = self.ready or opens
            if self._allowed(clock):
                now: Snapshot | None = self._snapshot()
            else:
                now = None
                self.waiting.append((-1 if clock is None else clock, future))
            released = self._release()
        if now is not None:
            future.set_result(now)
        _complete(released)
        return future

    def push(self, worker: int, version: int, grads: list[torch.Tensor | None],
             group_options: Sequence[dict[str, Any]]) -> dict[str, int]:
        """Take `worker`'s gradient computed on parameters of `version`; apply it (or its round)."""
        with self.lock:
            assert self.optimizer is not None, "push before the chief initialised the shard"
            self.clocks[worker] += 1
            self.stats.pushes += 1
            for group, options in zip(self.optimizer.param_groups, group_options):
                group.update(options)  # the worker's current rates: schedulers and warm-up run there
            staleness = self.version - version
            self.stats.staleness_total += staleness
            self.stats.staleness_max = max(self.stats.staleness_max, staleness)
            if self.staleness == 0:
                if worker in self.round:
                    raise RuntimeError(f"worker {worker} pushed twice in one synchronous round; step once per batch.")
                self.round[worker] = grads
                if self.training <= set(self.round):
                    self._apply_round()
            else:
                self._apply_one(grads, staleness)
            reply = {"staleness": staleness, "version": self.version, **asdict(self.stats)}
            released = self._release()
        _complete(released)
        return reply

    def finish(self, worker: int) -> None:
        """`worker` trains no more: it no longer holds back rounds or other workers' steps."""
        with self.lock:
            self.training.discard(worker)
            if self.staleness == 0 and self.round and self.training <= set(self.round):
                self._apply_round()
            released = self._release()
        _complete(released)

    def claim(self, worker: int, epoch: int, total: int) -> int | None:
        """The next batch of `epoch` (of `total`) for `worker`, or None when the epoch is used up.

        Batch w goes to worker w, so each worker has at least one batch per epoch (the loop treats an
        epoch without batches as an error); the rest go to whoever asks first.
        """
        with self.lock:
            shared, served = self.cursors.setdefault(epoch, (self.num_workers, set()))
            if worker not in served:
                served.add(worker)
                return worker if worker < total else None
            if shared >= total:
                return None
            self.cursors[epoch] = (shared + 1, served)
            return shared

    def optimizer_state(self) -> dict[int, dict[str, Any]]:
        """The optimizer's per-parameter state, keyed by shard position, copied to CPU."""
        with self.lock:
            assert self.optimizer is not None
            state = self.optimizer.state_dict()["state"]
            return {
                self.local_order[local]: {
                    key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
                    for key, value in entry.items()
                }
                for local, entry in state.items()
            }

    def report(self) -> dict[str, int]:
        with self.lock:
            return {"version": self.version, **asdict(self.stats)}

    # ------------------------------------------------------------------ inside the lock
    def _allowed(self, clock: int | None) -> bool:
        if not self.ready:
            return False
        if clock is None or self.staleness is None:
            return True
        if self.staleness == 0:
            return self.version >= clock  # every round before this step has been applied
        slowest = min((self.clocks[w] for w in self.training), default=clock)
        return clock - slowest <= self.staleness

    def _release(self) -> list[tuple[Future, Snapshot]]:
        allowed = [(clock, future) for clock, future in self.waiting if self._allowed(None if clock < 0 else clock)]
        if not allowed:
            return []
        self.waiting = [item for item in self.waiting if item not in allowed]
        now = self._snapshot()
        return [(future, now) for _, future in allowed]

    def _snapshot(self) -> Snapshot:
        # Copies: the values are serialised after the lock is released, while later updates write in place.
        return self.version, [param.detach().cpu().clone() for param in self.params]

    def _apply_round(self) -> None:
        contributions = [self.round[worker] for worker in sorted(self.round)]
        averaged = []
        for pos in range(len(self.params)):
            present = [grads[pos] for grads in contributions if grads[pos] is not None]
            # A worker that produced no gradient for a parameter contributes zero, as in data parallelism.
            averaged.append(torch.stack(present).sum(0) / len(contributions) if present else None)
        self.round.clear()
        self._step(averaged, 1.0)

    def _apply_one(self, grads: list[torch.Tensor | None], staleness: int) -> None:
        lr_factor = 1.0
        if self.staleness is not None and staleness > self.staleness:
            if self.stale_gradients == "drop":
                self.stats.dropped += 1
                return
            lr_factor = self.staleness / staleness
            self.stats.scaled += 1
        self._step(grads, lr_factor)

    def _step(self, grads: list[torch.Tensor | None], lr_factor: float) -> None:
        assert self.optimizer is not None
        for param, grad in zip(self.params, grads):
            param.grad = None if grad is None else grad.to(self.device, param.dtype)
        groups = self.optimizer.param_groups
        rates = [group.get("lr") for group in groups]
        if lr_factor != 1.0:
            for group, rate in zip(groups, rates):
                if rate is not None:
                    group["lr"] = rate * lr_factor
        try:
            self.optimizer.step()
        finally:
            for group, rate in zip(groups, rates):
                if rate is not None:
                    group["lr"] = rate
            for param in self.params:
                param.grad = None
        self.version += 1
        self.stats.applied += 1


def rebuild_optimizer(
    optimizer_class: type, groups: list[dict[str, Any]], defaults: dict[str, Any]
) -> torch.optim.Optimizer:
    """`optimizer_class(groups, **defaults)`, passing only the defaults its constructor takes.

    Some defaults are not constructor arguments (AdamW records `decoupled_weight_decay`, which it sets
    itself); every group already carries them all, as the worker's optimizer filled them in.
    """
    accepted = inspect.signature(optimizer_class).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        defaults = {key: value for key, value in defaults.items() if key in accepted}
    return optimizer_class(groups, **defaults)


def _complete(released: list[tuple[Future, Snapshot]]) -> None:
    # Outside the lock: completing a future sends the RPC reply on this thread.
    for future, value in released:
        future.set_result(value)


# --------------------------------------------------------------------------- the process's served shard

_SERVED: list[ParameterShard] = []


def start_serving(shard: ParameterShard) -> None:
    """Make `shard` the one this process serves (before it joins RPC, so no request finds nothing)."""
    _SERVED[:] = [shard]


def stop_serving() -> None:
    _SERVED.clear()


def served_shard() -> ParameterShard:
    """The shard this process serves."""
    return _served()


def _served() -> ParameterShard:
    if not _SERVED:
        raise RuntimeError("this process serves no parameter shard (it is not a parameter server, or it has stopped)")
    return _SERVED[0]


def on_shard(method: str, *args: Any) -> Any:
    """RPC entry point: `method` of this process's shard."""
    return getattr(_served(), method)(*args)


@rpc.functions.async_execution
def pull_from_shard(worker: int, clock: int | None, opens: bool) -> Future:
    """RPC entry point for pulls: the reply is sent when the step is allowed, without holding a thread."""
    return _served().pull(worker, clock, opens)
