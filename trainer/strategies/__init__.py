"""Strategy registry: `Trainer(strategy="ddp")`, `strategy={"name": "ddp", ...options}`, or an instance."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.errors import MisconfigurationError, closest
from trainer.strategies.base import Strategy
from trainer.strategies.ddp import DDPStrategy
from trainer.strategies.dp import DataParallelStrategy
from trainer.strategies.pipeline import PipelineStrategy
from trainer.strategies.ps import ParameterServerStrategy
from trainer.strategies.single import SingleDeviceStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDeviceStrategy,
    "dp": DataParallelStrategy,
    "ddp": DDPStrategy,
    "pipeline": PipelineStrategy,
    "ps": ParameterServerStrategy,
}


def build_strategy(spec: str | Mapping[str, Any] | Strategy) -> Strategy:
    """A Strategy from a registry name, a mapping `{name: ..., **options}`, or an instance."""
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("name", None)
        if name is None:
            raise MisconfigurationError(f"strategy options {options} need a 'name' (one of {', '.join(STRATEGIES)}).")
    else:
        name, options = spec, {}
    name = "single" if name == "auto" else str(name)
    if name not in STRATEGIES:
        raise MisconfigurationError(
            f"strategy={name!r} is not known{closest(name, STRATEGIES)}; known strategies: {', '.join(STRATEGIES)}."
        )
    cls = STRATEGIES[name]
    try:
        return cls(**options)
    except TypeError as err:
        raise MisconfigurationError(f"strategy {name!r} options {options}: {err}.") from err


__all__ = ["STRATEGIES", "Strategy", "build_strategy"]
