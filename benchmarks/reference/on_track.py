"""Which anchor a run is compared against, and the "on track?" line: one set of rules for the scripts' in-run line
(imported lazily at each evaluation) and for `benchmarks/results.py` (its figures, tables and --on-track).
The line compares windows, not single points (`windowed_line`): at a step, each side's mean of the last-100-episode
return over the anchor's last 8 logged iterations before it.

The anchors are the runs that the official PPG code and openai/train-procgen committed (this folder's .json.gz files,
built by build_reference.py). A run matches an anchor by its script, distribution mode, number of training levels and,
for PPG, its variant and phase lengths (`match_references`); `no_match_reason` says in words why a run has none.
This module imports no script, so that the scripts can import it and still run without benchmarks/.
"""
import gzip
import json
import os
from dataclasses import dataclass

import numpy as np

REFERENCE_DIR = os.path.dirname(os.path.abspath(__file__))
REFERENCE_FILES = {"phasic_policy_gradient": "phasic_policy_gradient.json.gz", "train_procgen": "train_procgen.json.gz"}
OFFICIAL_LABELS = {"ppo": "official PPO (PPG paper)", "ppg": "official PPG", "ppgsingle": "official PPG single-network",
                   "ppgkl": "official PPG-KL"}
PPG_DEFAULTS = {"n_pi": (32, "n-pi"), "e_pi": (1, "e-pi"), "e_aux": (6, "e-aux")}  # flag: (default, ablation folder)


@dataclass
class Reference:
    key: str  # "<file>/<experiment>", e.g. "phasic_policy_gradient/ppg"
    label: str  # as tables and figures name it, e.g. "official PPG"
    description: str
    mode: str
    num_levels: int
    split: str  # "train" (the return on the training levels) or "test" (train-procgen's test worker)
    curves: dict  # {game: [(steps, returns) of each seed]}


_REFERENCES = {}


def load_references(folder=REFERENCE_DIR):
    """{key: Reference} from the .json.gz files in `folder` (read once); {} where they are missing."""
    if folder in _REFERENCES:
        return _REFERENCES[folder]
    references = {}
    for stem, name in REFERENCE_FILES.items():
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            continue
        data = read_reference_file(path)
        for experiment, meta in data["experiments"].items():
            if stem == "phasic_policy_gradient":
                flag, value = experiment.rsplit("-", 1) if "-" in experiment else (experiment, "")
                symbol = {"e-pi": "E_pi", "e-aux": "E_aux", "n-pi": "N_pi"}.get(flag, flag)
                label = OFFICIAL_LABELS.get(experiment, f"official PPG ({symbol} = {value})")
            else:
                label = f"official baselines PPO ({experiment})"
            curves = {}
            for seed in meta["seeds"]:
                for game, curve in data["curves"][seed].items():
                    returns = np.array([np.nan if value is None else value for value in curve["returns"]])
                    kept = ~np.isnan(returns)
                    curves.setdefault(game, []).append((np.array(curve["steps"], dtype=float)[kept], returns[kept]))
            references[f"{stem}/{experiment}"] = Reference(f"{stem}/{experiment}", label, meta["description"],
                                                           meta["mode"], meta["num_levels"], meta["split"], curves)
    _REFERENCES[folder] = references
    return references


