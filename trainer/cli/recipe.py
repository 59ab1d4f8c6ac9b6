"""Recipes: YAML files that name a model, its data, callbacks and the trainer options, checked before anything runs.

    trainer:    TrainerConfig fields: typed, with defaults (`trainer config --reference` lists them)
    model:      {class_path: a TrainModule subclass, init_args: {...}}
    data:       {class_path: a DataModule subclass, init_args: {...}}
    callbacks:  [{class_path: a Callback subclass, init_args: {...}}, ...]
    ckpt_path:  a checkpoint to start from: a path, or "last" (the newest last.ckpt of this run name)

Sources apply left to right: recipe files merge, `dotted.key=value` overrides set one value each
(parsed as YAML). `${...}` interpolations resolve after the last source, so an override can change
what they point at. Every class and init argument is checked against the class signature here, in
the calling process, so a typo fails in a second instead of after a process group has started.

Mappings merge key by key; lists are values and a later source replaces them whole, as in
LightningCLI and Hydra. The callbacks list can also be appended to, with LightningCLI's `+`:

    callbacks:  [...]      in a later file: replaces the list before it (a warning names each class it drops)
    callbacks+: [...]      in a later file: appends its entries to the list before it
    callbacks+={class_path: torchyard.callbacks.EarlyStopping, init_args: {monitor: val/loss}}    an override that
                           appends one entry (or a list of entries)
    callbacks.0.init_args.monitor=val/acc    an override that changes entry 0 in place

A file may hold both keys: `callbacks` replaces first, then `callbacks+` appends.
"""

from __future__ import annotations

import io
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from torchyard.callbacks.base import Callback
from torchyard.trainer.cli.signatures import (
    check_init_args,
    import_class,
    init_parameters,
    is_plain,
    plain_default,
)
from torchyard.trainer.config import TrainerConfig, make_config, option_names
from torchyard.trainer.datamodule import DataModule
from torchyard.trainer.errors import MisconfigurationError, closest
from torchyard.trainer.logs.runs import dump_yaml
from torchyard.trainer.module import TrainModule
from torchyard.trainer.strategies import build_strategy

__all__ = ["ClassSpec", "Recipe", "check_init_args", "class_spec", "import_class", "init_parameters", "is_override",
           "load_recipe", "read_recipe_file"]

TOP_LEVEL_KEYS = ("trainer", "model", "data", "callbacks", "ckpt_path")
APPEND = "callbacks+"  # the key (in a file) or override key that appends to the callbacks list
CLASS_KEYS = ("class_path", "init_args")
SECTION_BASES: dict[str, type] = {"model": TrainModule, "data": DataModule, "callbacks": Callback}
_KEY = re.compile(r"[A-Za-z_]\w*(\.\w+)*")
_OVERRIDE_KEY = re.compile(r"[A-Za-z_]\w*(\.\w+)*\+?")  # a trailing + appends (callbacks+=...)


@dataclass
class ClassSpec:
    """One `class_path` + `init_args` entry, checked against the class signature."""

    where: str  # the recipe key: "model", "data", "callbacks.0"
    class_path: str
    cls: type
    init_args: dict[str, Any]

    def instantiate(self) -> Any:
        return self.cls(**self.init_args)

    def to_dict(self) -> dict[str, Any]:
        return {"class_path": self.class_path, "init_args": dict(self.init_args)}


@dataclass
class Recipe:
    """A validated recipe: nothing instantiated yet."""

    trainer: TrainerConfig
    model: ClassSpec
    data: ClassSpec
    callbacks: list[ClassSpec]
    ckpt_path: str | None = None

    def trainer_options(self) -> dict[str, Any]:
        return asdict(self.trainer)

    def to_dict(self, with_ckpt_path: bool = True) -> dict[str, Any]:
        """The resolved recipe as plain containers; what `config.yaml` in a run folder holds."""
        resolved: dict[str, Any] = {
            "trainer": self.trainer_options(),
            "model": self.model.to_dict(),
            "data": self.data.to_dict(),
            "callbacks": [spec.to_dict() for spec in self.callbacks],
        }
        if with_ckpt_path and self.ckpt_path is not None:
            resolved["ckpt_path"] = self.ckpt_path
        return resolved

    def to_yaml(self, with_ckpt_path: bool = True) -> str:
        return dump_yaml(self.to_dict(with_ckpt_path))


# --------------------------------------------------------------------------- reading and merging


