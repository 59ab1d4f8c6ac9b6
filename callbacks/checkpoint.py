"""ModelCheckpoint: keep the k best checkpoints by a logged metric (or the k latest), plus last.ckpt."""

from __future__ import annotations

import math
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from torchyard.callbacks.base import Callback
from torchyard.trainer.config import parse_duration
from torchyard.trainer.errors import MisconfigurationError
from torchyard.trainer.logs.evaluations import SCORED, clear_training_ended, mark_training_ended, read_record
from torchyard.trainer.logs.loggers import Logger
from torchyard.trainer.module import overridden

if TYPE_CHECKING:
    from torchyard.trainer.module import TrainModule
    from torchyard.trainer.trainer import Trainer

# `{name}` or `{name:format_spec}`; names may hold '/' and '.' (logged metric names), unlike str.format fields.
_PLACEHOLDER = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


class ModelCheckpoint(Callback):
    """Save checkpoints during fit: the `save_top_k` best by `monitor`, or the latest ones without a monitor.

    Saves happen at the end of every `every_n_epochs`-th training epoch (after that epoch's validation),
    after mid-epoch validations (`val_check_interval` < 1), every `every_n_train_steps` optimizer steps, or
    after the first optimizer step once `train_time_interval` (a timedelta, seconds, or 'DD:HH:MM:SS') has
    passed since the last such save; never twice for one global step and never while sanity checking.
    `save_on_train_epoch_end=True` saves at training epoch ends only (not after mid-epoch validations);
    `False` saves after validations only (an epoch end that no validation preceded saves nothing).
    `save_last` also keeps `last.ckpt`, written at every epoch end that saves (whatever triggers the ranked
    files) and at a stop mid-epoch; when a top-k file was written at the same step it is a second name for
    that file (a hard link).
    `filename` is a template holding `{epoch}`, `{step}` and logged metrics with optional format specs:
    `"{epoch}-{val/acc:.4f}"` gives `epoch=3-val_acc=0.9123.ckpt` ('/' becomes '_'; `name=` is inserted
    unless auto_insert_metric_name=False). A name already taken gets `-v1`, `-v2`, ... (with
    enable_version_counter=False it is overwritten instead). A non-finite monitored value is never saved as
    a top-k one. `save_weights_only` writes the weights and hparams alone: smaller files that evaluate and
    load, but that no fit can resume from.
    `from_evaluator=True` ranks by the scores of the evaluator side process (`Trainer(evaluator=...)`, its
    evaluations.json in the run folder) instead of values logged in the loop: every due save writes a checkpoint,
    which waits for its score; once scored it is ranked, and only the `save_top_k` best scored ones are kept
    (`best_model_path` is the best scored so far; the fit's end settles the last scores).
    """

    monitors = True

    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, monitor: str | None = None,
                 mode: str = "min", save_top_k: int = 1, save_last: bool | None = None,
                 every_n_epochs: int | None = None, every_n_train_steps: int | None = None,
                 verbose: bool = False, auto_insert_metric_name: bool = True, save_weights_only: bool = False,
                 enable_version_counter: bool = True, train_time_interval: Any = None,
                 save_on_train_epoch_end: bool | None = None, from_evaluator: bool = False) -> None:
        if mode not in ("min", "max"):
            raise MisconfigurationError(f"ModelCheckpoint(mode={mode!r}) is not known; use 'min' or 'max'.")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise MisconfigurationError(
                f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (keep all), 0 (none) or k >= 1.")
        for key, value in (("every_n_epochs", every_n_epochs), ("every_n_train_steps", every_n_train_steps)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise MisconfigurationError(f"ModelCheckpoint({key}={value!r}) must be a whole number >= 0.")
        interval = parse_duration(train_time_interval, f"ModelCheckpoint(train_time_interval={train_time_interval!r})")
        if interval == 0:
            raise MisconfigurationError("ModelCheckpoint(train_time_interval=0) would save after every step; use "
                                        "every_n_train_steps=1 for that, or give a positive duration.")
        given = (("every_n_epochs", every_n_epochs), ("every_n_train_steps", every_n_train_steps),
                 ("train_time_interval", train_time_interval))
        triggers = [f"{key}={value!r}" for key, value in given if value]
        if len(triggers) > 1:
            raise MisconfigurationError(f"ModelCheckpoint got {' and '.join(triggers)}; set only one of them.")
        if from_evaluator and monitor is None:
            raise MisconfigurationError("ModelCheckpoint(from_evaluator=True) ranks by the evaluator's score of a "
                                        "metric: give it monitor= (e.g. monitor='val/acc', mode='max').")
        if save_on_train_epoch_end not in (None, True, False):
            raise MisconfigurationError(
                f"ModelCheckpoint(save_on_train_epoch_end={save_on_train_epoch_end!r}) takes True, False or None.")
        self._dirpath_arg = Path(dirpath).expanduser() if dirpath is not None else None
        self.dirpath: str | None = None  # resolved in setup (default: <log_dir>/checkpoints)
        self.filename = filename or "{epoch}-{step}"
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = interval
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (0 if triggers else 1)
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.verbose, self.auto_insert_metric_name = verbose, auto_insert_metric_name
        self.save_weights_only, self.enable_version_counter = save_weights_only, enable_version_counter
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.from_evaluator = from_evaluator
        self.awaiting_score: dict[str, int] = {}  # from_evaluator: checkpoint path -> its global step, not yet scored
        self.best_model_path, self.kth_best_model_path, self.last_model_path = "", "", ""
        self.best_model_score: torch.Tensor | None = None
        self.kth_value: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
        self._last_global_step_saved = -1
        self._last_time_check = 0.0  # time.monotonic() at the start of training or the last timed save
        self._step_seen = -1  # global_step at the previous batch end
        self._validation_ran = False
        self._validated_step = -1
        self._warned_missing = False

    @property
    def state_key(self) -> str:
        # Unlike Lightning's, it names the filename (not the folder, which a resume may move): best-1 and best-3 differ.
        return self._key(filename=self.filename) if self.filename != "{epoch}-{step}" else self._key()

    @property
    def legacy_state_key(self) -> str:
        """The key checkpoints written before state_key named the filename hold this callback's state under."""
        return self._key()

    def _key(self, **more: Any) -> str:
        if self.train_time_interval is not None:  # only then: the keys that checkpoints already hold stay valid
            more["train_time_interval"] = self.train_time_interval
        settings = {"monitor": self.monitor, "mode": self.mode, "every_n_train_steps": self.every_n_train_steps,
                    "every_n_epochs": self.every_n_epochs, **more}
        return f"{type(self).__qualname__}{settings!r}"

    # ------------------------------------------------------------------ when to save
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        if stage != "fit":
            return
        path = self._dirpath_arg if self._dirpath_arg is not None else Path(trainer.log_dir) / "checkpoints"
        # Rank 0's absolute folder: every rank records the same paths, and a resume from another cwd recognises them.
        self.dirpath = trainer.strategy.broadcast(str(path.absolute()) if trainer.is_global_zero else None)
        self._validation_ran = False
        if trainer.is_global_zero:  # checkpoints come to the folder again (an evaluator watching it waits for them)
            clear_training_ended(self.dirpath)

    @override
    def on_fit_end(self, trainer: Trainer, module: TrainModule) -> None:
        # `trainer evaluate --watch` ends on this; a smoke test (fast_dev_run) leaves no files, as it saves none.
        if trainer.is_global_zero and self.dirpath is not None and not trainer.config.fast_dev_run:
            mark_training_ended(self.dirpath, trainer.global_step)

    def on_train_start(self, trainer: Trainer, module: TrainModule) -> None:
        # A resumed run's checkpoint already holds this step.
        self._last_global_step_saved = self._step_seen = trainer.global_step
        self._last_time_check = time.monotonic()

    def uses_hook(self, hook: str) -> bool:
        return hook != "on_train_batch_end" or bool(self.every_n_train_steps) or self.train_time_interval is not None

    def on_train_batch_end(self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0:
            self._save(trainer, at_epoch_end=False)
        if self.train_time_interval is not None:
            self._save_if_interval_passed(trainer)

    def _save_if_interval_passed(self, trainer: Trainer) -> None:
        # Only after a stepping batch: a save inside an accumulation window would lack its gradients and not resume.
        stepped, self._step_seen = trainer.global_step != self._step_seen, trainer.global_step
        if not stepped:
            return
        now = time.monotonic()
        # Rank 0's clock decides, so every rank saves after the same step.
        if trainer.strategy.broadcast(now - self._last_time_check >= self.train_time_interval):
            self._last_time_check = now
            self._save(trainer, at_epoch_end=False)

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if trainer.sanity_checking or trainer.stage != "fit":
            return
        self._validation_ran, self._validated_step = True, trainer.global_step
        # The epoch-end validation is followed by on_train_epoch_end, which saves for it.
        if not trainer.epoch_batches_done and self._epoch_due(trainer) and self.save_on_train_epoch_end is not True:
            self._save(trainer, at_epoch_end=False)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        validated = bool(trainer.val_dataloaders) and self._validated_step == trainer.global_step
        saves_here = self.save_on_train_epoch_end is not False or validated
        if self._epoch_due(trainer) and saves_here:
            self._save(trainer, at_epoch_end=True, top_k=self._score_is_current(trainer))
        elif self.save_last and (saves_here or not trainer.epoch_batches_done):
            # last.ckpt at each epoch end whatever saves ranked files (as in Lightning), and at a stop to resume from.
            self._save(trainer, at_epoch_end=True, top_k=False)

    def _score_is_current(self, trainer: Trainer) -> bool:
        """Whether the monitored value is this step's: after no validation it is an older one, not worth ranking."""
        current = self.monitor is None or not trainer.val_dataloaders or self._validated_step == trainer.global_step
        return current or self.from_evaluator  # the evaluator scores each checkpoint later, whatever the loop ran

    def _epoch_due(self, trainer: Trainer) -> bool:
        return self.every_n_epochs >= 1 and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    # ------------------------------------------------------------------ saving
    def _save(self, trainer: Trainer, at_epoch_end: bool, top_k: bool = True) -> None:
        step = trainer.global_step
        if trainer.sanity_checking or trainer.config.fast_dev_run or step == self._last_global_step_saved:
            return  # fast_dev_run: a smoke test leaves no files behind
        self._last_global_step_saved = step
        values = self._candidates(trainer)
        absent = top_k and self.monitor is not None and self.monitor not in values and not self.from_evaluator
        missing = self._missing_monitor(trainer, at_epoch_end) if absent else None
        previous_last = self.last_model_path
        if self.save_last:
            # Named before the top-k file is written, so that file's copy of this callback's state names it too.
            self.last_model_path = self._free_path(trainer, self.CHECKPOINT_NAME_LAST, values, reusable=previous_last)
        written = self._save_top_k(trainer, values) if top_k and self.save_top_k != 0 else None
        if self.save_last:
            if written is not None:  # the same state: a second name for that file, not a second write
                trainer.strategy.link_checkpoint(written, self.last_model_path)
            else:
                trainer.save_checkpoint(self.last_model_path, weights_only=self.save_weights_only, wait=False)
            if previous_last and previous_last != self.last_model_path:
                trainer.strategy.remove_checkpoint(previous_last)
        if trainer.is_global_zero:  # as in Lightning: a logger may upload what was saved (MLFlowLogger's log_model)
            for logger in trainer.loggers:
                if overridden(logger, "after_save_checkpoint", Logger) is not None:
                    trainer.strategy.finish_checkpoints()  # the files it may read are synced and named
                logger.after_save_checkpoint(self)
        if missing is not None:  # raised once the run's state is in last.ckpt (with save_last): no work is lost
            saved = f" The run so far is saved in {self.last_model_path}." if self.save_last else ""
            raise MisconfigurationError(missing + saved)

    def _candidates(self, trainer: Trainer) -> dict[str, Any]:
        """epoch, step and the logged values the monitor and the filename need, as rank 0 sees them."""
        metrics = trainer.callback_metrics
        wanted = {m.group(1) for m in _PLACEHOLDER.finditer(self.filename + self.CHECKPOINT_NAME_LAST)}
        if self.monitor is not None:
            wanted.add(self.monitor)
        values: dict[str, Any] = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        values.update({name: float(metrics[name]) for name in wanted - values.keys() if name in metrics})
        # Ranks could hold different unsynced values; deciding on rank 0's keeps the save collective in step.
        return trainer.strategy.broadcast(values)

    def _missing_monitor(self, trainer: Trainer, at_epoch_end: bool) -> str | None:
        """The error for a monitor absent where it must be logged; None (warning once) before a validation logs it."""
        message = (f"ModelCheckpoint(monitor={self.monitor!r}) found no such logged metric; logged: "
                   f"{sorted(trainer.callback_metrics)}. Log it with self.log({self.monitor!r}, value) "
                   "or fix the name" + (", or rank by the evaluator's scores: from_evaluator=True."
                                        if trainer.config.evaluator is not None else ".")
                   + trainer.strategy.missing_metric_hint(trainer.module))
        # Before the first validation a validation metric is legitimately absent; after it, it is a mistake.
        epoch_validated = at_epoch_end and trainer.epoch_batches_done and trainer.validates_at_epoch_end
        if self._validation_ran or epoch_validated:
            return message
        if not self._warned_missing and trainer.is_global_zero:
            self._warned_missing = True
            warnings.warn(message + " Skipping top-k saving until it appears.", stacklevel=2)
        return None

    def _save_top_k(self, trainer: Trainer, values: dict[str, Any]) -> str | None:
        """Save a checkpoint if it makes the top k; the path written, if any."""
        if self.from_evaluator:
            return self._save_for_evaluator(trainer, values)
        if self.monitor is None:
            score = float(values["step"])  # without a monitor the newest checkpoints are the best ones
        elif self.monitor not in values:
            return None
        else:
            score = values[self.monitor]
            self.current_score = torch.tensor(score, dtype=torch.float64)
            if not math.isfinite(score):
                self._say(trainer, values, f"{self.monitor!r} is {score}, which is never kept as a top-k checkpoint")
                return None
        k = self.save_top_k
        full = k != -1 and len(self.best_k_models) >= k
        if full and not self._better(score, float(self.best_k_models[self.kth_best_model_path])):
            if self.monitor is not None:
                self._say(trainer, values, f"{self.monitor!r} = {score:.5g} was not in the top {k}")
            return None
        path = self._free_path(trainer, self.filename, values, reusable=self.kth_best_model_path if full else "")
        self.best_k_models[path] = torch.tensor(score, dtype=torch.float64)
        evicted = []
        while k != -1 and len(self.best_k_models) > k:
            worst = self._worst_path()
            evicted.append(worst)
            del self.best_k_models[worst]
        self._rank()
        if self.monitor is not None:
            best = float(self.best_model_score)
            self._say(trainer, values, f"{self.monitor!r} reached {score:.5g} (best {best:.5g}), saving {path}")
        # The bookkeeping above is part of it.
        trainer.save_checkpoint(path, weights_only=self.save_weights_only, wait=False)
        for old in evicted:
            trainer.strategy.remove_checkpoint(old)
        return path

    def _save_for_evaluator(self, trainer: Trainer, values: dict[str, Any]) -> str:
        """Save a checkpoint for the evaluator to score; it is ranked once its score is recorded."""
        path = self._free_path(trainer, self.filename, values, reusable="")
        self.awaiting_score[path] = int(values["step"])
        trainer.save_checkpoint(path, weights_only=self.save_weights_only, wait=False)
        self.settle_scores(trainer)
        return path

    def settle_scores(self, trainer: Trainer, collective: bool = True) -> None:
        """Rank the checkpoints the evaluator has scored since the last call and keep the save_top_k best scored
        ones (those still awaiting a score stay). Rank 0 reads the record; `collective=False`: rank 0 alone."""
        scored: dict[str, float] | None = None
        if trainer.is_global_zero:
            by_step = {evaluation.global_step: evaluation.metrics[self.monitor]
                       for evaluation in read_record(trainer.log_dir)
                       if evaluation.status == SCORED and self.monitor in evaluation.metrics}
            scored = {path: by_step[step] for path, step in self.awaiting_score.items() if step in by_step}
        if collective:
            scored = trainer.strategy.broadcast(scored)
        if not scored:
            return
        unranked = []
        for path, score in scored.items():
            del self.awaiting_score[path]
            if math.isfinite(score):
                self.best_k_models[path] = torch.tensor(score, dtype=torch.float64)
            else:  # as in the loop: a non-finite score is never a top-k checkpoint
                unranked.append(path)
        while self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            worst = self._worst_path()
            unranked.append(worst)
            del self.best_k_models[worst]
        self._rank()
        for path in unranked:
            trainer.strategy.remove_checkpoint(path)

    @override
    def teardown(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        # The evaluator has scored the fit's last checkpoints by now (its callback waits for it in its teardown,
        # which runs first); no collective here, where a failed rank may be gone: the launching script adopts
        # rank 0's ranking.
        if stage == "fit" and self.from_evaluator and self.awaiting_score:
            self.settle_scores(trainer, collective=False)

    def _free_path(self, trainer: Trainer, template: str, values: dict[str, Any], reusable: str) -> str:
        """`<dirpath>/<name>.ckpt`, or `-v1`, `-v2`, ... added while a file has it (with enable_version_counter)."""
        path = None
        if trainer.is_global_zero:
            name = self.format_checkpoint_name(values, template)[: -len(self.FILE_EXTENSION)]
            version = 0
            while True:
                suffix = f"-v{version}" if version else ""
                path = str(Path(self.dirpath or ".") / f"{name}{suffix}{self.FILE_EXTENSION}")
                taken = path in self.best_k_models or path == self.last_model_path or Path(path).exists()
                if path == reusable or not taken or not self.enable_version_counter:
                    break
                version += 1
        return trainer.strategy.broadcast(path)

    def format_checkpoint_name(self, metrics: dict[str, Any], filename: str | None = None) -> str:
        """The file name `filename` (default: this callback's template) gives for `metrics`, with suffix."""
        template = filename if filename is not None else self.filename

        def fill(match: re.Match[str]) -> str:
            name, spec = match.group(1), match.group(2) or ""
            value = metrics.get(name, 0)  # as in Lightning, a metric not logged yet is 0
            value = value.item() if isinstance(value, torch.Tensor) else value
            try:
                text = format(value, spec)
            except ValueError:
                if not (isinstance(value, float) and value.is_integer()):
                    raise MisconfigurationError(f"ModelCheckpoint(filename={template!r}): {name}={value!r} "
                                                f"cannot be formatted as {spec!r}.") from None
                text = format(int(value), spec)  # a logged count arrives as a float
            named = match.string[: match.start()].endswith(f"{name}=")
            return f"{name}={text}" if self.auto_insert_metric_name and not named else text

        name = _PLACEHOLDER.sub(fill, template)
        return name.replace("/", "_").replace("\\", "_") + self.FILE_EXTENSION

    # ------------------------------------------------------------------ bookkeeping
    @property
    def _lower_is_better(self) -> bool:
        return self.mode == "min" and self.monitor is not None  # without a monitor the score is the step

    def _better(self, score: float, other: float) -> bool:
        return score < other if self._lower_is_better else score > other

    def _worst_path(self) -> str:
        pick = max if self._lower_is_better else min
        return pick(self.best_k_models, key=lambda p: float(self.best_k_models[p]))

    def _rank(self) -> None:
        if not self.best_k_models:
            self.best_model_path, self.kth_best_model_path = "", ""
            self.best_model_score = self.kth_value = None
            return
        self.kth_best_model_path = self._worst_path()
        self.kth_value = self.best_k_models[self.kth_best_model_path]
        best_pick = min if self._lower_is_better else max
        self.best_model_path = best_pick(self.best_k_models, key=lambda p: float(self.best_k_models[p]))
        self.best_model_score = self.best_k_models[self.best_model_path] if self.monitor is not None else None

    def _say(self, trainer: Trainer, values: dict[str, Any], message: str) -> None:
        if self.verbose and trainer.is_global_zero:
            print(f"Epoch {values['epoch']}, step {values['step']}: {message}")

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor, "dirpath": self.dirpath, "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score, "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path, "kth_value": self.kth_value,
            "last_model_path": self.last_model_path, "current_score": self.current_score,
            "awaiting_score": dict(self.awaiting_score),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_dir = state.get("dirpath")
        same_dir = self.dirpath is None or (saved_dir is not None
                                            and Path(saved_dir).resolve() == Path(self.dirpath).resolve())
        if not same_dir:
            # Other files live there: keeping their scores would evict or mis-rank files we never wrote.
            warnings.warn(f"ModelCheckpoint: the checkpoint folder changed from {saved_dir} to {self.dirpath}; "
                          "only best_model_path is restored, top-k bookkeeping starts afresh.", stacklevel=2)
            self.best_model_path = state.get("best_model_path", "")
            return
        self.dirpath = self.dirpath or saved_dir
        self.best_k_models = dict(state.get("best_k_models", {}))
        self.awaiting_score = dict(state.get("awaiting_score", {}))
        self.last_model_path = state.get("last_model_path", "")
        self.current_score = state.get("current_score")
        self._rank()
