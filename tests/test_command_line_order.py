"""The `trainer` command reads recipe files and KEY=VALUE overrides anywhere among a subcommand's options, in every
subcommand (issue 51: `trainer scale RECIPE --devices 1,2 trainer.max_epochs=2` was "unrecognized arguments" under
the top-level usage); after a SCRIPT.py the rest is the script's own arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchyard.trainer.cli.main import build_parser, main, parse_command_line

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DIGITS = str(RECIPES / "digits.yaml")
BAD_EPOCHS = "trainer.max_epochs=-3"  # refused by the recipe check: proof that the override reached the recipe


def parsed(*tokens: str) -> dict:
    args = parse_command_line(build_parser(), list(tokens))
    return {key: value for key, value in vars(args).items() if key not in ("handler", "subcommands")}


@pytest.mark.parametrize("tokens, expected", [
    (["scale", "r.yaml", "--devices", "1,2", "trainer.max_epochs=2"],
     {"sources": ["r.yaml", "trainer.max_epochs=2"], "devices": "1,2"}),
    (["scale", "--devices", "1,2", "r.yaml", "--nodes", "1,2", "b.yaml", "x=1"],
     {"sources": ["r.yaml", "b.yaml", "x=1"], "devices": "1,2", "nodes": "1,2"}),
    (["fit", "r.yaml", "trainer.max_epochs=2", "b.yaml"], {"sources": ["r.yaml", "trainer.max_epochs=2", "b.yaml"]}),
    (["submit", "r.yaml", "--nodes", "2", "trainer.max_epochs=2", "--dry-run"],
     {"sources": ["r.yaml", "trainer.max_epochs=2"], "nodes": 2, "dry_run": True}),
    (["submit", "--nodes", "2", "train.py", "--", "--nodes", "3", "--lr", "1"],
     {"sources": ["train.py", "--nodes", "3", "--lr", "1"], "nodes": 2}),
    (["launch", "r.yaml", "--hosts", "a,b", "trainer.max_epochs=2", "--nproc-per-node", "2"],
     {"sources": ["r.yaml", "trainer.max_epochs=2"], "hosts": "a,b", "nproc_per_node": 2}),
    (["launch", "--hosts", "a", "--ssh-config", "cfg.py", "train.py", "--hosts", "b", "--lr", "1"],
     {"sources": ["train.py", "--hosts", "b", "--lr", "1"], "hosts": "a", "ssh_config": "cfg.py"}),
    (["evaluate", "--every-n", "2", "runs/x/version_0", "--watch"],
     {"run_dir": "runs/x/version_0", "every_n": 2, "watch": True}),
])
def test_sources_and_options_in_any_order(tokens, expected):
    args = parsed(*tokens)
    assert args["command"] == tokens[0]
    assert {key: args[key] for key in expected} == expected


@pytest.mark.parametrize("argv", [
    ["fit", DIGITS, BAD_EPOCHS],
    ["scale", DIGITS, "--devices", "1,2", BAD_EPOCHS],
    ["scale", "--devices", "1,2", DIGITS, "--nodes", "1", BAD_EPOCHS],
    ["submit", DIGITS, "--nodes", "2", BAD_EPOCHS, "--dry-run"],
    ["launch", DIGITS, "--hosts", "a", BAD_EPOCHS],
])
def test_an_override_after_an_option_reaches_the_recipe_check(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainer {argv[0]}: error: ") and "max_epochs=-3 must be an integer" in err, err
    assert err.count("\n") == 1, err


def test_submit_writes_an_override_given_after_the_options_into_the_job(capsys, tmp_path):
    assert main(["submit", DIGITS, "--nodes", "2", "trainer.max_epochs=2", "--dry-run"]) == 0
    [srun] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("srun ")]
    assert f"-m torchyard.trainer fit {DIGITS} trainer.max_epochs=2 trainer.num_nodes=2" in srun


def test_evaluate_reads_its_options_before_the_run_folder(capsys):
    assert main(["evaluate", "--every-n", "0", "runs/x/version_0"]) == 2
    assert "evaluator.every_n=0 must be an integer >= 1" in capsys.readouterr().err


def test_an_unknown_option_is_refused_with_the_subcommands_usage(capsys):
    assert main(["scale", DIGITS, "--devices", "1,2", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trainer scale ")
    assert err.splitlines()[-1] == "trainer scale: error: unrecognized arguments: --bogus"


def test_help_and_unknown_commands_are_argparse_s(capsys):
    assert main(["--help"]) == 0
    assert "COMMAND" in capsys.readouterr().out
    assert main(["nope"]) == 2
    assert "argument COMMAND: invalid choice: 'nope'" in capsys.readouterr().err
    assert main([]) == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err