def import_from_cwd() -> None:
    """Put the working directory on sys.path: a console script does not, but recipes name classes in the user's
    own modules next to them, as `python script.py` would find them."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def load_recipe_to_run_elsewhere(sources: Sequence[str]) -> tuple[Recipe, list[str]]:
    """The recipe of `sources`, every check done here, and the sources with absolute file paths, for a command
    that runs it elsewhere (another host, a batch job) from another folder."""
    missing = [source for source in sources if not is_override(source) and not Path(source).is_file()]
    if missing:
        raise MisconfigurationError(f"recipe file {missing[0]!r} does not exist.")
    import_from_cwd()
    recipe = load_recipe(sources)
    return recipe, [source if is_override(source) else str(Path(source).resolve()) for source in sources]


def load_recipe(sources: Sequence[str | Path]) -> Recipe:
    """Merge recipe files and `key=value` overrides left to right, resolve, and validate everything."""
    merged: DictConfig = OmegaConf.create({"trainer": OmegaConf.structured(TrainerConfig)})
    dropped: list[str] = []  # warnings for callbacks a later list replaced: given once the recipe is valid
    if not any(not is_override(str(source)) for source in sources):
        raise MisconfigurationError(
            "no recipe file given; e.g. `trainer fit recipes/digits.yaml trainer.max_epochs=3`."
        )
    for source in map(str, sources):
        if is_override(source) and source.startswith(APPEND + "="):
            _append_callbacks(merged, _parse_override_value(source), f"override {source!r}")
        elif is_override(source):
            _apply_override(merged, source, dropped)
        else:
            layer = read_recipe_file(source)
            appended = layer.pop(APPEND, None)
            _check_keys(layer, source)
            dropped += _dropped_callbacks(merged, layer, source)
            _reset_changed_classes(merged, layer)
            merged = OmegaConf.merge(merged, layer)
            if appended is not None:
                _append_callbacks(merged, appended, f"{source}: {APPEND}")
    _fill_defaults(merged)
    resolved = OmegaConf.to_container(merged, resolve=True)
    recipe = _build(resolved)
    for message in dropped:
        warnings.warn(message, UserWarning, stacklevel=2)  # the line that loads the recipe
    return recipe


def _fill_defaults(merged: DictConfig) -> None:
    """Write each class's signature defaults into its init_args, so `${model.init_args.x}` finds them too."""
    entries = [(section, merged.get(section)) for section in ("model", "data")]
    callbacks = merged.get("callbacks")
    entries += [
        (f"callbacks.{i}", item) for i, item in enumerate(callbacks if isinstance(callbacks, ListConfig) else [])
    ]
    for where, entry in entries:
        if not isinstance(entry, DictConfig) or OmegaConf.is_interpolation(entry, "class_path"):
            continue  # malformed, or known only after resolution: _build checks those
        class_path, given = entry.get("class_path"), entry.get("init_args") or {}
        if not isinstance(class_path, str) or not isinstance(given, DictConfig | dict):
            continue
        base = SECTION_BASES[where.split(".")[0]]
        parameters, _ = init_parameters(import_class(where, class_path, base))
        defaults = {name: plain_default(parameter.default) for name, (parameter, _) in parameters.items()
                    if name not in given and is_plain(parameter.default)}
        if defaults:
            entry.init_args = OmegaConf.merge(defaults, given)


def is_override(token: str) -> bool:
    """`dotted.key=value` or `callbacks+=value` (a path that merely contains '=' is not one)."""
    key, eq, _ = token.partition("=")
    return bool(eq) and (_KEY.fullmatch(key) is not None or key == APPEND)


def _append_callbacks(merged: DictConfig, entries: Any, where: str) -> None:
    """Append one callback entry, or a list of them, to the merged callbacks list."""
    if isinstance(entries, DictConfig | dict):
        entries = [entries]
    if not isinstance(entries, ListConfig | list):
        raise MisconfigurationError(f"{where}: appends a {{class_path: ..., init_args: ...}} entry or a list of them; "
                                    f"got {entries!r}.")
    new = OmegaConf.to_container(OmegaConf.create(list(entries)), resolve=False)  # interpolations resolve at the end
    for index, item in enumerate(new):
        for key in item if isinstance(item, dict) else []:
            _check_path(["callbacks", str(index), str(key)], where)
    old = merged.get("callbacks")
    merged.callbacks = [*(OmegaConf.to_container(old, resolve=False) if isinstance(old, ListConfig) else []), *new]


