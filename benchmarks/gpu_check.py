"""The GPU check's steps, run by `bash benchmarks/gpu_bench.sh` once it has put in place what the
machine lacks.

The steps come in the order of their value, so that a run cut short still returns the most
important numbers. Before each one the deadline is checked: it starts only if the time it needs is
left before DEADLINE (less a reserve for the last step's clean stop and the packing), and runs under
its own budget, cut to the time left: past it, SIGTERM to its process group (the scripts stop at
their next clean point), then SIGKILL. A failed step is recorded and the next one runs;
summary.json is rewritten after every step.

  step          need  budget (s)
  preflight       20      60  versions, imports, a Procgen step, a CUDA op (gpu_preflight.py);
                              if it fails nothing else runs (the CPU dry run lets no CUDA through)
  cuda-tests      60     150  pytest -m cuda: the tests that skip without a GPU (4 at a time
                              where pytest-xdist is)
  ppo-speed       60     200  bench.py: PPO at its defaults, with --amp, with --compile, each
                              alone -> ppo.json
  ppg-speed       45      90  bench.py: PPG at its defaults but --n-pi 2: 7 iterations hold 3
                              auxiliary phases, the first (cold) in the warm-up; the policy and
                              the auxiliary phase apart -> ppg.json
  impala-speed    40      80  bench.py: IMPALA with --max-policy-lag 0 (synchronous) and 1 (its
                              default: acting and learning overlap) -> impala.json
  nccl            30      60  torchrun, one rank: PPO's data-parallel path over NCCL, 2 iterations
                              and a checkpoint
  learning       150    rest  PPO and PPG on StarPilot at their defaults, side by side, sized to
                              the time left less the results step's budget
  results         20      45  results.py on the learning runs: figure, aggregate.md, on-track lines

Files in OUT, 8 at most: gpu_bench.log (gpu_bench.sh writes it), summary.json, ppo.json, ppg.json,
impala.json, learning.tar.gz (the learning runs' metrics.jsonl, args.json and console logs,
results.py's outputs), starpilot_easy.png and aggregate.md. Compile time is recorded apart from the
steady state: bench.py's `warmup_s` of the compile configuration against the defaults'.

  python benchmarks/gpu_check.py --out DIR [--deadline 540] [--tiny] [--steps a,b]
      [--fail-step NAME] [--dry-run]

--tiny is the CPU dry run of tests/test_gpu_check.py: every command at tiny flags, every need 1 s
but learning's. --steps runs only the named steps (the others are recorded as not selected);
--fail-step replaces a step's command by one that fails, to check that the failure is reported and
the next step still runs. Only the standard library is imported, so that this runs, and reports,
whatever the machine lacks.
"""
import argparse
import collections
import dataclasses
import datetime
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNING_NEED_S = 150  # shorter learning runs say nothing: below this much time left, no learning step
RESULTS_BUDGET_S = 45  # results.py after the learning runs: the learning step leaves it this much
TAIL_LINES = 30  # of a step's output, kept in summary.json when it fails
PPO_ITERATION = 64 * 256  # environment steps per iteration at the defaults (PPO and PPG)
LEARN_STEPS_WITHOUT_SPEED = 30 * PPO_ITERATION  # when ppo.json has no speed at the defaults to size the runs by
TINY_FLAGS = {  # the CPU dry run: games, networks and batches as small as the scripts allow
    "ppo_procgen.py": "--env-id bigfish --num-envs 2 --num-steps 8 --num-minibatches 1 --update-epochs 1 "
                      "--channels 4 --hidden-size 8",
    "ppg_procgen.py": "--env-id bigfish --num-envs 2 --num-steps 8 --num-minibatches 1 --e-aux 1 "
                      "--num-aux-rollouts 2 --channels 4 --hidden-size 8",
    "vtrace.py": "--env-id bigfish --num-envs 4 --unroll-length 8 --updates-per-iteration 2 --channels 4 "
                 "--hidden-size 8",
}


