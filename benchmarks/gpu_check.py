"""The GPU check's steps, run by `bash benchmarks/gpu_bench.sh` on any machine with a CUDA GPU.

By default it runs what no GPU has measured yet, in the order of its value, so that a run cut short
still returns the most important numbers: the preflight, the CUDA tests (those of the CUDA graph and
of the host's advantages first), then PPO's new speed flags against its defaults in one bench.py run.
The steps measured before (marked "asked") run only when --steps names them (or "all"). The default
steps' budgets add up: with the reserve kept for the end (RESERVE_S) they fit DEADLINE_S, so at the
default deadline each gets its whole budget (tests/test_gpu_check.py checks the sum). A budget is a
step's whole wall time: past budget - GRACE_S, SIGTERM to its process group (the scripts stop at
their next clean point), at the budget SIGKILL. Before each step the deadline is checked: it starts
only if its need is left before the deadline (less the reserve), and its budget is cut to what is
left; otherwise it is recorded as "no time" with the seconds it needed. A failed step is recorded
and the next one runs.

  step          need  budget (s)
  preflight       15      25  versions, imports, a Procgen step, a CUDA op (gpu_preflight.py);
                              if it fails nothing else runs (the CPU dry run lets no CUDA through)
  cuda-tests      65     110  pytest -m cuda on the files that hold CUDA tests (2 at a time where
                              pytest-xdist is), the CUDA graph's and the host advantages' tests
                              first (gpu_pytest_log.py moves them to the front and writes each
                              outcome as the test ends, so a cut step still reports the tests
                              that ran); need and budget from their count (cuda_tests_budget)
  ppo-flags      160     330  bench.py, 2 warm-up and 3 measured iterations, 2 rounds alternated:
                              PPO at its defaults (advantages on the host), with --cuda-graph,
                              with every speed flag at once, with --cuda-graph --overlap-games,
                              with --amp --no-amp-rollout, with --overlap-games -> ppo_flags.json
  ppo-speed       40      55  asked: bench.py: PPO at its defaults: SPS, ms per vector step (the
                              rollout's and the games' share), the update's achieved TFLOPS
                              (gpu_flops.py), peak memory -> ppo.json
  ppg-speed       50      70  asked: bench.py: PPG at its defaults but --n-pi 2: 7 iterations hold
                              3 auxiliary phases, the first (cold) in the warm-up; the policy and
                              the auxiliary phase apart, as ppo-speed's figures -> ppg.json
  learning        90     100  asked: PPO and PPG at their defaults on StarPilot (easy) and on
                              BigFish (hard, where the official runs show PPG's lead earliest),
                              four runs side by side sized to the budget; packed into
                              learning.tar.gz as each run ends
  results         15      25  asked: results.py on the learning runs: figures, aggregate.md,
                              on-track lines (all into learning.tar.gz)
  impala-speed    45      55  asked: bench.py: IMPALA with --max-policy-lag 0 (synchronous) and 1
                              (its default: acting and learning overlap) -> impala.json
  nccl            25      35  asked: torchrun, one rank: PPO's data-parallel path over NCCL, 2
                              iterations and a checkpoint
  default                465  <= DEADLINE_S 540 - RESERVE_S 15; all steps: 805 (DEADLINE=840)

Files in OUT, at most 8 (a copy back from a GPU machine may take no more), each written whole (a
temporary file in OUT, then os.replace) as soon as its step ends: gpu_bench.log (gpu_bench.sh writes
it), summary.json (after every step), ppo_flags.json, ppo.json, ppg.json, impala.json (bench.py
writes into the work folder, the step's end copies), learning.tar.gz (the learning runs'
metrics.jsonl, args.json and console logs, packed as each run ends, then with results.py's figures
and aggregate.md, which go nowhere else).

  python benchmarks/gpu_check.py --out DIR [--deadline 540] [--tiny] [--steps a,b|all]
      [--fail-step NAME] [--time-scale 1] [--dry-run]

--deadline (or $DEADLINE, default 540) is for a job with a time limit: set it a minute below the
limit, and the steps that no longer fit are skipped and recorded. --tiny is the CPU dry run of
tests/test_gpu_check.py: every command at tiny flags (without --compile, which compiles for minutes
on a CPU). --time-scale multiplies every need, budget, the reserve and the grace (a scaled deadline:
tests/test_gpu_check.py runs the whole table in seconds). --steps runs the named steps, in the
table's order (the others are recorded as not selected); --fail-step replaces a step's command by
one that fails, to check that the failure is reported and the next step still runs. Only the
standard library is imported, so that this runs, and reports, whatever the machine lacks.
"""
import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import glob
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 540  # the default: the default steps in 9 minutes
RESERVE_S = 15  # kept back at the end: the last summary and a kill's slack
GRACE_S = 10  # from a step's SIGTERM to its SIGKILL, inside its budget
PUBLISH_EVERY_S = 10  # while a step runs, its results so far go into OUT this often (and as a run ends)
TAIL_LINES = 30  # of a step's output, kept in summary.json when it fails
PPO_ITERATION = 64 * 256  # environment steps per iteration at the defaults (PPO and PPG)
LEARN_STEPS_WITHOUT_SPEED = 30 * PPO_ITERATION  # when no step measured PPO's defaults to size the runs by
LEARNING_STARTUP_S = 60  # of the learning step's budget: the runs' start-up and evaluations, not training
# The files that hold the tests marked cuda (tests/conftest.py's NEEDS["cuda"], @pytest.mark.cuda):
# collecting only these costs four imports, not the whole suite. tests/test_gpu_check.py keeps
# the list complete, and CUDA_TESTS equal to the number of tests pytest -m cuda collects in them.
CUDA_TEST_FILES = ("tests/test_ppg.py", "tests/test_speed.py", "tests/test_vtrace.py",
                   "tests/test_vtrace_learner.py")
