"""`trainer scale` (trainer/scaling/study.py, scale_report.py) and the StepTiming callback it times each run with.

In-process: every check before a run, the recipe and commands of a layout, the report's numbers from StepTiming
files, StepTiming in a real one-process fit. Slow: a tiny study on this machine (a baseline and a 2-node layout).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import StepTiming
from torchyard.callbacks.step_timing import batch_size, parse_target, transfer_seconds
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cli.main import main
from torchyard.trainer.cli.recipe import load_recipe
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.scaling.report import add_speedups, draw_study, row_from_timing, verdict
from torchyard.trainer.scaling.study import (
    agent_commands,
    last_error_line,
    layout_recipe,
    parse_counts,
    parse_variants,
    plan_layouts,
    plan_study,
)

REPO = Path(__file__).resolve().parents[1]
DIGITS = str(REPO / "recipes" / "digits.yaml")


def plan(tmp_path: Path, devices: str = "1,2", nodes: str = "1,2", variants: str = "ddp",
         trainer_accelerator: str = "cpu", **options):
    settings = {"steps": 3, "epochs": None, "target": None, "warmup_steps": 1, "timeout_s": 60, **options}
    sources = [DIGITS, f"trainer.default_root_dir={tmp_path}", f"trainer.accelerator={trainer_accelerator}"]
    return plan_study(sources, devices, nodes, variants, **settings)


# --------------------------------------------------------------------------- checks before anything runs


@pytest.mark.parametrize(("argv", "message"), [
    (["--devices", "1,2", "--target", "val/f1=0.9"], "DigitsCNN never logs 'val/f1'"),
    (["--devices", "1,2", "--target", "val/acc"], "target 'val/acc' is not METRIC=VALUE"),
    (["--devices", "0,2"], "--devices '0,2' must list positive integers"),
    (["--devices", "two"], "--devices 'two' must list positive integers"),
    (["--devices", "2", "--variants", "ddp:sync_every=0"], "sync_every=0) must be an integer of at least 1"),
    (["--devices", "2", "--variants", "fsdq"], "strategy='fsdq' is not known"),
    (["--devices", "2", "--variants", "ddp:sync_every"], "options are written name:key=value"),
    (["--devices", "2", "--steps", "5", "--target", "val/acc=0.9"], "give the most epochs to try with --epochs"),
    (["--devices", "2", "--steps", "0"], "--steps 0 must be at least 1"),
])
def test_bad_input_is_one_line_before_any_run(tmp_path, capsys, argv, message):
    assert main(["scale", DIGITS, f"trainer.default_root_dir={tmp_path}", "trainer.accelerator=cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())  # no study folder, no run


def test_more_processes_than_cores_is_a_warning_naming_the_sharing(tmp_path):
    cores = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning, match=rf"starts {4 * cores} processes on {cores} CPU core\(s\): up to 4 "):
        plan(tmp_path, devices=f"1,{4 * cores}", nodes="1")


def test_layouts_spread_each_count_over_the_node_counts_that_divide_it():
    layouts = plan_layouts(parse_counts("4,1,2", "--devices"), parse_counts("1,2", "--nodes"),
                           parse_variants("ddp,ddp:sync_every=8:sync_warmup_steps=2"))
    assert [layout.label for layout in layouts] == [
        "1x1 single",
        "1x2 ddp", "1x2 ddp:sync_every=8:sync_warmup_steps=2", "2x1 ddp", "2x1 ddp:sync_every=8:sync_warmup_steps=2",
        "1x4 ddp", "1x4 ddp:sync_every=8:sync_warmup_steps=2", "2x2 ddp", "2x2 ddp:sync_every=8:sync_warmup_steps=2",
    ]
    assert layouts[2].variant.strategy == {"name": "ddp", "sync_every": 8, "sync_warmup_steps": 2}


def test_a_layouts_recipe_is_a_valid_recipe_at_that_shape_timed_by_step_timing(tmp_path):
    study = plan(tmp_path, devices="2", nodes="2", variants="ddp:sync_every=8")
    scale_out = study.layouts[1]
    folder = tmp_path / scale_out.folder_name
    resolved = layout_recipe(study, scale_out, folder)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(json.dumps(resolved))  # JSON is YAML
    recipe = load_recipe([str(recipe_file)])
    assert (recipe.trainer.devices, recipe.trainer.num_nodes, recipe.trainer.max_steps) == (1, 2, 4)
    assert recipe.trainer.strategy == {"name": "ddp", "sync_every": 8, "time_communication": True}
    assert [spec.cls for spec in recipe.callbacks] == [StepTiming]
    assert recipe.callbacks[0].init_args["output"] == str(folder / "timing.json")
    commands = agent_commands(scale_out, recipe_file, 29500)
    assert [[arg for arg in command if arg.startswith("--node-rank")] for command in commands] == [
        ["--node-rank=0"], ["--node-rank=1"]]
    assert all("--nnodes=2" in command and "--nproc-per-node=1" in command for command in commands)
    assert agent_commands(study.layouts[0], recipe_file, 29500) == [
        [sys.executable, "-m", "torchyard.trainer", "fit", str(recipe_file)]]


AGENT_REPORT = """Traceback (most recent call last):
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  error_file: <N/A>
"""


def test_a_failed_runs_error_is_the_workers_not_the_agents(tmp_path):
    (tmp_path / "node0.log").write_text("trainer fit: error: DDPStrategy(backend='nccl') needs CUDA devices.\n"
                                         + AGENT_REPORT)
    assert last_error_line(tmp_path) == "trainer fit: error: DDPStrategy(backend='nccl') needs CUDA devices."
    (tmp_path / "node0.log").write_text("[rank1]: RuntimeError: boom at step 3\n" + AGENT_REPORT)
    assert last_error_line(tmp_path) == "[rank1]: RuntimeError: boom at step 3"


def test_targets_and_batch_sizes_are_read_as_written():
    assert parse_target("val/acc=0.97") == ("val/acc", ">=", 0.97)
    assert parse_target("val/loss=1.5") == ("val/loss", "<=", 1.5)
    assert parse_target("val/acc>=0.5") == ("val/acc", ">=", 0.5)
    assert batch_size((torch.zeros(7, 3), torch.zeros(7))) == 7
    assert batch_size({"x": torch.zeros(5, 2)}) == 5


# --------------------------------------------------------------------------- the report


def timing(ranks: list[tuple[float, float, float, int, int, float]], steps_per_epoch: float = 10,
           transfer_s: float = 0.0) -> dict:
    keys = ("step_s", "communication_s", "data_wait_s", "steps", "samples", "wall_s")
    return {"ranks": [{**dict(zip(keys, rank)), "peak_memory_mb": 100.0 + i, "transfer_s": transfer_s}
                      for i, rank in enumerate(ranks)], "steps_per_epoch": steps_per_epoch, "target": None}


def test_the_transfer_of_a_step_is_the_wait_of_the_rank_that_arrived_last():
    # rank 0 waited 0.1 s then 0.5 s, rank 1 0.3 s then 0.2 s: the transfers took at most 0.1 and 0.2 s.
    assert transfer_seconds([[0.1, 0.5], [0.3, 0.2]]) == pytest.approx(0.3)
    assert transfer_seconds([]) == 0.0


def test_rows_hold_throughput_over_all_ranks_and_per_step_means_and_the_verdict_explains():
    one = row_from_timing("1x1 single", 1, 1, "single", timing([(1.0, 0.0, 0.1, 100, 6400, 1.1)]), 5.0)
    two = row_from_timing("1x2 ddp", 1, 2, "ddp",
                          timing([(2.0, 0.5, 0.2, 100, 6400, 2.2), (1.8, 0.3, 0.2, 100, 6400, 2.0)], 5, 0.25), 6.0)
    failed = row_from_timing("2x1 ddp", 2, 1, "ddp", timing([(0.0, 0.0, 0.0, 0, 0, 0.0)] * 2), 1.0)
    rows = [one, two, failed]
    add_speedups(rows)
    assert one.samples_per_s == pytest.approx(6400 / 1.1) and two.samples_per_s == pytest.approx(12800 / 2.2)
    assert two.speedup == pytest.approx((12800 / 2.2) / (6400 / 1.1))
    assert two.efficiency == pytest.approx(two.speedup / 2)
    # per step: 19 ms in the step, of which 4 ms waiting (2.5 ms the transfer, 1.5 ms for the slower rank), 2 ms data
    assert (two.compute_ms, two.communication_ms, two.imbalance_ms, two.data_ms) == pytest.approx((15, 4, 1.5, 2))
    assert two.epoch_s == pytest.approx((19.0 + 2.0) / 1000 * 5)
    assert two.peak_memory_mb == [100.0, 101.0]
    assert "no step was measured" in failed.error and math.isnan(failed.speedup)
    text = verdict(rows, by_target=False)
    assert text.startswith("Fastest: 1x1 single")
    assert ("At 1x2 ddp a step takes 21.0 ms: communication is 19% of it (4.0 ms, of which 1.5 ms waiting for slower "
            "ranks), data wait 2.0 ms") in text
    assert "compute 15.0 ms (1.5x one process's 10.0 ms: the processes compete for cores)" in text


def test_the_png_is_written_and_reads_back(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = [row_from_timing("1x1 single", 1, 1, "single", timing([(1.0, 0.0, 0.1, 100, 6400, 1.1)]), 5.0)]
    add_speedups(rows)
    path = draw_study(rows, tmp_path / "scale.png", "header")
    assert plt.imread(path).shape[2] in (3, 4)


# --------------------------------------------------------------------------- StepTiming in a fit


class Tiny(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val/score", float(self.current_epoch))  # 0, 1, 2, ...: reaches 2 after the third epoch

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_step_timing_counts_the_steps_after_warm_up_and_stops_at_the_target(tmp_path):
    data = TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    output = tmp_path / "timing.json"
    trainer = Trainer(max_epochs=10, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), num_sanity_val_steps=0, log_every_n_steps=1,
                      callbacks=[StepTiming(str(output), warmup_steps=2, target="val/score>=2")])
    trainer.fit(Tiny(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    report = json.loads(output.read_text())
    assert trainer.current_epoch == 3  # stopped once the target was reached, not after 10 epochs
    (rank,) = report["ranks"]
    assert rank["steps"] == 3 * 3 - 2 and rank["samples"] == 8 * rank["steps"]
    assert 0 < rank["step_s"] <= rank["wall_s"] and rank["communication_s"] == 0.0
    assert report["target"]["epochs"] == 3.0 and report["target"]["value"] == 2.0
    assert rank["peak_memory_mb"] > 0


# --------------------------------------------------------------------------- a tiny study on this machine


@pytest.mark.timeout(420)  # about 35 s on 2 idle cores; minutes when other jobs load them
def test_a_tiny_study_runs_a_baseline_and_two_node_layouts_and_writes_the_table_and_png(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "torchyard.trainer", "scale", DIGITS, f"trainer.default_root_dir={tmp_path}",
         "trainer.accelerator=cpu",
         "--devices", "2", "--nodes", "2", "--steps", "3", "--warmup-steps", "1",
         "--variants", "ddp,ddp:backend=nccl"],  # nccl on CPU: a run that fails (in its workers) is a row
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = tmp_path / "scale_digits" / "version_0"
    rows = json.loads((root / "runs.json").read_text())
    assert [(row["label"], row["error"]) for row in rows[:2]] == [("1x1 single", None), ("2x1 ddp", None)]
    assert rows[2]["label"] == "2x1 ddp:backend=nccl" and "backend='nccl') needs CUDA devices" in rows[2]["error"]
    assert rows[1]["communication_ms"] > 0 and rows[1]["imbalance_ms"] >= 0 and len(rows[1]["peak_memory_mb"]) == 2
    assert (root / "scale.png").stat().st_size > 0 and "Fastest:" in (root / "runs.md").read_text()
    assert (root / "2x1_ddp" / "run" / "version_0" / "metrics.csv").is_file()
    assert "2x1 ddp" in done.stdout


# --------------------------------------------------------------------------- CUDA (run where a GPU is lent)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_step_timing_reports_the_peak_of_allocated_gpu_memory(tmp_path):
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    output = tmp_path / "timing.json"
    trainer = Trainer(max_epochs=1, accelerator="cuda", devices=1, enable_progress_bar=False, logger=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      default_root_dir=str(tmp_path), callbacks=[StepTiming(str(output), warmup_steps=1)])
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    (rank,) = json.loads(output.read_text())["ranks"]
    assert rank["steps"] == 7 and rank["peak_memory_mb"] == pytest.approx(torch.cuda.max_memory_allocated() / 2**20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_more_processes_than_gpus_is_a_one_line_error(tmp_path):
    gpus = torch.cuda.device_count()
    with pytest.raises(MisconfigurationError, match=f"needs {gpus + 1} CUDA devices on this machine, which has {gpus}"):
        plan(tmp_path, devices=f"1,{gpus + 1}", nodes="1", trainer_accelerator="cuda")
