"""What a run does on SIGTERM/SIGINT, on a NaN/inf loss and when a collective hangs; the loop calls these in one
line each. The protocol (exit codes, agreement between ranks, costs) is in docs/fault-tolerance.md."""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchyard.trainer.strategies import Strategy
    from torchyard.trainer.trainer import Trainer

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM
SIGINT_EXIT_CODE = 130  # 128 + SIGINT
AGREE_EVERY_S = 0.25  # how often ranks stepping together exchange their SIGTERM flags (see the module docstring)
MAX_AGREE_INTERVAL = 4  # step boundaries between exchanges, at most: bounds the delay when steps slow down


class Terminated(SystemExit):
    """Raised out of fit once a SIGTERM's (or SIGINT's) checkpoint is saved; exits the process with
    SIGTERM_EXIT_CODE (SIGINT_EXIT_CODE)."""


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or inf (nonfinite_loss='error')."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within Trainer(timeout=...): another rank is stuck or gone."""


# --------------------------------------------------------------------------- the step guard


class StepGuard:
    """One fit's SIGTERM flag and non-finite loss check, both settled at optimizer-step boundaries.

    `with StepGuard(trainer) as guard:` installs the SIGTERM and SIGINT handlers (main thread only) and
    restores the previous ones on exit.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.mode: str = trainer.config.nonfinite_loss
        self.signalled = False
        self._losses: list[tuple[int, torch.Tensor]] = []  # the accumulation window's (batch_idx, loss)
        self._stop: bool | None = None  # what the ranks agreed at this batch's step boundary, until acted on
        strategy = trainer.strategy
        self._agree = strategy.world_size > 1 and strategy.steps_in_lockstep  # ranks must act at the same step
        self._local_check = self.mode == "error" and not self._agree  # a bad loss raises here, nothing to agree
        self._pending: Any = None  # the SIGTERM exchange started at the last exchange boundary
        self._countdown = 0  # step boundaries until the next exchange (agreed, so the same on every rank)
        self._interval = 1  # step boundaries from the last exchange to the next
        self._last_exchange: float | None = None  # time.monotonic() of the last exchange
        self._previous_handlers: dict[int, Any] = {}
        self.received = signal.SIGTERM  # the signal this rank got first (a rank told by the others: SIGTERM)
        self._second_sigint_stops = False

    def __enter__(self) -> StepGuard:
        strategy = self.trainer.strategy
        # One process started by hand: a second Ctrl-C is the user insisting (see the module docstring).
        self._second_sigint_stops = not strategy.environment.launched and strategy.world_size == 1
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            self._previous_handlers = {
                sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
            }
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._pending is not None and exc_info[0] is None:
            # Every rank started it: collect it, so no collective is left open when the group goes.
            self.trainer.strategy.max_across_ranks_result(self._pending)
        self._pending = None
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers = {}
        if self.signalled and exc_info[0] is None and self._second_sigint_stops:
            # It came after the last step boundary, so nothing acted on it; the fit's end saved its checkpoints.
            # The script must still stop rather than go on to its next stage (one process: no peer to wait for).
            if self.received == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(SIGTERM_EXIT_CODE)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.signalled:
            self.received = signal.Signals(signum)
        self.signalled = True
        if signum == signal.SIGINT and self._second_sigint_stops:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def allow_step(self, output: Any, batch_idx: int, stepping: bool) -> bool:
        """Keep a micro-batch's loss; at the micro-batch that steps, check and settle its window.

        True when the optimizer should step now; False on an accumulating micro-batch or a skipped step.
        """
        if stepping and self._local_check and type(output) is torch.Tensor and not self._losses:
            # The usual step (one process, no accumulation window, a loss tensor): the check is one host read.
            value = output.item()
            if math.isfinite(value):
                self._stop = self.signalled
                return True
            raise NonFiniteLossError(self._describe(batch_idx, value))
        if self.mode != "ignore":
            loss = output.get("loss") if isinstance(output, dict) else output
            if isinstance(loss, torch.Tensor):
                # Kept past its micro-batch only in an accumulation window: detached there, so its graph goes.
                self._losses.append((batch_idx, loss if stepping else loss.detach()))
        if not stepping:
            return False
        losses, self._losses = self._losses, []
        local = _first_nonfinite(losses) if losses else None
        if local is not None and self.mode == "error":
            # No agreement needed: the other ranks cannot save without this one, and the job stops.
            raise NonFiniteLossError(self._describe(*local))
        if self._agree:
            bad, self._stop = self._settle(local is not None)
        else:
            bad, self._stop = local is not None, self.signalled
        if not bad:
            return True
        for optimizer in self.trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.trainer.module.log("train/skipped_nonfinite", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        return False

    def check_reevaluated(self, loss: torch.Tensor, batch_idx: int) -> None:
        """A loss that an optimizer's closure evaluated again (LBFGS, SAM) inside its step: one that is NaN or inf
        stops the run unless nonfinite_loss='ignore' (the step cannot be skipped half-way; the optimizer reads the
        loss on the host anyway)."""
        if self.mode == "ignore":
            return
        value = loss.item()
        if not math.isfinite(value):
            raise NonFiniteLossError(
                f"the training loss was {value} when the optimizer evaluated it again inside its step at global step "
                f"{self.trainer.progress.global_step} (epoch {self.trainer.progress.epoch}, batch {batch_idx}); the "
                "last checkpoint is finite. Lower the learning rate or the optimizer's step size, or check that batch.")

    def stop_if_signalled(self) -> None:
        """Between batches, at a step boundary: when any rank got SIGTERM, save a checkpoint on every rank and exit."""
        if self._stop is None:
            if self.trainer.module.automatic_optimization:
                return  # not a step boundary: gradients accumulated since the last step would be lost
            _, self._stop = self._settle(False)  # manual optimization: every batch is a boundary
        stop, self._stop = self._stop, None
        if stop:
            self._terminate()

    def _settle(self, bad: bool) -> tuple[bool, bool]:
        """(some rank skips this step, some rank got SIGTERM), the same on every rank that steps in lockstep."""
        if not self._agree:
            return bad, self.signalled
        strategy = self.trainer.strategy
        if self.mode == "skip":
            # A skip must be agreed before this step is taken: one blocking 2-value all-reduce.
            pending = strategy.max_across_ranks_async([float(bad), float(self.signalled)])
            skip, stop = strategy.max_across_ranks_result(pending)
            return skip > 0, stop > 0
        self._countdown -= 1
        if self._countdown > 0:
            return bad, False
        # SIGTERM flags are exchanged every few steps, without blocking: the maxima sent at the previous
        # exchange (finished during the steps since) are read now, then this rank's flag and the interval
        # it proposes go out. The smallest proposal wins, so every rank counts the same boundaries to the next.
        stop, interval = False, 1
        if self._pending is not None:
            signalled, negated_interval = strategy.max_across_ranks_result(self._pending)
            stop, interval = signalled > 0, int(-negated_interval)
        proposal = self._proposal(self._interval)
        self._pending = None if stop else strategy.max_across_ranks_async([float(self.signalled), -proposal])
        self._interval = self._countdown = interval
        return bad, stop

    def _proposal(self, boundaries: int) -> float:
        """How many step boundaries make about AGREE_EVERY_S, at this rank's pace over the `boundaries` since
        the last exchange."""
        now = time.monotonic()
        previous, self._last_exchange = self._last_exchange, now
        if previous is None or now <= previous:  # the first exchange: nothing to measure from yet
            return 1.0
        return float(min(MAX_AGREE_INTERVAL, max(1, int(AGREE_EVERY_S * boundaries / (now - previous)))))

    def _describe(self, batch_idx: int, value: float) -> str:
        progress, strategy = self.trainer.progress, self.trainer.strategy
        where = f" on rank {strategy.global_rank}" if strategy.world_size > 1 else ""
        return (
            f"the training loss was {value}{where} at global step {progress.global_step} (epoch {progress.epoch}, "
            f"batch {batch_idx}); training stopped before that optimizer step, so the weights and the last "
            "checkpoint are finite. Lower the learning rate, clip gradients or check that batch, or set "
            "nonfinite_loss='skip' to skip such batches."
        )

    def _terminate(self) -> None:
        trainer, progress = self.trainer, self.trainer.progress
        path = _last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        code = SIGINT_EXIT_CODE if self.received == signal.SIGINT else SIGTERM_EXIT_CODE
        if trainer.is_global_zero:
            print(f"trainer: {self.received.name}: saved {path} at global step {progress.global_step} (epoch "
                  f"{progress.epoch}, {progress.epoch_batches} batches done); exiting with code {code}. "
                  "fit(ckpt_path='last') resumes from it.", file=sys.stderr, flush=True)
        raise Terminated(code)


def _first_nonfinite(losses: list[tuple[int, torch.Tensor]]) -> tuple[int, float] | None:
    """(batch_idx, value) of the window's first non-finite loss; one host read when all are finite."""
    if len(losses) == 1 and losses[0][1].ndim == 0:
        # The usual window, one scalar loss: reading it is one host sync, like the check below, with
        # none of its kernel launches (they cost tens of microseconds a step on a CPU).
        batch_idx, loss = losses[0]
        value = loss.item()
        return None if math.isfinite(value) else (batch_idx, value)
    if bool(torch.stack([torch.isfinite(loss).all() for _, loss in losses]).all()):
        return None
    for batch_idx, loss in losses:
        if not bool(torch.isfinite(loss).all()):
            return batch_idx, loss.float().flatten()[~torch.isfinite(loss.flatten())][0].item()
    return None


