"""Applying torch.compile where the strategy says, after it wrapped or sharded the module.

Each compiled part keeps its class and its parameters: the strategy replaces the part's `forward`, on the instance,
by a compiled one. So state_dict keys stay plain (no `_orig_mod.`), the wrappers' hooks (DDP's, FSDP's gathers) run
eagerly around the compiled code, and a module's steps (training_step calling self(x)) run it compiled. torch's own
`Module.compile()` compiles `_call_impl`, whose frame dynamo skips for torch's own classes (nn.Sequential, nn.Linear:
nothing was compiled, measured on torch 2.13); the function compiled here, _call_forward, is user code to dynamo,
which inlines any forward from it.

A module the user compiled (`torch.compile(module)`, an OptimizedModule, at the top or as a submodule) is unwrapped
before the stage: its plain module trains, and its compile context goes with it (a picklable attribute, so that the
job's other processes get it) to be applied to the plain forward the same way.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from torchyard.trainer.compile.options import CompileOptions
from torchyard.trainer.compile.report import CompileRecord, graph_break_message
from torchyard.trainer.errors import MisconfigurationError

#: The attribute of a plain module that holds the compile contexts of the parts the user compiled, by qualified name
#: ("" for the module itself).
USER_CONTEXTS = "torchyard_compile_contexts"


def unwrap_compiled(module: Any) -> Any:
    """`module`, with every torch.compile(...) wrapper in it (and itself, if it is one) replaced by the module it
    wraps; the wrappers' compile contexts are kept on the result (USER_CONTEXTS) for compile_parts."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process: no wrapper to find (and no import)
        return module
    from torch._dynamo.eval_frame import OptimizedModule

    contexts: dict[str, Any] = {}
    if isinstance(module, OptimizedModule):
        contexts[""] = module.dynamo_ctx
        module = _inner(module)
    if not isinstance(module, nn.Module):
        return module
    for name, child in list(module.named_modules()):
        for child_name, grandchild in list(child.named_children()):
            if isinstance(grandchild, OptimizedModule):
                contexts[f"{name}.{child_name}".lstrip(".")] = grandchild.dynamo_ctx
                setattr(child, child_name, _inner(grandchild))
    if contexts:
        module.__dict__[USER_CONTEXTS] = {**module.__dict__.get(USER_CONTEXTS, {}), **contexts}
    return module


def _inner(compiled: nn.Module) -> nn.Module:
    # OptimizedModule keeps the module it wraps as `_orig_mod` (torch's state-dict hooks strip that same name).
    return compiled._orig_mod


