"""What a checkpoint holds of a Trainer's run, part by part (weights, optimizers, schedulers, progress, callbacks,
loggers, metrics, RNG), and how each part is taken back. The file format and its IO are
trainer/checkpointing/files.py's."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchyard.trainer.checkpointing.files import (
    CHECKPOINT_VERSION,
    class_path,
    save_checkpoint_file,
    unloadable,
    weights_mismatch,
)
from torchyard.trainer.data.ledger import LEDGER_FILE
from torchyard.trainer.errors import CheckpointError, MisconfigurationError
from torchyard.trainer.logs.runs import atomic_write_text, run_folder
from torchyard.trainer.loop.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from torchyard.trainer.trainer import Trainer


# --------------------------------------------------------------------------- saving


def build_checkpoint(trainer: Trainer, weights_only: bool = False,
                     model_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint dict of the format in trainer/checkpointing/files.py. A collective (gathers RNG states): call on
    every rank.

    `weights_only`: version, epoch, global_step, state_dict and the hparams, what load_from_checkpoint and the
    evaluation stages need; a fit cannot resume from it (as in Lightning, callbacks add nothing to it).
    `model_state`: the weights to save instead of the strategy's (save_adopted_checkpoint's, where no strategy ran).
    """
    assert trainer.module is not None
    checkpoint: dict[str, Any] = {
        "version": CHECKPOINT_VERSION,
        # Lightning's top-level counters, for ported on_load_checkpoint code and tools (loops holds the rest).
        "epoch": trainer.current_epoch, "global_step": trainer.global_step,
        "state_dict": model_state if model_state is not None else trainer.strategy.checkpoint_model_state(),
        "module_class": class_path(type(trainer.module)),  # named when another model is given the checkpoint
        **saved_hparams(trainer),
    }
    if not weights_only:
        checkpoint.update(training_state(trainer))
    trainer.module.on_save_checkpoint(checkpoint)
    if not weights_only:
        for callback in trainer.callbacks:
            callback.on_save_checkpoint(trainer, trainer.module, checkpoint)
    refused = unloadable(checkpoint)
    if refused is not None:
        where, value = refused
        raise MisconfigurationError(
            f"the checkpoint's {where} is a {type(value).__module__}.{type(value).__qualname__}, which checkpoints "
            "cannot hold: they are read with torch.load(weights_only=True), which refuses it. Store plain Python "
            "values, "
            "lists, dicts or tensors there instead (e.g. float(x), x.tolist(), torch.as_tensor(x))."
        )
    return checkpoint


def save_adopted_checkpoint(trainer: Trainer, path: str | Path, weights_only: bool) -> Path:
    """trainer.save_checkpoint in a script whose fit started the job's processes itself and took back their trained
    weights (as a Lightning script calls it after fit): the weights, counters and hparams, what load_from_checkpoint,
    validate and test read. The optimizers' state stayed in the job's processes, so a resume starts from the run's
    own last checkpoint, as a warning says where a full checkpoint was asked for."""
    assert trainer.module is not None
    if not weights_only:
        last = getattr(trainer.checkpoint_callback, "last_model_path", "") or ""
        warnings.warn(
            f"trainer.save_checkpoint after a fit whose {trainer.world_size} processes this script started saves "
            "the trained weights and hparams (load_from_checkpoint, validate and test read them), not the "
            "optimizers' state, which ended with those processes; to resume training, pass the run's own checkpoint "
            f"as ckpt_path{f' ({last})' if last else ''}. weights_only=True saves the same without this note.",
            stacklevel=3)
    state = {name: tensor.detach().cpu() for name, tensor in trainer.module.state_dict().items()}
    return save_checkpoint_file(build_checkpoint(trainer, weights_only=True, model_state=state), path)


