#!/usr/bin/env bash
# The GPU check, for any machine with a CUDA GPU and requirements.txt installed:
#   bash benchmarks/gpu_bench.sh
# It runs benchmarks/gpu_check.py: speed at the defaults (ms per vector step, the update's achieved TFLOPS, peak
# memory), PPG's policy and auxiliary phases timed apart, a short learning check of PPO and PPG on StarPilot and
# BigFish, the CUDA tests; the steps, their budgets and their files are in gpu_check.py's docstring and docs/speed.md
# ("The GPU check"). Everything lands in $OUT (default benchmarks/results/gpu): summary.json, one JSON per step with
# numbers, and the whole console in gpu_bench.log.
# Settings, all optional: DEADLINE (seconds for the whole check, default 540; in a job with a time limit set it a
# minute below the limit: the steps come in the order of their value and those that no longer fit are skipped and
# recorded), PYTHON (default python3), GPU_CHECK_STEPS (run only these steps), GPU_CHECK_TINY=1 (the CPU dry run at
# tiny flags, tests/test_gpu_check.py), GPU_CHECK_FAIL_STEP, GPU_CHECK_TIME_SCALE (gpu_check.py --help); DRY_RUN=1
# only prints the steps' commands (tests/test_speed.py parses their flags).
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
