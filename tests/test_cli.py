"""The `trainer` command: recipe merging, overrides, interpolation, and one-line errors before anything runs."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from torchyard.trainer.cli.main import main
from torchyard.trainer.cli.options_table import readme_reference, reference_table, update_readme
from torchyard.trainer.cli.recipe import init_parameters, load_recipe
from torchyard.trainer.config import option_names, parse_duration
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.preflight import save_recipe_beside_earlier

REPO = Path(__file__).resolve().parents[1]
DIGITS = str(REPO / "recipes" / "digits.yaml")

GOOD = """
trainer: {name: good, max_epochs: 1, limit_train_batches: 2}
model: {class_path: torchyard.recipes.digits.DigitsCNN, init_args: {lr: 0.01}}
data: {class_path: torchyard.recipes.digits.DigitsData}
callbacks:
  - {class_path: torchyard.callbacks.ModelCheckpoint, init_args: {monitor: val/acc, mode: max}}
"""

# Modules the table's recipes name, written next to them (the CLI imports from the working directory).
MODULES = {
    "needy_models.py": """
from torchyard.trainer import TrainModule

class Needy(TrainModule):
    def __init__(self, num_classes: int, lr: float = 0.1):
        super().__init__()
""",
    "kw_models.py": """
from torchyard.trainer import TrainModule

class Base(TrainModule):
    def __init__(self, width: int = 8, lr: float = 0.1):
        super().__init__()

class Child(Base):
    def __init__(self, depth: int = 2, **kwargs):
        super().__init__(**kwargs)
