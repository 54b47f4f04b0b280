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
Apart from that steady state: the seconds until the measured iterations start (`warmup_s`: start-up of the loop,
torch.compile's compilation, cuDNN's autotuning) and of the whole process. PPG: also the policy phase's SPS without
the auxiliary phases, and the auxiliary phases that fell in the warm-up (the first one is cold) apart from the measured
ones. Writes the same as JSON (--out), rewritten after every configuration; a configuration whose process fails is
recorded with the end of its error output, the others still run, and bench.py then exits with status 1.
"""
import argparse
import contextlib
import importlib
import io
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


class ConfigurationFailed(Exception):
    """A configuration's training process exited with an error; the message holds its command and error output's end."""


def steps_per_iteration(script, flags):
    """Environment steps per training iteration at these flags, read from the script's own Args."""
    sys.path.insert(0, ROOT)
    module = importlib.import_module(os.path.splitext(script)[0])
    messages = io.StringIO()
    try:
        with contextlib.redirect_stdout(messages), contextlib.redirect_stderr(messages):
            args = tyro.cli(module.Args, args=flags)
    except SystemExit:  # tyro's message names the flag
        raise ConfigurationFailed(f"{script} {shlex.join(flags)}: {messages.getvalue()[-3000:]}") from None
    if hasattr(args, "updates_per_iteration"):  # vtrace.py: updates x unrolls per update (one per game) x unroll length
        return args.updates_per_iteration * args.num_envs * args.unroll_length
    return args.num_envs * args.num_steps


def run_once(script, flags, iterations, warmup, workdir):
    """One training process: `measure` of its metrics (the measured iterations, each with the seconds of any PPG
    auxiliary phase inside it; the auxiliary phases; `warmup_s`), its wall time and its peak RSS."""
    launcher = [sys.executable]
    if "--nproc-per-node" in flags:  # data parallel: torchrun starts the ranks
        position = flags.index("--nproc-per-node")
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", *flags[position : position + 2]]
        flags = flags[:position] + flags[position + 2 :]
    total = (warmup + iterations) * steps_per_iteration(script, flags)
    command = [*launcher, os.path.join(ROOT, script), *flags, "--total-timesteps", str(total),
               "--eval-every", "0", "--eval-episodes", "1", "--exp-name", "bench"]
    start = time.time()
    with tempfile.TemporaryFile("w+") as stderr:  # a file, not a pipe: a chatty child can never block on it
        process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        _, status, usage = os.wait4(process.pid, 0)  # the child's own resource usage: its peak RSS
        if os.waitstatus_to_exitcode(status) != 0:
            stderr.seek(0)
            raise ConfigurationFailed(f"{shlex.join(command)} exited with {os.waitstatus_to_exitcode(status)}:\n"
                                      f"{stderr.read()[-3000:]}")
    process_s = time.time() - start
    run_dir = max((os.path.join(workdir, "runs", d) for d in os.listdir(os.path.join(workdir, "runs"))),
                  key=os.path.getmtime)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return dict(measure(rows, warmup), process_s=process_s, rss=usage.ru_maxrss * 1024)  # Linux reports KiB


def measure(rows, warmup):
    """From a run's metrics rows: the measured iterations, PPG's auxiliary phases after and within the warm-up, and
    the seconds from the loop's start to the end of the warm-up. Each measured iteration's time is the gap since the
    previous iteration's row: everything the loop did. PPG's auxiliary phase runs inside the iteration that ends a
    policy phase (its row has the aux/ columns), so its seconds are that row's time/update less the median
    time/update of the iterations without one."""
    iterations = [row for row in rows if "charts/SPS" in row]
    with_aux = [any(key.startswith("aux/") for key in row) for row in iterations]
    plain = [row["time/update"] for row, aux in zip(iterations, with_aux) if not aux and "time/update" in row]
    policy_update = statistics.median(plain) if plain else 0.0
    aux_seconds = [row["time/update"] - policy_update if aux else 0.0 for row, aux in zip(iterations, with_aux)]
    measured = []
    for index in range(warmup, len(iterations)):
        before, after = iterations[index - 1], iterations[index]
        measured.append(dict(after, steps=after["global_step"] - before["global_step"],
                             seconds=after["time"] - before["time"], aux_seconds=aux_seconds[index]))
    aux = [(index, seconds) for index, (seconds, has) in enumerate(zip(aux_seconds, with_aux)) if has]
    return {"measured": measured, "aux_phases": [seconds for index, seconds in aux if index >= warmup],
            "aux_phases_warmup": [seconds for index, seconds in aux if index < warmup],
            "warmup_s": iterations[warmup - 1]["time"]}


