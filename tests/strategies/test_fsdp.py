"""strategy="fsdp" (torch FSDP2): against ddp on 2 CPU processes, and its checkpoints, full and sharded.

The 2-process cases run as one launched job (fsdp_cases.py, started once for the module): fsdp and ddp fits of
the same settings must land on the same weights, and a sharded checkpoint resumes bitwise. The rest runs in this
process on one rank (a world of one process shards nothing, but runs every code path of the strategy).
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import fsdp_cases
import pytest
import torch
from fsdp_cases import BATCH, EPOCHS, QUIET, SEED, TRAIN, VAL, Block, Net, checkpoint_folder, initial_state
from processes import run_ranks
from torch import nn
from torch.utils.data import DataLoader

from torchyard.callbacks import ModelCheckpoint
from torchyard.trainer import Trainer
from torchyard.trainer.cli.main import main as cli
from torchyard.trainer.errors import CheckpointError, MisconfigurationError
from torchyard.trainer.strategies import build_strategy
from torchyard.trainer.strategies.fsdp import FSDPStrategy, shard_units

ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nccl, bf16, cpu offload)")


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol, msg=key)


def loaders() -> tuple[DataLoader, DataLoader]:
    return DataLoader(TRAIN, batch_size=BATCH, shuffle=True), DataLoader(VAL, batch_size=BATCH)


def fresh(cls: type[Net] = Net, *args) -> Net:
    module = cls(*args)
    module.load_state_dict(initial_state(cls, *args))
    return module


def one_rank(root: Path, strategy: dict | str, **options) -> Trainer:
    return Trainer(strategy=strategy, devices=1, seed=SEED, default_root_dir=str(root),
                   **{"max_epochs": EPOCHS, **QUIET, **options})


# --------------------------------------------------------------------------- the 2-process job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """fsdp_cases.py on 2 ranks, which see torchrun's variables (so the Trainer starts nothing): its output folder and
    rank 0's results."""
    out = tmp_path_factory.mktemp("fsdp_job")
    run_ranks(fsdp_cases.main, 2, [str(out)], out, timeout=150)
    return out, torch.load(out / "results.pt", weights_only=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("fsdp", "ddp"), [
    ("fsdp_sgd", "ddp_sgd"),  # SGD with momentum; shard units by class name; sharded checkpoints saved
    ("fsdp_adamw", "ddp_adamw"),  # AdamW, 2 micro-batches a step (no reduce on the first), clipped by global norm
    ("fsdp_manual", "ddp_clipped"),  # manual optimization (clip_gradients by hand), activation checkpointing
    ("fsdp_from_ddp", "ddp_sgd"),  # resumed from ddp's epoch-0 file
])
def test_fsdp_lands_on_ddps_weights_and_metrics(job, fsdp, ddp):
    _, results = job
    assert_same_weights(results[fsdp]["weights"], results[ddp]["weights"], atol=1e-6)
    assert results[fsdp]["global_step"] == results[ddp]["global_step"]
    assert results[fsdp]["metrics"]["val_loss"] == pytest.approx(results[ddp]["metrics"]["val_loss"], rel=1e-5)
    assert results[fsdp]["metrics"]["gathered_ranks"] == 1.0  # all_gather of each rank's rank: 0 + 1


@pytest.mark.timeout(200)
def test_a_full_file_gathered_from_2_ranks_holds_the_whole_model_and_optimizer_and_resumes_under_ddp(job, tmp_path):
    out, results = job
    fsdp_file, ddp_file = (checkpoint_folder(out, case) / "epoch=1.ckpt" for case in ("fsdp_from_ddp", "ddp_sgd"))
    gathered, reference = (torch.load(path, weights_only=True) for path in (fsdp_file, ddp_file))
    assert_same_weights(gathered["state_dict"], results["fsdp_from_ddp"]["weights"], atol=0)
    assert gathered["optimizer_states"][0]["param_groups"] == reference["optimizer_states"][0]["param_groups"]
    for index, state in reference["optimizer_states"][0]["state"].items():  # momentum, in torch's own layout
        torch.testing.assert_close(gathered["optimizer_states"][0]["state"][index]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=0, atol=1e-6)
    # Its epoch-0 file resumed under ddp on one process trains on like ddp's own epoch-0 file.
    resumed = {}
    for name, source in (("from_fsdp", "fsdp_from_ddp"), ("from_ddp", "ddp_sgd")):
        module = Net()
        one_rank(tmp_path / name, "ddp", max_epochs=3, logger=False, enable_checkpointing=False).fit(
            module, *loaders(), ckpt_path=checkpoint_folder(out, source) / "epoch=1.ckpt")
        resumed[name] = module.state_dict()
    assert_same_weights(resumed["from_fsdp"], resumed["from_ddp"], atol=1e-6)


