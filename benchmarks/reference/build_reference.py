"""Rebuild the reference curves in this folder from the anchors' committed result CSVs (both MIT-licensed, see the
LICENSE-* files here):

  git clone https://github.com/openai/phasic-policy-gradient  /tmp/phasic-policy-gradient
  git clone https://github.com/openai/train-procgen           /tmp/train-procgen
  python benchmarks/reference/build_reference.py --ppg /tmp/phasic-policy-gradient --train-procgen /tmp/train-procgen

Either path may be the checkout or its results folder (`phasic_policy_gradient/results`, `train_procgen/results`).
Writes `phasic_policy_gradient.json.gz` and `train_procgen.json.gz` next to this script (or to --out); the bytes do not
depend on the time of the build, so `git diff` shows whether a rebuild changed anything.

What is kept: every run folder (every seed, every ablation) and every game; the return column (`EpRewMean` in the
official PPG CSVs, `eprewmean` in train-procgen's: both the mean return of the last 100 episodes); every logged row
(the on-track rule in on_track.py averages the anchor's last 8 rows before a step: a window needs all of them; the
files record this as "stride": 1); returns rounded to 5 decimals. Steps are exact, as the repos' own graph.py counts
them:
- official PPG: row i (1-based) is logged after i iterations of 4 workers x 64 envs x 256 steps = i x 65,536 steps
  (`ppo.learn`: ic_per_step = venv.num * comm.size * nstep); 1,526 rows, the last at 100,007,936 steps;
- train-procgen: `misc/total_timesteps` (per worker) x the number of workers graph.py assumes (1 in easy mode, 4 in
  hard mode); 3,051 rows, the last at 49,987,584 (easy) or 199,950,336 (hard) steps. The `-test` CSVs of the
  restricted-level runs are the test worker's (full distribution, never trained on), logged at the same steps.

The steps are written once per experiment (`experiments[name]["steps"]`, those of its first seed's first game); a
curve keeps its own "steps" only where they differ (in the committed CSVs none does: every game of every seed of an
experiment logged the same steps). Written out per curve, train-procgen's 288 step lists of ~30 KB each fell outside
gzip's 32 KB window and made a 5 MB file (1.4 MB now). on_track.read_reference_file gives every curve its steps back.
"""
import argparse
import csv
import gzip
import io
import json
import os
import re
import subprocess

GAMES = ["bigfish", "bossfight", "caveflyer", "chaser", "climber", "coinrun", "dodgeball", "fruitbot", "heist",
         "jumper", "leaper", "maze", "miner", "ninja", "plunder", "starpilot"]
HERE = os.path.dirname(os.path.abspath(__file__))

# Official PPG experiments: name -> (what it is, run folders). Hard mode, full distribution, 100M steps.
PPG_EXPERIMENTS = {
    "ppo": ("PPO baseline (PPG code, --n_epoch_pi 3 --n_epoch_vf 3 --n_aux_epochs 0 --arch shared)", "ppo-run"),
    "ppg": ("PPG, dual networks (--arch dual, the default)", "ppg-run"),
    "ppgsingle": ("PPG, single network (--arch detach)", "ppgsingle-run"),
    "ppgkl": ("PPG with a KL penalty instead of the clipped policy loss", "ppgkl-run"),
}
PPG_ABLATIONS = {"e-pi": "E_pi (policy epochs) = {}", "e-aux": "E_aux (auxiliary epochs) = {}",
                 "n-pi": "N_pi (policy iterations per phase) = {}"}


def results_folder(path, inner):
    candidate = os.path.join(path, inner)
    return candidate if os.path.isdir(candidate) else path


