"""Is the communication time `trainer scale` reports right? Checked against an independent measurement.

    python benchmarks/scale_communication.py [RECIPE [key=value ...]] [--rounds 3] [--steps 40] [--processes 2]

`trainer scale` times the wait for the gradient all-reduce inside DDP's communication hook (trainer/strategies/
comm_timing.py). The independent measurement runs the same layout with comm_hook='noop' (no all-reduce at all) and
takes the difference of the mean step times. The two variants alternate, round by round, so drift in the machine's
load hits both alike; medians over the rounds are printed with their ratio (target: within 25%).
Default: digits with a wider hidden layer (model.init_args.hidden=2048), so the all-reduce is a visible share.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from rich.console import Console

from torchyard.trainer.scale import plan_study, run_layout

DEFAULT_SOURCES = ["recipes/digits.yaml", "model.init_args.hidden=2048"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", default=DEFAULT_SOURCES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        plan = plan_study([*args.sources, f"trainer.default_root_dir={root}"], str(args.processes), "1",
                          "ddp,ddp:comm_hook=noop", args.steps, None, None, 5, 600)
        plan.root.mkdir(parents=True)
        ddp_layout, noop_layout = [layout for layout in plan.layouts if layout.variant is not None]
        reported, ddp_steps, noop_steps = [], [], []
        for round_index in range(args.rounds):
            order = [ddp_layout, noop_layout] if round_index % 2 == 0 else [noop_layout, ddp_layout]
            for layout in order:
                plan.root = plan.root.parent / f"round{round_index}"
                row = run_layout(plan, layout)
                if row.error:
                    raise SystemExit(f"{layout.label} failed: {row.error}")
                if layout is ddp_layout:
                    reported.append(row.communication_ms)
                    ddp_steps.append(row.step_ms - row.data_ms)
                else:
                    noop_steps.append(row.step_ms - row.data_ms)
                print(f"round {round_index}: {layout.label}: step {row.step_ms - row.data_ms:.2f} ms, "
                      f"communication reported {row.communication_ms:.2f} ms")
    measured = statistics.median(d - n for d, n in zip(ddp_steps, noop_steps))
    median_reported = statistics.median(reported)
    Console().print(
        f"{args.processes} processes, {' '.join(args.sources)}: communication per step reported by trainer scale "
        f"{median_reported:.2f} ms; step time with all-reduce - without (noop hook) {measured:.2f} ms; "
        f"ratio {median_reported / measured:.2f} (target 0.75-1.25)")


if __name__ == "__main__":
    main()
