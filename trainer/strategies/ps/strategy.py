"""Parameter-server training on torch.distributed.rpc: workers run at their own pace.
Roles, staleness modes, data and checkpoints: docs/strategies.md#ps."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import rpc
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment, find_free_port
from torchyard.trainer.data.loaders import loader_kwargs, prepare_loader
from torchyard.trainer.data.samplers import ResumableBatchSampler
from torchyard.trainer.errors import MisconfigurationError, Terminated
from torchyard.trainer.strategies import distributed
from torchyard.trainer.strategies.process_group import ProcessGroupStrategy
from torchyard.trainer.strategies.ps import liveness
from torchyard.trainer.strategies.ps.client import (
    ClaimedBatches,
    RemoteOptimizer,
    ShardClient,
    check_optimizer,
    plan_shards,
)
from torchyard.trainer.strategies.ps.server import ParameterShard, on_shard, served_shard, start_serving, stop_serving

if TYPE_CHECKING:
    from torchyard.trainer.config import TrainerConfig

STALE_POLICIES = ("drop", "scale")
BACKENDS = ("gloo", "nccl")


class ParameterServerStrategy(ProcessGroupStrategy):
    """`Trainer(strategy="ps", devices=N)`: `ps_servers` servers and N - ps_servers workers (per job).

    ps_servers: how many of the job's first ranks hold parameters. staleness: 0 (synchronous), S >= 1
    (bounded) or None (fully asynchronous). stale_gradients: 'drop' or 'scale' (learning rate times
    S / staleness) for gradients older than S updates. dynamic_batches: workers claim training batches
    as they go (default: when staleness is None). backend: the workers' process group ('gloo' on CPU,
    'nccl' on CUDA unless given). environment: who launched the job, when detection should not decide.
    """

    name = "ps"
    plannable = False  # its workers pull and push over torch.distributed.rpc, which the fake group does not serve
    steps_in_lockstep = False  # workers run at their own pace: no per-step collective among them

    def __init__(self, ps_servers: int = 1, staleness: int | None = None, stale_gradients: str = "scale",
                 dynamic_batches: bool | None = None, backend: str | None = None,
                 environment: str | ClusterEnvironment | None = None) -> None:
        super().__init__(backend, environment)
        if not isinstance(ps_servers, int) or isinstance(ps_servers, bool) or ps_servers < 1:
            raise MisconfigurationError(
                f"ps_servers={ps_servers!r} must be a positive integer (the number of server ranks)."
            )
        if staleness is not None and (not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0):
            raise MisconfigurationError(
                f"staleness={staleness!r} must be 0 (synchronous), a positive integer, or None (unbounded)."
            )
        if stale_gradients not in STALE_POLICIES:
            raise MisconfigurationError(f"stale_gradients={stale_gradients!r} is not known; use 'drop' or 'scale'.")
        if backend is not None and backend not in BACKENDS:
            raise MisconfigurationError(
                f"ParameterServerStrategy(backend={backend!r}) is not known; use 'gloo' or 'nccl'."
            )
        dynamic = staleness is None if dynamic_batches is None else bool(dynamic_batches)
        if dynamic and staleness is not None:
            raise MisconfigurationError(
                f"dynamic_batches=True needs staleness=None: with staleness={staleness}, a worker that ran out of "
                "batches at an epoch's end would hold back one still training, which waits for it in turn; "
                "set staleness=None or dynamic_batches=False."
            )
        self.ps_servers, self.staleness, self.stale_gradients = ps_servers, staleness, stale_gradients
        self.dynamic_batches = dynamic
        self._client: ShardClient | None = None
        self._in_rpc = self._clip_told = False
        self._rpc_store: dist.Store | None = None  # RPC's rendezvous store, when this rank must serve it
        self._ambient_exception: BaseException | None = None

    # ------------------------------------------------------------------ the world
    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        if not (dist.is_available() and rpc.is_available()):
            raise MisconfigurationError(
                "strategy='ps' runs on torch.distributed.rpc, which this torch build lacks "
                "(torch.distributed.rpc.is_available() is False); install a torch build with distributed support "
                "(the Linux and macOS wheels from pytorch.org) or use strategy='ddp'."
            )
        processes = devices * num_nodes
        if self.ps_servers >= processes:
            raise MisconfigurationError(
                f"strategy='ps' with ps_servers={self.ps_servers} leaves no worker: devices={devices} x "
                f"num_nodes={num_nodes} gives {processes} process(es) and the first {self.ps_servers} serve; "
                f"use at least {self.ps_servers + 1} processes in all, or fewer ps_servers."
            )
        if self.accelerator == "cuda" and devices > torch.cuda.device_count():
            raise MisconfigurationError(
                f"devices={devices} but this machine has {torch.cuda.device_count()} CUDA device(s); servers use "
                f"one each too, so use devices={torch.cuda.device_count()} or fewer."
            )

    @property
    def is_server(self) -> bool:
        """This process holds a parameter shard (one of the job's first ps_servers ranks)."""
        return self.environment.launched and self.environment.global_rank < self.ps_servers

    @property
    @override
    def global_rank(self) -> int:
        """A worker's rank among the workers (the chief is 0); a server's shard index."""
        env = self.environment
        return env.global_rank - self.ps_servers if env.launched and not self.is_server else env.global_rank

    @property
    @override
    def world_size(self) -> int:
        """The number of workers: the world the loop and its collectives see."""
        env = self.environment
        return env.world_size - self.ps_servers if env.launched else env.world_size

    @property
    @override
    def local_rank(self) -> int:
        """A worker's rank among its node's workers (the first of them prepares the node's data)."""
        env = self.environment
        if not env.launched or self.is_server:
            return env.local_rank
        servers_here = min(max(self.ps_servers - (env.global_rank - env.local_rank), 0), env.local_world_size)
        return env.local_rank - servers_here

    @property
    @override
    def is_global_zero(self) -> bool:
        return not self.is_server and self.global_rank == 0

    @property
    @override
    def reporting_rank(self) -> int:
        return self.ps_servers  # the chief

    @override
    def setup_environment(self, environment: ClusterEnvironment) -> None:
        """Join RPC (every rank) and the workers' process group (workers); a server starts holding its shard."""
        self._check_launch(environment)
        if dist.is_initialized():
            raise MisconfigurationError(
                "strategy='ps' makes a process group of its workers (the servers are not in it), but this process "
                "already has one; do not call torch.distributed.init_process_group yourself under strategy='ps'."
            )
        self._pin_device(environment)
        self._ambient_exception = sys.exc_info()[1]
        timeout = datetime.timedelta(seconds=self.timeout)
        store = distributed.job_store(environment, timeout, self.backend)
        attempt = f"trainer/attempt_{environment.restart_count}/ps"
        session = f"{attempt}/session_{(store.add(f'{attempt}/joined', 1) - 1) // environment.world_size}"
        if self.is_server:
            start_serving(ParameterShard(self.global_rank, self.world_size, self.staleness, self.stale_gradients,
                                         self.root_device))
        self._join_rpc(store, session, environment)
        if not self.is_server:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"{session}/workers/", store),
                                    rank=self.global_rank, world_size=self.world_size, timeout=timeout)
            self._owns_group = True
            if self.diagnosis != "off":
                self._start_watchdog(environment, self.global_rank, self.world_size)  # the workers watch each other

    def _join_rpc(self, store: dist.Store, session: str, environment: ClusterEnvironment) -> None:
        # RPC meets at its own port (its rendezvous store cannot share the job's); rank 0 picks a free one.
        rank = environment.global_rank
        if rank == 0:
            store.set(f"{session}/rpc_port", str(find_free_port()))
        port = int(store.get(f"{session}/rpc_port").decode())
        if rank == 0 and environment.use_agent_store:
            # Under torch's elastic agent, torch makes every rendezvous store a client (it assumes the agent
            # serves it), so rank 0 serves RPC's itself; elsewhere torch's rank 0 does.
            self._rpc_store = dist.TCPStore(environment.master_addr, port, environment.world_size, True,
                                            timeout=datetime.timedelta(seconds=self.timeout), wait_for_workers=False)
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{environment.master_addr}:{port}",
                                                  rpc_timeout=self.timeout, num_worker_threads=8)
        name = f"ps{rank}" if rank < self.ps_servers else f"worker{rank - self.ps_servers}"
        with _quiet_rpc_internals():
            rpc.init_rpc(name, rank=rank, world_size=environment.world_size, rpc_backend_options=options)
        self._in_rpc = True

    def _leave_rpc(self, graceful: bool) -> None:
        """Leave RPC; gracefully (every rank of the job together) unless a rank it would wait for is gone."""
        if self._in_rpc:
            self._in_rpc = False
            with _quiet_rpc_internals():
                if graceful:
                    watch = self._gone_server_rank if self.is_server else self._gone_worker_rank
                    liveness.graceful_shutdown_watched(watch)
                else:
                    rpc.shutdown(graceful=False)
        self._rpc_store = None

    def _gone_server_rank(self) -> str | None:
        """A server's watch: the first worker still training that stopped answering (the live ones are told)."""
        shard = served_shard()
        with shard.lock:
            training = sorted(shard.training)  # a worker that finished may leave: only those still training count
        gone = liveness.first_gone(f"worker{worker}" for worker in training)
        if gone is None:
            return None
        worker = int(gone.removeprefix("worker"))
        reason = (f"ps worker {worker} (rank {worker + self.ps_servers}) stopped answering while training (its "
                  "process is gone), so the parameter servers stopped the job")
        liveness.tell_aborted((f"worker{w}" for w in training if w != worker), reason)
        return reason

    def _gone_worker_rank(self) -> str | None:
        """A worker's watch: what a server said stopped the job, else the first server that stopped answering."""
        told = liveness.abort_reason()
        if told is not None:
            return told
        gone = liveness.first_gone(f"ps{k}" for k in range(self.ps_servers))
        return None if gone is None else f"parameter server {gone} stopped answering (its process is gone)"

    @override
    def serve(self) -> bool:
        """On a server: answer the workers until every process of the job has finished, then leave."""
        if not self.is_server:
            return False
        with _stop_signals_deferred(self.timeout) as received:
            try:
                self._leave_rpc(graceful=True)  # a graceful shutdown keeps answering until all ranks reach it
            finally:
                stop_serving()
        if received:
            raise Terminated(128 + received[0])  # stopped with the workers, as they were told to
        return True

    @override
    def teardown(self) -> None:
        """Workers: final values into the module, leave the servers' bookkeeping, the group, then RPC."""
        # An exception raised in this run (not one the caller was already handling) means the others may
        # never arrive: leave at once rather than wait for them in a graceful shutdown. A SIGTERM stop is
        # no failure: every rank was told, saved and leaves.
        raised = sys.exc_info()[1]
        failing = raised not in (None, self._ambient_exception) and not isinstance(raised, Terminated)
        try:
            if self._client is not None and not failing:
                reports = self._client.finish()
                if self.is_global_zero:
                    print(_summary(reports, self.stale_gradients))
        finally:
            self._client = None
            # The workers' group goes now, kept for the script or not (RPC, which shuts down next, outlives it).
            owns_group, self._owns_group = self._owns_group, False
            super().teardown()
            if owns_group:
                distributed.destroy_process_group()
            self._leave_rpc(graceful=not failing)
            stop_serving()

    # ------------------------------------------------------------------ the model
    @override
    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Place the parameters on the servers (the chief initialises them); the loop steps a RemoteOptimizer."""
        assert self.module is not None
        optimizer = check_optimizer(optimizers)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        own = {id(p) for p in self.module.parameters()}
        if any(id(p) not in own for p in params):
            raise MisconfigurationError(
                "the optimizer holds tensors that are not parameters of the module; under strategy='ps' the "
                "servers hold the module's parameters, so build the optimizer from self.parameters()."
            )
        shard_of = plan_shards([p.numel() for p in params], self.ps_servers)
        servers = [f"ps{k}" for k in range(self.ps_servers)]
        self._client = ShardClient(self.global_rank, servers, optimizer, shard_of, is_chief=self.is_global_zero)
        if self.is_global_zero:
            counts = self._client.initialize(optimizer)
            print(self._roles(counts, [sum(params[i].numel() for i in shard) for shard in self._client.shards]))
        return [RemoteOptimizer(optimizer, self._client)]

    def _roles(self, tensors: list[int], values: list[int]) -> str:
        servers, workers = self.ps_servers, self.world_size
        mode = {None: "fully asynchronous", 0: "synchronous"}.get(
            self.staleness, f"at most {self.staleness} steps ahead"
        )
        batches = "claimed as workers go" if self.dynamic_batches else "fixed shards per worker"
        lines = [f"ps: {servers} server(s), {workers} worker(s); staleness={self.staleness} ({mode}); "
                 f"stale_gradients={self.stale_gradients!r}; training batches {batches}"]
        lines += [f"  rank {k}: server ps{k}, {tensors[k]} tensors, {values[k]:,} values" for k in range(servers)]
        lines += [
            f"  rank {servers + w}: worker {w}" + (" (chief: logs, checkpoints)" if w == 0 else "")
            for w in range(workers)
        ]
        return "\n".join(lines)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self._client is not None:
            self.marker.enter("pull", "the parameters from the servers")
            self._client.refresh()
            self.marker.leave()
        return super().training_step(batch, batch_idx)

    @override
    def eval_step(self, step_name: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        if self._client is not None:
            self._client.refresh()
        return super().eval_step(step_name, batch, batch_idx, dataloader_idx)

    @override
    def check_config(self, config: TrainerConfig, callbacks: list[Any]) -> None:
        if config.compile is not None:  # a worker's module is refreshed from the server's tensors between steps
            raise MisconfigurationError("compile is not supported with strategy='ps' (its workers pull parameters "
                                        "from the server between steps); use strategy='ddp' with compile, or drop "
                                        "compile.")
        if not self.dynamic_batches:
            return
        # Claimed batches have no length, known only as the epoch runs out: a fraction of one means nothing.
        if isinstance(config.limit_train_batches, float) and config.limit_train_batches not in (0.0, 1.0):
            raise MisconfigurationError(
                f"limit_train_batches={config.limit_train_batches} is a fraction of an epoch, but strategy='ps' with "
                "dynamic_batches (staleness=None) gives its workers batches as they ask, so an epoch has no length; "
                "give a batch count (an int).")
        # Each worker counts its own batches and steps, and they differ; a validation or a checkpoint every n of
        # them is a collective that the workers would reach different numbers of times, and wait forever.
        # Callbacks declare such a need (Callback.step_collective). max_time is kept by a Timer the Trainer adds,
        # which asks rank 0's clock after every step: the option is named first, as the user set it.
        every_n = ["max_time"] if config.max_time is not None else []
        every_n += [need for need in (callback.step_collective for callback in callbacks) if need is not None]
        if not (
            isinstance(config.val_check_interval, float) and config.val_check_interval == 1.0
        ):  # int 1: every batch
            every_n.append(f"val_check_interval={config.val_check_interval}")
        if every_n:
            raise MisconfigurationError(
                f"{every_n[0]} needs every process to reach the same steps, but strategy='ps' with dynamic_batches "
                "(staleness=None) lets each worker train as many batches as it claims; validate, checkpoint and check "
                "time budgets at epoch ends (every_n_epochs, val_check_interval=1.0, Timer(duration=..., "
                "interval='epoch')), or give the ps strategy staleness=0.")

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, value: float, algorithm: str) -> None:
        """Clip this worker's gradient before it is pushed: the servers average clipped gradients, where ddp
        clips the average (the same only while no worker's gradient is clipped); said once, by the chief."""
        if self.staleness == 0 and self.is_global_zero and not self._clip_told:
            self._clip_told = True
            warnings.warn(
                "strategy='ps' clips each worker's gradient before the servers average them; ddp clips the "
                "averaged gradient, so synchronous ps with gradient_clip_val trains like ddp only while no "
                "worker's gradient exceeds the limit.", stacklevel=2)
        super().clip_gradients(optimizer, value, algorithm)

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], torch.Tensor] | None = None
    ) -> None:
        """Push the gradients (RemoteOptimizer.step); log how stale they were. (No optimizer that needs a closure
        gets here: check_optimizer refuses it.)"""
        self.marker.enter("push", "the gradients to the servers")
        super().optimizer_step(optimizer, closure)
        self.marker.leave()
        pushed = getattr(optimizer, "last_push", None)
        if pushed and self.module is not None:
            self.module.log("ps/staleness", float(pushed["staleness"]))
            if self.staleness:
                self.module.log(
                    "ps/stale_gradients", float(pushed["dropped" if self.stale_gradients == "drop" else "scaled"])
                )
            optimizer.last_push = {}

    # ------------------------------------------------------------------ data
    @override
    def prepare_loader(self, loader: DataLoader, train: bool, seed: int) -> DataLoader:
        """Fixed shards over the workers, or (dynamic_batches) one shared epoch order claimed batch by batch."""
        claimable = (train and self.dynamic_batches and type(loader) is DataLoader and loader.batch_size is not None
                     and not isinstance(loader.dataset, IterableDataset))
        if not claimable:
            return super().prepare_loader(loader, train, seed)
        pin = True if self.root_device.type == "cuda" else None
        ordered = prepare_loader(loader, train=True, num_replicas=1, rank=0, seed=seed, pin_memory=pin)
        assert isinstance(ordered.batch_sampler, ResumableBatchSampler)
        return DataLoader(ordered.dataset, batch_sampler=ClaimedBatches(ordered.batch_sampler, self._claim_batch),
                          **loader_kwargs(ordered, pin))

    def _claim_batch(self, epoch: int, total: int) -> int | None:
        if total < self.world_size:
            raise MisconfigurationError(
                f"an epoch has {total} training batch(es) for {self.world_size} workers, and each needs one; "
                "use a smaller batch size, more data, or dynamic_batches=False."
            )
        return rpc.rpc_sync("ps0", on_shard, args=("claim", self.global_rank, epoch, total))

    # ------------------------------------------------------------------ checkpoints
    @override
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The servers' values (a collective: each worker's pushes so far are applied before the read)."""
        if self._client is None:
            return super().model_state_dict()
        assert self.module is not None
        self.barrier("model_state_dict")
        return self._client.state_dict_of(self.module)

    @override
    def load_model_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        super().load_model_state_dict(state_dict, strict)
        if self._client is not None and self.is_global_zero:
            self._client.upload()


def _summary(reports: list[dict[str, int]], policy: str) -> str:
    pushes = sum(r["pushes"] for r in reports) // max(len(reports), 1)
    updates = sum(r["version"] for r in reports) // max(len(reports), 1)
    stale = sum(r["dropped" if policy == "drop" else "scaled"] for r in reports) // max(len(reports), 1)
    mean = sum(r["staleness_total"] for r in reports) / max(sum(r["pushes"] for r in reports), 1)
    worst = max((r["staleness_max"] for r in reports), default=0)
    share = f" ({100 * stale / pushes:.1f}%)" if pushes else ""
    return (f"ps: {updates} updates from {pushes} gradients per server; {stale} stale gradients "
            f"{'dropped' if policy == 'drop' else 'scaled'}{share}; staleness mean {mean:.2f}, max {worst}")


@contextlib.contextmanager
def _stop_signals_deferred(timeout_s: float) -> Iterator[list[int]]:
    """While a server answers, SIGTERM, SIGINT (Ctrl-C) and SIGHUP only mark that they came (the list holds their
    numbers): the workers, told too, save a checkpoint, which reads the parameters from the servers, before
    everyone leaves. A server still answering `timeout_s` after the first signal exits: a worker that failed (the
    reason the launcher stops the job) never joins the graceful shutdown it waits in."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
        yield received
        return

    def defer(signum: int, frame: Any) -> None:
        if not received:
            timer = threading.Timer(timeout_s, os._exit, args=(128 + signum,))
            timer.daemon = True
            timer.start()
        received.append(signum)

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, defer) for sig in signals}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _quiet_rpc_internals() -> Iterator[None]:
    # torch's RPC set-up and shutdown warn about their own use of a gloo backend object; users can do nothing about it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        yield
