"""StarPilot on a CPU against the baselines' pace: the tables of docs/results.md's
section "PPO on StarPilot on a 2-core CPU" from the committed runs in
benchmarks/results/procgen_cpu/ (their args.json and metrics.jsonl), and its PPO-beside-IMPALA
figure.

  python benchmarks/procgen_cpu.py            # the markdown tables, as docs/results.md shows them
  python benchmarks/procgen_cpu.py --figure   # also docs/procgen_cpu/starpilot_ppo_vs_impala.png

Runs are grouped by script and by the flags that differ from that script's defaults (`DEFAULTS`;
the seed and the flags that change only how a run is run, `RUNTIME_FLAGS`, are ignored): "PPO",
"IMPALA", "PPO, --reward-norm-gamma 0.99".

Ours: the mean return of the last 100 training episodes (`charts/episodic_return_last100`) at a
step, mean +- std over a group's seeds. The anchor: train-procgen's baselines PPO, easy mode, all
levels (its `eprewmean`, the same quantity), its three seeds' mean [min, max] at the same step, from
its every logged row (benchmarks/reference/train_procgen.json.gz). About 160 episodes end in each
16,384-step iteration, so either value is one iteration's statistic and moves by about 0.4 between
iterations; the "last 8 iterations" columns are the on-track rule's windows (benchmarks/reference/
on_track.py, the rule of `results.py --on-track` and the scripts' in-run line): each run's and each
anchor seed's mean over its rows in the anchor's last 8 logged iterations before the step,
(step - 131,072, step]. A run that has not reached a step shows "-" there.

IMPALA logs every 16,000 steps (32 games x 20 steps x 25 updates): its value at a mark is its row
at or nearest below the mark (128,000 for 131,072), its window its rows in the same 131,072 steps
(8 rows, the last at that row). No IMPALA run on Procgen was published, so it has no anchor.

Wall time is the sum of each process's training time: metrics.jsonl's `time` restarts at 0 when a
run is resumed (start-up, and the iterations after its last checkpoint that a crash lost, are not
counted).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "reference"))
import on_track  # noqa: E402  (the anchor's curves, its points and the on-track rule's windows)
import results  # noqa: E402  (find_runs, read_run, last100_curve: the figures' reading of a run)

RUNS = os.path.join(HERE, "results", "procgen_cpu")
FIGURE = os.path.join(os.path.dirname(HERE), "docs", "procgen_cpu", "starpilot_ppo_vs_impala.png")
ANCHOR = "train_procgen/easy-all"
ANCHOR_LABEL = "baselines PPO easy-all"
GAME = "starpilot"
STEPS = (131_072, 262_144, 524_288)
CAUSE_STUDY_STEP = 262_144
WINDOW = on_track.WINDOW_ROWS  # the anchor's iterations averaged in the windowed columns
LABELS = {"ppo_procgen.py": "PPO", "vtrace.py": "IMPALA"}  # also the tables' order
COLORS = {"ppo_procgen.py": "tab:blue", "vtrace.py": "tab:orange"}
ANCHORED = ("ppo_procgen.py",)  # the scripts that baselines PPO is the anchor of

# Flags that change how a run is run, not what it learns: naming, seed, length, devices, threads,
# speed-ups, evaluation and saving cadence, logging, resuming.
RUNTIME_FLAGS = {"script", "exp_name", "seed", "total_timesteps", "cuda", "torch_deterministic", "env_backend",
                 "env_threads", "torch_threads", "overlap_games", "cuda_graph", "channels_last", "compile",
                 "eval_every",
                 "eval_episodes", "capture_video", "track", "wandb_project",
                 "wandb_entity", "wandb_mode", "save_model", "save_every", "resume", "eval_only",
                 "checkpoint"}
# Runtime flags that earlier versions of the scripts wrote to args.json (the committed runs have them).
RETIRED_FLAGS = {"on_track"}
# Every other flag's default, per script (tests/test_procgen_cpu.py checks them against the scripts'
# Args). The environment, network, normalizer and optimizer flags belong to the shared blocks.
SHARED_DEFAULTS = {"learning_rate": 0.0005, "anneal_lr": False, "gamma": 0.999,
                   "max_grad_norm": 0.5, "adam_eps": 1e-05, "reward_norm_gamma": 0.999,
                   "reward_clip": 10.0,
                   "channels": [16, 32, 32], "hidden_size": 256, "init": "default",
                   "env_id": "starpilot", "distribution_mode": "easy", "num_levels": 0,
                   "start_level": 0, "amp": False}
DEFAULTS = {
    "ppo_procgen.py": {**SHARED_DEFAULTS, "num_envs": 64, "num_steps": 256, "gae_lambda": 0.95,
                       "num_minibatches": 8, "update_epochs": 3, "adv_norm": "minibatch",
                       "policy_loss": "clip", "clip_coef": 0.2, "clip_vloss": True,
                       "ent_coef": 0.01, "vf_coef": 0.5, "target_kl": None, "kl_beta": None,
                       "kl_estimator": "exact", "minibatch_unit": "frames", "amp_rollout": True},
    "vtrace.py": {**SHARED_DEFAULTS, "num_envs": 32, "rho_bar": 1.0, "c_bar": 1.0,
                  "pg_rho_bar": 1.0, "vtrace_lambda": 1.0, "correction": "vtrace",
                  "unroll_length": 20, "updates_per_iteration": 25, "max_policy_lag": 1,
                  "deterministic_lag": False, "baseline_cost": 0.5, "entropy_cost": 0.01},
}


# -------------------------------------------------------------------------------------------------
# Groups of runs

def changed_flags(args):
    """The run's flags that differ from its script's defaults, as sorted (flag, JSON value) pairs,
    runtime flags left out. A flag the table does not know counts as changed: it shows in the label
    rather than vanish."""
    script = args["script"]
    if script not in DEFAULTS:
        raise SystemExit(f"error: a run of {script}: procgen_cpu.py knows the defaults of "
                         f"{', '.join(DEFAULTS)} only")
    defaults = DEFAULTS[script]
    changed = [(flag, json.dumps(value)) for flag, value in args.items()
               if flag not in RUNTIME_FLAGS | RETIRED_FLAGS and (flag not in defaults or value != defaults[flag])]
    return tuple(sorted(changed))


def flag_text(flag, value):
    """One changed flag as tyro spells it on the command line: --flag, --no-flag, --flag 1 2 3."""
    name = flag.replace("_", "-")
    value = json.loads(value)
    if value is True:
        return f"--{name}"
    if value is False:
        return f"--no-{name}"
    if isinstance(value, list):
        return f"--{name} {' '.join(str(item) for item in value)}"
    return f"--{name} {value}"


def group_label(key):
    script, changes = key
    return ", ".join([LABELS[script]] + [flag_text(flag, value) for flag, value in changes])


def read_groups(folder):
    """{(script, changed flags): [runs sorted by seed]}: the scripts at their defaults first (PPO,
    IMPALA), then the groups with changed flags, by label. A run without a training row yet is left
    out, with a warning."""
    groups = {}
    for path in results.find_runs(folder):
        run = results.read_run(path)
        if not training_rows(run):
            print(f"warning: {path}: no training row yet ({run.partial}); left out", file=sys.stderr)
            continue
        groups.setdefault((run.args["script"], changed_flags(run.args)), []).append(run)
    order = list(LABELS)

    def sort_key(key):
        return (len(key[1]) > 0, order.index(key[0]), group_label(key))

    by_seed = {key: sorted(runs, key=lambda run: run.seed) for key, runs in groups.items()}
    return {key: by_seed[key] for key in sorted(groups, key=sort_key)}


# -------------------------------------------------------------------------------------------------
# A run's numbers

def training_rows(run):
    """The rows that carry a last-100 mean (those of results.last100_curve), in order."""
    return [row for row in run.rows if row.get("charts/episodic_return_last100") is not None]


def steps_per_iteration(run):
    """From the first training row: every script logs global_step = iteration x its iteration."""
    first = training_rows(run)[0]
    return first["global_step"] // first["iteration"]


def row_step(run, step):
    """The logged step at or nearest below `step` (`step` itself where an iteration ends there), or
    None if the run has not logged it yet."""
    logged = step // steps_per_iteration(run) * steps_per_iteration(run)
    steps, _ = results.last100_curve(run)
    return logged if np.any(steps == logged) else None


def return_at(run, step):
    """The run's last-100-episode mean at its row at or nearest below `step`, or None."""
    logged = row_step(run, step)
    if logged is None:
        return None
    steps, returns = results.last100_curve(run)
    return float(returns[np.flatnonzero(steps == logged)[0]])