def compile_targets(parts: Sequence[nn.Module], options: CompileOptions | None,
                    module: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """(name, submodule, how) for each thing to compile: with `options`, the regions of `parts` (the module, or a
    pipeline rank's stages) it names, else each part's forward; with None, what the user compiled of `module`
    (unwrap_compiled), `how` being its compile context."""
    if options is None:
        contexts = module.__dict__.get(USER_CONTEXTS, {})
        named = dict(module.named_modules()) if contexts else {}
        return [(name, named[name], context) for name, context in contexts.items() if name in named]
    targets = [(_qualified(index, part is module, name), target, options)
               for index, part in enumerate(parts) for name, target in _targets(part, options.regions)]
    if options.regions and not targets:
        present = sorted({own_class(m).__name__ for part in parts for m in part.modules()})
        raise MisconfigurationError(f"compile.regions={list(options.regions)}: the module has no submodule of those "
                                    f"classes; its classes: {', '.join(present)}.")
    return targets


def compile_parts(targets: list[tuple[str, nn.Module, Any]]) -> list[str]:
    """Compile each of compile_targets' targets in place; their names (with class names), for the report."""
    import torch

    for _, target, how in targets:
        if isinstance(how, CompileOptions):
            compile_fn: Any = functools.partial(torch.compile, **how.torch_options())
            _compile_forward(target, compile_fn, how, how.fullgraph)
        else:  # the user's torch.compile context, applied as it was
            _compile_forward(target, how, ("user", id(how)), bool(how.fullgraph))
    return [_label(name, target) for name, target, _ in targets]


def _targets(part: nn.Module, regions: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """What to compile in `part`: the submodules of the region classes, else its forward, else (a TrainModule that
    defines none: its steps call its children) each child holding parameters."""
    if regions:
        return [(name, m) for name, m in part.named_modules() if own_class(m).__name__ in regions]
    if type(part).forward is not nn.Module.forward:
        return [("", part)]
    return [(name, child) for name, child in part.named_children() if any(True for _ in child.parameters())]


def _qualified(index: int, is_module: bool, name: str) -> str:
    """A target's name for the report: its path in the module, or in this rank's index-th pipeline stage."""
    return name if is_module else f"stage part {index}" + (f" {name}" if name else "")


def _label(name: str, module: nn.Module) -> str:
    return f"{name or 'the module'} ({own_class(module).__name__})"


def own_class(module: nn.Module) -> type:
    """The module's own class: fsdp's fully_shard swaps a unit's class for a subclass of it (FSDPBlock for Block)."""
    return next((cls for cls in type(module).__mro__ if not cls.__module__.startswith("torch.distributed.")),
                type(module))


def _call_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The frame dynamo traces: user code to it, from which it inlines any forward, torch's own classes' too."""
    return type(module).forward(module, *args, **kwargs)


#: (module class, compile key) -> a copy of _call_forward with its own code object. dynamo keeps compiled code, and
#: counts recompilations against its limit, per code object: one per class keeps the blocks of one class sharing
#: their compiled code, and the classes (and differently compiled copies) apart.
_ENTRIES: dict[tuple[type, Any], Callable[..., Any]] = {}


def _entry(module_class: type, key: Any) -> Callable[..., Any]:
    entry = _ENTRIES.get((module_class, key))
    if entry is None:
        code = _call_forward.__code__.replace(co_name=f"{module_class.__name__}_forward")
        entry = _ENTRIES[(module_class, key)] = types.FunctionType(code, globals(), code.co_name)
    return entry


class CompiledForward:
    """A module's compiled forward, set on the instance. It pickles (and deep-copies) as the class's eager forward
    of the copy: compiled code does not travel, and a job's processes compile their own."""

    def __init__(self, module: nn.Module, compile_fn: Callable[[Callable[..., Any]], Any], key: Any,
                 fullgraph: bool) -> None:
        self.module_class, self.module_ref = type(module), weakref.ref(module)
        self.compiled, self.fullgraph = compile_fn(_entry(type(module), key)), fullgraph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.fullgraph:
            return self.compiled(self.module_ref(), *args, **kwargs)
        try:
            return self.compiled(self.module_ref(), *args, **kwargs)
        except Exception as error:
            message = graph_break_message(error)  # the first break fails fullgraph: one line, not dynamo's page
            if message is None:
                raise
            raise MisconfigurationError(message) from None

    def __reduce__(self) -> tuple[Any, ...]:
        return functools.partial, (self.module_class.forward, self.module_ref())


def _compile_forward(module: nn.Module, compile_fn: Callable[[Callable[..., Any]], Any], key: Any,
                     fullgraph: bool) -> None:
    """Replace `module`'s forward, on the instance, by its compiled self (once: a later stage of the same module
    finds it compiled)."""
    if not isinstance(vars(module).get("forward"), CompiledForward):
        module.forward = CompiledForward(module, compile_fn, key, fullgraph)


def uncompile(module: nn.Module) -> None:
    """Give every compiled part of `module` its class's forward back."""
    for part in module.modules():
        if isinstance(vars(part).get("forward"), CompiledForward):
            del part.forward


def start_compile(parts: Sequence[nn.Module], options: CompileOptions | None, module: nn.Module, cache_dir: Path,
                  reports: bool) -> CompileRecord | None:
    """Compile `parts` of `module` (see compile_parts), with inductor's cache in `cache_dir`; the record of it, or
    None where nothing is to be compiled. `reports`: this rank keeps the cold start's time for the warm ones."""
    targets = compile_targets(parts, options, module)
    if not targets:
        return None
    backend = options.backend if options is not None else "the module's own torch.compile"
    record = CompileRecord([], backend, cache_dir, reports)  # before compiling: it points torch at the cache
    try:
        record.compiled = compile_parts(targets)
    except BaseException:
        record.close()
        raise
    return record


def stop_compile(record: CompileRecord | None) -> None:
    """At the stage's end, release the record's hold on torch's log and cache setting. The module stays compiled,
    as torch.compile's would: a validate or predict after the fit reuses its compiled code (uncompile undoes it)."""
    if record is not None:
        record.close()
