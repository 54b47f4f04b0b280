"""How long a SIGTERM takes to stop a script at its defaults (SLURM's default grace before its SIGKILL is
30 s). Each --at value is one run of the script, in a folder of its own, sent SIGTERM that many seconds after it
started; the time from the signal to the process's exit is its latency. The JSON keeps each run's exit status, its
latency, the machine's load and the script's own stop line.

  python benchmarks/sigterm_latency.py --script ppg_procgen.py --at 40 120 240 --out sigterm_latency_ppg_cpu.json

The script runs at its defaults on --env-id's game.
"""
import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_lines(stream, lines):
    """Each line of `stream` with the time it came, into `lines`."""
    for line in stream:
        lines.append((time.perf_counter(), line.rstrip("\n")))


def one_run(script, flags, at):
    """The script started in a temporary folder, SIGTERM after `at` seconds; returns its record: the seconds from
    the signal to the stop line (the checkpoint written) and to the process's end."""
    lines = []
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen([sys.executable, "-u", os.path.join(ROOT, script), *flags], cwd=workdir,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=read_lines, args=(process.stdout, lines))
        reader.start()
        try:
            process.wait(at)
            return {"at": at, "exit": process.returncode, "error": "ended before the signal"}
        except subprocess.TimeoutExpired:
            pass
        load = os.getloadavg()[0]
        sent = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        process.wait()
        ended = time.perf_counter()
        reader.join()
    iterations = [line.split(" | ")[0] for _, line in lines if line.startswith("iter ")]
    stops = [(when, line) for when, line in lines if line.startswith(("interrupted by", "stopped at once"))]
    record = {"at": at, "exit": process.returncode, "latency_s": round(ended - sent, 2), "load_1min": round(load, 2),
              "iterations_logged": iterations}
    if stops:
        record.update(to_stop_line_s=round(stops[-1][0] - sent, 2), stop_line=stops[-1][1])
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--script", required=True, choices=["ppo_procgen.py", "ppg_procgen.py", "vtrace.py"],
                        help="the script run at its defaults")
    parser.add_argument("--at", type=float, nargs="+", required=True, help="seconds after the start, one run each")
    parser.add_argument("--out", help="JSON under benchmarks/results/")
    parser.add_argument("--env-id", default="starpilot", help="the game; every other flag is the script's default")
    options = parser.parse_args(argv)
    runs = []
    for at in options.at:
        runs.append(one_run(options.script, ["--env-id", options.env_id], at))
        print(json.dumps(runs[-1]), flush=True)
    record = {"command": " ".join(["python", "benchmarks/sigterm_latency.py", *(argv or sys.argv[1:])]),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "runs": runs}
    if options.out:
        path = os.path.join(ROOT, "benchmarks", "results", options.out)
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