def window_mean(run, step):
    """The run's mean of `charts/episodic_return_last100` over its rows in the on-track rule's
    window at `step` (the anchor's, `anchor_window`), or None if it has not logged its row at or
    nearest below `step`."""
    if row_step(run, step) is None:
        return None
    width, _ = anchor_window(step)
    return on_track.window_mean(*results.last100_curve(run), step, width)


def process_start(row):
    """The step at which the process that wrote `row` began training: its SPS counts that process's
    steps over its `time`, so global_step - SPS x time (a resumed run's next process begins at its
    checkpoint's step)."""
    return round(row["global_step"] - row["charts/SPS"] * row["time"])


def wall_clock_seconds(run):
    """(steps, seconds of training up to each row, summed over the processes that wrote the run).
    Each process's `time` counts from where it began, so it restarts at 0 after a resume; rows are
    told apart by process_start, which holds also where a resumed process has run longer than the
    one before it (its time then rises across the resume)."""
    rows = training_rows(run)
    seconds = []
    finished = 0.0  # the seconds of the processes before this row's
    for row, previous in zip(rows, [None] + rows[:-1]):
        if previous is not None and process_start(row) != process_start(previous):
            finished += previous["time"]
        seconds.append(finished + row["time"])
    return np.array([row["global_step"] for row in rows], dtype=float), np.array(seconds)


