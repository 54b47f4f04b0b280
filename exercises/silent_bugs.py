"""Silent-bug exercises, in the manner of Spinning Up's "algorithm failure modes": a copy of a script with ONE
planted bug in the algorithm's functions; it runs, and it still learns a little. The student finds the bug and
fixes it; the grader checks the fix against the repository's script.

  python exercises/silent_bugs.py make --out DIR [--bugs NAME,...]   # DIR/NAME/SCRIPT and DIR/NAME/README.txt
  python exercises/silent_bugs.py check NAME FILE                     # exit 0 when FILE behaves as the reference

Each bug is an exact text patch of one line inside one function; `make` fails with one line if that line is no
longer there (the script changed: update BUGS), and tests/test_exercises.py plants every bug, so a change of a
script is caught. `check` trains the fixed copy and the repository's script on the cue task for a few updates at
one seed and compares their metrics rows (the losses and returns): equal to float precision means fixed. It relies
only on the script's Args, train(args), its ProcgenVecEnv (replaced by the cue task) and the metrics rows. This
file stays with the instructor: the bundle does not ship it."""
import argparse
import ast
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from exercises import grading  # noqa: E402
from exercises.cue_env import patch as patch_cue_env  # noqa: E402

BUGS = {
    "advantage-normalization": dict(
        script="ppo_procgen.py", function="ppo_update",
        line="mean, std = global_moments(mb_advantages)",
        bug='mean, std = global_moments(batch["returns"][minibatch])',
        symptom="PPO still learns the cue task: at the public grader's flags (seed 1) its evaluation return is "
                "4.25, the correct script's 4.19, so the curve does not show the bug. Look at what each "
                "minibatch's policy loss is computed from, line by line, beside PPO's and baselines' code."),
    "bootstrap-across-episode-end": dict(
        script="ppg_procgen.py", function="compute_gae",
        line="delta = rewards[t] + gamma * next_values * next_nonterminal - values[t]",
        bug="delta = rewards[t] + gamma * next_values - values[t]",
        symptom="PPG still solves the cue task (evaluation 8.00 at the public grader's flags, seed 1, as the "
                "correct script): its rewards come at once, so the bug hardly shows there. Look at how the value "
                "targets are formed around the end of an episode."),
    "entropy-sign": dict(
        script="vtrace.py", function="vtrace_loss",
        line="return pg_loss + baseline_loss - entropy_cost * entropy, pg_loss, baseline_loss, entropy",
        bug="return pg_loss + baseline_loss + entropy_cost * entropy, pg_loss, baseline_loss, entropy",
        symptom="IMPALA still solves the cue task (evaluation 8.00 at the public grader's flags, seed 1, as the "
                "correct script; the curves differ in the second decimal). Look at what the loss asks of the "
                "policy's entropy, and at the sign of every term of IMPALA's loss (the paper's section 4.2)."),
}
CUE = dict(env_id="coinrun", channels=(8,), hidden_size=32, learning_rate=2e-3, eval_every=0, eval_episodes=1,
           torch_threads=1, seed=1)
CHECK_FLAGS = {  # a few updates at one seed: enough for any planted bug to change the metrics
    "ppo_procgen.py": dict(CUE, num_envs=4, num_steps=16, num_minibatches=2, total_timesteps=128),
    "ppg_procgen.py": dict(CUE, num_envs=4, num_steps=16, num_minibatches=2, total_timesteps=128, n_pi=2, e_aux=1,
                           save_every=2, arch="detach"),
    "vtrace.py": dict(CUE, num_envs=4, unroll_length=8, updates_per_iteration=4, max_policy_lag=1,
                      deterministic_lag=True, total_timesteps=384),
}


class BugNotFound(SystemExit):
    """The line a bug patches is gone: the script changed."""


