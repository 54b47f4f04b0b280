#!/usr/bin/env bash
# Issue 6's GPU check: PPO and PPG at default hyperparameters, plain path vs fast path, side by side.
# Run from the repo root on a CUDA machine after `pip install -r requirements.txt`.
# Expected to take about 7 minutes on one H200 (an estimate: no GPU was available to run it yet).
# Results: JSON files in ${OUT:-benchmarks/results}/ and the tables on stdout.
set -euo pipefail
out=${OUT:-benchmarks/results}
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
plain="--no-channels-last"
fast="--channels-last --compile --amp --no-torch-deterministic"
# PPO: 16,384 steps per iteration; the first iterations include torch.compile's compilation (dropped as warm-up).
python benchmarks/bench.py --script ppo_procgen.py --iterations 30 --warmup 5 --repeats 1 \
    --config plain="$plain" --config fast="$fast" --out "$out/ppo_gpu.json"
# PPG: two whole phases (N_pi = 32 iterations, then the auxiliary phase), so "overall" SPS includes the aux phase.
python benchmarks/bench.py --script ppg_procgen.py --iterations 59 --warmup 5 --repeats 1 \
    --config plain="$plain" --config fast="$fast" --out "$out/ppg_gpu.json"
