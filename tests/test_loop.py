"""The fit loop against a hand-written PyTorch loop: same seed, same batches, bitwise-identical weights.

On one process the Trainer keeps a loader's own sampler, which draws its shuffle from the global RNG as each
epoch starts, as in a plain loop: every reference loop here seeds as Trainer(seed=...) does and iterates the
same kind of DataLoader(shuffle=True). Losses are scaled by 1/accumulate_grad_batches with a multiplication, as
the loop does, because `loss / 3` and `loss * (1 / 3)` round differently.
"""

from __future__ import annotations

import copy
import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from torchyard.callbacks import Callback, ModelSummary
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster.environment import ClusterEnvironment
from torchyard.trainer.data.loaders import (
    data_wait_advice,
    measure_data_wait,
    prepare_loader,
    samples_in_batches,
    worker_oversubscription,
)
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.evaluation.predictions import merge_prediction_shares
from torchyard.trainer.strategies.single import SingleDeviceStrategy

SEED = 7
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
             logger=False, accelerator="cpu", num_sanity_val_steps=0)


def regression_data(samples: int = 44, features: int = 6) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    y = x @ torch.randn(features, 1, generator=generator) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, y)


def make_optimizer(params, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class Regressor(TrainModule):
    def __init__(self, optimizer: str = "sgd", lr: float = 0.05, scheduler_interval: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        optimizer = make_optimizer(self.parameters(), self.hparams.optimizer, self.hparams.lr)
        if self.hparams.scheduler_interval is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.hparams.scheduler_interval},
        }


def reference_fit(model: Regressor, dataset: TensorDataset, *, batch_size: int, epochs: int, accumulate: int = 1,
                  clip: tuple[float, str] | None = None, autocast: bool = False) -> list[torch.Tensor]:
    """The hand-written loop; returns the loss of every micro-batch."""
    torch.manual_seed(SEED)  # what Trainer(seed=SEED) does at the start of fit
    optimizer = make_optimizer(model.parameters(), model.hparams.optimizer, model.hparams.lr)
    interval = model.hparams.scheduler_interval
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) if interval else None
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    losses = []
    for _ in range(epochs):
        for batch_idx, (x, y) in enumerate(loader):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.mse_loss(model(x), y)
            losses.append(loss.detach())
            (loss * (1.0 / accumulate) if accumulate != 1 else loss).backward()
            if (batch_idx + 1) % accumulate == 0 or batch_idx + 1 == len(loader):
                if clip is not None and clip[1] == "norm":
                    torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip[0])
                elif clip is not None:
                    torch.nn.utils.clip_grad_value_(list(model.parameters()), clip[0])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if interval == "step":
                    scheduler.step()
        if interval == "epoch":
            scheduler.step()
    return losses


def trainer_fit(module: Regressor, dataset: TensorDataset, batch_size: int, **options) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    step = module.training_step

    def recording_step(batch, batch_idx):
        loss = step(batch, batch_idx)
        losses.append(loss.detach())
        return loss

    module.training_step = recording_step
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    Trainer(seed=SEED, **QUIET, **options).fit(module, loader)
    return losses


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), f"{key} differs from the hand-written loop"


def fresh_pair(**hparams) -> tuple[Regressor, Regressor]:
    torch.manual_seed(123)
    module = Regressor(**hparams)
    return module, copy.deepcopy(module)


