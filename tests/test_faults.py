"""Fault tolerance, each fault caused for real: SIGKILL (mid-epoch, mid-write, one ddp rank), SIGTERM,
corrupt checkpoints, a rank stuck before a collective, NaN losses.

The runs come from tests/faults/fault_script.py, in a subprocess where the test kills or signals them, in
this process (or workers the Trainer starts from it) otherwise. Every resumed run must end on the weights
of the uninterrupted run, bitwise, with the same metrics.csv rows.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from faults import fault_script
from faults.fault_script import KillAt, SampleLog, fit, metrics_rows, starts
from processes import reaped
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.callbacks import Callback, ModelCheckpoint
from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.cli.main import main as ledger_command
from torchyard.trainer.cluster.environment import find_free_port
from torchyard.trainer.data.ledger import read_ledger
from torchyard.trainer.data.loaders import prepare_loader
from torchyard.trainer.errors import CheckpointError
from torchyard.trainer.loop import faults
from torchyard.trainer.loop.faults import (
    SIGINT_EXIT_CODE,
    SIGTERM_EXIT_CODE,
    NonFiniteLossError,
)
from torchyard.trainer.strategies import base as strategies_base

SCRIPT = Path(fault_script.__file__)
QUIET = dict(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(autouse=True)
def _deterministic_flag_restored():
    """fit(deterministic=True) in this process switches a global torch flag; give it back."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def run_folder(root: Path) -> Path:
    return root / "default" / "version_0"


def saved_step(path: Path) -> int:
    return load_checkpoint_file(path)["loops"]["progress"]["global_step"]


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{key} differs from the uninterrupted run"


def start_script(root: Path, *args: str) -> subprocess.Popen:
    """fault_script.py in its own session (its process group holds the workers it starts)."""
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(root), *args], cwd=root, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    """Wait for the script; kill its whole group if it outlives the timeout or the test fails."""
    with reaped([proc]):
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output