CUDA_TESTS = 25
CUDA_TEST_S = 2.5  # per test, one at a time: 18 of them took 45 s on the H200 (gpu/cuda_tests.log)
# Never run on a GPU yet: the cuda-tests step runs them first (gpu_pytest_log.py, by test name).
CUDA_TESTS_FIRST = ("test_cuda_graph_rollouts_are_the_eager_ones_bit_for_bit",
                    "test_cuda_advantages_on_the_host_are_the_devices_bit_for_bit")
# PPO's speed flags against its defaults in one bench.py run, alternated over 2 rounds, so that each
# ratio compares configurations measured side by side; the defaults first (bench.py's baseline),
# then the order of value. The defaults take their advantages on the host (no flag turns that off):
# their gain is the defaults' SPS against benchmarks/results/gpu/ppo.json's, another run.
PPO_FLAGS = [("defaults", ""), ("graph", "--cuda-graph"),
             ("fastest", "--cuda-graph --overlap-games --amp --no-amp-rollout --compile"),
             ("graph_overlap", "--cuda-graph --overlap-games"), ("amp_update", "--amp --no-amp-rollout"),
             ("overlap", "--overlap-games")]
TINY_FLAGS = {  # the CPU dry run: games, networks, batches as small as the scripts allow, one thread
    "ppo_procgen.py": "--env-id bigfish --num-envs 2 --num-steps 8 --num-minibatches 1 --update-epochs 1 "
                      "--channels 4 --hidden-size 8 --torch-threads 1",
    "ppg_procgen.py": "--env-id bigfish --num-envs 2 --num-steps 8 --num-minibatches 1 --e-aux 1 "
                      "--num-aux-rollouts 2 --channels 4 --hidden-size 8 --torch-threads 1",
    "vtrace.py": "--env-id bigfish --num-envs 4 --unroll-length 8 --updates-per-iteration 2 --channels 4 "
                 "--hidden-size 8",
}


