"""What compiling a stage cost and where its graphs broke, read from torch's dynamo counters, its compilation metrics
and its graph-break log; and the folder that keeps compiled artifacts for the next start.

torch.compile compiles lazily, at a part's first call: the first step pays for it. A CompileRecord starts when the
strategy compiles the module and is read once after the first step (the report) and at the fit's end (the run
summary). Nothing here runs per step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

#: dynamo logs each graph break, with the user's file and line, to this logger (torch._logging's "graph_breaks"
#: artifact) at DEBUG, and nowhere unless asked; its counters keep only the reasons.
_BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
_BREAK = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)\s*\nGraph Break Reason: (?P<reason>.*)", re.DOTALL)
_COMPILE_ID = re.compile(r"(\d+)/(\d+)")
#: inductor's cache folder (FX graphs, AOTAutograd graphs, compiled kernels), which it reads at each compile.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
#: The file of the function every compiled forward traces from (regions.CompiledForward).
_COMPILED_FORWARD_FILE = str(Path(__file__).with_name("regions.py"))
COLD_FILE = "first_step.json"  # in the cache folder: the cold start's time to first step, to compare warm ones with


def short_reason(text: str) -> str:
    """dynamo's explanation of a graph break, on one line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in lines:
        if line.startswith("Explanation:"):
            return line[len("Explanation:"):].strip()
    return lines[0] if lines else "no reason given"


def graph_break_message(error: BaseException) -> str | None:
    """One line naming where (file:line) and why a fullgraph compile broke; None for another error."""
    from torch._dynamo.exc import Unsupported

    if not isinstance(error, Unsupported):
        return None
    stack = getattr(error, "real_stack", None) or []
    where = f"{stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else "a place dynamo did not say"
    return (f"compile fullgraph=True: the graph breaks at {where}: {short_reason(str(error))}; make that line "
            "traceable, or set compile fullgraph: false to run the model in compiled pieces.")


