"""ppo_rlhf_toy.py's whole pipeline once per seed, then mean +- standard error over the seeds.

    python benchmarks/rlhf_seeds.py --seeds 1 2 3 4 5                  # PPO (beta 0.05) against best-of-n
    python benchmarks/rlhf_seeds.py --seeds 1 2 3 --sweep --ppo-iterations 150 --sweep-plot docs/rlhf_sweep.png

Every flag of ppo_rlhf_toy.py applies to each run (--seed is replaced by --seeds). Each seed trains its own SFT
model, reward model and PPO policy, so the spread covers the whole pipeline. Standard error = sample standard
deviation (ddof 1) / sqrt(seeds). Prints Markdown tables; writes every seed's numbers and the aggregate as JSON.
"""
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_rlhf_toy as toy  # noqa: E402  (tooling may import the script; the scripts never import each other)

EVAL_KEYS = ["gold/score", "proxy/score", "objective/kl", "gold/grammar_rate", "gold/repeat_rate", "gold/distinct_frac"]
KL_LEVELS = (1.0, 2.0, 4.0, 6.0)  # where the runs of different beta are compared at the same KL
RM_KEYS = ["rm/heldout_acc", "rm/heldout_acc_gold", "rm/label_ceiling", "rm/heldout_loss", "rm/train_pairs",
           "rm/heldout_pairs"]


@dataclass
class SeedsArgs(toy.Args):
    seeds: Tuple[int, ...] = (1, 2, 3)
    """seeds to run, one whole pipeline each (replaces --seed)"""
    out: Optional[str] = None
    """JSON with every seed's numbers and the aggregate (default runs/rlhf_seeds__{time}.json)"""
    sweep_plot: Optional[str] = None
    """with --sweep: where to write the plot of gold and proxy against sqrt(KL) and episodes (none by default)"""


# PPO iterations in the centred moving average of the sweep's curves and peaks: enough to average out the noise of
# rollout-batch means, short enough to keep beta = 0's gold peak, which lasts a few iterations (a 9-iteration window
# lowered it by another 0.19, mean of 3 seeds)
SMOOTHING_WINDOW = 5


def moving_average(values):
    """Centred moving average over SMOOTHING_WINDOW iterations (all of them if fewer): output j is centred on input
    j + (window - 1) // 2. Rollout-batch means are noisy; the sweep's curves and peaks use this."""
    window = min(SMOOTHING_WINDOW, len(values))
    return np.convolve(values, np.ones(window) / window, mode="valid")


def mean_and_standard_error(values):
    """Mean over seeds and its standard error, std (ddof 1) / sqrt(seeds); 0 with a single seed."""
    values = np.asarray(values, dtype=float)
    seeds = len(values)
    spread = values.std(axis=0, ddof=1) / math.sqrt(seeds) if seeds > 1 else np.zeros_like(values.mean(0))
    return values.mean(axis=0), spread


def mean_se(values):
    """{'mean', 'se'} over seeds."""
    mean, error = mean_and_standard_error(values)
    return {"mean": float(mean), "se": float(error)}


def smoothed_peak(histories):
    """Where the seed-mean of the smoothed gold curves peaks (one seed: that run's). `histories`: one PPO
    history per seed (same length). Returns the iteration (1-based, the window's centre), gold and KL there, each
    with its standard error."""
    window = min(SMOOTHING_WINDOW, len(histories[0]))
    curves = {key: np.stack([moving_average([record[key] for record in history]) for history in histories])
              for key in ("gold/score", "objective/kl")}
    gold, gold_error = mean_and_standard_error(curves["gold/score"])
    peak = int(gold.argmax())
    kl, kl_error = mean_and_standard_error(curves["objective/kl"])
    return {"iteration": peak + (window - 1) // 2 + 1, "gold/score": float(gold[peak]),
            "gold/score se": float(gold_error[peak]), "objective/kl": float(kl[peak]),
            "objective/kl se": float(kl_error[peak])}


def gold_at_kl(history, level):
    """Gold score of the first PPO iteration whose rollout-batch KL reaches `level`, or None if none does. Raw batch
    means: a moving average over a run whose KL rises fast would mix several KLs."""
    return next((record["gold/score"] for record in history if record["objective/kl"] >= level), None)


