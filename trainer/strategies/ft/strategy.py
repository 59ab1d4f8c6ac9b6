"""ddp with live recovery on torchft: `strategy={"name": "ddp", "fault_tolerance": {"replica_groups": 3}}`.

The job is `replica_groups` independent groups of processes (one process each, for now), each its own torch process
group, restarted on its own when it dies. Every step asks torchft's lighthouse for a quorum of the groups alive
(torchft's Manager, one per process), all-reduces gradients over that quorum only (DDP's hook into the Manager), and
applies the step only where every participant finished it (`should_commit`); a step that does not commit (a peer died
in it) is trained again on the same samples under the next quorum. A restarted group asks for its first quorum before
training, and torchft hands it a live peer's whole training state (weights, optimizer, counters, the sample ledger; no
checkpoint read), from which it goes on as from a checkpoint. Each step's global batch is dealt over the quorum's
participants (slices.py), so every sample of every epoch is trained exactly once. Group 0's first process writes the
logs, checkpoints and ledger; docs/fault-tolerance.md#live-recovery-torchft says what it costs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from torchyard.trainer.cluster.environment import ClusterEnvironment, find_free_port
from torchyard.trainer.data.loaders import prepare_loader
from torchyard.trainer.errors import MisconfigurationError, closest
from torchyard.trainer.strategies.ddp import DDPStrategy
from torchyard.trainer.strategies.ft.lighthouse import (
    check_lighthouse,
    require_torchft,
    split_address,
    start_lighthouse,
)
from torchyard.trainer.strategies.ft.slices import StepBatches, replica_loader
from torchyard.trainer.strategies.user_steps import StepDispatcher

if TYPE_CHECKING:
    from torchyard.trainer.config import TrainerConfig
    from torchyard.trainer.module import TrainModule

#: Which replica group a process belongs to, and the lighthouse's address ('http://host:port', torchft's own
#: variable): set by the Trainer's launcher of replica groups, or by hand for torchrun per group. Read here only.
GROUP_VARIABLE, LIGHTHOUSE_VARIABLE = "TORCHYARD_REPLICA_GROUP", "TORCHFT_LIGHTHOUSE"
#: Quorums a replica asks for before it trains, where one fails (a peer died in it, a heal's state did not arrive).
JOIN_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """The `fault_tolerance` options. replica_groups: the groups the job plans for (each step trains replica_groups
    x batch_size samples, dealt over the groups alive); min_replicas: the fewest groups a step may commit with;
    lighthouse: 'host:port' of a running torchft lighthouse (None: the Trainer starts one); timeout: seconds a
    step's collectives and a heal may take before the step is dropped and retried; quorum_timeout: seconds to wait
    for min_replicas groups."""

    replica_groups: int
    min_replicas: int = 1
    lighthouse: str | None = None
    timeout: float = 10.0
    quorum_timeout: float = 60.0

    @classmethod
    def parse(cls, options: Any) -> FaultTolerance:
        """The options from the strategy's `fault_tolerance` mapping, each mistake one line."""
        known = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(options, Mapping) or "replica_groups" not in options:
            raise MisconfigurationError(
                f"fault_tolerance={options!r} must be a mapping with at least replica_groups, e.g. "
                "{'replica_groups': 3, 'min_replicas': 2}; its keys: " + ", ".join(known) + ".")
        for key in options:
            if key not in known:
                raise MisconfigurationError(f"fault_tolerance has no option {key!r}{closest(key, known)}; its "
                                            f"options: {', '.join(known)}.")
        parsed = cls(**options)
        for name in ("replica_groups", "min_replicas"):
            value = getattr(parsed, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MisconfigurationError(f"fault_tolerance {name}={value!r} must be a whole number of at least 1.")
        if parsed.replica_groups < 2:
            raise MisconfigurationError(
                f"fault_tolerance replica_groups={parsed.replica_groups}: live recovery heals a replica group from a "
                "live peer, so it needs at least 2; use plain ddp (with max_restarts) for one group.")
        if parsed.replica_groups < parsed.min_replicas:
            raise MisconfigurationError(
                f"fault_tolerance replica_groups={parsed.replica_groups} is fewer than min_replicas="
                f"{parsed.min_replicas}, so no step could ever commit; raise replica_groups or lower min_replicas.")
        for name in ("timeout", "quorum_timeout"):
            if not isinstance(getattr(parsed, name), (int, float)) or getattr(parsed, name) <= 0:
                raise MisconfigurationError(f"fault_tolerance {name}={getattr(parsed, name)!r} must be a positive "
                                            "number of seconds.")
        return parsed


class FaultTolerantDDPStrategy(DDPStrategy):
    """ddp over replica groups that survive each other's deaths (torchft); see the module docstring."""

    name = "ddp"
    heals_from_peers = True

    def __init__(self, fault_tolerance: Mapping[str, Any], **ddp_options: Any) -> None:
        refused = sorted(key for key in ("comm_hook", "sync_every", "sync_warmup_steps", "time_communication",
                                         "static_graph") if ddp_options.get(key))
        if refused:
            raise MisconfigurationError(
                f"strategy ddp with fault_tolerance cannot take {', '.join(refused)}: its gradients go through "
                "torchft's all-reduce over each step's quorum; drop them.")
        super().__init__(**ddp_options)
        self.ft = FaultTolerance.parse(fault_tolerance)
        require_torchft()
        self.lighthouse_address = check_lighthouse(self.ft.lighthouse) if self.ft.lighthouse else None
        self.replica_groups = self.ft.replica_groups
        self.replica_group = 0
        self.manager: Any = None  # torchft's Manager, built in setup_module
        self._trainer: Any = None
        self._quorum_ready = False  # the next step's quorum was already asked for (the first one, in join_replicas)
        self._healed: dict[str, Any] | None = None  # a live peer's state that the last quorum handed this replica
        self._step_batches: StepBatches | None = None
        self._batch_idx = 0
        self._alone: ClusterEnvironment | None = None  # see detect_environment

    # ------------------------------------------------------------------ checks before any process starts
    @override
    def configure(self, accelerator: str, devices: int, num_nodes: int, precision: str) -> None:
        super().configure(accelerator, devices, num_nodes, precision)
        if devices * num_nodes != 1:
            raise MisconfigurationError(
                f"fault_tolerance runs one process per replica group for now, but devices={devices} and num_nodes="
                f"{num_nodes} ask for {devices * num_nodes}; set devices=1 and num_nodes=1 (replica_groups="
                f"{self.ft.replica_groups} sets how many groups, and processes, the job runs).")

    @override
    def processes_per_node(self) -> int:
        return self.devices * self.ft.replica_groups  # the Trainer's own launch runs every group on this machine

    @override
    def check_config(self, config: TrainerConfig, callbacks: list[Any]) -> None:
        refused = {"accumulate_grad_batches": config.accumulate_grad_batches != 1,
                   "nonfinite_loss='skip'": config.nonfinite_loss == "skip", "launcher='ray'": config.launcher == "ray"}
        for option, given in refused.items():
            if given:
                raise MisconfigurationError(
                    f"strategy ddp with fault_tolerance cannot run with {option}: each step's quorum commits one "
                    "optimizer step on one batch of every replica; leave it at its default.")

    @override
    def check_module(self, module: TrainModule, stage: str) -> None:
        super().check_module(module, stage)
        if stage == "fit" and not module.automatic_optimization:
            raise MisconfigurationError(
                f"strategy ddp with fault_tolerance trains {type(module).__name__} only under automatic optimization "
                "(the strategy retries a step that did not commit); remove `automatic_optimization = False`.")

    # ------------------------------------------------------------------ the world
    @property
    @override
    def is_global_zero(self) -> bool:
        return self.replica_group == 0 and self.global_rank == 0

    @property
    @override
    def decides_for_ranks(self) -> bool:
        return self.global_rank == 0  # every group's first process: each finds the folder and files group 0's does

    @property
    @override
    def data_parallel_size(self) -> int:
        return self.ft.replica_groups * self.world_size  # as planned: learning-rate scaling follows the global batch

    @property
    @override
    def data_parallel_rank(self) -> int:
        return self.replica_group * self.world_size + self.global_rank

    @override
    def detect_environment(self) -> ClusterEnvironment:
        """As ddp detects it; but a process started alone as one replica group (TORCHYARD_REPLICA_GROUP set, with
        no launcher of its own: by hand, or one SLURM job step per group) is a launched group of one process."""
        environment = super().detect_environment()
        if environment.launched or GROUP_VARIABLE not in os.environ:
            return environment
        if self._alone is None:  # asked several times: the same store port each time
            self._alone = ClusterEnvironment(name="replica-group", master_port=find_free_port())
        return self._alone

    @override
    def setup_environment(self, environment: ClusterEnvironment) -> None:
        """Join this group's own process group; learn which group this is and where the lighthouse is."""
        group = os.environ.get(GROUP_VARIABLE, "0")
        if not group.isdigit() or int(group) >= self.ft.replica_groups:
            raise MisconfigurationError(f"{GROUP_VARIABLE}={group!r} must be a replica group number from 0 to "
                                        f"{self.ft.replica_groups - 1} (fault_tolerance replica_groups).")
        self.replica_group = int(group)
        self.lighthouse_address = os.environ.get(LIGHTHOUSE_VARIABLE) or self.lighthouse_address
        if self.lighthouse_address is None:
            raise MisconfigurationError(
                f"fault_tolerance has no lighthouse: give lighthouse='host:port' or set {LIGHTHOUSE_VARIABLE} (under "
                "torchrun, one launch per replica group), or let the Trainer start the groups itself.")
        super().setup_environment(environment)

    # ------------------------------------------------------------------ the model
    @override
    def setup_module(self, module: TrainModule) -> None:
        """The Manager (it joins the lighthouse now: as late as possible, so that peers do not wait on a replica
        still setting up), and the module in DDP, whose gradients are all-reduced over each quorum by the Manager."""
        torchft = require_torchft()
        # torchft warns at every new quorum that it cannot reset NCCL's flight recorder (on CPU too); its errors stay.
        logging.getLogger("torchft.manager").setLevel(logging.ERROR)
        super(DDPStrategy, self).setup_module(module)  # the base's: module on its device, no torch DDP
        environment = self.environment
        loopback = "127.0.0.1" in self.lighthouse_address or "localhost" in self.lighthouse_address
        group_class = torchft.ProcessGroupNCCL if self.backend == "nccl" else torchft.ProcessGroupGloo
        self.manager = torchft.Manager(
            pg=group_class(timeout=timedelta(seconds=self.ft.timeout)), min_replica_size=self.ft.min_replicas,
            load_state_dict=self._receive_state, state_dict=self._send_state,
            replica_id=f"replica_group_{self.replica_group}", lighthouse_addr=self.lighthouse_address,
            store_addr=environment.master_addr, store_port=environment.master_port,
            rank=environment.global_rank, world_size=environment.world_size,
            timeout=timedelta(seconds=self.ft.timeout), quorum_timeout=timedelta(seconds=self.ft.quorum_timeout),
            connect_timeout=timedelta(seconds=self.ft.quorum_timeout),
            # The quorum is settled before the step's batch is drawn: its part of the global batch depends on it.
            use_async_quorum=False, **({"hostname": "127.0.0.1"} if loopback else {}))
        _quiet_checkpoint_server(self.manager)
        if any(p.requires_grad for p in module.parameters()):
            # torchft's DistributedDataParallel, with a hook that survives a failed all-reduce (torchft 0.2's own
            # asserts there, which ended the survivors of a peer that died mid-step): torch's DDP on a one-process
            # stand-in group, whose buckets go through the Manager. find_unused_parameters keeps the buckets as
            # they are built first (a rebuild would order them differently on a replica that heals later).
            from torchft.process_group import ProcessGroupDummy

            self.model = torch.nn.parallel.DistributedDataParallel(
                StepDispatcher(module), process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
            self.model.register_comm_hook(self.manager, all_reduce_over_quorum)

    @override
    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        if len(optimizers) != 1:
            raise MisconfigurationError(
                f"strategy ddp with fault_tolerance commits one optimizer step per quorum, but configure_optimizers "
                f"returned {len(optimizers)} optimizers; return one.")
        return optimizers

    @override
    def join_replicas(self, trainer: Any) -> dict[str, Any] | None:
        """The first step's quorum, asked for before training: a replica behind its peers (restarted, or started
        late) gets a live peer's training state here, which the Trainer restores as it would a checkpoint. Its
        step in torchft's count is the loop's, so that replicas that resumed a checkpoint lead fresh ones."""
        self._trainer = trainer
        progress = trainer.progress
        self.manager.load_state_dict({"step": progress.global_step, "batches_committed": progress.global_step})
        for _ in range(JOIN_ATTEMPTS):
            self.manager.start_quorum()
            if self.manager.errored() is None:
                break  # else the quorum or the heal failed (a peer died in it, or its state did not arrive): again
        else:
            raise RuntimeError(f"replica group {self.replica_group} could not join its peers in {JOIN_ATTEMPTS} "
                               f"quorums: {self.manager.errored()}")
        self._quorum_ready = True
        healed, self._healed = self._healed, None
        if healed is None:
            if self.environment.restart_count and not self.manager.current_step():
                print(f"trainer: replica group {self.replica_group} restarted, but no live peer is ahead of it to heal "
                      "from (were all groups lost?): it trains from the start; fit(ckpt_path='last') resumes a run "
                      "from its last checkpoint instead.", file=sys.stderr, flush=True)
            return None
        step = healed.get("loops", {}).get("progress", {}).get("global_step", "?")
        print(f"trainer: replica group {self.replica_group} healed from a live peer: training state of global step "
              f"{step} (no checkpoint read).", file=sys.stderr, flush=True)
        return healed

    def _send_state(self) -> dict[str, Any]:
        # On torchft's quorum thread of a peer that a recovering replica heals from, while the training thread
        # waits for that quorum at a step boundary (use_async_quorum=False): the run's state stands still.
        return self._trainer.checkpoint_state()

    def _receive_state(self, state: dict[str, Any]) -> None:
        self._healed = state  # applied by join_replicas (the first quorum) or _take_peer_step (a later one)

    # ------------------------------------------------------------------ data
    @override
    def prepare_loader(self, loader: DataLoader, train: bool, seed: int) -> DataLoader:
        """Training: this replica's part of each step's global batch (slices.py). Evaluation: this group's own
        processes split the loader, every group evaluates all of it."""
        pin = True if self.root_device.type == "cuda" else None
        if not train:
            return prepare_loader(loader, train=False, num_replicas=self.world_size, rank=self.global_rank, seed=seed,
                                  pin_memory=pin)
        prepared = prepare_loader(loader, train=True, num_replicas=1, rank=0, seed=seed, pin_memory=pin)
        dealt = replica_loader(prepared, self.ft.replica_groups * self.world_size, self._step_quorum)
        if dealt is None:
            raise MisconfigurationError(
                "strategy ddp with fault_tolerance deals each step's samples over the replicas alive from one seeded "
                "order, so its training loader must be a plain DataLoader with a batch_size (shuffle True or False), "
                "not a custom sampler, batch sampler or IterableDataset.")
        if getattr(loader, "num_workers", 0) and self.is_global_zero:
            print("trainer: fault_tolerance draws training batches in the training process (a replica's part is "
                  "known once its step's quorum is), so the loader's workers are not used.", file=sys.stderr)
        loader, self._step_batches = dealt
        return loader

    def _step_quorum(self) -> tuple[int, int]:
        """At each step's start, before its batch is drawn: this step's quorum, and this replica's place in it."""
        if not self._quorum_ready:
            self.manager.start_quorum()
            if self._healed is not None:  # behind its peers without having noticed: _take_peer_step refuses it
                self._take_peer_step(ahead=0)
        self._quorum_ready = False
        place = self.manager.participating_rank()
        return (0 if place is None else place), max(1, self.manager.num_participants())

    # ------------------------------------------------------------------ the steps
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._batch_idx = batch_idx  # a retried step runs it again
        if not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return super(DDPStrategy, self).training_step(batch, batch_idx)
        with self.precision.autocast():
            return self.model("training_step", batch, batch_idx)

    @override
    def forward_backward(self, batch: Any, batch_idx: int, loss_scale: float,
                         before_backward: Callable[[torch.Tensor], None] | None) -> Any:
        """Each replica's loss (a mean over its part) weighted by its part's share of the global batch: averaged over
        the quorum, the gradient is then the whole global batch's mean one, however unevenly the parts split."""
        weight = self._step_batches.slices.weight if self._step_batches is not None else 1.0
        return super().forward_backward(batch, batch_idx, loss_scale * weight, before_backward)

    @override
    def no_backward_sync(self) -> Any:
        return super(DDPStrategy, self).no_backward_sync()  # no accumulation under fault_tolerance

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer,
                       closure: Callable[[], torch.Tensor] | None = None) -> Any:
        """Apply the step once every participant finished it. Otherwise its gradients are dropped and the same
        global batch is trained again under the next quorum, until a quorum commits it; or, where the peers
        committed it without this replica, this replica takes their state after it (_take_peer_step)."""
        while not self.manager.should_commit():
            if self._retry_step(optimizer):
                return None
        return super().optimizer_step(optimizer, closure)

    def _retry_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """One more try of the step in progress under a new quorum; True where the peers had committed it."""
        optimizer.zero_grad(set_to_none=True)  # torchft: a failed all-reduce may have left them half-summed
        self.manager.start_quorum()
        if self._healed is not None:
            self._take_peer_step(ahead=1)
            self._quorum_ready = True  # the peers' next step's quorum: this replica's next batch is drawn under it
            return True
        assert self._step_batches is not None
        place = self.manager.participating_rank()
        batch = self._step_batches.refetch(0 if place is None else place, max(1, self.manager.num_participants()))
        self.forward_backward(self.batch_to_device(batch), self._batch_idx, 1.0, None)
        config = self._trainer.config
        if config.gradient_clip_val:
            self.clip_gradients(optimizer, float(config.gradient_clip_val), config.gradient_clip_algorithm)
        return False

    def _take_peer_step(self, ahead: int) -> None:
        """The peers committed the step in progress without this replica: take their weights and optimizer state
        after it. The loop then counts the step as this replica's too and steps the schedulers as they did, so the
        optimizer's own hyperparameters (the rate a scheduler sets) stay this replica's, from before the step.

        Only where the peers are exactly `ahead` steps (that one) further: a replica further behind, whose loop
        would train other samples than its peers, ends instead, and its restart heals before it trains."""
        healed, self._healed = self._healed, None
        assert healed is not None and self.module is not None
        theirs, ours = healed["loops"]["progress"]["global_step"], self._trainer.progress.global_step
        if theirs != ours + ahead:
            raise RuntimeError(f"replica group {self.replica_group} is at global step {ours}, its peers at {theirs}: "
                               "it cannot go on beside them mid-epoch and ends, to heal when it is restarted.")
        self.module.load_state_dict(healed["state_dict"])
        for optimizer, state in zip(self._trainer.optimizers, healed["optimizer_states"], strict=True):
            own = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            optimizer.load_state_dict(state)
            for group, settings in zip(optimizer.param_groups, own, strict=True):
                group.update(settings)

    # ------------------------------------------------------------------ the launch of the groups
    def launch_lighthouse(self) -> tuple[Any, str]:
        """For a job the Trainer launches: the lighthouse given, else one served by the launching process (returned
        too, to shut down when the job ends)."""
        if self.lighthouse_address is not None:
            return None, self.lighthouse_address
        server = start_lighthouse(self.ft.min_replicas)  # on 127.0.0.1: the groups run on this machine
        _, port = split_address(server.address())
        return server, check_lighthouse(f"127.0.0.1:{port}")

    def group_variables(self, group: int, lighthouse: str) -> dict[str, str]:
        """The environment variables that make a process one of replica group `group` (see setup_environment); on
        CUDA, each group of the Trainer's own launch sees one GPU of this machine's, in turn."""
        variables = {GROUP_VARIABLE: str(group), LIGHTHOUSE_VARIABLE: lighthouse}
        if self.accelerator == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
            devices = [device for device in visible.split(",") if device.strip()]
            variables["CUDA_VISIBLE_DEVICES"] = devices[group % len(devices)]
        return variables

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        """torchft's Manager (its server, checkpoint server and quorum thread) first, then DDP and the group."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        super().teardown()


def _quiet_checkpoint_server(manager: Any) -> None:
    # torchft serves a replica's state to a healing peer over http.server, whose handler logs every request on
    # stderr ('"GET /checkpoint/0/full HTTP/1.1" 200'): lines in every user's output that say nothing to them.
    # torchft is pinned below 0.3 (pyproject's `ft` extra); where its layout differs, the lines just stay.
    server = getattr(getattr(manager, "_checkpoint_transport", None), "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None:
        handler.log_message = lambda *args: None


def all_reduce_over_quorum(manager, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    # Unannotated: DDP checks a hook's annotations against the real classes, and this module's are strings.
    """DDP's communication hook: the bucket's gradients averaged over this step's quorum (torchft's Manager). Where
    the all-reduce fails (a peer died in it) the Manager has recorded the error, so the step will not commit: the
    bucket is zeroed, and the step is trained again (FaultTolerantDDPStrategy.optimizer_step)."""
    gradients = bucket.buffer()
    if not manager.allreduce(gradients).wait():
        gradients.zero_()
    done = torch.futures.Future()
    done.set_result(gradients)
    return done
