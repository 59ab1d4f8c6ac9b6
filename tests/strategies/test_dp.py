"""strategy="dp": torch.nn.DataParallel on several CUDA devices, one device (with a warning) otherwise."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import build_strategy
from torchyard.trainer.strategies.dp import DataParallelStrategy, ReplicaSteps, _mean_over_replicas

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
             num_sanity_val_steps=0, max_epochs=2, seed=4)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs two or more CUDA devices")


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(32, 6, generator=generator)
    return TensorDataset(x, x[:, :1] - x[:, 1:2])


class Model(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
        self.devices_seen: set[str] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.devices_seen.add(str(x.device))
        return {"loss": F.mse_loss(self.net(x), y), "batch_rows": torch.tensor(float(x.shape[0]), device=x.device)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(strategy: str, **options) -> Model:
    module = Model()
    Trainer(strategy=strategy, **{**QUIET, **options}).fit(module, DataLoader(data(), batch_size=8, shuffle=True))
    return module


def test_without_two_cuda_devices_dp_warns_once_and_trains_like_one_device():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(strategy="dp", devices=2, accelerator="cpu", **QUIET)
    ours = [w for w in caught if "strategy='dp'" in str(w.message)]
    assert len(ours) == 1 and "running on a single device" in str(ours[0].message)
    assert ours[0].filename == __file__  # it points at the user's Trainer(...) line
    assert isinstance(trainer.strategy, DataParallelStrategy) and not trainer.strategy.parallel
    with pytest.warns(UserWarning, match="two or more CUDA devices"):
        dp = fit("dp", devices=2, accelerator="cpu")
    single = fit("single", accelerator="cpu")
    for (name, value), expected in zip(dp.state_dict().items(), single.state_dict().values()):
        assert torch.equal(value, expected), name


def test_replica_outputs_gather_as_vectors_and_average_like_lightning():
    class Scalars(TrainModule):
        def training_step(self, batch, batch_idx):
            return {"loss": batch.sum(), "count": torch.tensor(3)}

    step = ReplicaSteps(Scalars())("training_step", torch.ones(2), 0)
    assert step["loss"].shape == (1,) and step["count"].shape == (1,)
    gathered = {"loss": torch.tensor([1.0, 3.0]), "count": torch.tensor([3, 3]), "note": "kept"}
    reduced = _mean_over_replicas(gathered)
    assert reduced["loss"].item() == 2.0 and reduced["loss"].dim() == 0
    assert reduced["count"] is gathered["count"] and reduced["note"] == "kept"  # only floating tensors average


def test_dp_is_one_node_only():
    with pytest.raises(MisconfigurationError, match="num_nodes=2; use strategy='ddp'"):
        build_strategy("dp").configure("cpu", devices=1, num_nodes=2, precision="32")


@two_gpus
def test_dp_splits_each_batch_over_two_gpus_and_matches_one_device():
    dp = fit("dp", devices=2, accelerator="cuda")
    assert dp.devices_seen == {"cuda:0", "cuda:1"}
    single = fit("single", devices=1, accelerator="cuda")
    # The mean of two half-batch mean losses is the full-batch mean loss (8 rows split 4 + 4).
    for (name, value), expected in zip(dp.state_dict().items(), single.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-5, msg=name)


@two_gpus
def test_dp_refuses_more_devices_than_the_machine_has():
    with pytest.raises(MisconfigurationError, match="CUDA devices; use devices<="):
        Trainer(strategy="dp", devices=torch.cuda.device_count() + 1, accelerator="cuda")