def function_lines(source, function):
    """(first, last) line numbers (1-based) of the top-level function's body."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return node.body[0].lineno, node.end_lineno
    return None


def plant(source, name):
    """`source` with bug `name` planted: its one line inside its function replaced, indentation kept."""
    bug = BUGS[name]
    span = function_lines(source, bug["function"])
    lines = source.splitlines(keepends=True)
    hits = [] if span is None else [i for i in range(span[0] - 1, span[1]) if lines[i].strip() == bug["line"]]
    if len(hits) != 1:
        raise BugNotFound(f"error: silent bug {name}: expected the line `{bug['line']}` once in {bug['function']} "
                          f"of {bug['script']}, found it {len(hits)} times (the script changed: update BUGS)")
    index = hits[0]
    indent = lines[index][:len(lines[index]) - len(lines[index].lstrip())]
    lines[index] = indent + bug["bug"] + "\n"
    return "".join(lines)


def make(out, names=None, root=ROOT):
    """DIR/NAME/SCRIPT (the bug planted) and DIR/NAME/README.txt (the symptom and the task) for each bug."""
    written = []
    for name in names or list(BUGS):
        bug = BUGS[name]
        with open(os.path.join(root, bug["script"])) as f:
            source = plant(f.read(), name)
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, bug["script"]), "w") as f:
            f.write(source)
        with open(os.path.join(folder, "README.txt"), "w") as f:
            f.write(f"Silent bug '{name}': this copy of {bug['script']} has ONE planted bug in one of the algorithm's "
                    f"functions (not in the plumbing appendix). It runs, and it learns a little.\n\nWhat you see: "
                    f"{bug['symptom']}\n\nFind the bug (read the algorithm's functions beside the paper's equations; "
                    f"train on a small task and watch the logged losses), fix it, and hand in the fixed "
                    f"{bug['script']}. It is graded by comparing its training with the reference's at one seed.\n")
        written.append(os.path.join(folder, bug["script"]))
    return written


def tiny_run(path, script):
    """The metrics rows of a few updates of the script at `path` on the cue task (in a temporary folder)."""
    module = grading.load_script(path)
    patch_cue_env(module)
    threads = torch.get_num_threads()
    previous = os.getcwd()
    workdir = tempfile.mkdtemp(prefix="silent_bug_")
    try:
        os.chdir(workdir)
        fields = {f.name for f in dataclasses.fields(module.Args)}
        args = module.Args(**{k: v for k, v in CHECK_FLAGS[script].items() if k in fields})
        with contextlib.redirect_stdout(io.StringIO()):
            run_dir = module.train(args)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]
    finally:
        os.chdir(previous)
        torch.set_num_threads(threads)
        shutil.rmtree(workdir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def reference_rows(script):
    """The repository's script's rows (once per process: every check of one script compares with the same run)."""
    return tiny_run(os.path.join(ROOT, script), script)


def compared(row):
    """A row's numbers that the algorithm decides (losses, returns), not its timings."""
    return {key: value for key, value in row.items() if isinstance(value, (int, float)) and not isinstance(value, bool)
            and key.split("/")[0] in ("losses", "charts", "eval", "aux")
            and not any(word in key.lower() for word in ("sps", "per_second", "time", "seconds"))}


def differences(got, expected):
    problems = []
    if len(got) != len(expected):
        return [f"{len(got)} metrics rows, the reference logs {len(expected)}"]
    for number, (row, reference) in enumerate(zip(got, expected), 1):
        mine, theirs = compared(row), compared(reference)
        for key in sorted(set(mine) | set(theirs)):
            a, b = mine.get(key), theirs.get(key)
            if a is None or b is None or not math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7):
                problems.append(f"row {number}, {key}: yours {a}, the reference's {b}")
    return problems


def check(name, path, report=print):
    """True when the fixed copy at `path` trains exactly as the repository's script does."""
    bug = BUGS[name]
    problems = differences(tiny_run(path, bug["script"]), reference_rows(bug["script"]))
    if problems:
        report(f"FAIL: silent bug {name}: the fixed {bug['script']} does not train as the reference does "
               f"({len(problems)} numbers differ), e.g.\n  " + "\n  ".join(problems[:5]))
        return False
    report(f"PASS: silent bug {name}: {bug['script']} trains as the reference does (same losses and returns)")
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    making = commands.add_parser("make", help="write the bugged copies")
    making.add_argument("--out", required=True, help="folder for one sub-folder per bug")
    making.add_argument("--bugs", default=",".join(BUGS), help=f"comma-separated, from {', '.join(BUGS)}")
    checking = commands.add_parser("check", help="grade a fixed copy")
    checking.add_argument("bug", choices=sorted(BUGS))
    checking.add_argument("file", help="the student's fixed script")
    options = parser.parse_args(argv)
    if options.command == "make":
        names = [n for n in options.bugs.split(",") if n]
        unknown = [n for n in names if n not in BUGS]
        if unknown:
            parser.error(f"--bugs: unknown {', '.join(unknown)}; choose from {', '.join(BUGS)}")
        for path in make(options.out, names):
            print(path)
        return 0
    return 0 if check(options.bug, options.file) else 1


if __name__ == "__main__":
    sys.exit(main())