def _dropped_callbacks(merged: DictConfig, layer: DictConfig, source: str) -> list[str]:
    """A warning (as a one-item list) when the layer's callbacks list replaces the list before it and a class
    of that list is then gone; an empty list when nothing is dropped."""
    old, new = merged.get("callbacks"), layer.get("callbacks")
    if not isinstance(old, ListConfig) or not isinstance(new, ListConfig):
        return []
    old_entries, new_entries = (OmegaConf.to_container(entries, resolve=False) for entries in (old, new))
    kept = {entry.get("class_path") for entry in new_entries if isinstance(entry, dict)}
    dropped = [str(entry.get("class_path")) for entry in old_entries
               if isinstance(entry, dict) and entry.get("class_path") not in kept]
    if not dropped:
        return []
    return [f"{source}: its callbacks list replaces the one before it, which drops {', '.join(dropped)}; "
            f"to add to the list instead, write '{APPEND}:' in a file or {APPEND}=... as an override."]


def read_recipe_file(path_text: str) -> DictConfig:
    """One recipe file as a DictConfig; missing files and YAML syntax errors say where."""
    path = Path(path_text)
    if path.is_dir():
        raise MisconfigurationError(f"recipe file {path_text!r} is a folder; give a YAML file.")
    if not path.is_file():
        if _KEY.fullmatch(path_text) and "." in path_text and path.suffix not in (".yaml", ".yml"):
            raise MisconfigurationError(f"{path_text!r} is neither a recipe file nor an override; write key=value, "
                                        f"e.g. {path_text}=VALUE.")
        siblings = [str(p) for p in (path.parent if path.parent.is_dir() else Path(".")).glob("*.y*ml")]
        raise MisconfigurationError(f"recipe file {path_text!r} not found{closest(path_text, siblings)}.")
    try:
        source = path.read_text(encoding="utf-8")  # read once: both parses below see the same text
        loaded = OmegaConf.load(io.StringIO(source))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = " ".join(str(part) for part in (err.context, err.problem) if part)
        raise MisconfigurationError(
            f"{path_text}: YAML syntax error at {where}: {problem}; fix the YAML there."
        ) from err
    except UnicodeDecodeError as err:
        raise MisconfigurationError(f"{path_text}: not UTF-8 text ({err.reason} at byte {err.start}); save it as "
                                    "UTF-8 (a shell or editor may have written UTF-16).") from err
    if loaded is None or (isinstance(loaded, DictConfig) and not loaded):
        return OmegaConf.create({})
    if not isinstance(loaded, DictConfig):
        raise MisconfigurationError(f"{path_text}: a recipe is a mapping with keys {', '.join(TOP_LEVEL_KEYS)}; "
                                    f"this file holds a {type(loaded).__name__}.")
    for keys, text in _base_60_scalars(yaml.compose(source, Loader=yaml.SafeLoader)):
        parent: Any = loaded
        for key in keys[:-1]:
            parent = (
                parent.get(key)
                if isinstance(parent, DictConfig)
                else parent[key]
                if isinstance(parent, ListConfig)
                else None
            )
        if isinstance(parent, ListConfig) or isinstance(parent, DictConfig) and keys[-1] in parent:
            parent[keys[-1]] = text  # YAML 1.1 reads `max_time: 1:12:00:00` as 259200 (base 60): a duration is meant
    return loaded


def _base_60_scalars(node: yaml.Node | None, keys: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """(key path, text) of each unquoted number YAML 1.1 reads in base 60 (`1:30` is 90) under `node`."""
    if isinstance(node, yaml.MappingNode):
        merged = [pair for pair in node.value if pair[0].tag == "tag:yaml.org,2002:merge"]
        own = [pair for pair in node.value if pair not in merged]
        for key_node, value_node in own:
            yield from _base_60_scalars(value_node, (*keys, key_node.value))
        # `<<: *anchor` (or a list of them) brings the anchored mapping's keys here, where this one sets none.
        taken = {key_node.value for key_node, _ in own}
        for _, value_node in merged:
            for source in value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]:
                for key_node, inner in source.value if isinstance(source, yaml.MappingNode) else []:
                    if key_node.value not in taken:
                        taken.add(key_node.value)
                        yield from _base_60_scalars(inner, (*keys, key_node.value))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _base_60_scalars(item, (*keys, index))
    elif (isinstance(node, yaml.ScalarNode) and node.style is None and node.tag.endswith((":int", ":float"))
          and ":" in node.value):
        yield keys, node.value


