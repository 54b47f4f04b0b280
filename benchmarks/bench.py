"""Measure a training script's speed at given flags, and compare flag sets side by side.

Each configuration runs as its own process for warmup + iterations training iterations; the script's own
metrics.jsonl gives the per-iteration time split. Configurations alternate (A B A B ...) over --repeats rounds and
ratios are taken pair by pair, because absolute times on shared machines drift.

  python benchmarks/bench.py --script ppo_procgen.py --iterations 20 \
      --config plain="--no-channels-last" --config fast="--channels-last --compile --amp"

Reports, per configuration: SPS (median and min-max over the measured iterations of all rounds; "overall" divides all
measured steps by all measured time, PPG's auxiliary phases included), the time split per
iteration (env stepping, policy inference + host-device copies, learning, PPG auxiliary phase), peak host RSS of
the process and peak GPU memory; then the ratio of each configuration's median SPS to the first one's, per round.
Writes the same as JSON (--out).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch_size(flags):
    """num_envs * num_steps as the script will see them (its defaults: 64 x 256)."""
    def value(name, default):
        return int(flags[flags.index(name) + 1]) if name in flags else default
    return value("--num-envs", 64) * value("--num-steps", 256)


def run_once(script, flags, iterations, warmup, workdir):
    """One training process; returns its per-iteration rows (after warm-up) and its peak RSS."""
    total = (warmup + iterations) * batch_size(flags)
    command = [sys.executable, os.path.join(ROOT, script), *flags, "--total-timesteps", str(total),
               "--eval-every", "0", "--eval-episodes", "1", "--exp-name", "bench"]
    process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)  # the child's own resource usage: its peak RSS
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed:\n{process.stderr.read()[-3000:]}")
    run_dir = max((os.path.join(workdir, "runs", d) for d in os.listdir(os.path.join(workdir, "runs"))),
                  key=os.path.getmtime)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    iteration_rows = [r for r in rows if "time/update" in r][warmup:]
    aux_rows = [r for r in rows if "time/aux_phase" in r]
    return iteration_rows, aux_rows, usage.ru_maxrss * 1024  # Linux reports KiB


def summarize(name, rounds, batch):
    """Pool the measured iterations of all rounds."""
    rows = [r for iteration_rows, _, _ in rounds for r in iteration_rows]
    aux = [r["time/aux_phase"] for _, aux_rows, _ in rounds for r in aux_rows]
    per_iteration = [r["time/rollout"] + r["time/update"] for r in rows]
    sps = [batch / t for t in per_iteration]
    median = lambda key: statistics.median(r[key] for r in rows)
    gpu = [r.get("perf/gpu_memory_gb") for r in rows if r.get("perf/gpu_memory_gb") is not None]
    return {"config": name, "iterations": len(rows), "sps_median": statistics.median(sps), "sps_min": min(sps),
            "sps_max": max(sps), "env_s": median("time/env"), "policy_s": median("time/rollout") - median("time/env"),
            "learn_s": median("time/update"), "aux_phase_s": statistics.median(aux) if aux else None,
            # all measured steps over all measured time, PPG's auxiliary phases included
            "sps_overall": batch * len(rows) / (sum(per_iteration) + sum(aux)),
            "round_sps_medians": [statistics.median(batch / (r["time/rollout"] + r["time/update"]) for r in it)
                                  for it, _, _ in rounds],
            "peak_rss_gb": max(rss for _, _, rss in rounds) / 2**30, "peak_gpu_gb": max(gpu) if gpu else None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="ppo_procgen.py", help="ppo_procgen.py or ppg_procgen.py")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                        help="a named flag set (repeatable); the first is the baseline of the ratios")
    parser.add_argument("--common", default="", help="flags added to every configuration")
    parser.add_argument("--iterations", type=int, default=10, help="measured iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="iterations dropped at the start of each run")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of A B ... alternation")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--iterations and --repeats must be >= 1 and --warmup >= 0")
    configs = [c.split("=", 1) if "=" in c else (c, c) for c in (args.config or ["default="])]
    configs = [(name, shlex.split(args.common) + shlex.split(flags)) for name, flags in configs]
    rounds = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.repeats):
            for name, flags in configs:
                start = time.time()
                rounds[name].append(run_once(args.script, flags, args.iterations, args.warmup, workdir))
                print(f"round {round_index + 1}/{args.repeats} {name}: {time.time() - start:.0f}s", file=sys.stderr)
    results = [summarize(name, rounds[name], batch_size(flags)) for name, flags in configs]
    base = results[0]["round_sps_medians"]
    for result in results:
        ratios = [b / a for a, b in zip(base, result["round_sps_medians"])]
        result["sps_ratio_to_first"] = {"median": statistics.median(ratios), "per_round": ratios}
    header = f"{'config':<14}{'SPS median':>11}{'(min-max)':>17}{'overall':>9}{'env s':>8}{'policy s':>9}{'learn s':>9}" \
             f"{'aux s':>8}{'RSS GB':>8}{'GPU GB':>8}{'ratio':>7}"
    print(f"{args.script}, {args.iterations} iterations x {args.repeats} rounds after {args.warmup} warm-up")
    print(header)
    for r in results:
        fmt = lambda x, spec: "-" if x is None else format(x, spec)
        spread = f"({r['sps_min']:,.0f}-{r['sps_max']:,.0f})"
        print(f"{r['config']:<14}{r['sps_median']:>11,.0f}{spread:>17}{r['sps_overall']:>9,.0f}"
              f"{r['env_s']:>8.3f}{r['policy_s']:>9.3f}{r['learn_s']:>9.3f}{fmt(r['aux_phase_s'], '.2f'):>8}"
              f"{r['peak_rss_gb']:>8.2f}{fmt(r['peak_gpu_gb'], '.2f'):>8}{r['sps_ratio_to_first']['median']:>7.2f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"script": args.script, "iterations": args.iterations, "warmup": args.warmup,
                       "repeats": args.repeats, "configs": dict(configs), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
