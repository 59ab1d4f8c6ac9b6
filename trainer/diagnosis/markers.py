"""Where a rank is: a progress marker the training thread keeps with attribute writes only, and the rank's position
read off its stack (the framework collective it waits in, or the innermost line of the user's code it runs).

The marker costs the training thread two attribute writes around each framework collective (no store round-trip,
no lock); the watchdog thread (watchdog.py) reads it and publishes the rank's position in the job's TCPStore only
once the rank has stood still for a while.
"""

from __future__ import annotations

import json
import linecache
import os
import socket
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

#: The framework's own code (trainer/ and callbacks/; the recipes folder holds models and data like a user's).
_FRAMEWORK_DIRS = tuple(os.path.realpath(path) + os.sep for path in (
    Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[2] / "callbacks"))
#: Frames in these folders are not the user's: the framework's, torch's, Python's standard library and installed
#: packages.
_NOT_USER_DIRS = _FRAMEWORK_DIRS + tuple(
    os.path.realpath(path) + os.sep
    for path in (Path(torch.__file__).parent, *(sysconfig.get_paths()[name] for name in ("stdlib", "purelib",
                                                                                         "platlib"))))
_TORCH_DISTRIBUTED_DIR = os.path.realpath(Path(torch.__file__).parent / "distributed") + os.sep
_USER_FILE: dict[str, bool] = {}  # filename -> whether it is the user's (realpath is a system call: once per file)
_FRAMEWORK_FILE: dict[str, bool] = {}  # filename -> whether it is the framework's


class Marker:
    """This rank's progress: how many framework collectives it entered, the one it is in now (if any) and what it is
    for, and the loop's progress object (read for the step number). Written by the training thread only."""

    __slots__ = ("count", "operation", "purpose", "progress", "agree")

    def __init__(self) -> None:
        self.count = 0  # framework collectives entered since set-up: the same sequence on every rank in lockstep
        self.operation: str | None = None  # the framework collective this rank is in now ("all_reduce"), or None
        self.purpose = ""  # what it is for ("gradients")
        self.progress: Any = None  # the loop's Progress (global_step, epoch_batches), once a stage runs
        #: diagnosis='debug': called as each framework collective begins, to agree on it with the other ranks.
        self.agree: Callable[[str, str], None] | None = None

    def enter(self, operation: str, purpose: str) -> None:
        """The training thread is about to wait in framework collective `operation`, for `purpose`."""
        self.count += 1
        self.operation, self.purpose = operation, purpose
        if self.agree is not None:
            self.agree(operation, purpose)

    def leave(self) -> None:
        self.operation = None

    def step(self) -> int | None:
        """The optimizer step the loop is at (steps taken so far), or None outside a stage."""
        progress = self.progress
        return None if progress is None else progress.global_step

    def state(self) -> tuple[Any, ...]:
        """What changes whenever this rank advances: compared by the watchdog, read without a lock."""
        progress = self.progress
        if progress is None:
            return (self.count, self.operation)
        return (self.count, self.operation, progress.batches_stepped, progress.epoch_batches, progress.epoch)


@dataclass
class Position:
    """Where one rank is, as the report and the store carry it."""

    rank: int
    host: str
    pid: int
    step: int | None  # the optimizer step it is at
    count: int  # framework collectives it entered
    operation: str | None  # the framework collective it waits in (None: not in one)
    purpose: str
    torch_call: str | None  # a torch.distributed function the user's code waits in (their own collective)
    in_user_code: bool  # its innermost frame of the user's or the framework's is the user's
    innermost: str  # its innermost frame: 'function at file:line'
    function: str | None  # the innermost user frame (in user code): its function, file, line and source line
    file: str | None
    line: int | None
    code: str | None
    still_since: float  # since when (time.time()) it has not advanced
    stack: str  # its whole stack, innermost last

    @property
    def in_collective(self) -> bool:
        return self.torch_call is not None or (self.operation is not None and not self.in_user_code)

    def collective(self) -> str:
        """'all_reduce #57 (gradients of step 5)', or the torch call a user's code waits in."""
        if self.operation is not None:
            step = f" of step {self.step}" if self.step is not None else ""
            return f"{self.operation} #{self.count} ({self.purpose}{step})"
        return f"torch.distributed's {self.torch_call}" + (" (called by the user's code)" if self.file else "")

    def user_line(self, short: bool = True) -> str:
        """'training_step at train.py:25 (time.sleep(600))', or '' when no user frame is on the stack."""
        if self.file is None:
            return ""
        name = os.path.basename(self.file) if short else self.file
        code = f" ({self.code})" if self.code else ""
        return f"{self.function} at {name}:{self.line}{code}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Position:
        return cls(**json.loads(data))


