"""Strategy registry: `Trainer(strategy="ddp")`, `strategy={"name": "ddp", ...options}`, or an instance."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from torchyard.trainer.errors import MisconfigurationError, closest
from torchyard.trainer.strategies.base import Strategy

#: name -> "module:class", imported when that strategy is built: importing the Trainer pays for none of them
#: (ps's torch.distributed.rpc alone takes about 80 ms to import).
STRATEGIES: dict[str, str] = {
    "single": "torchyard.trainer.strategies.single:SingleDeviceStrategy",
    "dp": "torchyard.trainer.strategies.dp:DataParallelStrategy",
    "ddp": "torchyard.trainer.strategies.ddp:DDPStrategy",
    "fsdp": "torchyard.trainer.strategies.fsdp:FSDPStrategy",
    "pipeline": "torchyard.trainer.strategies.pipeline.strategy:PipelineStrategy",
    "ps": "torchyard.trainer.strategies.ps.strategy:ParameterServerStrategy",
}

#: name -> its fault-tolerant form (live recovery on torchft, strategies/ft), built where the options hold
#: `fault_tolerance`.
FAULT_TOLERANT: dict[str, str] = {"ddp": "torchyard.trainer.strategies.ft.strategy:FaultTolerantDDPStrategy"}


def build_strategy(spec: str | Mapping[str, Any] | Strategy, processes: int = 1) -> Strategy:
    """A Strategy from a registry name, a mapping `{name: ..., **options}`, or an instance; 'auto' is 'ddp' for a
    job of several `processes` (devices x num_nodes), as Lightning's "auto" picks, else 'single'."""
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("name", None)
        if name is None:
            raise MisconfigurationError(f"strategy options {options} need a 'name' (one of {', '.join(STRATEGIES)}).")
    else:
        name, options = spec, {}
    if name == "auto":
        name = "ddp" if processes > 1 else "single"
    name = str(name)
    if name not in STRATEGIES:
        raise MisconfigurationError(
            f"strategy={name!r} is not known{closest(name, STRATEGIES)}; known strategies: {', '.join(STRATEGIES)}."
        )
    path = STRATEGIES[name]
    if "fault_tolerance" in options:
        if name not in FAULT_TOLERANT:
            raise MisconfigurationError(
                f"strategy {name!r} cannot run fault_tolerance (live recovery on torchft runs on "
                f"{', '.join(FAULT_TOLERANT)}; fsdp is not built yet); use strategy={{'name': 'ddp', "
                "'fault_tolerance': {...}} or drop fault_tolerance.")
        path = FAULT_TOLERANT[name]
    module, _, class_name = path.partition(":")
    cls = getattr(importlib.import_module(module), class_name)
    parameters = inspect.signature(cls).parameters.values()
    known = [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    for key in options:
        if key not in known and not takes_any:
            raise MisconfigurationError(f"strategy {name!r} has no option {key!r}{closest(key, known)}; its options: "
                                        f"{', '.join(known) or 'none'}.")
    try:
        return cls(**options)
    except TypeError as err:
        raise MisconfigurationError(f"strategy {name!r} options {options}: {err}.") from err


__all__ = ["STRATEGIES", "Strategy", "build_strategy"]
