"""Class entries of a recipe checked against the class: its import, its base class, and its __init__ signature
(names, defaults and simple type hints), so a typo fails before anything is built."""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from typing import Any, Union

from torch import nn

from torchyard.callbacks.base import Callback
from torchyard.trainer.checkpointing.hparams import constructor_parameters
from torchyard.trainer.datamodule import DataModule
from torchyard.trainer.errors import MisconfigurationError, closest
from torchyard.trainer.module import TrainModule

# __init__s that take no user arguments: **kwargs that would reach them are the subclass's own.
_ARGLESS_BASES = (object, nn.Module, TrainModule, DataModule, Callback)


def import_class(where: str, class_path: str, base: type) -> type:
    """The class `class_path` names, which must be a subclass of `base`."""
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        raise MisconfigurationError(
            f"{where}.class_path={class_path!r} needs its module, e.g. 'torchyard.recipes.digits.DigitsCNN'."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise MisconfigurationError(f"{where}.class_path={class_path!r}: no module named {err.name!r}; "
                                        "check the spelling, or install the package that provides it.") from err
        raise MisconfigurationError(
            f"{where}.class_path={class_path!r}: importing {module_name!r} failed: {err}."
        ) from err
    except Exception as err:  # the user's module raised while importing: show what, in one line
        raise MisconfigurationError(f"{where}.class_path={class_path!r}: importing {module_name!r} raised "
                                    f"{type(err).__name__}: {err}.") from err
    cls = getattr(module, name, None)
    if cls is None:
        classes = [key for key, value in vars(module).items() if isinstance(value, type)]
        raise MisconfigurationError(f"{where}.class_path={class_path!r}: module {module_name!r} has no {name!r}"
                                    f"{closest(name, classes)}.")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        what = f"class {cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise MisconfigurationError(f"{where}.class_path={class_path!r} is {what}, not a {base.__name__} subclass; "
                                    f"{where} must name a {base.__name__}.")
    return cls


def check_init_args(where: str, cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """`given` checked against the class signature, completed with the signature's plain defaults."""
    parameters, takes_any = init_parameters(cls)
    for name, value in given.items():
        if name not in parameters:
            if takes_any:
                continue
            raise MisconfigurationError(
                f"{where}.init_args.{name}: {cls.__name__} does not take {name!r}"
                f"{closest(name, parameters)}; it takes {', '.join(parameters) or 'no arguments'}."
            )
        hint = parameters[name][1]
        if hint is not None and not _type_ok(value, hint):
            raise MisconfigurationError(f"{where}.init_args.{name}={value!r}: {cls.__name__} expects "
                                        f"{_type_name(hint)}, got {_value_kind(value)}.")
    complete: dict[str, Any] = {}
    for name, (parameter, _) in parameters.items():
        if name in given:
            complete[name] = given[name]
        elif parameter.default is inspect.Parameter.empty:
            raise MisconfigurationError(f"{where}.init_args: {cls.__name__} needs {name!r} (it has no default); "
                                        f"add it, e.g. {where}.init_args.{name}=VALUE.")
        elif is_plain(parameter.default):
            complete[name] = plain_default(parameter.default)
    complete.update({name: value for name, value in given.items() if name not in complete})
    return complete


def init_parameters(cls: type) -> tuple[dict[str, tuple[inspect.Parameter, Any]], bool]:
    """{name: (parameter, type hint)} an instance of `cls` can be built with; True when it takes any keyword."""
    return constructor_parameters(cls, _ARGLESS_BASES)


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether `value` fits a simple annotation; annotations this cannot judge pass."""
    origin = typing.get_origin(hint) or hint
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    checks = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        type(None): lambda v: v is None,
        list: lambda v: isinstance(v, list),
        tuple: lambda v: isinstance(v, list),
        dict: lambda v: isinstance(v, dict),
    }
    check = checks.get(origin)
    if check is None or not check(value):
        return check is None
    args = typing.get_args(hint)
    if origin is list and args:
        return all(_type_ok(v, args[0]) for v in value)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_type_ok(v, args[0]) for v in value)
        return len(value) == len(args) and all(_type_ok(v, arg) for v, arg in zip(value, args))
    if origin is dict and len(args) == 2:
        return all(_type_ok(k, args[0]) and _type_ok(v, args[1]) for k, v in value.items())
    return True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    args = [arg for arg in typing.get_args(hint) if arg is not Ellipsis]
    if origin in (list, tuple) and args:  # as a recipe writes them
        return f"a list of {' and '.join(sorted({_type_name(arg) for arg in args}))}"
    if origin is dict and len(args) == 2:
        return f"a mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    yaml_names = {tuple: "a list", list: "a list", dict: "a mapping", type(None): "null"}
    return yaml_names.get(origin, getattr(origin, "__name__", str(hint)))


def _value_kind(value: Any) -> str:
    """What a recipe value is, in the words of _type_name ("a list of int")."""
    if isinstance(value, list):
        kinds = sorted({_value_kind(v) for v in value})
        return f"a list of {' and '.join(kinds)}" if kinds else "an empty list"
    return "a mapping" if isinstance(value, dict) else "null" if value is None else type(value).__name__


def plain_default(value: Any) -> Any:
    """A default as a recipe writes it (tuples as lists)."""
    return [plain_default(v) for v in value] if isinstance(value, (list, tuple)) else value


def is_plain(value: Any) -> bool:
    """Whether a default can be written to YAML and read back unchanged."""
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))