def _check_keys(layer: DictConfig, source: str) -> None:
    """Unknown keys fail here, naming the closest valid ones."""
    for key in layer:
        if key not in TOP_LEVEL_KEYS:
            raise MisconfigurationError(f"{source}: unknown key {key!r}{closest(str(key), TOP_LEVEL_KEYS)}; "
                                        f"a recipe's keys are {', '.join(TOP_LEVEL_KEYS)}.")
    if "trainer" in layer and layer.trainer is None:
        del layer["trainer"]  # `trainer:` with every option commented out: nothing to set
    trainer = layer.get("trainer")
    if trainer is not None:
        if not isinstance(trainer, DictConfig):
            raise MisconfigurationError(f"{source}: 'trainer' must be a mapping of trainer options.")
        for key in trainer:
            _check_path(["trainer", str(key)], source)
    for section in ("model", "data"):
        value = layer.get(section)
        if isinstance(value, DictConfig):
            for key in value:
                _check_path([section, str(key)], source)
    callbacks = layer.get("callbacks")
    if callbacks is not None and not isinstance(callbacks, ListConfig):
        raise MisconfigurationError(f"{source}: 'callbacks' must be a list of {{class_path: ..., init_args: ...}}.")
    for index, item in enumerate(callbacks or []):
        for key in item if isinstance(item, DictConfig) else []:
            _check_path(["callbacks", str(index), str(key)], source)


def _check_path(parts: list[str], source: str) -> None:
    """Check one dotted key (as a list of parts) against the recipe schema."""
    head, rest = parts[0], parts[1:]
    if head not in TOP_LEVEL_KEYS:
        raise MisconfigurationError(f"{source}: unknown key {head!r}{closest(head, TOP_LEVEL_KEYS)}; "
                                    f"a recipe's keys are {', '.join(TOP_LEVEL_KEYS)}.")
    if head == "trainer" and rest and rest[0] not in option_names():
        raise MisconfigurationError(f"{source}: unknown trainer option {rest[0]!r}{closest(rest[0], option_names())}; "
                                    "`trainer config --reference` lists them all.")
    if head == "callbacks" and rest:
        if not rest[0].isdigit():
            raise MisconfigurationError(
                f"{source}: callbacks is a list; address an entry as callbacks.<index>.init_args.<name>."
            )
        rest = rest[1:]
    if head in ("model", "data", "callbacks") and rest and rest[0] not in CLASS_KEYS:
        bad_key = ".".join(parts[: len(parts) - len(rest) + 1])
        raise MisconfigurationError(f"{source}: unknown key {bad_key!r}{closest(rest[0], CLASS_KEYS)}; "
                                    f"a class entry has {' and '.join(CLASS_KEYS)}.")


_SEXAGESIMAL = re.compile(r"^\s*[-+]?\d+(:\d+)+\s*$")


def _apply_override(merged: DictConfig, token: str, dropped: list[str]) -> None:
    """Apply one `key=value`; a warning for callbacks it drops is added to `dropped`."""
    key, _, text = token.partition("=")
    _check_path(key.split("."), f"override {token!r}")
    value = _parse_override_value(token)
    parts = key.split(".")
    if parts[0] == "callbacks" and len(parts) > 1 and parts[1].isdigit():
        count = len(merged.get("callbacks") or [])
        if int(parts[1]) >= count:
            have = f"callbacks.0 to callbacks.{count - 1}" if count else "none"
            raise MisconfigurationError(f"override {token!r}: the recipe has {count} callback(s) ({have}); an override "
                                        "changes an entry, a new callback goes in a recipe file's callbacks list "
                                        f"(or {APPEND}: there), or an override {APPEND}={{class_path: ...}} "
                                        "appends one.")
    layer = OmegaConf.create(_nest(parts, value))
    if "." not in key:  # a whole section (`trainer=3`) must have the section's shape
        _check_keys(layer, f"override {token!r}")
        dropped += _dropped_callbacks(merged, layer, f"override {token!r}")
    _reset_changed_classes(merged, layer)
    OmegaConf.update(merged, key, value, merge=True)


