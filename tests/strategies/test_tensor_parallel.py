"""Tensor parallel and N-D layouts on one DeviceMesh: layouts refused before any process starts, and a 4-process
gloo job (tp_cases.py, started once for the module) against one process: pipeline=2 x tp=2, HSDP replicate=2 x
tp=2 and fsdp dp=2 x tp=2 training, and the last one's checkpoints (a full file and a sharded
folder) resumed at tp=1 x dp=2, tp=2 x dp=1 and on one process; and an 8-process 3-D job, pipeline=2 x fsdp=2 x
tp=2, for a few steps (8 processes on CI's two cores cost more per step than the slow-test budget allows for 20).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tp_cases
from processes import run_ranks
from tp_cases import EPOCHS, QUIET, RESUMED_EPOCHS, SEED, THREE_D_STEPS, TPNet, fresh, loader

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.cli.main import main as cli
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.strategies import build_strategy
from torchyard.trainer.strategies.mesh import MeshLayout, layout_for

TOLERANCE = 1e-5  # DTensor reduces in another order than one process does: equal to rounding, not bitwise


def assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=TOLERANCE, msg=key)


# --------------------------------------------------------------------------- layouts refused in one line


def test_layouts_split_the_world_tensor_parallel_innermost():
    assert layout_for(8, "X", tensor_parallel=2) == MeshLayout(dp_shard=4, tp=2)
    assert layout_for(8, "X", tensor_parallel=2, replicate=2) == MeshLayout(dp_replicate=2, dp_shard=2, tp=2)
    assert layout_for(8, "X", tensor_parallel=2, pipeline=2, shard=False) == MeshLayout(pp=2, dp_replicate=2, tp=2)
    assert layout_for(8, "X", tensor_parallel=2, replicate=2).describe() == "dp_replicate=2 x dp_shard=2 x tp=2"


def test_a_layout_that_does_not_divide_the_world_is_refused_when_the_trainer_is_built():
    with pytest.raises(MisconfigurationError) as caught:
        Trainer(strategy={"name": "fsdp", "tensor_parallel": 4}, devices=6, accelerator="cpu")
    assert str(caught.value) == (
        "FSDPStrategy: tensor_parallel=4 = 4 does not divide devices x num_nodes = 6; use a world size that is a "
        "multiple of 4, or smaller sizes that divide 6.")
    with pytest.raises(MisconfigurationError, match=r"^FSDPStrategy: replicate=2 x tensor_parallel=2 = 4 does not"):
        Trainer(strategy={"name": "fsdp", "tensor_parallel": 2, "replicate": 2}, devices=2, num_nodes=3,
                accelerator="cpu")
    with pytest.raises(MisconfigurationError) as caught:
        build_strategy({"name": "fsdp", "tensor_parallel": 0})
    assert str(caught.value) == "FSDPStrategy(tensor_parallel=0) must be a positive whole number (1 turns it off)."


@pytest.mark.parametrize("name", ["dp", "ddp", "ps"])
def test_tensor_parallel_with_dp_ddp_or_ps_is_refused(name):
    refused = rf"^strategy {name!r} has no option 'tensor_parallel'; its options"
    with pytest.raises(MisconfigurationError, match=refused):
        build_strategy({"name": name, "tensor_parallel": 2})


def test_a_module_without_a_plan_under_tensor_parallel_is_refused_naming_the_hook():
    class NoPlan(TPNet):
        configure_model = TrainModule.configure_model  # no plan

    trainer = Trainer(strategy={"name": "fsdp", "tensor_parallel": 2}, devices=2, **QUIET)
    with pytest.raises(MisconfigurationError) as caught:
        trainer.fit(NoPlan(), loader(1))
    assert str(caught.value) == (
        "FSDPStrategy(tensor_parallel=2) needs NoPlan.configure_model(self) to apply a tensor-parallel plan, e.g. "
        "parallelize_module(self.block, self.device_mesh['tp'], {'up': ColwiseParallel(), 'down': "
        "RowwiseParallel()}); it has none.")


def test_a_plan_that_names_a_missing_module_is_refused_in_one_line():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from torchyard.trainer.strategies.mesh import parallelize

    block = tp_cases.MLPBlock(8)
    with pytest.raises(MisconfigurationError) as caught:
        parallelize(block, None, {"upp": ColwiseParallel()})
    assert str(caught.value) == ("tensor-parallel plan key 'upp' names no submodule of MLPBlock (did you mean 'up'?); "
                                 "its submodules: norm, up, down.")


@pytest.mark.timeout(60)  # a process group and a mesh of one rank: several seconds on two loaded cores
def test_on_one_process_the_module_sees_a_mesh_of_one_rank_and_trains_as_single(tmp_path):
    module, single = fresh(), fresh()
    Trainer(strategy="fsdp", devices=1, max_epochs=1, seed=SEED, **QUIET).fit(module, loader(1))
    Trainer(strategy="single", devices=1, max_epochs=1, seed=SEED, **QUIET).fit(single, loader(1))
    assert module.device_mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert tuple(module.device_mesh.shape) == (1, 1, 1, 1)
    assert_close_weights(tp_cases.gathered(module), single.state_dict())


def test_the_charlm_tp_recipe_names_the_model_with_a_plan_and_keeps_charlms_keys():
    from torchyard.recipes.charlm import CharLM, TensorParallelCharLM
    from torchyard.trainer.cli.recipe import load_recipe

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    recipe = load_recipe([str(recipes / "charlm.yaml"), str(recipes / "charlm_tp.yaml")])
    assert recipe.trainer.strategy == {"name": "fsdp", "tensor_parallel": 2, "shard_units": ["Block"],
                                       "checkpoint": "full"}
    assert recipe.trainer.devices == 4 and recipe.model.cls is TensorParallelCharLM
    model = recipe.model.instantiate()
    assert model.state_dict().keys() == CharLM(**recipe.model.init_args).state_dict().keys()
    model.configure_model()  # no trainer, no mesh: nothing to split


# --------------------------------------------------------------------------- the 4-process job


def one_process(max_epochs: int, ckpt=None, max_steps: int = -1) -> tuple[dict[str, torch.Tensor], Trainer]:
    """The same run on one process, its batch the job's global batch."""
    module = fresh()
    trainer = Trainer(strategy="single", max_epochs=max_epochs, max_steps=max_steps, seed=SEED,
                      gradient_clip_val=tp_cases.CLIP, **QUIET)
    trainer.fit(module, loader(1), ckpt_path=ckpt)
    return module.state_dict(), trainer


