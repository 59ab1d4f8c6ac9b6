"""Hook dispatch: a hook fires on every callback that overrides it, then on the module."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchyard.callbacks.base import Callback
from torchyard.trainer.module import TrainModule, overridden

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer

#: Hooks whose monitoring callbacks (checkpointing, early stopping) run after the module's, via `call_monitors`.
MONITORS_LAST = ("on_train_epoch_end",)


class Hooks:
    """The hooks of one stage: its callbacks and module are fixed once it starts, so each hook's targets are
    looked up once (the base classes' empty bodies are never called)."""

    def __init__(self, trainer: Trainer, callbacks: list[Callback], module: TrainModule | None) -> None:
        self.trainer, self.callbacks, self.module = trainer, callbacks, module
        self._targets: dict[str, tuple[list[Any], Any]] = {}  # hook -> (callback methods, module method)

    def call(self, hook: str, *args: Any) -> Any:
        """Fire `hook` on every callback, then on the module (where it has one); return the module's answer.
        For on_train_epoch_end, callbacks that monitor logged values wait for `call_monitors`."""
        targets = self._targets.get(hook)
        if targets is None:
            targets = self._targets[hook] = self._resolve(hook)
        for method in targets[0]:
            method(self.trainer, self.module, *args)
        return targets[1](*args) if targets[1] is not None else None

    def call_monitors(self, hook: str) -> None:
        """Fire `hook` on the callbacks that `call` left for later (`Callback.monitors`)."""
        for callback in self.callbacks:
            if callback.monitors and callback.uses_hook(hook):
                getattr(callback, hook)(self.trainer, self.module)

    def bound(self, hook: str) -> Callable[..., Any] | None:
        """A callable that fires `hook` as `call` does, or None when no callback and not the module overrides
        it. The training step resolves its per-step hooks through this once per fit and calls only the ones in use."""
        methods, module_hook = self._resolve(hook)
        if not methods:
            return module_hook
        if len(methods) == 1 and module_hook is None:
            return functools.partial(methods[0], self.trainer, self.module)
        return functools.partial(self.call, hook)

    def _resolve(self, hook: str) -> tuple[list[Any], Any]:
        """The callback and module methods that override `hook` (and that the callback says it uses)."""
        monitors_later = hook in MONITORS_LAST
        methods = [overridden(c, hook, Callback) for c in self.callbacks
                   if c.uses_hook(hook) and not (monitors_later and c.monitors)]
        return [m for m in methods if m is not None], overridden(self.module, hook, TrainModule)
