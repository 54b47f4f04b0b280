"""The public grader: check a student's functions against fixed cases, then (informational) train with them.

  python exercises/grade.py EXERCISE [FILE ...] [--no-train] [-v] [--json OUT]

EXERCISE is one of gae, ppo_loss, ppg_aux, vtrace, rlhf, grpo_rloo; FILE is the student's copy of the script (made by
exercises/make_starter.py, the blank filled in; several files: each is graded, and copies of one function must
agree), by default the script of that name next to exercises/. The cases are data (exercises/cases/*.json: inputs,
expected outputs and gradients, the answers of typical mistakes with their hints): no solution ships. Every case is
scored; a failure does not stop the others. Exit status 0 when every case passes. The learning curve that follows
is informational and gives no points: on the cue task it does not tell right from wrong (docs/assignments.md).

This grader is the student's own check: it runs the student's code in its own process, so a student who tampers
with it fools only themself. The instructor's grade is computed elsewhere, by the instructor's grader, with each
submission in a sandboxed process of its own, on hidden cases too (they carry at least half of the points)."""
import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from exercises import grading  # noqa: E402
from exercises.cue_env import patch as patch_cue_env  # noqa: E402
from exercises.grading import Failed, exercise_text, load_script  # noqa: E402,F401 (the graders' API)
from exercises.texts import EXERCISES  # noqa: E402


OWN_CHECK = ("your own check, in this process: the instructor's grade is computed elsewhere, in a sandbox, on hidden "
             "cases too")


def default_path(exercise):
    return os.path.join(ROOT, EXERCISES[exercise]["script"])


def check_modules(exercise, modules):
    """Part (a): every public case of every function the exercise grades in `modules` ({file: module})."""
    return grading.grade_exercise(exercise, modules, grading.load_cases)


def check(exercise, module):
    """The public cases on one module; raises Failed with every failing case's report, else returns the count."""
    results = check_modules(exercise, {EXERCISES[exercise]["script"]: module})
    failed = [r for r in results if not r.passed]
    if failed:
        raise Failed("\n".join(grading.report_lines(failed)))
    return len(results)


# ---------------------------------------------------------------- the learning check on the real script
CUE = dict(env_id="coinrun", num_envs=16, channels=(8,), hidden_size=32, learning_rate=2e-3, eval_every=0,
           eval_episodes=16, torch_threads=1)
TRAINING = {  # which script a module is, told by what it defines, and its tiny flags
    "ppg": dict(CUE, total_timesteps=6144, num_steps=32, num_minibatches=4, n_pi=4, e_aux=2, save_every=4,
                arch="detach"),
    "vtrace": dict(CUE, total_timesteps=10240, unroll_length=8, updates_per_iteration=10, max_policy_lag=1,
                   deterministic_lag=True, gamma=0.9),
    "ppo": dict(CUE, total_timesteps=6144, num_steps=32, num_minibatches=4),
    "rlhf": dict(corpus_size=3000, sft_steps=200, num_pairs=2500, rm_epochs=3, rm_lr=3e-3, ppo_iterations=20,
                 rollout_batch_size=64, eval_samples=256, bon_pool=16),
}


def kind_of(module):
    for kind, marker in (("rlhf", "per_token_rewards"), ("ppg", "ppg_aux_loss"), ("vtrace", "from_importance_weights"),
                         ("ppo", "compute_gae")):
        if hasattr(module, marker):
            return kind
    raise Failed("this file is none of the four scripts (it defines no compute_gae, ppg_aux_loss, "
                 "from_importance_weights or per_token_rewards)")


def make_args(module, overrides):
    fields = {f.name for f in dataclasses.fields(module.Args)}
    return module.Args(**{key: value for key, value in overrides.items() if key in fields})


# An exercise whose functions only a flag's path calls trains on that path (GRPO: the first of its two functions).
EXERCISE_FLAGS = {"grpo_rloo": {"advantage": "grpo"}}


def train_and_judge(module, report, flags=None):
    """Train the student's script on the cue task (or the RLHF toy at tiny flags) and print its learning curve;
    True when it meets the old bar. Raises Failed only when training cannot run (an error, another blank)."""
    kind = kind_of(module)
    args = make_args(module, {**TRAINING[kind], **(flags or {})})
    if kind != "rlhf":
        patch_cue_env(module)
    workdir = tempfile.mkdtemp(prefix="grade_")
    output = io.StringIO()
    previous = os.getcwd()
    threads = torch.get_num_threads()
    start = time.time()
    try:
        os.chdir(workdir)
        with contextlib.redirect_stdout(output):
            result = module.train(args)
        if kind != "rlhf":
            with open(os.path.join(result, "metrics.jsonl")) as f:
                result = [json.loads(line) for line in f]
    except NotImplementedError as error:
        raise Failed("training stopped at another blank of this script (NotImplementedError):\n\n"
                     + exercise_text(error))
    except (Exception, SystemExit) as error:
        tail = "\n".join("    " + line for line in output.getvalue().rstrip().splitlines()[-8:])
        raise Failed(f"training raised {type(error).__name__}: {error}\n  last lines of the run:\n{tail}\n"
                     + "\n".join("  " + line for line in grading.explain_error(error).splitlines()))
    finally:
        os.chdir(previous)
        torch.set_num_threads(threads)
        shutil.rmtree(workdir, ignore_errors=True)
    judge = judge_rlhf if kind == "rlhf" else judge_cue
    return judge(result, time.time() - start, report)


