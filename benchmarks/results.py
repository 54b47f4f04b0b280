"""From runs to results: learning curves per game, and aggregate normalized scores with confidence intervals.

  python benchmarks/results.py runs                         # figures and tables in runs/_results/
  python benchmarks/results.py runs --score eval --out docs/results
  python benchmarks/results.py runs --on-track             # in progress: each game against the official runs

Reads every run folder under RUNS (at any depth): `args.json` (the run's flags, written when it starts) and
`metrics.jsonl` (a row per iteration and per evaluation). Runs are grouped by algorithm (`--exp-name`: the scripts'
stems read PPO, PPG and IMPALA, any other name is shown as given), game, distribution mode and seed. Writes to --out:
- `<game>_<mode>.png`: training and evaluation return against environment steps, one line per algorithm: the mean
  over seeds and a 95% Student-t interval around it;
- `aggregate.md`, `aggregate.png`: per distribution mode and algorithm, the normalized score's interquartile mean,
  median and mean with 95% stratified-bootstrap confidence intervals, the probability that each algorithm improves on
  each other one, and the per-game returns (mean +- std over seeds);
- the same summary on the console.
A crashed run is read up to its last complete row and marked partial, as is a run that stopped short of its steps.

Against the anchors' own runs (`--reference`, on by default; `--no-reference` turns it off): where a run's script,
game, mode and flags match runs that the official PPG code or train-procgen committed (benchmarks/reference/; the
rules in `match_references` of reference/on_track.py, the expected values in docs/results.md), the figures draw
those runs behind ours and aggregate.md compares both with the same estimators at the same environment steps, with
P(ours > theirs). Where runs have no anchor, one line per game and algorithm says why (`no anchor: ...`: no anchor
ran that script, mode or those flags, or the anchor did not log the step the runs reached).
`--on-track` prints only one line per game for runs in progress:

  python benchmarks/results.py runs --on-track
  PPG (hard) starpilot @ 12.0M (mean of the last 524k steps): ours 14.2 ± 1.1 (3 seeds) vs official PPG 10.6 [9.2,
  12.0] (above)

each of our seeds and each official seed averaged over the same window: the official runs' last 8 logged iterations
before the step (one iteration's last-100-episode return moves by ~0.4 on StarPilot: a single point decides by chance).

The statistics are those of Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice" (NeurIPS), as in
their `rliable` library, written out in numpy below (rliable pulls in scipy, pandas, seaborn and arch);
docs/scale-out.md (results section) records a cross-check against rliable 1.2.0.
"""
import io
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Annotated, Literal, Optional

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import tyro  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ppo_procgen import PROCGEN_RANGES, normalized_score  # noqa: E402  (one table of ranges for the whole repo)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
from on_track import (format_step, load_references, match_references, no_match_reason,  # noqa: E402,F401
                      on_track_line, reference_at, reference_window, windowed_line)

LABELS = {"ppo_procgen": "PPO", "ppg_procgen": "PPG", "vtrace": "IMPALA"}  # exp_name defaults: the script stems
ORDER = {label: index for index, label in enumerate(LABELS.values())}  # PPO, PPG, IMPALA, then the others by name


@dataclass
class Args:
    runs: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUNS")]
    """folder holding the run folders (searched at any depth), e.g. runs"""
    out: Optional[str] = None
    """where the figures and tables go (default: RUNS/_results)"""
    score: Literal["train", "eval"] = "train"
    """each run's score for the aggregate: 'train' = mean return of its last 100 training episodes at its last
    iteration (what CleanRL's and the PPG paper's tables report), 'eval' = its last evaluation's mean return"""
    smooth: int = 10
    """training curves: each point is the mean return of the episodes that ended in the last this many iterations"""
    reps: int = 50_000
    """bootstrap resamples (rliable's default)"""
    confidence: float = 0.95
    """coverage of the confidence intervals and of the curves' bands"""
    seed: int = 0
    """seed of the bootstrap's random generator (the same seed gives the same intervals)"""
    reference: bool = True
    """draw and table the anchors' own runs (benchmarks/reference/) where one matches a run's game, mode and
    algorithm: baselines PPO (train-procgen) and the official PPG code's PPO, PPG, single-network PPG and PPG-KL"""
    on_track: bool = False
    """only print, per game, our runs' return at their latest common step against the matching official runs'
    range there (for runs in progress); no figures, no tables"""


# ---------------------------------------------------------------------------------------------------------------
# Statistics. A score set is a list with one array per task (game): the normalized scores of that task's runs, on
# the last axis (leading axes, if any, index bootstrap resamples). Tasks may have different numbers of runs.

def interquartile_mean(task_scores):
    """IQM: the mean of the middle 50% of all (run x task) scores pooled, floor(n/4) of the n scores trimmed from each
    end (as scipy.stats.trim_mean(scores, 0.25), which rliable calls). Robust to outlier runs, yet uses half the
    data, where the median uses one or two scores."""
    pooled = np.sort(np.concatenate(task_scores, axis=-1), axis=-1)
    trim = pooled.shape[-1] // 4
    return pooled[..., trim : pooled.shape[-1] - trim].mean(axis=-1)