def is_user_file(filename: str) -> bool:
    """Whether a frame of `filename` is the user's code (not torch's, the framework's, the standard library's or an
    installed package's)."""
    known = _USER_FILE.get(filename)
    if known is None:
        real = os.path.realpath(filename)
        known = not filename.startswith("<") and not real.startswith(_NOT_USER_DIRS)
        _USER_FILE[filename] = known
    return known


def _is_framework_file(filename: str) -> bool:
    known = _FRAMEWORK_FILE.get(filename)
    if known is None:
        known = _FRAMEWORK_FILE[filename] = os.path.realpath(filename).startswith(_FRAMEWORK_DIRS)
    return known


def position_of(frames: list[FrameType], lines: list[int], marker: Marker, rank: int, still_since: float) -> Position:
    """This rank's position from its stack (`frames` outermost first, each at `lines`) and its marker.

    Where the innermost frame of the user's or the framework's code is the user's (a training_step, or a
    pipeline_loss the schedule called), the rank runs the user's code; a torch.distributed call inside it is the
    user's own collective. Otherwise it is in the framework, in the collective its marker names (if any)."""
    user = next((i for i in range(len(frames) - 1, -1, -1) if is_user_file(frames[i].f_code.co_filename)), -1)
    framework = next((i for i in range(len(frames) - 1, -1, -1)
                      if _is_framework_file(frames[i].f_code.co_filename)), -1)
    in_user_code = user > framework
    torch_call = None
    function = file = code = None
    line = None
    if in_user_code:
        frame, line = frames[user], lines[user]
        function, file = frame.f_code.co_name, frame.f_code.co_filename
        code = linecache.getline(file, line).strip() or None
        torch_call = next((f.f_code.co_name for f in reversed(frames[user:])
                           if os.path.realpath(f.f_code.co_filename).startswith(_TORCH_DISTRIBUTED_DIR)), None)
    innermost = (f"{frames[-1].f_code.co_name} at {os.path.basename(frames[-1].f_code.co_filename)}:{lines[-1]}"
                 if frames else "?")
    stack = "".join(traceback.format_list(
        [traceback.FrameSummary(f.f_code.co_filename, n, f.f_code.co_name) for f, n in zip(frames, lines)]))
    return Position(rank=rank, host=socket.gethostname(), pid=os.getpid(), step=marker.step(), count=marker.count,
                    operation=marker.operation, purpose=marker.purpose, torch_call=torch_call,
                    in_user_code=in_user_code, innermost=innermost, function=function, file=file, line=line, code=code,
                    still_since=still_since, stack=stack)


def live_frames(thread_id: int) -> tuple[list[FrameType], list[int]]:
    """The stack a thread runs now (outermost first), with each frame's current line."""
    frame = sys._current_frames().get(thread_id)  # documented in `sys`; faulthandler prints the same, to a file
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    return frames, [f.f_lineno or 0 for f in frames]


def traceback_frames(error: BaseException) -> tuple[list[FrameType], list[int]]:
    """The frames an exception passed through (outermost first), each at the line it raised from."""
    pairs = list(traceback.walk_tb(error.__traceback__))
    return [frame for frame, _ in pairs], [line for _, line in pairs]


def now() -> float:
    """The clock the watchdog measures stillness on: wall time, which the ranks' hosts share (to NTP's skew)."""
    return time.time()