def judge_cue(rows, seconds, report):
    returns = [r["charts/episodic_return"] for r in rows if r.get("charts/episodic_return") is not None]
    final = [r["eval/episodic_return"] for r in rows if "eval/episodic_return" in r][-1]
    begin, end = float(np.mean(returns[:2])), float(np.mean(returns[-2:]))
    report(f"  learning curve (cue task: random play earns 0.53 per episode, a solved task 8.00), {seconds:.0f} s:")
    report(f"    episodic return per iteration: {' '.join(f'{x:.2f}' for x in returns)}")
    report(f"    start {begin:.2f} -> end {end:.2f}; evaluation after training {final:.2f}")
    learned = final > 4.0 and end > begin + 1.5
    report(f"    {'it learns' if learned else 'it did not learn'} the cue task by the old bar (evaluation above 4.0, "
           "training return up by 1.5). Informational only: wrong code often passes this bar and correct code can "
           "miss it (docs/assignments.md, 'A learning curve is not a grade').")
    return learned


def judge_rlhf(summary, seconds, report):
    rm, sft, (ppo,) = summary["rm"], summary["sft"], summary["ppo"].values()
    history = [row["gold/score"] for row in next(iter(summary["histories"].values())) if "gold/score" in row]
    report(f"  the RLHF toy at tiny flags, {seconds:.0f} s:")
    report(f"    reward model (Bradley-Terry): held-out accuracy {rm['rm/heldout_acc']:.3f} against the labels, "
           f"{rm['rm/heldout_acc_gold']:.3f} against the gold order (chance 0.5)")
    if history:
        report(f"    the RL stage's gold score per iteration: start {np.mean(history[:2]):+.3f} -> "
               f"end {np.mean(history[-2:]):+.3f}")
    trained = {"grpo": "GRPO", "rloo": "RLOO"}.get(summary.get("advantage"), "PPO")
    report(f"    gold score SFT {sft['gold/score']:+.3f} -> {trained} {ppo['gold/score']:+.3f}; proxy (RM) score SFT "
           f"{sft['proxy/score']:+.3f} -> {trained} {ppo['proxy/score']:+.3f}; KL to SFT {ppo['objective/kl']:.2f}")
    learned = (rm["rm/heldout_acc"] > 0.6 and ppo["gold/score"] > sft["gold/score"] + 0.5
               and ppo["proxy/score"] > sft["proxy/score"] + 0.5)
    report(f"    {'it learns' if learned else 'it did not learn'} by the old bar (held-out accuracy above 0.6, "
           "gold and proxy scores up by 0.5 over SFT). Informational only: a flipped KL sign passes this bar "
           "(docs/assignments.md, 'A learning curve is not a grade').")
    return learned


# ---------------------------------------------------------------- grading
def grade(exercise, paths=None, train=True, out=print, verbose=False, json_path=None):
    """The whole grade, printed through `out`; True when every case passes (the learning curve gives no points)."""
    if isinstance(paths, str):
        paths = [paths]
    paths = [os.path.abspath(p) for p in (paths or [default_path(exercise)])]
    info = EXERCISES[exercise]
    out(f"exercise {exercise}: {info['title']}\n  {', '.join(info['functions'])} in "
        f"{', '.join(paths)}\n  ({info['equation']})\n  {OWN_CHECK}")
    start = time.time()
    modules = {}
    for path in paths:
        try:
            modules[os.path.basename(path)] = load_script(path)
        except Exception:
            out(f"FAIL: {path} does not import:\n" + traceback.format_exc(limit=-3))
            return False
    out("(a) the functions on the public cases (values, gradients, dtype, inputs left unchanged)")
    results = check_modules(exercise, modules)
    out("\n".join(grading.report_lines(results, verbose=verbose)))
    points, total = grading.score(results)
    passed = points == total
    out(f"  score: {points:g} / {total:g} points ({time.time() - start:.1f} s)")
    if json_path:
        report = {"exercise": exercise, "points": points, "max_points": total,
                  "cases": [dict(dataclasses.asdict(r), passed=r.passed) for r in results]}
        grading.write_atomic(json_path, json.dumps(report, indent=1))
    training_file = grading.training_file_of(exercise, grading.names_of(modules))
    if train and passed and training_file is not None:
        out(f"(b) training {training_file} with them (informational: no points, it does not grade)")
        try:
            train_and_judge(modules[training_file], out, EXERCISE_FLAGS.get(exercise))
        except Failed as failure:
            out("  " + str(failure))
        except Exception as error:  # the curve is informational: a script whose logs changed still gets its grade
            out(f"  the learning curve could not be read ({type(error).__name__}: {error}); the grade stands")
    elif train and not passed:
        out("(b) training skipped: fix the failing cases first")
    out(f"{'PASS' if passed else 'FAIL'}: {points:g} / {total:g} points ({time.time() - start:.0f} s)")
    return passed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercise", choices=sorted(EXERCISES))
    parser.add_argument("paths", nargs="*", help="the student's script(s) (default: the script next to exercises/)")
    parser.add_argument("--no-train", action="store_true", help="only the cases (the learning curve gives no "
                        "points anyway)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case that passes")
    parser.add_argument("--json", default=None, help="write the per-case result as JSON here")
    options = parser.parse_args(argv)
    passed = grade(options.exercise, options.paths, train=not options.no_train, verbose=options.verbose,
                   json_path=options.json)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