@pytest.fixture(scope="module")
def reference() -> dict[int, tuple[dict[str, torch.Tensor], dict[str, float], int]]:
    """One process's weights, metrics and steps after EPOCHS and after RESUMED_EPOCHS (computed once)."""
    runs = {}
    for epochs in (EPOCHS, RESUMED_EPOCHS):
        weights, trainer = one_process(epochs)
        runs[epochs] = weights, {k: float(v) for k, v in trainer.callback_metrics.items()}, trainer.global_step
    return runs


def run_job(out: Path, world_size: int, arguments: list[str]) -> Path:
    """tp_cases.py's main on world_size local ranks."""
    run_ranks(tp_cases.main, world_size, [str(out), *arguments], out, timeout=170)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("tp_job"), 4, [])


@pytest.mark.timeout(200)
def test_dp2_x_tp2_trains_20_adamw_steps_as_one_process_does(job, reference):
    results = torch.load(job / "dp2_tp2.pt", weights_only=True)
    weights, metrics, steps = reference[EPOCHS]
    assert results["global_step"] == steps == 20
    assert_close_weights(results["weights"], weights)
    # The metrics are reduced over the data-parallel replicas: a sum counts each sample once, not once per TP rank.
    assert results["metrics"]["samples"] == metrics["samples"] == len(tp_cases.dataset())
    assert results["metrics"]["train_loss"] == pytest.approx(metrics["train_loss"], abs=1e-6)
    # The sampler shards by data-parallel rank: the two ranks of a TP group read the same batch, the groups differ.
    first = results["first_batches"]
    assert results["data_parallel_size"] == 2 and first[0] == first[1] and first[2] == first[3] != first[0]
    whole = next(iter(loader(1)))[0]
    assert first[0] + first[2] == pytest.approx(float(whole.sum()), abs=1e-4)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("case", "replicas"), [("pp2_tp2", 1), ("hsdp2_tp2", 2)])
