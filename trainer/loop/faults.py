"""What a run does on SIGTERM/SIGINT, on a NaN/inf loss and when a collective hangs; the loop calls these in one
line each. The protocol (exit codes, agreement between ranks, costs) is in docs/fault-tolerance.md."""

from __future__ import annotations

import datetime
import math
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchyard.trainer.errors import CollectiveTimeoutError, NonFiniteLossError, Terminated

if TYPE_CHECKING:
    from torchyard.trainer.strategies import Strategy
    from torchyard.trainer.trainer import Trainer

SIGTERM_EXIT_CODE = 143  # 128 + SIGTERM
SIGINT_EXIT_CODE = 130  # 128 + SIGINT
SIGHUP_EXIT_CODE = 129  # 128 + SIGHUP
#: The signals a fit saves last.ckpt on and then exits with 128 + the signal: a scheduler's SIGTERM, Ctrl-C, and
#: SIGHUP (the terminal closed, the ssh session dropped), which would otherwise end the run with nothing saved.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOPPED_EXIT_CODES = tuple(128 + int(sig) for sig in STOP_SIGNALS)
AGREE_EVERY_S = 0.2  # how often ranks stepping together exchange their SIGTERM flags (docs/fault-tolerance.md)
AGREE_AHEAD_S = 0.1  # how far ahead, in time at the current pace, the step the ranks stop at is set
MAX_AGREE_AHEAD = 128  # ... in step boundaries, at most: bounds the delay when steps slow down
READ_LOSSES_EVERY_S = 0.5  # on an accelerator, how often nonfinite_loss='error' reads the losses it kept


# --------------------------------------------------------------------------- the step guard