def aggregate(results):
    """Mean +- standard error over seeds of the RM's numbers, the SFT and final PPO evaluations, best-of-n, the
    paired difference PPO - best-of-n (largest n) of each seed, and the smoothed gold peak of each beta."""
    def over_seeds(get):
        return mean_se([get(result) for result in results])

    betas = list(results[0]["ppo"])
    scores = ("gold/score", "proxy/score")
    largest_n = results[0]["bon"][-1]["n"]
    summary = {"seeds": len(results),
               "rm": {key: over_seeds(lambda result: result["rm"][key]) for key in RM_KEYS},
               "sft": {key: over_seeds(lambda result: result["sft"][key]) for key in EVAL_KEYS},
               "ppo": {}, "bon": [], f"ppo_minus_best_of_{largest_n}": {}, "smoothed_peak": {}, "gold_at_kl": {}}
    for beta in betas:
        summary["ppo"][beta] = {key: over_seeds(lambda result: result["ppo"][beta][key]) for key in EVAL_KEYS}
        summary[f"ppo_minus_best_of_{largest_n}"][beta] = {
            key: over_seeds(lambda result: result["ppo"][beta][key] - result["bon"][-1][key]) for key in scores}
        summary["smoothed_peak"][beta] = smoothed_peak([result["histories"][float(beta)] for result in results])
        summary["gold_at_kl"][beta] = {}
        for level in KL_LEVELS:  # over the seeds whose run reached this KL
            golds = [gold_at_kl(result["histories"][float(beta)], level) for result in results]
            reached = [gold for gold in golds if gold is not None]
            summary["gold_at_kl"][beta][str(level)] = {**(mean_se(reached) if reached else {}), "seeds": len(reached)}
    for index, row in enumerate(results[0]["bon"]):
        summary["bon"].append({"n": row["n"], "kl_bound": row["kl_bound"],
                               **{key: over_seeds(lambda result: result["bon"][index][key]) for key in scores}})
    return summary