@pytest.mark.parametrize(
    ("hparams", "options", "reference"),
    [
        pytest.param({}, {"max_epochs": 3}, {"epochs": 3}, id="sgd"),
        pytest.param({"optimizer": "adam", "lr": 0.01}, {"max_epochs": 2}, {"epochs": 2}, id="adam"),
        # 6 batches per epoch, accumulate 4: one full step and a tail step of 2 micro-batches per epoch.
        pytest.param(
            {}, {"max_epochs": 2, "accumulate_grad_batches": 4}, {"epochs": 2, "accumulate": 4}, id="accumulate-tail"
        ),
        pytest.param(
            {}, {"max_epochs": 2, "accumulate_grad_batches": 3}, {"epochs": 2, "accumulate": 3}, id="accumulate-3"
        ),
        pytest.param(
            {}, {"max_epochs": 2, "gradient_clip_val": 0.05}, {"epochs": 2, "clip": (0.05, "norm")}, id="clip-norm"
        ),
        pytest.param(
            {},
            {"max_epochs": 2, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
            {"epochs": 2, "clip": (0.01, "value")},
            id="clip-value",
        ),
        pytest.param({"scheduler_interval": "step"}, {"max_epochs": 2}, {"epochs": 2}, id="scheduler-step"),
        pytest.param({"scheduler_interval": "epoch"}, {"max_epochs": 3}, {"epochs": 3}, id="scheduler-epoch"),
        pytest.param(
            {"optimizer": "adam", "lr": 0.01},
            {"max_epochs": 2, "precision": "bf16-mixed"},
            {"epochs": 2, "autocast": True},
            id="bf16-mixed",
        ),
    ],
)
def test_fit_matches_hand_written_loop(hparams, options, reference):
    dataset = regression_data()
    module, expected = fresh_pair(**hparams)
    losses = trainer_fit(module, dataset, batch_size=8, **options)
    expected_losses = reference_fit(expected, dataset, batch_size=8, **reference)
    assert len(losses) == len(expected_losses) == 6 * reference["epochs"]
    assert torch.equal(torch.stack(losses), torch.stack(expected_losses))
    assert_same_weights(module, expected)
    assert module.trainer.global_step == expected_global_steps(reference)


def expected_global_steps(reference: dict) -> int:
    accumulate = reference.get("accumulate", 1)
    return reference["epochs"] * -(-6 // accumulate)


def test_bf16_reference_differs_from_fp32():
    """Guards the bf16 case above: if autocast did nothing, matching the autocast reference would be luck."""
    dataset = regression_data()
    _, bf16 = fresh_pair()
    _, fp32 = fresh_pair()
    reference_fit(bf16, dataset, batch_size=8, epochs=1, autocast=True)
    reference_fit(fp32, dataset, batch_size=8, epochs=1)
    assert not torch.equal(bf16.net[0].weight, fp32.net[0].weight)


class ManualRegressor(Regressor):
    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def on_train_epoch_end(self):
        self.lr_schedulers().step()  # manual optimization: the user steps schedulers, the loop never does


def test_manual_optimization_matches_hand_written_loop():
    dataset = regression_data()
    torch.manual_seed(123)
    module = ManualRegressor(scheduler_interval="epoch")
    expected = copy.deepcopy(module)
    trainer_fit(module, dataset, batch_size=8, max_epochs=3)
    reference_fit(expected, dataset, batch_size=8, epochs=3)
    assert_same_weights(module, expected)
    assert module.trainer.global_step == 18
    # StepLR(step_size=2) stepped once per epoch by the user only: 3 steps -> lr * 0.5.
    assert module.optimizers().param_groups[0]["lr"] == pytest.approx(0.05 * 0.5)


class Stream(IterableDataset):
    """A dataset without a length: the loop only learns that a batch was the epoch's last by looking ahead."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)


def test_iterable_dataset_steps_on_the_tail_like_a_hand_written_loop():
    dataset = regression_data()
    module, expected = fresh_pair()
    Trainer(seed=SEED, max_epochs=2, accumulate_grad_batches=4, **QUIET).fit(
        module, DataLoader(Stream(dataset), batch_size=8)
    )

    optimizer = make_optimizer(expected.parameters(), "sgd", 0.05)
    for _ in range(2):
        batches = list(DataLoader(dataset, batch_size=8))
        for batch_idx, (x, y) in enumerate(batches):
            (F.mse_loss(expected(x), y) * 0.25).backward()
            if (batch_idx + 1) % 4 == 0 or batch_idx + 1 == len(batches):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert_same_weights(module, expected)
    assert module.trainer.global_step == 4 and module.trainer.current_epoch == 2


def test_lr_scaling_with_warmup_matches_hand_written_loop():
    """lr_scaling='linear' scales by data-parallel size * accumulate_grad_batches (here 1 * 2), reached by warm-up."""
    dataset = regression_data(samples=32)  # 4 batches: 2 steps per epoch
    module, expected = fresh_pair(lr=0.03)
    Trainer(seed=SEED, max_epochs=3, accumulate_grad_batches=2, lr_scaling="linear", lr_warmup_steps=3,
            **QUIET).fit(module, DataLoader(dataset, batch_size=8, shuffle=True))

    optimizer = make_optimizer(expected.parameters(), "sgd", 0.03)
    optimizer.param_groups[0]["lr"] *= 2.0
    torch.manual_seed(SEED)
    loader = DataLoader(dataset, batch_size=8, shuffle=True)
    step = 0
    for _ in range(3):
        for batch_idx, (x, y) in enumerate(loader):
            (F.mse_loss(expected(x), y) * 0.5).backward()
            if batch_idx % 2 == 1:
                scaled = optimizer.param_groups[0]["lr"]
                if step < 3:
                    optimizer.param_groups[0]["lr"] = scaled * ((1.0 + step / 3) / 2.0)
                optimizer.step()
                optimizer.param_groups[0]["lr"] = scaled
                optimizer.zero_grad(set_to_none=True)
                step += 1
    assert_same_weights(module, expected)
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == 0.03 * 2.0  # exactly: no drift from warm-up


class LearningRates(Callback):
    """The first group's rate at each optimizer step."""

    def __init__(self):
        self.seen = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.seen.append(optimizer.param_groups[0]["lr"])


def rates_seen_with_doubled_rates(module: TrainModule) -> list[float]:
    """The rates of 3 epochs of 2 steps under lr_scaling='linear' with accumulate_grad_batches=2 (a scale of 2)."""
    rates = LearningRates()
    Trainer(seed=SEED, max_epochs=3, accumulate_grad_batches=2, lr_scaling="linear", callbacks=[rates],
            **QUIET).fit(module, DataLoader(regression_data(samples=32), batch_size=8))
    return rates.seen


@pytest.mark.parametrize("schedule", ["one_cycle", "cyclic", "cosine_then_step"])
def test_lr_scaling_scales_every_rate_a_schedule_is_built_from(schedule):
    """OneCycleLR reads its groups' max_lr/min_lr, CyclicLR its max_lrs, cosine annealing its eta_min: the
    scaled schedule equals the same schedule built with doubled rates (accumulate 2: a scale of 2)."""

    def build(optimizer, scale):
        if schedule == "one_cycle":
            return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1 * scale, total_steps=6)
        if schedule == "cyclic":
            return torch.optim.lr_scheduler.CyclicLR(
                optimizer, base_lr=0.01 * scale, max_lr=0.1 * scale, step_size_up=2
            )
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3, eta_min=0.01 * scale)
        step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [cosine, step], milestones=[3])

    class Scheduled(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": build(optimizer, 1.0), "interval": "step"}}

    torch.manual_seed(123)
    seen = rates_seen_with_doubled_rates(Scheduled())
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler, expected = build(optimizer, 2.0), []
    for _ in range(6):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(expected, rel=1e-12)


class TimmLikeCosine:
    """A scheduler as timm writes them: rates read from the groups at construction into `base_values`, set by
    `step_update(num_updates)`, which the module's lr_scheduler_step calls (Lightning's recipe for timm)."""

    def __init__(self, optimizer, total):
        self.optimizer, self.total = optimizer, total
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_values = [group["initial_lr"] for group in optimizer.param_groups]

    def step_update(self, num_updates):
        for group, base in zip(self.optimizer.param_groups, self.base_values):
            group["lr"] = base * 0.5 * (1 + math.cos(math.pi * num_updates / self.total))

    def step(self, epoch=None):
        pass

    def state_dict(self):
        return {"base_values": self.base_values}

    def load_state_dict(self, state):
        self.base_values = state["base_values"]


def test_lr_scaling_scales_a_timm_schedulers_base_values_and_warns_for_a_scheduler_it_cannot_scale():
    class Scheduled(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": TimmLikeCosine(optimizer, 6), "interval": "step"},
            }

        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step_update(self.global_step)

    seen = rates_seen_with_doubled_rates(Scheduled())
    expected = [0.1] + [0.1 * 0.5 * (1 + math.cos(math.pi * step / 6)) for step in range(1, 6)]
    assert seen == pytest.approx(expected, rel=1e-12)

    class Opaque(TimmLikeCosine):
        def __init__(self, optimizer, total):
            super().__init__(optimizer, total)
            self.rates = self.__dict__.pop("base_values")

    class Unscalable(Scheduled):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": Opaque(optimizer, 6), "interval": "step"}}

        def lr_scheduler_step(self, scheduler, metric):
            pass

    with pytest.warns(UserWarning, match=r"multiplied the optimizers' learning rates by 2, but Opaque keeps the rates"):
        Trainer(seed=SEED, max_epochs=1, accumulate_grad_batches=2, lr_scaling="linear",
                **QUIET).fit(Unscalable(), DataLoader(regression_data(samples=32), batch_size=8))


@pytest.mark.parametrize(
    ("batch_size", "drop_last", "start", "end", "expected"),
    [(4, False, 0, 3, 10), (4, False, 1, 3, 6), (4, False, 2, 3, 2), (4, True, 0, 2, 8), (3, False, 0, 2, 6)],
)
def test_samples_in_batches_counts_the_short_last_batch(batch_size, drop_last, start, end, expected):
    loader = prepare_loader(DataLoader(regression_data(10), batch_size=batch_size, shuffle=True, drop_last=drop_last),
                            train=True)
    assert samples_in_batches(loader, start, end) == expected
    assert expected == sum(len(batch[0]) for batch in itertools.islice(loader, start, end))


def test_a_custom_training_sampler_is_dealt_into_equal_shards_and_evaluation_into_exact_ones():
    """A rank with one batch more would run a gradient all-reduce the others never join: training shards of a
    user's own sampler (or batch sampler) are padded with its first indices, as DistributedSampler pads."""
    data, order = regression_data(samples=65), list(range(64, -1, -1))  # any sampler that is not torch's own two
    shards = [[index for batch in prepare_loader(DataLoader(data, batch_size=8, sampler=order), train=True,
                                                 num_replicas=2, rank=rank).batch_sampler for index in batch]
              for rank in (0, 1)]
    assert shards[0] == order[0::2] and shards[1] == order[1::2] + [order[0]]
    batches = [list(prepare_loader(DataLoader(data, batch_sampler=[[0], [1, 2], [3]]), train=True, num_replicas=2,
                                   rank=rank).batch_sampler) for rank in (0, 1)]
    assert batches == [[[0], [3]], [[1, 2], [0]]]
    evaluated = [len(prepare_loader(DataLoader(data, batch_size=8, sampler=order), train=False, num_replicas=2,
                                    rank=rank).batch_sampler.sampler) for rank in (0, 1)]
    assert evaluated == [33, 32]  # every sample once


def test_an_evaluation_slice_without_batches_is_refused_on_every_rank_alike():
    """One validation sample for two processes: rank 1 would never join rank 0's end-of-epoch reduction."""
    from torchyard.trainer.evaluation.predictions import check_every_rank_evaluates

    for rank in (0, 1):
        loader = prepare_loader(DataLoader(regression_data(1), batch_size=4), train=False, num_replicas=2, rank=rank)
        with pytest.raises(MisconfigurationError, match=r"the validation dataloader gives 2 data-parallel processes 1 "
                                                        r"batch\(es\) in all, so rank\(s\) 1 would get none"):
            check_every_rank_evaluates(loader, 1.0, "validation", None)
    for samples, limit in ((2, 1.0), (9, 1), (9, 0)):  # a batch each; or none anywhere (limit 0): nothing waits
        loader = prepare_loader(DataLoader(regression_data(samples), batch_size=4), train=False, num_replicas=2, rank=1)
        check_every_rank_evaluates(loader, limit, "validation", None)


def test_samples_in_batches_is_unknown_for_a_custom_batch_sampler():
    loader = DataLoader(regression_data(10), batch_sampler=[[0, 1], [2, 3, 4]])
    assert samples_in_batches(loader, 0, 2) is None


# --------------------------------------------------------------------------- predictions of data-parallel ranks


def rank_predictions(loader: DataLoader, replicas: int, predict, limit: int | None = None) -> list[list]:
    """What each of `replicas` ranks predicts from its slice of `loader` (the slicing predict uses)."""
    shares = []
    for rank in range(replicas):
        sliced = prepare_loader(loader, train=False, num_replicas=replicas, rank=rank)
        shares.append([predict(batch) for batch in itertools.islice(sliced, limit)])
    return shares


def merged(loader: DataLoader, replicas: int, predict, limit: int | None = None) -> list:
    sliced = prepare_loader(loader, train=False, num_replicas=replicas, rank=0)
    return merge_prediction_shares(rank_predictions(loader, replicas, predict, limit), sliced)


def with_inputs(batch):
    x, y = batch
    return {"x": x, "pair": (2 * x, y)}


@pytest.mark.parametrize(("samples", "batch_size", "replicas"), [(23, 4, 2), (23, 4, 3), (8, 4, 2), (2, 4, 3)])
def test_data_parallel_predictions_come_back_in_dataset_order_and_batch_size(samples, batch_size, replicas):
    data = regression_data(samples)
    loader = DataLoader(data, batch_size=batch_size)
    expected = [with_inputs(batch) for batch in loader]
    actual = merged(loader, replicas, with_inputs)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.keys() == want.keys()
        assert torch.equal(got["x"], want["x"]) and torch.equal(got["pair"][0], want["pair"][0])
        assert torch.equal(got["pair"][1], want["pair"][1])


def test_predictions_follow_the_loaders_own_sampler_and_a_batch_limit():
    data = regression_data(30)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(1)).tolist()
    loader = DataLoader(data, batch_size=4, sampler=order)
    actual = merged(loader, 2, lambda batch: batch[0], limit=2)  # each rank: 2 batches, 8 of its samples
    assert torch.equal(torch.cat(actual), data.tensors[0][order[:16]])
    assert [len(batch) for batch in actual] == [4, 4, 4, 4]