def _parse_override_value(token: str) -> Any:
    """The value of `key=value`, parsed as YAML; interpolations stay unresolved."""
    key, _, text = token.partition("=")
    # Parse the value the way omegaconf parses a dotlist (YAML), without resolving interpolations yet.
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]), resolve=False)["value"]
        if isinstance(value, int) and _SEXAGESIMAL.match(text):  # YAML 1.1 reads 1:30 as 90: a duration is meant
            value = text.strip()
    except OmegaConfBaseException as err:
        reason = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
        raise MisconfigurationError(f"override {token!r}: cannot parse the value ({reason}); an interpolation "
                                    "reads ${other.key}, and \\${ is a literal '${'.") from err
    except yaml.YAMLError as err:  # the value is read as YAML: `{...}` is a mapping there, `a: b` one too
        reason = " ".join(str(err).split())
        raise MisconfigurationError(f"override {token!r}: the value is not valid YAML ({reason}); quote it: "
                                    f"{key}=\"'{text}'\".") from err
    return value


def _nest(parts: list[str], value: Any) -> dict[str, Any]:
    return {parts[0]: _nest(parts[1:], value) if len(parts) > 1 else value}


def _reset_changed_classes(merged: DictConfig, layer: DictConfig) -> None:
    """A layer that names a different class starts its init_args afresh (the old ones belong to the old class)."""
    for section in ("model", "data"):
        if _names_another_class(layer.get(section), merged.get(section)):
            merged[section] = {}
    # Likewise a strategy of another name: ps's options mean nothing to ddp.
    new_trainer, old_trainer = layer.get("trainer"), merged.get("trainer")
    if isinstance(new_trainer, DictConfig) and isinstance(old_trainer, DictConfig):
        if _names_another_class(new_trainer.get("strategy"), old_trainer.get("strategy"), key="name"):
            old_trainer.strategy = {}
    # A file's callbacks list replaces the old list whole; an override such as callbacks.0.class_path=...
    # arrives as {"callbacks": {"0": {...}}} and merges into the entry it addresses.
    new_entries, old_entries = layer.get("callbacks"), merged.get("callbacks")
    if isinstance(new_entries, DictConfig) and isinstance(old_entries, ListConfig):
        for index, new in new_entries.items_ex(resolve=False):  # interpolations resolve after the last source
            position = int(index) if str(index).isdigit() else -1
            if 0 <= position < len(old_entries) and _names_another_class(new, old_entries[position]):
                old_entries[position] = {}


def _names_another_class(new: Any, old: Any, key: str = "class_path") -> bool:
    return isinstance(new, DictConfig) and isinstance(old, DictConfig) and key in new and new.get(key) != old.get(key)


# --------------------------------------------------------------------------- validation


def _build(resolved: dict[str, Any]) -> Recipe:
    trainer = make_config(resolved.get("trainer") or {})
    build_strategy(trainer.strategy)  # an unknown name fails here too, listing the known ones
    sections = {}
    for section in ("model", "data"):
        if resolved.get(section) is None:
            raise MisconfigurationError(f"the recipe has no {section!r} section; add "
                                        f"{section}: {{class_path: <module>.<Class>, init_args: {{...}}}}.")
        sections[section] = class_spec(section, resolved[section], SECTION_BASES[section])
    if not isinstance(resolved.get("callbacks") or [], list):
        raise MisconfigurationError("callbacks must be a list of {class_path: ..., init_args: ...} entries.")
    callbacks = [class_spec(f"callbacks.{i}", item, Callback) for i, item in enumerate(resolved.get("callbacks") or [])]
    ckpt_path = resolved.get("ckpt_path")
    if ckpt_path is not None and not isinstance(ckpt_path, str):
        raise MisconfigurationError(f"ckpt_path={ckpt_path!r} must be a checkpoint path or 'last'.")
    return Recipe(trainer, sections["model"], sections["data"], callbacks, ckpt_path)


def class_spec(where: str, entry: Any, base: type) -> ClassSpec:
    """Check one class entry: the class imports, subclasses `base`, and takes exactly these init_args."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("class_path"), str):
        raise MisconfigurationError(
            f"{where} needs class_path: <module>.<Class> (a {base.__name__} subclass); got {entry!r}."
        )
    init_args = entry.get("init_args") or {}
    if not isinstance(init_args, Mapping):
        raise MisconfigurationError(
            f"{where}.init_args must be a mapping of argument names to values; got {init_args!r}."
        )
    cls = import_class(where, entry["class_path"], base)
    return ClassSpec(where, entry["class_path"], cls, check_init_args(where, cls, dict(init_args)))
