"""Loggers as Lightning code uses them: `experiment`, log_hyperparams(params, metrics), the loggers import path,
trainer.log_dir as a string; MLFlowLogger against a real tracking store (sqlite, and a `mlflow server` process)."""

from __future__ import annotations

import csv
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

from torchyard.callbacks import ModelCheckpoint
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger  # Lightning's `loggers` path

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0,
             log_every_n_steps=1)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(count)]


class Linear(TrainModule):
    def __init__(self, lr: float = 0.1, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_experiment_and_log_hyperparams_with_metrics(tmp_path):
    logger = CSVLogger(tmp_path, "exp")
    logger.log_hyperparams({"lr": 0.1}, {"hp_metric": 0.5})
    experiment = logger.experiment
    experiment.log_metrics({"acc": 0.25}, step=3)
    experiment.log_hparams({"lr": 0.2})
    experiment.save()
    assert experiment.log_dir == str(tmp_path / "exp" / "version_0")
    assert [(r["step"], r["hp_metric"], r["acc"]) for r in rows(Path(experiment.metrics_file_path))] == [
        ("0", "0.5", ""), ("3", "", "0.25")]
    assert (tmp_path / "exp" / "version_0" / "hparams.yaml").read_text().strip() == "lr: 0.2"


def test_log_dir_is_a_string(tmp_path):
    trainer = Trainer(max_epochs=1, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(Linear(), batches(2))
    assert trainer.log_dir == str(tmp_path / "default" / "version_0")
    assert (Path(trainer.log_dir) / "metrics.csv").is_file()


def test_tensorboard_experiment_is_a_summary_writer(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    logger = TensorBoardLogger(tmp_path, "tb")
    assert isinstance(logger.experiment, SummaryWriter)
    logger.log_hyperparams({"lr": 0.1}, {"hp_metric": 0.5})
    logger.save()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logger.log_dir))
    events.Reload()
    assert events.Scalars("hp_metric")[0].value == 0.5


# --------------------------------------------------------------------------- MLflow


def check_run(client, run_id: str, module: Linear, csv_rows: list[dict[str, str]]) -> None:
    """The run's params are the hparams, its metrics the CSV logger's, its checkpoint the trained weights."""
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "0.1", "width": "3"}
    expected = [(int(r["step"]), float(r["train_loss"])) for r in csv_rows if r.get("train_loss")]
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train_loss"))
    assert history == [(step, pytest.approx(value, rel=1e-6)) for step, value in expected] and len(history) == 4
    assert client.get_metric_history(run_id, "val_loss")
    names = sorted(a.path for a in client.list_artifacts(run_id, "checkpoints"))
    assert "checkpoints/last.ckpt" in names
    local = client.download_artifacts(run_id, "checkpoints/last.ckpt")
    saved = torch.load(local, weights_only=True)["state_dict"]
    assert torch.equal(saved["layer.weight"], module.layer.weight)
    assert run.info.status == "FINISHED"


def fit_with_mlflow(tmp_path: Path, tracking_uri: str, **mlflow_options) -> tuple[MLFlowLogger, Linear, list]:
    csv_logger = CSVLogger(tmp_path / "csv", "run")
    mlflow = MLFlowLogger("ported", tracking_uri=tracking_uri, save_dir=str(tmp_path / "mlruns"), log_model=True,
                          **mlflow_options)
    module = Linear()
    trainer = Trainer(max_epochs=2, default_root_dir=str(tmp_path), logger=[mlflow, csv_logger],
                      callbacks=[ModelCheckpoint(save_last=True)], **QUIET)
    trainer.fit(module, batches(2), batches(1))
    assert trainer.log_dir == mlflow.log_dir == str(Path(trainer.checkpoint_callback.dirpath).parent)
    return mlflow, module, rows(csv_logger.metrics_path)


def test_mlflow_logger_with_a_sqlite_store(tmp_path):
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger, module, csv_rows = fit_with_mlflow(tmp_path, uri, artifact_location=(tmp_path / "artifacts").as_uri())
    from mlflow.tracking import MlflowClient

    check_run(MlflowClient(uri), logger.run_id, module, csv_rows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_mlflow_logger_with_an_mlflow_server(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # The schema is created here, in this process (mlflow is imported already): the server then starts on a
    # migrated database instead of running its dozens of migrations itself.
    MlflowClient(f"sqlite:///{tmp_path / 'server.db'}").search_experiments()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "served-artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start (exit code {server.poll()})")
                time.sleep(0.5)
        logger, module, csv_rows = fit_with_mlflow(tmp_path, uri)
        check_run(MlflowClient(uri), logger.run_id, module, csv_rows)
        assert any((tmp_path / "served-artifacts").rglob("last.ckpt"))  # uploaded through the server
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