@dataclasses.dataclass
class Settings:
    python: str  # the interpreter of every step
    out: str  # the results (at most 8 files)
    work: str  # everything else: the learning runs, the preflight's report
    tiny: bool
    deadline_s: float
    started: float  # when gpu_bench.sh started: its setup counts against the deadline
    reserve_s: float  # kept back from every step: the last SIGTERM's grace, then packing the learning runs
    grace_s: float  # from a step's SIGTERM to its SIGKILL

    def left(self):
        return self.started + self.deadline_s - self.reserve_s - time.time()


@dataclasses.dataclass
class Step:
    name: str
    need_s: float  # the least time left in which it starts
    budget_s: float  # its timeout, cut to the time left; None: all that is left but `leave_s`
    command: list = None  # the process that is the step; None: a function of its own (learning, results)
    output: str = None  # the JSON it writes into OUT (bench.py's), read into summary.json
    leave_s: float = 0  # with budget_s None: the seconds left to the steps after it


# ---- the steps ----
def bench_command(settings, script, configs, iterations, warmup, output):
    """bench.py over named configurations of one script, its JSON into OUT."""
    command = [settings.python, os.path.join(ROOT, "benchmarks", "bench.py"), "--script", script]
    if settings.tiny:
        command += ["--common", TINY_FLAGS[script]]
        iterations = 2
        warmup = 1
    command += ["--iterations", str(iterations), "--warmup", str(warmup)]
    for name, flags in configs:
        command += ["--config", f"{name}={flags}"]
    return command + ["--out", os.path.join(settings.out, output)]


def nccl_command(settings):
    """One rank under torchrun: init, broadcast, all-reduce and a checkpoint over NCCL (gloo on the CPU)."""
    flags = ["--env-id", "starpilot", "--total-timesteps", str(2 * PPO_ITERATION), "--eval-episodes", "4"]
    if settings.tiny:
        flags = shlex.split(TINY_FLAGS["ppo_procgen.py"]) + ["--total-timesteps", "32", "--eval-episodes", "1"]
    return [settings.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            os.path.join(ROOT, "ppo_procgen.py"), *flags, "--save-model", "--exp-name", "nccl_smoke"]


def learning_command(settings, script, total_timesteps):
    flags = ["--env-id", "starpilot", "--seed", "1", "--total-timesteps", str(total_timesteps), "--eval-every", "20"]
    if settings.tiny:
        flags = shlex.split(TINY_FLAGS[script]) + ["--seed", "1", "--total-timesteps", str(total_timesteps),
                                                   "--eval-every", "0", "--eval-episodes", "1"]
    return [settings.python, os.path.join(ROOT, script), *flags]


def plan(settings):
    """The steps in the order of their value."""
    def need(seconds):
        return 1 if settings.tiny else seconds

    pytest = [settings.python, "-m", "pytest", "-q", os.path.join(ROOT, "tests"), "-m", "cuda",
              "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:  # the lent machine has it: the three compile tests at once
        pytest += ["-n", "4"]
    ppo = [("defaults", ""), ("amp", "--amp"), ("compile", "--compile")]
    impala = [("sync", "--max-policy-lag 0"), ("overlap", "--max-policy-lag 1")]
    preflight = [settings.python, os.path.join(ROOT, "benchmarks", "gpu_preflight.py"), "--json",
                 os.path.join(settings.work, "preflight.json")]
    return [
        Step("preflight", need(20), 60, preflight),
        Step("cuda-tests", need(60), 150, pytest),
        Step("ppo-speed", need(60), 200, bench_command(settings, "ppo_procgen.py", ppo, 5, 3, "ppo.json"),
             "ppo.json"),
        Step("ppg-speed", need(45), 90, bench_command(settings, "ppg_procgen.py", [("n_pi_2", "--n-pi 2")], 4, 3,
                                                       "ppg.json"), "ppg.json"),
        Step("impala-speed", need(40), 80, bench_command(settings, "vtrace.py", impala, 4, 2, "impala.json"),
             "impala.json"),
        Step("nccl", need(30), 60, nccl_command(settings)),
        Step("learning", LEARNING_NEED_S, None, leave_s=RESULTS_BUDGET_S),
        Step("results", need(20), RESULTS_BUDGET_S),
    ]


def skip_reason(step, settings, done, selected):
    """Why the step does not run (None: it runs). `done`: the steps so far, by name."""
    if selected and step.name not in selected:
        return "not selected (--steps)"
    preflight = done.get("preflight")
    cuda_only = settings.tiny and preflight is not None and preflight.get("exit_code") == 2
    if preflight is not None and preflight["status"] not in ("ok", "skipped") and not cuda_only:
        return f"the preflight failed: {preflight.get('missing')}"
    if step.name == "results" and done.get("learning", {}).get("status", "skipped") == "skipped":
        return "no learning runs"
    left = settings.left()
    if left < step.need_s:
        return f"deadline: {left:.0f} s left, the step needs {step.need_s:.0f} s"
    return None


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


def wait_or_stop(processes, timeout_s, grace_s):
    """Waits for all processes; past timeout_s, SIGTERM to the process groups of those still
    running (the scripts then stop at their next clean point, with a checkpoint), grace_s later
    SIGKILL. Afterwards whatever the steps left behind in their groups (compile workers, a rank) is
    killed. Returns the indices of those that were stopped."""
    end = time.time() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(end - time.time(), 0))
        except subprocess.TimeoutExpired:
            pass
    stopped = [index for index, process in enumerate(processes) if process.poll() is None]
    for index in stopped:
        signal_group(processes[index], signal.SIGTERM)
    end = time.time() + grace_s
    for index in stopped:
        try:
            processes[index].wait(timeout=max(end - time.time(), 0))
        except subprocess.TimeoutExpired:
            signal_group(processes[index], signal.SIGKILL)
            processes[index].wait()
    for process in processes:
        signal_group(process, signal.SIGKILL)
    return stopped