def cuda_tests_budget(count):
    """(need, budget) of the cuda-tests step for `count` tests: the need is their estimate at
    CUDA_TEST_S each, the budget 1.6 times that (a cold GPU, the first compile) and the grace,
    both rounded up to 5 s."""
    def up_to_5(seconds):
        return -(-seconds // 5) * 5

    return int(up_to_5(count * CUDA_TEST_S)), int(up_to_5(1.6 * count * CUDA_TEST_S + GRACE_S))


# (name, need, budget) in seconds at the default deadline, in the order they run (see above): what no
# GPU has measured first (DEFAULT_STEPS), then the steps measured before, which run when asked. Each
# measured budget is a step's time on a cold H200 (docs/speed.md) plus GRACE_S and a margin.
TABLE = [("preflight", 15, 25), ("cuda-tests", *cuda_tests_budget(CUDA_TESTS)), ("ppo-flags", 160, 330),
         ("ppo-speed", 40, 55), ("ppg-speed", 50, 70), ("learning", 90, 100), ("results", 15, 25),
         ("impala-speed", 45, 55), ("nccl", 25, 35)]
DEFAULT_STEPS = ("preflight", "cuda-tests", "ppo-flags")


@dataclasses.dataclass
class Settings:
    python: str  # the interpreter of every step
    out: str  # the results
    work: str  # everything else: the learning runs, bench.py's JSONs, the preflight's report, the tests' log
    tiny: bool
    deadline_s: float
    started: float  # when gpu_bench.sh started
    scale: float = 1.0  # --time-scale: every need, budget, the reserve and the grace
    reserve_s: float = RESERVE_S  # kept back from every step, scaled
    grace_s: float = GRACE_S  # from a step's SIGTERM to its SIGKILL, scaled

    def left(self, now=None):
        """Seconds left before the deadline, less the reserve, at `now` (default: the clock's)."""
        now = time.time() if now is None else now
        return self.started + self.deadline_s - self.reserve_s - now


@dataclasses.dataclass
class Step:
    name: str
    need_s: float  # the least time left in which it starts
    budget_s: float  # its whole wall time, cut to the time left
    command: list = None  # the process that is the step; None: a function of its own (learning, results)
    output: str = None  # bench.py's steps: the JSON it lands in, in OUT
    environment: dict = None  # added to the step's environment


# ---- the steps ----
def bench_command(settings, script, configs, iterations, warmup, name, repeats=1):
    """bench.py over named configurations of one script, its JSON into the work folder (the step's
    end, and every PUBLISH_EVERY_S, copies it into OUT)."""
    command = [settings.python, os.path.join(ROOT, "benchmarks", "bench.py"), "--script", script]
    if settings.tiny:
        command += ["--common", TINY_FLAGS[script]]
        iterations, warmup, repeats = 2, 1, 1
        configs = [(config, shlex.join(word for word in shlex.split(flags) if word != "--compile"))
                   for config, flags in configs]
    command += ["--iterations", str(iterations), "--warmup", str(warmup), "--repeats", str(repeats)]
    for config, flags in configs:
        command += ["--config", f"{config}={flags}"]
    return command + ["--out", bench_json(settings, name)]


def bench_json(settings, name):
    return os.path.join(settings.work, f"{name}.json")


def nccl_command(settings):
    """One rank under torchrun: init, broadcast, all-reduce and a checkpoint over NCCL (gloo on the CPU)."""
    flags = ["--env-id", "starpilot", "--total-timesteps", str(2 * PPO_ITERATION), "--eval-episodes", "4"]
    if settings.tiny:
        flags = shlex.split(TINY_FLAGS["ppo_procgen.py"]) + ["--total-timesteps", "32", "--eval-episodes", "1"]
    return [settings.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            os.path.join(ROOT, "ppo_procgen.py"), *flags, "--save-model", "--exp-name", "nccl_smoke"]


def cuda_tests_command(settings, files=CUDA_TEST_FILES):
    """pytest -m cuda on the files that hold CUDA tests, each outcome logged as it ends
    (gpu_pytest_log.py); two workers where pytest-xdist is: the three compile tests overlap.
    Without it, pytest.ini's addopts are dropped: one of them is pytest-xdist's."""
    command = [settings.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_pytest_log", "-m", "cuda",
               *(os.path.join(ROOT, path) for path in files)]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", "2"]
    else:
        command += ["-o", "addopts="]
    return command


def cuda_tests_environment(settings, first=CUDA_TESTS_FIRST):
    """The plugin found on PYTHONPATH (after what gpu_bench.sh put first), its log in the work folder,
    the tests it runs first."""
    path = os.path.join(ROOT, "benchmarks")
    if os.environ.get("PYTHONPATH"):
        path += os.pathsep + os.environ["PYTHONPATH"]
    return {"PYTHONPATH": path, "GPU_CHECK_TEST_LOG": os.path.join(settings.work, "cuda_tests.jsonl"),
            "GPU_CHECK_TESTS_FIRST": ",".join(first)}


# The learning check's games: StarPilot, the project's usual test game, and BigFish in hard mode, where
# the official runs show PPG's lead over PPO earliest (their last 100 episodes at 25M steps: 5.6
# for PPO, 23.1 for PPG). A few minutes show learning on both, not that lead.
LEARNING_GAMES = [("starpilot", "easy"), ("bigfish", "hard")]


def learning_command(settings, script, total_timesteps, game="starpilot", mode="easy"):
    flags = ["--seed", "1", "--total-timesteps", str(total_timesteps), "--eval-every", "20"]
    if settings.tiny:
        flags = shlex.split(TINY_FLAGS[script]) + ["--seed", "1", "--total-timesteps", str(total_timesteps),
                                                   "--eval-every", "0", "--eval-episodes", "1"]
    return [settings.python, os.path.join(ROOT, script), *flags, "--env-id", game, "--distribution-mode", mode]


def plan(settings):
    """Every step of TABLE in its order, needs and budgets scaled by --time-scale."""
    preflight = [settings.python, os.path.join(ROOT, "benchmarks", "gpu_preflight.py"), "--json",
                 os.path.join(settings.work, "preflight.json")]
    impala = [("sync", "--max-policy-lag 0"), ("overlap", "--max-policy-lag 1")]
    commands = {
        "preflight": {"command": preflight},
        # 2 warm-up and 3 measured iterations: a run ~20 s, ~45 s with the cold compile, 2 rounds in the budget
        "ppo-flags": {"command": bench_command(settings, "ppo_procgen.py", PPO_FLAGS, 3, 2, "ppo-flags", repeats=2),
                      "output": "ppo_flags.json"},
        "ppo-speed": {"command": bench_command(settings, "ppo_procgen.py", [("defaults", "")], 5, 3, "ppo-speed"),
                      "output": "ppo.json"},
        "ppg-speed": {"command": bench_command(settings, "ppg_procgen.py", [("n_pi_2", "--n-pi 2")], 4, 3,
                                               "ppg-speed"), "output": "ppg.json"},
        "impala-speed": {"command": bench_command(settings, "vtrace.py", impala, 4, 2, "impala-speed"),
                         "output": "impala.json"},
        "nccl": {"command": nccl_command(settings)},
        "cuda-tests": {"command": cuda_tests_command(settings), "environment": cuda_tests_environment(settings)},
    }
    return [Step(name, need * settings.scale, budget * settings.scale, **commands.get(name, {}))
            for name, need, budget in TABLE]


def skip_reason(step, settings, done, selected, now=None):
    """Why the step does not run (None: it runs), at `now` (default: the clock's). `done`: the steps
    so far, by name; `selected`: the names of the steps to run."""
    if step.name not in selected:
        return "not selected (--steps)"
    preflight = done.get("preflight")
    cuda_only = settings.tiny and preflight is not None and preflight.get("exit_code") == 2
    if preflight is not None and preflight["status"] not in ("ok", "skipped") and not cuda_only:
        return f"the preflight failed: {preflight.get('missing')}"
    if step.name == "results" and done.get("learning", {}).get("status", "skipped") == "skipped":
        return "no learning runs"
    left = settings.left(now)
    if left < step.need_s:
        return f"no time: {max(left, 0):.1f} s left, needs {step.need_s:.1f} s"
    return None


# ---- writing into OUT: whole files only ----
def write_atomically(path, write):
    """`write(file)` into a temporary file beside `path`, flushed and synced, then renamed over it:
    a reader, or a kill, meets the old file or the new one, never half of one."""
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".",
                                         suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_json(path, value):
    def dump(f):
        f.write(json.dumps(value, indent=1).encode())

    write_atomically(path, dump)


def remove_leftovers(settings):
    """A temporary file a killed writer left in OUT would come back as one file too many."""
    for path in glob.glob(os.path.join(settings.out, "*.tmp")):
        with contextlib.suppress(OSError):
            os.unlink(path)


# ---- running a step's processes ----
def echo_lines(stream, tail):
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))


