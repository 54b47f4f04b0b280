"""Environment steps per second of the two Procgen backends behind the scripts' adapter (`ProcgenVecEnv`), measured
side by side: each timing in a fresh interpreter, the one given for its backend (requirements.txt installs
procgen-mirror with numpy 1.26 on CPython 3.11 and 3.12, EnvPool with numpy 2 on 3.13; one interpreter with both
installed may be given twice), alternated round by round so that a change in the machine's load falls on both. Each
round's ratio is kept too: how far apart the rounds are shows how much one comparison can be trusted.

    python benchmarks/env_backends.py --procgen-python .venv/bin/python --envpool-python .venv313/bin/python \
        --games starpilot bigfish bossfight --rounds 5 --out benchmarks/results/cpu_env_backends.json

What is timed is what a rollout sees: `ProcgenVecEnv.step` on --num-envs games with uniformly random actions (EnvPool's
extra reset step for finished games included), after a warm-up, --env-threads worker threads per backend."""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(backend, game, num_envs, steps, threads):
    """One timing in this interpreter: adapter steps per second x games."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import ppo_procgen

    envs = ppo_procgen.ProcgenVecEnv(num_envs, game, num_threads=threads, backend=backend)
    envs.reset(seed=1)
    actions = np.random.default_rng(0).integers(15, size=(steps + 50, num_envs))
    for action in actions[:50]:  # warm-up: the games' first episodes are drawn, the assets are loaded
        envs.step(action)
    ends, start = 0, time.perf_counter()
    for action in actions[50:]:
        ends += int(envs.step(action)[2].sum())
    seconds = time.perf_counter() - start
    envs.close()
    return {"steps_per_second": num_envs * steps / seconds, "seconds": seconds, "episode_ends": ends,
            "numpy": np.__version__, "python": platform.python_version()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--procgen-python", help="an interpreter with procgen-mirror installed")
    parser.add_argument("--envpool-python", help="an interpreter with envpool installed")
    parser.add_argument("--games", nargs="+", default=["starpilot", "bigfish", "bossfight"], help="games timed")
    parser.add_argument("--num-envs", type=int, default=64, help="the scripts' default --num-envs")
    parser.add_argument("--steps", type=int, default=400, help="vector steps per timing")
    parser.add_argument("--env-threads", type=int, default=1, help="the scripts' choice on a CPU (thread_split)")
    parser.add_argument("--rounds", type=int, default=5, help="timings of each backend, alternated")
    parser.add_argument("--out", help="write the timings and their medians to this JSON file")
    parser.add_argument("--worker", nargs=2, metavar=("BACKEND", "GAME"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(*args.worker, args.num_envs, args.steps, args.env_threads)))
        return
    if not (args.procgen_python and args.envpool_python):
        parser.error("give both --procgen-python and --envpool-python")
    pythons = {"procgen": args.procgen_python, "envpool": args.envpool_python}
    results = {game: {backend: [] for backend in pythons} for game in args.games}
    for round_ in range(args.rounds):
        for game in args.games:
            order = list(pythons) if round_ % 2 == 0 else list(pythons)[::-1]  # A B, then B A
            for backend in order:
                command = [pythons[backend], os.path.abspath(__file__), "--worker", backend, game,
                           "--num-envs", str(args.num_envs), "--steps", str(args.steps),
                           "--env-threads", str(args.env_threads)]
                timing = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
                timing["load_average_1min"] = os.getloadavg()[0]
                results[game][backend].append(timing)
                print(f"round {round_ + 1} {game:10} {backend:8} {timing['steps_per_second']:8.0f} steps/s "
                      f"(load {timing['load_average_1min']:.1f})", flush=True)
    summary = {}
    for game, by_backend in results.items():
        medians = {backend: statistics.median(t["steps_per_second"] for t in timings)
                   for backend, timings in by_backend.items()}
        # Each round's two timings ran back to back: their ratio shows how much one comparison can move.
        per_round = [envpool["steps_per_second"] / procgen["steps_per_second"]
                     for procgen, envpool in zip(by_backend["procgen"], by_backend["envpool"])]
        summary[game] = {**{f"{backend}_median": value for backend, value in medians.items()},
                         "envpool_over_procgen": medians["envpool"] / medians["procgen"],
                         "envpool_over_procgen_per_round": per_round}
        print(f"{game:10} procgen-mirror {medians['procgen']:8.0f}  EnvPool {medians['envpool']:8.0f} steps/s  "
              f"ratio {summary[game]['envpool_over_procgen']:.2f} (per round "
              f"{min(per_round):.2f}-{max(per_round):.2f})")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
                       "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                       "num_envs": args.num_envs, "steps": args.steps, "env_threads": args.env_threads,
                       "summary": summary, "timings": results}, out, indent=1)


if __name__ == "__main__":
    main()
