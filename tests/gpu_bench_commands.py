"""The GPU check's dry runs, shared by tests/test_gpu_check.py and tests/test_speed.py: the training commands
benchmarks/gpu_bench.sh would run, as its listing (DRY_RUN=1) gives them, each flag set parsed by its script's Args and
checked by its check_args; and one CPU dry run of the check itself at tiny flags, shared by every test that reads it."""
import functools
import importlib
import json
import os
import shlex
import subprocess
import sys
import types

import pytest
import tyro
from conftest import ROOT

# The steps the shared dry run runs: those whose processes the suite does not run elsewhere and that are cheap on a
# CPU (ppo-flags' six bench.py runs, impala-speed, nccl and cuda-tests are covered by the listing's parse, test_speed.py's
# harness test and tests/test_gpu_check.py's scaled run, cut pytest and count of the files a whole run writes).
DRY_RUN_STEPS = "preflight,ppo-speed,ppg-speed,learning,results"


def gpu_bench(out, tmp_dir, **environment):
    """The one command, as on a GPU machine but with GPU_CHECK_TINY=1: (the finished process, summary.json, the files
    in OUT, gpu_bench.log)."""
    return finish_gpu_bench(start_gpu_bench(out, tmp_dir, **environment), out)


def start_gpu_bench(out, tmp_dir, **environment):
    """gpu_bench's command, started: (the running process, the file in tmp_dir that its output goes to)."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_TINY": "1", "TMPDIR": str(tmp_dir),
           **environment}
    output = open(os.path.join(tmp_dir, "gpu_bench.output"), "w+")  # a file: a pipe nobody reads yet could fill
    process = subprocess.Popen(["bash", os.path.join(ROOT, "benchmarks", "gpu_bench.sh")], cwd=ROOT, env=env,
                               stdout=output, stderr=subprocess.STDOUT, text=True)
    return process, output


def finish_gpu_bench(started, out):
    """What gpu_bench returns, once the started process has ended."""
    process, output = started
    try:
        returncode = process.wait(timeout=600)
    finally:
        process.kill()
    with output:
        output.seek(0)
        finished = subprocess.CompletedProcess(process.args, returncode, output.read(), "")
    summary = json.loads((out / "summary.json").read_text())
    log = (out / "gpu_bench.log").read_text()
    return finished, summary, sorted(os.listdir(out)), log


@pytest.fixture(scope="session")
def tiny_gpu_check_started(tmp_path_factory):
    """The dry run behind tiny_gpu_check, started: (its folder, what start_gpu_bench returned). test_gpu_check.py
    starts it with the module, so that it runs while the module's other tests do."""
    tmp_dir = tmp_path_factory.mktemp("gpu_check")
    started = start_tiny_dry_run(tmp_dir)
    yield tmp_dir, started
    started[0].wait(timeout=600)  # when no test read it (a -k selection), it still ends before pytest does


@pytest.fixture(scope="session")
def tiny_gpu_check(tiny_gpu_check_started):
    """One CPU dry run of the check's first five steps, for every test that reads it (see start_tiny_dry_run)."""
    tmp_dir, started = tiny_gpu_check_started
    out = tmp_dir / "out"
    finished, summary, files, log = finish_gpu_bench(started, out)
    steps = {step["name"]: step for step in summary["steps"]}
    return types.SimpleNamespace(finished=finished, summary=summary, steps=steps, files=files, log=log, out=out)


def start_tiny_dry_run(tmp_dir):
    """The dry run behind tiny_gpu_check; the deadline and every budget tripled (a scaled deadline), since tiny runs on
    a shared 2-core machine can take most of a GPU step's budget."""
    return start_gpu_bench(tmp_dir / "out", tmp_dir, GPU_CHECK_STEPS=DRY_RUN_STEPS, GPU_CHECK_TIME_SCALE="3",
                           DEADLINE=str(3 * 540))


@functools.cache  # one listing per setting for the whole test run
def parsed_commands(tiny):
    """(the dry run's listing, [(script, flags)] of its bench.py configurations, learning runs and NCCL check), at the
    real flags (tiny "") or the CPU dry run's (tiny "1")."""
    listing = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_bench.sh")], cwd=ROOT, text=True,
                             capture_output=True, check=True,
                             env={**os.environ, "DRY_RUN": "1", "GPU_CHECK_TINY": tiny}).stdout
    parsed = []
    for line in listing.splitlines():
        words = shlex.split(line)
        if "bench.py" in line:
            script = words[words.index("--script") + 1]
            common = words[words.index("--common") + 1] if "--common" in words else ""
            flag_sets = [common + " " + words[i + 1].split("=", 1)[1] for i, w in enumerate(words) if w == "--config"]
        elif line.startswith("learn "):
            script, flag_sets = "ppo_procgen.py", [line.split("SCRIPT ", 1)[1]]
        elif "torch.distributed.run" in line:
            script = next(word for word in words if word.endswith(".py"))
            flag_sets = [shlex.join(words[words.index(script) + 1:])]
        else:
            continue
        module = importlib.import_module(os.path.splitext(script)[0])
        for flags in flag_sets:
            module.check_args(tyro.cli(module.Args, args=shlex.split(flags)))
            parsed.append((script, flags))
    return listing, parsed
