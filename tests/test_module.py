"""TrainModule's own surface: hparams, what configure_optimizers may return, manual optimization helpers."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import DataModule, Trainer, TrainModule
from torchyard.trainer.errors import MisconfigurationError

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
             accelerator="cpu")


class WithHparams(TrainModule):
    def __init__(self, width: int, depth: int = 2, *, activation: str = "relu", encoder: nn.Module | None = None,
                 **extra) -> None:
        super().__init__()
        self.save_hyperparameters(ignore="encoder")
        self.layer = nn.Linear(width, 1)


def test_save_hyperparameters_keeps_init_arguments():
    module = WithHparams(4, activation="gelu", encoder=nn.Linear(1, 1), dropout=0.1)
    assert dict(module.hparams) == {"width": 4, "depth": 2, "activation": "gelu", "dropout": 0.1}
    assert module.hparams.width == 4
    with pytest.raises(
        AttributeError, match=r"hparams has no 'lr'; it holds \['activation', 'depth', 'dropout', 'width'\]"
    ):
        module.hparams.lr  # noqa: B018


def test_save_hyperparameters_by_name_and_on_a_datamodule():
    class Named(TrainModule):
        def __init__(self, a: int, b: int) -> None:
            super().__init__()
            self.save_hyperparameters("b")

    class Data(DataModule):
        def __init__(self, batch_size: int = 32) -> None:
            super().__init__()
            self.save_hyperparameters()

    assert dict(Named(1, 2).hparams) == {"b": 2}
    assert dict(Data(batch_size=8).hparams) == {"batch_size": 8}


def test_save_hyperparameters_takes_a_mapping_or_namespace_and_a_subclasss_arguments(tmp_path):
    import argparse

    class FromDict(TrainModule):
        def __init__(self, config) -> None:
            super().__init__()
            self.save_hyperparameters(config)

    assert dict(FromDict({"lr": 0.5, "hidden": 3}).hparams) == {"lr": 0.5, "hidden": 3}
    assert dict(FromDict(argparse.Namespace(lr=0.5, hidden=3)).hparams) == {"lr": 0.5, "hidden": 3}

    class Parent(TrainModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return (self.layer(batch[0]) - batch[1]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    class Child(Parent):
        def __init__(self, hidden: int, lr: float = 0.3) -> None:
            super().__init__(lr=lr / 3)  # the child's own value is what rebuilding the child takes
            self.hidden = hidden

    child = Child(hidden=5)
    assert dict(child.hparams) == {"lr": 0.3, "hidden": 5}
    Trainer(max_epochs=1, **QUIET).fit(child, data())
    path = tmp_path / "trained.ckpt"
    child.trainer.save_checkpoint(path)
    assert Child.load_from_checkpoint(path).hidden == 5
    lightning = tmp_path / "lightning.ckpt"  # Lightning's own layout: its hparams under hyper_parameters
    torch.save({"state_dict": child.state_dict(), "hyper_parameters": {"hidden": 7, "lr": 0.3}}, lightning)
    assert Child.load_from_checkpoint(lightning).hidden == 7


def test_outside_a_trainer():
    module = WithHparams(2)
    module.log("ignored", 1.0)  # nothing collects outside fit/validate/test, as in Lightning
    assert (module.current_epoch, module.global_step, module.global_rank) == (0, 0, 0)
    assert module.device == torch.device("cpu")
    with pytest.raises(MisconfigurationError, match="WithHparams is not attached to a Trainer yet"):
        module.trainer  # noqa: B018


def test_the_default_transfer_moves_every_tensor_of_a_nested_batch_and_keeps_its_containers():
    Pair = collections.namedtuple("Pair", "left right")
    x = torch.ones(2)
    batch = [x, (x, "label", 3), {"ids": x, "rest": [Pair(x, None)]}]
    moved = WithHparams(2).transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert type(moved) is list and type(moved[1]) is tuple and type(moved[2]["rest"][0]) is Pair
    tensors = [moved[0], moved[1][0], moved[2]["ids"], moved[2]["rest"][0].left]
    assert all(tensor.device == torch.device("meta") and tensor.shape == (2,) for tensor in tensors)
    assert moved[1][1:] == ("label", 3) and moved[2]["rest"][0].right is None
    assert batch[0].device == torch.device("cpu")  # the loader's batch itself is left as it was


class Regressor(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return (self.layer(batch[0]) - batch[1]).pow(2).mean()


def data(batches: int = 4) -> DataLoader:
    x = torch.randn(2 * batches, 2)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)


def fit_with(configure, epochs: int = 2) -> Trainer:
    module = Regressor()
    module.configure_optimizers = lambda: configure(module)
    trainer = Trainer(max_epochs=epochs, **QUIET)
    trainer.fit(module, data())
    return trainer


def learning_rate(trainer: Trainer) -> float:
    return trainer.optimizers[0].param_groups[0]["lr"]


def test_configure_optimizers_return_forms():
    def sgd(module):
        return torch.optim.SGD(module.parameters(), lr=1.0)

    def halving(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    # 4 batches per epoch, 2 epochs: 8 steps, 2 epoch ends.
    assert learning_rate(fit_with(sgd)) == 1.0
    assert learning_rate(fit_with(lambda m: (o := sgd(m), halving(o)))) == 0.25
    assert learning_rate(fit_with(lambda m: ([o := sgd(m)], [halving(o)]))) == 0.25
    assert learning_rate(fit_with(lambda m: {"optimizer": (o := sgd(m)), "lr_scheduler": halving(o)})) == 0.25
    step_every_2 = {"scheduler": None, "interval": "step", "frequency": 2}
    assert learning_rate(fit_with(lambda m: {"optimizer": (o := sgd(m)),
                                             "lr_scheduler": {**step_every_2, "scheduler": halving(o)}})) == 0.5**4


def test_reduce_lr_on_plateau_reads_its_monitored_metric():
    class Plateau(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("flat", 1.0, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "flat"}}

    trainer = Trainer(max_epochs=3, **QUIET)
    trainer.fit(Plateau(), data())
    assert learning_rate(trainer) == 0.25  # the first epoch sets the best value; two flat epochs halve twice

    class Unlogged(Plateau):
        def training_step(self, batch, batch_idx):
            return Regressor.training_step(self, batch, batch_idx)

    with pytest.raises(MisconfigurationError, match="ReduceLROnPlateau monitors 'flat', which was not logged"):
        Trainer(max_epochs=1, **QUIET).fit(Unlogged(), data())

    class MonitorBesideTheOptimizer(Plateau):  # Lightning reads "monitor" at the dict's top level too
        def configure_optimizers(self):
            config = super().configure_optimizers()
            return {**config, "lr_scheduler": config["lr_scheduler"]["scheduler"], "monitor": "flat"}

    trainer = Trainer(max_epochs=3, **QUIET)
    trainer.fit(MonitorBesideTheOptimizer(), data())
    assert learning_rate(trainer) == 0.25


class StepwiseHalving:
    """A scheduler of another library's kind (timm's): not torch's, and its step takes the step count."""

    def __init__(self, optimizer):
        self.optimizer, self.steps_seen = optimizer, []

    def step(self, step_count):
        self.steps_seen.append(step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.5 ** step_count

    def state_dict(self):
        return {"steps_seen": list(self.steps_seen)}

    def load_state_dict(self, state):
        self.steps_seen = list(state["steps_seen"])


def test_lr_scheduler_step_steps_schedulers_of_other_kinds_and_sees_plateau_metrics(tmp_path):
    class Custom(Regressor):
        def __init__(self):
            super().__init__()
            self.calls = []

        def training_step(self, batch, batch_idx):
            self.log("flat", 1.0, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer, still = torch.optim.SGD(self.parameters(), lr=1.0), torch.optim.SGD(self.parameters(), lr=0.0)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(still, patience=0, factor=0.5)
            return (
                {"optimizer": optimizer, "lr_scheduler": {"scheduler": StepwiseHalving(optimizer), "interval": "step"}},
                {"optimizer": still, "lr_scheduler": plateau, "monitor": "flat"},
            )

        def lr_scheduler_step(self, scheduler, metric):
            assert metric is None or isinstance(metric, torch.Tensor)  # the logged value, as Lightning passes it
            self.calls.append((type(scheduler).__name__, None if metric is None else float(metric)))
            if isinstance(scheduler, StepwiseHalving):
                scheduler.step(self.global_step)
            else:
                super().lr_scheduler_step(scheduler, metric)

        # Two optimizers under automatic optimization each step every batch, which is what this test needs.

    module = Custom()
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), **{**QUIET, "enable_checkpointing": True})
    trainer.fit(module, data())
    stepwise = trainer.lr_scheduler_configs[0].scheduler
    assert stepwise.steps_seen == list(range(1, 9)) and learning_rate(trainer) == 0.5**8  # 4 batches x 2 epochs
    assert module.calls.count(("StepwiseHalving", None)) == 8 and module.calls.count(("ReduceLROnPlateau", 1.0)) == 2
    resumed = Custom()
    trainer = Trainer(max_epochs=3, default_root_dir=str(tmp_path), **{**QUIET, "enable_checkpointing": True})
    trainer.fit(resumed, data(), ckpt_path="last")
    assert trainer.lr_scheduler_configs[0].scheduler.steps_seen == list(range(1, 13))  # its state came back

    class OwnPlateau(StepwiseHalving):  # a plateau scheduler of another library, told apart by reduce_on_plateau
        def step(self, metric):
            self.steps_seen.append(float(metric))

    class Plateaued(Custom):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": OwnPlateau(optimizer), "monitor": "flat",
                                                             "reduce_on_plateau": True}}

        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step(metric)

    trainer = Trainer(max_epochs=2, **QUIET)
    trainer.fit(Plateaued(), data())
    assert trainer.lr_scheduler_configs[0].scheduler.steps_seen == [1.0, 1.0]

    class NotStepped(Regressor):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            return optimizer, StepwiseHalving(optimizer)

    with pytest.raises(MisconfigurationError, match=r"the scheduler StepwiseHalving is not one of torch's.*define "
                                                    r"NotStepped.lr_scheduler_step\(self, scheduler, metric\)"):
        Trainer(max_epochs=1, **QUIET).fit(NotStepped(), data())