def start(command, cwd, stdout):
    """In a process group of its own, so that a timeout stops its children too (bench.py's, torchrun's)."""
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(command, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True, env=environment)


def run_process(command, timeout_s, settings):
    """In the work folder (runs/ lands there), its output line by line to ours (the log); returns
    the step's status, exit code and last lines."""
    process = start(command, settings.work, subprocess.PIPE)
    tail = collections.deque(maxlen=TAIL_LINES)
    reader = threading.Thread(target=echo_lines, args=(process.stdout, tail), daemon=True)
    reader.start()
    stopped = wait_or_stop([process], timeout_s, settings.grace_s)
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


def pytest_numbers(step, settings, entry):
    """The counts of pytest's last line ('3 passed, 11 skipped in 42.0s')."""
    counts = {}
    for line in entry["output_tail"].splitlines()[-3:]:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", line):
            counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return {"tests": counts}


def bench_numbers(step, settings, entry):
    """Per configuration the figures worth reading at a glance (the rest is in the step's JSON)."""
    saved = read_json(os.path.join(settings.out, step.output), settings)
    if saved is None:
        return {"results": None}
    keys = ("config", "sps_median", "sps_overall", "sps_policy_phase", "aux_phase_s", "aux_phase_warmup_s",
            "warmup_s", "process_s", "seconds_per_iteration", "peak_gpu_gb", "peak_rss_gb", "error")
    results = [{key: result[key] for key in keys if key in result} for result in saved["results"]]
    numbers = {"results": results}
    by_name = {result["config"]: result for result in results if "error" not in result}
    if "defaults" in by_name and "compile" in by_name:  # torch.compile's cost, apart from its steady state
        numbers["compile_extra_warmup_s"] = by_name["compile"]["warmup_s"] - by_name["defaults"]["warmup_s"]
    return numbers


NUMBERS = {"preflight": preflight_numbers, "cuda-tests": pytest_numbers, "ppo-speed": bench_numbers,
           "ppg-speed": bench_numbers, "impala-speed": bench_numbers}


def run_command_step(step, timeout_s, settings, inject):
    entry = run_process(failing_command(settings) if inject else step.command, timeout_s, settings)
    if step.name in NUMBERS:
        entry.update(NUMBERS[step.name](step, settings, entry))
    if entry["status"] == "ok":
        del entry["output_tail"]
    return entry


