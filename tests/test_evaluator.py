"""The evaluator (trainer/evaluation/evaluator.py): each checkpoint scored once, outside the loop, as in-loop
validation scores it; its record drives EarlyStopping and ModelCheckpoint."""

from __future__ import annotations

import csv
import dataclasses
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import reaped
from typing_extensions import override

from torchyard.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torchyard.recipes.digits import DigitsCNN, DigitsData
from torchyard.trainer import Trainer, seed_everything
from torchyard.trainer.cli.main import main
from torchyard.trainer.cli.recipe import load_recipe
from torchyard.trainer.config import EvaluatorConfig
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.evaluation.evaluator import Evaluator, EvaluatorProcess, evaluator_gpu
from torchyard.trainer.logs.evaluations import DELETED, SCORED, SKIPPED, read_record, training_ended
from torchyard.trainer.logs.plot import read_run

REPO = Path(__file__).resolve().parents[1]
DIGITS = str(REPO / "recipes" / "digits.yaml")
DIGITS_DDP = str(REPO / "recipes" / "digits_ddp.yaml")
CPU = EvaluatorConfig(accelerator="cpu", poll_interval=0.1)


def digits_fit(name: str, epochs: int = 2, callbacks: tuple[Callback, ...] = (), module: DigitsCNN | None = None,
               **options: Any) -> Trainer:
    """A short digits fit in this process; the same seed gives the same initial weights and batches."""
    seed_everything(0)
    module = module or DigitsCNN(dropout=0.0)  # no dropout: the weights do not depend on what else drew numbers
    options = {"limit_train_batches": 4, "num_sanity_val_steps": 0, "log_every_n_steps": 1, **options}
    trainer = Trainer(max_epochs=epochs, seed=0, name=name, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[*callbacks] or [ModelCheckpoint(save_top_k=-1)], **options)
    trainer.fit(module, datamodule=DigitsData())
    return trainer


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def logged(path: Path, name: str) -> dict[int, float]:
    """{step: value} of a metric in a CSV logger file."""
    return {int(row["step"]): float(row[name]) for row in csv_rows(path) if row.get(name)}


class ScoreCheckpointsHere(Callback):
    """The evaluator run in this process at each training epoch's end (before the monitoring callbacks) and at the
    end of the fit: what a side process that keeps up has scored by then, without timing."""

    def __init__(self) -> None:
        self.evaluator: Evaluator | None = None

    @override
    def on_train_epoch_end(self, trainer: Trainer, module: DigitsCNN) -> None:
        if self.evaluator is None:
            self.evaluator = Evaluator(Trainer, DigitsCNN(), DigitsData(), trainer.log_dir,
                                       trainer.checkpoint_callback.dirpath, CPU, say=lambda line: None)
        self.evaluator.score(self.evaluator.new_states())

    @override
    def teardown(self, trainer: Trainer, module: DigitsCNN, stage: str) -> None:
        if self.evaluator is not None:  # before ModelCheckpoint's teardown, as the side process's callback
            self.evaluator.score(self.evaluator.new_states())
            self.evaluator.close()


# --------------------------------------------------------------------------- options