class TwoOptimizers(Regressor):
    automatic_optimization = False

    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        assert self.lr_schedulers() is None
        for optimizer, layer in ((first, self.layer), (second, self.other)):
            loss = (layer(batch[0]) - batch[1]).pow(2).mean()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]


def test_manual_optimization_with_two_optimizers():
    torch.manual_seed(0)
    module = TwoOptimizers()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = Trainer(max_epochs=1, **QUIET)
    trainer.fit(module, data())  # training_step returns None: fine under manual optimization
    assert trainer.global_step == 8  # 4 batches x 2 optimizers: each step counts, as in Lightning
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    stopped = Trainer(max_steps=6, **QUIET)
    stopped.fit(TwoOptimizers(), data())
    assert (stopped.global_step, stopped.progress.epoch_batches) == (6, 3)


class TwoOptimizersLogging(TwoOptimizers):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        self.log("batch", float(batch_idx))


def test_loggers_count_batches_not_optimizer_steps_under_manual_optimization(tmp_path):
    """As in Lightning: a GAN's two optimizer steps a batch do not make metrics.csv log twice as often."""
    quiet = {**QUIET, "logger": True}
    trainer = Trainer(max_epochs=2, log_every_n_steps=3, default_root_dir=str(tmp_path), **quiet)
    trainer.fit(TwoOptimizersLogging(), data(batches=6))
    assert trainer.global_step == 24
    rows = (tmp_path / "default" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [dict(zip(header, row.split(","))) for row in rows[1:]]
    # Every third batch of 12, named by its batch count; batch_idx runs 0..5 in each epoch.
    assert [(int(r["step"]), float(r["batch"])) for r in logged] == [(3, 2.0), (6, 5.0), (9, 2.0), (12, 5.0)]


def test_module_pickles_without_its_trainer():
    module = Regressor()
    module._trainer = Trainer(**QUIET)
    copy = pickle.loads(pickle.dumps(module))
    assert copy._trainer is None
    assert torch.equal(copy.layer.weight, module.layer.weight)


def test_setup_builds_layers_before_the_optimizers_and_teardown_ends_each_stage():
    class Lazy(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def setup(self, stage):
            self.calls.append(f"setup:{stage}")
            if not hasattr(self, "layer"):
                self.layer = nn.Linear(2, 1)

        def teardown(self, stage):
            self.calls.append(f"teardown:{stage}")

        def training_step(self, batch, batch_idx):
            return (self.layer(batch[0]) - batch[1]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", (self.layer(batch[0]) - batch[1]).pow(2).mean())

        def configure_optimizers(self):
            self.calls.append("configure_optimizers")
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Lazy()
    trainer = Trainer(max_epochs=2, **QUIET)
    trainer.fit(module, data())
    trainer.validate(module, data(), verbose=False)
    assert module.calls == ["setup:fit", "configure_optimizers", "teardown:fit", "setup:validate", "teardown:validate"]
    assert trainer.global_step > 0 and "val_loss" in trainer.callback_metrics


def test_manual_optimization_fires_the_step_hooks_and_offers_clipping_and_toggling():
    from torchyard.callbacks import Callback

    class Gan(TwoOptimizers):
        def training_step(self, batch, batch_idx):
            for optimizer, layer, frozen in zip(self.optimizers(), (self.layer, self.other), (self.other, self.layer)):
                self.toggle_optimizer(optimizer)
                assert not frozen.weight.requires_grad and layer.weight.requires_grad
                loss = (layer(batch[0]) - batch[1]).pow(2).mean() * 100
                optimizer.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")
                assert layer.weight.grad.abs().max() <= 0.01
                optimizer.step()
                self.untoggle_optimizer(optimizer)
            assert self.layer.weight.requires_grad and self.other.weight.requires_grad

    class Hooks(Callback):
        def __init__(self):
            self.calls = {}

        def count(self, name):
            self.calls[name] = self.calls.get(name, 0) + 1

        def on_before_backward(self, trainer, module, loss):
            self.count("before_backward")

        def on_after_backward(self, trainer, module):
            self.count("after_backward")

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.count("before_optimizer_step")

    hooks = Hooks()
    trainer = Trainer(max_epochs=1, callbacks=[hooks], **QUIET)
    trainer.fit(Gan(), data())
    steps = trainer.global_step  # two optimizer steps a batch
    assert steps > 0 and hooks.calls == {
        "before_backward": steps,
        "after_backward": steps,
        "before_optimizer_step": steps,
    }