def wait_for(marker: Path, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while not marker.exists():
        if proc.poll() is not None or time.time() > deadline:
            code, output = finish(proc, timeout=1)
            pytest.fail(f"{marker.name} never appeared (exit code {code}):\n{output[-3000:]}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The uninterrupted one-process run: final weights and metrics.csv rows."""
    root = tmp_path_factory.mktemp("single_reference")
    before = torch.are_deterministic_algorithms_enabled()
    module = fit(root, "single")
    torch.use_deterministic_algorithms(before)
    return module.state_dict(), metrics_rows(root)


@pytest.fixture(scope="module")
def uninterrupted(ddp_reference, tmp_path_factory):
    """The uninterrupted 2-process run of a strategy, started from this process, by where its seed came from (each
    run once): weights and metrics.csv rows. ddp seeded by the Trainer is conftest.py's, shared with the Ray tests."""
    runs = {("ddp", "trainer"): (ddp_reference[0], metrics_rows(ddp_reference[1]))}

    def run(strategy: str = "ddp", seed_from: str = "trainer") -> tuple[dict[str, torch.Tensor], list[dict[str, str]]]:
        if (strategy, seed_from) not in runs:
            root = tmp_path_factory.mktemp(f"{strategy}_reference_{seed_from}")
            module = fit(root, strategy, seed_from=seed_from)
            runs[strategy, seed_from] = module.state_dict(), metrics_rows(root)
        return runs[strategy, seed_from]

    return run


@pytest.fixture(scope="module")
def ddp_run(uninterrupted):
    return uninterrupted("ddp")


# --------------------------------------------------------------------------- one process


@pytest.mark.timeout(180)
def test_a_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(single_run, tmp_path):
    code, output = finish(start_script(tmp_path, "single", "--kill-at", "7"))
    assert code == -signal.SIGKILL, output[-3000:]
    assert saved_step(run_folder(tmp_path) / "checkpoints" / "last.ckpt") == 6
    resumed = fit(tmp_path, "single", ckpt_path="last")
    assert starts(tmp_path) == ["0 0", "0 6"]
    assert_same_weights(resumed.state_dict(), single_run[0])
    assert metrics_rows(tmp_path) == single_run[1]  # the kill's unsaved rows neither lost nor doubled


@pytest.mark.timeout(180)
def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one_intact(single_run, tmp_path):
    proc = start_script(tmp_path, "single", "--slow-write-at", "6")
    wait_for(tmp_path / "marker", proc)
    os.killpg(proc.pid, signal.SIGKILL)  # half of step 6's checkpoint is on disk, in its temporary file
    finish(proc)
    folder = run_folder(tmp_path) / "checkpoints"
    with pytest.raises(CheckpointError, match=r"epoch=0-step=6\.ckpt\.tmp.*truncated or corrupt"):
        load_checkpoint_file(folder / "epoch=0-step=6.ckpt.tmp")
    assert not (folder / "epoch=0-step=6.ckpt").exists()
    assert saved_step(folder / "last.ckpt") == 3  # the previous one, whole
    resumed = fit(tmp_path, "single", ckpt_path="last")
    assert starts(tmp_path) == ["0 0", "0 3"]
    assert_same_weights(resumed.state_dict(), single_run[0])


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("crash")


@pytest.mark.timeout(120)
def test_corrupt_checkpoints_are_skipped_with_a_warning_naming_them(single_run, tmp_path):
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path, "single", [CrashAt(10)])
    folder = run_folder(tmp_path) / "checkpoints"
    data = (folder / "last.ckpt").read_bytes()
    (folder / "last.ckpt").write_bytes(data[: len(data) // 2])  # truncated
    (folder / "epoch=0-step=9.ckpt").write_bytes(b"\x00" * 512)  # garbage
    with pytest.warns(UserWarning) as warned:
        resumed = fit(tmp_path, "single", ckpt_path="last")
    messages = [str(w.message) for w in warned if "Skipped it" in str(w.message)]
    assert len(messages) == 2
    assert any("last.ckpt' is truncated or corrupt" in m for m in messages)
    assert any("epoch=0-step=9.ckpt' is truncated or corrupt" in m for m in messages)
    assert all("using" in m and "epoch=0-step=6.ckpt" in m for m in messages)
    assert starts(tmp_path) == ["0 0", "0 6"]
    assert_same_weights(resumed.state_dict(), single_run[0])
    assert metrics_rows(tmp_path) == single_run[1]  # rows 7-10 of the crashed run dropped, then re-logged


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig, exit_code", [(signal.SIGTERM, SIGTERM_EXIT_CODE), (signal.SIGINT, SIGINT_EXIT_CODE)])
def test_sigterm_or_ctrl_c_saves_a_checkpoint_exits_and_the_next_start_resumes(single_run, tmp_path, sig, exit_code):
    proc = start_script(tmp_path, "single", "--slow-from", "5")
    wait_for(tmp_path / "marker", proc)
    proc.send_signal(sig)
    code, output = finish(proc)
    assert code == exit_code, output[-3000:]
    last = run_folder(tmp_path) / "checkpoints" / "last.ckpt"
    assert f"trainer: {sig.name}: saved {last}" in output and "Traceback" not in output
    step = saved_step(last)
    assert 5 <= step < 24  # where the signal landed; the run had 24 steps to go
    resumed = fit(tmp_path, "single", ckpt_path="last")
    assert starts(tmp_path) == ["0 0", f"0 {step}"]
    assert_same_weights(resumed.state_dict(), single_run[0])
    assert metrics_rows(tmp_path) == single_run[1]



def test_the_sigterm_checkpoints_name_is_made_durable_before_the_process_exits(tmp_path, monkeypatch):
    """A preempted machine may be switched off right after the exit, before the filesystem's next commit: the
    stage's end (which the stop goes through) syncs the folder before fit raises."""
    events = []
    real_save = Trainer.save_checkpoint

    def save_checkpoint(self, path, weights_only=False, **kwargs):
        real_save(self, path, weights_only, **kwargs)
        events.append(("saved", Path(path)))

    class SignalAtStep3(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(strategies_base, "sync_folder", lambda folder: events.append(("synced", Path(folder))))
    with pytest.raises(faults.Terminated):
        fit(tmp_path, "single", [SignalAtStep3()])
    last = run_folder(tmp_path) / "checkpoints" / "last.ckpt"
    assert events[-2:] == [("saved", last), ("synced", last.parent)]  # before it, the epoch-end checkpoint
    assert saved_step(last) == 4  # the step boundary after the signal


# --------------------------------------------------------------------------- non-finite losses

POISONED = 13  # this sample's input is NaN, so the loss of whichever batch holds it is NaN


def poisoned_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=generator)
    y = x.sum(1, keepdim=True)
    x[POISONED, 0] = float("nan")
    return TensorDataset(x, y)


class Linear(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def epoch_batches(epoch: int) -> list[list[int]]:
    """The trainer's training order for `epoch`: the loader's own shuffle, drawn from the global RNG (seeded with 5
    as the fit starts; nothing else draws from it here) as each epoch starts, batches of 4."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        indices = DataLoader(range(len(poisoned_data())), batch_size=4, shuffle=True)
        orders = [[batch.tolist() for batch in indices] for _ in range(epoch + 1)]
    return orders[epoch]


def fit_poisoned(root: Path, **options) -> Linear:
    torch.manual_seed(0)
    module = Linear()
    checkpoints = ModelCheckpoint(every_n_train_steps=1, save_last=True, save_top_k=0)
    trainer = Trainer(seed=5, max_epochs=2, default_root_dir=str(root), log_every_n_steps=1, callbacks=[checkpoints],
                      **QUIET, **options)
    trainer.fit(module, DataLoader(poisoned_data(), batch_size=4, shuffle=True))
    return module


def test_a_nan_loss_stops_before_its_step_and_the_last_checkpoint_stays_finite(tmp_path):
    bad_batch = next(i for i, batch in enumerate(epoch_batches(0)) if POISONED in batch)
    with pytest.raises(
        NonFiniteLossError, match=rf"loss was nan at global step {bad_batch} \(epoch 0, batch {bad_batch}\)"
    ):
        fit_poisoned(tmp_path)
    last = load_checkpoint_file(run_folder(tmp_path) / "checkpoints" / "last.ckpt")
    assert last["loops"]["progress"]["global_step"] == bad_batch
    assert all(torch.isfinite(value).all() for value in last["state_dict"].values())
    # The checkpoint is the state of a run that simply stopped before the poisoned batch.
    stopped = fit_poisoned(tmp_path / "stopped", max_steps=bad_batch)
    assert_same_weights(last["state_dict"], stopped.state_dict())


@pytest.fixture
def reads_wait(monkeypatch):
    """Reading a loss waits for the device, as on a GPU (its test is in test_cuda.py): the guard keeps the losses
    and reads them together, every READ_LOSSES_EVERY_S (set it with the returned function)."""
    monkeypatch.setattr(faults, "reads_wait_for", lambda device: True)
    return lambda seconds: monkeypatch.setattr(faults, "READ_LOSSES_EVERY_S", seconds)


def test_a_nan_loss_read_late_still_leaves_no_checkpoint_after_it(tmp_path, reads_wait):
    reads_wait(3600.0)  # read only where a checkpoint is built: here after every step
    bad_batch = next(i for i, batch in enumerate(epoch_batches(0)) if POISONED in batch)
    with pytest.raises(NonFiniteLossError, match=rf"loss was nan at global step {bad_batch} \(epoch 0, batch "
                                                 rf"{bad_batch}\); .* so 1 optimizer step\(s\) from that one on"):
        fit_poisoned(tmp_path)
    # The checkpoint after the bad step was never written: the last one is a run that stopped before it.
    last = load_checkpoint_file(run_folder(tmp_path) / "checkpoints" / "last.ckpt")
    assert last["loops"]["progress"]["global_step"] == bad_batch
    assert_same_weights(last["state_dict"], fit_poisoned(tmp_path / "stopped", max_steps=bad_batch).state_dict())


class LinearWithOneElementLosses(Linear):
    """Its odd batches' losses have shape (1,), which backward takes as it takes a scalar's."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss.reshape(1) if batch_idx % 2 else loss


@pytest.mark.parametrize("module_class", [Linear, LinearWithOneElementLosses])
def test_a_nan_loss_read_late_stops_the_fit_at_its_epoch_end_naming_its_step(tmp_path, reads_wait, module_class):
    reads_wait(3600.0)
    torch.manual_seed(0)
    trainer = Trainer(seed=5, max_epochs=2, default_root_dir=str(tmp_path), enable_checkpointing=False, logger=False,
                      **QUIET)
    bad_batch = next(i for i, batch in enumerate(epoch_batches(0)) if POISONED in batch)
    later = 8 - bad_batch  # the epoch's 8 steps from the bad one on
    with pytest.raises(NonFiniteLossError, match=rf"at global step {bad_batch} .* so {later} optimizer step"):
        trainer.fit(module_class(), DataLoader(poisoned_data(), batch_size=4, shuffle=True))
    assert trainer.global_step == 8 and trainer.current_epoch == 0


def test_a_loss_read_as_soon_as_it_is_due_still_stops_before_its_step(tmp_path, reads_wait):
    reads_wait(0.0)  # due at every step: read before that step's optimizer step, as on a CPU
    torch.manual_seed(0)
    module = Linear()
    trainer = Trainer(seed=5, max_epochs=2, default_root_dir=str(tmp_path), enable_checkpointing=False, logger=False,
                      **QUIET)
    bad_batch = next(i for i, batch in enumerate(epoch_batches(0)) if POISONED in batch)
    with pytest.raises(NonFiniteLossError, match=rf"at global step {bad_batch} .* training stopped before that"):
        trainer.fit(module, DataLoader(poisoned_data(), batch_size=4, shuffle=True))
    assert trainer.global_step == bad_batch
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_skip_mode_drops_nan_steps_like_a_hand_written_loop_and_counts_them(tmp_path):
    handlers = [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)]
    module = fit_poisoned(tmp_path, nonfinite_loss="skip")
    assert [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)] == handlers  # fit gave them back
    torch.manual_seed(0)
    reference = Linear()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    x, y = poisoned_data().tensors
    for epoch in range(2):
        for batch in epoch_batches(epoch):
            loss = F.mse_loss(reference.layer(x[batch]), y[batch])
            if not math.isfinite(loss.item()):
                continue  # no step, and no gradient carried into the next one
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert_same_weights(module.state_dict(), reference.state_dict())
    assert module.trainer.global_step == 2 * 8 - 2
    skipped = [row["train/skipped_nonfinite"] for row in metrics_rows(tmp_path) if row.get("train/skipped_nonfinite")]
    assert skipped == ["1.0", "1.0"]  # one poisoned batch in each epoch


class SignalDisposition(torch.utils.data.Dataset):
    """Each item: whether the process that loads it ignores SIGTERM, and the worker init's mark."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index):
        return signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, os.environ.get("USER_INIT_RAN", "no")


def mark_user_init(worker_id: int) -> None:
    os.environ["USER_INIT_RAN"] = "yes"


def test_loader_workers_ignore_sigterm_and_still_run_the_users_worker_init(tmp_path):
    loader = DataLoader(SignalDisposition(), batch_size=2, num_workers=1, worker_init_fn=mark_user_init)
    assert next(iter(loader))[0].tolist() == [False, False]  # as torch leaves them
    prepared = prepare_loader(loader, train=True)
    ignored, user_init_ran = next(iter(prepared))
    assert ignored.tolist() == [True, True] and user_init_ran == ("yes", "yes")
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # this process still hears it


def test_the_sigterm_agreement_exchanges_off_the_training_thread_and_stops_at_the_agreed_boundary():
    """The ranks' SIGTERM flags go round in a thread of their own (here on a one-rank gloo group): the training
    thread only counts its step boundaries, and stops at the one the exchange agreed, after the signal."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    signalled = [False]
    agreement = faults.SignalAgreement(lambda: signalled[0], timeout_s=60)
    boundary = 0
    while boundary < 100_000:
        boundary += 1
        if boundary == 20:
            signalled[0] = True
        if agreement.at_boundary():
            break
        time.sleep(0.001)  # a step
    assert agreement.stop_at is not None and 20 < boundary == agreement.stop_at
    agreement.close(together=True)
    assert not agreement._thread.is_alive()
    # A rank whose fit failed leaves after at most one more exchange, telling the others.
    leaving = faults.SignalAgreement(lambda: False, timeout_s=60)
    leaving.close(together=False)
    assert not leaving._thread.is_alive() and leaving._apart


# --------------------------------------------------------------------------- ddp on 2 processes


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "seed_from"), [("ddp", "trainer"), ("ddp", "seed_everything"),
                                                 ("fsdp", "trainer")])