def training_state(trainer: Trainer) -> dict[str, Any]:
    """What a resume needs beyond the weights. A collective, like build_checkpoint."""
    strategy = trainer.strategy
    return {
        "optimizer_states": [strategy.optimizer_state_dict(opt) for opt in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": strategy.precision.state_dict(),
        "loops": {
            "progress": trainer.progress.state_dict(), "seed": trainer.config.seed or 0,
            "lr_scale": trainer.lr_scaler.factor,  # the optimizer states' rates carry it
            "data_parallel_size": strategy.data_parallel_size,  # epoch_batches counts each rank's batches
            # The run folder a resume continues in (when it resumes in the same place).
            "version": trainer.version, "folder": run_folder(trainer.config.default_root_dir, trainer.config.name),
            # Per rank, like rng: each rank's running epoch means of self.log values.
            "metrics": strategy.all_gather_object(trainer.metrics.state_dict() if trainer.metrics is not None else {}),
            "ledger": record_ledger(trainer),  # which samples each rank trained, as far as this checkpoint
        },
        "callbacks": {callback.state_key: callback.state_dict() for callback in trainer.callbacks},
        # The step tells a resumed logger which of the rows logged after the checkpoint to keep.
        "loggers": [{**logger.state_dict(), "step": trainer.progress.batches_stepped} for logger in trainer.loggers],
        # With torch's state as the running epoch began (its shuffle drew from it), for a resume mid-way.
        "rng": strategy.all_gather_object(_rng_with_epoch_start(trainer)),
        "datamodule": trainer.datamodule.state_dict() if trainer.datamodule is not None else {},
        "strategy": strategy.state_dict(trainer.optimizers),  # e.g. local SGD's averager steps and replicas
    }


def record_ledger(trainer: Trainer) -> dict[str, Any]:
    """Every rank's sample ledger up to now (data/ledger.py), which rank 0 also writes to the run folder's
    LEDGER_FILE, atomically. A collective: call on every rank (at each checkpoint and at the fit's end)."""
    progress = trainer.progress
    state = trainer.loop_state.ledger.gather(progress.epoch_batches, progress.global_step,
                                             trainer.strategy.all_gather_object)
    if not trainer.is_global_zero or not state["epochs"]:
        return state
    # Only beside what the run writes anyway: the folder of a run without loggers or checkpoints there
    # (barebones, fast_dev_run, checkpoints in a dirpath of their own) stays empty and is given back.
    folder = Path(trainer.log_dir)
    if folder.is_dir() and any(folder.iterdir()):
        atomic_write_text(folder / LEDGER_FILE, json.dumps(state, separators=(",", ":")))
    return state


def _rng_with_epoch_start(trainer: Trainer) -> dict[str, Any]:
    state = rng_state()
    epoch_start = trainer.loop_state.epoch_start_rng
    if epoch_start is not None:
        state["torch_epoch_start"] = epoch_start
    return state


def saved_hparams(trainer: Trainer) -> dict[str, Any]:
    """The checkpoint's `hparams` and `hparams_repr` entries; warns once per key stored as its repr."""
    module = trainer.module
    assert module is not None
    hparams: dict[str, Any] = {}
    repr_keys: list[str] = []
    warned: set[str] = module.__dict__.setdefault("_hparams_repr_warned", set())
    for key, value in module.hparams.items():
        key = str(key)
        replaced: list[Any] = []
        hparams[key] = _plain(value, replaced)
        if not replaced:
            continue
        repr_keys.append(key)
        if key not in warned and trainer.is_global_zero:
            warned.add(key)
            warnings.warn(
                f"hparams[{key!r}] holds {', '.join(type(v).__name__ for v in replaced)}, which a weights-only "
                f"checkpoint cannot hold, so checkpoints store its repr {hparams[key]!r}; pass it again when "
                f"loading: {type(module).__name__}.load_from_checkpoint(path, {key}=...), or leave it out of "
                f"the hparams with save_hyperparameters(ignore=[{key!r}]).",
                stacklevel=2,
            )
    # `hyper_parameters` is Lightning's name for the same dict (pickled once), for ported on_load_checkpoint code.
    # hparams_name: the __init__ argument that save_hyperparameters(namespace) was given, which load_from_checkpoint
    # passes them to again.
    return {"hparams": hparams, "hyper_parameters": hparams, "hparams_repr": repr_keys,
            "hparams_name": module.__dict__.get("_hparams_name")}


def _plain(value: Any, replaced: list[Any]) -> Any:
    """`value` reduced to what weights_only loading accepts; what is not becomes its repr, listed in `replaced`."""
    if isinstance(value, dict):
        return {str(k): _plain(v, replaced) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, replaced) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    replaced.append(value)
    return repr(value)


# --------------------------------------------------------------------------- restoring


def restore_checkpoint(trainer: Trainer, checkpoint: dict[str, Any], full: bool) -> None:
    """Load the weights; with `full` (fit), also optimizers, schedulers, counters, callbacks, RNG: a resume."""
    assert trainer.module is not None
    if full:
        check_resumable(checkpoint)
    trainer.module.on_load_checkpoint(checkpoint)
    for callback in trainer.callbacks:
        callback.on_load_checkpoint(trainer, trainer.module, checkpoint)
    restore_weights(trainer, checkpoint)
    if not full:
        return
    restore_optimizers(trainer, checkpoint)
    trainer.strategy.precision.load_state_dict(checkpoint.get("precision", {}))
    restore_progress(trainer, checkpoint)
    restore_callbacks(trainer, checkpoint)
    if trainer.datamodule is not None:  # again: an elastic restart's checkpoint came after the loaders were built
        trainer.datamodule.load_state_dict(checkpoint.get("datamodule", {}))
    restore_metrics(trainer, checkpoint)
    restore_rng(trainer, checkpoint)


def restore_weights(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """The model's weights, with a one-line account of what differs where they do not fit."""
    try:
        trainer.strategy.load_model_state_dict(checkpoint["state_dict"], strict=trainer.module.strict_loading)
    except RuntimeError as err:  # torch lists every key; say what differs in one line
        differences = weights_mismatch(trainer.module.state_dict(), checkpoint["state_dict"], err)
        raise CheckpointError(f"the checkpoint's weights do not fit {type(trainer.module).__name__}: {differences}. "
                              "Build the model with the hparams it was trained with.") from err


def restore_optimizers(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """The optimizers' and schedulers' states, and the rates rescaled where this run's lr_scaling factor differs."""
    try:
        for index, (optimizer, state) in enumerate(
            zip(trainer.optimizers, checkpoint["optimizer_states"], strict=True)
        ):
            _restore_optimizer(trainer, index, optimizer, state)
        # Before the rescale below: a strategy may replace the states with this rank's own (local SGD's replicas).
        trainer.strategy.load_state_dict(checkpoint.get("strategy", {}), trainer.optimizers)
        restore_schedulers(trainer, checkpoint)
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"the checkpoint's optimizers or schedulers do not match configure_optimizers "
                              f"({type(err).__name__}: {err}); resume with the ones it was trained with.") from err
    # A run resumed on another number of processes (or accumulation) scales its rates by its own factor.
    saved_scale = float(checkpoint["loops"].get("lr_scale", trainer.lr_scaler.factor))
    if saved_scale != trainer.lr_scaler.factor:
        trainer.lr_scaler.rescale_restored(trainer.optimizers, trainer.lr_scheduler_configs, saved_scale)
        if trainer.is_global_zero:
            print(f"lr_scaling: the checkpoint's rates were scaled x{saved_scale:g}, this run's are x"
                  f"{trainer.lr_scaler.factor:g}; rescaled the restored rates to match.")


def _restore_optimizer(trainer: Trainer, index: int, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    # torch takes the saved param groups whole: another kind of optimizer's fail only at its first step. The
    # keys the optimizer's own groups hold are the ones it needs (its `defaults` may gain more on loading).
    needed = {key for group in optimizer.param_groups for key in group}
    trainer.strategy.load_optimizer_state_dict(optimizer, state)
    missing = sorted({key for key in needed for group in optimizer.param_groups if key not in group})
    if missing:
        raise CheckpointError(
            f"the checkpoint's optimizer {index} has no {', '.join(missing)}, which configure_optimizers' "
            f"{type(optimizer).__name__} needs: it was saved from another kind of optimizer. Resume with the one "
            "it was trained with, or start a new fit from its weights (Net.load_from_checkpoint)."
        )


def restore_schedulers(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """The schedulers' states (a count that differs from configure_optimizers' raises ValueError)."""
    for config, state in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"], strict=True):
        config.scheduler.load_state_dict(state)
        # The optimizer stepped before the checkpoint; torch's check that a scheduler steps after its
        # optimizer only sees this process, and would warn when a resume's first act is an epoch end.
        if isinstance(getattr(config.scheduler, "optimizer", None), torch.optim.Optimizer):
            config.scheduler.optimizer._opt_called = True


def restore_progress(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Where the run stood, in this run's batches per process."""
    trainer.progress.load_state_dict(checkpoint["loops"]["progress"])
    trainer.loop_state.ledger.load_state_dict(checkpoint["loops"].get("ledger"))
    saved_size = checkpoint["loops"].get("data_parallel_size", trainer.strategy.data_parallel_size)
    _rescale_epoch_position(trainer, int(saved_size))


def restore_callbacks(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Each callback's state, found under its state_key (or the key it used to have)."""
    saved = checkpoint.get("callbacks", {})
    for callback in trainer.callbacks:
        key = next((k for k in (callback.state_key, getattr(callback, "legacy_state_key", None)) if k in saved), None)
        if key is not None:
            callback.load_state_dict(saved[key])
        elif callback.has_state and trainer.is_global_zero:
            warnings.warn(f"the checkpoint holds no state for the callback {callback.state_key} (it was saved without "
                          "it, or with other settings), so it starts afresh.", stacklevel=3)


def restore_metrics(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """This rank's running epoch aggregates (rank 0's where the checkpoint had another number of ranks)."""
    metric_states = checkpoint["loops"].get("metrics", [])
    if metric_states and trainer.metrics is not None:
        trainer.metrics.load_state_dict(_this_ranks(trainer, metric_states))


def restore_rng(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """This rank's random generators (rank 0's where the checkpoint had another number of ranks)."""
    states = checkpoint.get("rng", [])
    if states:
        state = _this_ranks(trainer, states)
        set_rng_state(state)
        trainer.loop_state.resumed_epoch_rng = state.get("torch_epoch_start")


def _this_ranks(trainer: Trainer, per_rank: list[Any]) -> Any:
    return per_rank[trainer.global_rank] if len(per_rank) == trainer.world_size else per_rank[0]


def check_resumable(checkpoint: dict[str, Any]) -> None:
    """A clear error for a checkpoint that holds weights but not this format's training state."""
    if "optimizer_states" not in checkpoint:
        raise CheckpointError(
            "this checkpoint holds only the model's weights (saved with weights_only=True, as "
            "ModelCheckpoint(save_weights_only=True) does), so a fit cannot resume from it; pass it to "
            "validate/test/predict or Net.load_from_checkpoint, or save full checkpoints to resume from."
        )
    loops = checkpoint.get("loops")
    if not isinstance(loops, dict) or not isinstance(loops.get("progress"), dict):
        raise CheckpointError(
            "this checkpoint has no training position in this framework's layout (loops.progress): it was not "
            "written by Trainer.save_checkpoint (a Lightning or hand-made file?), so a fit cannot resume from it; "
            "load its weights (Net.load_from_checkpoint) and start a new fit."
        )


def _rescale_epoch_position(trainer: Trainer, saved_size: int) -> None:
    """A mid-epoch resume on another number of data-parallel processes continues after as many samples as were
    trained (each rank's batches count `saved_size` times over), not after as many batches per rank."""
    progress, size = trainer.progress, trainer.strategy.data_parallel_size
    if saved_size == size or progress.epoch_batches == 0:
        return
    trained, progress.epoch_batches = progress.epoch_batches, progress.epoch_batches * saved_size // size
    progress.validated_batches = progress.epoch_batches if progress.validated_batches == trained else 0
    # Where the ledger recorded the epoch's seeded order, the loop deals its rest again exactly (data/ledger.py).
    exact = trainer.loop_state.ledger.epochs.get(str(progress.epoch), {}).get("order", {}).get("kind") == "seeded"
    if trainer.is_global_zero and not exact:
        warnings.warn(
            f"resuming mid-epoch on {size} data-parallel process(es) from a checkpoint of {saved_size}: epoch "
            f"{progress.epoch} goes on after {progress.epoch_batches} batches per process ({trained} per process were "
            f"trained on {saved_size}). The samples left are not the ones an unchanged run would see, as the sampler "
            "splits the epoch by process count; checkpoints at epoch ends resume exactly.", stacklevel=2,
        )