def summarize(name, rounds):
    """Pool the measured iterations of all rounds."""
    rows = [row for run in rounds for row in run["measured"]]
    sps = [r["steps"] / r["seconds"] for r in rows]
    splits = sorted({key for r in rows for key in r if key.startswith("time/")})
    aux = [seconds for run in rounds for seconds in run["aux_phases"]]
    aux_warmup = [seconds for run in rounds for seconds in run["aux_phases_warmup"]]
    policy_phase_sps = None
    if aux or aux_warmup:  # PPG: the policy phase alone, each iteration's auxiliary phase taken out
        policy_phase_sps = statistics.median(r["steps"] / (r["seconds"] - r["aux_seconds"]) for r in rows)
    gpu = [r.get("perf/gpu_memory_gb") for r in rows if r.get("perf/gpu_memory_gb") is not None]
    return {"config": name, "iterations": len(rows), "sps_median": statistics.median(sps), "sps_min": min(sps),
            "sps_max": max(sps), "sps_overall": sum(r["steps"] for r in rows) / sum(r["seconds"] for r in rows),
            "sps_policy_phase": policy_phase_sps,
            "seconds_per_iteration": {key[5:]: statistics.median(r[key] for r in rows) for key in splits},
            "aux_phase_s": statistics.median(aux) if aux else None, "aux_phase_warmup_s": aux_warmup,
            "warmup_s": statistics.median(run["warmup_s"] for run in rounds),
            "process_s": statistics.median(run["process_s"] for run in rounds),
            "round_sps": [sum(r["steps"] for r in run["measured"]) / sum(r["seconds"] for r in run["measured"])
                          for run in rounds],
            "peak_rss_gb": max(run["rss"] for run in rounds) / 2**30, "peak_gpu_gb": max(gpu) if gpu else None}


def results_so_far(configs, rounds, failures):
    """One entry per configuration in their order: its summary, or its error; ratios against the first that ran."""
    results = []
    for name, _ in configs:
        if name in failures:
            results.append({"config": name, "error": failures[name]})
        elif rounds[name]:
            results.append(summarize(name, rounds[name]))
    measured = [r for r in results if "error" not in r]
    for result in measured:
        ratios = [b / a for a, b in zip(measured[0]["round_sps"], result["round_sps"])]
        result["sps_ratio_to_first"] = {"median": statistics.median(ratios), "per_round": ratios}
    return results


def write_json(path, args, configs, results):
    """Atomically, so that a reader (or a kill) never meets half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"script": args.script, "iterations": args.iterations, "warmup": args.warmup,
                   "repeats": args.repeats, "configs": dict(configs), "results": results}, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--script", default="ppo_procgen.py", help="ppo_procgen.py, ppg_procgen.py or vtrace.py")
    parser.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                        help="a named flag set (repeatable); the first is the baseline of the ratios")
    parser.add_argument("--common", default="", help="flags added to every configuration")
    parser.add_argument("--iterations", type=int, default=10, help="measured iterations per run")
    parser.add_argument("--warmup", type=int, default=2, help="iterations dropped at the start of each run (>= 1)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of A B ... alternation")
    parser.add_argument("--out", default=None, help="write the results as JSON here, after every configuration")
    args = parser.parse_args(argv)
    if min(args.iterations, args.warmup, args.repeats) < 1:
        parser.error("--iterations, --warmup and --repeats must be >= 1 (the first iteration times the start-up)")
    configs = [c.split("=", 1) if "=" in c else (c, c) for c in (args.config or ["default="])]
    configs = [(name, shlex.split(args.common) + shlex.split(flags)) for name, flags in configs]
    rounds = {name: [] for name, _ in configs}
    failures = {}  # name -> the command and the end of its error output; a failed configuration is not run again
    with tempfile.TemporaryDirectory() as workdir:
        for round_index in range(args.repeats):
            for name, flags in configs:
                if name in failures:
                    continue
                start = time.time()
                try:
                    rounds[name].append(run_once(args.script, flags, args.iterations, args.warmup, workdir))
                except ConfigurationFailed as error:
                    failures[name] = str(error)
                    print(f"error: configuration {name} failed: {error}", file=sys.stderr)
                print(f"round {round_index + 1}/{args.repeats} {name}: {time.time() - start:.0f}s", file=sys.stderr)
                if args.out:
                    write_json(args.out, args, configs, results_so_far(configs, rounds, failures))
    results = results_so_far(configs, rounds, failures)
    print(f"{args.script}, {args.iterations} iterations x {args.repeats} rounds after {args.warmup} warm-up; "
          "SPS per iteration (median, min-max), overall (all steps / all time), seconds per iteration by phase")
    for r in results:
        if "error" in r:
            print(f"{r['config']:<16} FAILED (the end of its error output is in the JSON)")
            continue
        spread = f"({r['sps_min']:,.0f}-{r['sps_max']:,.0f})"
        phases = " ".join(f"{key} {value:.3f}" for key, value in r["seconds_per_iteration"].items())
        aux = f" aux_phase {r['aux_phase_s']:.2f}" if r["aux_phase_s"] is not None else ""
        gpu = f", GPU {r['peak_gpu_gb']:.2f} GB" if r["peak_gpu_gb"] is not None else ""
        print(f"{r['config']:<16} SPS {r['sps_median']:>9,.0f} {spread:>17} overall {r['sps_overall']:>9,.0f} | "
              f"{phases}{aux} | warm-up {r['warmup_s']:.1f}s | RSS {r['peak_rss_gb']:.2f} GB{gpu} | "
              f"ratio {r['sps_ratio_to_first']['median']:.2f}")
    if failures:
        raise SystemExit(f"error: {len(failures)} of {len(configs)} configurations failed: {', '.join(failures)}")
    return results


if __name__ == "__main__":
    main()
