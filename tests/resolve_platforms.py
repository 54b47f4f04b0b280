"""Does requirements.txt install on every platform the README names? uv's resolver answers for any platform and
Python version from the package index's metadata, without that machine: for each of the 16 cells (CPython 3.11-3.14
on Linux x86-64 and aarch64, macOS 14+ on Apple Silicon and Windows x86-64) it resolves the file with wheels only
(gym, a pure-Python source distribution, aside) and checks which Procgen backend and numpy each cell gets.

    python tests/resolve_platforms.py [--json PATH]      (needs uv, in requirements.txt, and the package index)

Exit status 0 when all 16 cells resolve as intended, 1 otherwise, with one line per cell."""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHONS = ("3.11", "3.12", "3.13", "3.14")
# uv's names for the platforms; torch 2.13's macOS wheels need macOS 14 (uv assumes 13 unless told).
PLATFORMS = {"Linux x86-64": "x86_64-manylinux_2_28", "Linux aarch64": "aarch64-manylinux_2_28",
             "macOS arm64": "aarch64-apple-darwin", "Windows x86-64": "x86_64-pc-windows-msvc"}


def intended(platform, python):
    """What requirements.txt's environment markers ask for in this cell: the official package where it has wheels."""
    if platform == "Linux x86-64" and python in ("3.11", "3.12"):
        return {"procgen-mirror": "0.10.7", "numpy": "1.26.4"}
    return {"envpool": "1.2.5", "numpy": "2.4.6"}


def resolve(platform, python, requirements):
    """uv pip compile for one cell: (pinned versions by name, or None, and uv's last line)."""
    command = ["uv", "pip", "compile", "--quiet", "--no-header", "--only-binary", ":all:", "--no-binary", "gym",
               "--python-platform", PLATFORMS[platform], "--python-version", python, requirements]
    environment = {**os.environ, "MACOSX_DEPLOYMENT_TARGET": "14.0"}
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        return None, " ".join(lines[-2:])[:300]
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", result.stdout, flags=re.M))
    return {name.lower(): version for name, version in pins.items()}, ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requirements", default=os.path.join(ROOT, "requirements.txt"))
    parser.add_argument("--json", help="also write the cells' results to this file")
    args = parser.parse_args(argv)
    cells, start = [], time.time()
    for platform in PLATFORMS:
        for python in PYTHONS:
            pins, error = resolve(platform, python, args.requirements)
            wanted = intended(platform, python)
            wrong = error or "; ".join(f"{name} {pins.get(name)} instead of {version}"
                                       for name, version in wanted.items() if pins.get(name) != version)
            backend = "procgen-mirror" if "procgen-mirror" in wanted else "envpool"
            cells.append({"platform": platform, "python": python, "resolved": not wrong, "backend": backend,
                          "numpy": (pins or {}).get("numpy"), "torch": (pins or {}).get("torch"), "error": wrong})
            print(f"{platform:15} CPython {python}: {'ok' if not wrong else 'FAILED'}  {backend}, numpy "
                  f"{(pins or {}).get('numpy')}, torch {(pins or {}).get('torch')}  {wrong}", flush=True)
    good = sum(cell["resolved"] for cell in cells)
    print(f"{good} of {len(cells)} cells resolve with wheels ({time.time() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"uv": subprocess.run(["uv", "--version"], capture_output=True, text=True).stdout.strip(),
                       "date": time.strftime("%Y-%m-%d"), "cells": cells}, out, indent=1)
    return 0 if good == len(cells) else 1


if __name__ == "__main__":
    sys.exit(main())
