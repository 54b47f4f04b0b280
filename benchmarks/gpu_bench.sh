#!/usr/bin/env bash
# The one GPU check. On the H200 that the device tool lends, with the bundle of benchmarks/gpu_wheels.sh carried
# (docs/speed.md, "The GPU check", has the calls: the check here, the device tool's status, the run, the hand-back):
#   CHECK_WHEELS=1 bash benchmarks/gpu_bench.sh    # here, before anything is sent: is .whl/ there and whole?
#   DEADLINE=540 bash benchmarks/gpu_bench.sh    # there
# CHECK_WHEELS=1 verifies every file of .whl/ against the SHA256SUMS that gpu_wheels.sh writes last, and that the bundle and
# the working tree together fit the 64 MiB that travel; it prints one line (the fix: bash benchmarks/gpu_wheels.sh).
# The run makes the same check of .whl/ first, then puts in place what the machine lacks, writing nothing into /: the
# wheels of .whl/ installed into a private folder put first on PYTHONPATH, and those of the carried system libraries
# in .whl/lib/ (procgen's Qt loads them) that the machine's loader does not find linked into a private folder put
# first on LD_LIBRARY_PATH. Then benchmarks/gpu_check.py runs the steps, ordered by value, each under its own budget,
# all within DEADLINE seconds of this script's start (default 540; set it from the device tool's remaining time); its
# docstring lists the steps, their budgets and the at most 8 files they leave in OUT (default benchmarks/results/gpu;
# the device tool sets its own). The console goes to $OUT/gpu_bench.log too.
# Other settings: PYTHON (default python3), WHEELS (default .whl; "none": the machine has every package, as in the CPU
# dry run), GPU_CHECK_TINY=1 (the CPU dry run at tiny flags: tests/test_gpu_check.py), GPU_CHECK_STEPS,
# GPU_CHECK_FAIL_STEP, GPU_CHECK_TIME_SCALE (gpu_check.py --help); DRY_RUN=1 only prints the steps' commands
# (tests/test_speed.py parses their flags).
set -uo pipefail
started=$(date +%s)
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
if [ -n "${DRY_RUN:-}" ]; then
    exec "$python" benchmarks/gpu_check.py --dry-run
fi

check_wheels() {  # one line on stdout: .whl/ is whole (status 0), or what is wrong and the fix (status 1)
    local fix="build it here with: bash benchmarks/gpu_wheels.sh (as root), then carry it: carry [\"$wheels\"]"
    local failed
    if [ ! -f "$wheels/SHA256SUMS" ]; then
        echo "error: $wheels/ is missing or incomplete (no SHA256SUMS, which gpu_wheels.sh writes last); $fix"
        return 1
    fi
    if ! failed=$(cd "$wheels" && sha256sum --quiet --check SHA256SUMS 2>&1); then
        echo "error: $wheels/ is incomplete or changed (${failed%%$'\n'*}); $fix"
        return 1
    fi
    echo "gpu_bench.sh: $wheels/ is whole: the $(wc -l < "$wheels/SHA256SUMS") files of its SHA256SUMS"
}

check_carry_size() {  # here only (the copy that travels is no git checkout): .whl/ and the tree within 64 MiB
    local bundle tree
    git rev-parse --is-inside-work-tree >/dev/null 2>&1 || return 0
    bundle=$(du -sb "$wheels" | cut -f1)
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    if [ $((bundle + tree)) -gt $((64 * 1048576)) ]; then
        echo "error: $wheels/ ($bundle bytes) and the working tree ($tree bytes) pass the 64 MiB that travel;" \
            "remove untracked files or rebuild with: bash benchmarks/gpu_wheels.sh"
        return 1
    fi
    echo "gpu_bench.sh: with the working tree, $(( (bundle + tree + 1048575) / 1048576 )) MiB of the 64 that travel"
}

if [ -n "${CHECK_WHEELS:-}" ]; then
    check_wheels && check_carry_size
    exit
fi
out=${OUT:-benchmarks/results/gpu}
mkdir -p "$out"
wheels_line="gpu_bench.sh: WHEELS=none: no wheels carried (the machine has every package)"
if [ "$wheels" != none ] && ! wheels_line=$(check_wheels); then  # before any step: one line, no wait
    echo "$wheels_line" | tee "$out/gpu_bench.log"
    exit 1
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")

install_wheels() {  # the carried wheels into $work/site, first on PYTHONPATH (so they shadow the machine's copies)
    local found=("$wheels"/*.whl)
    [ -e "${found[0]}" ] || return 0
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" "${found[@]}" \
        || echo "gpu_bench.sh: installing the wheels of $wheels failed (the preflight will name what is missing)"
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_bench.sh: ${#found[@]} wheels of $wheels on PYTHONPATH ($work/site)"
}

machine_has() {  # machine_has LIBRARY: the dynamic loader finds it without our folder
    local dir
    if ldconfig -p 2>/dev/null | grep -q "^[[:space:]]$1 "; then
        return 0
    fi
    for dir in ${LD_LIBRARY_PATH//:/ } /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /lib /usr/lib; do
        [ -e "$dir/$1" ] && return 0
    done
    return 1
}

link_missing_libraries() {  # of the carried system libraries, those the machine lacks, first on LD_LIBRARY_PATH
    local path name linked=()
    [ -d "$wheels/lib" ] || return 0
    mkdir -p "$work/lib"
    for path in "$wheels"/lib/*.so*; do
        [ -e "$path" ] || continue
        name=$(basename "$path")
        machine_has "$name" && continue
        ln -s "$(realpath "$path")" "$work/lib/$name"
        linked+=("$name")
    done
    export LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export GPU_CHECK_LINKED="${linked[*]:-}"  # for the preflight's report and summary.json
    echo "gpu_bench.sh: carried libraries the machine lacks, on LD_LIBRARY_PATH: ${linked[*]:-none}"
}

{
    echo "$wheels_line"
    LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
    if [ "$wheels" != none ]; then
        install_wheels
        link_missing_libraries
    fi
    echo "gpu_bench.sh: DEADLINE ${DEADLINE:-540} s from this script's start"
    PYTHONUNBUFFERED=1 "$python" benchmarks/gpu_check.py --out "$out" --work "$work" --started "$started"
} 2>&1 | tee "$out/gpu_bench.log"
exit "${PIPESTATUS[0]}"