def test_whole_batches_dealt_by_a_custom_batch_sampler_are_interleaved_back():
    data = regression_data(10)
    loader = DataLoader(data, batch_sampler=[[0, 1], [2, 3, 4], [5], [6, 7, 8, 9], [3]])
    actual = merged(loader, 2, lambda batch: batch[0])
    assert [torch.equal(got, data.tensors[0][indices]) for got, indices in zip(actual, loader.batch_sampler)] == [
        True
    ] * 5


def test_predictions_without_one_row_per_sample_come_batch_by_batch_with_a_warning():
    loader = DataLoader(regression_data(10), batch_size=3)
    with pytest.warns(UserWarning, match="cannot be put back in dataset order"):
        actual = merged(loader, 2, lambda batch: float(batch[0].sum()))
    shares = rank_predictions(loader, 2, lambda batch: float(batch[0].sum()))
    assert actual == [shares[0][0], shares[1][0], shares[0][1], shares[1][1]]
    with pytest.warns(UserWarning, match="one row per sample"):  # a per-batch summary, not per-sample rows
        merged(loader, 2, lambda batch: batch[0].sum(0))


# --------------------------------------------------------------------------- loader workers


def paced(items: int, fetch_s: float = 0.0, first_s: float = 0.0):
    for index in range(items):
        time.sleep(first_s if index == 0 else fetch_s)
        yield index