def signal_group(process, signum):
    try:
        os.killpg(process.pid, signum)
    except OSError:  # the group is gone
        pass


def wait_or_stop(processes, timeout_s, grace_s, publish=None):
    """Waits for all processes, calling `publish()` as each one ends and every PUBLISH_EVERY_S
    (results land in OUT as they come); at timeout_s - grace_s SIGTERM to the process groups of
    those still running (the scripts then stop at their next clean point, with a checkpoint), at
    timeout_s SIGKILL. Afterwards whatever the steps left behind in their groups (compile workers,
    a rank) is killed. Returns the indices of those that were stopped."""
    begin = time.time()
    grace_s = min(grace_s, timeout_s / 4)
    stopped, running = [], set(range(len(processes)))
    last_publish = begin
    while running:
        ended = {index for index in running if processes[index].poll() is not None}
        running -= ended
        elapsed = time.time() - begin
        if publish is not None and (ended or time.time() - last_publish >= PUBLISH_EVERY_S):
            publish()
            last_publish = time.time()
        if elapsed >= timeout_s:
            for index in running:
                signal_group(processes[index], signal.SIGKILL)
                processes[index].wait()
            break
        if elapsed >= timeout_s - grace_s:
            for index in sorted(running - set(stopped)):
                signal_group(processes[index], signal.SIGTERM)
                stopped.append(index)
        time.sleep(0.05)
    for process in processes:
        signal_group(process, signal.SIGKILL)
    if publish is not None:
        publish()
    return sorted(stopped)


