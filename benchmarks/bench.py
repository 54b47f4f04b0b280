"""Measure a training script's speed at given flags, and compare flag sets side by side.

Each configuration runs as its own process for warmup + iterations training iterations; the script's own
metrics.jsonl gives the per-iteration time split. Configurations alternate (A B A B ...) over --repeats rounds and
ratios are taken pair by pair, because absolute times on shared machines drift.

  python benchmarks/bench.py --script ppo_procgen.py --iterations 20 \
      --config plain="--no-channels-last" --config fast="--channels-last --compile --amp"

Works with ppo_procgen.py, ppg_procgen.py and vtrace.py. A configuration whose flags hold `--nproc-per-node N` runs
under torchrun with N ranks (data parallel; SPS counts the steps of all ranks):

  python benchmarks/bench.py --script ppo_procgen.py --config 1rank= --config "2ranks=--nproc-per-node 2"
 Reports, per configuration: SPS (median and min-max over the
measured iterations of all rounds; "overall" divides all measured steps by all measured time, PPG's auxiliary phases
included), the median seconds per iteration of each phase the script logs (time/*: env stepping, rollout = env +
policy inference + host-device copies, update; PPG's auxiliary phase; IMPALA's learner waiting for unrolls and
learning, its actor waiting for parameters and playing), peak host RSS
of the process and peak GPU memory; then each configuration's SPS over the first one's, per round (median quoted).
Writes the same as JSON (--out).
"""
import argparse
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steps_per_iteration(script, flags):
    """Environment steps per training iteration at these flags, read from the script's own Args."""
    sys.path.insert(0, ROOT)
    module = importlib.import_module(os.path.splitext(script)[0])
    args = tyro.cli(module.Args, args=flags)
    if hasattr(args, "updates_per_iteration"):  # vtrace.py: updates x unrolls per update (one per game) x unroll length
        return args.updates_per_iteration * args.num_envs * args.unroll_length
    return args.num_envs * args.num_steps


def run_once(script, flags, iterations, warmup, workdir):
    """One training process; returns its measured iteration rows (after warm-up), its auxiliary-phase rows (PPG)
    and its peak RSS."""
    launcher = [sys.executable]
    if "--nproc-per-node" in flags:  # data parallel: torchrun starts the ranks
        position = flags.index("--nproc-per-node")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", *flags[position : position + 2]]
        flags = flags[:position] + flags[position + 2 :]
    total = (warmup + iterations) * steps_per_iteration(script, flags)
    command = [*launcher, os.path.join(ROOT, script), *flags, "--total-timesteps", str(total),
               "--eval-every", "0", "--eval-episodes", "1", "--exp-name", "bench"]
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: a chatty child can never block on it
        process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        _, status, usage = os.wait4(process.pid, 0)  # the child's own resource usage: its peak RSS
        if os.waitstatus_to_exitcode(status) != 0:
            stderr.seek(0)
            raise SystemExit(f"error: {' '.join(command)} failed:\n{stderr.read()[-3000:]}")
    run_dir = max((os.path.join(workdir, "runs", d) for d in os.listdir(os.path.join(workdir, "runs"))),
                  key=os.path.getmtime)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    iteration_rows = [r for r in rows if "charts/SPS" in r]
    # Each measured iteration's time is the gap since the previous row: everything the loop did, PPG's auxiliary
    # phase included (it runs between two iteration rows).
    measured = [dict(r, steps=r["global_step"] - p["global_step"], seconds=r["time"] - p["time"])
                for p, r in zip(iteration_rows[warmup - 1 :], iteration_rows[warmup:])]
    return measured, [r for r in rows if "time/aux_phase" in r], usage.ru_maxrss * 1024  # Linux reports KiB


def summarize(name, rounds):
    """Pool the measured iterations of all rounds."""
    rows = [r for measured, _, _ in rounds for r in measured]
    sps = [r["steps"] / r["seconds"] for r in rows]
    splits = sorted({key for r in rows for key in r if key.startswith("time/")})
    aux = [r["time/aux_phase"] for _, aux_rows, _ in rounds for r in aux_rows]
    gpu = [r.get("perf/gpu_memory_gb") for r in rows if r.get("perf/gpu_memory_gb") is not None]
    return {"config": name, "iterations": len(rows), "sps_median": statistics.median(sps), "sps_min": min(sps),
            "sps_max": max(sps), "sps_overall": sum(r["steps"] for r in rows) / sum(r["seconds"] for r in rows),
            "seconds_per_iteration": {key[5:]: statistics.median(r[key] for r in rows) for key in splits},
            "aux_phase_s": statistics.median(aux) if aux else None,
            "round_sps": [sum(r["steps"] for r in m) / sum(r["seconds"] for r in m) for m, _, _ in rounds],
            "peak_rss_gb": max(rss for _, _, rss in rounds) / 2**30, "peak_gpu_gb": max(gpu) if gpu else None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default="ppo_procgen.py", help="ppo_procgen.py, ppg_procgen.py or vtrace.py")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                        help="a named flag set (repeatable); the first is the baseline of the ratios")
    parser.add_argument("--common", default="", help="flags added to every configuration")
    parser.add_argument("--iterations", type=int, default=10, help="measured iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="iterations dropped at the start of each run (>= 1)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of A B ... alternation")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.iterations, args.warmup, args.repeats) < 1:
        parser.error("--iterations, --warmup and --repeats must be >= 1 (the first iteration times the start-up)")
    configs = [c.split("=", 1) if "=" in c else (c, c) for c in (args.config or ["default="])]
    configs = [(name, shlex.split(args.common) + shlex.split(flags)) for name, flags in configs]
    rounds = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.repeats):
            for name, flags in configs:
                start = time.time()
                rounds[name].append(run_once(args.script, flags, args.iterations, args.warmup, workdir))
                print(f"round {round_index + 1}/{args.repeats} {name}: {time.time() - start:.0f}s", file=sys.stderr)
    results = [summarize(name, rounds[name]) for name, _ in configs]
    for result in results:
        ratios = [b / a for a, b in zip(results[0]["round_sps"], result["round_sps"])]
        result["sps_ratio_to_first"] = {"median": statistics.median(ratios), "per_round": ratios}
    print(f"{args.script}, {args.iterations} iterations x {args.repeats} rounds after {args.warmup} warm-up; "
          "SPS per iteration (median, min-max), overall (all steps / all time), seconds per iteration by phase")
    for r in results:
        spread = f"({r['sps_min']:,.0f}-{r['sps_max']:,.0f})"
        phases = " ".join(f"{key} {value:.3f}" for key, value in r["seconds_per_iteration"].items())
        aux = f" aux_phase {r['aux_phase_s']:.2f}" if r["aux_phase_s"] is not None else ""
        gpu = f", GPU {r['peak_gpu_gb']:.2f} GB" if r["peak_gpu_gb"] is not None else ""
        print(f"{r['config']:<16} SPS {r['sps_median']:>9,.0f} {spread:>17} overall {r['sps_overall']:>9,.0f} | "
              f"{phases}{aux} | RSS {r['peak_rss_gb']:.2f} GB{gpu} | ratio {r['sps_ratio_to_first']['median']:.2f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"script": args.script, "iterations": args.iterations, "warmup": args.warmup,
                       "repeats": args.repeats, "configs": dict(configs), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