""",
}

FILES = {
    "good.yaml": GOOD,
    "broken.yaml": "trainer:\n  max_epochs: [1, 2\nmodel: {}\n",
    "typo_top.yaml": GOOD + "trainr: {max_epochs: 1}\n",
    "typo_trainer.yaml": "trainer: {max_epoch: 3}\n",
    "no_model.yaml": "data: {class_path: torchyard.recipes.digits.DigitsData}\n",
    "listed.yaml": "- trainer\n- model\n",
    "utf16.yaml": "",  # written as UTF-16 by the fixture
}

# (argv after the subcommand, a piece of the one-line message)
BAD_INPUTS = [
    (["missing.yaml"], "recipe file 'missing.yaml' not found"),
    (["goood.yaml"], "not found (did you mean 'good.yaml'"),
    (["trainer.max_epochs=3"], "no recipe file given"),
    (["good.yaml", "trainer.max_epochs"], "'trainer.max_epochs' is neither a recipe file nor an override"),
    (["broken.yaml"], "broken.yaml: YAML syntax error at line 3, column 6"),
    (["listed.yaml"], "a recipe is a mapping"),
    (["typo_top.yaml"], "unknown key 'trainr' (did you mean 'trainer'?)"),
    (["good.yaml", "typo_trainer.yaml"], "unknown trainer option 'max_epoch' (did you mean 'max_epochs'"),
    (["good.yaml", "trainer.limit_train_batchs=3"], "(did you mean 'limit_train_batches'"),
    (["good.yaml", "model.init_arg.lr=1"], "unknown key 'model.init_arg' (did you mean 'init_args'?)"),
    (["no_model.yaml"], "the recipe has no 'model' section"),
    (["good.yaml", "trainer.max_steps=abc"], "trainer.max_steps takes int"),
    (["good.yaml", "trainer.enable_progress_bar=maybe"], "trainer.enable_progress_bar takes bool"),
    (["good.yaml", "trainer.seed=abc"], "seed='abc' must be an integer or unset"),
    (["good.yaml", "trainer.devices=0"], "devices=0 must be at least 1"),
    (["good.yaml", "trainer.max_epochs=-2"], "max_epochs=-2 must be an integer >= -1"),
    (["good.yaml", "trainer.precision=8"], "precision='8' is not known; use one of 32, bf16-mixed, 16-mixed"),
    (["good.yaml", "trainer.strategy=nosuch"], "strategy='nosuch' is not known"),
    (
        ["good.yaml", "model.class_path=torchyard.recipes.digitz.DigitsCNN"],
        "no module named 'torchyard.recipes.digitz'",
    ),
    (
        ["good.yaml", "model.class_path=torchyard.recipes.digits.DigitCNN"],
        "has no 'DigitCNN' (did you mean 'DigitsCNN'?)",
    ),
    (["good.yaml", "model.class_path=torch.nn.Linear"], "is class torch.nn.modules.linear.Linear, not a TrainModule"),
    (["good.yaml", "data.class_path=torchyard.recipes.digits.DigitsCNN"], "not a DataModule subclass"),
    (
        ["good.yaml", "callbacks=[{class_path: torchyard.recipes.digits.DigitsData}]"],
        "callbacks.0.class_path='torchyard.recipes.digits.DigitsData' is class",
    ),
    (["good.yaml", "model.init_args.lrr=0.1"], "DigitsCNN does not take 'lrr' (did you mean 'lr'?)"),
    (["good.yaml", "model.init_args.channels=wide"], "model.init_args.channels='wide': DigitsCNN expects int, got str"),
    (["good.yaml", "callbacks.0.init_args.monitr=val/loss"], "does not take 'monitr' (did you mean 'monitor'?)"),
    (["good.yaml", "model.class_path=needy_models.Needy"], "Needy needs 'num_classes' (it has no default)"),
    (["good.yaml", "model.class_path=kw_models.Child", "model.init_args.height=3"], "it takes depth, width, lr"),
    (["good.yaml", "model.init_args.lr=${nope.value}"], "model.init_args.lr: cannot resolve an interpolation"),
    (["good.yaml", "model.init_args.lr=${oc.env:TRAINER_TEST_SURELY_UNSET}"], "TRAINER_TEST_SURELY_UNSET"),
    (["good.yaml", "ckpt_path=missing.ckpt"], "ckpt_path 'missing.ckpt' does not exist"),
    (["good.yaml", "model.init_args.lr=${oops"], "override 'model.init_args.lr=${oops': cannot parse the value"),
    (["good.yaml", "trainer=3"], "override 'trainer=3': 'trainer' must be a mapping of trainer options"),
    (["utf16.yaml"], "utf16.yaml: not UTF-8 text (invalid start byte at byte 0); save it as UTF-8"),
    (["folder.yaml"], "recipe file 'folder.yaml' is a folder; give a YAML file"),
    (
        ["good.yaml", "callbacks.0.init_args.filename={epoch}-{val/acc:.3f}"],
        'the value is not valid YAML (did not find expected <document start> in "<unicode string>", line 1, column 8); '
        "quote it: callbacks.0.init_args.filename=\"'{epoch}-{val/acc:.3f}'\"",
    ),
    (
        ["good.yaml", "callbacks.4.init_args.monitor=x"],
        "the recipe has 1 callback(s) (callbacks.0 to callbacks.0); an "
        "override changes an entry, a new callback goes in a recipe file's callbacks list",
    ),
    (["good.yaml", "trainer.max_time=1:30"], "max_time='1:30': a string must read 'DD:HH:MM:SS'"),  # not YAML's 90
    (
        ["good.yaml", "trainer.strategy={name: ps, stalenes: 4}"],
        "strategy 'ps' has no option 'stalenes' (did you mean 'staleness', 'stale_gradients'?); its options: "
        "ps_servers,",
    ),
]


@pytest.fixture()
def recipes_here(tmp_path: Path, monkeypatch) -> Path:
    for name, text in {**FILES, **MODULES}.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "utf16.yaml").write_text("trainer:\n  max_epochs: 1\n", encoding="utf-16")
    (tmp_path / "folder.yaml").mkdir()
    # `trainer` puts its working directory on sys.path (cli.main); tests that call load_recipe directly
    # need the same, and an import cache that has seen the new files.
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(("argv", "message"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_nothing_runs(recipes_here, capsys, argv, message):
    code = main(["fit", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.startswith("trainer fit: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not (recipes_here / "runs").exists()


def test_a_duration_override_is_a_duration_not_a_yaml_base_60_number(recipes_here):
    # YAML 1.1 reads 1:00:00:00 as the integer 216000 (base 60); Lightning's DD:HH:MM:SS means one day.
    assert load_recipe(["good.yaml", "trainer.max_time=1:00:00:00"]).trainer.max_time == "1:00:00:00"
    assert load_recipe(["good.yaml", "trainer.max_time=90"]).trainer.max_time == 90


def test_a_duration_in_a_recipe_file_is_a_duration_not_a_yaml_base_60_number(recipes_here):
    (recipes_here / "timed.yaml").write_text(
        "trainer:\n  max_time: 1:12:00:00\ncallbacks:\n"
        "  - class_path: torchyard.callbacks.Timer\n    init_args: &timer {duration: 2:00:00:00, interval: step}\n"
        "  - class_path: torchyard.callbacks.Timer\n    init_args: {<<: *timer, interval: epoch}\n"
        "  - class_path: torchyard.callbacks.Timer\n    init_args: {<<: *timer, duration: 3:00:00:00}\n")
    with pytest.warns(UserWarning, match="replaces the one before it, which drops torchyard.callbacks.ModelCheckpoint"):
        recipe = load_recipe(["good.yaml", "timed.yaml"])
    assert recipe.trainer.max_time == "1:12:00:00"  # YAML alone: 259200 seconds, three days
    assert parse_duration(recipe.trainer.max_time) == 36 * 3600
    # The list replaces good.yaml's; a `<<` merge brings the text along, and a key set beside it wins.
    assert [timer.init_args for timer in recipe.callbacks] == [
        {"duration": "2:00:00:00", "interval": "step", "verbose": True},
        {"duration": "2:00:00:00", "interval": "epoch", "verbose": True},
        {"duration": "3:00:00:00", "interval": "step", "verbose": True}]
    assert recipe.callbacks[1].instantiate().duration == 48 * 3600


def test_lightning_cli_style_options_are_answered_with_the_override_syntax(recipes_here, capsys):
    assert main(["fit", "good.yaml", "--trainer.max_epochs=3"]) == 2
    assert capsys.readouterr().err == ("trainer: error: '--trainer.max_epochs=3': overrides are written key=value, "
                                       "without dashes: trainer.max_epochs=3\n")


@pytest.mark.parametrize("argv", [["--verbose", "fit", "good.yaml", "trainer.devices=0"],
                                  ["fit", "good.yaml", "-v", "trainer.devices=0"]])
def test_verbose_anywhere_adds_the_traceback(recipes_here, capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "devices=0 must be at least 1" in err.splitlines()[-1]


def test_a_literal_dollar_brace_survives_the_saved_config(recipes_here):
    recipe = load_recipe(["good.yaml", r"trainer.name=\${not_a_key}"])
    assert recipe.trainer.name == "${not_a_key}"
    (recipes_here / "saved.yaml").write_text(recipe.to_yaml())
    assert load_recipe(["saved.yaml"]).to_dict() == recipe.to_dict()


@pytest.mark.slow  # a new Python process that imports torch
@pytest.mark.one_core
def test_console_script_reports_one_line(recipes_here):
    script = Path(sys.executable).with_name("trainer")
    done = subprocess.run([str(script), "fit", "good.yaml", "model.init_args.lrr=1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "trainer fit: error: model.init_args.lrr: DigitsCNN does not take 'lrr' (did you mean 'lr'?); "
        "it takes channels, hidden, dropout, lr, weight_decay."
    ]
    assert not (recipes_here / "runs").exists()


@pytest.mark.slow  # a new Python process that imports torch
@pytest.mark.one_core
def test_python_dash_m_prints_the_resolved_config(recipes_here):
    done = subprocess.run([sys.executable, "-m", "torchyard.trainer", "config", "good.yaml", "trainer.max_epochs=7"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    assert config["trainer"]["max_epochs"] == 7
    assert list(config["trainer"]) == option_names()  # every option, defaults filled in
    assert config["model"] == {"class_path": "torchyard.recipes.digits.DigitsCNN", "init_args": {
        "channels": 32, "hidden": 128, "dropout": 0.25, "lr": 0.01, "weight_decay": 1e-4}}


def test_files_merge_left_to_right_then_overrides(recipes_here):
    (recipes_here / "small.yaml").write_text(
        "trainer: {max_epochs: 2, name: small}\nmodel: {init_args: {channels: 8}}\n"
    )
    recipe = load_recipe(["good.yaml", "small.yaml", "model.init_args.channels=4", "trainer.name=last"])
    assert recipe.trainer.max_epochs == 2 and recipe.trainer.limit_train_batches == 2
    assert recipe.trainer.name == "last"
    assert recipe.model.init_args["channels"] == 4 and recipe.model.init_args["lr"] == 0.01
    # Order matters: a file after an override wins over it.
    assert load_recipe(["good.yaml", "trainer.name=first", "small.yaml"]).trainer.name == "small"


def test_interpolation_and_environment(recipes_here, monkeypatch):
    (recipes_here / "interp.yaml").write_text(
        "trainer: {max_epochs: '${oc.env:TRAINER_TEST_EPOCHS,3}', name: '${data.init_args.batch_size}-run'}\n"
        "data: {init_args: {batch_size: 16}}\n"
    )
    with pytest.raises(MisconfigurationError, match="max_epochs='3' must be an integer"):
        load_recipe(["good.yaml", "interp.yaml"])  # oc.env gives strings ...
    recipe = load_recipe(
        ["good.yaml", "interp.yaml", "trainer.max_epochs=${oc.decode:${oc.env:TRAINER_TEST_EPOCHS,3}}"]
    )
    assert recipe.trainer.max_epochs == 3  # ... oc.decode parses them
    monkeypatch.setenv("TRAINER_TEST_EPOCHS", "5")
    recipe = load_recipe(["good.yaml", "interp.yaml", "trainer.max_epochs=${oc.decode:${oc.env:TRAINER_TEST_EPOCHS}}",
                          "data.init_args.batch_size=8"])
    assert recipe.trainer.max_epochs == 5
    assert recipe.trainer.name == "8-run"  # resolved after the override


def test_new_class_path_drops_the_old_init_args(recipes_here):
    recipe = load_recipe(["good.yaml", "model.class_path=kw_models.Child", "model.init_args.width=4"])
    assert recipe.model.cls.__name__ == "Child"
    assert recipe.model.init_args == {"depth": 2, "width": 4, "lr": 0.1}  # DigitsCNN's lr=0.01 is gone


def test_a_strategy_of_another_name_drops_the_old_strategys_options():
    recipes = REPO / "recipes"
    recipe = load_recipe(
        [str(recipes / "charlm.yaml"), str(recipes / "charlm_pipeline.yaml"), "trainer.strategy.name=ddp"]
    )
    assert recipe.trainer.strategy == {"name": "ddp"}  # the pipeline's stages, microbatches, ... are gone
    recipe = load_recipe([DIGITS, str(recipes / "digits_ps.yaml"), str(recipes / "digits_ddp.yaml")])
    assert recipe.trainer.strategy == {"name": "ddp", "find_unused_parameters": False}
    recipe = load_recipe([DIGITS, str(recipes / "digits_ddp.yaml"), "trainer.strategy.name=ddp",
                          "trainer.strategy.static_graph=true"])
    assert recipe.trainer.strategy == {"name": "ddp", "find_unused_parameters": False, "static_graph": True}


def test_new_class_path_drops_the_old_init_args_of_a_callback(recipes_here):
    checkpoint_args = ["callbacks.0.init_args.save_last=true", "callbacks.0.init_args.monitor=val/loss"]
    recipe = load_recipe(["good.yaml", *checkpoint_args, "callbacks.0.class_path=torchyard.callbacks.EarlyStopping",
                          "callbacks.0.init_args.monitor=val/loss", "callbacks.0.init_args.patience=5"])
    early_stopping = recipe.callbacks[0].instantiate()
    assert type(early_stopping).__name__ == "EarlyStopping"
    assert "save_last" not in recipe.callbacks[0].init_args
    assert (early_stopping.monitor, early_stopping.mode, early_stopping.patience) == ("val/loss", "min", 5)
    # The whole entry at once, too; naming the same class keeps its arguments.
    recipe = load_recipe(["good.yaml", *checkpoint_args,
                          "callbacks.0={class_path: torchyard.callbacks.EarlyStopping, init_args: {monitor: val/acc}}"])
    assert recipe.callbacks[0].instantiate().mode == "min"
    recipe = load_recipe(["good.yaml", *checkpoint_args, "callbacks.0.class_path=torchyard.callbacks.ModelCheckpoint"])
    assert recipe.callbacks[0].init_args["save_last"] is True and recipe.callbacks[0].init_args["mode"] == "max"


def test_corrupt_ckpt_path_is_one_line_exit_2(recipes_here, capsys):
    (recipes_here / "junk.ckpt").write_text("hello world")
    (recipes_here / "noise.ckpt").write_bytes(bytes(range(7, 256)) * 4)
    for name in ("junk.ckpt", "noise.ckpt"):
        assert main(["test", "good.yaml", f"ckpt_path={name}", "trainer.enable_progress_bar=false"]) == 2
        err = capsys.readouterr().err
        assert err == (f"trainer test: error: checkpoint '{name}' is truncated or corrupt and cannot be read (it is "
                       "neither a zip archive nor a pickle).\n")
    assert not (recipes_here / "runs").exists()  # a run that failed before starting leaves no folder


def test_list_entries_take_dotted_overrides(recipes_here):
    recipe = load_recipe(["good.yaml", "callbacks.0.init_args.monitor=val/loss", "callbacks.0.init_args.mode=min"])
    assert recipe.callbacks[0].init_args["monitor"] == "val/loss"
    assert recipe.callbacks[0].instantiate().monitor == "val/loss"


def test_init_parameters_follow_kwargs_to_the_parent(recipes_here):
    sys.path.insert(0, str(recipes_here))
    try:
        from kw_models import Child
    finally:
        sys.path.remove(str(recipes_here))
    parameters, takes_any = init_parameters(Child)
    assert list(parameters) == ["depth", "width", "lr"] and not takes_any

    from torchyard.trainer import TrainModule

    class Swallow(TrainModule):
        def __init__(self, **options):
            super().__init__()

    assert init_parameters(Swallow) == ({}, True)


def test_reference_lists_every_option_and_the_readme_matches():
    table = reference_table()
    for name in option_names():
        assert f"| `{name}` |" in table
    assert "| `max_steps` | int | `-1` |" in table
    readme = (REPO / "README.md").read_text()
    assert readme_reference(readme) == table, (
        "README table is stale: run `trainer config --reference --readme README.md`"
    )


def test_reference_command_rewrites_a_stale_readme(tmp_path, capsys):
    stale = (REPO / "README.md").read_text().replace("| `max_steps` |", "| `max_stepz` |")
    (tmp_path / "README.md").write_text(stale)
    assert main(["config", "--reference", "--readme", "README.md"]) == 0
    assert readme_reference((tmp_path / "README.md").read_text()) == reference_table()
    assert not update_readme(tmp_path / "README.md")  # second time: nothing to change
    assert main(["config", "--reference"]) == 0
    assert capsys.readouterr().out.endswith(reference_table())


def test_saved_config_is_the_resolved_recipe(recipes_here):
    code = main(["fit", "good.yaml", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=1",
                 "trainer.enable_model_summary=false", "model.init_args.channels=${data.init_args.batch_size}"])
    assert code == 0
    saved = yaml.safe_load((recipes_here / "runs" / "good" / "version_0" / "config.yaml").read_text())
    assert saved == load_recipe(["good.yaml", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=1",
                                 "trainer.enable_model_summary=false", "model.init_args.channels=64"]).to_dict()
    assert saved["model"]["init_args"]["channels"] == 64 and "ckpt_path" not in saved
    assert not list((recipes_here / "runs" / "good" / "version_0").glob("*.tmp"))


@pytest.mark.slow  # two CLI fits
@pytest.mark.one_core
def test_a_resume_refused_for_misfit_weights_leaves_the_runs_files_as_they_were(recipes_here, capsys):
    quiet = ["trainer.enable_progress_bar=false", "trainer.limit_val_batches=1", "trainer.enable_model_summary=false"]
    assert main(["fit", "good.yaml", *quiet]) == 0
    folder = recipes_here / "runs" / "good" / "version_0"
    before = {name: (folder / name).read_text() for name in ("config.yaml", "hparams.yaml", "metrics.csv")}
    capsys.readouterr()
    [saved] = (folder / "checkpoints").glob("*.ckpt")
    assert main(["fit", str(folder / "config.yaml"), f"ckpt_path={saved}", "model.init_args.channels=16", *quiet]) == 2
    assert "the checkpoint's weights do not fit DigitsCNN" in capsys.readouterr().err
    assert {name: (folder / name).read_text() for name in before} == before
    assert main(["fit", str(folder / "config.yaml"), f"ckpt_path={saved}", "trainer.max_epochs=2", *quiet]) == 0


@pytest.mark.slow  # three CLI fits
@pytest.mark.one_core
def test_resuming_last_names_the_checkpoint_and_keeps_the_runs_config_beside_a_differing_one(recipes_here, capsys):
    quiet = ["trainer.enable_progress_bar=false", "trainer.limit_val_batches=1", "trainer.enable_model_summary=false",
             "callbacks.0.init_args.save_last=true"]
    assert main(["fit", "good.yaml", *quiet]) == 0
    folder = recipes_here / "runs" / "good" / "version_0"
    first_config = (folder / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["fit", "good.yaml", "ckpt_path=last", "trainer.max_epochs=2", "data.init_args.batch_size=32",
                 *quiet]) == 0
    out, err = capsys.readouterr()
    [loaded] = [line for line in err.splitlines() if line.startswith("trainer: fit resumes from")]
    assert loaded.startswith("trainer: fit resumes from runs/good/version_0/checkpoints/")
    assert loaded.endswith("(run runs/good/version_0, epoch 0, global step 2)")
    assert "data.init_args.batch_size: 64 -> 32" in err and "trainer.max_epochs: 1 -> 2" in err
    assert (folder / "config.yaml").read_text() == first_config  # the run's recipe, as it first ran
    resumed = yaml.safe_load((folder / "config_resume_1.yaml").read_text())
    assert resumed["data"]["init_args"]["batch_size"] == 32 and resumed["trainer"]["max_epochs"] == 2
    # Another resume keeps both earlier files; a recipe the same as the run's saves nothing more.
    assert main(["fit", str(folder / "config_resume_1.yaml"), "ckpt_path=last", "trainer.max_epochs=3", *quiet]) == 0
    assert "trainer.max_epochs: 1 -> 3" in capsys.readouterr().err
    assert sorted(path.name for path in folder.glob("config*.yaml")) == [
        "config.yaml", "config_resume_1.yaml", "config_resume_2.yaml"]
    # The run's own recipe, or one saved beside it already, is not saved again.
    assert save_recipe_beside_earlier(folder, yaml.safe_load(first_config)) is None
    resumed_again = yaml.safe_load((folder / "config_resume_2.yaml").read_text())
    assert save_recipe_beside_earlier(folder, resumed_again) == folder / "config_resume_2.yaml"
    assert len(list(folder.glob("config*.yaml"))) == 3


def test_unknown_command_is_a_usage_error(capsys):
    assert main(["train", DIGITS]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["--help"]) == 0



def write_metrics(folder: Path, header: list[str], rows: list[list[object]]) -> None:
    folder.mkdir(parents=True)
    lines = [",".join(header)] + [",".join("" if value is None else str(value) for value in row) for row in rows]
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")


@pytest.mark.slow  # imports matplotlib and draws: seconds
@pytest.mark.one_core
def test_plot_draws_one_panel_per_metric_one_line_per_run(tmp_path, capsys):
    image_module = pytest.importorskip("matplotlib.image")
    header = ["step", "train/loss", "epoch", "val/loss", "val/acc"]
    write_metrics(tmp_path / "runs" / "a" / "version_0", header,
                  [[5, 2.0, 0, None, None], [10, 1.0, 0, None, None], [10, None, 0, 1.2, 0.6]])
    write_metrics(tmp_path / "runs" / "b" / "version_0", header[:3], [[1, 3.0, 0]])
    write_metrics(tmp_path / "runs" / "b" / "version_1", header, [[5, 1.5, 0, None, None], [9, None, 0, 0.9, 0.8]])
    # A version folder, and a run-name folder (its newest version).
    assert main(["plot", "runs/a/version_0", "runs/b", "-o", "plots/curves.png"]) == 0
    assert "plots/curves.png" in capsys.readouterr().out
    image = image_module.imread(tmp_path / "plots" / "curves.png")
    assert image.shape[:2] == (320, 1440)  # three metrics: one row of three 4.8 x 3.2 inch panels at 100 dpi
    assert image[..., :3].std() > 0.01  # something is drawn

    write_metrics(tmp_path / "runs" / "c" / "version_0", [*header, "lr-Adam"], [[5, 1.0, 0, 1.0, 0.5, 0.1]])
    assert main(["plot", "runs/c/version_0", "-o", "four.png"]) == 0
    assert image_module.imread(tmp_path / "four.png").shape[:2] == (640, 1440)  # four metrics: two rows

    # Without a suffix a PNG, into an existing folder curves.png: the path printed is the file written.
    capsys.readouterr()
    assert main(["plot", "runs/c/version_0", "-o", "bare"]) == 0
    assert "wrote bare.png" in capsys.readouterr().out and (tmp_path / "bare.png").is_file()
    assert main(["plot", "runs/c/version_0", "-o", "plots"]) == 0
    assert capsys.readouterr().out.strip().endswith("plots/curves.png")


def test_plot_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_metrics(tmp_path / "run", ["step", "epoch", "loss"], [[1, 0, 1.0]])
    assert main(["plot", "run", "-o", "curves.txt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-o 'curves.txt': matplotlib cannot write '.txt' files; use one of" in err
    (tmp_path / "file").write_text("")
    assert main(["plot", "run", "-o", "file/under/a/file.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write 'file/under/a/file.png'" in err


def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    assert main(["plot", "empty"]) == 2
    assert "'empty' holds no metrics.csv" in capsys.readouterr().err
    for name, text in (("letters", b"step,loss\n1,0.5\n2,abc\n"), ("binary", b"step,loss\n1,\xff\xfe\n"),
                       ("stepless", b"epoch,loss\n1,2\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.csv").write_bytes(text)
        assert main(["plot", name]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not a metrics.csv the CSV logger wrote" in err
    assert main(["config", "--reference", "--readme", "missing.md"]) == 2
    assert "--readme 'missing.md' cannot be read (No such file or directory)" in capsys.readouterr().err
    write_metrics(tmp_path / "run", ["step", "epoch"], [[1, 0]])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the optional extra were not installed
    assert main(["plot", "run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer plot needs matplotlib: pip install 'torchyard[plot]'" in err


# --------------------------------------------------------------------------- first hour: speed and edges


@pytest.mark.parametrize("argv", [["--help"], ["fit", "--help"], ["config", "--help"], ["plot", "--help"],
                                  ["config", "--reference"]])
def test_help_and_the_options_reference_import_no_torch(argv):
    # torch takes seconds to import; a user reading the help, or the options, must not wait for it.
    code = ("import sys; from trainer.cli.main import main; status = main(sys.argv[1:]); "
            "loaded = sorted(name for name in sys.modules if name.split('.')[0] == 'torch'); "
            "print('TORCH:', loaded[:5]); raise SystemExit(status)")
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "TORCH: []"
    expected = "| `devices` | int | `1` |" if "--reference" in argv else "usage: trainer"
    assert expected in result.stdout


def test_devices_auto_is_accepted_in_a_recipe_as_in_python(recipes_here):
    from torchyard.trainer.config import make_config

    one_process_per_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 1
    assert make_config({"devices": "auto"}).devices == one_process_per_gpu
    assert load_recipe(["good.yaml", "trainer.devices=auto"]).trainer.devices == one_process_per_gpu
    (recipes_here / "auto.yaml").write_text("trainer: {devices: auto, accelerator: cpu}\n")
    assert load_recipe(["good.yaml", "auto.yaml"]).trainer.devices == 1  # on CPU: one process
    assert main(["fit", "good.yaml", "trainer.devices=many"]) == 2  # anything else is still refused


def test_a_negative_learning_rate_is_one_line_before_anything_runs(recipes_here, capsys):
    assert main(["fit", "good.yaml", "model.init_args.lr=-1", "trainer.enable_progress_bar=false"]) == 2
    assert capsys.readouterr().err == ("trainer fit: error: DigitsCNN: lr=-1 must be a positive learning rate "
                                       "(model.init_args.lr in a recipe).\n")
    assert not (recipes_here / "runs").exists()


def test_a_warning_shown_by_the_command_is_one_line_without_a_python_location(recipes_here, capsys):
    (recipes_here / "warns_models.py").write_text(
        "import warnings\nfrom torchyard.recipes.digits import DigitsCNN\n\n"
        "class Warns(DigitsCNN):\n    def __init__(self, **kwargs):\n"
        "        warnings.warn('widths above 64 are slow on CPU')\n        super().__init__(**kwargs)\n")
    argv = ["validate", "good.yaml", "model.class_path=warns_models.Warns", "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Warning: widths above 64 are slow on CPU\n" in err
    assert "warns_models.py" not in err and "warnings.warn(" not in err
    # Outside the command, Python's own format (file:line) is back.
    with pytest.warns(UserWarning) as record:
        __import__("warns_models").Warns()
    assert "warns_models.py:6" in warnings.formatwarning(record[0].message, record[0].category, record[0].filename,
                                                         record[0].lineno)