def read_column(path, column):
    """The column's values, one per row; empty cells (a row logged before any episode ended) are NaN."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = [name.lower() for name in rows[0]]
    index = header.index(column.lower())
    cells = [row[index] if index < len(row) else "" for row in rows[1:]]
    return [float(cell) if cell != "" else float("nan") for cell in cells], header, rows[1:]


def curve(steps, returns):
    """Every row: the steps as integers, the returns rounded to 5 decimals, an empty cell (NaN) as None."""
    return {"steps": [int(step) for step in steps],
            "returns": [None if value != value else round(value, 5) for value in returns]}


def git_commit(path):
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def build_ppg(path, commit=None):
    folder = results_folder(path, os.path.join("phasic_policy_gradient", "results"))
    experiments = {}
    curves = {}
    runs = sorted(name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name)))
    for name, (description, prefix) in PPG_EXPERIMENTS.items():
        seeds = sorted(run for run in runs if re.fullmatch(re.escape(prefix) + r"\d+", run))
        experiments[name] = {"description": description, "mode": "hard", "num_levels": 0, "split": "train",
                             "seeds": seeds}
    for prefix, description in PPG_ABLATIONS.items():
        for run in sorted((run for run in runs if re.fullmatch(re.escape(prefix) + r"-\d+", run)),
                          key=lambda run: int(run.rsplit("-", 1)[1])):
            experiments[run] = {"description": "PPG ablation, one seed: " + description.format(run.rsplit("-", 1)[1]),
                                "mode": "hard", "num_levels": 0, "split": "train", "seeds": [run]}
    for experiment in experiments.values():
        for run in experiment["seeds"]:
            curves[run] = {}
            for game in GAMES:
                returns, _, _ = read_column(os.path.join(folder, run, f"progress-{game}.csv"), "EpRewMean")
                steps = [(i + 1) * 4 * 64 * 256 for i in range(len(returns))]
                curves[run][game] = curve(steps, returns)
    return {"source": "openai/phasic-policy-gradient", "path": "phasic_policy_gradient/results",
            "commit": commit or git_commit(path), "license": "LICENSE-phasic-policy-gradient", "column": "EpRewMean",
            "stride": 1, "steps": "row i (1-based) x 4 workers x 64 envs x 256 steps", "experiments": experiments,
            "curves": curves}


def build_train_procgen(path, commit=None):
    """train-procgen's curves, every row."""
    folder = results_folder(path, os.path.join("train_procgen", "results"))
    experiments = {}
    curves = {}
    for mode, levels, workers in (("easy", 0, 1), ("easy", 200, 1), ("hard", 0, 4), ("hard", 500, 4)):
        stem = f"{mode}-{levels or 'all'}"
        splits = ("train", "test") if levels else ("train",)
        for split in splits:
            name = stem if not levels else f"{stem}-{split}"
            seeds = sorted(run for run in os.listdir(folder) if re.fullmatch(re.escape(stem) + r"-run\d+", run))
            where = ("trained on all levels" if not levels else
                     f"{levels} training levels, " + ("return on those levels" if split == "train" else
                                                      "return of the test worker on unseen levels"))
            experiments[name] = {"description": f"baselines PPO, {mode} mode, {workers} x 64 envs, {where}",
                                 "mode": mode, "num_levels": levels, "split": split,
                                 "seeds": [f"{run}:{split}" for run in seeds]}
            for run in seeds:
                curves[f"{run}:{split}"] = {}
                for game in GAMES:
                    suffix = f"-{split}" if levels else ""
                    returns, header, rows = read_column(os.path.join(folder, run, f"progress-{game}{suffix}.csv"),
                                                        "eprewmean")
                    column = header.index("misc/total_timesteps")
                    steps = [int(float(row[column])) * workers for row in rows]
                    curves[f"{run}:{split}"][game] = curve(steps, returns)
    return {"source": "openai/train-procgen", "path": "train_procgen/results", "commit": commit or git_commit(path),
            "license": "LICENSE-train-procgen", "column": "eprewmean", "stride": 1,
            "steps": "misc/total_timesteps x workers (1 in easy mode, 4 in hard mode, as in train_procgen/graph.py)",
            "experiments": experiments, "curves": curves}


def steps_once(data):
    """The file's layout: each experiment's steps once (those of its first seed's first game), a curve's own steps only
    where they differ (an experiment without seeds: an empty list)."""
    for experiment in data["experiments"].values():
        seeds = experiment["seeds"]
        experiment["steps"] = data["curves"][seeds[0]][GAMES[0]]["steps"] if seeds else []
        for seed in seeds:
            for game_curve in data["curves"][seed].values():
                if game_curve["steps"] == experiment["steps"]:
                    del game_curve["steps"]
    return data


def write(data, path):
    data = steps_once(data)
    text = json.dumps(data, separators=(",", ":"), sort_keys=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as f:  # mtime 0: reproducible bytes
        f.write(text.encode())
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
    print(f"wrote {path}: {len(buffer.getvalue()):,} bytes, {len(data['curves'])} runs x {len(GAMES)} games")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ppg", required=True, help="openai/phasic-policy-gradient checkout or its results folder")
    parser.add_argument("--train-procgen", required=True, help="openai/train-procgen checkout or its results folder")
    parser.add_argument("--ppg-commit", help="the commit of --ppg, if it is not a git checkout")
    parser.add_argument("--train-procgen-commit", help="the commit of --train-procgen, if it is not a git checkout")
    parser.add_argument("--out", default=HERE, help="where the .json.gz files go (default: this folder)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    write(build_ppg(args.ppg, commit=args.ppg_commit), os.path.join(args.out, "phasic_policy_gradient.json.gz"))
    write(build_train_procgen(args.train_procgen, commit=args.train_procgen_commit),
          os.path.join(args.out, "train_procgen.json.gz"))


if __name__ == "__main__":
    main()