def test_evaluator_options_are_checked_before_anything_runs():
    trainer = Trainer(evaluator=True, enable_progress_bar=False)
    [process] = [callback for callback in trainer.callbacks if isinstance(callback, EvaluatorProcess)]
    assert process.options == EvaluatorConfig()
    assert Trainer(evaluator={"every_n": 2}).config.evaluator.every_n == 2
    assert not any(isinstance(callback, EvaluatorProcess) for callback in Trainer().callbacks)
    cases = {
        "unknown evaluator option 'every' (did you mean 'every_n'?)": {"every": 2},
        "evaluator.accelerator='tpu'; use one of auto, cpu, cuda": {"accelerator": "tpu"},
        "evaluator.device=1 names a GPU, but evaluator.accelerator='cpu'": {"accelerator": "cpu", "device": 1},
        "evaluator.every_n=0 must be an integer >= 1": {"every_n": 0},
        "evaluator.poll_interval=0 must be a positive number": {"poll_interval": 0},
        "evaluator=3: use true, or a mapping": 3,
    }
    for message, value in cases.items():
        with pytest.raises(MisconfigurationError, match="^" + re.escape(message)):
            Trainer(evaluator=value)
    with pytest.raises(MisconfigurationError, match="^evaluator scores the checkpoints the fit writes, but enable_"):
        Trainer(evaluator=True, enable_checkpointing=False)
    with pytest.raises(MisconfigurationError, match="from_evaluator=True.*give it monitor="):
        ModelCheckpoint(from_evaluator=True)
    recipe = load_recipe([DIGITS, "trainer.evaluator={accelerator: cpu, every_n: 3}"])
    assert recipe.trainer.evaluator == EvaluatorConfig(accelerator="cpu", every_n=3)
    assert recipe.to_dict()["trainer"]["evaluator"]["every_n"] == 3  # config.yaml reruns it
    with pytest.raises(MisconfigurationError, match="evaluator.limit_val_batches=0"):
        load_recipe([DIGITS, "trainer.evaluator.limit_val_batches=0"])
    # A script without a __main__ guard, re-imported by the evaluator's spawned process, stops there at once.
    process = multiprocessing.current_process()
    process._inheriting = True  # what multiprocessing sets while a spawned child imports the parent's script
    try:
        with pytest.raises(SystemExit, match="the evaluator process imported the script"):
            exec(compile("Trainer(evaluator=True)", "script.py", "exec"),
                 {"__name__": "__mp_main__", "Trainer": Trainer})
    finally:
        del process._inheriting
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert evaluator_gpu(EvaluatorConfig(accelerator="cpu"), 0) is None
    assert evaluator_gpu(EvaluatorConfig(), gpus) is None  # auto: no GPU left to the evaluator, so the CPU
    with pytest.raises(MisconfigurationError, match=f"needs GPU {gpus}, but this node has {gpus} GPU"):
        evaluator_gpu(EvaluatorConfig(accelerator="cuda"), gpus)


def test_docs_list_every_evaluator_option_and_its_cli_flag():
    text = (REPO / "docs" / "evaluator.md").read_text()
    for option in dataclasses.fields(EvaluatorConfig):
        assert f"| `{option.name}` |" in text, option.name
        assert f"--{option.name.replace('_', '-')}" in text, option.name


def test_a_fit_given_loaders_alone_cannot_hand_them_to_the_evaluator(tmp_path):
    data = DigitsData()
    data.setup("fit")
    loaders = (data.train_dataloader(), data.val_dataloader())
    trainer = Trainer(max_epochs=1, evaluator={"accelerator": "cpu"}, enable_progress_bar=False)
    with pytest.raises(MisconfigurationError, match="^the evaluator validates with the loader of a DataModule"):
        trainer.fit(DigitsCNN(), *loaders)