# ---- learning and results ----
def learning_steps(settings, timeout_s):
    """Steps per run: two runs share the GPU and the cores, so each is given half the speed PPO
    measured at the defaults, over the time left after start-up and evaluations (60 s), with a fifth
    to spare."""
    if settings.tiny:
        return 32
    saved = read_json(os.path.join(settings.out, "ppo.json"), settings) or {"results": []}
    speeds = [r["sps_overall"] for r in saved["results"] if r["config"] == "defaults" and "error" not in r]
    if not speeds:
        return LEARN_STEPS_WITHOUT_SPEED
    steps = int(speeds[0] / 2 * max(timeout_s - 60, 0) * 0.8) // PPO_ITERATION * PPO_ITERATION
    return max(steps, 2 * PPO_ITERATION)


def run_learning(step, timeout_s, settings, inject):
    """PPO and PPG side by side, each its own process, console log and exit status."""
    learn = os.path.join(settings.work, "learn")
    os.makedirs(learn, exist_ok=True)
    total = learning_steps(settings, timeout_s)
    names, processes, logs = [], [], []
    for script in ("ppo_procgen.py", "ppg_procgen.py"):
        command = failing_command(settings) if inject else learning_command(settings, script, total)
        names.append(os.path.splitext(script)[0])
        logs.append(open(os.path.join(learn, f"{names[-1]}.log"), "w"))
        print(f"== learning: {shlex.join(command)} > {logs[-1].name}", flush=True)
        processes.append(start(command, learn, logs[-1]))
    stopped = wait_or_stop(processes, timeout_s, settings.grace_s)
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


def run_results(step, timeout_s, settings, inject):
    """results.py on the learning runs (figure and aggregate.md into OUT), then its on-track lines."""
    learn = os.path.join(settings.work, "learn")
    results_py = os.path.join(ROOT, "benchmarks", "results.py")
    figures = [settings.python, results_py, os.path.join(learn, "runs"), "--out", os.path.join(learn, "results")]
    if settings.tiny:  # fewer bootstrap resamples than the 50,000 of rliable's default
        figures += ["--reps", "2000"]
    end = time.time() + timeout_s
    entry = run_process(failing_command(settings) if inject else figures, timeout_s, settings)
    for path in glob.glob(os.path.join(learn, "results", "*_easy.png"))[:1] + \
            glob.glob(os.path.join(learn, "results", "aggregate.md")):
        shutil.copy(path, settings.out)
    if entry["status"] == "ok":
        on_track = [settings.python, results_py, os.path.join(learn, "runs"), "--on-track"]
        tracked = run_process(on_track, max(end - time.time(), 1), settings)
        entry["on_track"] = tracked["output_tail"].splitlines()
        entry["status"] = tracked["status"]
        entry["output_tail"] = tracked["output_tail"]
    if entry["status"] == "ok":
        del entry["output_tail"]
    return entry


RUNNERS = {"learning": run_learning, "results": run_results}


def pack_learning_runs(settings):
    """The learning runs' metrics, flags and console logs and results.py's outputs, as one file in
    OUT."""
    learn = os.path.join(settings.work, "learn")
    if not os.path.isdir(learn):
        return
    with tarfile.open(os.path.join(settings.out, "learning.tar.gz"), "w:gz") as archive:
        for pattern in ("runs/*/metrics.jsonl", "runs/*/args.json", "*.log", "results/*"):
            for path in sorted(glob.glob(os.path.join(learn, pattern))):
                archive.add(path, arcname=os.path.relpath(path, learn))


