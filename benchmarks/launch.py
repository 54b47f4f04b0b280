"""Several runs side by side on one machine (one GPU, say): the cores split between them, and each run's and the
aggregate steps/s.

  python benchmarks/launch.py --out runs/side_by_side --minutes 9 \\
      "ppo_procgen.py --env-id starpilot" "ppg_procgen.py --env-id bigfish"

Each command is a script of this repository with its flags. Run i works in OUT/<i>_<script stem>/ (the script's
runs/ folder lands there, its console in console.log) with its share of the machine's cores: `--env-threads` and
`--torch-threads` are set to cores // N (at least 1) unless the command sets them, and where N <= cores each run is
pinned to cores of its own (sched_setaffinity), so that no two runs' threads fight for one core. At the deadline
(--minutes) every run still going gets SIGTERM: the scripts save their last whole iteration and stop (exit 143),
and `python <script> --resume <run>/checkpoint.pt` continues one later (with --save-model). A run that has not
stopped --grace seconds after that is killed; its previous checkpoint stays. Ctrl-C (or a SIGTERM to the launcher)
stops every run the same way at once.

At the end, on the console and in OUT/launch.json: per run its status, the environment steps it trained during
the launch (the last `global_step` of its metrics.jsonl, less where it started; start-up and evaluations count
in its time) and those steps over its time from its start to its exit; and the aggregate, all runs' steps over
the launch's wall time: what the machine gives when it runs them together.
Exit status: 0 when every run finished or was stopped at the deadline, 1 when one failed, 130 when interrupted.
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_S = 0.2


@dataclass
class Job:
    """One run: its name (its folder under OUT) and its command line (a script of the repository, its flags)."""
    name: str
    argv: list
    process: Optional[subprocess.Popen] = None
    start_step: int = 0
    status: str = "not started"
    seconds: float = 0.0  # from its start to its exit


def last_step(folder):
    """The largest `global_step` in the metrics.jsonl files under `folder` (a job's runs/), 0 where there is none;
    a cut-off last line (a run killed mid-write) is left out."""
    step = 0
    for directory, _, files in os.walk(folder):
        if "metrics.jsonl" in files:
            with open(os.path.join(directory, "metrics.jsonl"), errors="replace") as f:
                for line in f:
                    if line.endswith("\n") and '"global_step"' in line:
                        try:
                            step = max(step, int(json.loads(line).get("global_step", 0)))
                        except (ValueError, TypeError):
                            pass
    return step


def thread_flags(argv, share):
    """`--env-threads` and `--torch-threads` of one run's share of the cores, where its command does not set them."""
    flags = []
    for flag in ("--env-threads", "--torch-threads"):
        if not any(word == flag or word.startswith(flag + "=") for word in argv):
            flags += [flag, str(share)]
    return flags


def start(job, out, cores, index, runs):
    """Starts one run in OUT/<name>/ with its share of the cores, in a session of its own (so that a Ctrl-C in
    the terminal reaches the launcher only, which then stops each run with SIGTERM)."""
    folder = os.path.join(out, job.name)
    os.makedirs(folder, exist_ok=True)
    share = max(1, len(cores) // runs)
    mine = cores[index * share:(index + 1) * share] if runs <= len(cores) else cores
    argv = [sys.executable, os.path.join(ROOT, job.argv[0]), *job.argv[1:], *thread_flags(job.argv, share)]
    job.start_step = last_step(os.path.join(folder, "runs"))
    pin = (lambda: os.sched_setaffinity(0, mine)) if hasattr(os, "sched_setaffinity") else None
    with open(os.path.join(folder, "console.log"), "a") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        job.process = subprocess.Popen(argv, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       preexec_fn=pin, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    job.status = "running"
    print(f"[{time.strftime('%H:%M:%S')}] {job.name}: {shlex.join(job.argv)} "
          f"({share} thread{'s' * (share > 1)}, cores {mine[0]}-{mine[-1]}) > {folder}/console.log", flush=True)


def time_exits(jobs, begin):
    """Each run's seconds from the launch to its exit, noted as it exits."""
    for job in jobs:
        if not job.seconds and job.process.poll() is not None:
            job.seconds = time.time() - begin


def stop(jobs, grace_s, begin):
    """SIGTERM to every run still going, then SIGKILL to those still going after `grace_s`."""
    time_exits(jobs, begin)
    for job in jobs:
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGTERM)
            job.status = "stopped"
    end = time.time() + grace_s
    while time.time() < end and any(job.process.poll() is None for job in jobs):
        time_exits(jobs, begin)
        time.sleep(POLL_S)
    for job in jobs:
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait()
            job.status = "killed"
    time_exits(jobs, begin)


def launch(jobs, out, seconds, grace_s):
    """Runs `jobs` side by side until each ends or `seconds` pass, then stops the rest (`stop`); returns the
    report (also written to OUT/launch.json) and whether a Ctrl-C or SIGTERM cut the launch."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    interrupted = []
    handlers = {signum: signal.signal(signum, lambda signum, frame: interrupted.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    begin = time.time()
    try:
        for index, job in enumerate(jobs):
            start(job, out, cores, index, len(jobs))
        while any(job.process.poll() is None for job in jobs) and time.time() - begin < seconds and not interrupted:
            time_exits(jobs, begin)
            time.sleep(POLL_S)
        stop(jobs, grace_s, begin)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    wall = time.time() - begin
    report = {"seconds": round(wall, 2), "cores": len(cores), "runs": {}}
    for job in jobs:
        code = job.process.returncode
        job.status = final_status(job, code, os.path.join(out, job.name, "console.log"), interrupted)
        steps = last_step(os.path.join(out, job.name, "runs")) - job.start_step
        report["runs"][job.name] = {"command": shlex.join(job.argv), "status": job.status, "exit_code": code,
                                    "steps": steps, "seconds": round(job.seconds, 2),
                                    "steps_per_s": round(steps / max(job.seconds, 1e-9), 1)}
    report["aggregate_steps_per_s"] = round(sum(run["steps"] for run in report["runs"].values()) / wall, 1)
    write_json(os.path.join(out, "launch.json"), report)
    return report, bool(interrupted)


def final_status(job, code, log, interrupted):
    """What became of a run: finished, stopped (at the deadline or by a Ctrl-C) with its checkpoint, killed after
    the grace, or failed, with the console log to read."""
    if code == 0:
        return "finished"
    if job.status == "stopped" and code in (-signal.SIGTERM, 128 + signal.SIGTERM):
        return "stopped " + ("by a signal to the launcher" if interrupted else "at the deadline") + " (resumable)"
    if job.status == "killed":
        return f"killed: it had not stopped after the grace (its previous checkpoint stays; see {log})"
    return f"failed (exit {code}): see {log}"


def write_json(path, value):
    """Whole or not at all: a temporary file beside it, then os.replace."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def print_report(report):
    width = max(map(len, report["runs"]))
    for name, run in report["runs"].items():
        print(f"{name:<{width}}  {run['steps']:>11,} steps  {run['steps_per_s']:>9,.1f} steps/s  {run['status']}")
    print(f"{'aggregate':<{width}}  {sum(run['steps'] for run in report['runs'].values()):>11,} steps  "
          f"{report['aggregate_steps_per_s']:>9,.1f} steps/s  ({len(report['runs'])} run"
          f"{'s side by side' if len(report['runs']) > 1 else ''} on {report['cores']} cores, "
          f"{report['seconds']:.0f} s)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("commands", nargs="+", metavar="COMMAND",
                        help='a script of this repository with its flags, quoted: "ppo_procgen.py --env-id starpilot"')
    parser.add_argument("--out", default="runs/side_by_side", help="the runs' folders and launch.json go here")
    parser.add_argument("--minutes", type=float, default=9.0, help="the deadline: then every run still going stops")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds a stopping run has to save its checkpoint before it is killed")
    args = parser.parse_args(argv)
    jobs = []
    for index, command in enumerate(args.commands):
        words = shlex.split(command)
        if not words or words[0] not in ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py"):
            parser.error(f"COMMAND {command!r}: start it with ppo_procgen.py, ppg_procgen.py, vtrace.py or "
                         "ppo_rlhf_toy.py")
        jobs.append(Job(f"{index}_{os.path.splitext(words[0])[0]}", words))
    if args.minutes <= 0 or args.grace < 0:
        parser.error(f"--minutes {args.minutes} must be > 0 and --grace {args.grace} >= 0")
    os.makedirs(args.out, exist_ok=True)
    report, interrupted = launch(jobs, args.out, args.minutes * 60, args.grace)
    print_report(report)
    if interrupted:
        return 130
    return 1 if any(run["status"].startswith(("failed", "killed")) for run in report["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