def consume(batches, step_s: float = 0.0) -> list:
    taken = []
    for batch in batches:
        taken.append(batch)
        time.sleep(step_s)
    return taken


def test_measured_data_wait_is_the_share_of_time_spent_fetching_after_the_first_batch():
    reports = []
    assert consume(measure_data_wait(paced(12, fetch_s=0.01), lambda *r: reports.append(r), window=5)) == list(
        range(12)
    )
    [(share, wait)] = reports
    assert share > 0.8 and 0.009 < wait < 0.05
    reports.clear()
    consume(measure_data_wait(paced(12, first_s=0.2), lambda *r: reports.append(r), window=5), step_s=0.01)
    [(share, wait)] = reports  # the slow first batch (workers starting) is not counted
    assert share < 0.2 and wait < 0.002


def test_data_wait_advice_asks_for_the_workers_a_gpu_process_can_use(monkeypatch):
    monkeypatch.setattr("torchyard.trainer.data.loaders.usable_cores", lambda: 8)
    advice = data_wait_advice(0.6, 0.01, num_workers=0, local_processes=2, device_type="cuda")
    assert advice is not None and "60% of the time" in advice and "num_workers=0; num_workers=4 would" in advice
    assert data_wait_advice(0.6, 0.01, num_workers=4, local_processes=2, device_type="cuda") is None  # has them
    assert data_wait_advice(0.1, 0.01, num_workers=0, local_processes=2, device_type="cuda") is None  # not data-bound
    assert data_wait_advice(0.6, 0.0001, num_workers=0, local_processes=1, device_type="cuda") is None  # too cheap
    assert data_wait_advice(0.9, 0.01, num_workers=0, local_processes=1, device_type="cpu") is None  # no idle cores


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # torch, about the real cores
def test_loader_workers_of_all_processes_on_a_node_are_counted_against_its_cores(monkeypatch):
    monkeypatch.setattr("torchyard.trainer.data.loaders.usable_cores", lambda: 4)
    loader = DataLoader(regression_data(8), num_workers=3)
    warning = worker_oversubscription(loader, "training", local_processes=2)
    assert warning == (
        "the training dataloader's num_workers=3 on each of 2 process(es) on this node starts 6 loader "
        "processes for 4 CPU core(s), which then take turns with training; num_workers=2 fits this machine."
    )
    assert worker_oversubscription(DataLoader(regression_data(8), num_workers=2), "training", 2) is None
    # More than the cores in one process: torch's DataLoader already says so.
    assert worker_oversubscription(DataLoader(regression_data(8), num_workers=5), "training", 2) is None