def plot_sweep(runs, path):
    """Gold and proxy vs sqrt(KL) and vs episodes, and KL vs episodes, for each beta of a sweep.
    `runs` holds one (histories by beta, best-of-n rows) pair per seed. Lines: the mean over seeds
    of each seed's centred moving average; bands: +- one standard error over seeds (none with one
    seed)."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global state

    fig = Figure(figsize=(17, 4.8))
    axes = fig.subplots(1, 3)
    colors = ["tab:purple", "tab:blue", "tab:green", "tab:orange", "tab:brown"] * 9
    def curve(beta, key, transform=np.asarray):  # mean and standard error over seeds of the smoothed curves
        smoothed = [moving_average(transform([record[key] for record in histories[beta]])) for histories, _ in runs]
        return mean_and_standard_error(smoothed)

    for beta, color in zip(runs[0][0], colors):
        sqrt_kl = curve(beta, "objective/kl", lambda kl: np.sqrt(np.maximum(kl, 0)))[0]
        episodes = curve(beta, "episode")[0]
        for key, style, what in (("gold/score", "-", "gold"), ("proxy/score", "--", "proxy (RM)")):
            mean, error = curve(beta, key)
            axes[0].plot(sqrt_kl, mean, style, color=color, label=f"PPO beta={beta:g}: {what}")
            axes[0].fill_between(sqrt_kl, mean - error, mean + error, color=color, alpha=0.15, lw=0)
            axes[1].plot(episodes, mean, style, color=color)
            axes[1].fill_between(episodes, mean - error, mean + error, color=color, alpha=0.15, lw=0)
        mean, error = curve(beta, "objective/kl")
        axes[2].plot(episodes, mean, color=color, label=f"beta={beta:g}")
        axes[2].fill_between(episodes, mean - error, mean + error, color=color, alpha=0.15, lw=0)
    bon_rows = runs[0][1]
    for key, style in (("gold/score", "o-"), ("proxy/score", "o--")):
        mean, error = mean_and_standard_error([[row[key] for row in bon] for _, bon in runs])
        label = f"best-of-n (n <= {bon_rows[-1]['n']}): {key.split('/')[0]}, KL upper bound"
        axes[0].errorbar([math.sqrt(row["kl_bound"]) for row in bon_rows], mean, yerr=error, fmt=style, ms=4,
                         color="tab:red", label=label)
    seeds = f"mean +- SE over {len(runs)} seeds, " if len(runs) > 1 else ""
    smoothing = f"{seeds}{SMOOTHING_WINDOW}-iteration centred moving average"
    ylabel = "score (solid: hidden gold, dashed: proxy RM)"
    axes[0].set(xlabel="sqrt(KL(pi || pi_ref))  [sqrt nats]", ylabel=ylabel, title="gold and proxy vs sqrt(KL)")
    axes[1].set(xlabel="episodes", ylabel=ylabel, title=f"gold and proxy during PPO\n({smoothing})")
    axes[2].set(xlabel="episodes", ylabel="KL(pi || pi_ref)  [nats]", title="KL to the SFT reference during PPO")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)


def show(number, digits=3, sign="+"):
    return f"{number['mean']:{sign}.{digits}f} ± {number['se']:.{digits}f}"


def show_reached(cell, seeds):
    """Mean ± standard error over the seeds whose run got there, saying how many when not all did."""
    if cell["seeds"] == 0:
        return "never"
    return show(cell) + ("" if cell["seeds"] == seeds else f" ({cell['seeds']} of {seeds} seeds)")


def print_tables(summary):
    print(f"\nmean ± standard error over {summary['seeds']} seeds\n")
    rm = summary["rm"]
    print(f"reward model: held-out accuracy {show(rm['rm/heldout_acc'], sign='')} vs noisy labels (ceiling "
          f"{show(rm['rm/label_ceiling'], sign='')}), {show(rm['rm/heldout_acc_gold'], sign='')} vs the gold order; "
          f"held-out loss {show(rm['rm/heldout_loss'], sign='')}; {rm['rm/train_pairs']['mean']:.0f} training / "
          f"{rm['rm/heldout_pairs']['mean']:.0f} held-out pairs\n")
    print("| policy | gold (hidden, max 2) | proxy (RM) | KL to SFT (nats) | grammar | repeats | distinct |")
    print("|---|---|---|---|---|---|---|")
    rows = [("SFT", summary["sft"])] + [(f"PPO, β = {beta}", final) for beta, final in summary["ppo"].items()]
    for name, final in rows:
        print(f"| {name} | {show(final['gold/score'])} | {show(final['proxy/score'])} | "
              f"{show(final['objective/kl'], 2, '')} | {show(final['gold/grammar_rate'], 2, '')} | "
              f"{show(final['gold/repeat_rate'], 2, '')} | {show(final['gold/distinct_frac'], 2, '')} |")
    for row in summary["bon"]:
        print(f"| best-of-{row['n']} from SFT | {show(row['gold/score'])} | {show(row['proxy/score'])} | "
              f"≤ {row['kl_bound']:.2f} | | | |")
    difference_key = next(key for key in summary if key.startswith("ppo_minus_best_of_"))
    for beta, difference in summary[difference_key].items():
        print(f"\nPPO (β = {beta}) − best-of-{difference_key.rsplit('_', 1)[1]}, paired by seed: gold "
              f"{show(difference['gold/score'])}, proxy {show(difference['proxy/score'])}")
    print(f"\n| β | peak of the smoothed gold ({SMOOTHING_WINDOW}-iteration centred moving average, seed mean) "
          "| KL there | iteration | final gold | final proxy | final KL |")
    print("|---|---|---|---|---|---|---|")
    for beta, peak in summary["smoothed_peak"].items():
        final = summary["ppo"][beta]
        print(f"| {beta} | {peak['gold/score']:+.3f} ± {peak['gold/score se']:.3f} | {peak['objective/kl']:.2f} ± "
              f"{peak['objective/kl se']:.2f} | {peak['iteration']} | {show(final['gold/score'])} | "
              f"{show(final['proxy/score'])} | {show(final['objective/kl'], 2, '')} |")
    seeds = summary["seeds"]
    print(f"\n| β | {' | '.join(f'gold where KL first reaches {level:g}' for level in KL_LEVELS)} |")
    print("|---|" + "---|" * len(KL_LEVELS))
    for beta, levels in summary["gold_at_kl"].items():
        print(f"| {beta} | {' | '.join(show_reached(cell, seeds) for cell in levels.values())} |")


def main(args):
    toy_args = toy.Args(**{field.name: getattr(args, field.name) for field in dataclasses.fields(toy.Args)})
    for seed in args.seeds:  # every seed's flags are checked before the first run starts
        toy.validate_args(dataclasses.replace(toy_args, seed=seed))
    start = time.time()
    results = []
    for seed in args.seeds:
        print(f"\n##### seed {seed}", flush=True)
        result = toy.train(dataclasses.replace(toy_args, seed=seed))
        results.append(result)
    summary = aggregate(results)
    print_tables(summary)
    if args.sweep and args.sweep_plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.sweep_plot)), exist_ok=True)
        plot_sweep([(result["histories"], result["bon"]) for result in results], args.sweep_plot)
        print(f"plot: {args.sweep_plot}")
    out = args.out or os.path.join("runs", f"rlhf_seeds__{int(time.time())}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    record = {"command": sys.argv, "seeds": list(args.seeds), "wall_s": time.time() - start, "aggregate": summary,
              "per_seed": [{**{key: value for key, value in result.items() if key != "histories"},
                            "smoothed_peak": {str(beta): smoothed_peak([history])
                                              for beta, history in result["histories"].items()}}
                           for result in results]}
    with open(out + ".tmp", "w") as file:
        json.dump(record, file, indent=1)
    os.replace(out + ".tmp", out)
    print(f"results: {out} ({time.time() - start:.0f} s)")
    return summary


if __name__ == "__main__":
    main(tyro.cli(SeedsArgs, description=__doc__.split("\n\n")[0]))