def _last_checkpoint_path(trainer: Trainer) -> Path:
    """Where a SIGTERM checkpoint goes: the ModelCheckpoint's last file, so `ckpt_path="last"` finds it."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath:
        return Path(callback.last_model_path or Path(callback.dirpath) / "last.ckpt")
    return Path(trainer.log_dir) / "checkpoints" / "last.ckpt"


# --------------------------------------------------------------------------- collective timeouts

_TIMEOUT_MARKERS = ("Timed out waiting", "Application timeout caused pair closure")
_OPERATIONS = {
    "backward": "the gradient all-reduce in backward",
    "forward_backward": "the training step (forward, backward and the gradient all-reduce)",
    "training_step": "the training step's forward (DDP broadcasts buffers there)",
    "reduce": "an all-reduce of logged values",
    "max_across_ranks_result": "the ranks' agreement on SIGTERM and skipped steps",
    "barrier": "a barrier",
    "broadcast": "a broadcast",
    "all_gather_object": "an all-gather",
    "save_checkpoint": "saving a checkpoint",
    "setup_module": "the model's initial weight broadcast",
}


def is_collective_timeout(error: BaseException) -> bool:
    """True for gloo's collective timeout (and for a later call on the pair that timeout closed)."""
    text = str(error)
    if isinstance(error, torch.distributed.DistError) and "timeout" in text.lower():
        return True
    return isinstance(error, RuntimeError) and any(marker in text for marker in _TIMEOUT_MARKERS)


