"""Mutation testing: does the test suite catch one-line bugs in the algorithms?

benchmarks/mutants.toml lists plausible one-line bugs in the code that carries the papers' equations (a clip bound, a
sign, lambda left out of GAE, a KL the wrong way round, V-trace's log rho one step off, ...): each an id, the file, an
exact piece of one line and what replaces it, and the tests that should catch it. For each mutant the runner copies
the working tree into a fresh temporary folder (the tree itself is never written: a killed run leaves it intact),
applies the one replacement there and runs the mutant's tests with `pytest -x` (stop at the first failure) under a
time limit. A mutant is `caught` (a test failed: which one is recorded), `missed` (all passed), `equivalent` (missed,
and the catalogue argues why no test can tell it from the original), `timeout`, `stale` (its original text is gone or
not unique: never counted as caught) or `error` (pytest could not run the tests: a collection error). The unmutated
tests run first, once: if any fails there the runner stops.

  python benchmarks/mutate.py                       (every mutant; writes benchmarks/results/mutation.json)
  python benchmarks/mutate.py --only ppo-clip-lower-bound gae-no-lambda --jobs 1
  python benchmarks/mutate.py --list

Why not mutmut or cosmic-ray: they generate mutants mechanically, one for each operator or constant they can change
on every line of a module, so for these scripts mostly in plumbing (flags, logs, checkpoints, signals), each to be
triaged by hand as a bug or an equivalent change. What is tested here instead is a
fixed, reviewed list of the bugs a reader of the papers could make, each with its description and its own quick
selection of tests, so that a whole pass takes minutes on two cores and its score says which equations the tests
pin down.
"""
import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOGUE = os.path.join(ROOT, "benchmarks", "mutants.toml")
# What a copy of the tree leaves out: .gitignore's entries (runs, caches, checkpoints) and git's own folder.
NOT_COPIED = (".git", ".venv", ".venv313", "__pycache__", ".pytest_cache", "runs", "wandb", "videos", "*.pt", "*.tmp")
DEFAULT_TIMEOUT = 240  # seconds for one mutant's tests; a mutant may set its own `timeout`


def load_catalogue(path=CATALOGUE):
    """The mutants of the TOML catalogue, in its order: dicts with id, file, original, replacement, description,
    tests (pytest node ids or test files) and optionally equivalent (the argument) and timeout."""
    with open(path, "rb") as f:
        return tomllib.load(f)["mutant"]


def apply_mutant(text, mutant):
    """The file's text with the mutant's one replacement; None when its original is not exactly once in the text
    (the catalogue is stale: the code changed under it)."""
    if text.count(mutant["original"]) != 1:
        return None
    return text.replace(mutant["original"], mutant["replacement"])


def copy_tree(source, destination):
    """The working tree's files as they are now, without runs, caches and virtual environments."""
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)


def pytest_command(tests, basetemp):
    """One process, stop at the first failure, no cache written, failures and errors summarized by node id."""
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0", "-rfE",
            f"--basetemp={basetemp}", *tests]


def run_tests(folder, tests, timeout, running=None):
    """Runs `tests` in `folder`. Returns (pytest's exit status or None after the time limit, its output). The
    tests' process group is killed at the time limit (and on Ctrl-C: `running` holds the live processes)."""
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("PYTEST_", "COV_"))}  # not the settings of a pytest that runs this
    environment["PYTHONDONTWRITEBYTECODE"] = "1"
    process = subprocess.Popen(pytest_command(tests, os.path.join(folder, ".pytest-tmp")), cwd=folder,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment, start_new_session=True)
    if running is not None:
        running.add(process)
    try:
        output, _ = process.communicate(timeout=timeout)
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the tests' own children too (a forked server, torchrun)
        output, _ = process.communicate()
        return None, output
    except BaseException:  # Ctrl-C: the tests run in their own session, which no terminal signal reaches
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        if running is not None:
            running.discard(process)


def first_failure(output):
    """The node id of the first FAILED or ERROR line of pytest's short summary, else None."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0].strip()
    return None


def classify(mutant, status, output):
    """(status, the catching test or a reason) from pytest's exit status: 1 a test failed, 0 all passed, None the
    time limit; anything else (2: collection errors, 4: a bad node id, 5: no tests) means the tests did not run."""
    if status == 1:
        return "caught", first_failure(output)
    if status == 0:
        return ("equivalent" if mutant.get("equivalent") else "missed"), None
    if status is None:
        return "timeout", None
    lines = [line for line in output.splitlines() if line.strip()]
    return "error", f"pytest exit status {status}: {lines[-1] if lines else ''}"


def run_mutant(mutant, snapshot, running=None):
    """One mutant in a fresh copy of `snapshot` (a folder). Returns its record."""
    start = time.perf_counter()
    record = {"id": mutant["id"], "file": mutant["file"], "description": mutant["description"]}
    with open(os.path.join(snapshot, mutant["file"])) as f:
        mutated = apply_mutant(f.read(), mutant)
    if mutated is None:
        return {**record, "status": "stale", "seconds": 0.0, "caught_by": None}
    folder = tempfile.mkdtemp(prefix=f"mutant-{mutant['id']}-")
    try:
        copy_tree(snapshot, os.path.join(folder, "tree"))
        with open(os.path.join(folder, "tree", mutant["file"]), "w") as f:
            f.write(mutated)
        status, output = run_tests(os.path.join(folder, "tree"), mutant["tests"],
                                   mutant.get("timeout", DEFAULT_TIMEOUT), running)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    status, caught_by = classify(mutant, status, output)
    return {**record, "status": status, "seconds": round(time.perf_counter() - start, 1), "caught_by": caught_by}


def baseline(mutants, snapshot, timeout, running=None):
    """The union of the mutants' tests on the unmutated snapshot: (passed, seconds, the first failure or reason)."""
    tests = list(dict.fromkeys(test for mutant in mutants for test in mutant["tests"]))
    start = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="mutant-baseline-")
    try:
        copy_tree(snapshot, os.path.join(folder, "tree"))
        status, output = run_tests(os.path.join(folder, "tree"), tests, timeout, running)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seconds = round(time.perf_counter() - start, 1)
    if status == 0:
        return True, seconds, None
    reason = "the time limit" if status is None else first_failure(output) or f"pytest exit status {status}"
    return False, seconds, reason


