"""StarPilot on a CPU against the baselines' pace: the tables of docs/results.md ("PPO and IMPALA on StarPilot, on a
2-core CPU") from the committed runs in benchmarks/results/procgen_cpu/ (their args.json and metrics.jsonl).

  python benchmarks/procgen_cpu.py                      # the markdown tables, as docs/results.md shows them
  python benchmarks/results.py benchmarks/results/procgen_cpu --out docs/procgen_cpu   # the figure

Ours: the mean return of the last 100 training episodes (`charts/episodic_return_last100`) at each step, mean +- std
over seeds; the anchor: train-procgen's baselines PPO, easy mode, all levels (its `eprewmean`, the same quantity),
its three seeds' mean [min, max] at the same step. About 160 episodes end in each 16,384-step iteration, so either
value is one iteration's statistic and moves by about 0.4 between iterations; the "last 8 iterations" columns average
each run over the 8 logged iterations that end at the step (both sides, from every logged row: the anchor's from
benchmarks/reference/train_procgen_first_1M.json.gz). A run that has not reached a step yet shows "-" there.
"""
import argparse
import gzip
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "reference"))
import results  # noqa: E402  (read_run, last100_curve: the same reading as the figures')
from on_track import load_references, reference_at  # noqa: E402

RUNS = os.path.join(HERE, "results", "procgen_cpu")
STEPS = (131_072, 262_144, 524_288)
ANCHOR = "train_procgen/easy-all"
ITERATION = 64 * 256  # steps per iteration, ours at the defaults and the anchor's (1 worker x 64 envs x 256 steps)
WINDOW = 8  # iterations averaged in the windowed columns


def anchor_window_means(game, step, window=WINDOW):
    """Each anchor seed's mean over its `window` logged rows that end at `step` (every row, from the early file)."""
    with gzip.open(os.path.join(HERE, "reference", "train_procgen_first_1M.json.gz"), "rt") as f:
        data = json.load(f)
    means = []
    for seed in data["experiments"]["easy-all"]["seeds"]:
        curve = data["curves"][seed][game]
        wanted = [step - k * ITERATION for k in range(window)]
        by_step = dict(zip(curve["steps"], curve["returns"]))
        means.append(float(np.mean([by_step[s] for s in wanted])))
    return np.array(means)


def window_mean(run, step, window=WINDOW):
    """The run's mean of `charts/episodic_return_last100` over the `window` iterations ending at `step`, or None."""
    steps, returns = results.last100_curve(run)
    wanted = [step - k * ITERATION for k in range(window)]
    if not all(np.any(steps == s) for s in wanted):
        return None
    return float(np.mean([returns[np.flatnonzero(steps == s)[0]] for s in wanted]))


def read_runs(folder):
    """{algorithm label: [runs sorted by seed]} of the finished or partial runs under `folder`."""
    by_algorithm = {}
    for path in results.find_runs(folder):
        run = results.read_run(path)
        by_algorithm.setdefault(run.algorithm, []).append(run)
    return {label: sorted(runs, key=lambda run: run.seed) for label, runs in sorted(by_algorithm.items())}


def return_at(run, step):
    """The run's last-100-episode mean at `step` (a logged row's value), or None if it has not logged that step."""
    steps, returns = results.last100_curve(run)
    exact = np.flatnonzero(steps == step)
    return float(returns[exact[0]]) if len(exact) else None


def mean_std(values):
    if not values:
        return "-"
    spread = f" ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else ""
    return f"{np.mean(values):.2f}{spread} ({len(values)} seed{'s' * (len(values) > 1)})"


def pace_table(by_algorithm, game="starpilot"):
    """Markdown: per step, each algorithm's mean +- std over seeds and the anchor's seeds."""
    anchor = load_references()[ANCHOR]
    labels = list(by_algorithm)
    header = ([f"ours: {label}" for label in labels] + ["baselines PPO easy-all: mean [min, max]"]
              + [f"ours: {label}, last {WINDOW} iterations" for label in labels]
              + [f"baselines PPO, last {WINDOW} iterations"])
    lines = ["| step | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for step in STEPS:
        points = []
        windows = []
        for label in labels:
            values = [return_at(run, step) for run in by_algorithm[label]]
            points.append(mean_std([value for value in values if value is not None]))
            values = [window_mean(run, step) for run in by_algorithm[label]]
            windows.append(mean_std([value for value in values if value is not None]))
        theirs = reference_at(anchor, game, step)
        theirs_window = anchor_window_means(game, step)
        cells = (points + [f"{theirs.mean():.2f} [{theirs.min():.2f}, {theirs.max():.2f}]"] + windows
                 + [f"{theirs_window.mean():.2f} [{theirs_window.min():.2f}, {theirs_window.max():.2f}]"])
        lines.append(f"| {step:,} | " + " | ".join(cells) + " |")
    return lines


def runs_table(by_algorithm):
    """Markdown: one row per run: seed, steps reached, wall time, steps per second, final last-100 mean."""
    lines = ["| run | seed | steps reached | wall time | steps/s | last-100 mean at its last step |",
             "|---|---|---|---|---|---|"]
    for label, runs in by_algorithm.items():
        for run in runs:
            rows = [row for row in run.rows if "charts/episodic_return_last100" in row]
            last = rows[-1]
            hours = last["time"] / 3600
            lines.append(f"| {label} | {run.seed} | {last['global_step']:,} | {hours:.2f} h | "
                         f"{last['global_step'] / last['time']:.0f} | {last['charts/episodic_return_last100']:.2f} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="?", default=RUNS, help="folder of run folders (default: %(default)s)")
    options = parser.parse_args(argv)
    by_algorithm = read_runs(options.runs)
    text = "\n".join(pace_table(by_algorithm) + [""] + runs_table(by_algorithm))
    print(text)
    return text


if __name__ == "__main__":
    main()