def test_trainer_evaluate_of_a_folder_without_a_recipe_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "runs" / "x" / "version_0").mkdir(parents=True)
    assert main(["evaluate", "runs/x/version_0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer evaluate: error: 'runs/x/version_0' holds no config.yaml") and err.count("\n") == 1
    assert main(["evaluate", "runs/x/version_0", "--every-n", "0"]) == 2
    assert "evaluator.every_n=0 must be an integer >= 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- scoring


def test_trainer_evaluate_backfills_each_checkpoint_once_as_validate_scores_it(tmp_path, capsys):
    quiet = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "trainer.max_epochs=2",
             "trainer.limit_train_batches=3", "trainer.limit_val_batches=0", "callbacks.0.init_args.monitor=null",
             "callbacks.0.init_args.save_top_k=-1"]
    assert main(["fit", DIGITS, *quiet]) == 0
    run = tmp_path / "runs" / "digits" / "version_0"
    assert training_ended(run / "checkpoints") == {"global_step": 6}
    assert main(["evaluate", "runs/digits/version_0", "--accelerator", "cpu"]) == 0
    assert "evaluator: 2 checkpoint(s) scored" in capsys.readouterr().out
    record = read_record(run)
    # Each training state once: last.ckpt is a second name of the last epoch's file.
    assert [(e.step, e.epoch, e.status) for e in record] == [(3, 0, SCORED), (6, 1, SCORED)]
    assert sorted(record[1].checkpoints) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    rows = csv_rows(run / "metrics_evaluator.csv")
    assert [(int(row["step"]), int(row["epoch"])) for row in rows] == [(3, 0), (6, 1)]
    for evaluation, row in zip(record, rows):
        [reference] = Trainer(logger=False, enable_progress_bar=False).validate(
            DigitsCNN(), datamodule=DigitsData(), ckpt_path=run / "checkpoints" / evaluation.checkpoints[0],
            verbose=False)
        assert evaluation.metrics == pytest.approx(reference, abs=1e-6)
        assert float(row["val/acc"]) == pytest.approx(reference["val/acc"], abs=1e-6)
    # `trainer plot` draws them with the run's training curves, as it would in-loop validation.
    assert read_run(run / "metrics.csv")["val/acc"] == ([3, 6], [e.metrics["val/acc"] for e in record])
    assert "train/loss" in read_run(run / "metrics.csv")
    # Run again: nothing is scored twice, the rows stay.
    assert main(["evaluate", "runs/digits/version_0", "--accelerator", "cpu"]) == 0
    assert read_record(run) == record and csv_rows(run / "metrics_evaluator.csv") == rows


def test_a_checkpoint_removed_before_it_was_scored_is_skipped(tmp_path):
    trainer = digits_fit("removed", limit_val_batches=0)
    folder = Path(trainer.checkpoint_callback.dirpath)
    evaluator = Evaluator(Trainer, DigitsCNN(), DigitsData(), trainer.log_dir, folder, CPU, say=lambda line: None)
    # every_n=3 leaves both out as they come, then scores the run's last one all the same.
    sparse_run = tmp_path / "runs" / "sparse" / "version_0"
    Evaluator(Trainer, DigitsCNN(), DigitsData(), sparse_run, folder, EvaluatorConfig(accelerator="cpu", every_n=3),
              say=lambda line: None).run()
    assert [(e.step, e.status) for e in read_record(sparse_run)] == [(4, SKIPPED), (8, SCORED)]
    found = evaluator.new_states()
    assert [e.checkpoints for e in found] == [["epoch=0-step=4.ckpt"], ["epoch=1-step=8.ckpt"]]
    (folder / "epoch=0-step=4.ckpt").unlink()  # top-k removed it after the evaluator listed it
    evaluator.score(found)
    evaluator.close()
    assert [(e.step, e.status) for e in read_record(trainer.log_dir)] == [(4, DELETED), (8, SCORED)]
    assert list(logged(Path(trainer.log_dir) / "metrics_evaluator.csv", "val/acc")) == [8]


def test_early_stopping_driven_by_the_evaluator_stops_a_run_that_stops_improving(tmp_path, capsys):
    stopping = EarlyStopping("val/acc", mode="max", patience=2, min_delta=0.01, from_evaluator=True)
    # A learning rate that changes nothing: the score never improves by min_delta after the first checkpoint.
    trainer = digits_fit("stalled", epochs=10, module=DigitsCNN(lr=1e-12), limit_val_batches=0,
                         callbacks=(ScoreCheckpointsHere(), stopping, ModelCheckpoint(save_top_k=-1)))
    record = read_record(trainer.log_dir)
    # Scored by each epoch's end: the checkpoints before it. Epoch 1's end sees epoch 0's score (the first best),
    # epochs 2 and 3 see two that do not improve: the fit stops at epoch 3's end, one checkpoint after the one
    # whose score said so, instead of running 10 epochs.
    assert stopping.stopped_epoch == 3 and trainer.current_epoch == 4  # epochs done
    assert "did not improve by more than 0.01 in the last 2 checks" in stopping.stopping_reason_message
    assert "the evaluator's score of step 12" in capsys.readouterr().out
    assert [(e.epoch, e.status) for e in record] == [(epoch, SCORED) for epoch in range(4)]
    assert stopping.evaluated_step == 12 and stopping.state_dict()["evaluated_step"] == 12


