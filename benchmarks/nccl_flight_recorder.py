"""The stuck-job report's flight-recorder line (trainer/diagnosis/flight_recorder.py) on a real NCCL record.

One GPU cannot host two NCCL ranks, so the collective is held back on the device instead of by a missing rank: one
process, an NCCL group of one, a kernel that spins on the GPU for `--hold` seconds, then an all-reduce queued behind
it. While the GPU spins, the recorder's line must name that all-reduce as not completed, issued about as long ago as
the host has waited; once it ran, as completed. Prints both lines and exits 1 if either state is not what NCCL
should record (the gloo tests cannot check this: gloo records neither start nor completion).

    python benchmarks/nccl_flight_recorder.py [--hold 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from torchyard.trainer.diagnosis import flight_recorder


def spin(seconds: float) -> None:
    """Queue a kernel that keeps the current stream busy for about `seconds` (its cycle rate timed first)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10**8
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    torch.cuda._sleep(int(seconds * cycles / (start.elapsed_time(end) / 1e3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, default=3.0, help="seconds the GPU spins before the all-reduce")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    flight_recorder.enable()
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # NCCL then records 'started' as well as 'completed'
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    values = torch.ones(2, 5, device="cuda")
    dist.all_reduce(values)
    torch.cuda.synchronize()
    spin(args.hold)
    work = dist.all_reduce(values, async_op=True)
    waited = args.hold / 2
    time.sleep(waited)
    held = flight_recorder.describe(flight_recorder.entries(), 0)
    print(f"while the GPU spins ({waited:.1f} s after the all-reduce was issued):\n  {held}", flush=True)
    if held is None:
        import torch._C._distributed_c10d as c10d

        print(f"  (no entries; this build's dumps: {[name for name in dir(c10d) if name.startswith('_dump')]})")
    work.wait()
    torch.cuda.synchronize()
    done = flight_recorder.describe(flight_recorder.entries(), 0)
    print(f"after it ran:\n  {done}", flush=True)
    dist.destroy_process_group()
    held_ok = held is not None and "nccl:all_reduce #2" in held and ", completed" not in held
    done_ok = done is not None and "nccl:all_reduce #2" in done and ", completed" in done
    verdict = {True: "as expected", False: "UNEXPECTED"}
    print(f"held back: {verdict[held_ok]}; after: {verdict[done_ok]}")
    sys.exit(0 if held_ok and done_ok else 1)


if __name__ == "__main__":
    main()
