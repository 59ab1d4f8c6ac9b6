"""`compile`: torch.compile applied by the strategy, against eager references.

Each compile costs tens of seconds on two busy cores, so the tests are few and share their runs: one single-process
fit on inductor (weights, validation, predict, checkpoint keys, the report); the multi-process ones on cheaper
backends (fsdp on aot_eager: dynamo and AOTAutograd around FSDP's hooks; the user-compiled module under ddp on eager:
what it tests is the unwrapping, the keys and the workers' own compile), since what varies by strategy is where the
compiled code sits, not inductor's kernels; graph breaks on the eager backend.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchyard.trainer import Trainer, TrainModule
from torchyard.trainer.checkpointing.files import load_checkpoint_file
from torchyard.trainer.compile.options import CompileOptions, compile_options
from torchyard.trainer.errors import MisconfigurationError

STEPS, BATCH, LR = 30, 4, 0.05
QUIET = dict(accelerator="cpu", enable_progress_bar=False, logger=False, seed=0)


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(samples, 5, generator=generator)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


TRAIN = dataset(2 * STEPS * BATCH)  # one epoch of STEPS steps on two ranks (STEPS * BATCH samples each)


class Net(TrainModule):
    """A 2-layer MLP; `peek` prints a value in forward (a deliberate graph break)."""

    def __init__(self, peek: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        self.peek = peek

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.peek:
            print("peek", out.sum().item())  # the graph break the report must name
        return out

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


PEEK_LINE = Net.forward.__code__.co_firstlineno + 3  # the print's line


def fresh(peek: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(peek)


def eager_reference(ranks: int) -> dict[str, torch.Tensor]:
    """STEPS hand-written SGD steps; each on the batches of every rank at once (a mean loss: DDP's gradient). The
    Trainer's loaders are unshuffled here, so rank r's i-th sample is sample i * ranks + r."""
    model = fresh()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = TRAIN.tensors
    for step in range(STEPS):
        index = torch.arange(step * BATCH * ranks, (step + 1) * BATCH * ranks)
        optimizer.zero_grad()
        F.mse_loss(model(x[index]), y[index]).backward()
        optimizer.step()
    return model.state_dict()


def assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)  # plain keys: no `_orig_mod.`
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=1e-5, msg=key)


def loader(samples: int = len(TRAIN)) -> DataLoader:
    return DataLoader(TensorDataset(*(t[:samples] for t in TRAIN.tensors)), batch_size=BATCH)


# --------------------------------------------------------------------------- options, checked before anything runs


@pytest.mark.parametrize(("value", "message"), [
    ({"mode": "fastest"}, "compile.mode='fastest' is not known; use one of default, reduce-overhead, max-autotune, "
                          "max-autotune-no-cudagraphs or leave it unset."),
    ({"regoins": ["Block"]}, "unknown compile option 'regoins' (did you mean 'regions'?); compile takes backend, "
                             "mode, fullgraph, dynamic, regions, cache_dir."),
    ({"backend": "aot_eager", "mode": "max-autotune"}, "compile.mode='max-autotune' is inductor's, but "
                                                       "compile.backend='aot_eager'; drop mode or use backend "
                                                       "'inductor'."),
    ({"regions": "Block"}, "compile.regions='Block' must be a list of class names, e.g. [Block]."),
])
def test_a_compile_option_that_cannot_run_is_refused_in_one_line(value, message):
    with pytest.raises(MisconfigurationError) as error:
        Trainer(compile=value, **QUIET)
    assert str(error.value) == message


def test_compile_options_take_true_a_mapping_and_off():
    assert compile_options(True) == CompileOptions()
    assert compile_options(False) is None
    assert compile_options({"regions": ["Block"], "fullgraph": True}) == CompileOptions(regions=("Block",),
                                                                                        fullgraph=True)
    assert Trainer(compile={"dynamic": False}, **QUIET).config.compile == CompileOptions(dynamic=False)


@pytest.mark.parametrize(("strategy", "why"), [("dp", "DataParallel replicates the module at every step"),
                                               ("ps", "its workers pull parameters from the server between steps")])
def test_dp_and_ps_refuse_compile_before_any_process_starts(strategy, why):
    with warnings.catch_warnings(), pytest.raises(MisconfigurationError) as error:
        warnings.simplefilter("ignore")  # dp on a CPU warns that it runs on one device
        Trainer(strategy=strategy, devices=2 if strategy == "ps" else 1, compile=True, **QUIET)
    assert str(error.value).startswith(f"compile is not supported with strategy='{strategy}' ({why}); use "
                                       "strategy='ddp' with compile")


def test_unknown_regions_name_the_classes_the_module_has(tmp_path):
    trainer = Trainer(compile={"regions": ["Block"], "backend": "eager"}, max_steps=1, default_root_dir=str(tmp_path),
                      **QUIET)
    with pytest.raises(MisconfigurationError, match=re.escape(
            "compile.regions=['Block']: the module has no submodule of those classes; its classes: Linear, Net, "
            "Sequential, Tanh.")):
        trainer.fit(fresh(), loader(8))


# --------------------------------------------------------------------------- one process, inductor


@pytest.mark.timeout(400)
@pytest.mark.one_core
def test_single_compiled_on_inductor_trains_validates_and_predicts_as_eager(tmp_path, capsys):
    module = fresh()
    trainer = Trainer(compile=True, max_steps=STEPS, limit_val_batches=2, default_root_dir=str(tmp_path),
                      **QUIET)
    trainer.fit(module, loader(STEPS * BATCH), loader(8))
    assert_close_weights(module.state_dict(), eager_reference(ranks=1))
    record = trainer.strategy.compile_record
    assert record.compiled == ["the module (Net)"] and record.graph_break_count == 0
    hits, misses = record.cache_counts()
    assert hits + misses > 0  # inductor compiled (or took from its cache) the training and validation graphs
    out = capsys.readouterr().out
    assert out.count("compile: the module (Net) with inductor; first step after ") == 1  # once, after the first step
    assert re.search(r"compile: time to first step\s*│\s*\d+\.\d s, (cold|warm|partly warm) ", out)
    assert (tmp_path / "default" / "compile_cache").is_dir()  # the run's cache: a restart or the next run starts warm
    # The module stays compiled: predict runs the compiled forward, and matches the eager one.
    compiled_forward = vars(module)["forward"]
    predictions = torch.cat(trainer.predict(module, loader(8)))
    assert vars(module)["forward"] is compiled_forward
    with torch.no_grad():
        assert torch.allclose(predictions, Net.forward(module, TRAIN.tensors[0][:8]), atol=1e-6)
    # Its checkpoint holds the plain module's keys and loads into an uncompiled module.
    plain = Net()
    plain.load_state_dict(load_checkpoint_file(trainer.checkpoint_callback.last_model_path)["state_dict"])
    assert_close_weights(plain.state_dict(), module.state_dict())


# --------------------------------------------------------------------------- graph breaks, on the eager backend


@pytest.mark.timeout(200)
def test_a_graph_break_is_reported_with_its_line_and_fullgraph_fails_on_it_in_one_line(tmp_path, capsys):
    options = dict(max_steps=2, num_sanity_val_steps=0, enable_checkpointing=False, default_root_dir=str(tmp_path),
                   **QUIET)
    trainer = Trainer(compile={"backend": "eager"}, **options)
    trainer.fit(fresh(peek=True), loader(8))
    where = f"{__file__}:{PEEK_LINE}"
    assert trainer.strategy.compile_record.graph_breaks == {
        where: "Dynamo does not support tracing `Tensor.item()` with config.capture_scalar_outputs=False."}
    out = capsys.readouterr().out
    assert "compile: graphs break at 1 place(s)" in out
    assert f"  {where}: Dynamo does not support tracing `Tensor.item()`" in out

    trainer = Trainer(compile={"backend": "eager", "fullgraph": True}, **options)
    with pytest.raises(MisconfigurationError) as error:
        trainer.fit(fresh(peek=True), loader(8))
    message = str(error.value)  # one line: where, dynamo's explanation (of the .item() or the print), the fix
    assert message.startswith(f"compile fullgraph=True: the graph breaks at {where} in forward: Dynamo does not ")
    assert message.endswith("; make that line traceable, or set compile fullgraph: false to run the model in "
                            "compiled pieces.") and "\n" not in message


@pytest.mark.timeout(200)
def test_a_submodule_the_user_compiled_trains_compiled_and_saves_plain_keys(tmp_path):
    module = fresh()
    module.body = torch.compile(module.body, backend="eager")  # state_dict keys: body._orig_mod.0.weight, ...
    trainer = Trainer(max_steps=STEPS, num_sanity_val_steps=0, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(module, loader(STEPS * BATCH))
    assert trainer.strategy.compile_record.compiled == ["body (Sequential)"]
    assert isinstance(module.body, nn.Sequential)  # unwrapped, its forward compiled on the instance
    assert_close_weights(module.state_dict(), eager_reference(ranks=1))
    saved = load_checkpoint_file(trainer.checkpoint_callback.last_model_path)["state_dict"]
    assert list(saved) == ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]


# --------------------------------------------------------------------------- two processes, aot_eager


@pytest.mark.timeout(300)
def test_a_module_the_user_compiled_trains_under_ddp_and_its_checkpoint_loads_uncompiled(tmp_path):
    compiled = torch.compile(fresh(), backend="eager")  # the path under test is unwrapping, keys and the workers
    trainer = Trainer(strategy="ddp", devices=2, max_steps=STEPS, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(compiled, loader())
    assert_close_weights(compiled._orig_mod.state_dict(), eager_reference(ranks=2))
    plain = Net()
    plain.load_state_dict(load_checkpoint_file(trainer.checkpoint_callback.last_model_path)["state_dict"])
    assert_close_weights(plain.state_dict(), eager_reference(ranks=2))


@pytest.mark.timeout(300)
def test_fsdp_compiled_per_shard_unit_on_two_processes_lands_on_the_eager_weights(tmp_path):
    module = fresh()  # each Linear its own shard unit and its own compiled region (fsdp's hooks eager between them)
    trainer = Trainer(strategy={"name": "fsdp", "shard_units": ["Linear"]}, devices=2, max_steps=STEPS,
                      compile={"backend": "aot_eager", "regions": ["Linear"]},
                      enable_checkpointing=False, default_root_dir=str(tmp_path), **QUIET)
    trainer.fit(module, loader())
    assert_close_weights(module.state_dict(), eager_reference(ranks=2))
