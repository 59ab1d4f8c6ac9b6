"""Details of how a run starts and ends (issue 51): srun's and mpirun's tasks get a share of the node's cores as torch
threads, as the Trainer's own launcher gives its workers; the evaluator's output comes before the fit's last line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import ModelSummary
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cluster.environment import (
    ClusterEnvironment,
    mpi_environment,
    slurm_environment,
    usable_cores,
)
from torchyard.trainer.evaluation.evaluator import EvaluatorProcess

SRUN_TASK = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "node[1-2]"}
MPI_RANK = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


@pytest.mark.parametrize("detect, env", [(slurm_environment, SRUN_TASK), (mpi_environment, MPI_RANK)])
def test_a_launched_task_gets_its_share_of_the_nodes_cores_unless_omp_num_threads_says(detect, env):
    assert detect(env).threads == max(1, usable_cores() // 2)  # two tasks on this node
    assert detect({**env, "OMP_NUM_THREADS": "3"}).threads is None  # torch read it as it started
    if detect is slurm_environment:
        assert detect({**env, "SLURM_CPUS_PER_TASK": "5"}).threads == 5


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_run_sets_the_environments_threads_before_it_starts(monkeypatch):
    before = torch.get_num_threads()
    seen = []

    class Threads(Net):
        def on_fit_start(self):
            seen.append(torch.get_num_threads())

    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu")
    wanted = 2 if before != 2 else 3
    monkeypatch.setattr(trainer.strategy, "detect_environment", lambda: ClusterEnvironment("local", threads=wanted))
    try:
        data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
        trainer.fit(Threads(), DataLoader(data, batch_size=4))
    finally:
        torch.set_num_threads(before)
    assert seen == [wanted]


class Validated(Net):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.layer(x), y))

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)


class FakeSideProcess:
    """What EvaluatorProcess waits on: the order of the waits and the lines is what is checked."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.exitcode = events, 0

    def set(self) -> None:
        self.events.append("evaluator told the fit ended")

    def join(self) -> None:
        self.events.append("evaluator printed its last score and ended")

    def terminate(self) -> None:
        self.events.append("terminated")


def test_the_evaluator_ends_before_the_fits_closing_line(tmp_path, capsys, monkeypatch):
    events: list[str] = []
    trainer = Trainer(max_epochs=1, evaluator={"accelerator": "cpu"}, enable_progress_bar=False,
                      accelerator="cpu", callbacks=[ModelSummary(max_depth=0)])
    [evaluator] = [c for c in trainer.callbacks if isinstance(c, EvaluatorProcess)]
    kinds = [type(c) for c in trainer.callbacks]
    assert kinds.index(EvaluatorProcess) < kinds.index(ModelSummary)  # a user's summary too

    def start_fake(trainer, module):  # in place of the spawned side process
        evaluator.process, evaluator._ended = FakeSideProcess(events), FakeSideProcess(events)

    monkeypatch.setattr(evaluator, "on_fit_start", start_fake)
    monkeypatch.setattr("builtins.print", lambda *args, **kwargs: events.append(" ".join(map(str, args))))
    trainer.fit(Validated(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4))
    closing = next(i for i, line in enumerate(events) if line.startswith("trainer: training stopped"))
    assert events.index("evaluator printed its last score and ended") < closing
    assert evaluator.process is None
