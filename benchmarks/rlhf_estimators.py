"""PPO (GAE and a critic) against its critic-free successors GRPO and RLOO on ppo_rlhf_toy.py's
toy, at the same budget, over seeds and a sweep of the KL coefficient beta.

    python benchmarks/rlhf_estimators.py --seeds 1 2 3 4 --betas 0.05 0.2 \
        --out docs/rlhf_estimators.json --plot docs/rlhf_estimators.png
    python benchmarks/rlhf_estimators.py --report docs/rlhf_estimators.json --plot docs/rlhf_estimators.png

Every flag of ppo_rlhf_toy.py applies to each run (--seed, --beta and --advantage are replaced by
--seeds, --betas and --estimators). Fair by construction: every run of a seed loads the SFT policy
and the reward model that the seed's first run trained, so the estimators of a seed share the SFT
policy, the RM, the prompt distribution and best-of-n; each run generates --rollout-batch-size
responses per iteration for --ppo-iterations iterations. Runs go beta by beta (every seed and
estimator at the first beta first) and the JSON is rewritten after each run, so a stopped benchmark
keeps every finished run and a restart with the same --out skips them. The compute of each RL stage
is counted here, not in the toy: the token positions each network processes forward (and backward,
when its parameters learn), and the RL stage's wall and CPU seconds. Means over seeds with 95%
confidence intervals (Student t); differences to PPO are paired by seed.
"""
import collections
import dataclasses
import glob
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_rlhf_toy as toy  # noqa: E402  (tooling may import the script; the scripts never import each other)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rlhf_seeds  # noqa: E402  (the sweep's moving average)

HISTORY_KEYS = ("gold/score", "proxy/score", "objective/kl", "objective/entropy", "gold/distinct_frac")
FINAL_KEYS = ("gold/score", "proxy/score", "objective/kl", "gold/grammar_rate", "gold/repeat_rate",
              "gold/distinct_frac")
NAMES = {"gae": "PPO (GAE, critic)", "grpo": "GRPO", "rloo": "RLOO", "grpo-kl-reward": "GRPO, KL in the reward",
         "rloo-kl-loss": "RLOO, KL in the loss", "gae-kl-loss": "PPO, KL in the loss"}
COLORS = {"gae": "tab:blue", "grpo": "tab:orange", "rloo": "tab:green", "grpo-kl-reward": "tab:purple",
          "rloo-kl-loss": "tab:olive", "gae-kl-loss": "tab:cyan"}
WINDOWS = ((1, 5), (6, 15), (16, 30), (31, 100))  # iterations (1-based, inclusive) of the over-training table
# Two-sided 95% quantiles of Student's t by degrees of freedom (seeds - 1)
T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass
class EstimatorArgs(toy.Args):
    seeds: Tuple[int, ...] = (1, 2, 3, 4)
    """seeds, one SFT policy and reward model each (replaces --seed)"""
    betas: Tuple[float, ...] = (0.05, 0.0, 0.2)
    """KL coefficients, run in this order (replaces --beta): the first is the main comparison"""
    estimators: Tuple[str, ...] = ("gae", "grpo", "rloo")
    """the --advantage values to compare (replaces --advantage)"""
    out: str = os.path.join("runs", "rlhf_estimators.json")
    """JSON of every finished run; rewritten after each run, read back to skip finished runs"""
    plot: Optional[str] = None
    """where to write the figure (none by default)"""
    report: Tuple[str, ...] = ()
    """run nothing: print the tables (and --plot) of these JSON files, their runs together"""


# ---------------------------------------------------------------- compute: counted around the toy's RL stage
ROLES = {}  # id(network) -> its role, during one RL stage
TOKENS = collections.Counter()  # "policy forward", "critic backward", ...: token positions processed
LAST_STAGE = {}  # the compute of the last RL stage
original_forward = toy.TinyTransformer.forward
original_run_ppo = toy.run_ppo


def counting_forward(network, tokens):
    """TinyTransformer.forward, counting the token positions it processes by the network's role; a forward with
    gradient through a learning network is also a backward pass over as many positions."""
    role = ROLES.get(id(network))
    if role is not None:
        TOKENS[f"{role} forward"] += tokens.numel()
        if torch.is_grad_enabled() and network.head.weight.requires_grad:
            TOKENS[f"{role} backward"] += tokens.numel()
    return original_forward(network, tokens)