def processes(run):
    """How many processes wrote the run (1 + its resumes)."""
    return len({process_start(row) for row in training_rows(run)})


# -------------------------------------------------------------------------------------------------
# The anchor

def anchor_reference():
    """Baselines PPO easy-all as on_track.load_references reads it: each seed's every logged row."""
    return on_track.load_references()[ANCHOR]


def anchor_curves(game=GAME):
    """(steps, returns: seeds x steps) of the anchor's seeds, which logged the same steps."""
    curves = anchor_reference().curves[game]
    assert all(np.array_equal(steps, curves[0][0]) for steps, _ in curves)
    return curves[0][0], np.stack([returns for _, returns in curves])


def anchor_at(step, game=GAME):
    """Each anchor seed's last-100 mean at `step` (on_track.reference_at: its row there, where it
    logged one)."""
    return on_track.reference_at(anchor_reference(), game, step)


def anchor_window(step, game=GAME):
    """(W, each anchor seed's mean over its rows in (step - W, step]): on_track.reference_window,
    W = 8 x 16,384 steps."""
    return on_track.reference_window(anchor_reference(), game, step)


# -------------------------------------------------------------------------------------------------
# Tables

def mean_std(values):
    """"mean ± std (n seeds)" of the values that are not None, "-" if none is."""
    values = [value for value in values if value is not None]
    if not values:
        return "-"
    spread = f" ± {np.std(values, ddof=1):.2f}" if len(values) > 1 else ""
    return f"{np.mean(values):.2f}{spread} ({len(values)} seed{'s' * (len(values) > 1)})"


def band(values):
    return f"{values.mean():.2f} [{values.min():.2f}, {values.max():.2f}]"


def anchor_cells(script, step):
    """The anchor's point and window cells at `step`; "no anchor" twice for a script it does not
    anchor."""
    if script not in ANCHORED:
        return ["no anchor", "no anchor"]
    return [band(anchor_at(step)), band(anchor_window(step)[1])]


def step_cell(runs, step):
    """The step, and the row used where the group's iterations do not end there."""
    logged = step // steps_per_iteration(runs[0]) * steps_per_iteration(runs[0])
    return f"{step:,}" if logged == step else f"{step:,} (its row at {logged:,})"


def table_row(cells):
    return "| " + " | ".join(cells) + " |"


def pace_table(groups):
    """Markdown: each script at its defaults, per step, ours mean +- std over seeds, the anchor."""
    header = ["run group", "step", "ours: last-100 mean", f"{ANCHOR_LABEL}: mean [min, max]",
              f"ours: last {WINDOW} iterations", f"{ANCHOR_LABEL}: last {WINDOW} iterations"]
    lines = [table_row(header), "|---" * len(header) + "|"]
    for (script, changes), runs in groups.items():
        if changes:
            continue
        for step in STEPS:
            point, window = anchor_cells(script, step)
            lines.append(table_row([LABELS[script], step_cell(runs, step),
                                    mean_std([return_at(run, step) for run in runs]), point,
                                    mean_std([window_mean(run, step) for run in runs]), window]))
    return lines