@pytest.mark.timeout(200)
def test_a_sharded_checkpoint_resumes_on_the_same_ranks_bitwise(job):
    out, results = job
    assert_same_weights(results["fsdp_sharded_resumed"]["weights"], results["fsdp_sgd"]["weights"], atol=0)
    folder = checkpoint_folder(out, "fsdp_sgd")
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    assert sorted(p.name for p in (folder / "last.ckpt").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.pt"]


@pytest.mark.timeout(200)
def test_a_sharded_checkpoint_resumes_on_one_rank_and_as_a_converted_file_under_ddp(job, tmp_path, capsys):
    out, results = job
    folder = checkpoint_folder(out, "fsdp_sgd")
    # The last folder on one rank (DCP reshards): the same weights as the job's, so the same validation loss.
    [on_one] = one_rank(tmp_path / "one", {"name": "fsdp"}, logger=False).validate(
        fresh(), DataLoader(VAL, batch_size=BATCH), ckpt_path=folder / "last.ckpt")
    assert on_one["val_loss"] == pytest.approx(results["fsdp_sgd"]["metrics"]["val_loss"], rel=1e-6)
    # Converted to one file: the job's weights; ddp (and load_from_checkpoint) read it.
    assert cli(["checkpoint", "convert", str(folder / "last.ckpt"), str(tmp_path / "last_full.ckpt")]) == 0
    converted = torch.load(tmp_path / "last_full.ckpt", weights_only=True)
    assert_same_weights(converted["state_dict"], results["fsdp_sgd"]["weights"], atol=0)
    assert_same_weights(Net.load_from_checkpoint(tmp_path / "last_full.ckpt").state_dict(),
                        results["fsdp_sgd"]["weights"], atol=0)
    # Resumed mid-run on one rank, sharded and as a file under ddp: both train on from epoch 1, alike.
    resumed = {}
    for name, strategy, ckpt in (("fsdp", {"name": "fsdp", "checkpoint": "sharded"}, folder / "epoch=0.ckpt"),
                                 ("ddp", "ddp", tmp_path / "epoch0_full.ckpt")):
        if name == "ddp":
            assert cli(["checkpoint", "convert", str(folder / "epoch=0.ckpt"), str(ckpt)]) == 0
        module = Net()
        trainer = one_rank(tmp_path / name, strategy, max_epochs=3, logger=False, enable_checkpointing=False)
        trainer.fit(module, *loaders(), ckpt_path=ckpt)
        assert trainer.global_step == 5 + 2 * 10  # epoch 0: 5 steps on 2 ranks; then 10 an epoch on one
        resumed[name] = fsdp_cases.gathered(module)
    assert_same_weights(resumed["fsdp"], resumed["ddp"], atol=1e-6)


@pytest.mark.timeout(200)
def test_a_sharded_folder_missing_a_ranks_file_is_a_one_line_error(job, tmp_path, capsys):
    out, _ = job
    broken = tmp_path / "broken.ckpt"
    shutil.copytree(checkpoint_folder(out, "fsdp_sgd") / "last.ckpt", broken)
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"is missing __1_0.distcp \(a rank's shard"):
        one_rank(tmp_path, "fsdp", logger=False).validate(fresh(), DataLoader(VAL, batch_size=BATCH),
                                                          ckpt_path=broken)
    assert cli(["checkpoint", "convert", str(broken), str(tmp_path / "out.ckpt")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "is missing __1_0.distcp" in error and not (tmp_path / "out.ckpt").exists()
    with pytest.raises(CheckpointError, match="is a sharded folder: load it with strategy='fsdp'"):
        one_rank(tmp_path, "single", logger=False).validate(Net(), DataLoader(VAL, batch_size=BATCH),
                                                            ckpt_path=checkpoint_folder(out, "fsdp_sgd") / "last.ckpt")
    # DCP unpickles .metadata fully: a folder whose pickle would run code is refused before DCP reads it.
    evil = tmp_path / "evil.ckpt"
    shutil.copytree(checkpoint_folder(out, "fsdp_sgd") / "last.ckpt", evil)
    (evil / ".metadata").write_bytes(pickle.dumps(RunsCode(str(tmp_path / "ran"))))
    with pytest.raises(CheckpointError, match="its .metadata is corrupt or holds objects other than DCP's"):
        one_rank(tmp_path, "fsdp", logger=False).validate(fresh(), DataLoader(VAL, batch_size=BATCH), ckpt_path=evil)
    assert not (tmp_path / "ran").exists()


class RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


# --------------------------------------------------------------------------- one rank, in this process


def test_a_full_fsdp_checkpoint_loads_into_one_process_and_a_single_file_into_fsdp(tmp_path):
    module = fresh(Net, "adamw")
    trainer = one_rank(tmp_path / "fsdp", {"name": "fsdp", "shard_units": ["Block"]}, max_epochs=1)
    trainer.fit(module, *loaders())
    last = trainer.checkpoint_callback.last_model_path
    saved = torch.load(last, weights_only=True)
    assert_same_weights(saved["state_dict"], fsdp_cases.gathered(module), atol=0)
    # torch's own optimizer layout (indices), so that single and ddp load it.
    assert saved["optimizer_states"][0]["param_groups"][0]["params"] == list(range(8))
    single = fresh(Net, "adamw")
    one_rank(tmp_path / "single", "single", max_epochs=2, logger=False, enable_checkpointing=False).fit(
        single, *loaders(), ckpt_path=last)
    back = fresh(Net, "adamw")
    one_rank(tmp_path / "back", "fsdp", max_epochs=2, logger=False, enable_checkpointing=False).fit(
        back, *loaders(), ckpt_path=last)
    assert_same_weights(fsdp_cases.gathered(back), single.state_dict(), atol=1e-6)


class Wider(Net):
    def __init__(self) -> None:
        super().__init__()
        self.net[3] = nn.Linear(8, 2)


def test_a_full_checkpoint_of_another_model_is_a_one_line_error(tmp_path):
    trainer = one_rank(tmp_path, "single", max_epochs=1)
    trainer.fit(Net(), *loaders())
    with pytest.raises(CheckpointError, match=r"do not fit Wider: other shapes: net.3.weight \[1, 8\] in the ch"):
        one_rank(tmp_path, "fsdp", logger=False).validate(Wider(), DataLoader(VAL, batch_size=BATCH),
                                                          ckpt_path=trainer.checkpoint_callback.last_model_path)


def test_sharded_folders_resume_with_last_keep_the_top_k_and_match_an_uninterrupted_run(tmp_path):
    sharded = {"name": "fsdp", "checkpoint": "sharded", "min_params": 50}

    def run(root: Path, epochs: int, ckpt_path=None) -> tuple[Net, ModelCheckpoint]:
        best = ModelCheckpoint(monitor="val_loss", save_top_k=1, filename="{epoch}", save_last=True)
        module = fresh()
        one_rank(root, sharded, max_epochs=epochs, callbacks=[best]).fit(module, *loaders(), ckpt_path=ckpt_path)
        return module, best

    uninterrupted, _ = run(tmp_path / "whole", 3)
    run(tmp_path / "split", 1)
    resumed, best = run(tmp_path / "split", 3, ckpt_path="last")
    assert_same_weights(fsdp_cases.gathered(resumed), fsdp_cases.gathered(uninterrupted), atol=0)
    folders = sorted(p.name for p in Path(best.dirpath).glob("*.ckpt"))
    assert folders == sorted([Path(best.best_model_path).name, "last.ckpt"])  # top-1: the others were removed
    assert all((Path(best.dirpath) / name / "trainer_state.pt").is_file() for name in folders)


class CrashSavingAt(ModelCheckpoint):
    """Dies half-way through writing the sharded folder of step `step`: one shard on disk, no metadata."""

    def __init__(self, step: int) -> None:
        super().__init__(save_top_k=0, save_last=True, every_n_train_steps=5)
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            from torch.distributed import checkpoint as dcp

            def dying_save(state_dict, storage_writer):
                (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"half a shard")
                raise KeyboardInterrupt("killed while saving")

            dcp.save = dying_save
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)


def test_a_crash_while_a_sharded_folder_is_written_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    from torch.distributed import checkpoint as dcp

    monkeypatch.setattr(dcp, "save", dcp.save)  # restored after the test: the callback replaces it
    sharded = {"name": "fsdp", "checkpoint": "sharded"}
    trainer = one_rank(tmp_path, sharded, max_epochs=1, callbacks=[CrashSavingAt(10)], enable_checkpointing=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(fresh(), *loaders())
    folder = Path(trainer.checkpoint_callback.dirpath)
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "last.ckpt.tmp"]
    monkeypatch.undo()
    # last.ckpt is step 5's, whole: a resume from it lands on the uninterrupted run's weights.
    resumed, uninterrupted = fresh(), fresh()
    one_rank(tmp_path / "resumed", sharded, max_epochs=1, logger=False, enable_checkpointing=False).fit(
        resumed, *loaders(), ckpt_path=folder / "last.ckpt")
    one_rank(tmp_path / "whole", sharded, max_epochs=1, logger=False, enable_checkpointing=False).fit(
        uninterrupted, *loaders())
    assert_same_weights(fsdp_cases.gathered(resumed), fsdp_cases.gathered(uninterrupted), atol=0)


def test_options_are_checked_before_any_process_starts():
    strategy = build_strategy({"name": "fsdp", "shard_units": ["Block"], "checkpoint": "sharded"})
    assert isinstance(strategy, FSDPStrategy) and strategy.shard_units == ["Block"]
    errors = {
        "has no option 'find_unused_parameters'": lambda: build_strategy({"name": "fsdp",
                                                                          "find_unused_parameters": True}),
        "checkpoint='zip'.* is not known": lambda: FSDPStrategy(checkpoint="zip"),
        "shard_units or min_params, not both": lambda: FSDPStrategy(shard_units=["Block"], min_params=10),
        r"min_params=0\) must be a positive": lambda: FSDPStrategy(min_params=0),
        "shard_units='Block'\\) takes a non-empty list": lambda: FSDPStrategy(shard_units="Block"),
        "cpu_offload=True\\) needs accelerator='cuda'": lambda: Trainer(strategy=FSDPStrategy(cpu_offload=True),
                                                                        accelerator="cpu"),
        "sync_batchnorm=True\\) needs accelerator='cuda'": lambda: Trainer(
            strategy=FSDPStrategy(sync_batchnorm=True), accelerator="cpu"),
        "backend='mpi'": lambda: FSDPStrategy(backend="mpi"),
    }
    for message, build in errors.items():
        with pytest.raises(MisconfigurationError, match=message):
            build()


@pytest.mark.parametrize(("options", "message"), [
    ({"shard_units": ["Blok"]}, "shard_units=\\['Blok'\\]\\): Net has no submodule of class 'Blok' \\(did you mean "
                                "'Block'\\?\\); its classes: Block, Linear, Net, Sequential"),
    ({"activation_checkpointing": ["Transformer"]}, "activation_checkpointing=\\['Transformer'\\]\\): Net has no"),
    ({"min_params": 1000}, "min_params=1000\\) makes no shard unit of Net: its largest child holds 201 param"),
])
def test_a_module_the_options_do_not_fit_is_refused_before_any_process_starts(options, message):
    trainer = Trainer(strategy={"name": "fsdp", **options}, devices=2, logger=False, **QUIET)
    with pytest.raises(MisconfigurationError, match=message):
        trainer.fit(Net(), DataLoader(TRAIN, batch_size=BATCH))


def test_shard_units_go_innermost_first_and_a_threshold_counts_what_no_smaller_unit_holds():
    module = Net()
    assert shard_units(module, ["Block"], None) == [module.net[2], module.net[1]]
    # Each Block's linear holds 72 parameters: it becomes the unit, and its Block (no parameter left) does not; the
    # Sequential still holds 57 that no unit does.
    assert shard_units(module, None, 50) == [module.net[2].linear, module.net[1].linear, module.net]
    assert shard_units(module, None, 200) == [module.net]


class SelfSharding(Net):
    """Shards its own blocks in configure_model, as Lightning's ModelParallelStrategy lets a module do."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for block in (self.net[1], self.net[2]):
            fully_shard(block, mesh=self.device_mesh["dp_shard"])


def test_a_module_may_shard_itself_in_configure_model(tmp_path):
    from torch.distributed.fsdp import FSDPModule

    module, reference = fresh(SelfSharding), fresh()
    one_rank(tmp_path, "fsdp", max_epochs=1, logger=False, enable_checkpointing=False).fit(module, *loaders())
    one_rank(tmp_path, "single", max_epochs=1, logger=False, enable_checkpointing=False).fit(reference, *loaders())
    assert isinstance(module.net[1], FSDPModule) and not isinstance(module.net[0], FSDPModule)
    assert_same_weights(fsdp_cases.gathered(module), reference.state_dict(), atol=1e-6)


def test_bf16_mixed_precision_trains_on_cpu_and_fp16_is_refused(tmp_path):
    module = fresh()
    one_rank(tmp_path, "fsdp", precision="bf16-mixed", max_epochs=1, logger=False, enable_checkpointing=False).fit(
        module, *loaders())
    reference = fresh()
    one_rank(tmp_path, "single", max_epochs=1, logger=False, enable_checkpointing=False).fit(reference, *loaders())
    weights = fsdp_cases.gathered(module)
    assert all(value.dtype == torch.float32 for value in weights.values())  # the sharded weights stay fp32
    assert_same_weights(weights, reference.state_dict(), atol=2e-2)  # computed in bf16: close, not equal
    assert not all(torch.equal(weights[k], reference.state_dict()[k]) for k in weights)
    with pytest.raises(MisconfigurationError, match="16-mixed' is not supported on CPU.*use precision='bf16-mixed'"):
        Trainer(strategy="fsdp", precision="16-mixed", accelerator="cpu")


def test_a_module_sharded_by_a_finished_run_is_refused_with_the_way_out(tmp_path):
    module = Net()
    one_rank(tmp_path, "fsdp", max_epochs=1, logger=False, enable_checkpointing=False).fit(module, *loaders())
    with pytest.raises(MisconfigurationError, match="sharded by an earlier fsdp run whose process group has ended"):
        one_rank(tmp_path, "fsdp", logger=False).validate(module, DataLoader(VAL, batch_size=BATCH))


# --------------------------------------------------------------------------- GPU (the lead runs these on a GPU)


class NormedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), Block(8), nn.Linear(8, 1))


@ON_CUDA
@pytest.mark.parametrize("options", [
    {"precision": "bf16-mixed"},
    {"strategy": {"name": "fsdp", "cpu_offload": True, "shard_units": ["Block"]}},
    {"strategy": {"name": "fsdp", "sync_batchnorm": True}, "module": NormedNet},
])
def test_on_cuda_nccl_bf16_cpu_offload_and_sync_batchnorm_train_close_to_fp32(tmp_path, options):
    options = dict(options)
    cls = options.pop("module", Net)
    strategy = options.pop("strategy", "fsdp")
    module, reference = fresh(cls), fresh(cls)
    with pytest.raises(MisconfigurationError, match="fsdp' takes precision='bf16-mixed' or '32'"):
        Trainer(strategy="fsdp", precision="16-mixed", accelerator="cuda")
    Trainer(strategy=strategy, devices=1, accelerator="cuda", max_epochs=1, seed=SEED, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **options).fit(
        module, *loaders())
    assert module.trainer.strategy.backend == "nccl"
    Trainer(strategy="single", accelerator="cpu", max_epochs=1, seed=SEED, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(reference, *loaders())
    weights = fsdp_cases.gathered(module)
    assert_same_weights(weights, reference.state_dict(), atol=2e-2 if "precision" in options else 1e-4)
