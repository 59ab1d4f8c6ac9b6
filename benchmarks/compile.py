"""`compile` on the charlm recipe: time to the first step cold vs warm, and the steady step time compiled vs eager.

Warm start: `trainer fit recipes/charlm.yaml trainer.compile=true` twice, each in a fresh process, in one run
folder: the first compiles into the run's cache (`<root>/charlm/compile_cache`, empty at the start), the second is
"the next run of the same recipe" and takes its graphs from it. The time to the first step is the one the Trainer
reports (CompileReport: from the strategy's compile to the end of the first optimizer step, the sanity validation's
compile included). Printed: both times and warm / cold (target <= 0.3). With `--restart`: a 2-process ddp fit of the
same recipe with max_restarts=1 whose rank 1 is killed (SIGKILL) after its third step on the first attempt; the
restarted ranks report their own time to first step (their graphs from the cache the first attempt filled).

Steady step time: in this process, the recipe's CharLM and CharData, `--steps` optimizer steps after `--warmup` ones,
four ways: the Trainer eager and compiled, and a hand-written torch loop (AdamW, the recipe's clipping) eager and
on torch.compile(model). A step's time is the median interval between the starts of consecutive steps, in wall time and
in the main thread's CPU time (one intra-op thread: all the work runs on it; on a shared machine read the CPU time,
which does not count the moments other processes hold the cores). Printed: ms per step of each, compiled / eager for
the Trainer and for the hand loop, and the Trainer's compiled step / the hand loop's compiled step.
`--accelerator cuda` runs the fits and the steady steps on the GPU (the hand loop moves its model and batches there;
every step start, on both sides, waits for the GPU first); `--restart` stays on the CPU (it needs two devices).

    python benchmarks/compile.py [--steps 40] [--warmup 5] [--restart] [--skip-warm] [--skip-steady] [--cache-dir D]
                                 [--accelerator cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchyard.callbacks import Callback
from torchyard.trainer import Trainer
from torchyard.trainer.cli.recipe import load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "charlm.yaml"
FIRST_STEP = re.compile(r"compile: .* first step after (?P<seconds>[\d.]+) s, (?P<kind>[a-z ]+) \(")
SHORT = ["trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
         "trainer.enable_progress_bar=false", "trainer.compile=true"]


def first_steps(command: list[str]) -> list[tuple[float, str]]:
    """Run `command`; the (seconds, cold/warm) of each time-to-first-step report it printed."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = [(float(m["seconds"]), m["kind"]) for m in FIRST_STEP.finditer(done.stdout)]
    if done.returncode != 0 or not found:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return found


def warm_start(root: Path, accelerator: str) -> None:
    fit = [sys.executable, "-m", "torchyard.trainer", "fit", str(RECIPE), f"trainer.default_root_dir={root}", *SHORT,
           f"trainer.accelerator={accelerator}"]
    (cold, cold_kind), = first_steps(fit)
    (warm, warm_kind), = first_steps(fit)
    print(f"time to first step, charlm, inductor: cold {cold:.1f} s ({cold_kind}), next run {warm:.1f} s "
          f"({warm_kind}): warm / cold = {warm / cold:.2f} (target <= 0.3)", flush=True)


