"""The GPU check's first step (benchmarks/gpu_check.py): in seconds, whether everything the later
steps need is there, or one line naming what is missing.

  python benchmarks/gpu_preflight.py [--json PATH]

Prints the versions of Python, glibc, torch, CUDA, cuDNN, the GPU's driver and every package the
scripts and the check import; imports the three Procgen scripts; plays one step of two Procgen games
through the scripts' own adapter (procgen's bundled Qt loads libGL, libglib-2.0 and the X11
libraries: a machine without them fails here, with the library's name); runs one matrix
product and one convolution on the GPU against the CPU's. The last line is `preflight: ok` or
`preflight: missing: <what>`. Exit status 0: everything is there; 1: a package, a library or the
Procgen step is missing, so no later step can run; 2: only CUDA is missing (the steps would run on
the CPU, as in the CPU dry run of tests/test_gpu_check.py). --json writes the same as JSON. Only the
standard library is imported at the top, so that a missing package is reported, not raised.
"""
import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (module, distribution): everything the scripts, bench.py, results.py and the CUDA tests import,
# procgen's own needs (gym3 imports imageio at its import, procgen's builder filelock, gymnasium
# cloudpickle) included.
REQUIRED = [("numpy", "numpy"), ("torch", "torch"), ("typing_extensions", "typing_extensions"),
            ("tyro", "tyro"), ("docstring_parser", "docstring-parser"), ("typeguard", "typeguard"),
            ("gymnasium", "gymnasium"), ("cloudpickle", "cloudpickle"), ("imageio", "imageio"),
            ("filelock", "filelock"), ("matplotlib", "matplotlib"), ("tensorboard", "tensorboard"),
            ("pytest", "pytest")]
# The Procgen backend that requirements.txt installs on this platform (docs/platforms.md): procgen-mirror with the
# old gym and gym3, or EnvPool.
BACKEND_REQUIRED = {"procgen": [("gym", "gym"), ("cffi", "cffi"), ("gym3", "gym3"), ("procgen", "procgen-mirror")],
                    "envpool": [("envpool", "envpool")]}
# Used only by flags the check never sets (videos, Weights & Biases), or to run tests in parallel.
OPTIONAL = [("av", "av"), ("wandb", "wandb"), ("xdist", "pytest-xdist")]
MINIMUM_VERSIONS = {"typing_extensions": (4, 13)}  # tyro 1.0.17's; older ones import, fail later


def version_tuple(text):
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def one_line(error):
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def distribution_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_imports(report):
    """Imports every required package (procgen's import loads its C++ games and, through them,
    Qt's system libraries); of the optional ones only the versions (wandb takes seconds)."""
    for _, distribution in OPTIONAL:
        report["packages"][distribution] = distribution_version(distribution)
    backend = "procgen" if importlib.util.find_spec("procgen") else "envpool"  # the scripts' --env-backend auto
    for module, distribution in REQUIRED + BACKEND_REQUIRED[backend]:
        version = distribution_version(distribution)
        report["packages"][distribution] = version
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # old gym prints a notice when procgen imports it
                importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 -- any failure to import is what this reports
            report["missing"].append(f"import {module}: {one_line(error)}")
            continue
        minimum = MINIMUM_VERSIONS.get(module)
        if minimum and (version is None or version_tuple(version) < minimum):
            wanted = ".".join(map(str, minimum))
            report["missing"].append(f"{distribution} >= {wanted} (found {version}; pip install -r requirements.txt)")