def start(command, cwd, stdout, environment=None):
    """In a process group of its own, so that a timeout stops its children too (bench.py's, torchrun's)."""
    environment = dict(os.environ, PYTHONUNBUFFERED="1", **(environment or {}))
    return subprocess.Popen(command, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True, env=environment)


def run_process(command, timeout_s, settings, environment=None, publish=None):
    """In the work folder (runs/ lands there), its output line by line to ours (the log); returns
    the step's status, exit code and last lines."""
    process = start(command, settings.work, subprocess.PIPE, environment)
    tail = collections.deque(maxlen=TAIL_LINES)
    reader = threading.Thread(target=echo_lines, args=(process.stdout, tail), daemon=True)
    reader.start()
    stopped = wait_or_stop([process], timeout_s, settings.grace_s, publish)
    reader.join(timeout=10)
    status = "ok" if process.returncode == 0 else "failed"
    if stopped:
        status = "timeout"
    return {"status": status, "exit_code": process.returncode, "output_tail": "\n".join(tail)}


def failing_command(settings):
    return [settings.python, "-c", "raise SystemExit('error: a failure injected into this step (--fail-step)')"]


# ---- what each step adds to summary.json ----
def read_json(path, settings):
    """A JSON this check wrote (None for one it did not write, or one older than the check: an
    earlier run's)."""
    try:
        if os.path.getmtime(path) < settings.started:
            return None
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def preflight_numbers(step, settings, entry):
    report = read_json(os.path.join(settings.work, "preflight.json"), settings)
    if report is None:  # it did not get as far as its report: its last line says why
        return {"missing": (entry["output_tail"].splitlines() or ["no report"])[-1]}
    return {"missing": report["status"], "report": report}


def read_test_log(path):
    """gpu_pytest_log.py's lines; a last line cut by a kill is left out."""
    records = []
    try:
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
    except OSError:
        pass
    return records


def pytest_numbers(step, settings, entry):
    """The outcome counts of the tests that ended, from the log written as each ended (a cut step
    still has them), the failed tests' names, and whether pytest got to its end."""
    records = read_test_log(step.environment["GPU_CHECK_TEST_LOG"])
    counts = collections.Counter(record["outcome"] for record in records if "test" in record)
    collected = [record["collected"] for record in records if "collected" in record]
    finished = [record["exit_status"] for record in records if "exit_status" in record]
    failed = [record["test"] for record in records if record.get("outcome") in ("failed", "error")]
    return {"tests": dict(counts), "collected": collected[0] if collected else None,
            "pytest_finished": bool(finished), "failed_tests": failed[:10]}


