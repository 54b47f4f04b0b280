"""What each anchor reached, from the reference data alone: per-game tables and learning-curve figures of the anchors'
own runs (the numbers and figures of docs/results.md).

  python benchmarks/reference/anchors.py --out docs/anchors      # anchors.md and three PNGs

Per game: the mean +- std over seeds of the return (the last-100-episode mean the anchors log) at a step, linearly
interpolated between the stored rows (benchmarks/reference/ keeps every logged row of both anchors); "final" is the
final logged row. Aggregates: per game the mean over
seeds, normalized with Procgen's published ranges of the mode, then the mean over games (the PPG paper's headline),
and the IQM with a 95% stratified-bootstrap interval (benchmarks/results.py's estimators).
"""
import argparse
import io
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import results  # noqa: E402  (benchmarks/results.py: the reference loader and the estimators)

GAMES = sorted(results.PROCGEN_RANGES)
TABLES = [  # (title, figure, [(reference key, short name)], marks: (column name, step or None for the final row))
    ("Official PPG code, hard mode, all levels, 4 x 64 envs (openai/phasic-policy-gradient results/)",
     "official_ppg_hard.png",
     [("phasic_policy_gradient/ppo", "PPO"), ("phasic_policy_gradient/ppg", "PPG"),
      ("phasic_policy_gradient/ppgsingle", "PPG single"), ("phasic_policy_gradient/ppgkl", "PPG-KL")],
     [("25M", 25e6), ("final (100.0M)", None)]),
    ("Baselines PPO, easy mode, 1 x 64 envs (openai/train-procgen results/): all levels, and 200 training levels "
     "(train: on those levels; test: the test worker, unseen levels)", "baselines_ppo_easy.png",
     [("train_procgen/easy-all", "easy-all"), ("train_procgen/easy-200-train", "easy-200 train"),
      ("train_procgen/easy-200-test", "easy-200 test")],
     [("25M", 25e6), ("final (50.0M)", None)]),
    ("Baselines PPO, hard mode, 4 x 64 envs (openai/train-procgen results/): all levels, and 500 training levels",
     "baselines_ppo_hard.png",
     [("train_procgen/hard-all", "hard-all"), ("train_procgen/hard-500-train", "hard-500 train"),
      ("train_procgen/hard-500-test", "hard-500 test")],
     [("25M", 25e6), ("100M", 100e6), ("final (200.0M)", None)]),
]


def returns_at(reference, game, step):
    """Each seed's return at `step` (None: the final logged row)."""
    if step is None:
        return np.array([y[-1] for _, y in reference.curves[game]])
    return results.reference_at(reference, game, step)


def table(references, entries, marks, rng, reps):
    header = ["game"] + [f"{name} @ {mark}" for _, name in entries for mark, _ in marks]
    rows = []
    per_column = []
    for key, _ in entries:
        for _, step in marks:
            per_column.append((references[key], step))
    for game in GAMES:
        cells = [game]
        for reference, step in per_column:
            values = returns_at(reference, game, step)
            cells.append(f"{values.mean():.2f} ± {values.std(ddof=1):.2f}" if len(values) > 1 else f"{values[0]:.2f}")
        rows.append(cells)
    mean_row = ["**mean normalized**"]
    iqm_row = ["IQM [95% CI]"]
    for reference, step in per_column:
        scores = [results.normalized_score(game, reference.mode, returns_at(reference, game, step)) for game in GAMES]
        mean_row.append(f"**{np.mean([s.mean() for s in scores]):.3f}**")
        metrics, _ = results.aggregate_scores({"x": scores}, reps, 0.95, rng)
        value, (low, high) = metrics["x"]["IQM"]
        iqm_row.append(f"{value:.3f} [{low:.3f}, {high:.3f}]")
    return results.markdown_table(header, rows + [mean_row, iqm_row])


def figure(path, references, entries, title):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(4, 4, figsize=(15, 12), constrained_layout=True)
    for axis, game in zip(axes.flat, GAMES):
        for number, (key, name) in enumerate(entries):
            reference = references[key]
            curves = reference.curves[game]
            steps = curves[0][0]
            aligned = np.stack([np.interp(steps, x, y) for x, y in curves])
            axis.plot(steps / 1e6, aligned.mean(axis=0), color=f"C{number}", linewidth=1,
                      label=f"{name} ({len(curves)} seed{'s' * (len(curves) > 1)})")
            axis.fill_between(steps / 1e6, aligned.min(axis=0), aligned.max(axis=0), color=f"C{number}", alpha=0.2,
                              linewidth=0)
        axis.set_title(game)
        axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel("environment steps (M)")
    for axis in axes[:, 0]:
        axis.set_ylabel("return (last 100 episodes)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"The anchors' own runs: {title}\nline: mean over seeds; band: min-max over seeds "
                 "(data: benchmarks/reference/)")
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=60)
    plt.close(fig)
    try:  # a 64-colour palette: a quarter of the bytes, the same picture to the eye
        from PIL import Image
        Image.open(buffer).convert("RGB").quantize(64).save(path, optimize=True)
    except ImportError:
        with open(path, "wb") as f:
            f.write(buffer.getvalue())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("docs", "anchors"), help="folder for anchors.md and the PNGs")
    parser.add_argument("--reps", type=int, default=50_000, help="bootstrap resamples")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    references = results.load_references()
    rng = np.random.default_rng(0)
    lines = [f"Made by `python benchmarks/reference/anchors.py --out {args.out} --reps {args.reps}`.", ""]
    for title, name, entries, marks in TABLES:
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
        lines += table(references, entries, marks, rng, args.reps)
        figure(os.path.join(args.out, name), references, entries, title.split(" (")[0])
    with open(os.path.join(args.out, "anchors.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}/: " + ", ".join(sorted(os.listdir(args.out))))


if __name__ == "__main__":
    main()