def test_an_elastic_restart_after_a_rank_is_killed_resumes_to_the_uninterrupted_weights(
    uninterrupted, tmp_path, capfd, strategy, seed_from
):
    """The seed from Trainer(seed=) or from the script's seed_everything (which reaches the workers as the
    launching process's RNG state): the run that lost rank 1 and restarted ends on the uninterrupted weights."""
    log = tmp_path / "samples.txt"
    module = fit(tmp_path, strategy, [KillAt(5, rank=1), SampleLog(str(log))], max_restarts=1,
                 seed_from=seed_from)  # rank 1 dies at 5
    assert "restart 1: resuming from" in capfd.readouterr().err
    assert starts(tmp_path) == ["0 0", "1 3"]  # the restarted group began at the last checkpoint, not at 0
    assert_same_weights(module.state_dict(), uninterrupted(strategy, seed_from)[0])
    assert metrics_rows(tmp_path) == uninterrupted(strategy, seed_from)[1]
    # The sample ledger (run folder and `trainer ledger`) shows each epoch's samples once, as the batches held them.
    fault_script.assert_each_sample_trained_once(read_ledger(run_folder(tmp_path)), log)
    assert ledger_command(["ledger", str(run_folder(tmp_path))]) == 0
    assert capfd.readouterr().out.splitlines() == [f"epoch {e}: 48 of 48 samples trained, each exactly once"
                                                   for e in (0, 1)]