def update_work(settings, script, configs):
    """gpu_flops.py's floating-point work of one update, per configuration ({} where it cannot run)."""
    command = [settings.python, os.path.join(ROOT, "benchmarks", "gpu_flops.py"), "--script", script]
    command += [f"--flags={shlex.join(flags)}" for flags in configs.values()]
    try:
        answer = subprocess.run(command, capture_output=True, text=True, timeout=max(min(60, settings.left()), 1))
    except subprocess.TimeoutExpired:
        return {}
    if answer.returncode != 0:
        print(f"gpu_flops.py failed: {(answer.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
        return {}
    return dict(zip(configs, (json.loads(line) for line in answer.stdout.splitlines())))


def bounds(result, work):
    """Which bound binds: ms per vector step (one step of all games: the whole rollout's, and the
    games' own share of it) against the update's achieved TFLOPS (its counted work over its time)."""
    seconds = result.get("seconds_per_iteration") or {}
    if work is None or "rollout" not in seconds:
        return {}
    numbers = {"ms_per_vector_step": 1000 * seconds["rollout"] / work["num_steps"],
               "env_ms_per_vector_step": 1000 * seconds.get("env", 0.0) / work["num_steps"],
               "update_flop": work["update_flop"]}
    if seconds.get("update"):
        numbers["update_tflops"] = work["update_flop"] / seconds["update"] / 1e12
    return numbers


def bench_numbers(step, settings, entry):
    """Per configuration the figures worth reading at a glance (the rest is in the step's JSON)."""
    saved = read_json(bench_json(settings, step.name), settings)
    if saved is None:
        return {"results": None}
    keys = ("config", "sps_median", "sps_overall", "sps_policy_phase", "aux_phase_s", "aux_phase_warmup_s",
            "warmup_s", "process_s", "seconds_per_iteration", "peak_gpu_gb", "peak_rss_gb", "error")
    results = [{key: result[key] for key in keys if key in result} for result in saved["results"]]
    work = {}
    if saved.get("script") in ("ppo_procgen.py", "ppg_procgen.py"):
        work = update_work(settings, saved["script"], saved["configs"])
    for result in results:
        result.update(bounds(result, work.get(result["config"])))
    numbers = {"results": results}
    return numbers


def publish_bench(step, settings):
    """bench.py's JSON so far into OUT."""
    saved = read_json(bench_json(settings, step.name), settings)
    if saved is not None:
        write_json(os.path.join(settings.out, step.output), saved)


NUMBERS = {"preflight": preflight_numbers, "cuda-tests": pytest_numbers, "ppo-speed": bench_numbers,
           "ppg-speed": bench_numbers, "ppo-flags": bench_numbers, "impala-speed": bench_numbers}


def run_command_step(step, timeout_s, settings, inject):
    publish = None
    if step.output is not None:
        publish = functools.partial(publish_bench, step, settings)
    command = failing_command(settings) if inject else step.command
    entry = run_process(command, timeout_s, settings, step.environment, publish)
    if step.name in NUMBERS:
        entry.update(NUMBERS[step.name](step, settings, entry))
    if entry["status"] == "ok" and entry.get("tests", True):  # no test outcomes: the output says why
        del entry["output_tail"]
    return entry


# ---- learning and results ----
def learning_steps(settings, timeout_s, runs):
    """Steps per run: `runs` runs share the GPU and the cores, so each is given that share of the
    speed PPO measured at the defaults (ppo-speed's or ppo-flags'), over the budget less start-up
    and evaluations, with a fifth to spare."""
    if settings.tiny:
        return 32
    speeds = []
    for name in ("ppo-speed", "ppo-flags"):
        saved = read_json(bench_json(settings, name), settings) or {"results": []}
        speeds += [r["sps_overall"] for r in saved["results"] if r["config"] == "defaults" and "error" not in r]
    if not speeds:
        return LEARN_STEPS_WITHOUT_SPEED
    steps = int(speeds[0] / runs * max(timeout_s - LEARNING_STARTUP_S, 0) * 0.8) // PPO_ITERATION * PPO_ITERATION
    return max(steps, 2 * PPO_ITERATION)


def run_learning(step, timeout_s, settings, inject):
    """PPO and PPG on each of LEARNING_GAMES side by side, each run its own process, console log
    and exit status; their metrics packed into OUT as each run ends."""
    learn = os.path.join(settings.work, "learn")
    os.makedirs(learn, exist_ok=True)
    runs = [(script, game, mode) for game, mode in LEARNING_GAMES for script in ("ppo_procgen.py", "ppg_procgen.py")]
    total = learning_steps(settings, timeout_s, len(runs))
    names, processes, logs = [], [], []
    for script, game, mode in runs:
        command = failing_command(settings) if inject else learning_command(settings, script, total, game, mode)
        names.append(f"{game}_{os.path.splitext(script)[0]}")
        logs.append(open(os.path.join(learn, f"{names[-1]}.log"), "w"))
        print(f"== learning: {shlex.join(command)} > {logs[-1].name}", flush=True)
        processes.append(start(command, learn, logs[-1]))
    stopped = wait_or_stop(processes, timeout_s, settings.grace_s, functools.partial(pack_learning_runs, settings))
    runs = {}
    for index, (name, process, log) in enumerate(zip(names, processes, logs)):
        log.close()
        with open(log.name, errors="replace") as f:
            lines = f.read().splitlines()
        run = {"exit_code": process.returncode, "last_line": lines[-1] if lines else ""}
        if index in stopped:
            run["status"] = "stopped at the deadline"
        elif process.returncode == 0:
            run["status"] = "ok"
        else:
            run.update(status="failed", output_tail="\n".join(lines[-TAIL_LINES:]))
        runs[name] = run
        print(f"== learning: {name}: {run['status']} (exit {process.returncode})", flush=True)
    status = "timeout" if stopped else "ok"
    if any(run["status"] == "failed" for run in runs.values()):
        status = "failed"
    return {"status": status, "total_timesteps": total, "runs": runs}


def results_commands(settings):
    """results.py on the learning runs: the figure and aggregate table, then the on-track lines."""
    learn = os.path.join(settings.work, "learn")
    results_py = os.path.join(ROOT, "benchmarks", "results.py")
    figures = [settings.python, results_py, os.path.join(learn, "runs"), "--out", os.path.join(learn, "results")]
    if settings.tiny:  # fewer bootstrap resamples than the 50,000 of rliable's default
        figures += ["--reps", "2000"]
    return figures, [settings.python, results_py, os.path.join(learn, "runs"), "--on-track"]


def run_results(step, timeout_s, settings, inject):
    """results.py's figures and aggregate.md into learning.tar.gz (OUT holds few files), its on-track
    lines into summary.json."""
    learn = os.path.join(settings.work, "learn")
    figures, on_track = results_commands(settings)
    end = time.time() + timeout_s
    entry = run_process(failing_command(settings) if inject else figures, timeout_s, settings)
    if entry["status"] == "ok":
        tracked = run_process(on_track, max(end - time.time(), 1), settings)
        entry["on_track"] = tracked["output_tail"].splitlines()
        entry["status"] = tracked["status"]
        entry["output_tail"] = tracked["output_tail"]
    pack_learning_runs(settings)
    if entry["status"] == "ok":
        del entry["output_tail"]
    return entry


RUNNERS = {"learning": run_learning, "results": run_results}


def pack_learning_runs(settings):
    """The learning runs' metrics, flags and console logs and results.py's outputs so far, as one
    file in OUT."""
    learn = os.path.join(settings.work, "learn")

    def pack(f):
        with tarfile.open(fileobj=f, mode="w:gz") as archive:
            for pattern in ("runs/*/metrics.jsonl", "runs/*/args.json", "*.log", "results/*"):
                for path in sorted(glob.glob(os.path.join(learn, pattern))):
                    archive.add(path, arcname=os.path.relpath(path, learn))

    write_atomically(os.path.join(settings.out, "learning.tar.gz"), pack)


# ---- the check ----
def write_summary(settings, summary):
    remove_leftovers(settings)
    summary["elapsed_s"] = round(time.time() - settings.started, 1)
    summary["files"] = sorted(os.listdir(settings.out))
    write_json(os.path.join(settings.out, "summary.json"), summary)


def timeout_for(step, settings, now=None):
    """The step's budget, cut to what is left before the deadline at `now` (default: the clock's)."""
    return min(step.budget_s, settings.left(now))


def run_check(settings, steps, selected, fail_step):
    budgets = sum(step.budget_s for step in steps if step.name in selected)
    summary = {"started": datetime.datetime.fromtimestamp(settings.started, datetime.timezone.utc).isoformat(),
               "deadline_s": settings.deadline_s, "time_scale": settings.scale, "tiny": settings.tiny,
               "python": settings.python, "budgets_s": round(budgets, 1),
               "usable_s": round(settings.deadline_s - settings.reserve_s, 1), "selected": list(selected),
               "steps": [], "plan": [{"name": step.name, "need_s": step.need_s, "budget_s": step.budget_s}
                                     for step in steps]}
    write_summary(settings, summary)  # from the start: a kill during the first step still leaves the plan
    done = {}
    for step in steps:
        entry = {"name": step.name, "need_s": step.need_s, "budget_s": step.budget_s}
        now = time.time()  # one reading for the decision and the budget
        reason = skip_reason(step, settings, done, selected, now)
        if reason is not None:
            entry.update(status="skipped", reason=reason)
            print(f"== {step.name}: skipped: {reason}", flush=True)
        else:
            timeout_s = timeout_for(step, settings, now)
            entry["timeout_s"] = round(timeout_s, 1)
            print(f"== {step.name}: up to {timeout_s:.0f} s ({settings.left(now):.0f} s left before the deadline)",
                  flush=True)
            begin = time.time()
            runner = RUNNERS.get(step.name, run_command_step)
            entry.update(runner(step, timeout_s, settings, step.name == fail_step))
            entry["seconds"] = round(time.time() - begin, 2)
            print(f"== {step.name}: {entry['status']} after {entry['seconds']:.0f} s", flush=True)
        summary["steps"].append(entry)
        done[step.name] = entry
        write_summary(settings, summary)
    print(f"== the GPU check after {summary['elapsed_s']:.0f} s of {settings.deadline_s:.0f}; "
          f"{os.path.join(settings.out, 'summary.json')}:")
    for entry in summary["steps"]:
        print(f"   {entry['name']:<13} {entry['status']:<8} {entry.get('reason') or entry.get('missing') or ''}")
    return 0 if all(entry["status"] in ("ok", "skipped") for entry in summary["steps"]) else 1


def listing(steps, settings):
    """DRY_RUN: each step's command, paths relative to the repository (tests/test_speed.py parses
    the flags)."""
    def relative(word):
        return os.path.relpath(word, ROOT) if os.path.isabs(word) and word.startswith(ROOT) else word

    for step in steps:
        if step.command is not None:
            print(shlex.join(relative(word) for word in step.command))
    python = relative(settings.python)
    for game, mode in LEARNING_GAMES:
        flags = learning_command(settings, "ppo_procgen.py", LEARN_STEPS_WITHOUT_SPEED, game, mode)[2:]
        print(f"learn ppo_procgen.py ppg_procgen.py: {python} SCRIPT {shlex.join(flags)}")
    print(f"{python} benchmarks/results.py RUNS --out RESULTS; {python} benchmarks/results.py RUNS --on-track")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu"),
                        help="the results folder")
    parser.add_argument("--work", default=None, help="a private folder for everything else (default: a new one)")
    parser.add_argument("--deadline", type=float, default=float(os.environ.get("DEADLINE", DEADLINE_S)),
                        help="seconds for the whole check, from --started; in a job with a time limit, a minute "
                             f"below it (default: $DEADLINE or {DEADLINE_S})")
    parser.add_argument("--started", type=float, default=None,
                        help="when the check started (Unix time; default: now)")
    parser.add_argument("--tiny", action="store_true", default=bool(os.environ.get("GPU_CHECK_TINY")),
                        help="the CPU dry run: tiny flags (default: $GPU_CHECK_TINY)")
    parser.add_argument("--time-scale", type=float, default=float(os.environ.get("GPU_CHECK_TIME_SCALE", 1)),
                        help="multiplies every need, budget, the reserve and the grace (default: "
                             "$GPU_CHECK_TIME_SCALE or 1)")
    parser.add_argument("--steps", default=os.environ.get("GPU_CHECK_STEPS") or ",".join(DEFAULT_STEPS),
                        help="comma-separated steps to run, in the table's order, or 'all' (default: "
                             f"$GPU_CHECK_STEPS or {','.join(DEFAULT_STEPS)}: what no GPU has measured yet)")
    parser.add_argument("--fail-step", default=os.environ.get("GPU_CHECK_FAIL_STEP"),
                        help="replace this step's command by one that fails (default: $GPU_CHECK_FAIL_STEP)")
    parser.add_argument("--dry-run", action="store_true", help="only print the steps' commands")
    args = parser.parse_args(argv)
    work = args.work
    if work is None:
        work = "WORK" if args.dry_run else tempfile.mkdtemp(prefix="gpu_check.")
    started = args.started
    if started is None:
        started = time.time()
    settings = Settings(python=os.environ.get("PYTHON", sys.executable), out=os.path.abspath(args.out), work=work,
                        tiny=args.tiny, deadline_s=args.deadline, started=started, scale=args.time_scale,
                        reserve_s=RESERVE_S * args.time_scale, grace_s=GRACE_S * args.time_scale)
    steps = plan(settings)
    names = [step.name for step in steps]
    selected = names if args.steps == "all" else [name for name in args.steps.split(",") if name]
    unknown = [name for name in selected + [args.fail_step or names[0]] if name not in names]
    if unknown:
        parser.error(f"--steps/--fail-step: unknown step {unknown[0]!r}; the steps are {', '.join(names)}")
    if args.dry_run:
        listing(steps, settings)
        return 0
    os.makedirs(settings.out, exist_ok=True)
    os.makedirs(settings.work, exist_ok=True)
    return run_check(settings, steps, selected, args.fail_step)


if __name__ == "__main__":
    sys.exit(main())
