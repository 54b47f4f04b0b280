#!/usr/bin/env bash
# The Procgen protocol: games x seeds x algorithms at the scripts' defaults, one run after another (or one queue per
# GPU), then benchmarks/results.py for the curves and the aggregate table. Run from the repo root.
#
#   bash benchmarks/procgen_suite.sh                          # CleanRL's protocol: easy, 25M steps, 64 envs,
#                                                             # starpilot bossfight bigfish x seeds 1 2 3, PPO + PPG
#   GAMES=all bash benchmarks/procgen_suite.sh                # all 16 games
#   MODE=hard bash benchmarks/procgen_suite.sh                # the PPG paper's protocol: hard, 100M steps, 256 envs
#   SCRIPTS="ppo_procgen.py ppg_procgen.py vtrace.py" ...     # add IMPALA (at its own defaults)
#   GPUS="0 1 2 3" bash benchmarks/procgen_suite.sh           # one queue per GPU (CUDA_VISIBLE_DEVICES); "0 0 1 1"
#                                                             # runs two jobs at a time on each of two GPUs
#   DRY_RUN=1 bash benchmarks/procgen_suite.sh                # print the commands (e.g. for a scheduler), run nothing
#
# Each job's console goes to $LOG_DIR/<game>__<script>__<seed>.log; its results to runs/<env>__<exp>__<seed>__<time>/.
# A failed job does not stop the others; the suite ends with results.py over whatever finished (partial runs are
# marked there) and exits 1 if any job failed. Runs save checkpoints (--save-model), so a crashed job continues with
# `python <script> --resume runs/<run>/checkpoint.pt`. Cost: one 25M-step run takes 108-129 minutes with CleanRL's
# ppo_procgen.py on its (unnamed) GPU; the default protocol is 18 such runs.
set -euo pipefail
set -f  # no filename expansion: a job's command line is split on spaces only

MODE=${MODE:-easy}                                  # easy (CleanRL, 25M steps) or hard (PPG paper, 100M steps)
GAMES=${GAMES:-"starpilot bossfight bigfish"}       # or "all" for the 16 games
SEEDS=${SEEDS:-"1 2 3"}
SCRIPTS=${SCRIPTS:-"ppo_procgen.py ppg_procgen.py"}
GPUS=${GPUS:-}                                      # empty: one job at a time on the default device
PYTHON=${PYTHON:-python}
EXTRA_FLAGS=${EXTRA_FLAGS:-"--save-model"}          # added to every job
PPO_FLAGS=${PPO_FLAGS:-}                            # added to the jobs of one script only
PPG_FLAGS=${PPG_FLAGS:-}
IMPALA_FLAGS=${IMPALA_FLAGS:-}
RUNS_DIR=runs                                       # where the scripts write (relative to the working directory)
LOG_DIR=${LOG_DIR:-$RUNS_DIR/suite_logs}
RESULTS_FLAGS=${RESULTS_FLAGS:-}                    # e.g. "--score eval --out docs/results"
DRY_RUN=${DRY_RUN:-0}

ALL_GAMES="bigfish bossfight caveflyer chaser climber coinrun dodgeball fruitbot heist jumper leaper maze miner ninja
           plunder starpilot"
if [ "$GAMES" = all ]; then GAMES=$ALL_GAMES; fi
for game in $GAMES; do  # procgen aborts the whole process on an unknown name: check before the first job
    case " $(echo $ALL_GAMES) " in *" $game "*) ;; *) echo "error: GAMES contains $game; choose from" \
        $ALL_GAMES "(or GAMES=all)" >&2; exit 2 ;; esac
done
for script in $SCRIPTS; do
    case "$script" in ppo_procgen.py | ppg_procgen.py | vtrace.py) ;; *) echo "error: SCRIPTS contains $script;" \
        "choose from ppo_procgen.py ppg_procgen.py vtrace.py" >&2; exit 2 ;; esac