def test_pipeline_x_tp_and_hsdp_x_tp_train_as_one_process_does(job, reference, case, replicas):
    results = torch.load(job / f"{case}.pt", weights_only=True)
    weights = reference[EPOCHS][0]
    assert results["global_step"] == 20 and results["data_parallel_size"] == replicas
    assert_close_weights(results["weights"], weights)  # after fit every rank holds the whole model (gathered)


@pytest.mark.timeout(200)
def test_full_and_sharded_checkpoints_of_dp2_x_tp2_resume_at_other_layouts_and_on_one_process(job, reference,
                                                                                               tmp_path):
    full = torch.load(job / "full.ckpt", weights_only=True)
    saved = torch.load(job / "dp2_tp2.pt", weights_only=True)["weights"]
    # The full file holds single-device keys, whole tensors (the DTensors gathered), and torch's optimizer layout.
    assert_close_weights(full["state_dict"], saved)
    assert len(full["optimizer_states"][0]["state"]) == len(list(TPNet().parameters()))
    assert full["optimizer_states"][0]["state"][1]["exp_avg"].shape == (8,)
    uninterrupted = reference[RESUMED_EPOCHS][0]  # 30 steps
    for layout in ("tp1", "tp2"):  # the sharded folder at tp=1 x dp=2; the full file at tp=2 x dp=1
        resumed = torch.load(job / f"resumed_{layout}.pt", weights_only=True)
        assert resumed["global_step"] == 30
        assert_close_weights(resumed["weights"], uninterrupted)
    # On one process: the full file, and the sharded folder converted by `trainer checkpoint convert`.
    converted = tmp_path / "converted.ckpt"
    assert cli(["checkpoint", "convert", str(job / "sharded.ckpt"), str(converted)]) == 0
    assert_close_weights(torch.load(converted, weights_only=True)["state_dict"], saved)
    for source in (job / "full.ckpt", converted):
        weights, trainer = one_process(RESUMED_EPOCHS, ckpt=source)
        assert trainer.global_step == 30
        assert_close_weights(weights, uninterrupted)


@pytest.mark.timeout(200)
def test_an_8_process_pipeline2_x_fsdp2_x_tp2_job_trains_as_one_process_does(tmp_path):
    run_job(tmp_path, 8, ["3d"])
    results = torch.load(tmp_path / "pp2_fsdp2_tp2.pt", weights_only=True)
    assert results["global_step"] == THREE_D_STEPS and results["data_parallel_size"] == 2
    weights, _ = one_process(EPOCHS, max_steps=THREE_D_STEPS)
    assert_close_weights(results["weights"], weights)


@pytest.mark.timeout(200)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_dp2_x_tp2_full_file_resumes_on_one_gpu_under_fsdp(job, reference):
    """The single-process and checkpoint case on a GPU (several nccl ranks would need several GPUs)."""
    module = fresh()
    options = {**QUIET, "accelerator": "cuda"}
    trainer = Trainer(strategy="fsdp", devices=1, max_epochs=RESUMED_EPOCHS, seed=SEED,
                      gradient_clip_val=tp_cases.CLIP, **options)
    trainer.fit(module, loader(1), ckpt_path=job / "full.ckpt")
    uninterrupted = reference[RESUMED_EPOCHS][0]
    for key, value in tp_cases.gathered(module).items():  # another device's kernels: rounding, not bitwise
        torch.testing.assert_close(value.cpu(), uninterrupted[key], rtol=0, atol=1e-4, msg=key)
