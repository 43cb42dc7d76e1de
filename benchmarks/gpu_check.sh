#!/usr/bin/env bash
# One-shot GPU check of the codec kernels (issue 3). Made for an H200 with a 15-minute budget:
# at most ~7 minutes (every step has a timeout), every result written as it comes.
#
#   OUT=/path/to/results bash benchmarks/gpu_check.sh        # from the repository root
#
# Steps (outputs under $OUT):
#   env.txt                  GPU, driver, torch/CUDA/NCCL/triton versions, the git commit, the
#                            host's CPU and load (every figure of this run cites it)
#   bench_cuda.txt / .csv    codec throughput on CUDA, 1 GB fp32, bits 1-8, Triton and the torch
#                            reference, beside copy/clone; int4 launch-shape sweep; full-size
#                            bit-exactness of Triton against the reference (--verify)
#                            (target: int4 encode >= 3 TB/s of fp32 input; H200 copy ~4.3 TB/s)
#   tests_cuda.txt           tests/kernels with the tensors on the GPU (FASTML_TEST_DEVICE=cuda) and
#                            Triton compiled for real (TRITON_INTERPRET=0): bit-exact against the
#                            CPU reference; about 220 kernel compilations, ~0.5 s each; includes
#                            tests/kernels/test_segment_table.py (one launch per stage, issue 10)
#   sync_free.txt / sync_free.json
#                            whole DDP training steps (int4, topk1, a mixed plan; one rank, NCCL)
#                            under torch.cuda.set_sync_debug_mode("error"), host reads per step
#                            counted (issue 10, item 4: expect [1, 1, ...] and no error)
#   summary.txt              exit codes and the lines that matter
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}   # the device image has python3, not always python
export TRITON_INTERPRET=0 FASTML_TEST_DEVICE=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/fastml-triton-cache}"   # not under $OUT: no cache comes back
export FASTML_CACHE_DIR="${FASTML_CACHE_DIR:-/tmp/fastml-cache}"
T0=$(date +%s)

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  # FASTML_COMMIT: for a copy of the tree without .git (say it in the command that starts this script)
  echo "commit ${FASTML_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}$(git diff --quiet 2>/dev/null || echo ' (uncommitted changes or no git)')"
  echo "host $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $(uptime)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  "$PY" - <<'EOF'
import torch, triton, platform
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", nccl, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
EOF
} > "$OUT/env.txt" 2>&1

# 1. Benchmark (the figures the issue asks for), with the launch-shape sweep and a full-size check.
timeout 90 "$PY" benchmarks/bench_codecs.py --device cuda --size-mb 1024 --reps 20 --budget-s 1 \
    --backends triton,torch --sweep --verify --csv "$OUT/bench_codecs_cuda.csv" \
    > "$OUT/bench_cuda.txt" 2>&1
BENCH_RC=$?

# 2. Kernel tests on the GPU (compiles ~220 kernel variants; the runtime itself is seconds).
timeout 170 "$PY" -m pytest tests/kernels -q -rfE -p no:cacheprovider --durations=5 \
    > "$OUT/tests_cuda.txt" 2>&1
TEST_RC=$?

# 3. End to end: the hook on CUDA/NCCL (one GPU, so one rank), DDP vs FastML recipes, 25.2M MLP.
timeout 90 "$PY" -m torch.distributed.run --nproc_per_node 1 benchmarks/gpu_e2e.py \
    --csv "$OUT/gpu_e2e.csv" > "$OUT/e2e.txt" 2>&1
E2E_RC=$?

# 4. No host synchronisation on the hot path: whole steps under set_sync_debug_mode("error").
timeout 120 "$PY" tests/integrations/jobs/sync_free_job.py "$OUT" > "$OUT/sync_free.txt" 2>&1
SYNC_RC=$?

{
  grep -E "^(commit|host|python|device) " "$OUT/env.txt"
  echo "sync-free steps exit $SYNC_RC (124 = timed out)"
  grep -E "^(int4|topk1|mixed) " "$OUT/sync_free.txt" | cut -c1-300
  echo "e2e exit $E2E_RC"
  tail -8 "$OUT/e2e.txt"
  echo "bench exit $BENCH_RC (124 = timed out), tests exit $TEST_RC (124 = timed out), $(( $(date +%s) - T0 )) s"
  grep -E "verify|copy:|clone:" "$OUT/bench_cuda.txt"
  grep -E "passed|failed|error" "$OUT/tests_cuda.txt" | tail -3
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
