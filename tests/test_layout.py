"""The story first (issue 16): each script reads top to bottom as its algorithm, with the plumbing in an appendix
below `train`. These tests measure the budgets instead of trusting the eye."""
import ast
import os
import re
import subprocess
import tempfile

import pytest
from conftest import ROOT

MARKER = "# ---- Appendix: plumbing ----"
SCRIPTS = ["ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py"]
STORY_LINES = {"ppo_procgen.py": 450, "ppg_procgen.py": 550, "vtrace.py": 620, "ppo_rlhf_toy.py": 800}
TRAIN_LINES = {"ppo_procgen.py": 100, "ppg_procgen.py": 100, "vtrace.py": 110, "ppo_rlhf_toy.py": 80}
# Top-level names that are plumbing wherever they appear: none of them may be defined before `train`.
PLUMBING = {"Run", "Logger", "ProcgenVecEnv", "FramesToDevice", "PROCGEN_RANGES", "RUNTIME_FLAGS", "CPU_NOTE",
            "normalized_score", "evaluate", "write_video", "setup_distributed", "thread_split", "thread_budget",
            "all_reduce_mean", "average_gradients", "global_moments", "gather", "catch_interrupt",
            "save_checkpoint", "load_checkpoint", "reward_statistics", "rank_state", "restore_rank_state", "require",
            "check_ranges", "check_args", "mean_or_none"}
# A name that is part of one script's story (the RLHF toy's evaluation stage) is not plumbing there.
STORY_NAMES = {"ppo_rlhf_toy.py": {"evaluate"}}
# What the diff of the PPO and PPG stories may not hold: PPG's algorithm and defaults only.
NOT_IN_STORY_DIFF = ["logger.", "print(", "signal", "torch.distributed", "dist.", "checkpoint", "time.time",
                     "perf_counter"]


def read(name):
    path = os.path.join(ROOT, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} not written yet")
    return open(path).read()


def train_node(source):
    return next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "train")


def story(source):
    """Line 1 to the last line of `train`."""
    return source.splitlines()[: train_node(source).end_lineno]


@pytest.mark.parametrize("name", SCRIPTS)
def test_story_is_short(name):
    assert len(story(read(name))) <= STORY_LINES[name]


@pytest.mark.parametrize("name", SCRIPTS)
def test_train_is_short(name):
    node = train_node(read(name))
    assert node.end_lineno - node.lineno + 1 <= TRAIN_LINES[name]


@pytest.mark.parametrize("name", SCRIPTS)
def test_few_long_lines(name):
    lines = read(name).splitlines()
    long_lines = [number for number, line in enumerate(lines, 1) if len(line) > 100]
    assert len(long_lines) <= 0.10 * len(lines), f"{len(long_lines)} of {len(lines)} lines over 100 characters"


@pytest.mark.parametrize("name", SCRIPTS)
def test_plumbing_lives_in_the_appendix_after_train(name):
    source = read(name)
    lines = source.splitlines()
    assert MARKER in lines, f"no line {MARKER!r}"
    train_end = train_node(source).end_lineno
    assert lines.index(MARKER) + 1 > train_end, "the appendix marker comes before the end of train"
    before = []
    for node in ast.parse(source).body:
        if node.lineno >= train_end:
            break
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            before.append(node.name)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            before.append(node.targets[0].id)
    plumbing = (PLUMBING - STORY_NAMES.get(name, set())) & set(before)
    assert not plumbing, f"plumbing before train: {sorted(plumbing)}"
    main_guard = [number for number, line in enumerate(lines) if line.startswith("if __name__ ==")]
    assert main_guard and main_guard[0] > lines.index(MARKER)


def changed_lines(first, second):
    """Lines that `diff` reports as changed between two texts (given as lists of lines)."""
    with tempfile.TemporaryDirectory() as directory:
        paths = [os.path.join(directory, name) for name in ("first.py", "second.py")]
        for path, text in zip(paths, (first, second)):
            with open(path, "w") as f:
                f.write("\n".join(text) + "\n")
        result = subprocess.run(["diff", *paths], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if line[:1] in "<>"]


def test_ppo_to_ppg_diff_is_at_most_200_lines():
    changed = changed_lines(read("ppo_procgen.py").splitlines(), read("ppg_procgen.py").splitlines())
    assert 0 < len(changed) <= 200, f"{len(changed)} changed lines"


def test_ppo_to_ppg_story_diff_holds_the_algorithm_only():
    changed = changed_lines(story(read("ppo_procgen.py")), story(read("ppg_procgen.py")))
    plumbing = [line for line in changed if any(word in line for word in NOT_IN_STORY_DIFF)]
    assert changed and not plumbing, "plumbing in the story diff:\n" + "\n".join(plumbing)


def test_the_story_diff_check_can_fail():
    """The plumbing words are found where they are (so a passing story-diff test means something)."""
    assert re.search("|".join(map(re.escape, NOT_IN_STORY_DIFF)), "> print(f'x')")
    assert changed_lines(["a", "b"], ["a", "c"]) == ["< b", "> c"]
