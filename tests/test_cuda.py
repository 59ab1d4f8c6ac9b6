"""The CUDA paths on one GPU: device placement, pinned loaders, mixed precision, nccl, and checkpoints that
cross between GPU and CPU. Every test is skipped on a machine without CUDA (CI's); they ran on an H100.

Each compares with a hand-written loop on the same GPU, same seed and same batches (the loader's own shuffle, drawn
from the global RNG as each epoch starts, as in test_loop.py).
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import ModelCheckpoint
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.errors import MisconfigurationError, NonFiniteLossError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SEED = 3
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, num_sanity_val_steps=0, seed=SEED)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 12, generator=generator)
    return TensorDataset(x, x @ torch.randn(12, 1, generator=generator))


class Net(TrainModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))
        self.batch_devices: set[str] = set()

    def on_train_batch_start(self, batch, batch_idx):
        self.batch_devices.add(str(batch[0].device))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def reference(epochs: int, precision: str = "32") -> nn.Module:
    """A hand-written loop on cuda:0 with the Trainer's batch order, autocast and grad scaler."""
    model = Net().net.cuda()
    torch.manual_seed(SEED)  # as Trainer(seed=SEED) does when fit starts, before the loader draws its shuffle
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    loader = DataLoader(data(), batch_size=16, shuffle=True)  # the shuffle draws from the global RNG, as the Trainer's
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.cuda(), y.cuda()
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.mse_loss(model(x), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad(set_to_none=True)
    return model


def assert_close(module: nn.Module, expected: nn.Module, tolerance: float = 0.0) -> None:
    for (name, actual), wanted in zip(module.state_dict().items(), expected.state_dict().values()):
        assert actual.device == wanted.device, name
        torch.testing.assert_close(actual, wanted, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_fit_on_cuda_matches_a_hand_written_loop_on_the_same_gpu(precision, tmp_path):
    module = Net()
    trainer = Trainer(accelerator="cuda", precision=precision, max_epochs=2, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(module, DataLoader(data(), batch_size=16, shuffle=True))
    assert module.batch_devices == {"cuda:0"}
    assert next(module.parameters()).dtype == torch.float32  # mixed precision keeps fp32 master weights
    assert_close(module.net, reference(2, precision))


def test_batch_transfer_hooks_see_the_batch_on_the_host_then_on_the_gpu(tmp_path):
    class Augmented(Net):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            assert batch[0].device.type == "cpu"
            return batch

        def on_after_batch_transfer(self, batch, dataloader_idx):
            x, y = batch
            assert x.is_cuda
            return x * 1.0, y  # where an augmentation on the GPU would go

    module = Augmented()
    Trainer(accelerator="cuda", max_epochs=2, default_root_dir=str(tmp_path), **QUIET).fit(
        module, DataLoader(data(), batch_size=16, shuffle=True))
    assert module.batch_devices == {"cuda:0"}
    assert_close(module.net, reference(2))


def test_training_loaders_are_pinned_on_cuda(tmp_path):
    module = Net()
    trainer = Trainer(accelerator="cuda", max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    loader = DataLoader(data(), batch_size=16, shuffle=True)
    assert not loader.pin_memory
    trainer.fit(module, loader)
    prepared = trainer.strategy.prepare_loader(loader, train=True, seed=SEED)
    assert prepared.pin_memory
    assert next(iter(prepared))[0].is_pinned()


def test_a_cuda_checkpoint_loads_on_cpu_and_resumes_there(tmp_path):
    module = Net()
    trainer = Trainer(accelerator="cuda", max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(module, DataLoader(data(), batch_size=16, shuffle=True))
    path = tmp_path / "gpu.ckpt"
    trainer.save_checkpoint(path)
    assert load_checkpoint_file(path, map_location="cuda")["state_dict"]["net.0.weight"].is_cuda

    on_cpu = Net.load_from_checkpoint(path)  # map_location="cpu" by default
    assert_close(on_cpu.net, module.net.cpu())
    resumed = Net()
    Trainer(accelerator="cpu", max_epochs=2, default_root_dir=str(tmp_path / "cpu"), **QUIET).fit(
        resumed, DataLoader(data(), batch_size=16, shuffle=True), ckpt_path=path)
    assert resumed.trainer.global_step == 12 and next(resumed.parameters()).device.type == "cpu"
    assert_close(resumed.net.cuda(), reference(2), tolerance=1e-5)  # CPU and GPU kernels round differently


def test_ddp_with_nccl_on_one_gpu_trains_like_one_device(tmp_path):
    module = Net()
    trainer = Trainer(
        strategy="ddp", devices=1, accelerator="cuda", max_epochs=2, default_root_dir=str(tmp_path), **QUIET
    )
    trainer.fit(module, DataLoader(data(), batch_size=16, shuffle=True))
    assert trainer.strategy.backend == "nccl"
    assert module.batch_devices == {"cuda:0"}
    assert_close(module.net, reference(2))


def test_ddp_asking_for_more_gpus_than_the_machine_has_is_refused_before_starting():
    with pytest.raises(MisconfigurationError, match=rf"devices={torch.cuda.device_count() + 1} but this machine has"):
        Trainer(strategy="ddp", devices=torch.cuda.device_count() + 1, accelerator="cuda")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the one-GPU fallback")
def test_dp_on_one_gpu_warns_and_trains_on_it(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            strategy="dp", devices=2, accelerator="cuda", max_epochs=2, default_root_dir=str(tmp_path), **QUIET
        )
    assert sum("strategy='dp'" in str(w.message) for w in caught) == 1
    module = Net()
    trainer.fit(module, DataLoader(data(), batch_size=16, shuffle=True))
    assert module.batch_devices == {"cuda:0"}
    assert_close(module.net, reference(2))


class SlowSamples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.samples = data()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        time.sleep(0.002)
        return self.samples[index]


def test_a_gpu_run_that_waits_for_data_is_told_how_many_loader_workers_to_use(tmp_path):
    trainer = Trainer(max_epochs=1, accelerator="cuda", default_root_dir=str(tmp_path), **QUIET)
    with pytest.warns(UserWarning, match=r"training waited for its dataloader \d+% of the time .* with num_workers=0; "
                                         r"num_workers=\d+ would load batches while the GPU steps"):
        trainer.fit(Net(lr=0.005), DataLoader(SlowSamples(), batch_size=4))  # lr=0.05 diverges on batches of 4


# --------------------------------------------------------------------------- the non-finite loss check on a GPU


class BadLossNet(Net):
    """Net whose loss is NaN at the batches in `bad`; `as_dict` returns {'loss': ...}, which the loss check reads
    through its general branch rather than its shortcut for a lone loss tensor."""

    def __init__(self, bad: set[int], as_dict: bool = False) -> None:
        super().__init__()
        self.bad, self.as_dict = bad, as_dict

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx in self.bad:
            loss = loss * float("nan")
        return {"loss": loss} if self.as_dict else loss


@pytest.mark.parametrize("as_dict", [False, True])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_nan_loss_on_the_gpu_stops_the_fit_naming_its_step_and_no_checkpoint_holds_it(as_dict, accumulate,
                                                                                         tmp_path):
    module = BadLossNet({2}, as_dict)
    checkpoints = ModelCheckpoint(every_n_train_steps=1, save_last=True, save_top_k=0)
    trainer = Trainer(accelerator="cuda", max_epochs=1, accumulate_grad_batches=accumulate, callbacks=[checkpoints],
                      default_root_dir=str(tmp_path), **QUIET)
    steps = 2 // accumulate
    with pytest.raises(NonFiniteLossError,
                       match=rf"the training loss was nan at global step {steps} \(epoch 0, batch 2\)"):
        trainer.fit(module, DataLoader(data(), batch_size=16, shuffle=True))
    # Read at the latest as the checkpoint after its step was built, which was then not written.
    last = load_checkpoint_file(checkpoints.last_model_path)
    assert last["global_step"] == steps
    assert all(bool(torch.isfinite(value).all()) for value in last["state_dict"].values())


class SleepyNet(Net):
    """Net whose steps queue 50 ms or so of GPU work before their loss; notes, as each step begins, whether the
    previous one's GPU work was done (the host then waited for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: torch.cuda.Event | None = None
        self.previous_done: list[bool] = []

    def training_step(self, batch, batch_idx):
        if self.queued is not None:
            self.previous_done.append(self.queued.query())
        torch.cuda._sleep(100_000_000)  # GPU clock cycles
        loss = super().training_step(batch, batch_idx)
        self.queued = torch.cuda.Event()
        self.queued.record()
        return loss


@pytest.mark.parametrize(("nonfinite_loss", "waits"), [("error", False), ("skip", True)])
def test_the_loss_check_lets_the_host_run_ahead_of_the_gpu_unless_it_must_decide_each_step(nonfinite_loss, waits,
                                                                                             tmp_path):
    module = SleepyNet()
    trainer = Trainer(accelerator="cuda", max_epochs=1, nonfinite_loss=nonfinite_loss, enable_checkpointing=False,
                      default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(module, DataLoader(data(), batch_size=16))
    # Past the first steps' one-off set-up (loading kernels; a first read of the losses if it took 0.5 s).
    assert module.previous_done[2:] == [waits] * 3


def test_nonfinite_loss_skip_on_the_gpu_skips_the_step_of_the_bad_batch_only(tmp_path):
    module = BadLossNet({1, 4})
    trainer = Trainer(accelerator="cuda", max_epochs=1, nonfinite_loss="skip", default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(module, DataLoader(data(), batch_size=16))
    assert trainer.global_step == 4 and trainer.callback_metrics["train/skipped_nonfinite"] == 2
    # The same loop by hand, stepping on batches 0, 2, 3 and 5 only.
    model, (x, y) = Net().net.cuda(), data().tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for start in (0, 32, 48, 80):
        F.mse_loss(model(x[start:start + 16].cuda()), y[start:start + 16].cuda()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_close(module.net, model)