def measured_run_ppo(args, rl, beta, log=None):
    """toy.run_ppo with its networks' token positions and its wall and CPU seconds recorded in LAST_STAGE."""
    TOKENS.clear()
    ROLES.update({id(rl.policy): "policy", id(rl.ref_policy): "reference",
                  id(rl.score_fn.args[0]): "reward model"})  # score_fn = partial(proxy_score, rm, ...)
    if rl.critic is not None:
        ROLES[id(rl.critic)] = "critic"
    wall, cpu = time.time(), time.process_time()
    try:
        history = original_run_ppo(args, rl, beta, log)
    finally:
        ROLES.clear()
    LAST_STAGE.update(wall_s=time.time() - wall, cpu_s=time.process_time() - cpu, tokens=dict(TOKENS))
    return history


# ---------------------------------------------------------------- the runs
def label_of(toy_args, estimator):
    """The name a run is stored under: the --advantage value, plus where the KL enters when --kl-penalty moves it
    from that estimator's default (GRPO's paper: the loss; PPO's and RLOO's: the reward)."""
    default = "loss" if estimator == "grpo" else "reward"
    placement = toy_args.kl_penalty or default
    return estimator if placement == default else f"{estimator}-kl-{placement}"


def run_one(toy_args, seed, estimator, beta, checkpoints):
    """One toy run; the seed's first run trains and saves the SFT policy and RM, the others load them."""
    first = seed not in checkpoints
    exp_name = f"estimators_{estimator}_beta{beta:g}"
    run_args = dataclasses.replace(
        toy_args, seed=seed, advantage=estimator, beta=beta, sweep=False, exp_name=exp_name, save_model=first,
        load_sft=None if first else checkpoints[seed][0], load_rm=None if first else checkpoints[seed][1],
        bon_pool=toy_args.bon_pool if first else 2,  # best-of-n depends on the SFT policy and RM only: once a seed
        group_size=toy.Args.group_size if estimator == "gae" else toy_args.group_size)
    summary = toy.train(run_args)
    if first:
        (run_dir,) = glob.glob(os.path.join("runs", f"rlhf_sentiment__{exp_name}__{seed}__*"))[-1:]
        checkpoints[seed] = (os.path.join(run_dir, "sft.pt"), os.path.join(run_dir, "rm.pt"))
    final = {key: summary["ppo"][str(beta)][key] for key in FINAL_KEYS}
    history = [{key: record[key] for key in HISTORY_KEYS} for record in summary["histories"][beta]]
    record = {"seed": seed, "estimator": label_of(toy_args, estimator), "beta": beta, "final": final, "history": history,
              "compute": dict(LAST_STAGE), "run_wall_s": summary["wall_s"]}
    if first:
        record.update(rm=summary["rm"], sft={key: summary["sft"][key] for key in FINAL_KEYS}, bon=summary["bon"])
    return record


def main(args):
    if args.report:
        parts = []
        for path in args.report:
            with open(path) as file:
                parts.append(json.load(file))
        runs = {}  # the first file's run of each (seed, estimator, beta): benchmarks run in parallel may overlap
        for run in (run for part in parts for run in part["runs"]):
            runs.setdefault((run["seed"], run["estimator"], run["beta"]), run)
        results = {"commands": [part["command"] for part in parts], "hardware": parts[0]["hardware"],
                   "runs": list(runs.values())}
        report(results, args.plot)
        return results
    toy_args = toy.Args(**{field.name: getattr(args, field.name) for field in dataclasses.fields(toy.Args)})
    for seed, estimator, beta in [(s, e, b) for s in args.seeds for e in args.estimators for b in args.betas]:
        group_size = toy.Args.group_size if estimator == "gae" else args.group_size
        toy.validate_args(dataclasses.replace(toy_args, seed=seed, advantage=estimator, beta=beta,
                                              group_size=group_size))  # before the first run starts
    results = {"command": sys.argv, "hardware": hardware(), "runs": [], "checkpoints": {}}
    if os.path.exists(args.out):
        with open(args.out) as file:
            results = json.load(file)
    checkpoints = {int(seed): tuple(paths) for seed, paths in results["checkpoints"].items()}
    done = {(run["seed"], run["estimator"], run["beta"]) for run in results["runs"]}
    labels = {estimator: label_of(toy_args, estimator) for estimator in args.estimators}
    toy.TinyTransformer.forward = counting_forward  # the toy itself is left as it was, below
    toy.run_ppo = measured_run_ppo
    start = time.time()
    try:
        for beta, seed, estimator in [(b, s, e) for b in args.betas for s in args.seeds for e in args.estimators]:
            if (seed, labels[estimator], beta) in done:
                continue
            print(f"\n##### seed {seed}, {NAMES[labels[estimator]]}, beta {beta:g} ({time.time() - start:.0f} s)", flush=True)
            results["runs"].append(run_one(toy_args, seed, estimator, beta, checkpoints))
            results["checkpoints"] = {str(seed): paths for seed, paths in checkpoints.items()}
            write_json(args.out, results)
    finally:
        toy.TinyTransformer.forward = original_forward
        toy.run_ppo = original_run_ppo
    report(results, args.plot)
    print(f"results: {args.out} ({time.time() - start:.0f} s)")
    return results