def median_of_task_means(task_scores):
    """rliable's aggregate median: the median over tasks of each task's mean score over runs."""
    return np.median(np.stack([scores.mean(axis=-1) for scores in task_scores], axis=-1), axis=-1)


def mean_of_task_means(task_scores):
    """rliable's aggregate mean: the mean over tasks of each task's mean score over runs."""
    return np.stack([scores.mean(axis=-1) for scores in task_scores], axis=-1).mean(axis=-1)


def probability_of_improvement(scores_x, scores_y):
    """P(X > Y) = (1/M) sum_m (1/(N_m K_m)) sum_i sum_j S(x_m,i, y_m,j), with S(x, y) = 1 if x > y, 1/2 if x = y,
    0 otherwise: per task m the Mann-Whitney U statistic of X's N_m runs against Y's K_m runs, normalized to a
    probability, then averaged over the M tasks (Agarwal et al. 2021, section 4.3)."""
    per_task = []
    for x, y in zip(scores_x, scores_y):
        x_i = x[..., :, None]  # every pair (i, j) of an X run and a Y run
        y_j = y[..., None, :]
        per_task.append(((x_i > y_j) + 0.5 * (x_i == y_j)).mean(axis=(-2, -1)))
    return np.mean(per_task, axis=0)


def stratified_bootstrap(task_scores, reps, rng):
    """Resample runs with replacement *within each task* (the strata), keeping each task's number of runs: the
    uncertainty of a repeat of the experiment with new seeds on the same games. Returns one array per task, shape
    (reps, runs of that task)."""
    return [scores[rng.integers(0, len(scores), size=(reps, len(scores)))] for scores in task_scores]


def percentile_interval(samples, confidence):
    """The percentile bootstrap interval: the (1-c)/2 and (1+c)/2 quantiles of the resampled statistic."""
    return tuple(np.percentile(samples, [50 * (1 - confidence), 50 * (1 + confidence)]))


