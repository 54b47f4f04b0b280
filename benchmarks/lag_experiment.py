"""The lag experiment: what V-trace's correction buys as the policy lag grows.

vtrace.py trains with a deterministic policy lag k (--deterministic-lag: unroll n is played with the parameters of
exactly n - k updates ago) and --correction vtrace or none (importance weights fixed to 1, the unrolls learned from as
if on-policy), for k in {0, 1, 4, 16, 64} x 3 seeds, on two pixel tasks small enough for a CPU:
  cue       tests/conftest.py's CueEnv: a contextual bandit (the action matching the frame's colour earns 1, 8 steps)
  corridor  CueEnv where a wrong action ends the episode: the value of an action includes the rewards that the policy
            collects after it, so it depends on which policy plays on (sequential credit assignment)
Every other setting is the learning test's (tests/test_vtrace_learner.py: 16 games, T = 8, lr 2e-3, gamma 0.9,
channels (8,), hidden 32), for 20 iterations of 10 updates; nothing was tuned to these results.
What was expected before the runs (written before them): on `cue` the uncorrected policy gradient still pushes up the
matching action (the next frame does not depend on the action), so little or no gap; on `corridor` the uncorrected
value targets estimate the stale policy's value instead of the learner's, so a gap may open as k grows.

Writes the raw results (JSON: per run, the evaluation return after every iteration and the lags trained at), a PNG of
the learning curves (mean and standard error over seeds) and prints a Markdown table of the final returns (mean of the
last 5 evaluations of each run; mean +- standard error over seeds). Deterministic: a rerun gives the same numbers on
the same CPU software stack. A run takes 22 s on the idle 2-core machine (35-130 s, 64 minutes for all 60, while
other jobs ran).

  python benchmarks/lag_experiment.py              (all 60 runs; writes the defaults of --out and --plot)
  python benchmarks/lag_experiment.py --plot-only  (redraws the plot and the table from --out)
"""
import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import vtrace  # noqa: E402
from conftest import CueEnv  # noqa: E402

FINAL_EVALUATIONS = 5  # the final return of a run: the mean of its last 5 evaluations (5 x 16 episodes)


class CueCorridorEnv(CueEnv):
    """CueEnv with sequential credit assignment: the matching action earns 1 and the episode goes on (at most
    `length` steps); any other action earns 0 and ends it. Random play earns sum_i (1/15)^i ~ 0.07 per episode, a
    solved task 8."""

    def step(self, actions):
        match = np.asarray(actions) == self.cue
        self.t += 1
        done = (self.t >= self.length) | ~match
        self.t[done] = 0
        self.cue = self.np_random.integers(self.num_cues, size=self.num_envs)
        return self._frames(), match.astype(np.float64), done, np.zeros(self.num_envs, dtype=bool), {}


TASKS = {"cue": CueEnv, "corridor": CueCorridorEnv}


def run(task, lag, correction, seed, iterations):
    """One deterministic-lag training run on `task`; returns its evaluation curve and lag histogram."""
    vtrace.ProcgenVecEnv = lambda num_envs, *arguments, **keywords: TASKS[task](num_envs)  # envs and evaluation
    args = vtrace.Args(env_id="coinrun", num_envs=16, unroll_length=8, updates_per_iteration=10,
                       total_timesteps=iterations * 10 * 16 * 8, max_policy_lag=lag, deterministic_lag=True,
                       correction=correction, channels=(8,), hidden_size=32, learning_rate=2e-3, gamma=0.9,
                       eval_every=1, eval_episodes=16, seed=seed, exp_name=f"lag{lag}_{correction}",
                       torch_threads=2)  # the published runs' count: another one rounds differently
    with tempfile.TemporaryDirectory() as workdir, contextlib.chdir(workdir), \
            contextlib.redirect_stdout(io.StringIO()):
        run_dir = vtrace.train(args)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    evaluations = [row["eval/episodic_return"] for row in rows if "eval/episodic_return" in row]
    trained = [row for row in rows if "losses/policy_loss" in row]
    lag_counts = np.sum([[row[f"policy_lag/count_{k}"] for k in range(lag + 1)] for row in trained], axis=0)
    return {"task": task, "lag": lag, "correction": correction, "seed": seed,
            "updates": [row["iteration"] * args.updates_per_iteration for row in trained],
            "eval_return": evaluations, "train_return": [row["charts/episodic_return"] for row in trained],
            "lag_counts": lag_counts.tolist(), "final_return": float(np.mean(evaluations[-FINAL_EVALUATIONS:]))}