class StepGuard:
    """One fit's SIGTERM flag and non-finite loss check, both settled at optimizer-step boundaries.

    `with StepGuard(trainer) as guard:` installs the SIGTERM, SIGINT and SIGHUP handlers (main thread only) and
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
        # On an accelerator, reading a loss waits for the kernels queued before it, so the host stops running
        # ahead of the device (and loading the next batch while it computes) at every step. 'error' need not
        # decide before the step, so there it keeps the losses (global_step, epoch, batch_idx, loss) and reads
        # them together every READ_LOSSES_EVERY_S, at each epoch end and before any checkpoint is built.
        self._unread: list[tuple[int, int, int, torch.Tensor]] | None = (
            [] if self.mode == "error" and reads_wait_for(strategy.root_device) else None)
        self._read_by = 0.0  # time.monotonic() at which the kept losses are read next
        self._agreement: SignalAgreement | None = None  # the ranks' SIGTERM exchange, off the training thread
        self._previous_handlers: dict[int, Any] = {}
        self.received = signal.SIGTERM  # the signal this rank got first (a rank told by the others: SIGTERM)
        self._second_sigint_stops = False

    def __enter__(self) -> StepGuard:
        strategy = self.trainer.strategy
        # One process started by hand: a second Ctrl-C is the user insisting (see the module docstring).
        self._second_sigint_stops = not strategy.environment.launched and strategy.world_size == 1
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            self._previous_handlers = {
                sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS
            }
        if self._agree and self.mode != "skip":
            self._agreement = SignalAgreement(lambda: self.signalled, strategy.timeout)
        if self._unread is not None:
            self._read_by = time.monotonic() + READ_LOSSES_EVERY_S
            self.trainer.loop_state.read_losses = self.read_losses
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._agreement is not None:
            # Every rank ends its fit, or stops at the agreed step: their exchanges end together.
            self._agreement.close(together=exc_info[0] is None or isinstance(exc_info[1], Terminated))
            self._agreement = None
        self.trainer.loop_state.read_losses = None
        for sig, previous in self._previous_handlers.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers = {}
        if self.signalled and exc_info[0] is None and self._second_sigint_stops:
            # It came after the last step boundary, so nothing acted on it; the fit's end saved its checkpoints.
            # The script must still stop rather than go on to its next stage (one process: no peer to wait for).
            if self.received == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(128 + int(self.received))

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.signalled:
            self.received = signal.Signals(signum)
        self.signalled = True
        strategy = self.trainer.strategy
        if signum == signal.SIGTERM and strategy.stuck_seconds() >= strategy.timeout / 2:
            # Stuck for half the timeout (its watchdog says so): this rank would not reach the step boundary where
            # the flag acts, and the job is failing (the launcher stops the ranks when one's collective timed
            # out). Leave now rather than at the launcher's SIGKILL, as a failure (not Terminated: nothing was
            # saved, and a strategy must not wait at teardown for ranks that are gone).
            raise SystemExit(SIGTERM_EXIT_CODE)
        if signum == signal.SIGINT and self._second_sigint_stops:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def allow_step(self, output: Any, batch_idx: int, stepping: bool) -> bool:
        """Keep a micro-batch's loss; at the micro-batch that steps, check and settle its window.

        True when the optimizer should step now; False on an accumulating micro-batch or a skipped step.
        """
        if stepping and self._local_check and type(output) is torch.Tensor and not self._losses:
            # The usual step (one process, no accumulation window, a loss tensor): the check is one host read,
            # or none at this step on an accelerator.
            if self._unread is not None:
                self._keep_unread(batch_idx, output)
                self._stop = self.signalled
                return True
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
        local = None
        if self._unread is not None:
            for loss_batch_idx, loss in losses:
                self._keep_unread(loss_batch_idx, loss)
        elif losses:
            found = _first_nonfinite([loss for _, loss in losses])
            local = None if found is None else (losses[found[0]][0], found[1])
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

    def _keep_unread(self, batch_idx: int, loss: torch.Tensor) -> None:
        progress, unread = self.trainer.progress, self._unread
        assert unread is not None
        unread.append((progress.global_step, progress.epoch, batch_idx, loss.data))  # `.data`: no graph kept
        if time.monotonic() >= self._read_by:
            self.read_losses()

    def read_losses(self) -> None:
        """Read the losses kept unread (nonfinite_loss='error' on an accelerator), one host read when all are
        finite; raise NonFiniteLossError at the first that is NaN or inf."""
        unread = self._unread
        if not unread:
            return
        self._unread, self._read_by = [], time.monotonic() + READ_LOSSES_EVERY_S
        found = _first_nonfinite([loss for *_, loss in unread])
        if found is None:
            return
        global_step, epoch, batch_idx, _ = unread[found[0]]
        taken = self.trainer.progress.global_step - global_step
        # Read before its own step (the read fell due at it): that step was not taken.
        raise NonFiniteLossError(self._describe_late(global_step, epoch, batch_idx, found[1], taken) if taken
                                 else self._describe(batch_idx, found[1]))

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
        if self._agreement is None:  # a fit loop run outside `with StepGuard(...)`: a blocking exchange
            pending = strategy.max_across_ranks_async([float(self.signalled)])
            return bad, strategy.max_across_ranks_result(pending)[0] > 0
        return bad, self._agreement.at_boundary()

    def _describe(self, batch_idx: int, value: float) -> str:
        progress = self.trainer.progress
        return (
            f"{self._bad_loss(value, progress.global_step, progress.epoch, batch_idx)}; training stopped before that "
            "optimizer step, so the weights and the last checkpoint are finite. Lower the learning rate, clip "
            "gradients or check that batch, or set nonfinite_loss='skip' to skip such batches."
        )

    def _describe_late(self, global_step: int, epoch: int, batch_idx: int, value: float, taken: int) -> str:
        return (
            f"{self._bad_loss(value, global_step, epoch, batch_idx)}; on {self.trainer.strategy.root_device.type}, "
            f"nonfinite_loss='error' reads the losses every {READ_LOSSES_EVERY_S:g} s rather than at each step (a "
            f"read waits for the device), so {taken} optimizer step(s) from that one on were taken: the weights in "
            "memory are not finite, but the last checkpoint is (one is written only after the losses before it were "
            "read). Lower the learning rate, clip gradients or check that batch, or set nonfinite_loss='skip', which "
            "reads each loss before its step and skips the bad ones."
        )

    def _bad_loss(self, value: float, global_step: int, epoch: int, batch_idx: int) -> str:
        """Which loss was bad, and where: the start of both messages above."""
        strategy = self.trainer.strategy
        where = f" on rank {strategy.global_rank}" if strategy.world_size > 1 else ""
        return f"the training loss was {value}{where} at global step {global_step} (epoch {epoch}, batch {batch_idx})"

    def _terminate(self) -> None:
        trainer, progress = self.trainer, self.trainer.progress
        path = _last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        code = 128 + int(self.received)  # 143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP
        if trainer.is_global_zero:
            print(f"trainer: {self.received.name}: saved {path} at global step {progress.global_step} (epoch "
                  f"{progress.epoch}, {progress.epoch_batches} batches done); exiting with code {code}. "
                  "fit(ckpt_path='last') resumes from it.", file=sys.stderr, flush=True)
        raise Terminated(code)


class SignalAgreement:
    """Every AGREE_EVERY_S, a thread of each rank all-reduces the ranks' SIGTERM flags and step-boundary counts in a
    gloo group of its own, so the training thread runs no collective for it: at a step boundary it only counts
    and compares. Once some rank is signalled, all stop at the same boundary: the highest count in that exchange
    plus the most boundaries any rank proposed (AGREE_AHEAD_S at its pace). A rank whose count reaches its own
    proposal past an exchange that has not yet returned waits for it, so none can pass the agreed boundary unaware.
    """

    def __init__(self, signalled: Callable[[], bool], timeout_s: float) -> None:
        self.group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._signalled = signalled
        self._changed = threading.Condition()
        self._boundaries = 0
        self._in_flight: tuple[int, int, int] | None = None  # (count sent, exchange number, boundaries ahead proposed)
        self._exchanges = 0  # exchanges returned
        self.stop_at: int | None = None  # the boundary every rank stops at, once agreed
        self._ended = threading.Event()
        self._apart = False  # this rank leaves without the others (its fit failed): no more exchanges
        self._thread = threading.Thread(target=self._exchange_until_all_end, name="sigterm-agreement", daemon=True)
        self._thread.start()

    def at_boundary(self) -> bool:
        """Count a step boundary; True when every rank stops here."""
        with self._changed:
            self._boundaries += 1
            boundary, in_flight = self._boundaries, self._in_flight
            if in_flight is not None and boundary >= in_flight[0] + in_flight[2]:
                self._changed.wait_for(lambda: self._exchanges >= in_flight[1] or self._apart)
            return self.stop_at is not None and boundary >= self.stop_at

    def close(self, together: bool) -> None:
        """End the exchanges: `together` when every rank ends its fit here too; otherwise the next exchange tells
        the others that this rank leaves, and ends theirs."""
        self._apart = self._apart or not together
        self._ended.set()
        self._thread.join(timeout=None if together else 5 * AGREE_EVERY_S)
        if not self._thread.is_alive():
            torch.distributed.destroy_process_group(self.group)

    def _exchange_until_all_end(self) -> None:
        number, started, counted = 0, time.monotonic(), 0
        try:
            while True:
                self._ended.wait(AGREE_EVERY_S)
                number, now = number + 1, time.monotonic()
                with self._changed:
                    count = self._boundaries
                    pace = (count - counted) / max(now - started, 1e-9)  # boundaries a second, since the last exchange
                    ahead = min(MAX_AGREE_AHEAD, max(2, int(AGREE_AHEAD_S * pace)))
                    self._in_flight = (count, number, ahead)
                started, counted = now, count
                # The last value says a rank leaves without the others (its fit failed): all exchanges end.
                values = torch.tensor([float(self._signalled()), float(count), float(ahead),
                                       0.0 if self._ended.is_set() else 1.0, float(self._apart)])
                torch.distributed.all_reduce(values, torch.distributed.ReduceOp.MAX, group=self.group)
                signalled, highest, most_ahead, running, left = values.tolist()
                with self._changed:
                    if signalled > 0 and self.stop_at is None:
                        self.stop_at = int(highest) + int(most_ahead)
                    self._in_flight, self._exchanges, self._apart = None, number, self._apart or left > 0
                    self._changed.notify_all()
                if running == 0 or self._apart:
                    return
        except Exception:  # noqa: BLE001  (the group timed out or went: the fit is failing, and says why itself)
            with self._changed:
                self._apart = True
                self._in_flight = None
                self._changed.notify_all()


def reads_wait_for(device: torch.device) -> bool:
    """Whether reading a tensor of `device` on the host waits for the work queued on it (not for the CPU)."""
    return device.type != "cpu"


def _first_nonfinite(losses: list[torch.Tensor]) -> tuple[int, float] | None:
    """(index, value) of the first of `losses` that holds a NaN or inf, and that value; one host read when all
    are finite."""
    if len(losses) == 1 and losses[0].ndim == 0:
        # The usual window, one scalar loss: reading it is one host sync, like the check below, with
        # none of its kernel launches (they cost tens of microseconds a step on a CPU).
        value = losses[0].item()
        return None if math.isfinite(value) else (0, value)
    try:  # losses of one shape (scalars, as a rule): one stack, not a check per loss
        finite = torch.isfinite(torch.stack(losses)).reshape(len(losses), -1).all(1)
    except RuntimeError:  # losses of several shapes
        finite = torch.stack([torch.isfinite(loss).all() for loss in losses])
    if bool(finite.all()):
        return None
    index = finite.tolist().index(False)
    loss = losses[index].float().flatten()
    return index, loss[~torch.isfinite(loss)][0].item()


def _last_checkpoint_path(trainer: Trainer) -> Path:
    """Where a SIGTERM checkpoint goes: the ModelCheckpoint's last file, so `ckpt_path="last"` finds it."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath:
        return Path(callback.last_model_path or Path(callback.dirpath) / "last.ckpt")
    return Path(trainer.log_dir) / "checkpoints" / "last.ckpt"


