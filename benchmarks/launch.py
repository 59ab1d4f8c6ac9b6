"""Launch to first training step: `python train.py` with Trainer(strategy="ddp", devices=2) against `torchrun
--nproc-per-node=2` running the hand-written DDP script, both training the same model on the same data.

    python benchmarks/launch.py [--invocations 6] [--unguarded] [--cold]
    python benchmarks/launch.py --single [--invocations 6]

Each invocation is a fresh command (every import is paid, as a user pays it), timed from just before the command
starts to the end of rank 0's first optimizer step (both ranks took part: its all-reduce). The sides alternate,
each going first in every other round, so drift in the machine's load hits both alike. Prints each side's median
and spread (min-max) in seconds and its ratio to torchrun's median (target <= 1.0). `--unguarded` also times the
Trainer script without its main guard (Lightning's launch: rank 1 re-runs the command line); `--cold` also the
guarded script with workers spawned as fresh interpreters (the launch before trainer/launch/warm_start.py).

`--single`: one process instead, `python hand_single.py` (a plain loop) against `python train_single.py` (the
Trainer on its defaults: progress bar, model summary, CSV logger, checkpointing), timed the same way; prints the
difference of the medians (target: hand-written + 0.3 s at most).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = '''
import sys, time
from pathlib import Path
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

OUT = sys.argv[1]


def make_net():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_data():
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 256, generator=generator), torch.randint(0, 10, (512,), generator=generator))


def first_step_done():
    Path(OUT, "first_step").write_text(repr(time.time()))
'''

HAND_WRITTEN = COMMON + '''
import torch.distributed as dist
from torch.utils.data import DistributedSampler

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(make_net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
data = make_data()
sampler = DistributedSampler(data, shuffle=True, seed=0)
for step, (x, y) in enumerate(DataLoader(data, batch_size=64, sampler=sampler)):
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    if step == 0 and dist.get_rank() == 0:
        first_step_done()
del model
dist.destroy_process_group()
'''

TRAINER = COMMON + '''
from torchyard.callbacks import Callback
from torchyard.trainer import Trainer, TrainModule


class Classifier(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class FirstStep(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 1 and trainer.is_global_zero:
            first_step_done()


def main():
    torch.manual_seed(0)
    trainer = Trainer(TRAINER_ARGUMENTS, default_root_dir=OUT, callbacks=[FirstStep()])
    trainer.fit(Classifier(), DataLoader(make_data(), batch_size=64, shuffle=True))
'''


HAND_WRITTEN_SINGLE = COMMON + '''
torch.manual_seed(0)
model = make_net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step, (x, y) in enumerate(DataLoader(make_data(), batch_size=64, shuffle=True)):
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    if step == 0:
        first_step_done()
'''

DDP_ARGUMENTS = ('strategy="ddp", devices=2, accelerator="cpu", max_epochs=1, logger=False, '
                 'enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False')
SINGLE_ARGUMENTS = 'accelerator="cpu", max_epochs=1'  # the defaults: bar, summary, logger, checkpoints


def time_command(command: list[str]) -> float:
    """Seconds from the command's start to rank 0's first step."""
    with tempfile.TemporaryDirectory() as out:
        start = time.time()
        done = subprocess.run([*command, out], capture_output=True, text=True)
        stamp = Path(out, "first_step")
        # Only a failure before the first step spoils the figure (gloo now and then aborts a process at exit).
        if not stamp.exists():
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        if done.returncode != 0:
            print(f"(after its first step, {' '.join(command[-2:])} exited with code {done.returncode})")
        return float(stamp.read_text()) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--invocations", type=int, default=6)
    parser.add_argument("--unguarded", action="store_true")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--single", action="store_true", help="one process: a plain loop against the Trainer")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    ddp = TRAINER.replace("TRAINER_ARGUMENTS", DDP_ARGUMENTS)
    guarded = ddp + '\nif __name__ == "__main__":\n    main()\n'
    no_forkserver = "import torchyard.trainer.launch.warm_start as warm_start\nwarm_start.available = lambda: False\n"
    scripts = {"hand.py": HAND_WRITTEN, "train.py": guarded, "unguarded.py": ddp + "\nmain()\n",
               "cold.py": no_forkserver + guarded, "hand_single.py": HAND_WRITTEN_SINGLE,
               "train_single.py": TRAINER.replace("TRAINER_ARGUMENTS", SINGLE_ARGUMENTS) + "\nmain()\n"}
    for name, text in scripts.items():
        (folder / name).write_text(text)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    if args.single:
        sides = {name: [sys.executable, str(folder / name)] for name in ("hand_single.py", "train_single.py")}
    else:
        sides = {"torchrun hand.py": [*torchrun, str(folder / "hand.py")],
                 "python train.py": [sys.executable, str(folder / "train.py")]}
    if args.unguarded:
        sides["python unguarded.py"] = [sys.executable, str(folder / "unguarded.py")]
    if args.cold:
        sides["python cold.py"] = [sys.executable, str(folder / "cold.py")]
    os.environ.pop("OMP_NUM_THREADS", None)  # each launcher sets its own
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.invocations):
        for name in list(sides) if round_index % 2 == 0 else list(reversed(sides)):
            times[name].append(time_command(sides[name]))
    reference_name = next(iter(sides))
    reference = statistics.median(times[reference_name])
    layout = "one process" if args.single else "2-process ddp (gloo)"
    print(f"launch to first training step, {layout}, {args.invocations} invocations each, interleaved")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:22s} median {median:6.2f} s  spread {min(values):6.2f}-{max(values):6.2f} s  "
              f"ratio {median / reference:5.3f}  {median - reference:+.2f} s")
    if args.single:
        print(f"Trainer over the plain loop: {statistics.median(times['train_single.py']) - reference:+.2f} s "
              "(target +0.3 s at most)")


if __name__ == "__main__":
    main()
