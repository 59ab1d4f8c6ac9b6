"""The `compile` option: `Trainer(compile=True)` or a mapping of CompileOptions' fields, checked before any process
starts. No torch import here: the option schema (config.py) reads it, and `trainer --help` must stay fast."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchyard.trainer.errors import MisconfigurationError, closest

#: torch.compile's modes (inductor's); None is its default.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """How the strategy compiles the module (docs/strategies.md, "compile")."""

    #: torch.compile's backend: 'inductor' (generated kernels), or 'aot_eager' / 'eager' (tracing only, to debug).
    backend: str = "inductor"
    #: inductor's mode (one of MODES); None: its default.
    mode: str | None = None
    #: Fail at the first graph break, naming its file and line, instead of running the model in pieces.
    fullgraph: bool = False
    #: torch.compile's `dynamic`: True traces shapes as symbols, False specializes, None decides on a recompile.
    dynamic: bool | None = None
    #: Class names of the submodules to compile one by one (the repeated block, as fsdp's shard units); empty: the
    #: module's forward (or, where the module has none, each of its children holding parameters).
    regions: tuple[str, ...] = ()
    #: Where compiled artifacts are kept for the next start (a resume, a restart, the next run); None: the run's
    #: folder, <default_root_dir>/<name>/compile_cache. Name a shared folder to warm-start other runs too.
    cache_dir: str | None = None

    def torch_options(self) -> dict[str, Any]:
        """The keyword arguments of torch.compile."""
        return {"backend": self.backend, "mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic}


def compile_options(value: Any) -> CompileOptions | None:
    """The compile option as CompileOptions (None: off), checked; `value` is a bool, a mapping of CompileOptions'
    fields, or CompileOptions."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if isinstance(value, CompileOptions):
        return _checked(value)
    fields = [f.name for f in dataclasses.fields(CompileOptions)]
    if not isinstance(value, Mapping):
        raise MisconfigurationError(f"compile={value!r}: use true, or a mapping such as "
                                    "{mode: max-autotune, regions: [Block]} (keys: " + ", ".join(fields) + ").")
    for key in value:
        if key not in fields:
            raise MisconfigurationError(f"unknown compile option {key!r}{closest(str(key), fields)}; compile takes "
                                        f"{', '.join(fields)}.")
    options = dict(value)
    regions = options.get("regions") or ()
    if isinstance(regions, str) or not isinstance(regions, Sequence):
        raise MisconfigurationError(f"compile.regions={regions!r} must be a list of class names, e.g. [Block].")
    options["regions"] = tuple(regions)
    return _checked(CompileOptions(**options))


def _checked(options: CompileOptions) -> CompileOptions:
    if not isinstance(options.backend, str) or not options.backend:
        raise MisconfigurationError(f"compile.backend={options.backend!r} must name a torch.compile backend, "
                                    "e.g. 'inductor' or 'aot_eager'.")
    if options.mode is not None and options.mode not in MODES:
        raise MisconfigurationError(f"compile.mode={options.mode!r} is not known; use one of {', '.join(MODES)} "
                                    "or leave it unset.")
    if options.mode is not None and options.backend != "inductor":
        raise MisconfigurationError(f"compile.mode={options.mode!r} is inductor's, but compile.backend="
                                    f"{options.backend!r}; drop mode or use backend 'inductor'.")
    if not isinstance(options.fullgraph, bool):
        raise MisconfigurationError(f"compile.fullgraph={options.fullgraph!r} must be true or false.")
    if options.dynamic is not None and not isinstance(options.dynamic, bool):
        raise MisconfigurationError(f"compile.dynamic={options.dynamic!r} must be true, false or unset.")
    if not all(isinstance(name, str) and name for name in options.regions):
        raise MisconfigurationError(f"compile.regions={list(options.regions)!r} must be class names (strings).")
    if options.cache_dir is not None and not isinstance(options.cache_dir, str):
        raise MisconfigurationError(f"compile.cache_dir={options.cache_dir!r} must be a folder path (a string).")
    return options


def cache_folder(options: CompileOptions | None, default_root_dir: str, name: str) -> Path:
    """Where compiled artifacts are kept: compile.cache_dir, else the run's <default_root_dir>/<name>/compile_cache,
    which every version of the run (a resume, a restart, the next run of the recipe) shares. Absolute: the job's
    processes start in this one's folder, but a user's script may change it later."""
    given = options.cache_dir if options is not None else None
    return Path(given if given else Path(default_root_dir) / name / "compile_cache").absolute()
