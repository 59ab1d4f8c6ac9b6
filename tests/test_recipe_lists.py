"""Recipe lists: a later callbacks list replaces the one before it (warning for each class it drops);
`callbacks+` (file key or override) appends to it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from torchyard.trainer.cli.main import main
from torchyard.trainer.cli.recipe import load_recipe
from torchyard.trainer.errors import MisconfigurationError

BASE = """
trainer: {name: base, max_epochs: 1}
model: {class_path: torchyard.recipes.digits.DigitsCNN}
data: {class_path: torchyard.recipes.digits.DigitsData}
callbacks:
  - {class_path: torchyard.callbacks.ModelCheckpoint, init_args: {monitor: val/acc, mode: max}}
"""
REPLACE = "callbacks:\n  - {class_path: torchyard.callbacks.EarlyStopping, init_args: {monitor: val/loss}}\n"
APPEND = "callbacks+:\n  - {class_path: torchyard.callbacks.EarlyStopping, init_args: {monitor: val/loss}}\n"
EARLY_STOP = "{class_path: torchyard.callbacks.EarlyStopping, init_args: {monitor: val/loss, patience: 7}}"


@pytest.fixture()
def recipes(tmp_path: Path) -> Path:
    for name, text in {"base.yaml": BASE, "replace.yaml": REPLACE, "append.yaml": APPEND}.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def classes(recipe) -> list[str]:
    return [spec.class_path for spec in recipe.callbacks]


def test_a_later_list_replaces_and_the_warning_names_what_it_dropped(recipes):
    with pytest.warns(UserWarning) as record:
        recipe = load_recipe(["base.yaml", "replace.yaml"])
    assert classes(recipe) == ["torchyard.callbacks.EarlyStopping"]
    assert len(record) == 1
    assert str(record[0].message) == (
        "replace.yaml: its callbacks list replaces the one before it, which drops "
        "torchyard.callbacks.ModelCheckpoint; to add "
        "to the list instead, write 'callbacks+:' in a file or callbacks+=... as an override."
    )
    assert record[0].filename == __file__  # the caller of load_recipe, not a framework line


def test_callbacks_plus_in_a_file_appends_without_a_warning(recipes):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = load_recipe(["base.yaml", "append.yaml"])
    assert classes(recipe) == ["torchyard.callbacks.ModelCheckpoint", "torchyard.callbacks.EarlyStopping"]
    assert recipe.callbacks[0].init_args["monitor"] == "val/acc"
    assert recipe.callbacks[1].init_args["monitor"] == "val/loss"
    # Both kinds of instance are built, with their arguments.
    checkpoint, early_stopping = (spec.instantiate() for spec in recipe.callbacks)
    assert (checkpoint.monitor, checkpoint.mode, early_stopping.monitor) == ("val/acc", "max", "val/loss")


def test_a_file_may_replace_then_append(recipes):
    (recipes / "both.yaml").write_text(REPLACE + APPEND.replace("EarlyStopping", "Timer").replace(
        "{monitor: val/loss}", "{duration: 60}"))
    with pytest.warns(UserWarning, match="drops torchyard.callbacks.ModelCheckpoint"):
        recipe = load_recipe(["base.yaml", "both.yaml"])
    assert classes(recipe) == ["torchyard.callbacks.EarlyStopping", "torchyard.callbacks.Timer"]


def test_callbacks_plus_override_appends_one_entry_or_a_list(recipes):
    recipe = load_recipe(["base.yaml", f"callbacks+={EARLY_STOP}"])
    assert classes(recipe) == ["torchyard.callbacks.ModelCheckpoint", "torchyard.callbacks.EarlyStopping"]
    assert recipe.callbacks[1].init_args["patience"] == 7
    recipe = load_recipe(["base.yaml", f"callbacks+=[{EARLY_STOP}, {{class_path: torchyard.callbacks.Timer}}]",
                          "callbacks.2.init_args.duration=30"])  # an appended entry takes dotted overrides after
    assert classes(recipe) == [
        "torchyard.callbacks.ModelCheckpoint",
        "torchyard.callbacks.EarlyStopping",
        "torchyard.callbacks.Timer",
    ]
    assert recipe.callbacks[2].init_args["duration"] == 30


def test_an_appended_entry_is_checked_and_interpolations_resolve_at_the_end(recipes):
    with pytest.raises(MisconfigurationError, match="callbacks.1.init_args.monitr: EarlyStopping does not take"):
        load_recipe(["base.yaml", "callbacks+={class_path: torchyard.callbacks.EarlyStopping, init_args: {monitr: x}}"])
    with pytest.raises(MisconfigurationError, match="unknown key 'callbacks.0.init_arg'"):
        load_recipe(["base.yaml", "callbacks+={class_path: torchyard.callbacks.EarlyStopping, init_arg: {}}"])
    with pytest.raises(MisconfigurationError, match=r"appends a \{class_path: \.\.\., init_args: \.\.\.\} entry"):
        load_recipe(["base.yaml", "callbacks+=3"])
    follows_the_first = "{monitor: '${callbacks.0.init_args.monitor}'}"  # quoted: ${ inside a YAML flow mapping
    appended = f"callbacks+={{class_path: torchyard.callbacks.EarlyStopping, init_args: {follows_the_first}}}"
    recipe = load_recipe(["base.yaml", appended, "callbacks.0.init_args.monitor=val/loss"])
    assert recipe.callbacks[1].init_args["monitor"] == "val/loss"


def test_an_override_that_replaces_the_list_warns_too(recipes):
    with pytest.warns(UserWarning, match=r"override 'callbacks=\[\]': its callbacks list replaces .* drops "
                                         r"torchyard\.callbacks\.ModelCheckpoint") as record:
        assert load_recipe(["base.yaml", "callbacks=[]"]).callbacks == []
    assert record[0].filename == __file__
    with warnings.catch_warnings():  # the same classes again, with other arguments: nothing is dropped
        warnings.simplefilter("error")
        recipe = load_recipe(["base.yaml", "callbacks=[{class_path: torchyard.callbacks.ModelCheckpoint}]"])
    assert recipe.callbacks[0].init_args["monitor"] is None


def test_the_command_shows_the_merge_warning_as_one_line_without_a_python_location(recipes, capsys):
    assert main(["config", "base.yaml", "replace.yaml"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "Warning: replace.yaml: its callbacks list replaces the one before it, which drops "
        "torchyard.callbacks.ModelCheckpoint; to add to the list instead, write 'callbacks+:' in a file "
        "or callbacks+=... as an override.\n"
    )
    assert "EarlyStopping" in captured.out and "ModelCheckpoint" not in captured.out
    assert main(["config", "base.yaml", "append.yaml"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "EarlyStopping" in captured.out and "ModelCheckpoint" in captured.out
