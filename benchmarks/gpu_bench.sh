#!/usr/bin/env bash
# The GPU check, for any machine with a CUDA GPU and requirements.txt installed:
#   bash benchmarks/gpu_bench.sh
# It runs benchmarks/gpu_check.py. By default: what no GPU has measured yet, the CUDA tests (the CUDA graph's and the
# host advantages' first) and PPO's speed flags against its defaults in one run; the steps measured before (speed at
# the defaults, PPG's phases, a short learning check, IMPALA, NCCL) when GPU_CHECK_STEPS names them. The steps, their
# budgets and their files are in gpu_check.py's docstring and docs/speed.md ("The GPU check"). Everything lands in
# $OUT (default benchmarks/results/gpu), at most 8 files: summary.json, one JSON per step with numbers, the learning
# runs' tarball, and the whole console in gpu_bench.log.
# Settings, all optional: DEADLINE (seconds for the whole check, default 540; in a job with a time limit set it a
# minute below the limit: the steps come in the order of their value and those that no longer fit are skipped and
# recorded), PYTHON (default python3), GPU_CHECK_STEPS (these steps, comma-separated, or "all": then DEADLINE=840),
# GPU_CHECK_TINY=1 (the CPU dry run at tiny flags, tests/test_gpu_check.py), GPU_CHECK_FAIL_STEP,
# GPU_CHECK_TIME_SCALE (gpu_check.py --help); DRY_RUN=1 only prints the steps' commands (tests/test_speed.py parses
# their flags).
set -uo pipefail
started=$(date +%s)
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -n "${DRY_RUN:-}" ]; then
    exec "$python" benchmarks/gpu_check.py --dry-run
fi
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
{
    echo "gpu_bench.sh: DEADLINE ${DEADLINE:-540} s from this script's start"
    PYTHONUNBUFFERED=1 "$python" benchmarks/gpu_check.py --out "$out" --started "$started"
} 2>&1 | tee "$out/gpu_bench.log"
exit "${PIPESTATUS[0]}"