class _BreakLog(logging.Handler):
    """Keeps each graph break dynamo logs as {"file:line": reason}."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.breaks: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = _BREAK.search(record.getMessage())
        if match is not None:
            self.breaks.setdefault(f"{match['file']}:{match['line']}", short_reason(match["reason"]))


class CompileRecord:
    """One stage's compile: what was compiled, the time to its first step (cold or warm from the cache), graph
    breaks with where and why, and recompilations."""

    def __init__(self, compiled: list[str], backend: str, cache_dir: Path | None, reports: bool) -> None:
        from torch._dynamo.utils import counters, get_compilation_metrics

        self.compiled, self.backend, self.cache_dir, self.reports = compiled, backend, cache_dir, reports
        self.started = time.perf_counter()
        self.first_step_seconds: float | None = None
        self._counters_before = {group: dict(values) for group, values in counters.items()}
        self._metrics_before = {id(metrics) for metrics in get_compilation_metrics()}
        self._log: _BreakLog | None = _BreakLog()
        self._breaks: dict[str, str] = {}  # the log's, once closed (the record then pickles with the trainer)
        logger = logging.getLogger(_BREAK_LOGGER)
        self._level, self._propagate = logger.level, logger.propagate
        logger.setLevel(logging.DEBUG)  # dynamo writes a break's file and line only where this level is on
        logger.propagate = False  # to this record alone, not to torch's console handler
        logger.addHandler(self._log)
        self._cache_env = os.environ.get(CACHE_ENV)
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)
            os.environ[CACHE_ENV] = str(cache_dir)  # where torch reads it; restored by close()

    def close(self) -> None:
        """Stop listening to dynamo's log and give the process its cache setting back."""
        if self._log is None:
            return
        logger = logging.getLogger(_BREAK_LOGGER)
        logger.removeHandler(self._log)
        self._breaks, self._log = dict(self._log.breaks), None
        logger.setLevel(self._level)
        logger.propagate = self._propagate
        if self._cache_env is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = self._cache_env

    # ------------------------------------------------------------------ counts since the record started
    def _count(self, group: str, key: str | None = None) -> int:
        from torch._dynamo.utils import counters

        now, before = counters.get(group, {}), self._counters_before.get(group, {})
        if key is None:
            return sum(now.values()) - sum(before.values())
        return now.get(key, 0) - before.get(key, 0)

    @property
    def graph_breaks(self) -> dict[str, str]:
        """{"file:line": why} of each graph break seen (where dynamo logged one)."""
        return dict(self._log.breaks) if self._log is not None else dict(self._breaks)

    @property
    def graph_break_count(self) -> int:
        """Graph breaks counted by dynamo (each break once per compile of its frame)."""
        return max(self._count("graph_break"), len(self.graph_breaks))

    def recompiles(self) -> list[str]:
        """One line per recompilation of an already compiled frame: which function, where, and the guard that
        failed."""
        from torch._dynamo.utils import get_compilation_metrics

        found = []
        for metrics in get_compilation_metrics():
            match = _COMPILE_ID.search(str(metrics.compile_id or ""))
            if id(metrics) in self._metrics_before or match is None or match.group(2) == "0" or not metrics.co_name:
                continue
            reason = " ".join(short_reason(str(getattr(metrics, "recompile_reason", None) or "a guard failed")).split())
            reason = reason if len(reason) <= 120 else reason[:117] + "..."
            where = (f"{metrics.co_name} (compiled)" if metrics.co_filename == _COMPILED_FORWARD_FILE
                     else f"{metrics.co_name} ({metrics.co_filename}:{metrics.co_firstlineno})")
            found.append(f"{where}: {reason}")
        return found

    def cache_counts(self) -> tuple[int, int]:
        """(graphs inductor took from its cache, graphs it compiled) since the record started."""
        return self._count("inductor", "fxgraph_cache_hit"), self._count("inductor", "fxgraph_cache_miss")

    # ------------------------------------------------------------------ the reports
    def first_step(self) -> None:
        """The first optimizer step has run: note the time to it, and (rank 0, a cold start) keep it in the cache
        folder for the warm starts to compare with."""
        self.first_step_seconds = time.perf_counter() - self.started
        hits, misses = self.cache_counts()
        if self.reports and self.cache_dir is not None and misses and not hits:
            (self.cache_dir / COLD_FILE).write_text(json.dumps({"cold_seconds": self.first_step_seconds}))

    def start_kind(self) -> str:
        """'cold', 'warm', 'partly warm' or 'uncached' (a backend without inductor's cache)."""
        hits, misses = self.cache_counts()
        if not hits and not misses:
            return "uncached"
        return "warm" if hits and not misses else "cold" if misses and not hits else "partly warm"

    def first_step_text(self) -> str:
        """The time to the first step, cold or warm, against the cold start's where one was kept."""
        if self.first_step_seconds is None:
            return "-"
        hits, misses = self.cache_counts()
        text = f"{self.first_step_seconds:.1f} s, {self.start_kind()} ({hits} graphs from the cache, {misses} compiled)"
        cold = self._cold_seconds()
        if cold and self.start_kind() in ("warm", "partly warm"):
            text += f"; the cold start took {cold:.1f} s ({self.first_step_seconds / cold:.2f}x)"
        return text

    def _cold_seconds(self) -> float | None:
        try:
            return float(json.loads((self.cache_dir / COLD_FILE).read_text())["cold_seconds"])  # type: ignore[operator]
        except (OSError, TypeError, ValueError, KeyError):
            return None

    def report_lines(self) -> list[str]:
        """What the first step's report prints: what was compiled, the time to the first step, each graph break
        with where and why, each recompilation."""
        what = ", ".join(self.compiled) if len(self.compiled) <= 4 else f"{len(self.compiled)} regions"
        lines = [f"compile: {what} with {self.backend}; first step after {self.first_step_text()}"]
        breaks = self.graph_breaks
        if self.graph_break_count:
            lines.append(f"compile: graphs break at {len(breaks)} place(s) ({self.graph_break_count} breaks counted "
                         "over the compiles); each splits the compiled code in two:")
            lines += [f"  {where}: {why}" for where, why in breaks.items()]
        recompiles = self.recompiles()
        if recompiles:
            lines.append(f"compile: {len(recompiles)} recompilation(s):")
            lines += [f"  {line}" for line in recompiles]
        return lines

    def summary_rows(self) -> dict[str, Any]:
        """The run summary's compile rows."""
        breaks = self.graph_breaks
        where = "; ".join(f"{place}: {why}" for place, why in list(breaks.items())[:3])
        return {"compile": f"{len(self.compiled)} part(s) with {self.backend}",
                "compile: time to first step": self.first_step_text(),
                "compile: graph breaks": f"{self.graph_break_count}" + (f" ({where})" if where else ""),
                "compile: recompilations": len(self.recompiles())}