def raise_if_collective_timeout(error: BaseException, strategy: Strategy) -> None:
    """Re-raise a collective timeout as one line naming the operation that waited; otherwise do nothing."""
    if not is_collective_timeout(error) or isinstance(error, CollectiveTimeoutError):
        return
    raise CollectiveTimeoutError(
        f"rank {strategy.global_rank} waited more than {strategy.timeout:g} s in {_waiting_call(error, strategy)}; "
        "another rank is stuck or died before joining it (see its output). Raise Trainer(timeout=...) if a "
        "step legitimately takes longer."
    ) from error


def _waiting_call(error: BaseException, strategy: Strategy) -> str:
    """'<operation> (<Strategy>.<method>, called from <caller>)', read from the traceback's frames."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    own = [i for i, frame in enumerate(frames) if frame.f_locals.get("self") is strategy]
    if not own:
        return "a collective"
    inner, outer = frames[own[-1]], own[0]
    method = inner.f_code.co_name
    name = inner.f_locals.get("name") if method == "barrier" else None
    operation = _OPERATIONS.get(method, "a collective") + (f" {name!r}" if name else "")
    caller = frames[outer - 1].f_code if outer > 0 else None
    called_from = f", called from {getattr(caller, 'co_qualname', caller.co_name)}" if caller is not None else ""
    return f"{operation} ({type(strategy).__name__}.{method}{called_from})"