done
case "$MODE" in
    # CleanRL's ppo_procgen.py / ppg_procgen.py protocol: the scripts' defaults (64 envs, 25M steps).
    easy)
        MODE_FLAGS="--distribution-mode easy --total-timesteps ${TOTAL_TIMESTEPS:-25000000}"
        PPO_MODE_FLAGS=""
        PPG_MODE_FLAGS="" ;;
    # The PPG paper (official code): 4 MPI workers x 64 envs = 256 envs, 100M steps. With 256 envs in one process,
    # 8 minibatches are 8,192 frames, the paper's effective minibatch (4 workers x 2,048, gradients averaged), and
    # the paper's auxiliary minibatch is 4 rollouts per worker x 4 workers = 16 rollouts. PPG's auxiliary buffer is
    # then 256 steps x 256 envs x 32 iterations of 64x64x3 uint8 frames = 24 GiB (on the GPU if it fits, else host).
    hard)
        MODE_FLAGS="--distribution-mode hard --total-timesteps ${TOTAL_TIMESTEPS:-100000000}"
        PPO_MODE_FLAGS="--num-envs 256"
        PPG_MODE_FLAGS="--num-envs 256 --num-aux-rollouts 16" ;;
    *) echo "error: MODE=$MODE; choose easy or hard" >&2; exit 2 ;;
esac

jobs=()
job_names=()
for game in $GAMES; do
    for seed in $SEEDS; do
        for script in $SCRIPTS; do
            case "$script" in
                ppo_procgen.py) script_flags="$PPO_MODE_FLAGS $PPO_FLAGS" ;;
                ppg_procgen.py) script_flags="$PPG_MODE_FLAGS $PPG_FLAGS" ;;
                vtrace.py) script_flags="$IMPALA_FLAGS" ;;  # in neither protocol: IMPALA's own defaults in every mode
            esac
            command="$PYTHON $script --env-id $game --seed $seed $MODE_FLAGS $EXTRA_FLAGS $script_flags"
            jobs+=("$(echo $command)")  # unquoted echo: one space between words
            job_names+=("${game}__${script%.py}__${seed}")
        done
    done
done

read -r -a gpus <<< "$GPUS"
if [ "$DRY_RUN" = 1 ]; then  # the plain list: a scheduler assigns the devices
    printf '%s\n' "${jobs[@]}"
    echo $PYTHON benchmarks/results.py $RUNS_DIR $RESULTS_FLAGS  # unquoted: one space between words
    exit 0
fi

mkdir -p "$LOG_DIR"
claims=$(mktemp -d)
trap 'rm -rf "$claims"' EXIT
run_queue() {  # one queue per entry of GPUS: each takes the next job no queue has taken yet (mkdir is atomic)
    local gpu=$1 failed=0 code
    for index in "${!jobs[@]}"; do
        mkdir "$claims/$index" 2> /dev/null || continue
        local log="$LOG_DIR/${job_names[$index]}.log"
        echo "[$(date +%H:%M:%S)] job $((index + 1))/${#jobs[@]}${gpu:+ on GPU $gpu}: ${jobs[$index]} > $log"
        code=0
        if [ -n "$gpu" ]; then
            CUDA_VISIBLE_DEVICES=$gpu ${jobs[$index]} > "$log" 2>&1 || code=$?
        else
            ${jobs[$index]} > "$log" 2>&1 || code=$?
        fi
        if [ "$code" -eq 130 ]; then  # Ctrl-C: the script saved a checkpoint and stopped; start nothing new
            return 130
        elif [ "$code" -ne 0 ]; then
            echo "FAILED (exit $code): see $log"
            failed=1
        fi
    done
    return $failed
}
pids=()
for gpu in "${gpus[@]:-}"; do  # no GPUS: one queue on the default device
    run_queue "$gpu" &
    pids+=($!)
done
trap 'echo "Ctrl-C: the running jobs save a checkpoint and stop; no new job starts"' INT
status=0
for pid in "${pids[@]}"; do
    code=0
    wait "$pid" || code=$?
    while kill -0 "$pid" 2> /dev/null; do  # a Ctrl-C ends `wait` early: wait again for the queue to finish
        code=0
        wait "$pid" || code=$?
    done
    if [ "$code" -eq 130 ]; then status=130; elif [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then status=1; fi
done
if [ "$status" -eq 130 ]; then
    echo "interrupted: continue a run with python <script> --resume runs/<run>/checkpoint.pt, or rerun the suite"
    exit 130
fi
$PYTHON benchmarks/results.py "$RUNS_DIR" $RESULTS_FLAGS || status=1
exit $status