def test_model_checkpoint_keeps_the_best_by_the_evaluators_scores(tmp_path):
    best_k = ModelCheckpoint(monitor="val/acc", mode="max", save_top_k=1, from_evaluator=True)
    trainer = digits_fit("ranked", epochs=3, module=DigitsCNN(lr=0.01), limit_val_batches=0,
                         callbacks=(ScoreCheckpointsHere(), best_k))
    record = read_record(trainer.log_dir)
    assert [e.status for e in record] == [SCORED] * 3
    best = max(record, key=lambda e: e.metrics["val/acc"])
    assert Path(best_k.best_model_path).name == best.checkpoints[0]
    assert float(best_k.best_model_score) == pytest.approx(best.metrics["val/acc"])
    assert best_k.awaiting_score == {}
    assert sorted(path.name for path in Path(best_k.dirpath).glob("*.ckpt")) == [best.checkpoints[0]]


def test_a_run_logging_to_tensorboard_gets_the_evaluators_values_there_too(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    trainer = digits_fit("board", limit_val_batches=0, logger="tensorboard")
    run = Path(trainer.log_dir)
    Evaluator(Trainer, DigitsCNN(), DigitsData(), run, trainer.checkpoint_callback.dirpath, CPU, tensorboard=True,
              say=lambda line: None).run()
    events = event_accumulator.EventAccumulator(str(run))
    events.Reload()  # the training's event file and the evaluator's, in one folder: one run to TensorBoard
    scored = {e.step: e.metrics["val/acc"] for e in read_record(run)}
    assert {event.step: event.value for event in events.Scalars("val/acc")} == pytest.approx(scored)


# --------------------------------------------------------------------------- processes


@pytest.mark.timeout(180)
def test_the_side_process_scores_each_epoch_checkpoint_as_in_loop_validation_scores_the_same_weights(tmp_path):
    side = digits_fit("side", evaluator={"accelerator": "cpu", "poll_interval": 0.1}, limit_val_batches=0)
    side_dir = Path(side.log_dir)
    record = read_record(side_dir)
    assert [(e.step, e.status, e.checkpoints) for e in record] == [
        (4, SCORED, ["epoch=0-step=4.ckpt"]), (8, SCORED, ["epoch=1-step=8.ckpt"])]
    assert "val/acc" not in csv_rows(side_dir / "metrics.csv")[0]  # no validation in the side run's loop
    evaluated = logged(side_dir / "metrics_evaluator.csv", "val/acc")
    assert list(evaluated) == [4, 8]
    # The loop's own validation of the same weights. (A second run with in-loop validation would train on other
    # weights: each validation pass draws its loader's seed from the global RNG, as in a plain loop, and so moves
    # the next epoch's shuffle.)
    for step, name in zip(evaluated, ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt")):
        checker = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        checker.validate(DigitsCNN(dropout=0.0), datamodule=DigitsData(),
                         ckpt_path=str(side_dir / "checkpoints" / name))
        assert evaluated[step] == pytest.approx(float(checker.callback_metrics["val/acc"]), abs=1e-6)
    assert side.callbacks and not any(getattr(c, "process", None) for c in side.callbacks)  # joined, gone


@pytest.mark.timeout(300)
def test_trainer_evaluate_watch_attached_to_a_running_ddp_job_scores_every_checkpoint_once(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [str(Path(sys.executable).parent / "trainer")]  # a console script: `python -m` cannot start workers
    fit = subprocess.Popen(
        [*command, "fit", DIGITS, DIGITS_DDP, "trainer.max_epochs=3", "trainer.limit_train_batches=3",
         "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         "callbacks.0.init_args.monitor=null", "callbacks.0.init_args.save_top_k=-1"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = subprocess.Popen(
        [*command, "evaluate", "runs/digits_ddp/version_0", "--watch", "--accelerator", "cpu", "--poll-interval",
         "0.2", "--timeout", "120"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    with reaped([fit, watch]):
        fit_output, _ = fit.communicate(timeout=250)
        if fit.returncode != 0:
            watch.kill()
        watch_output, _ = watch.communicate(timeout=250)
    assert fit.returncode == 0, fit_output
    assert watch.returncode == 0, watch_output
    run = tmp_path / "runs" / "digits_ddp" / "version_0"
    record = read_record(run)
    # Every epoch's checkpoint once, the last included (scored after the job said it ended); last.ckpt held the
    # newest state each time, which was scored once under either name.
    assert [(e.epoch, e.status) for e in record] == [(0, SCORED), (1, SCORED), (2, SCORED)]
    assert all(name.startswith(f"epoch={e.epoch}-") or name == "last.ckpt" for e in record for name in e.checkpoints)
    assert [int(row["step"]) for row in csv_rows(run / "metrics_evaluator.csv")] == [e.step for e in record]
    assert watch_output.count("evaluator: ") == 4, watch_output  # three scores, then the closing line


# --------------------------------------------------------------------------- GPUs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_evaluator_scores_on_a_gpu_as_on_the_cpu(tmp_path):
    trainer = digits_fit("cpu_trained", limit_val_batches=0)
    folder = trainer.checkpoint_callback.dirpath
    for where, gpu in (("on_cpu", None), ("on_gpu", 0)):
        run = tmp_path / "runs" / where / "version_0"
        Evaluator(Trainer, DigitsCNN(dropout=0.0), DigitsData(), run, folder, CPU, gpu=gpu,
                  say=lambda line: None).run()
    on_cpu, on_gpu = (read_record(tmp_path / "runs" / where / "version_0") for where in ("on_cpu", "on_gpu"))
    assert [e.step for e in on_gpu] == [e.step for e in on_cpu] == [4, 8]
    for ours, theirs in zip(on_gpu, on_cpu):
        assert ours.status == theirs.status == SCORED
        # Other kernels, the same weights: the loss agrees closely; at most one of the 359 images may tip over.
        assert ours.metrics["val/loss"] == pytest.approx(theirs.metrics["val/loss"], abs=1e-4)
        assert ours.metrics["val/acc"] == pytest.approx(theirs.metrics["val/acc"], abs=3e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.timeout(180)
def test_a_gpu_training_s_side_evaluator_scores_as_its_in_loop_validation(tmp_path):
    # The training takes GPU 0; 'auto' gives the evaluator the next GPU, or the CPU on a one-GPU machine.
    side = digits_fit("gpu_side", accelerator="cuda", evaluator={"poll_interval": 0.1}, limit_val_batches=0)
    evaluated = logged(Path(side.log_dir) / "metrics_evaluator.csv", "val/acc")
    assert list(evaluated) == [4, 8]
    # In-loop validation of the same weights, on the training's GPU: other kernels, so one image may tip over.
    for step, name in zip(evaluated, ("epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt")):
        checker = Trainer(accelerator="cuda", logger=False, enable_progress_bar=False, enable_model_summary=False)
        checker.validate(DigitsCNN(dropout=0.0), datamodule=DigitsData(),
                         ckpt_path=str(Path(side.log_dir) / "checkpoints" / name))
        assert evaluated[step] == pytest.approx(float(checker.callback_metrics["val/acc"]), abs=3e-3)