def restart(root: Path) -> None:
    """ddp on 2 processes, max_restarts=1, rank 1 killed with SIGKILL after step 3 of the first attempt."""
    kill = ("import os, signal\nfrom torchyard.callbacks import Callback\n"
            "class KillOnce(Callback):\n"
            "    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):\n"
            "        if trainer.global_rank == 1 and trainer.global_step == 3 and "
            "os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0':\n"
            "            os.kill(os.getpid(), signal.SIGKILL)\n")
    root.mkdir(parents=True, exist_ok=True)
    (root / "kill_once.py").write_text(kill)
    command = [sys.executable, "-m", "torchyard.trainer", "fit", str(RECIPE), f"trainer.default_root_dir={root}",
               "trainer.strategy=ddp", "trainer.devices=2", "trainer.max_restarts=1", "trainer.max_steps=6",
               "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false",
               "trainer.compile=true", "callbacks+={class_path: kill_once.KillOnce}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=root)
    found = [(float(m["seconds"]), m["kind"]) for m in FIRST_STEP.finditer(done.stdout)]
    if done.returncode != 0 or len(found) < 2:
        print(f"restart run: exit {done.returncode}, reports {found}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return
    (cold, cold_kind), (warm, warm_kind) = found[0], found[-1]
    print(f"time to first step, ddp x2 killed and restarted: first attempt {cold:.1f} s ({cold_kind}), after the "
          f"restart {warm:.1f} s ({warm_kind}): restart / first = {warm / cold:.2f}", flush=True)


class StepStarts(Callback):
    """The time each training step starts: (wall clock, this thread's CPU time)."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.starts.append(step_start())


def step_start() -> tuple[float, float]:
    """Now, in wall and this thread's CPU time, once the GPU (if any) finished the work queued before."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter(), time.thread_time()


def median_step(starts: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    """The median step, in wall time and in this thread's CPU time (with one intra-op thread all the work runs on
    it; on a shared machine the wall clock also counts the time other processes held the CPU)."""
    pairs = list(zip(starts[warmup:], starts[warmup + 1:]))
    return (statistics.median(b[0] - a[0] for a, b in pairs), statistics.median(b[1] - a[1] for a, b in pairs))


def trainer_step(root: Path, compile_option: bool | dict, steps: int, warmup: int,
                 accelerator: str) -> tuple[float, float]:
    recipe = load_recipe([RECIPE])
    torch.manual_seed(0)
    module, data = recipe.model.instantiate(), recipe.data.instantiate()
    timer = StepStarts()
    trainer = Trainer(max_steps=warmup + steps + 1, num_sanity_val_steps=0, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      gradient_clip_val=1.0, compile=compile_option, default_root_dir=str(root), callbacks=[timer],
                      accelerator=accelerator)
    trainer.fit(module, datamodule=data)
    return median_step(timer.starts, warmup)


def hand_step(compiled: bool, steps: int, warmup: int, accelerator: str) -> tuple[float, float]:
    recipe = load_recipe([RECIPE])
    torch.manual_seed(0)
    module, data = recipe.model.instantiate(), recipe.data.instantiate()
    module.to(accelerator)
    data.setup("fit")
    model = torch.compile(module) if compiled else module
    optimizer = module.configure_optimizers()
    optimizer = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    starts: list[tuple[float, float]] = []
    for step, (tokens, targets) in enumerate(data.train_dataloader()):
        if step > warmup + steps:
            break
        starts.append(step_start())
        tokens, targets = tokens.to(accelerator, non_blocking=True), targets.to(accelerator, non_blocking=True)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
    return median_step(starts, warmup)


def steady(root: Path, steps: int, warmup: int, cache: Path, accelerator: str) -> None:
    """Both compiled sides take inductor's cache from `cache` (the warm-start runs', where they ran first)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # the hand loop's torch.compile; the Trainer's is its option
    times = {"Trainer eager": trainer_step(root, False, steps, warmup, accelerator),
             "Trainer compiled": trainer_step(root, {"cache_dir": str(cache)}, steps, warmup, accelerator),
             "hand loop eager": hand_step(False, steps, warmup, accelerator),
             "hand loop compiled": hand_step(True, steps, warmup, accelerator)}
    for name, (wall, cpu) in times.items():
        print(f"{name:20s} {wall * 1e3:8.2f} ms/step wall, {cpu * 1e3:8.2f} ms/step CPU", flush=True)
    for clock, which in (("wall", 0), ("CPU", 1)):
        ratio = {name: value[which] for name, value in times.items()}
        print(f"{clock}: compiled / eager: Trainer {ratio['Trainer compiled'] / ratio['Trainer eager']:.2f}, hand "
              f"loop {ratio['hand loop compiled'] / ratio['hand loop eager']:.2f}; Trainer compiled / hand loop "
              f"compiled {ratio['Trainer compiled'] / ratio['hand loop compiled']:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--restart", action="store_true", help="also a kill -9 + max_restarts=1 ddp restart")
    parser.add_argument("--skip-warm", action="store_true")
    parser.add_argument("--skip-steady", action="store_true")
    parser.add_argument("--cache-dir", help="inductor's cache for the steady runs (default: the warm-start runs')")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        if not args.skip_warm:
            warm_start(root / "runs", args.accelerator)
        if args.restart:
            restart(root / "restart")
        if not args.skip_steady:
            cache = Path(args.cache_dir) if args.cache_dir else root / "runs" / "charlm" / "compile_cache"
            steady(root / "steady", args.steps, args.warmup, cache.absolute(), args.accelerator)


if __name__ == "__main__":
    main()