@pytest.mark.timeout(120)
def test_seed_everything_in_the_script_makes_two_ddp_runs_with_dropout_and_a_shuffled_loader_equal(uninterrupted,
                                                                                                   tmp_path):
    again = fit(tmp_path, "ddp", seed_from="seed_everything")
    assert_same_weights(again.state_dict(), uninterrupted("ddp", "seed_everything")[0])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig, exit_code", [(signal.SIGTERM, SIGTERM_EXIT_CODE), (signal.SIGINT, SIGINT_EXIT_CODE)])
def test_sigterm_or_ctrl_c_to_a_ddp_job_saves_on_every_rank_and_the_next_start_resumes(
    ddp_run, tmp_path, sig, exit_code
):
    proc = start_script(tmp_path, "ddp", "--slow-from", "2")
    wait_for(tmp_path / "marker", proc)
    os.killpg(proc.pid, sig)  # as SLURM (SIGTERM) or a terminal's Ctrl-C (SIGINT) do: the launcher and every worker
    code, output = finish(proc)
    assert code == exit_code, output[-3000:]
    last = run_folder(tmp_path) / "checkpoints" / "last.ckpt"
    assert f"trainer: {sig.name}: saved {last}" in output and "Traceback" not in output
    step = saved_step(last)
    assert 2 <= step < 12
    resumed = fit(tmp_path, "ddp", ckpt_path="last")
    assert starts(tmp_path) == ["0 0", f"0 {step}"]
    assert_same_weights(resumed.state_dict(), ddp_run[0])
    assert metrics_rows(tmp_path) == ddp_run[1]


# A rank stuck before a collective: tests/test_diagnosis.py (the report naming it and its line, on every strategy).
