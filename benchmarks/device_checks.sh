#!/usr/bin/env bash
# The GPU checks, for a session that is lent a GPU machine: one run, each part under its own time limit, each part's
# output in its own file under $OUT. That machine's image has torch, pytest and the rest of our dependencies but
# omegaconf, which travels as a wheel: `make device-wheels` here, then, on the device (the repository's root):
#     bash benchmarks/device_checks.sh [PART ...]          (carry: .whl; no PART: all of them)
# Parts, in the order of what a lent GPU alone can show:
#   plan.log    the plan's peak against torch.cuda.max_memory_allocated, single and fsdp (tests/test_plan.py)
#   tests.log   every other test that is skipped without CUDA (test_cuda.py; the dp2 x tp2 file resumed on one GPU;
#               fsdp's bf16, cpu offload and sync batchnorm; the evaluator and `trainer scale` on a GPU)
#   nccl_flight_recorder.log   the stuck-job report's flight-recorder line on a real NCCL record
#   compile.log  compiled against eager step time on the charlm recipe, and the warm start, on cuda
#   overhead_cuda.log  the Trainer's step against a hand-written GPU loop (interleaved blocks)
set -u
OUT=${OUT:-/tmp/device_checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels (make device-wheels) did not install"; exit 1; }
mkdir -p /tmp/pkg/torchyard
for folder in trainer callbacks recipes; do ln -sfn "$PWD/$folder" "/tmp/pkg/torchyard/$folder"; done
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD/benchmarks PYTHONUNBUFFERED=1

PARTS=" ${*:-plan tests nccl_flight_recorder compile overhead_cuda} "
part() {  # part NAME SECONDS COMMAND...: run COMMAND under a time limit into $OUT/NAME.log; say how it ended
    local name=$1 seconds=$2 started=$SECONDS
    shift 2
    [[ $PARTS == *" $name "* ]] || return 0
    timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - started)) s (limit $seconds s)" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
  nproc; } >"$OUT/summary.txt" 2>&1
part plan 60 python3 -m pytest -q -s -p no:cacheprovider -k cuda tests/test_plan.py  # -s: prints the figures
part tests 200 python3 -m pytest -q -rs -p no:cacheprovider -k "cuda or gpu" tests/test_cuda.py \
    tests/test_scale.py tests/test_evaluator.py tests/test_lightning_loop.py tests/strategies/test_fsdp.py \
    tests/strategies/test_tensor_parallel.py
part nccl_flight_recorder 45 python3 benchmarks/nccl_flight_recorder.py
part compile 150 python3 benchmarks/compile.py --accelerator cuda --steps 40
part overhead_cuda 90 python3 benchmarks/overhead_cuda.py --runs 1 --epochs 2
tail -n 4 "$OUT"/*.log