# --------------------------------------------------------------------------- collective timeouts

_TIMEOUT_MARKERS = ("Timed out waiting", "Application timeout caused pair closure", "RPC ran for more than set timeout")
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
    "optimizer_step": "the push of gradients to the parameter servers",
    "setup_module": "the model's initial weight broadcast",
}


def is_collective_timeout(error: BaseException) -> bool:
    """True for gloo's collective timeout (and for a later call on the pair that timeout closed)."""
    text = str(error)
    if isinstance(error, torch.distributed.DistError) and "timeout" in text.lower():
        return True
    return isinstance(error, RuntimeError) and any(marker in text for marker in _TIMEOUT_MARKERS)


def raise_if_collective_timeout(error: BaseException, strategy: Strategy) -> None:
    """Re-raise a collective timeout as the report of where every rank is (trainer/diagnosis), or one line naming
    the operation that waited; otherwise do nothing."""
    if not is_collective_timeout(error) or isinstance(error, CollectiveTimeoutError):
        return
    waited = (f"rank {strategy.global_rank} waited more than {strategy.timeout:g} s in "
              f"{_waiting_call(error, strategy)}")
    report = strategy.hang_report(error)  # where every rank is, from the ranks' watchdogs (trainer/diagnosis)
    if report is None:
        raise CollectiveTimeoutError(
            f"{waited}; another rank is stuck or died before joining it (see its output). Raise "
            "Trainer(timeout=...) if a step legitimately takes longer.") from error
    raise CollectiveTimeoutError(
        f"{report}\n  ({waited}; raise Trainer(timeout=...) if a step legitimately takes longer.)") from error


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