def mean_and_standard_error(values):
    """Over the first axis (seeds); the standard error is 0 for a single seed."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return values.mean(0), np.zeros(values.shape[1:])
    return values.mean(0), values.std(0, ddof=1) / np.sqrt(len(values))


def table(results, tasks, lags):
    """Markdown: final return per (task, correction) row and lag column, mean +- standard error over seeds."""
    lines = ["| task | correction | " + " | ".join(f"k = {lag}" for lag in lags) + " |",
             "|---|---|" + "---|" * len(lags)]
    for task in tasks:
        for correction in ("vtrace", "none"):
            cells = []
            for lag in lags:
                finals = [r["final_return"] for r in results
                          if (r["task"], r["lag"], r["correction"]) == (task, lag, correction)]
                if not finals:
                    cells.append("-")
                    continue
                mean, error = mean_and_standard_error(finals)
                cells.append(f"{mean:.2f} ± {error:.2f}")
            lines.append(f"| {task} | {correction} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, tasks, lags, path):
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global state

    fig = Figure(figsize=(3.2 * len(lags), 2.9 * len(tasks)))
    axes = np.array(fig.subplots(len(tasks), len(lags), sharey="row", squeeze=False))
    for row, task in enumerate(tasks):
        for column, lag in enumerate(lags):
            axis = axes[row, column]
            for correction, color in (("vtrace", "tab:blue"), ("none", "tab:red")):
                runs = [r for r in results if (r["task"], r["lag"], r["correction"]) == (task, lag, correction)]
                if not runs:
                    continue
                mean, error = mean_and_standard_error([r["eval_return"] for r in runs])
                updates = np.asarray(runs[0]["updates"])
                axis.plot(updates, mean, color=color, label=f"{correction} ({len(runs)} seeds)")
                axis.fill_between(updates, mean - error, mean + error, color=color, alpha=0.2)
            axis.set_title(f"{task}, lag k = {lag}", fontsize=10)
            axis.grid(alpha=0.3)
            if row == len(tasks) - 1:
                axis.set_xlabel("learner updates")
            if column == 0:
                axis.set_ylabel("evaluation return (max 8)")
    axes[0, 0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=100)
    os.replace(path + ".tmp.png", path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS), help="tasks to run")
    parser.add_argument("--lags", nargs="+", type=int, default=[0, 1, 4, 16, 64], help="policy lags k")
    parser.add_argument("--corrections", nargs="+", default=["vtrace", "none"], choices=["vtrace", "none"],
                        help="off-policy corrections compared: V-trace's, or none")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds of each configuration")
    parser.add_argument("--iterations", type=int, default=20, help="iterations of 10 updates of 16 x 8 steps per run")
    parser.add_argument("--out", default="benchmarks/results/lag_experiment.json", help="raw results (JSON)")
    parser.add_argument("--plot", default="docs/vtrace_lag.png", help="learning curves (PNG)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot and table from --out")
    args = parser.parse_args(argv)
    if args.iterations < FINAL_EVALUATIONS or min(args.lags) < 0:
        parser.error(f"--iterations must be >= {FINAL_EVALUATIONS} and every --lags value >= 0")
    if args.plot_only:
        with open(args.out) as f:
            results = json.load(f)["results"]
    else:
        results = []
        for task in args.tasks:
            for lag in args.lags:
                for correction in args.corrections:
                    for seed in args.seeds:
                        start = time.time()
                        results.append(run(task, lag, correction, seed, args.iterations))
                        print(f"{task} k={lag} {correction} seed {seed}: final return "
                              f"{results[-1]['final_return']:.2f} ({time.time() - start:.0f}s)", file=sys.stderr)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump({"command": " ".join(["python", "benchmarks/lag_experiment.py", *(argv or sys.argv[1:])]),
                       "results": results}, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    tasks = [task for task in TASKS if any(r["task"] == task for r in results)]
    lags = sorted({r["lag"] for r in results})
    plot(results, tasks, lags, args.plot)
    print(table(results, tasks, lags))
    return results


if __name__ == "__main__":
    main()
