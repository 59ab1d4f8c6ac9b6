"""Local SGD (ddp with sync_every=H) against ordinary ddp: the communication it saves per step.

    python benchmarks/local_sgd.py [RECIPE [key=value ...]] [--sync-every 8] [--rounds 3] [--steps 48]

Both run as `trainer scale` runs on 2 processes (1x2), alternating round by round so drift in the machine's load hits
both alike. Per step: the communication `trainer scale` reports (ddp: the wait for the gradient all-reduce; local
SGD: the parameter averaging every H steps, and nothing in between) and, independently, the step times. Prints the
medians over the rounds, the communication saved per step and the step-time difference.
Default: digits with a wider hidden layer (model.init_args.hidden=2048), so the all-reduce is a visible share.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from torchyard.trainer.scaling.study import plan_study, run_layout

DEFAULT_SOURCES = ["recipes/digits.yaml", "model.init_args.hidden=2048"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="*", default=DEFAULT_SOURCES)
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    variants = f"ddp,ddp:sync_every={args.sync_every}"
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as root:
        plan = plan_study([*args.sources, f"trainer.default_root_dir={root}"], "2", "1", variants, args.steps, None,
                          None, 5, 600)
        layouts = [layout for layout in plan.layouts if layout.variant is not None]
        for round_index in range(args.rounds):
            plan.root = plan.root.parent / f"round{round_index}"
            for layout in layouts if round_index % 2 == 0 else layouts[::-1]:
                row = run_layout(plan, layout)
                if row.error:
                    raise SystemExit(f"{layout.label} failed: {row.error}")
                result = results.setdefault(layout.label, {"comm": [], "step": [], "samples": []})
                result["comm"].append(row.communication_ms)
                result["step"].append(row.step_ms)
                result["samples"].append(row.samples_per_s)
                print(f"round {round_index}: {layout.label}: step {row.step_ms:.2f} ms, communication "
                      f"{row.communication_ms:.2f} ms, {row.samples_per_s:,.0f} samples/s")
    (ddp, ddp_r), (local, local_r) = ((label, {k: statistics.median(v) for k, v in r.items()})
                                      for label, r in results.items())
    print(f"{ddp}: communication {ddp_r['comm']:.2f} ms/step, step {ddp_r['step']:.2f} ms, "
          f"{ddp_r['samples']:,.0f} samples/s")
    print(f"{local}: communication {local_r['comm']:.2f} ms/step, step {local_r['step']:.2f} ms, "
          f"{local_r['samples']:,.0f} samples/s")
    print(f"communication saved per step: {ddp_r['comm'] - local_r['comm']:.2f} ms "
          f"({100 * (1 - local_r['comm'] / ddp_r['comm']):.0f}%); step time saved "
          f"{ddp_r['step'] - local_r['step']:.2f} ms; throughput x{local_r['samples'] / ddp_r['samples']:.2f}")


if __name__ == "__main__":
    main()
