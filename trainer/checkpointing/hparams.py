"""Hyperparameter helpers: the arguments an __init__ was called with, and what a class can be built with."""

from __future__ import annotations

import inspect
import typing
from typing import Any


def constructor_parameters(
    cls: type, argless_bases: tuple[type, ...]
) -> tuple[dict[str, tuple[inspect.Parameter, Any]], bool]:
    """{name: (parameter, type hint)} an instance can be built with, following **kwargs up the MRO.

    The second value is True when the class accepts any keyword: its **kwargs never reach a parent
    that would check them (they stop at one of `argless_bases`, whose __init__ takes no user arguments).
    """
    found: dict[str, tuple[inspect.Parameter, Any]] = {}
    followed_kwargs = False
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        if klass in argless_bases:
            return found, followed_kwargs
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # an annotation that does not evaluate: skip type checks, keep the names
            hints = {}
        signature = inspect.signature(init)
        for name, parameter in list(signature.parameters.items())[1:]:
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                found.setdefault(name, (parameter, hints.get(name)))
        if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            return found, False
        followed_kwargs = True
    return found, True


class AttributeDict(dict):
    """A dict whose keys read as attributes: `self.hparams.lr`."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:
            raise AttributeError(f"hparams has no {key!r}; it holds {sorted(self)}") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def init_args(
    frame: Any, owner: Any, names: tuple[str, ...] = (), ignore: list[str] | str | None = None
) -> dict[str, Any]:
    """The arguments of the __init__ running in `frame` and of every __init__ of `owner` that called it (a
    subclass's, through super().__init__), which save_hyperparameters keeps. The outermost call's values win:
    they are what rebuilding the same class takes."""
    values: dict[str, Any] = {}
    first = frame
    while frame is not None and (
        frame is first or frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is owner
    ):
        args = inspect.getargvalues(frame)
        own = {name: args.locals[name] for name in args.args if name != "self"}
        if args.keywords:
            own.update(args.locals[args.keywords])
        values.update(own)
        frame = frame.f_back
    ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
    return {k: v for k, v in values.items() if k not in ignored and k != "__class__" and (not names or k in names)}
