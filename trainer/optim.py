"""What configure_optimizers may return, and learning-rate scaling by the number of data-parallel workers."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from torchyard.trainer.config import LR_SCALINGS
from torchyard.trainer.errors import MisconfigurationError


@dataclass
class SchedulerConfig:
    """A scheduler and when it steps (Lightning's lr_scheduler dict)."""

    scheduler: LRScheduler | ReduceLROnPlateau
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None
    reduce_on_plateau: bool | None = None  # steps with its monitored value; unset: whether it is a ReduceLROnPlateau

    def __post_init__(self) -> None:
        if self.reduce_on_plateau is None:
            self.reduce_on_plateau = isinstance(self.scheduler, ReduceLROnPlateau)


def _scheduler_config(item: Any, monitor: str | None = None) -> SchedulerConfig:
    """`monitor`: the one given beside the optimizer ({"optimizer", "lr_scheduler", "monitor"}, as Lightning
    reads it)."""
    if isinstance(item, Mapping):
        unknown = set(item) - {"scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau"}
        if "scheduler" not in item or unknown:
            raise MisconfigurationError(
                f"an lr_scheduler dict needs 'scheduler' and may hold interval, frequency, monitor, strict, name, "
                f"reduce_on_plateau; got {sorted(item)}."
            )
        config = SchedulerConfig(**{"monitor": monitor, **item})
    else:
        config = SchedulerConfig(item, monitor=monitor)
    if not is_torch_scheduler(config.scheduler) and not _steppable(config.scheduler):
        raise MisconfigurationError(
            f"expected an LR scheduler, got {type(config.scheduler).__name__}; a scheduler of another kind (timm's) "
            "needs step, state_dict and load_state_dict methods and the module's lr_scheduler_step(scheduler, metric) "
            "to "
            "step it."
        )
    if config.interval not in ("step", "epoch"):
        raise MisconfigurationError(f"lr_scheduler interval={config.interval!r}; use 'step' or 'epoch'.")
    return config


def check_monitors(schedulers: list[SchedulerConfig]) -> None:
    """Under automatic optimization the Trainer steps a plateau scheduler with its monitored value, so it needs a
    monitor (under manual optimization the user steps it with a value of their own, as in Lightning)."""
    for config in schedulers:
        if config.reduce_on_plateau and config.monitor is None:
            raise MisconfigurationError(
                f"{type(config.scheduler).__name__} steps on a monitored value: it needs a 'monitor' "
                "key naming a logged metric."
            )


def is_torch_scheduler(scheduler: Any) -> bool:
    """One of torch's schedulers, whose step() the Trainer knows how to call (others need lr_scheduler_step)."""
    return isinstance(scheduler, (LRScheduler, ReduceLROnPlateau))


def needs_closure(optimizer: Optimizer) -> bool:
    """Whether the optimizer's step evaluates the loss itself, through a closure it must be given (LBFGS)."""
    return _closure_parameter(type(optimizer)) == "required"


def takes_closure(optimizer: Optimizer) -> bool:
    """Whether the training step hands the optimizer's step a closure, as Lightning always does: where it needs
    one, and for optimizers from outside torch.optim that take one (SAM calls it after moving the weights).
    torch's others would only call it once, for the loss already computed."""
    kind, declared = _closure_parameter(type(optimizer)), getattr(optimizer, "steps_with_closure", None)
    if declared is not None:  # a wrapper says (the parameter server's RemoteOptimizer: never)
        return declared
    return kind == "required" or kind == "optional" and not type(optimizer).__module__.startswith("torch.optim")


@functools.cache
def _closure_parameter(kind: type) -> str | None:
    closure = inspect.signature(kind.step).parameters.get("closure")
    if closure is None:
        return None
    return "required" if closure.default is inspect.Parameter.empty else "optional"


class HookedClosure:
    """A closure that runs `before_step` (on_before_optimizer_step, then clipping) after each evaluation, as
    Lightning runs them after each closure call inside an optimizer's step; returns the closure's loss
    (None without a closure: the hooks still run once, for the gradients already there)."""

    def __init__(
        self, closure: Callable[[], Any] | None, before_step: Callable[[Optimizer], None], optimizer: Optimizer
    ) -> None:
        self.closure, self.before_step, self.optimizer = closure, before_step, optimizer

    def __call__(self) -> Any:
        loss = self.closure() if self.closure is not None else None
        self.before_step(self.optimizer)
        return loss


def check_closure_optimizer(optimizers: list[Optimizer], accumulate_grad_batches: int, precision: str) -> None:
    """Under automatic optimization, an optimizer that evaluates the loss itself (LBFGS) gets a closure running
    training_step and backward again on the step's batch: refuse what that cannot honour."""
    kinds = [type(optimizer).__name__ for optimizer in optimizers if needs_closure(optimizer)]
    if not kinds:
        return
    if len(optimizers) > 1:
        raise MisconfigurationError(
            f"{kinds[0]} evaluates the loss itself, again and again, so under automatic optimization it must be the "
            f"only optimizer, but configure_optimizers returned {len(optimizers)}; put every parameter in it, or step "
            "them "
            "yourself with `automatic_optimization = False`."
        )
    if accumulate_grad_batches > 1:
        raise MisconfigurationError(
            f"accumulate_grad_batches={accumulate_grad_batches} cannot be used with {kinds[0]}: it evaluates the loss "
            "again on the step's batch alone, not on the accumulated ones; use accumulate_grad_batches=1 and a larger "
            "batch."
        )
    if precision == "16-mixed":
        raise MisconfigurationError(
            f"precision='16-mixed' cannot step {kinds[0]}: a grad scaler cannot unscale the gradients of the "
            "evaluations its step runs itself (as in Lightning); use precision='bf16-mixed' or '32'."
        )


def _steppable(scheduler: Any) -> bool:
    """A scheduler that is not torch's, which the module's own lr_scheduler_step steps (checked by the Trainer)."""
    return all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict"))


def parse_optimizers(output: Any) -> tuple[list[Optimizer], list[SchedulerConfig]]:
    """Normalise configure_optimizers' return: an optimizer, (opt, sched), ([opts], [scheds]), dict(s)."""
    if isinstance(output, Optimizer):
        return [output], []
    if isinstance(output, Mapping):
        output = [output]
    if isinstance(output, (list, tuple)):
        if all(isinstance(item, Mapping) for item in output) and output:
            optimizers = [item["optimizer"] for item in output]
            schedulers = [_scheduler_config(item["lr_scheduler"], item.get("monitor")) for item in output
                          if item.get("lr_scheduler")]
            return _checked(optimizers), schedulers
        if len(output) == 2 and isinstance(output[0], (list, tuple)):
            return _checked(list(output[0])), [_scheduler_config(s) for s in output[1]]
        if len(output) == 2 and isinstance(output[0], Optimizer) and not isinstance(output[1], Optimizer):
            return [output[0]], [_scheduler_config(output[1])]
        return _checked(list(output)), []
    raise MisconfigurationError(
        f"configure_optimizers returned {type(output).__name__}; return an optimizer, (optimizer, scheduler), "
        "or a dict {'optimizer': ..., 'lr_scheduler': ...}."
    )


def _checked(optimizers: list[Any]) -> list[Optimizer]:
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise MisconfigurationError(
                f"configure_optimizers returned a {type(opt).__name__} where an optimizer belongs."
            )
    if not optimizers:
        raise MisconfigurationError("configure_optimizers returned no optimizer.")
    return optimizers


class LRScaler:
    """Scale learning rates by the data-parallel world size, reaching the scaled rate by linear warm-up.

    factor = N (linear, Goyal et al. 2017) or sqrt(N), N = data-parallel size * accumulate_grad_batches.
    During warm-up step t < W the rate is base * (1 + (factor - 1) * t / W), applied around each step so
    schedulers keep seeing (and decaying) the scaled rate.
    """

    def __init__(self, mode: str, workers: int, warmup_steps: int) -> None:
        if mode not in LR_SCALINGS:
            raise MisconfigurationError(f"lr_scaling={mode!r} is not known; use one of {', '.join(LR_SCALINGS)}.")
        self.factor = {"none": 1.0, "linear": float(workers), "sqrt": math.sqrt(workers)}[mode]
        self.warmup_steps = warmup_steps
        self.warmup_end = warmup_steps if self.factor != 1.0 else 0  # the first step taken at the full rate

    def apply(self, optimizers: list[Optimizer], schedulers: list[SchedulerConfig]) -> None:
        """Multiply every group's rate (and the schedulers' base rates) by the factor, once."""
        _multiply_rates(optimizers, schedulers, self.factor)

    def rescale_restored(
        self, optimizers: list[Optimizer], schedulers: list[SchedulerConfig], saved_factor: float
    ) -> None:
        """Rates just restored from a checkpoint of a run scaled by `saved_factor` (another data-parallel
        size or accumulation): bring them to this run's factor."""
        _multiply_rates(optimizers, schedulers, self.factor / saved_factor)

    def warmup_ratio(self, global_step: int) -> float:
        """The fraction of the (scaled) rate in force at optimizer step `global_step`: below 1 while warming up."""
        if global_step >= self.warmup_end:
            return 1.0
        return (1.0 + (self.factor - 1.0) * global_step / self.warmup_steps) / self.factor

    def step(self, optimizer: Optimizer, global_step: int, optimizer_step: Callable[..., None],
             closure: Callable[[], torch.Tensor] | None = None) -> Any:
        """Run `optimizer_step(optimizer, closure)` at the rate warm-up gives `global_step` (the rates are restored
        afterwards) and return what it returns. The training step calls it only before `warmup_end`, and steps
        directly after."""
        with self._lowered(optimizer, self.warmup_ratio(global_step)):
            return optimizer_step(optimizer, closure)

    @staticmethod
    @contextlib.contextmanager
    def _lowered(optimizer: Optimizer, ratio: float) -> Iterator[None]:
        rates = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= ratio
        try:
            yield
        finally:
            # Restore the saved rates: `lr * ratio / ratio` is not always `lr` in floating point.
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate


def _multiply_rates(optimizers: list[Optimizer], schedulers: list[SchedulerConfig], ratio: float) -> None:
    if ratio == 1.0:
        return
    # Every rate a schedule is built from: OneCycleLR reads its groups' max_lr and min_lr, CyclicLR its max_lrs,
    # cosine annealing its eta_min; scaling only `lr` would leave them at one process's values.
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr", "max_lr", "min_lr"):
                if isinstance(group.get(key), (int, float)):
                    group[key] *= ratio
    pending = [config.scheduler for config in schedulers]
    while pending:
        scheduler = pending.pop()
        pending.extend(getattr(scheduler, "_schedulers", []))  # SequentialLR and ChainedScheduler
        scaled = False
        for name in ("base_lrs", "max_lrs", "base_values"):  # base_values: timm's schedulers
            if isinstance(getattr(scheduler, name, None), list):
                setattr(scheduler, name, [lr * ratio for lr in getattr(scheduler, name)])
                scaled = True
        if isinstance(getattr(scheduler, "eta_min", None), (int, float)):
            scheduler.eta_min *= ratio
        if not scaled and not is_torch_scheduler(scheduler):
            warnings.warn(
                f"lr_scaling multiplied the optimizers' learning rates by {ratio:g}, but {type(scheduler).__name__} "
                "keeps the rates it sets where the Trainer does not know to scale them (torch's base_lrs, timm's "
                "base_values), "
                "so its steps may set unscaled rates; build it with rates multiplied by the same factor.",
                stacklevel=3,
            )


def step_scheduler(config: SchedulerConfig, metrics: Mapping[str, torch.Tensor],
                   step: Callable[[Any, torch.Tensor | None], None]) -> None:
    """Step one scheduler through `step(scheduler, metric)` (the module's lr_scheduler_step); a plateau scheduler
    gets its monitored value (the logged tensor), the others None, as in Lightning."""
    metric = None
    if config.reduce_on_plateau:
        if config.monitor not in metrics:
            if config.strict:
                raise MisconfigurationError(
                    f"{type(config.scheduler).__name__} monitors {config.monitor!r}, which was not logged; logged: "
                    f"{sorted(metrics)}."
                )
            return
        metric = metrics[config.monitor]
    step(config.scheduler, metric)


class ManualOptimizer:
    """An optimizer as `self.optimizers()` hands it out under manual optimization, like Lightning's
    LightningOptimizer: `step()` goes through the strategy (grad scaler, parameter-server push) and counts one
    global step, so max_steps, checkpoint names and logging count optimizer steps. The rest is the optimizer's."""

    def __init__(self, optimizer: Optimizer, trainer: Any) -> None:
        self.optimizer, self._trainer = optimizer, trainer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step; a `closure` (LBFGS) goes to the optimizer itself, which may call it several times."""
        self._trainer.hooks.call("on_before_optimizer_step", self.optimizer)
        result = (
            self._trainer.strategy.optimizer_step(self.optimizer) if closure is None else self.optimizer.step(closure)
        )
        self._trainer.progress.global_step += 1
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


#: Lightning's name for the optimizer wrapper that manual optimization hands out (isinstance checks, type hints).
LightningOptimizer = ManualOptimizer


class HookOptimizer:
    """The optimizer a module's `optimizer_step` override gets, as Lightning's LightningOptimizer: `step`
    goes through `apply` (the strategy's step: grad scaler, parameter-server push, learning-rate warm-up), with
    `before_step` (on_before_optimizer_step and clipping) after each evaluation of the closure (HookedClosure).
    Forward and backward have already run, so the closure's first call returns the step's loss; an optimizer
    that takes a closure (LBFGS, SAM) gets it, and its later calls run them again. The rest is the optimizer's."""

    def __init__(
        self, optimizer: Optimizer, apply: Callable[..., Any], before_step: Callable[[Optimizer], None]
    ) -> None:
        self.optimizer, self._apply, self._before_step = optimizer, apply, before_step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        hooked = HookedClosure(closure, self._before_step, self.optimizer)
        if takes_closure(self.optimizer):
            return self._apply(self.optimizer, closure=hooked)
        loss = hooked()
        self._apply(self.optimizer)
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