def read_reference_file(path):
    """One .json.gz file of this folder as its JSON, each curve `curves[seed][game]` with its "steps" and "returns": the
    file writes an experiment's steps once (`experiments[name]["steps"]`) and a curve's own only where they differ."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    for meta in data["experiments"].values():
        for seed in meta["seeds"]:
            for curve in data["curves"][seed].values():
                curve.setdefault("steps", meta["steps"])
    return data


def match_references(args):
    """(keys for the training return, keys for the evaluation return) of the reference experiments that ran what this
    run runs, best match first; empty where none did. The match: the script (PPO or PPG, whatever --exp-name), the
    distribution mode and number of training levels, and for PPG --arch, --policy-loss and N_pi / E_pi / E_aux:
    - ppo_procgen.py, clipped loss: train-procgen's baselines PPO, easy-all / easy-200 / hard-all / hard-500 (with
      --num-levels 200 or 500 the evaluation, on unseen levels, is matched with the test worker); in hard mode on all
      levels also the PPG paper's PPO baseline, first when the run uses PPG's --init normed or --adv-norm batch;
    - ppg_procgen.py, hard mode, all levels: --policy-loss kl-penalty -> ppgkl, --arch detach -> ppgsingle, else ppg;
      with one of N_pi, E_pi, E_aux changed (and the rest at the defaults), the official one-seed ablation of it."""
    script = os.path.basename(args.get("script") or f"{args.get('exp_name', '')}.py")
    mode = args.get("distribution_mode")
    levels = args.get("num_levels", 0)
    clipped = args.get("policy_loss", "clip") == "clip"
    if script == "ppo_procgen.py" and clipped and (mode, levels) in (("easy", 0), ("easy", 200), ("hard", 0),
                                                                     ("hard", 500)):
        stem = f"train_procgen/{mode}-{levels or 'all'}"
        if levels:
            return [f"{stem}-train"], [f"{stem}-test"]
        if mode == "easy":
            return [stem], [stem]
        keys = [stem, "phasic_policy_gradient/ppo"]
        if args.get("init") == "normed" or args.get("adv_norm") == "batch":  # the PPG paper's PPO baseline
            keys.reverse()
        return keys, keys
    if script == "ppg_procgen.py" and mode == "hard" and levels == 0:
        name = "ppgkl" if not clipped else "ppgsingle" if args.get("arch") == "detach" else "ppg"
        changed = [(flag, args[flag]) for flag, (default, _) in PPG_DEFAULTS.items()
                   if args.get(flag, default) != default]
        if changed and (name != "ppg" or len(changed) > 1):
            return [], []
        if changed:
            name = f"{PPG_DEFAULTS[changed[0][0]][1]}-{changed[0][1]}"
        return [f"phasic_policy_gradient/{name}"], [f"phasic_policy_gradient/{name}"]
    return [], []



def reference_at(reference, game, step):
    """The reference seeds' returns at `step` (linear interpolation between logged rows), or None where a seed has not
    logged both a row at or before and one at or after it."""
    curves = reference.curves.get(game, [])
    if not curves or any(not len(x) or step < x[0] or step > x[-1] for x, _ in curves):
        return None
    return np.array([np.interp(step, x, y) for x, y in curves])


def format_step(step):
    return f"{step / 1e6:.1f}M" if step >= 1e5 else f"{step / 1e3:.1f}k"


# The on-track rule. About 160 episodes end in a 16,384-step iteration of baselines PPO, so one logged row (the mean of
# the last 100 episodes) is one iteration's statistic that moves by ~0.4 from row to row on StarPilot: a
# single point on either side decides "below" or "above" by chance. Both sides are averaged over the same window
# instead: the anchor's last WINDOW_ROWS logged iterations before the step.
WINDOW_ROWS = 8


def reference_window(reference, game, step):
    """(W, each reference seed's mean return over its rows in (step - W, step]): W = WINDOW_ROWS x the reference's row
    spacing (baselines PPO easy: 8 x 16,384 steps; hard and the official PPG runs: 8 x 65,536); None where a seed did
    not log through `step` or has no row in the window."""
    curves = reference.curves.get(game, [])
    spacings = [np.diff(x).min() for x, _ in curves if len(x) > 1]
    if not spacings or any(not len(x) or x[-1] < step for x, _ in curves):
        return None
    width = WINDOW_ROWS * min(spacings)
    means = [window_mean(x, y, step, width) for x, y in curves]
    return None if None in means else (width, np.array(means))


def window_mean(steps, returns, step, width):
    """The mean of the `returns` logged at `steps` in (step - width, step], None where none is."""
    inside = (np.asarray(steps) > step - width) & (np.asarray(steps) <= step)
    return float(np.mean(np.asarray(returns)[inside])) if inside.any() else None


def windowed_line(game, step, our_curves, reference):
    """The on-track line of our seeds' (steps, last-100-episode returns) curves at `step` against `reference`, each side
    the mean over the window of `reference_window`; None where the reference has no window there or a seed of ours
    logged no row in it."""
    window = reference_window(reference, game, step)
    if window is None:
        return None
    width, theirs = window
    ours = [window_mean(x, y, step, width) for x, y in our_curves]
    if not ours or None in ours:
        return None
    return on_track_line(f"{game} @ {format_step(step)} (mean of the last {width / 1e3:,.0f}k steps)", ours,
                         reference.label, theirs)


def on_track_line(heading, ours, label, theirs):
    """`starpilot @ 12.0M (mean of the last 524k steps): ours 14.2 ± 1.1 (3 seeds) vs official PPG 13.0 [11.5, 14.8]
    (within)`: after the `heading`, our mean (and std over seeds) against the reference seeds' mean and range, and
    where ours falls in that range."""
    ours = np.asarray(ours, dtype=float)
    spread = f" ± {ours.std(ddof=1):.1f}" if len(ours) > 1 else ""
    low, high = theirs.min(), theirs.max()
    verdict = "below" if ours.mean() < low else "above" if ours.mean() > high else "within"
    return (f"{heading}: ours {ours.mean():.1f}{spread} ({len(ours)} seed{'s' * (len(ours) > 1)}) "
            f"vs {label} {theirs.mean():.1f} [{low:.1f}, {high:.1f}] ({verdict})")


def no_match_reason(args):
    """Why `match_references(args)` found no anchor, in a few words (None when it found one)."""
    if any(match_references(args)):
        return None
    script = os.path.basename(args.get("script") or f"{args.get('exp_name', '')}.py")
    mode = args.get("distribution_mode")
    levels = args.get("num_levels", 0)
    if script not in ("ppo_procgen.py", "ppg_procgen.py"):
        return f"{script}: no anchor ran it on Procgen (the official runs are PPO and PPG)"
    if script == "ppo_procgen.py" and args.get("policy_loss", "clip") != "clip":
        return "ppo_procgen.py --policy-loss kl-penalty: the anchors ran the clipped surrogate"
    if script == "ppo_procgen.py":
        return (f"ppo_procgen.py --distribution-mode {mode} --num-levels {levels}: baselines PPO ran easy with 0 or "
                "200 levels and hard with 0 or 500")
    if (mode, levels) != ("hard", 0):
        return (f"ppg_procgen.py --distribution-mode {mode} --num-levels {levels}: the official PPG runs are hard "
                "mode on all levels (--num-levels 0)")
    changed = [f"--{flag.replace('_', '-')} {args[flag]}" for flag, (default, _) in PPG_DEFAULTS.items()
               if args.get(flag, default) != default]
    return f"ppg_procgen.py {' '.join(changed)}: no official run changed these together (or with this variant)"


def run_on_track_line(args, global_step, metrics_path):
    """One run's line at `global_step`, exactly as `results.py --on-track` prints it for one seed, from the rows
    of its metrics.jsonl (`metrics_path`); None where no anchor matches `args` (a run's args.json as a dict, with
    "script"), the anchor did not log through that step or the run logged no training row in the window (as an
    --eval-only run's folder)."""
    keys = match_references(args)[0]
    references = load_references()
    if not keys or keys[0] not in references or not os.path.exists(metrics_path):
        return None
    return windowed_line(args["env_id"], global_step, [read_last100(metrics_path)], references[keys[0]])


def read_last100(metrics_path):
    """(steps, returns) of a metrics.jsonl's rows with a last-100-episode mean (a cut-off last line is left out)."""
    steps, returns = [], []
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line) if line.endswith("\n") else {}
            if row.get("charts/episodic_return_last100") is not None:
                steps.append(row["global_step"])
                returns.append(row["charts/episodic_return_last100"])
    return np.array(steps, dtype=float), np.array(returns, dtype=float)