def test_fit_warns_about_workers_that_the_nodes_processes_start_together(monkeypatch, tmp_path):
    monkeypatch.setattr("torchyard.trainer.data.loaders.usable_cores", lambda: 2)
    monkeypatch.setattr(
        SingleDeviceStrategy, "detect_environment", lambda self: ClusterEnvironment("local", local_world_size=2)
    )
    trainer = Trainer(max_epochs=1, limit_train_batches=2, default_root_dir=str(tmp_path), **QUIET)
    with pytest.warns(UserWarning, match="num_workers=2 on each of 2 process.*num_workers=1 fits"):
        trainer.fit(Regressor(), DataLoader(regression_data(16), batch_size=4, num_workers=2))


class SlowSamples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        time.sleep(0.002)
        return torch.ones(6), torch.ones(1)


def test_the_run_summary_says_how_long_training_waited_for_data(tmp_path):
    summary = ModelSummary()
    trainer = Trainer(max_epochs=2, callbacks=[summary], default_root_dir=str(tmp_path),
                      **{**QUIET, "enable_model_summary": True})
    trainer.fit(Regressor(), DataLoader(SlowSamples(), batch_size=2))
    share, wait = trainer.data_wait
    assert share > 0.5 and wait >= 0.004  # two samples of 2 ms, on a step of microseconds
    assert (
        summary.run_summary["waiting for data"]
        == f"{share:.0%} of the time, {wait * 1e3:.2f} ms a batch (first batches)"
    )


