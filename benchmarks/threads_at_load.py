"""How many torch threads a CPU run should use when other programs keep the machine busy.

Starts --load busy processes (each spins one core, as a compiler or a browser tab would), then runs
--iterations iterations of a script's CPU quick start once per --torch-threads candidate, alternating
the candidates (A, B, A, B, ...) --repeats times so that a change in the load hits them alike, and
stops the load at the end. By default the iterations are the quick start's with 16 steps a rollout
instead of 64 and one minibatch instead of 4 (--num-steps 16): the same 16 games a forward pass, the
same 256-frame minibatches and the same epochs, so the same work a frame in a quarter of the time (a
collapsed quick-start iteration takes minutes); --num-steps 64 is the quick start itself. Each
iteration's steps/s is its frames over its seconds (the console
line's rollout + update); a run still inside an iteration after --cap seconds is stopped and counted
at most frames / --cap. The JSON keeps every iteration, the 1-minute load average (os.getloadavg)
at each run's end and the median steps/s of each candidate.

  python benchmarks/threads_at_load.py --load 4 --out cpu_threads_at_load.json
  python benchmarks/threads_at_load.py --load 0 --out cpu_threads_idle.json

Candidate 0 is the script's own default; on a machine with C cores the useful others are 1, C // 2, C.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# README's CPU quick starts: 16 games, minibatches of 256 frames (4 of them in 64 steps).
QUICK_START = {"ppo_procgen.py": ["--num-envs", "16"], "ppg_procgen.py": ["--num-envs", "16", "--n-pi", "4"]}
GAMES, MINIBATCH = 16, 256
ITERATION_LINE = re.compile(r"^iter (\d+)/.*\(rollout ([\d.]+)s, env [\d.]+s, update ([\d.]+)s")


def spin():
    """One busy core, until killed."""
    while True:
        pass


def start_load(count):
    code = "import sys; sys.path.insert(0, %r); import threads_at_load; threads_at_load.spin()" % os.path.dirname(
        os.path.abspath(__file__))
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def one_run(script, threads, num_steps, iterations, cap):
    """The quick start with --torch-threads `threads` until it has logged `iterations` iterations or `cap` seconds
    have passed in one iteration; returns the steps/s of each iteration (a capped one as frames / cap)."""
    frames = GAMES * num_steps
    flags = [*QUICK_START[script], "--num-steps", str(num_steps), "--num-minibatches", str(frames // MINIBATCH),
             "--total-timesteps", str(64 * frames), "--eval-every", "0", "--eval-episodes", "1",
             "--torch-threads", str(threads)]
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen([sys.executable, "-u", os.path.join(ROOT, script), *flags], cwd=workdir,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, last = [], [time.monotonic()]

        def read():
            for line in process.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith("iter "):
                    last[0] = time.monotonic()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        capped = False
        while sum(line.startswith("iter ") for line in lines) < iterations and process.poll() is None:
            if time.monotonic() - last[0] > cap:
                capped = True
                break
            time.sleep(0.2)
        load = os.getloadavg()[0]
        process.kill()
        process.wait()
        reader.join(timeout=5)
    per_iteration = []
    for line in lines:
        match = ITERATION_LINE.match(line)
        if match:
            seconds = float(match.group(2)) + float(match.group(3))
            per_iteration.append(round(frames / seconds, 1))
    if capped:
        per_iteration.append(round(frames / cap, 1))  # at most: the iteration had not ended after `cap` seconds
    if not per_iteration:
        raise SystemExit(f"error: {script} --torch-threads {threads} logged no iteration:\n" + "\n".join(lines[-20:]))
    return {"torch_threads": threads, "steps_per_s": per_iteration, "capped": capped, "load_1min": round(load, 2)}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--script", default="ppo_procgen.py", choices=sorted(QUICK_START),
                        help="the script whose quick start is timed")
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--candidates", type=int, nargs="+", default=[0, *sorted({1, max(1, cores // 2), cores})],
                        help="--torch-threads values (0: the script's default)")
    parser.add_argument("--load", type=int, default=4, help="busy background processes during the runs")
    parser.add_argument("--num-steps", type=int, default=16, choices=[16, 32, 64],
                        help="steps of each game a rollout (64: the quick start itself)")
    parser.add_argument("--iterations", type=int, default=3, help="iterations timed in each run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each candidate, alternated")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds after which an iteration is cut short")
    parser.add_argument("--out", help="JSON under benchmarks/results/")
    options = parser.parse_args(argv)
    load = start_load(options.load)
    runs = []
    try:
        time.sleep(5 if options.load else 0)  # the load is running before the first run starts
        for repeat in range(options.repeats):
            for threads in options.candidates:
                runs.append(one_run(options.script, threads, options.num_steps, options.iterations, options.cap))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for process in load:
            process.kill()
            process.wait()
    medians = {}
    for threads in options.candidates:
        mine = [run for run in runs if run["torch_threads"] == threads]
        medians[str(threads)] = {"median_steps_per_s": statistics.median(sps for run in mine
                                                                         for sps in run["steps_per_s"]),
                                 "capped_runs": sum(run["capped"] for run in mine)}
    record = {"command": " ".join(["python", "benchmarks/threads_at_load.py", *(argv or sys.argv[1:])]),
              "machine": f"{cpu_model()}, {os.cpu_count()} cores",
              "cores": cores, "medians": medians, "runs": runs}
    print(json.dumps(medians))
    if options.out:
        path = os.path.join(ROOT, "benchmarks", "results", options.out)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