def hardware():
    """The CPU's model name and count, and the torch version: the figures' hardware."""
    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as file:
            model = next((line.split(":", 1)[1].strip() for line in file if line.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as file:
        json.dump(data, file, indent=None, separators=(",", ":"))
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------- statistics, tables, figure
def mean_and_interval(values):
    """Mean over seeds and the half-width of its 95% confidence interval (Student t, seeds - 1 degrees of freedom;
    0 with one seed)."""
    values = np.asarray(values, dtype=float)
    seeds = len(values)
    if seeds < 2:
        return values.mean(0), np.zeros_like(values.mean(0))
    t = T_95.get(seeds - 1, 2.0)  # beyond 11 seeds t is within 0.23 of 2.0; never used here
    return values.mean(0), t * values.std(0, ddof=1) / math.sqrt(seeds)


def runs_of(results, estimator, beta):
    """The runs of one estimator at one beta, by seed."""
    return sorted((run for run in results["runs"] if run["estimator"] == estimator and run["beta"] == beta),
                  key=lambda run: run["seed"])


def first_runs(results):
    """Each seed's first run, which holds its SFT evaluation, RM and best-of-n (one per seed: the SFT policy and the
    RM of a seed are the same in every benchmark that trains them, on CPU)."""
    firsts = {}
    for run in results["runs"]:
        if "bon" in run:
            firsts.setdefault(run["seed"], run)
    return list(firsts.values())


def show(values, digits=3, sign="+"):
    mean, half = mean_and_interval(values)
    return f"{mean:{sign}.{digits}f} ± {half:.{digits}f}"


def aggregate(results):
    """Per (estimator, beta): the mean and 95% interval of the final numbers, the compute, and the paired difference
    to PPO at the same beta and seed."""
    table = {}
    estimators = list(dict.fromkeys(run["estimator"] for run in results["runs"]))
    betas = list(dict.fromkeys(run["beta"] for run in results["runs"]))
    for beta in betas:
        ppo = {run["seed"]: run for run in runs_of(results, "gae", beta)}
        for estimator in estimators:
            runs = runs_of(results, estimator, beta)
            if not runs:
                continue
            row = {"seeds": [run["seed"] for run in runs]}
            for key in FINAL_KEYS:
                row[key] = dict(zip(("mean", "ci95"), map(float, mean_and_interval([r["final"][key] for r in runs]))))
            for key in ("wall_s", "cpu_s"):
                row["rl_" + key] = float(np.median([run["compute"][key] for run in runs]))
            tokens = collections.Counter()
            for run in runs:
                tokens.update(run["compute"]["tokens"])
            row["tokens"] = {key: value / len(runs) for key, value in sorted(tokens.items())}
            paired = [run for run in runs if run["seed"] in ppo]
            if estimator != "gae" and paired:
                row["minus_ppo"] = {key: dict(zip(("mean", "ci95"), map(float, mean_and_interval(
                    [run["final"][key] - ppo[run["seed"]]["final"][key] for run in paired])))) for key in FINAL_KEYS}
            table[f"{estimator} {beta:g}"] = row
    return table


def report(results, plot_path=None):
    """Markdown tables of the final numbers, the differences to PPO and the compute; the figure with --plot."""
    firsts = first_runs(results)
    seeds = sorted({run["seed"] for run in results["runs"]})
    print(f"\n{len(results['runs'])} runs, seeds {seeds}; mean ± 95% confidence interval (Student t) over seeds\n")
    print("| policy | β | seeds | gold (hidden) | proxy (RM) | KL to SFT (nats) | distinct |")
    print("|---|---|---|---|---|---|---|")
    print(f"| SFT | | {len(firsts)} | {show([r['sft']['gold/score'] for r in firsts])} | "
          f"{show([r['sft']['proxy/score'] for r in firsts])} | 0 | "
          f"{show([r['sft']['gold/distinct_frac'] for r in firsts], 2, '')} |")
    betas = list(dict.fromkeys(run["beta"] for run in results["runs"]))
    estimators = list(dict.fromkeys(run["estimator"] for run in results["runs"]))
    for beta in sorted(betas):
        for estimator in estimators:
            runs = runs_of(results, estimator, beta)
            if runs:
                final = {key: [run["final"][key] for run in runs] for key in FINAL_KEYS}
                print(f"| {NAMES[estimator]} | {beta:g} | {len(runs)} | {show(final['gold/score'])} | "
                      f"{show(final['proxy/score'])} | {show(final['objective/kl'], 2, '')} | "
                      f"{show(final['gold/distinct_frac'], 2, '')} |")
    for index, row in enumerate(firsts[0]["bon"] if firsts else []):
        print(f"| best-of-{row['n']} of SFT samples | | {len(firsts)} | {show([r['bon'][index]['gold/score'] for r in firsts])} "
              f"| {show([r['bon'][index]['proxy/score'] for r in firsts])} | ≤ {row['kl_bound']:.2f} | |")
    table = aggregate(results)
    print("\nminus PPO at the same β and seed (paired): a 95% interval that holds 0 means no difference detectable\n")
    print("| estimator | β | seeds | gold | proxy | KL |")
    print("|---|---|---|---|---|---|")
    for name, row in table.items():
        if "minus_ppo" in row:
            estimator, beta = name.split()
            cells = " | ".join(f"{row['minus_ppo'][key]['mean']:+.3f} ± {row['minus_ppo'][key]['ci95']:.3f}"
                               for key in ("gold/score", "proxy/score", "objective/kl"))
            print(f"| {NAMES[estimator]} | {beta} | {len(row['seeds'])} | {cells} |")
    over_training(results)
    print("\ncompute of the RL stage (means over runs of token positions, in millions; median seconds)\n")
    roles = ("policy", "reference", "reward model", "critic")
    print("| estimator | β | " + " | ".join(f"{role} fwd / bwd" for role in roles) + " | wall s | CPU s |")
    print("|---|---|" + "---|" * (len(roles) + 2))
    for name, row in table.items():
        estimator, beta = name.split()
        cells = " | ".join(f"{row['tokens'].get(role + ' forward', 0) / 1e6:.2f} / "
                           f"{row['tokens'].get(role + ' backward', 0) / 1e6:.2f}" for role in roles)
        print(f"| {NAMES[estimator]} | {beta} | {cells} | {row['rl_wall_s']:.0f} | {row['rl_cpu_s']:.0f} |")
    if plot_path:
        plot(results, plot_path)
        print(f"plot: {plot_path}")
    return table


def over_training(results):
    """At the first beta: each estimator's mean gold and KL over windows of iterations (rollout-batch means), and its
    gold minus PPO's over the same window and seed."""
    beta = results["runs"][0]["beta"]
    ppo = {run["seed"]: run for run in runs_of(results, "gae", beta)}

    def window_mean(run, key, first, last):
        return float(np.mean([record[key] for record in run["history"][first - 1:last]]))

    print(f"\nover training, β = {beta:g}: rollout-batch means over each window of iterations\n")
    print("| estimator | iterations | gold | minus PPO (paired) | KL |")
    print("|---|---|---|---|---|")
    for estimator in dict.fromkeys(run["estimator"] for run in results["runs"]):
        runs = [run for run in runs_of(results, estimator, beta) if run["seed"] in ppo]
        for first, last in WINDOWS:
            if not runs or len(runs[0]["history"]) < first:
                continue
            gold = [window_mean(run, "gold/score", first, last) for run in runs]
            minus = [g - window_mean(ppo[run["seed"]], "gold/score", first, last) for g, run in zip(gold, runs)]
            kl = [window_mean(run, "objective/kl", first, last) for run in runs]
            difference = "" if estimator == "gae" else show(minus)
            print(f"| {NAMES[estimator]} | {first}–{min(last, len(runs[0]['history']))} | {show(gold)} | {difference} | "
                  f"{show(kl, 2, '')} |")


def plot(results, path):
    """Left: gold and proxy over training at the first beta; middle: KL over training at the first beta; right: the
    gold-KL frontier, each (estimator, beta)'s final evaluation, and best-of-n at its KL upper bound. Means over
    seeds, bands and bars the 95% intervals."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global state

    fig = Figure(figsize=(17, 4.8))
    axes = fig.subplots(1, 3)
    first_beta = results["runs"][0]["beta"]
    for estimator, color in COLORS.items():
        runs = runs_of(results, estimator, first_beta)
        if not runs:
            continue
        iterations = np.arange(1, len(runs[0]["history"]) + 1)
        for key, style, axis in (("gold/score", "-", 0), ("proxy/score", "--", 0), ("objective/kl", "-", 1)):
            mean, half = mean_and_interval([rlhf_seeds.moving_average([r[key] for r in run["history"]]) for run in runs])
            x = iterations[(rlhf_seeds.SMOOTHING_WINDOW - 1) // 2:][:len(mean)]
            what = {"gold/score": ": hidden gold", "proxy/score": ": proxy (RM)", "objective/kl": ""}[key]
            axes[axis].plot(x, mean, style, color=color, label=NAMES[estimator] + what)
            axes[axis].fill_between(x, mean - half, mean + half, color=color, alpha=0.15, lw=0)
        betas = [beta for beta in sorted({run["beta"] for run in results["runs"]}) if runs_of(results, estimator, beta)]
        final = {key: [mean_and_interval([run["final"][key] for run in runs_of(results, estimator, beta)])
                       for beta in betas] for key in ("objective/kl", "gold/score", "proxy/score")}
        sqrt_kl = [math.sqrt(max(kl, 0)) for kl, _ in final["objective/kl"]]
        for key, style, what in (("gold/score", "o-", ": hidden gold"), ("proxy/score", "o--", ": proxy (RM)")):
            axes[2].errorbar(sqrt_kl, [mean for mean, _ in final[key]], yerr=[half for _, half in final[key]],
                             fmt=style, mfc="none" if key == "proxy/score" else color, color=color, capsize=3,
                             label=NAMES[estimator] + what)
        for beta, x, (gold, _) in zip(betas, sqrt_kl, final["gold/score"]):
            axes[2].annotate(f"β={beta:g}", (x, gold), fontsize=7, color=color, xytext=(4, -10),
                             textcoords="offset points")
    firsts = first_runs(results)
    if firsts:
        bon = firsts[0]["bon"]
        mean, half = mean_and_interval([[row["gold/score"] for row in run["bon"]] for run in firsts])
        axes[2].errorbar([math.sqrt(row["kl_bound"]) for row in bon], mean, yerr=half, fmt="s:", color="tab:red",
                         ms=4, capsize=2, label=f"best-of-n from SFT (n = 1 .. {bon[-1]['n']}), KL upper bound")
    seeds = len({run["seed"] for run in results["runs"]})
    smoothing = f"mean ± 95% CI over {seeds} seeds, {rlhf_seeds.SMOOTHING_WINDOW}-iteration centred moving average"
    axes[0].set(xlabel="iteration", ylabel="score (solid: hidden gold, dashed: proxy RM)",
                title=f"gold and proxy during training, β = {first_beta:g}\n({smoothing})")
    axes[1].set(xlabel="iteration", ylabel="KL(pi || pi_ref)  [nats]", title=f"KL to the SFT policy, β = {first_beta:g}")
    axes[2].set(xlabel="sqrt(KL(pi || pi_ref)) at the end  [sqrt nats]",
                ylabel="score at the end (solid: hidden gold, dashed: proxy RM)",
                title=f"reward-KL frontier over β (mean ± 95% CI over {seeds} seeds)")
    for axis in axes:
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)


if __name__ == "__main__":
    main(tyro.cli(EstimatorArgs, description=__doc__.split("\n\n")[0]))
