"""Does bfloat16 autocast (--amp) learn as float32 does? PPO and PPG on the learning tests' pixel task (CueEnv, in
tests/conftest.py: random play earns 0.53 per episode, a solved task 8), float32 against --amp, the same seeds,
alternated; prints mean +- standard error over the seeds of the final evaluation return and of the mean training
return over the run (the area under the curve), and writes them as JSON.

  python benchmarks/amp_learning.py --seeds 1 2 3 4 5 --out benchmarks/results/cpu_amp_learning.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import ppg_procgen  # noqa: E402
import ppo_procgen  # noqa: E402
from conftest import CueEnv  # noqa: E402

# The learning tests' settings (tests/test_ppo.py, cue_args), twice their steps
COMMON = dict(env_id="coinrun", total_timesteps=12288, num_envs=16, num_steps=32, num_minibatches=4, channels=(8,),
              hidden_size=32, learning_rate=2e-3, eval_every=0, eval_episodes=16, torch_threads=2)
SCRIPTS = {"PPO": (ppo_procgen, {}), "PPG": (ppg_procgen, dict(n_pi=4, e_aux=2, arch="detach"))}


def run(module, overrides, seed, amp):
    module.ProcgenVecEnv = lambda num_envs, *args, **kwargs: CueEnv(num_envs)
    start = time.time()
    run_dir = module.train(module.Args(**COMMON, **overrides, seed=seed, amp=amp))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train_returns = [row["charts/episodic_return"] for row in rows if row.get("charts/episodic_return") is not None]
    return {"seed": seed, "amp": amp, "final_eval": rows[-1]["eval/episodic_return"],
            "mean_train_return": statistics.mean(train_returns), "seconds": time.time() - start}


def mean_and_error(values):
    error = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return statistics.mean(values), error


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="one run each in float32 and with --amp")
    parser.add_argument("--out", default=None, help="write the runs and the summary here as JSON")
    options = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as directory:
        os.chdir(directory)  # the runs' folders are scratch
        for name, (module, overrides) in SCRIPTS.items():
            for seed in options.seeds:
                for amp in (False, True):  # alternated, so that the machine's drift hits both alike
                    results.append({"script": name, **run(module, overrides, seed, amp)})
                    print(results[-1], flush=True)
    summary = {}
    for name in SCRIPTS:
        for amp in (False, True):
            runs = [r for r in results if r["script"] == name and r["amp"] == amp]
            key = f"{name} {'bf16' if amp else 'fp32'}"
            summary[key] = {measure: mean_and_error([r[measure] for r in runs])
                            for measure in ("final_eval", "mean_train_return", "seconds")}
            print(f"{key}: final eval {summary[key]['final_eval'][0]:.2f} +- {summary[key]['final_eval'][1]:.2f}, "
                  f"mean training return {summary[key]['mean_train_return'][0]:.2f} +- "
                  f"{summary[key]['mean_train_return'][1]:.2f}, {summary[key]['seconds'][0]:.1f} s per run")
    if options.out:
        with open(os.path.join(ROOT, options.out) if not os.path.isabs(options.out) else options.out, "w") as f:
            json.dump({"settings": {**COMMON, "channels": list(COMMON["channels"])}, "runs": results,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
