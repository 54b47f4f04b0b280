"""The training commands benchmarks/gpu_bench.sh would run, as its dry run (DRY_RUN=1) lists them, each flag set
parsed by its script's Args and checked by its check_args: one parser for tests/test_gpu_check.py and
tests/test_speed.py."""
import functools
import importlib
import os
import shlex
import subprocess

import tyro
from conftest import ROOT


@functools.cache  # one dry run per setting for the session
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
