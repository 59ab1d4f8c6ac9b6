"""The shipped recipes run from the command line: they train, rerun from config.yaml, resume, and predict."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from torchyard.recipes.charlm import CharBlocks, CharData, CharLM, decode, encode, read_corpus
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.cli.main import main

REPO = Path(__file__).resolve().parents[1]
DIGITS = str(REPO / "recipes" / "digits.yaml")
CHARLM = str(REPO / "recipes" / "charlm.yaml")
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
# deterministic: on a GPU, cuDNN's convolution backward may otherwise differ between identical runs.
SHORT_DIGITS = ["trainer.max_epochs=1", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2",
                "trainer.deterministic=true", *QUIET]
TINY_CHARLM = [
    "trainer.max_steps=3", "trainer.limit_val_batches=2", "data.init_args.batch_size=4", "data.init_args.block_size=16",
    "model.init_args.width=32", "model.init_args.layers=2", "model.init_args.heads=2", *QUIET,
]


@pytest.fixture(autouse=True)
def _one_thread():
    # These models are too small to gain from intra-op threads, and spinning OpenMP threads slow the
    # whole run several-fold when the cores are shared (other tests, other jobs).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint_file(path)["state_dict"]


def assert_same_weights(path_a: Path, path_b: Path) -> None:
    a, b = weights(path_a), weights(path_b)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def val_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("val/acc")]


@pytest.mark.timeout(120)  # about 10 s on an idle 2-core machine; generous for a loaded one
def test_digits_recipe_reaches_97_percent(tmp_path):
    assert main(["fit", DIGITS, *QUIET]) == 0
    run = tmp_path / "runs" / "digits" / "version_0"
    rows = val_rows(run)
    assert len(rows) == 10 and float(rows[-1]["val/acc"]) >= 0.97
    # The best checkpoint's accuracy, recomputed by hand on the validation split, is the best one logged.
    best = max(rows, key=lambda row: float(row["val/acc"]))
    (best_path,) = [p for p in (run / "checkpoints").glob("epoch=*.ckpt")]
    model = DigitsCNN.load_from_checkpoint(best_path).eval()
    data = DigitsData()
    data.setup("validate")
    images, labels = data.val_set.tensors
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=-1) == labels).float().mean().item()
    assert accuracy == pytest.approx(float(best["val/acc"]), abs=1e-6)
    assert accuracy >= 0.97 and len(labels) == 359


@pytest.mark.slow  # four CLI runs of the digits recipe
def test_digits_config_yaml_reruns_resumes_and_predicts(tmp_path):
    root = tmp_path / "runs" / "digits"
    assert main(["fit", DIGITS, *SHORT_DIGITS]) == 0
    first = root / "version_0"
    config = first / "config.yaml"
    assert yaml.safe_load(config.read_text())["trainer"]["limit_train_batches"] == 5

    # The saved config reproduces the run: same folder layout, same weights.
    assert main(["fit", str(config)]) == 0
    second = root / "version_1"
    assert yaml.safe_load((second / "config.yaml").read_text()) == yaml.safe_load(config.read_text())
    assert_same_weights(first / "checkpoints" / "last.ckpt", second / "checkpoints" / "last.ckpt")

    # ckpt_path=last with a run's config.yaml resumes that run (version_0, not the newest), in its own folder,
    # and ends where an uninterrupted run ends.
    assert main(["fit", str(config), "trainer.max_epochs=2", "ckpt_path=last"]) == 0
    assert not (root / "version_2").exists()
    assert {int(float(row["epoch"])) for row in val_rows(first)} == {0, 1}
    assert {int(float(row["epoch"])) for row in val_rows(second)} == {0}
    assert main(["fit", DIGITS, *SHORT_DIGITS, "trainer.max_epochs=2", "trainer.name=straight"]) == 0
    assert_same_weights(
        first / "checkpoints" / "last.ckpt", tmp_path / "runs" / "straight" / "version_0" / "checkpoints" / "last.ckpt"
    )

    # predict saves the predicted classes, which are the checkpoint's argmax over the validation images, in the
    # folder of the run whose checkpoint it loaded (no version_2).
    assert main(["predict", str(config), "ckpt_path=last"]) == 0
    assert not (root / "version_2").exists()
    predictions = torch.cat(torch.load(first / "predictions.pt", weights_only=True))
    model = DigitsCNN.load_from_checkpoint(first / "checkpoints" / "last.ckpt").eval()
    data = DigitsData()
    data.setup("predict")
    with torch.no_grad():
        assert torch.equal(predictions, model(data.val_set.tensors[0]).argmax(dim=-1))


def test_charlm_trains_and_predict_prints_sampled_text(tmp_path, capsys):
    assert main(["fit", CHARLM, *TINY_CHARLM]) == 0
    run = tmp_path / "runs" / "charlm" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    capsys.readouterr()
    prompts = ["def main(", "import "]
    predict = ["predict", CHARLM, *TINY_CHARLM, "ckpt_path=last", "model.init_args.max_new_tokens=12",
               f"data.init_args.prompts={prompts}"]
    assert main(predict) == 0
    printed = capsys.readouterr().out
    texts = printed.split("\n" + "-" * 72 + "\n")[:-1]
    assert len(texts) == 2
    for prompt, text in zip(prompts, texts):
        assert text.startswith(prompt) and len(text) == len(prompt) + 12
    assert main(predict) == 0
    assert capsys.readouterr().out == printed  # trainer.seed makes sampling repeatable


@pytest.mark.parametrize(
    ("recipe", "override", "message"),
    [
        (
            DIGITS,
            "data.init_args.batch_size=0",
            "DigitsData: batch_size=0 must be at least 1 (data.init_args.batch_size in a recipe).",
        ),
        (
            CHARLM,
            "data.init_args.batch_size=-4",
            "CharData: batch_size=-4 must be at least 1 (data.init_args.batch_size in a recipe).",
        ),
        (
            DIGITS,
            "data.init_args.num_workers=-1",
            "DigitsData: num_workers=-1 must be 0 or more (data.init_args.num_workers in a recipe).",
        ),
        (
            CHARLM,
            "data.init_args.prompts=[1]",
            "data.init_args.prompts=[1]: CharData expects a list of str, got a list of int.",
        ),
        (
            CHARLM,
            "data.init_args.prompts=[]",
            "CharData: prompts=[]: predict continues each prompt, so give one or more "
            "non-empty strings (data.init_args.prompts in a recipe).",
        ),
        (
            CHARLM,
            'data.init_args.prompts=["def", ""]',
            "CharData: prompts=['def', '']: predict continues each prompt, so "
            "give one or more non-empty strings (data.init_args.prompts in a recipe).",
        ),
    ],
)
def test_loader_arguments_torch_refuses_are_one_line_before_anything_runs(tmp_path, capsys, recipe, override, message):
    assert main(["fit", recipe, override, *QUIET]) == 2
    assert capsys.readouterr().err == f"trainer fit: error: {message}\n"
    assert not (tmp_path / "runs").exists()


def test_charlm_splits_into_embed_blocks_head():
    torch.manual_seed(0)
    model = CharLM(block_size=16, width=32, layers=3, heads=4).eval()
    tokens = torch.randint(0, 98, (2, 16))
    assert [name for name, _ in model.named_children()] == ["embed", "blocks", "head"]
    assert isinstance(model.blocks, torch.nn.Sequential) and len(model.blocks) == 3
    logits = model(tokens)
    torch.testing.assert_close(
        model.head(model.blocks[2](model.blocks[1](model.blocks[0](model.embed(tokens))))), logits
    )
    targets = torch.randint(0, 98, (2, 16))
    torch.testing.assert_close(model.pipeline_loss(logits, (tokens, targets)),
                               F.cross_entropy(logits.reshape(-1, 98), targets.reshape(-1)))
    assert model.pipeline_input((tokens, targets)) is tokens
    # Causal: changing the last character changes no earlier prediction.
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 98
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])


def test_charlm_corpus_windows_and_alphabet():
    text = read_corpus(["string.py", "textwrap.py"])
    assert text == read_corpus(["string.py", "textwrap.py"]) and len(text) > 10_000
    assert decode(encode("def f(x):\n\treturn x ~ 1")) == "def f(x):\n\treturn x ~ 1"
    assert decode(encode("π")) == "\N{REPLACEMENT CHARACTER}"
    tokens = encode(text)
    blocks = CharBlocks(tokens, 32)
    inputs, targets = blocks[3]
    torch.testing.assert_close(inputs[1:], targets[:-1])
    assert torch.equal(inputs, tokens[96:128]) and len(blocks) == (len(tokens) - 1) // 32
    data = CharData(files=["string.py"], block_size=32, val_fraction=0.25)
    data.setup("fit")
    split = int(len(encode(read_corpus(["string.py"]))) * 0.75)
    assert torch.equal(data.val_set.tokens, encode(read_corpus(["string.py"]))[split:])  # split by position


def test_digits_test_set_is_held_out_from_training_and_validation():
    data = DigitsData()
    data.setup("fit")
    sets = {name: getattr(data, f"{name}_set").tensors[0].flatten(1) for name in ("train", "val", "test")}
    assert {name: len(images) for name, images in sets.items()} == {"train": 1258, "val": 359, "test": 180}  # of 1797
    # No image of the test set is in the training or validation set (compared pixel by pixel).
    test = {tuple(row.tolist()) for row in sets["test"]}
    seen = {tuple(row.tolist()) for name in ("train", "val") for row in sets[name]}
    assert len(test) == 180 and not test & seen
    assert torch.equal(data.test_dataloader().dataset.tensors[0], data.test_set.tensors[0])
    assert torch.equal(data.val_dataloader().dataset.tensors[0], data.val_set.tensors[0])