# ---- the check ----
def write_summary(settings, summary):
    summary["elapsed_s"] = round(time.time() - settings.started, 1)
    summary["files"] = sorted(os.listdir(settings.out))
    path = os.path.join(settings.out, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(path + ".tmp", path)


def run_check(settings, steps, selected, fail_step, linked):
    summary = {"started": datetime.datetime.fromtimestamp(settings.started, datetime.timezone.utc).isoformat(),
               "deadline_s": settings.deadline_s, "tiny": settings.tiny, "python": settings.python,
               "libraries_linked": linked.split(), "steps": [],
               "plan": [{"name": step.name, "need_s": step.need_s, "budget_s": step.budget_s} for step in steps]}
    write_summary(settings, summary)  # from the start: a kill during the first step still leaves the plan
    done = {}
    for step in steps:
        entry = {"name": step.name, "need_s": step.need_s, "budget_s": step.budget_s}
        reason = skip_reason(step, settings, done, selected)
        if reason is not None:
            entry.update(status="skipped", reason=reason)
            print(f"== {step.name}: skipped: {reason}", flush=True)
        else:
            left = settings.left()
            timeout_s = left - step.leave_s if step.budget_s is None else min(step.budget_s, left)
            entry["timeout_s"] = round(timeout_s)
            print(f"== {step.name}: up to {timeout_s:.0f} s ({left:.0f} s left before the deadline)", flush=True)
            begin = time.time()
            runner = RUNNERS.get(step.name, run_command_step)
            entry.update(runner(step, timeout_s, settings, step.name == fail_step))
            entry["seconds"] = round(time.time() - begin, 1)
            print(f"== {step.name}: {entry['status']} after {entry['seconds']:.0f} s", flush=True)
        summary["steps"].append(entry)
        done[step.name] = entry
        write_summary(settings, summary)
    pack_learning_runs(settings)
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
    flags = learning_command(settings, "ppo_procgen.py", LEARN_STEPS_WITHOUT_SPEED)[2:]
    print(f"learn ppo_procgen.py ppg_procgen.py: {python} SCRIPT {shlex.join(flags)}")
    print(f"{python} benchmarks/results.py RUNS --out RESULTS; {python} benchmarks/results.py RUNS --on-track")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu"),
                        help="the results folder (at most 8 files)")
    parser.add_argument("--work", default=None, help="a private folder for everything else (default: a new one)")
    parser.add_argument("--deadline", type=float, default=float(os.environ.get("DEADLINE", 540)),
                        help="seconds for the whole check, from --started (default: $DEADLINE or 540)")
    parser.add_argument("--started", type=float, default=None,
                        help="when the check started (Unix time; default: now)")
    parser.add_argument("--tiny", action="store_true", default=bool(os.environ.get("GPU_CHECK_TINY")),
                        help="the CPU dry run: tiny flags, 1 s needs (default: $GPU_CHECK_TINY)")
    parser.add_argument("--steps", default=os.environ.get("GPU_CHECK_STEPS", ""),
                        help="comma-separated steps to run; default ($GPU_CHECK_STEPS or empty): all")
    parser.add_argument("--fail-step", default=os.environ.get("GPU_CHECK_FAIL_STEP"),
                        help="replace this step's command by one that fails (default: $GPU_CHECK_FAIL_STEP)")
    parser.add_argument("--linked", default=os.environ.get("GPU_CHECK_LINKED", ""),
                        help="the carried libraries gpu_bench.sh put on LD_LIBRARY_PATH (for the summary)")
    parser.add_argument("--dry-run", action="store_true", help="only print the steps' commands")
    args = parser.parse_args(argv)
    work = args.work
    if work is None:
        work = "WORK" if args.dry_run else tempfile.mkdtemp(prefix="gpu_check.")
    started = args.started
    if started is None:
        started = time.time()
    reserve_s = 15
    grace_s = 10
    if args.tiny:  # a CPU dry run of a 30 s deadline could not keep 15 s back
        reserve_s = 5
        grace_s = 3
    settings = Settings(python=os.environ.get("PYTHON", sys.executable), out=os.path.abspath(args.out), work=work,
                        tiny=args.tiny, deadline_s=args.deadline, started=started, reserve_s=reserve_s,
                        grace_s=grace_s)
    steps = plan(settings)
    names = [step.name for step in steps]
    selected = [name for name in args.steps.split(",") if name]
    unknown = [name for name in selected + [args.fail_step or names[0]] if name not in names]
    if unknown:
        parser.error(f"--steps/--fail-step: unknown step {unknown[0]!r}; the steps are {', '.join(names)}")
    if args.dry_run:
        listing(steps, settings)
        return 0
    os.makedirs(settings.out, exist_ok=True)
    os.makedirs(settings.work, exist_ok=True)
    return run_check(settings, steps, selected, args.fail_step, args.linked)


if __name__ == "__main__":
    sys.exit(main())
