"""TrainModule: the user's model plus the hooks the loop calls, Lightning-compatible by name."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchyard.trainer.checkpointing.files import load_checkpoint_file, load_hparams_file, weights_mismatch
from torchyard.trainer.checkpointing.hparams import AttributeDict, constructor_parameters, init_args
from torchyard.trainer.config import CLIP_ALGORITHMS
from torchyard.trainer.data.batches import move_to_device
from torchyard.trainer.errors import CheckpointError, MisconfigurationError, closest
from torchyard.trainer.precision import HALF_DTYPES

if TYPE_CHECKING:
    from torchyard.callbacks.base import Callback
    from torchyard.trainer.trainer import Trainer


class HyperparametersMixin:
    """`save_hyperparameters()` and `hparams`, for TrainModule and DataModule alike."""

    def save_hyperparameters(self, *names: Any, ignore: list[str] | str | None = None) -> None:
        """Store the caller's __init__ arguments in `self.hparams` (and in every checkpoint): all of them, the
        ones named, or, given one mapping or Namespace, its items."""
        frame = inspect.currentframe()
        if len(names) == 1 and not isinstance(names[0], str):
            given = names[0]
            self.hparams.update(given if isinstance(given, Mapping) else vars(given))
            caller = frame.f_back.f_locals if frame and frame.f_back else {}
            self._hparams_name = next((name for name, value in caller.items() if value is given and name != "self"),
                                      None)  # the __init__ argument load_from_checkpoint gives them to again
            return
        self.hparams.update(init_args(frame.f_back if frame else None, self, names, ignore))

    @property
    def hparams(self) -> AttributeDict:
        """The saved hyperparameters."""
        # Created on first use, so a subclass that skips super().__init__() still has them.
        return self.__dict__.setdefault("_hparams", AttributeDict())


_ABSENT = object()


def overridden(owner: Any, name: str, base: type) -> Callable[..., Any] | None:
    """`owner.<name>`, bound, where it is not `base`'s (whose body is a default the loop need not call), else
    None; also None where `owner` (e.g. None) has no such attribute."""
    method = getattr(owner, name, None)
    if method is None or getattr(method, "__func__", None) is getattr(base, name, _ABSENT):
        return None
    return method


class BatchTransferHooks:
    """Lightning's batch-transfer hooks, for TrainModule and DataModule alike (where both override one, the
    DataModule's is called, as in Lightning). Training batches come from loader 0."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it is moved to the device."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a batch to `device`; the default moves the tensors in (nested) lists, tuples and dicts."""
        return move_to_device(batch, device, non_blocking=device.type == "cuda")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch once it is on the device (e.g. augment it on the GPU)."""
        return batch


class TrainModule(HyperparametersMixin, BatchTransferHooks, nn.Module):
    """Subclass this: define training_step and configure_optimizers; the other hooks are optional.

    Hook names, `self.log`, `self.hparams`, manual optimization and `load_from_checkpoint` follow
    LightningModule, so a LightningModule ports by changing its import and base class. As there, it may
    also define its own data: `prepare_data()` and `train_dataloader()`, `val_dataloader()`,
    `test_dataloader()`, `predict_dataloader()`, which a stage uses for the loaders it is not given.
    """

    #: Set to False to call `self.optimizers()`, `self.manual_backward()` and `opt.step()` yourself.
    automatic_optimization: bool = True
    #: False: a checkpoint's weights load with strict=False (fit(ckpt_path=...), load_from_checkpoint), as in
    #: Lightning, for a module that saves only part of its weights.
    strict_loading: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None
        # The seed torch's generator was set with when the layers below were initialised: a Trainer(seed=...)
        # built after the module did not seed them, and says so (rng.warn_if_weights_unseeded).
        self._built_with_seed: int | None = torch.initial_seed()

    # ----------------------------------------------------------------- the steps
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        """Return the loss (a scalar tensor) or a dict with key 'loss'."""
        raise MisconfigurationError(f"{type(self).__name__} must define training_step(self, batch, batch_idx).")

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Compute and `self.log` validation metrics for one batch."""

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Compute and `self.log` test metrics for one batch."""

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Return predictions for one batch; the default calls the module on the batch."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer, (optimizer, scheduler), lists of them, or a Lightning-style dict."""
        raise MisconfigurationError(
            f"{type(self).__name__} has no configure_optimizers(); define it to return an optimizer, "
            "e.g. `return torch.optim.Adam(self.parameters(), lr=1e-3)`."
        )

    def lr_scheduler_step(self, scheduler: Any, metric: torch.Tensor | None) -> None:
        """Step one scheduler when its interval and frequency say so (`metric`: a plateau scheduler's monitored value,
        else None). Override it for a scheduler whose step takes other arguments (timm's), as in Lightning."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        """Callbacks this module needs wherever it runs, as in Lightning: they join the Trainer's, replacing its
        callbacks of their types or base types (a MyCheckpoint(ModelCheckpoint) replaces the ModelCheckpoint)."""
        return []

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """Loss of the last pipeline stage's output against the batch's target (pipeline strategy)."""
        raise MisconfigurationError(
            f"strategy='pipeline' computes the loss on the last stage, so {type(self).__name__} must define "
            "pipeline_loss(self, output, batch) -> loss (and pipeline_input(self, batch) if the input is "
            "not batch[0])."
        )

    def pipeline_input(self, batch: Any) -> torch.Tensor:
        """What the first pipeline stage consumes; by default the first element of the batch."""
        return batch[0] if isinstance(batch, (list, tuple)) else batch

    # ----------------------------------------------------------------- hooks (all optional)
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def prepare_data(self) -> None:
        """Download or write files; runs on local rank 0 only, after the datamodule's and before any `setup`."""

    def setup(self, stage: str) -> None:
        """Called at the start of each stage ("fit", "validate", "test", "predict") in every process, after the
        datamodule's setup and before configure_optimizers: build layers that need the data here."""

    def teardown(self, stage: str) -> None:
        """Called at the end of each stage in every process."""

    def configure_model(self) -> None:
        """Called after setup(stage), each stage, in every process: build layers here (make it idempotent:
        a second stage calls it again on the same module). Under a strategy with a mesh (fsdp, pipeline),
        `self.device_mesh` is set by then: apply tensor-parallel plans on `self.device_mesh["tp"]` here."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward of the loss (already scaled under a grad scaler); override for e.g. retain_graph=True.
        Automatic optimization and manual_backward both go through it."""
        loss.backward(*args, **kwargs)

    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step the optimizer (automatic optimization); override to act around the step, e.g. a learning-rate
        warm-up, as in Lightning. Forward and backward have already run: the closure's first call returns the
        step's loss; a later call (LBFGS) runs them again. A step the override leaves out still counts in
        global_step."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients after each optimizer step (automatic optimization); the default sets them to None."""
        optimizer.zero_grad(set_to_none=True)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip before each optimizer step, with the Trainer's gradient_clip_val and gradient_clip_algorithm
        (None: no clipping); override to clip your own way, e.g. with self.clip_gradients."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...

    # ----------------------------------------------------------------- logging
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Record a scalar or torchmetrics Metric; the trainer aggregates, reduces and writes it.

        As in Lightning, `rank_zero_only` marks a value logged on rank 0 alone (never synced: the other ranks
        would wait for it), and `add_dataloader_idx=False` keeps the name without `/dataloader_idx_<i>`
        (then each loader must log its own names)."""
        trainer = self._trainer
        if trainer is None:
            return  # called outside fit/validate/test: nothing collects, as in Lightning
        metrics, sync_dist = trainer.metrics, sync_dist and not rank_zero_only
        checked = metrics.checked_step_logs
        if checked is not None:  # in a training step
            known = checked.get(name)
            # A scalar tensor under a name the collector checked with these options (per step only): stored as its
            # `log` would, here, as the calls down to it cost a measurable share of a small model's step.
            if (known is not None and known[0] == (prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
                    and type(value) is torch.Tensor and value.ndim == 0 and value.dtype not in HALF_DTYPES):
                value = value.data if value.requires_grad else value  # `.data`: see MetricCollector.log
                for store in known[1]:
                    store[name] = value
                return
        metrics.log(name, value, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, batch_size,
                    add_dataloader_idx)

    def log_dict(self, values: Mapping[str, Any], **kwargs: Any) -> None:
        """`self.log` for each item."""
        for name, value in values.items():
            self.log(name, value, **kwargs)

    # ----------------------------------------------------------------- what the trainer tells the module
    @property
    def trainer(self) -> Trainer:
        """The Trainer running this module."""
        if self._trainer is None:
            raise MisconfigurationError(f"{type(self).__name__} is not attached to a Trainer yet.")
        return self._trainer

    @property
    def device(self) -> torch.device:
        """The device of the module's parameters (cpu when it has none)."""
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @property
    def on_gpu(self) -> bool:
        """Whether the module's parameters are on a GPU."""
        return self.device.type == "cuda"

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job (0 without a trainer)."""
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def device_mesh(self) -> Any:
        """The strategy's DeviceMesh, its dimensions named "pp", "dp_replicate", "dp_shard" and "tp"
        (trainer/strategies/mesh.py); None without a trainer or under a strategy that builds none."""
        return self._trainer.strategy.device_mesh if self._trainer is not None else None

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def logger(self) -> Any:
        """The trainer's first logger (None without one or without a trainer), as in Lightning."""
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        return self._trainer.loggers if self._trainer is not None else []

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on global rank 0 only, as Lightning's self.print."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def freeze(self) -> None:
        """No gradients for any parameter, and eval mode (for inference or a frozen backbone)."""
        for parameter in self.parameters():
            parameter.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Undo freeze(): gradients for every parameter, and train mode."""
        for parameter in self.parameters():
            parameter.requires_grad = True
        self.train()

    def all_gather(self, data: Any, sync_grads: bool = False) -> Any:
        """`data` (a tensor, or a nested container of them) from every process: each tensor stacked along a new
        first dimension of size world_size (by a tensor collective, on its device; `sync_grads`: differentiable),
        any other value as the list of every process's; unchanged on one process. Every process must pass
        the same structure, with tensors of one shape and dtype."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1:
            return data
        strategy = trainer.strategy
        leaves, structure = pytree.tree_flatten(data)
        # What each process holds, compared first: a tensor collective over mismatched shapes would fail
        # deep inside the backend, or wait forever. Other values travel with it.
        layout = [(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else "value" for leaf in leaves]
        values = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        shared = strategy.all_gather_object((str(structure), layout, values))
        first = shared[0][:2]
        for rank, (other_structure, other_layout, _) in enumerate(shared[1:], start=1):  # decided alike on every rank
            if (other_structure, other_layout) != first:
                ours, theirs = next(
                    ((a, b) for a, b in zip(first[1], other_layout) if a != b), (first[0], other_structure)
                )
                raise MisconfigurationError(
                    f"all_gather got {ours} on rank 0 and {theirs} on rank {rank}; every process must gather the same "
                    "structure of tensors with one shape and dtype (pad them to a common shape).")
        gathered = [strategy.all_gather(leaf, sync_grads) if isinstance(leaf, torch.Tensor)
                    else [other[2][index] for other in shared] for index, leaf in enumerate(leaves)]
        return pytree.tree_unflatten(gathered, structure)

    # ----------------------------------------------------------------- manual optimization
    def optimizers(self) -> Any:
        """The optimizer (or list of them) configure_optimizers returned; under manual optimization each is
        wrapped so that its `step()` counts in global_step, as in Lightning (`.optimizer` is the torch one)."""
        opts = self.trainer.optimizers if self.automatic_optimization else self.trainer.manual_optimizers
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        """The scheduler (or list of them) configure_optimizers returned, or None."""
        scheds = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Backward through the strategy (grad scaling, DDP hooks) under manual optimization, between the
        on_before_backward and on_after_backward hooks, as in automatic optimization."""
        trainer = self.trainer
        trainer.hooks.call("on_before_backward", loss)
        trainer.strategy.backward(loss)
        trainer.hooks.call("on_after_backward")

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Clip `optimizer`'s gradients (unscaled first under a grad scaler) by norm or by value, for manual
        optimization; nothing when `gradient_clip_val` is None."""
        if gradient_clip_val is None:
            return
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in CLIP_ALGORITHMS:
            raise MisconfigurationError(f"gradient_clip_algorithm={algorithm!r}; use 'norm' or 'value'.")
        self.trainer.strategy.clip_gradients(
            getattr(optimizer, "optimizer", optimizer), float(gradient_clip_val), algorithm
        )

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Let only `optimizer`'s parameters take gradients (the others' requires_grad is off until
        `untoggle_optimizer`), as when training a GAN's two networks in turn."""
        own = {id(p) for group in getattr(optimizer, "optimizer", optimizer).param_groups for p in group["params"]}
        toggled = self.__dict__.setdefault("_toggled", {})
        for parameter in self.parameters():
            if id(parameter) not in own:
                toggled.setdefault(parameter, parameter.requires_grad)
                parameter.requires_grad = False

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give back the requires_grad that `toggle_optimizer` turned off."""
        for parameter, requires_grad in self.__dict__.pop("_toggled", {}).items():
            parameter.requires_grad = requires_grad

    # ----------------------------------------------------------------- checkpoints
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, map_location: Any = "cpu",
                             hparams_file: str | Path | None = None, strict: bool | None = None,
                             **hparam_overrides: Any) -> TrainModule:
        """Build the module from the checkpoint's hparams (those of `hparams_file`, a YAML file, win over them;
        keyword overrides win over both) and load its weights (`strict` unset: the module's strict_loading).

        As in Lightning, saved hparams that `__init__` does not take (set on `self.hparams` later, or a
        parent's) are left out; hparams saved from one namespace go back to the argument that held it.
        """
        parameters, takes_any = constructor_parameters(cls, (object, nn.Module, TrainModule))
        for key in hparam_overrides:
            if not takes_any and key not in parameters:
                raise MisconfigurationError(
                    f"{cls.__name__}.load_from_checkpoint(..., {key}=...): {cls.__name__} does not take {key!r}"
                    f"{closest(key, parameters)}; it takes {', '.join(parameters) or 'no arguments'}."
                )
        checkpoint = load_checkpoint_file(checkpoint_path, map_location=map_location)
        stored = dict(checkpoint.get("hparams", checkpoint.get("hyper_parameters", {})))
        from_file = load_hparams_file(hparams_file) if hparams_file is not None else {}
        stored.update(from_file)
        for key in checkpoint.get("hparams_repr", ()):  # older checkpoints do not record them
            if key in stored and key not in hparam_overrides and key not in from_file:
                raise MisconfigurationError(
                    f"checkpoint {str(checkpoint_path)!r} holds hparams[{key!r}] only as its repr {stored[key]!r} (it "
                    f"was not plain data when saved); pass the value again: "
                    f"{cls.__name__}.load_from_checkpoint(path, {key}=...)."
                )
        namespace = checkpoint.get("hparams_name")
        if namespace in parameters:
            saved: dict[str, Any] = {namespace: AttributeDict(stored)}
        else:
            saved = {key: value for key, value in stored.items() if takes_any or key in parameters}
        module = cls(**{**saved, **hparam_overrides})
        module._built_with_seed = None  # its weights are the checkpoint's, whatever seeded their first values
        module.on_load_checkpoint(checkpoint)
        try:
            module.load_state_dict(checkpoint["state_dict"], strict=module.strict_loading if strict is None else strict)
        except RuntimeError as err:  # torch lists every key; say what differs in one line
            differences = weights_mismatch(module.state_dict(), checkpoint["state_dict"], err)
            raise CheckpointError(
                f"checkpoint {str(checkpoint_path)!r} does not fit {cls.__name__}: {differences}."
            ) from err
        return module

    def __getstate__(self) -> dict[str, Any]:
        # The trainer travels separately to spawned workers; never pickle it inside the module.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_trainer"] = None
        return state