def cause_study_table(groups, step=CAUSE_STUDY_STEP):
    """Markdown: per group with changed flags, at `step`, ours against the same script at its
    defaults and the anchor; no lines where there is no such group."""
    changed = {key: runs for key, runs in groups.items() if key[1]}
    if not changed:
        return []
    header = [f"change (at {step:,} steps)", "ours: last-100 mean", "the script at its defaults",
              f"{ANCHOR_LABEL}: mean [min, max]", f"ours: last {WINDOW} iterations",
              f"the script at its defaults: last {WINDOW}",
              f"{ANCHOR_LABEL}: last {WINDOW} iterations"]
    lines = [table_row(header), "|---" * len(header) + "|"]
    for (script, changes), runs in changed.items():
        defaults = groups.get((script, ()), [])
        point, window = anchor_cells(script, step)
        lines.append(table_row([group_label((script, changes)),
                                mean_std([return_at(run, step) for run in runs]),
                                mean_std([return_at(run, step) for run in defaults]), point,
                                mean_std([window_mean(run, step) for run in runs]),
                                mean_std([window_mean(run, step) for run in defaults]), window]))
    return lines


def runs_table(groups):
    """Markdown, a row per run: group, script, seed, steps reached, wall time, steps per second and
    the last-100 mean at its last step."""
    header = ["run group", "script", "seed", "steps reached", "wall time (summed over resumes)",
              "steps/s", "last-100 mean at its last step"]
    lines = [table_row(header), "|---" * len(header) + "|"]
    for key, runs in groups.items():
        for run in runs:
            steps, seconds = wall_clock_seconds(run)
            _, returns = results.last100_curve(run)
            count = processes(run)
            resumed = f" ({count} processes)" if count > 1 else ""
            lines.append(table_row([group_label(key), key[0], str(run.seed), f"{steps[-1]:,.0f}",
                                    f"{seconds[-1] / 3600:.2f} h{resumed}",
                                    f"{steps[-1] / seconds[-1]:.0f}", f"{returns[-1]:.2f}"]))
    return lines


# -------------------------------------------------------------------------------------------------
# The figure

def plot_figure(groups, path):
    """Two panels, the last-100 mean against environment steps and against wall-clock hours: a line
    per seed of each script at its defaults, the anchor's three seeds' [min, max] band behind the
    per-step panel."""
    figure, (by_step, by_hour) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    until = max(results.last100_curve(run)[0][-1] for runs in groups.values() for run in runs)
    steps, returns = anchor_curves()
    shown = steps <= until
    by_step.fill_between(steps[shown], returns[:, shown].min(axis=0), returns[:, shown].max(axis=0),
                         color="gray", alpha=0.25, label=f"{ANCHOR_LABEL}, 3 seeds [min, max]")
    for (script, changes), runs in groups.items():
        if changes:
            continue
        for number, run in enumerate(runs):
            run_steps, run_returns = results.last100_curve(run)
            _, seconds = wall_clock_seconds(run)
            style = {"color": COLORS[script], "linewidth": 1, "marker": ".", "markersize": 3,
                     "label": LABELS[script] if number == 0 else None}
            by_step.plot(run_steps, run_returns, **style)
            by_hour.plot(seconds / 3600, run_returns, **style)
    by_step.set_xlabel("environment steps")
    by_hour.set_xlabel("wall-clock hours on the shared 2-core CPU (summed over resumes)")
    for axis in (by_step, by_hour):
        axis.set_ylabel("mean return of the last 100 training episodes")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left", fontsize=8)
    figure.suptitle(f"{GAME}, easy, all levels: a line per seed")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="?", default=RUNS,
                        help="folder of run folders (default: %(default)s)")
    parser.add_argument("--figure", nargs="?", const=FIGURE, default=None, metavar="PNG",
                        help=f"also write the PPO-beside-IMPALA figure (default: {FIGURE})")
    options = parser.parse_args(argv)
    groups = read_groups(options.runs)
    cause_study = cause_study_table(groups)
    tables = [pace_table(groups)] + ([cause_study] if cause_study else []) + [runs_table(groups)]
    text = "\n\n".join("\n".join(table) for table in tables)
    print(text)
    if options.figure:
        plot_figure(groups, options.figure)
        print(f"\nwrote {options.figure}")
    return text


if __name__ == "__main__":
    main()