def hardware():
    """The machine in one line: the CPU's model name, its cores, and whether torch sees a GPU."""
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        model = names[0] if names else model
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{model}, {os.cpu_count()} cores, {gpu}"


def versions():
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__}


TOTALS = ("caught", "missed", "equivalent", "timeout", "stale", "error")


def write_json(path, data):
    """All of `data` or what the file held before: a temporary file renamed over it."""
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(temporary, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants (ids of the catalogue)")
    parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at the same time, each in one process")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mutation.json"),
                        help="the JSON result file")
    parser.add_argument("--catalogue", default=CATALOGUE, help="the TOML catalogue of mutants")
    parser.add_argument("--root", default=ROOT, help="the tree whose copies are mutated")
    args = parser.parse_args()
    mutants = load_catalogue(args.catalogue)
    if args.list:
        for mutant in mutants:
            equivalent = "  (argued equivalent)" if mutant.get("equivalent") else ""
            print(f"{mutant['id']:<38} {mutant['file']:<16} {mutant['description']}{equivalent}")
        return
    if args.only:
        unknown = sorted(set(args.only) - {mutant["id"] for mutant in mutants})
        if unknown:
            raise SystemExit(f"error: --only {' '.join(unknown)}: no such mutant (see --list)")
        mutants = [mutant for mutant in mutants if mutant["id"] in args.only]
    if args.jobs < 1:
        raise SystemExit(f"error: --jobs {args.jobs} must be >= 1")

    start, load = time.perf_counter(), [round(value, 2) for value in os.getloadavg()]
    running = set()  # the live pytest processes, killed on Ctrl-C
    stopping = threading.Event()
    snapshot_folder = tempfile.mkdtemp(prefix="mutant-snapshot-")
    try:
        # One snapshot of the tree for the whole pass: the baseline and every mutant test the same files, even
        # while people edit the working tree.
        snapshot = os.path.join(snapshot_folder, "tree")
        copy_tree(args.root, snapshot)
        passed, baseline_seconds, reason = baseline(mutants, snapshot, DEFAULT_TIMEOUT * 4, running)
        if not passed:
            raise SystemExit(f"error: the unmutated tests fail ({reason}); mutation testing needs them green")
        print(f"baseline: the {len(mutants)} mutants' tests pass unmutated ({baseline_seconds:.0f} s)")
        width = max(len(mutant["id"]) for mutant in mutants)
        print(f"{'mutant':<{width}} {'status':<10} {'seconds':>7}  caught by")

        def one(mutant):
            if stopping.is_set():
                return None
            return run_mutant(mutant, snapshot, running)

        records = {}
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(one, mutant) for mutant in mutants]
            try:
                for future in concurrent.futures.as_completed(futures):
                    record = future.result()
                    records[record["id"]] = record
                    print(f"{record['id']:<{width}} {record['status']:<10} {record['seconds']:>7.1f}  "
                          f"{record['caught_by'] or ''}", flush=True)
            except KeyboardInterrupt:  # the workers' tests are killed here, before the pool waits for them
                stopping.set()
                for process in list(running):
                    with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                        os.killpg(process.pid, signal.SIGKILL)
                raise
    except KeyboardInterrupt:
        raise SystemExit("interrupted: no result file written") from None
    finally:
        shutil.rmtree(snapshot_folder, ignore_errors=True)

    ordered = [records[mutant["id"]] for mutant in mutants]
    totals = {status: sum(record["status"] == status for record in ordered) for status in TOTALS}
    wall = time.perf_counter() - start
    print("totals: " + ", ".join(f"{count} {status}" for status, count in totals.items()) +
          f" of {len(ordered)} mutants, {wall / 60:.1f} min")
    command = "python benchmarks/mutate.py" + "".join(f" {arg}" for arg in sys.argv[1:])
    result = {"command": command, "date": time.strftime("%Y-%m-%d"), "hardware": hardware(), **versions(),
              "load_average_at_start": load,  # 1, 5 and 15 minutes: other jobs stretch the wall time
              "jobs": args.jobs, "baseline_seconds": baseline_seconds, "wall_seconds": round(wall, 1),
              "totals": totals, "mutants": ordered}
    write_json(args.out, result)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