def check_procgen_step(report):
    """Two games, one step, through the adapter the scripts train on."""
    sys.path.insert(0, ROOT)
    try:
        import numpy as np

        import ppo_procgen
        import ppg_procgen  # noqa: F401 -- their imports and module-level code must run too
        import vtrace  # noqa: F401
        envs = ppo_procgen.ProcgenVecEnv(2, "bigfish")
        frames, _ = envs.reset(seed=1)
        frames, rewards, terminated, _, _ = envs.step(np.zeros(2, dtype=np.int64))
        envs.close()
        if frames.shape != (2, 64, 64, 3) or frames.dtype != np.uint8:
            raise RuntimeError(f"frames of shape {frames.shape} and dtype {frames.dtype}, "
                               "not (2, 64, 64, 3) uint8")
        report["procgen_step"] = "ok"
    except Exception as error:  # noqa: BLE001
        report["missing"].append(f"a Procgen step: {one_line(error)}")


def nvidia_smi():
    """The driver's version, the GPU's name and memory, from nvidia-smi (None where it is
    absent)."""
    try:
        answer = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total",
                                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return answer.stdout.strip() or answer.stderr.strip() or None


def check_cuda(report):
    """One matrix product and one convolution (cuDNN) on the GPU, against the same on the CPU."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:  # noqa: BLE001 -- already reported as a missing import
        return
    report["torch"] = torch.__version__
    report["cuda"] = torch.version.cuda
    if not torch.cuda.is_available():
        report["cuda_missing"] = (f"CUDA: torch {torch.__version__} sees no GPU "
                                  "(torch.cuda.is_available() is False)")
        return
    try:
        report["gpu"] = torch.cuda.get_device_name(0)
        report["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        report["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        report["cudnn"] = torch.backends.cudnn.version()
        generator = torch.Generator().manual_seed(0)
        matrix = torch.randn(512, 512, generator=generator)
        frames = torch.randn(2, 3, 64, 64, generator=generator)
        weights = torch.randn(16, 3, 3, 3, generator=generator)
        checks = {"matrix product": (matrix @ matrix, (matrix.cuda() @ matrix.cuda()).cpu()),
                  "convolution": (F.conv2d(frames, weights), F.conv2d(frames.cuda(), weights.cuda()).cpu())}
        torch.cuda.synchronize()
        for name, (on_cpu, on_gpu) in checks.items():
            error = (on_gpu - on_cpu).abs().max() / on_cpu.abs().max()  # TF32 convolutions: about 1e-3
            if not error < 1e-2:
                raise RuntimeError(f"a {name} on the GPU differs from the CPU's by {error:.2g} "
                                   "of its largest value")
        report["cuda_op"] = "ok"
    except Exception as error:  # noqa: BLE001
        report["cuda_missing"] = f"CUDA: {one_line(error)}"


def check_machine(report):
    """What is not a package: the C library's version, a C compiler for torch.compile (Triton
    builds its launchers with one), the driver."""
    report["glibc"] = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    if not any(shutil.which(name) for name in ("cc", "gcc", "clang")):
        report["warnings"].append("no C compiler (cc, gcc, clang): --compile will fail (Triton builds with one)")
    report["driver"] = nvidia_smi()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the report here as JSON")
    args = parser.parse_args(argv)
    start = time.time()
    report = {"python": platform.python_version(), "executable": sys.executable, "packages": {}, "missing": [],
              "warnings": [], "ld_library_path": os.environ.get("LD_LIBRARY_PATH"),
              "pythonpath": os.environ.get("PYTHONPATH")}
    check_machine(report)
    check_imports(report)
    check_procgen_step(report)
    check_cuda(report)
    report["seconds"] = round(time.time() - start, 1)
    for key in ("python", "glibc", "torch", "cuda", "cudnn", "driver", "gpu", "gpu_capability", "gpu_memory_gb"):
        print(f"{key}: {report.get(key)}")
    print("packages: " + ", ".join(f"{name} {version}" for name, version in report["packages"].items()))
    for warning in report["warnings"]:
        print(f"warning: {warning}")
    missing = list(report["missing"])
    if "cuda_missing" in report:
        missing.append(report["cuda_missing"])
    report["status"] = "ok" if not missing else "missing: " + "; ".join(missing)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"preflight: {report['status']}", flush=True)
    if report["missing"]:
        return 1
    return 2 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