def student_t_quantile(probability, df):
    """The quantile of Student's t with an integer number of degrees of freedom, by bisection on its CDF in closed
    form (Abramowitz & Stegun 26.7.3-4): with theta = atan(t / sqrt(df)), P(|T| <= t) is
    (2/pi) (theta + sin(theta) sum_{k=0}^{(df-3)/2} a_k cos^(2k+1)(theta)), a_0 = 1, a_k = a_{k-1} 2k/(2k+1), for odd
    df, and sin(theta) sum_{k=0}^{(df-2)/2} b_k cos^(2k)(theta), b_0 = 1, b_k = b_{k-1} (2k-1)/(2k), for even df."""
    def two_sided_cdf(t):
        theta = np.arctan(t / np.sqrt(df))
        series = 0.0
        coefficient = 1.0
        if df % 2 == 1:
            for k in range((df - 1) // 2):
                series += coefficient * np.cos(theta) ** (2 * k + 1)
                coefficient *= (2 * k + 2) / (2 * k + 3)
            return 2 / np.pi * (theta + np.sin(theta) * series)
        for k in range(df // 2):
            series += coefficient * np.cos(theta) ** (2 * k)
            coefficient *= (2 * k + 1) / (2 * k + 2)
        return np.sin(theta) * series

    target = 2 * probability - 1  # P(T <= t) = p  <=>  P(|T| <= t) = 2p - 1 for p > 1/2
    low = 0.0
    high = 1e6
    for _ in range(200):
        middle = (low + high) / 2
        if two_sided_cdf(middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def mean_and_band(curves, confidence):
    """Align runs on the union of their logged steps (linear interpolation where a run lacks a step, nothing past
    either end of a run) and return (steps, mean, low, high, runs per step): the mean over runs with a Student-t
    interval, mean +- t_{(1+c)/2, n-1} s / sqrt(n), where at least two runs cover the step (NaN elsewhere)."""
    steps = np.unique(np.concatenate([x for x, _ in curves]))
    aligned = np.full((len(curves), len(steps)), np.nan)
    for row, (x, y) in enumerate(curves):
        inside = (steps >= x[0]) & (steps <= x[-1])
        aligned[row, inside] = np.interp(steps[inside], x, y)
    count = (~np.isnan(aligned)).sum(axis=0)
    mean = np.nanmean(aligned, axis=0)
    half_width = np.full(len(steps), np.nan)
    for n in np.unique(count[count >= 2]):
        at = count == n
        spread = np.nanstd(aligned[:, at], axis=0, ddof=1)
        half_width[at] = student_t_quantile((1 + confidence) / 2, int(n) - 1) * spread / np.sqrt(n)
    return steps, mean, mean - half_width, mean + half_width, count


# ---------------------------------------------------------------------------------------------------------------
# Reading runs

@dataclass
class Run:
    path: str
    algorithm: str
    game: str
    mode: str
    seed: int
    args: dict
    rows: list = field(default_factory=list)
    partial: Optional[str] = None  # why the run is partial (None: it finished)


def read_run(path):
    """A run folder's flags and metrics rows, up to the last row that parses; marks the run partial when a line is
    cut off (a crash mid-write) or when it stopped short of its total steps or of its final evaluation."""
    with open(os.path.join(path, "args.json")) as f:
        args = json.load(f)
    exp_name = args.get("exp_name", os.path.splitext(args.get("script", "?"))[0])
    run = Run(path, LABELS.get(exp_name, exp_name), args["env_id"], args["distribution_mode"], args["seed"], args)
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(metrics):
        run.partial = "no metrics.jsonl"
        return run
    with open(metrics) as f:
        for number, line in enumerate(f, start=1):
            try:
                run.rows.append(json.loads(line))
            except json.JSONDecodeError:
                run.partial = f"metrics.jsonl line {number} cut off; read up to line {number - 1}"
                break
    # Steps per iteration as the scripts compute them (vtrace.py: an update per unroll of all games).
    if "updates_per_iteration" in args:
        steps_per_iteration = args["updates_per_iteration"] * args["num_envs"] * args["unroll_length"]
    else:
        steps_per_iteration = args["num_envs"] * args["num_steps"]
    final_step = args["total_timesteps"] // steps_per_iteration * steps_per_iteration
    iterations = [row for row in run.rows if "charts/episodic_return" in row]
    evaluations = [row for row in run.rows if "eval/episodic_return" in row]
    last_step = iterations[-1]["global_step"] if iterations else 0
    if run.partial is None and last_step < final_step:
        run.partial = f"ends at step {last_step:,} of {final_step:,} (stopped, crashed or still running)"
    elif run.partial is None and not (evaluations and evaluations[-1]["global_step"] == final_step):
        run.partial = "no final evaluation (crashed in it or still running)"
    return run


def nothing_to_report(run):
    """Why the run has nothing to draw or score yet (None if it has something): no rows at all (started, not yet
    through its first iteration, or stopped at start-up), no training row, or neither a finished episode nor an
    evaluation."""
    why = f" ({run.partial})" if run.partial and not run.partial.startswith("ends at step") else ""
    if not run.rows:
        return "no rows yet" + why
    if not any("charts/episodic_return" in row for row in run.rows):
        return f"no training rows yet (only {len(run.rows)} evaluation row{'s' * (len(run.rows) > 1)})"
    if not any(row.get("charts/episodic_return") is not None or row.get("eval/episodic_return") is not None
               for row in run.rows):
        return "no finished episode yet and no evaluation"
    return None


def find_runs(folder):
    """Every folder under `folder` that holds an args.json, sorted by path."""
    if not os.path.isdir(folder):
        raise SystemExit(f"error: RUNS {folder!r} is not a folder; give the folder the scripts wrote (e.g. runs)")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise SystemExit(f"error: RUNS {folder!r} cannot be read (permission denied)")
    found = []
    for directory, _, files in os.walk(folder, onerror=lambda error: print(f"warning: skipped {error}")):
        if "args.json" in files:
            found.append(directory)
    if not found:
        raise SystemExit(f"error: no runs under {folder!r}: expected run folders with args.json and metrics.jsonl, as "
                         "ppo_procgen.py, ppg_procgen.py and vtrace.py write them in runs/")
    return sorted(found)


def training_curve(run, window):
    """(steps, returns): at each iteration the mean return of the episodes that ended in the last `window` iterations
    (weighted by their counts, so every episode counts once); iterations with no episode in the window are left out."""
    rows = [row for row in run.rows if "charts/episodic_return" in row]
    steps = np.array([row["global_step"] for row in rows], dtype=float)
    counts = np.array([row["charts/episodes"] if row["charts/episodic_return"] is not None else 0 for row in rows],
                      dtype=float)
    sums = np.array([row["charts/episodic_return"] or 0.0 for row in rows], dtype=float) * counts
    window_counts = np.convolve(counts, np.ones(window))[: len(rows)]  # trailing sums over `window` iterations
    window_sums = np.convolve(sums, np.ones(window))[: len(rows)]
    kept = window_counts > 0
    return steps[kept], window_sums[kept] / window_counts[kept]


def evaluation_curve(run):
    """(steps, returns) of the run's evaluations."""
    rows = [row for row in run.rows if row.get("eval/episodic_return") is not None]
    steps = np.array([row["global_step"] for row in rows], dtype=float)
    returns = np.array([row["eval/episodic_return"] for row in rows], dtype=float)
    return steps, returns


def run_score(run, score):
    """The run's raw score for the aggregate (see --score), or None if it has none yet."""
    return run_score_and_step(run, score)[0]


def run_score_and_step(run, score):
    """(the run's raw score, the environment step of the row it comes from), or (None, None)."""
    if score == "train":
        rows = [row for row in run.rows if "charts/episodic_return_last100" in row]
        return (rows[-1]["charts/episodic_return_last100"], rows[-1]["global_step"]) if rows else (None, None)
    rows = [row for row in run.rows if row.get("eval/episodic_return") is not None]
    return (rows[-1]["eval/episodic_return"], rows[-1]["global_step"]) if rows else (None, None)


# ---------------------------------------------------------------------------------------------------------------
# Reference runs: the anchors' committed curves and the rules that match a run to them live in
# benchmarks/reference/on_track.py.

def run_references(runs, evaluation=False, references=None):
    """The references every one of `runs` matches (an algorithm's seeds run the same flags), best match first."""
    references = load_references() if references is None else references
    matched = [match_references(run.args)[1 if evaluation else 0] for run in runs]
    return [references[key] for key in matched[0] if key in references and all(key in keys for keys in matched)]


def last100_curve(run):
    """(steps, mean return of the last 100 training episodes), the quantity both anchors log (EpRewMean, eprewmean)."""
    rows = [row for row in run.rows if row.get("charts/episodic_return_last100") is not None]
    return (np.array([row["global_step"] for row in rows], dtype=float),
            np.array([row["charts/episodic_return_last100"] for row in rows], dtype=float))


def on_track(groups):
    """The on-track lines: per (mode, algorithm), one line per game with a matching reference, at the latest step every
    seed has reached, by the rule of the scripts' in-run line (`windowed_line`: each seed's and each reference seed's
    mean over the reference's last 8 logged iterations before that step)."""
    lines = []
    for (mode, game), algorithms in sorted(groups.items()):
        for algorithm, runs in algorithms.items():
            references = run_references(runs)
            curves = [curve for curve in map(last100_curve, runs) if len(curve[0])]
            if not references or not curves:
                continue
            line = windowed_line(game, min(x[-1] for x, _ in curves), curves, references[0])
            if line is not None:  # else a `no anchor: ...` line (missing_anchors) says which steps the anchor has
                lines.append(f"{algorithm} ({mode}) {line}")
    return lines


def missing_anchors(groups):
    """One line per (mode, game, algorithm) whose runs have no anchor to be drawn or tabled against, with the reason:
    no anchor ran their script, mode or flags (`no_match_reason`), the anchor has no run of the game, or it did not
    log the step their runs reached (the latest step every seed has reached)."""
    lines = []
    for (mode, game), algorithms in sorted(groups.items()):
        for algorithm, runs in algorithms.items():
            prefix = f"no anchor: {algorithm} ({mode}) {game}"
            references = run_references(runs)
            if not references:
                reasons = [no_match_reason(run.args) for run in runs]
                reason = reasons[0]
                if reason is None or len(set(reasons)) > 1:  # the seeds ran different flags
                    reason = "its seeds ran different flags: " + "; ".join(
                        f"seed {run.seed}: {why or 'an anchor matches it alone'}" for run, why in zip(runs, reasons))
                lines.append(f"{prefix}: {reason}")
                continue
            curves = references[0].curves.get(game)
            if not curves:
                lines.append(f"{prefix}: {references[0].label} has no run of {game}")
                continue
            step = min(max((row["global_step"] for row in run.rows if "global_step" in row), default=0)
                       for run in runs)
            if reference_window(references[0], game, step) is None:
                first = max(x[0] for x, _ in curves)
                last = min(x[-1] for x, _ in curves)
                lines.append(f"{prefix} @ {format_step(step)}: steps outside the anchor's curve ({references[0].label} "
                             f"logged from {format_step(first)} to {format_step(last)})")
    return lines


def reference_comparison(algorithm, reference, mode, raw, reps, confidence, rng):
    """Our scored runs against the reference at the same steps, per game where both exist: the reference seeds'
    returns interpolated at the mean step of our runs' scores. Returns None if no game has both."""
    ours = {}
    theirs = {}
    steps = {}
    for game, scored in raw.items():
        values = [(value, step) for _, value, step in scored if value is not None]
        if not values or game not in PROCGEN_RANGES or mode not in PROCGEN_RANGES[game]:
            continue
        step = float(np.mean([step for _, step in values]))
        at = reference_at(reference, game, step)
        if at is not None:
            ours[game] = np.array([value for value, _ in values])
            theirs[game] = at
            steps[game] = step
    if not ours:
        return None
    games = sorted(ours)
    scores = {algorithm: [normalized_score(game, mode, ours[game]) for game in games],
              reference.label: [normalized_score(game, mode, theirs[game]) for game in games]}
    metrics, improvement = aggregate_scores(scores, reps, confidence, rng)
    return dict(reference=reference, games=games, steps=steps, raw=dict(ours=ours, theirs=theirs), metrics=metrics,
                improvement=improvement[(algorithm, reference.label)])


def reference_tables(algorithm, comparison, args, score_name):
    """Markdown of one comparison: the two rows of estimators, P(ours > reference), and the per-game returns."""
    reference = comparison["reference"]
    label = reference.label
    games = comparison["games"]
    column = "EpRewMean" if reference.key.startswith("phasic") else "eprewmean"
    lines = [f"### {algorithm} against {label}", "",
             f"{label}: {reference.description} ({reference.mode} mode; {len(reference.curves[games[0]])} seeds; "
             f"their `{column}`, the mean return of the last 100 episodes). Compared at the same environment step: "
             f"per game, the reference seeds' returns at the mean step of our runs' scores ({score_name}; "
             f"interpolated between their logged rows), on {len(games)} game{'s' * (len(games) > 1)}: "
             f"{', '.join(games)}.", ""]
    rows = []
    for name in (algorithm, label):
        runs = sum(len(values) for values in comparison["raw"]["ours" if name == algorithm else "theirs"].values())
        rows.append([name, str(runs)] + [format_interval(*comparison["metrics"][name][metric])
                                         for metric in ("IQM", "median", "mean")])
    lines += markdown_table(["", "runs", "IQM", "median", "mean"], rows)
    lines += [f"P({algorithm} > {label}) = {format_interval(*comparison['improvement'])} (Mann-Whitney per game, "
              "averaged over games).", ""]
    rows = []
    for game in comparison["games"]:
        cells = [game, format_step(comparison["steps"][game])]
        for values in (comparison["raw"]["ours"][game], comparison["raw"]["theirs"][game]):
            spread = f" +- {values.std(ddof=1):.2f}" if len(values) > 1 else ""
            cells.append(f"{values.mean():.2f}{spread} ({len(values)})")
        rows.append(cells)
    return lines + markdown_table(["game", "step", algorithm, label], rows)


# ---------------------------------------------------------------------------------------------------------------
# Figures

def plot_reference(axis, reference, game, color, until):
    """The reference's seeds behind our runs, up to step `until`: their mean (dashed) and min-max range (faint)."""
    curves = [(x[x <= until], y[x <= until]) for x, y in reference.curves.get(game, [])]
    if not curves or not all(len(x) for x, _ in curves):
        return False
    steps = np.unique(np.concatenate([x for x, _ in curves]))
    aligned = np.stack([np.interp(steps, x, y, left=np.nan, right=np.nan) for x, y in curves])
    axis.plot(steps, np.nanmean(aligned, axis=0), color=color, linestyle="--", linewidth=1.2, zorder=1,
              label=f"{reference.label} ({len(curves)} seed{'s' * (len(curves) > 1)}: mean, min-max)")
    axis.fill_between(steps, np.nanmin(aligned, axis=0), np.nanmax(aligned, axis=0), color=color, alpha=0.1,
                      linewidth=0, zorder=0)
    return True


def plot_game(path, game, mode, by_algorithm, colors, args, references=None):
    """references: {algorithm: (references for the training panel, references for the evaluation panel)}."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    references = references or {}
    drawn = set()
    for algorithm, runs in by_algorithm.items():
        last = max((row["global_step"] for run in runs for row in run.rows if "global_step" in row), default=0)
        for axis, panel in zip(axes, references.get(algorithm, ([], []))):
            for number, reference in enumerate(panel[:2]):  # the best match in the algorithm's colour, a second grey
                if (id(axis), reference.key) not in drawn and last > 0:
                    if plot_reference(axis, reference, game, colors[algorithm] if number == 0 else "gray", last):
                        drawn.add((id(axis), reference.key))
    for algorithm, runs in by_algorithm.items():
        color = colors[algorithm]
        partial = sum(run.partial is not None for run in runs)
        label = f"{algorithm} ({len(runs)} seed{'s' * (len(runs) > 1)}" + (f", {partial} partial)" if partial else ")")
        for axis, curve_of in ((axes[0], lambda run: training_curve(run, args.smooth)), (axes[1], evaluation_curve)):
            run_curves = [curve_of(run) for run in runs]
            curves = [curve for curve in run_curves if len(curve[0])]
            if not curves:
                continue
            steps, mean, low, high, _ = mean_and_band(curves, args.confidence)
            # Evaluations are few, so each gets a marker; a curve of one point (a run shorter than --eval-every
            # iterations evaluates once, at its end) is drawn by its marker alone, a line needs two points.
            marker = "o" if axis is axes[1] or len(steps) == 1 else None
            axis.plot(steps, mean, color=color, label=label, marker=marker, markersize=4)
            if len(steps) > 1:
                axis.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
            elif not np.isnan(low[0]):  # a band of zero width is invisible: the interval as an error bar
                axis.errorbar(steps[0], mean[0], yerr=[[mean[0] - low[0]], [high[0] - mean[0]]], color=color,
                              capsize=3)
            for run, (x, y) in zip(runs, run_curves):
                if run.partial is not None and len(x):  # where a partial run ends
                    axis.plot(x[-1], y[-1], "x", color=color)
    axes[0].set_title(f"training return (episodes of the last {args.smooth} iterations)")
    axes[1].set_title("evaluation return")
    for axis in axes:
        axis.set_xlabel("environment steps")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("episodic return (raw game score)")
    if axes[0].get_legend_handles_labels()[0]:  # a run of minutes may have ended no episode yet
        axes[0].legend(fontsize=8)
    if any(id(axes[1]) == axis for axis, _ in drawn):
        axes[1].legend(fontsize=8)
    official = "; dashed: the anchors' own runs (faint: their seeds' range)" if drawn else ""
    figure.suptitle(f"{game} ({mode}): mean over seeds, {args.confidence:.0%} t-interval; x: a partial run's end"
                    + official)
    save_figure(figure, path)


def draw_interval(axis, position, value, interval, color):
    """A horizontal bar over the interval and a black tick at the point estimate."""
    axis.barh(position, interval[1] - interval[0], left=interval[0], height=0.6, alpha=0.6, color=color)
    axis.plot([value, value], [position - 0.3, position + 0.3], color="black")


def plot_aggregate(path, aggregates, colors, score_name, confidence):
    """One row per distribution mode: IQM, median and mean with their intervals, then P(X > Y) for each pair."""
    bars = max(max(len(aggregate["metrics"]), len(aggregate["improvement"])) for aggregate in aggregates.values())
    figure, axes = plt.subplots(len(aggregates), 4, figsize=(16, len(aggregates) * (1.6 + 0.45 * bars)),
                                squeeze=False, constrained_layout=True)
    for row, (mode, aggregate) in enumerate(aggregates.items()):
        algorithms = list(aggregate["metrics"])
        for column, metric in enumerate(("IQM", "median", "mean")):
            axis = axes[row, column]
            for position, algorithm in enumerate(algorithms):
                draw_interval(axis, position, *aggregate["metrics"][algorithm][metric], color=colors[algorithm])
            axis.set_yticks(range(len(algorithms)), algorithms if column == 0 else [""] * len(algorithms))
            axis.invert_yaxis()  # the first algorithm on top
            axis.use_sticky_edges = False  # bars pin the axis to their left ends; pad instead, so that an interval
            axis.margins(x=0.1)            # of zero width stays visible
            axis.set_title(f"{metric} ({mode})")
            axis.set_xlabel("normalized score")
            axis.grid(axis="x", alpha=0.3)
        axis = axes[row, 3]
        pairs = list(aggregate["improvement"].items())
        for position, (_, (value, interval)) in enumerate(pairs):
            draw_interval(axis, position, value, interval, color="C4")
        axis.set_yticks(range(len(pairs)), [f"P({x} > {y})" for (x, y), _ in pairs])
        axis.invert_yaxis()
        axis.axvline(0.5, color="gray", linestyle="--")
        axis.set_xlim(-0.02, 1.02)
        axis.set_title(f"probability of improvement ({mode})")
        axis.grid(axis="x", alpha=0.3)
    figure.suptitle(f"normalized score over {score_name}; bars: {confidence:.0%} stratified-bootstrap intervals, "
                    "black ticks: point estimates")
    save_figure(figure, path)


# ---------------------------------------------------------------------------------------------------------------
# Aggregate and tables

def save_figure(figure, path):
    """The figure as a PNG at `path`, written atomically; then closed."""
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=100)
    plt.close(figure)
    write_atomically(path, image.getbuffer())


def write_atomically(path, data):
    """`path` holds all of `data` (bytes) or what it held before, whatever happens: a temporary file in the same
    folder, flushed to the disk, renamed over `path`; a failed write leaves no temporary file."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def aggregate_scores(scores, reps, confidence, rng):
    """scores: {algorithm: one array of normalized scores per game}, the same games for every algorithm. Returns
    ({algorithm: {"IQM" | "median" | "mean": (point estimate, interval)}}, {(X, Y): (P(X > Y), interval)})."""
    metrics = {}
    for algorithm, task_scores in scores.items():
        resampled = stratified_bootstrap(task_scores, reps, rng)  # the same resamples for the three statistics
        metrics[algorithm] = {name: (float(statistic(task_scores)),
                                     percentile_interval(statistic(resampled), confidence))
                              for name, statistic in (("IQM", interquartile_mean), ("median", median_of_task_means),
                                                      ("mean", mean_of_task_means))}
    improvement = {}
    for x in scores:
        for y in scores:
            if x != y:  # X's and Y's runs are resampled independently, each within its games
                resampled = probability_of_improvement(stratified_bootstrap(scores[x], reps, rng),
                                                       stratified_bootstrap(scores[y], reps, rng))
                improvement[(x, y)] = (float(probability_of_improvement(scores[x], scores[y])),
                                       percentile_interval(resampled, confidence))
    return metrics, improvement


def format_interval(value, interval):
    return f"{value:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"


def markdown_table(header, rows):
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + [
        "| " + " | ".join(row) + " |" for row in rows] + [""]


def mode_tables(mode, games, raw, metrics, improvement, args, score_name):
    """The Markdown tables of one distribution mode."""
    algorithms = list(raw)
    lines = [f"Games: {', '.join(games)}. Normalization: (R - R_min) / (R_max - R_min) with Procgen's published "
             f"{mode} ranges. Intervals: {args.confidence:.0%} percentile stratified bootstrap ({args.reps:,} "
             f"resamples of the runs within each game, seed {args.seed}).", ""]
    rows = []
    for algorithm in algorithms:
        used = [run for game in games for run, value in raw[algorithm][game] if value is not None]
        partial = sum(run.partial is not None for run in used)
        rows.append([algorithm, f"{len(used)}" + (f" ({partial} partial)" if partial else "")]
                    + [format_interval(*metrics[algorithm][name]) for name in ("IQM", "median", "mean")])
    lines += markdown_table(["algorithm", "runs", "IQM", "median", "mean"], rows)
    if improvement:
        lines += ["Probability of improvement P(row > column): Mann-Whitney per game (ties count 1/2), averaged over "
                  "games.", ""]
        lines += markdown_table([""] + algorithms, [[x] + ["-" if x == y else format_interval(*improvement[(x, y)])
                                                           for y in algorithms] for x in algorithms])
    rows = []
    for game in games:
        cells = [game]
        for algorithm in algorithms:
            values = np.array([value for _, value in raw[algorithm][game] if value is not None])
            spread = f" +- {values.std(ddof=1):.2f}" if len(values) > 1 else ""
            cells.append(f"{values.mean():.2f}{spread} ({len(values)})")
        rows.append(cells)
    lines += [f"Raw return per game over {score_name}: mean +- std over seeds (number of seeds).", ""]
    return lines + markdown_table(["game"] + algorithms, rows)


def reference_section(mode, games, groups, algorithms, found, args, score_name, rng):
    """The comparisons of each algorithm with the references its runs match, into `found` (keyed by (algorithm,
    reference key)) and as Markdown lines."""
    lines = []
    for algorithm in algorithms:
        seeds = [run for game in games for run in groups[(mode, game)].get(algorithm, [])]
        raw = {game: [(run, *run_score_and_step(run, args.score)) for run in groups[(mode, game)].get(algorithm, [])]
               for game in games}
        for reference in run_references(seeds, evaluation=args.score == "eval"):
            comparison = reference_comparison(algorithm, reference, mode, raw, args.reps, args.confidence, rng)
            if comparison is None:
                continue
            if not lines:
                lines += [f"## {mode} mode: against the anchors' own runs", ""]
            found[(algorithm, reference.key)] = comparison
            lines += reference_tables(algorithm, comparison, args, score_name)
    return lines


# ---------------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = tyro.cli(Args, args=argv, description=__doc__.split("\n\n")[0])
    for ok, message in ((args.smooth >= 1, f"--smooth {args.smooth} must be >= 1 (iterations)"),
                        (args.reps >= 1000, f"--reps {args.reps} must be >= 1000 for a stable interval"),
                        (0 < args.confidence < 1, f"--confidence {args.confidence} must be in (0, 1)")):
        if not ok:
            raise SystemExit(f"error: {message}")
    out = args.out or os.path.join(args.runs, "_results")
    score_name = {"train": "the last 100 training episodes", "eval": "the last evaluation"}[args.score]

    # 1. Read every run, then group by (mode, game) and algorithm, one run per seed.
    candidates = {}
    skipped = []
    waiting = []  # runs with nothing to report yet: one line each, left out of every figure and table
    for path in find_runs(args.runs):
        try:
            run = read_run(path)
        except (OSError, ValueError, KeyError, TypeError) as error:  # an unreadable or foreign args.json
            skipped.append(f"{path}: cannot read args.json ({type(error).__name__}: {error})")
            continue
        if run.args.get("eval_only"):
            skipped.append(f"{path}: an --eval-only run")
            continue
        if nothing_to_report(run):  # before the seeds are matched, so that it cannot displace a run with rows
            waiting.append((path, nothing_to_report(run)))
            continue
        candidates.setdefault((run.mode, run.game, run.algorithm, run.seed), []).append(run)
    groups = {}
    for (mode, game, algorithm, seed), same_seed in sorted(candidates.items()):
        # A seed run twice (a re-run after a crash, say): keep a finished run over a partial one, then the newer one.
        kept = max(same_seed, key=lambda run: (run.partial is None, os.path.getmtime(os.path.join(run.path,
                                                                                                  "args.json"))))
        skipped += [f"{run.path}: seed {seed} again in {kept.path}, which is kept" for run in same_seed
                    if run is not kept]
        groups.setdefault((mode, game), {}).setdefault(algorithm, []).append(kept)
    runs = [run for algorithms in groups.values() for seeds in algorithms.values() for run in seeds]
    if not runs:
        first = ([f"{path}: {why}" for path, why in waiting] + skipped)[0]
        raise SystemExit(f"error: no run under {args.runs!r} has anything to report yet ({len(waiting)} without rows, "
                         f"{len(skipped)} skipped; the first: {first})")
    print(f"{len(runs)} runs under {args.runs}: " + "; ".join(
        f"{game} ({mode}): " + ", ".join(f"{algorithm} x{len(seeds)}" for algorithm, seeds in algorithms.items())
        for (mode, game), algorithms in sorted(groups.items())))
    for run in runs:
        if run.partial:
            print(f"partial: {run.path}: {run.partial}")
    for path, why in waiting:
        print(f"left out: {path}: {why}")
    for line in skipped:
        print(f"skipped: {line}")
    for algorithm in sorted({run.algorithm for run in runs}):
        for flag in ("total_timesteps", "num_levels"):
            values = sorted({run.args.get(flag) for run in runs if run.algorithm == algorithm}, key=str)
            if len(values) > 1:
                print(f"warning: {algorithm}'s runs differ in --{flag.replace('_', '-')} ({values}); give each "
                      "setting its own --exp-name to keep them apart")

    missing = missing_anchors(groups) if args.reference or args.on_track else []
    for line in missing:
        print(line)

    if args.on_track:
        lines = on_track(groups)
        print("\n".join(lines) if lines else "on track: no run matches a reference (game, mode and algorithm; see "
                                              "match_references in benchmarks/reference/on_track.py)")
        return dict(runs=runs, groups=groups, on_track=lines, missing_anchors=missing, left_out=waiting)

    # 2. Learning curves: one figure per game and mode, each algorithm in the same colour everywhere.
    order = lambda algorithm: (ORDER.get(algorithm, len(ORDER)), algorithm)
    colors = {algorithm: f"C{index}" for index, algorithm in enumerate(sorted({run.algorithm for run in runs},
                                                                               key=order))}
    os.makedirs(out, exist_ok=True)
    for (mode, game), algorithms in sorted(groups.items()):
        by_algorithm = {algorithm: algorithms[algorithm] for algorithm in sorted(algorithms, key=order)}
        references = ({algorithm: (run_references(seeds), run_references(seeds, evaluation=True))
                       for algorithm, seeds in by_algorithm.items()} if args.reference else {})
        plot_game(os.path.join(out, f"{game}_{mode}.png"), game, mode, by_algorithm, colors, args, references)

    # 3. Aggregate normalized scores per mode, over the games on which every algorithm has a scored run.
    rng = np.random.default_rng(args.seed)
    aggregates = {}
    comparisons = {}  # {mode: {(algorithm, reference key): comparison}}
    lines = []
    for mode in sorted({mode for mode, _ in groups}):
        games = sorted(game for game_mode, game in groups if game_mode == mode)
        algorithms = sorted({algorithm for game in games for algorithm in groups[(mode, game)]}, key=order)
        raw = {algorithm: {game: [(run, run_score(run, args.score)) for run in groups[(mode, game)].get(algorithm, [])]
                           for game in games} for algorithm in algorithms}
        common = [game for game in games
                  if all(any(value is not None for _, value in raw[algorithm][game]) for algorithm in algorithms)]
        lines += [f"## {mode} mode: normalized score over {score_name}", ""]
        if set(common) != set(games):
            lines += [f"Left out of the aggregate, as not every algorithm has a scored run there: "
                      f"{', '.join(sorted(set(games) - set(common)))}.", ""]
        if not common or any(mode not in PROCGEN_RANGES[game] for game in common):
            lines += ["No aggregate: " + ("no published normalization ranges for this mode." if common else
                                          "no game on which every algorithm has a scored run."), ""]
            if args.reference:
                lines += reference_section(mode, games, groups, algorithms, comparisons.setdefault(mode, {}), args,
                                           score_name, rng)
            continue
        scores = {algorithm: [np.array([normalized_score(game, mode, value) for _, value in raw[algorithm][game]
                                        if value is not None]) for game in common] for algorithm in algorithms}
        metrics, improvement = aggregate_scores(scores, args.reps, args.confidence, rng)
        aggregates[mode] = dict(games=common, metrics=metrics, improvement=improvement)
        lines += mode_tables(mode, common, raw, metrics, improvement, args, score_name)
        if args.reference:
            lines += reference_section(mode, games, groups, algorithms, comparisons.setdefault(mode, {}), args,
                                       score_name, rng)

    # 4. Write the tables and the figure; print the same.
    command = (f"python benchmarks/results.py {args.runs} --score {args.score} --smooth {args.smooth} --reps "
               f"{args.reps} --confidence {args.confidence} --seed {args.seed}"
               + ("" if args.reference else " --no-reference"))
    partial_runs = [f"- `{run.path}`: {run.partial}" for run in runs if run.partial]
    lines_out = lines + (["Partial runs (read up to their last complete row):", ""] + partial_runs if partial_runs
                         else [])
    if waiting:
        lines_out += ["", "Left out, with nothing to report yet:", ""] + [f"- `{path}`: {why}" for path, why in waiting]
    text = "\n".join([f"# Results from {len(runs)} runs", "", f"`{command}`", ""] + lines_out) + "\n"
    write_atomically(os.path.join(out, "aggregate.md"), text.encode())
    if aggregates:
        plot_aggregate(os.path.join(out, "aggregate.png"), aggregates, colors, score_name, args.confidence)
    print("\n" + "\n".join(lines))
    print(f"wrote {out}/: " + ", ".join(sorted(os.listdir(out))))
    return dict(runs=runs, groups=groups, aggregates=aggregates, reference=comparisons, out=out,
                missing_anchors=missing, left_out=waiting)


if __name__ == "__main__":
    main()
