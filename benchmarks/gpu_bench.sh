#!/usr/bin/env bash
# The one GPU check, meant to take under 9 minutes on one H200 (an estimate: no GPU has run it yet). Everything it
# writes goes to one folder, $OUT (default benchmarks/results/gpu), as 8 files at most:
#   gpu_bench.log                          the console of every step below, with each step's wall time
#   1. the CUDA-only tests (tests whose name says cuda; they skip on a CPU)
#   ppo.json, ppg.json, impala.json        2. SPS at the default hyperparameters, plain path (NCHW, eager, float32)
#                                             against the fast path (channels_last, torch.compile, bf16 autocast,
#                                             cuDNN autotuning), alternated A B; PPG over a whole phase with its
#                                             auxiliary phase; IMPALA synchronous (lag 0) against overlapped
#                                             (lag 1), plain and fast, with the time the learner waits for unrolls
#   starpilot_easy.png, aggregate.md,      3. a short PPO-vs-PPG learning run on StarPilot (2 seeds each, fast path,
#   runs.tar.gz                               two runs at a time), turned into a figure and a table by results.py,
#                                             PPO against the anchor's own runs at the same steps (baselines PPO,
#                                             train-procgen easy-all: benchmarks/reference/; no anchor ran PPG in easy
#                                             mode), and the on-track line per algorithm in the log;
#                                             the runs' metrics.jsonl and args.json in the archive
#                                          4. a one-rank torchrun run of PPO (the NCCL path), 2 iterations
# Run from the repo root on a CUDA machine after `pip install -r requirements.txt`: bash benchmarks/gpu_bench.sh
# On the machine the device tool lends, carry the wheels of benchmarks/gpu_wheels.sh (its header has the command).
# DRY_RUN=1 only prints the commands (tests/test_speed.py checks that they parse). Each step's size is a variable.
set -uo pipefail
out=${OUT:-benchmarks/results/gpu}
python=${PYTHON:-python}
learn_steps=${LEARN_STEPS:-1500000}
plain="--no-channels-last"
fast="--channels-last --compile --amp --no-torch-deterministic"
mkdir -p "$out"
status=0

step() {  # step NAME COMMAND...: run it (or print it with DRY_RUN=1), timed; a failed step does not stop the others
    local name=$1
    shift
    if [ -n "${DRY_RUN:-}" ]; then
        printf '%q ' "$@"
        echo
        return
    fi
    echo "== $name: $*"
    local start=$SECONDS
    "$@" || { echo "== $name FAILED"; status=1; }
    echo "== $name: $((SECONDS - start)) s"
}

learn() {  # learn SCRIPT SEED: one learning run of the comparison, logged to its own file
    "$python" "$1" --env-id starpilot --seed "$2" --total-timesteps "$learn_steps" --eval-every 20 $fast \
        --exp-name "$(basename "$1" .py)" > "$out/learn_$(basename "$1" .py)_$2.log" 2>&1
}

main() {
    step device "$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)"
    step cuda-tests "$python" -m pytest -q tests -k cuda -p no:cacheprovider
    step ppo-sps "$python" benchmarks/bench.py --script ppo_procgen.py --iterations "${PPO_ITERATIONS:-10}" \
        --warmup 3 --config plain="$plain" --config fast="$fast" --out "$out/ppo.json"
    # N_pi = 32 iterations, then the auxiliary phase: "overall" SPS counts the auxiliary phase.
    step ppg-sps "$python" benchmarks/bench.py --script ppg_procgen.py --iterations "${PPG_ITERATIONS:-33}" \
        --warmup 2 --config plain="$plain" --config fast="$fast" --out "$out/ppg.json"
    # IMPALA: synchronous (lag 0) against the default overlap of acting and learning (lag 1), then the fast path.
    step impala-sps "$python" benchmarks/bench.py --script vtrace.py --iterations "${IMPALA_ITERATIONS:-6}" \
        --warmup 2 --config sync="$plain --max-policy-lag 0" --config overlap="$plain --max-policy-lag 1" \
        --config overlap_fast="$fast --max-policy-lag 1" --out "$out/impala.json"
    if [ -n "${DRY_RUN:-}" ]; then
        echo "learn ppo_procgen.py ppg_procgen.py x seeds 1 2: $python SCRIPT --env-id starpilot --seed SEED" \
            "--total-timesteps $learn_steps --eval-every 20 $fast"
    else
        echo "== learning: PPO and PPG on starpilot, seeds 1 2, $learn_steps steps each, two runs at a time"
        local start=$SECONDS
        for seed in 1 2; do
            learn ppo_procgen.py "$seed" &
            learn ppg_procgen.py "$seed" &
            wait || status=1
        done
        echo "== learning: $((SECONDS - start)) s"
    fi
    step results "$python" benchmarks/results.py runs --reference --out "$out/results"
    step on-track "$python" benchmarks/results.py runs --on-track
    # After results.py, which should not see this run: the NCCL path of the data-parallel set-up, one rank on the one
    # GPU (init, broadcast, all-reduce, a checkpoint), 2 iterations.
    step nccl-smoke "$python" -m torch.distributed.run --standalone --nproc-per-node 1 ppo_procgen.py \
        --env-id starpilot --total-timesteps 32768 --eval-episodes 4 --save-model --exp-name nccl_smoke
    if [ -z "${DRY_RUN:-}" ]; then
        cp "$out"/results/*.png "$out"/results/aggregate.md "$out"/ 2>/dev/null
        rm -rf "$out/results"
        tar -czf "$out/runs.tar.gz" $(find runs -name metrics.jsonl -o -name args.json) "$out"/learn_*.log
        rm -f "$out"/learn_*.log
        echo "== files in $out:"
        ls -la "$out"
    fi
    return $status
}

if [ -n "${DRY_RUN:-}" ]; then
    main
else
    main 2>&1 | tee "$out/gpu_bench.log"
    exit "${PIPESTATUS[0]}"
fi