def test_a_training_step_returning_none_skips_its_batch_as_in_lightning():
    class Skipping(Regressor):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    torch.manual_seed(123)
    module = Skipping()
    expected = copy.deepcopy(module)
    dataset = regression_data(samples=40)
    trainer = Trainer(seed=SEED, max_epochs=2, **QUIET)
    trainer.fit(module, DataLoader(dataset, batch_size=8))
    optimizer = make_optimizer(expected.parameters(), "sgd", 0.05)
    for _ in range(2):
        for batch_idx, (x, y) in enumerate(DataLoader(dataset, batch_size=8)):
            if batch_idx % 2 == 0:
                F.mse_loss(expected(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    assert_same_weights(module, expected)
    assert trainer.global_step == 6  # batches 0, 2 and 4 of each epoch stepped


class DropoutClassifier(TrainModule):
    """An MLP with dropout (its masks draw from the global RNG between the loader's shuffles), logging as most do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_defaults_with_a_shuffled_loader_train_the_weights_of_a_plain_loop_bitwise(tmp_path):
    """One process, every default on (bar, summary, checkpoints, CSV logs): the loader keeps its own shuffle, drawn
    from the global RNG as each epoch starts, so the order and the dropout masks are a plain loop's."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(100, 8, generator=generator), torch.randint(0, 3, (100,), generator=generator))
    torch.manual_seed(1)
    expected = DropoutClassifier()
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data, batch_size=16, shuffle=True)
    for _ in range(3):
        expected.train()
        for x, y in loader:
            F.cross_entropy(expected(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    module = DropoutClassifier()
    Trainer(max_epochs=3, default_root_dir=str(tmp_path), accelerator="cpu").fit(
        module, DataLoader(data, batch_size=16, shuffle=True))
    assert_same_weights(module, expected)
