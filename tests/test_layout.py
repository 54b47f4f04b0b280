"""Each script reads top to bottom as its algorithm, with the plumbing in an appendix below `train`: these tests
check that structure (what comes before what, which calls the story makes), not the files' sizes."""
import ast
import difflib
import os
import re
import subprocess
import tempfile

import pytest
from conftest import ROOT

MARKER = "# ---- Appendix: plumbing ----"
SCRIPTS = ["ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py"]
SCREEN_LINES = 64  # no function or class in an appendix is longer than one screen of a laptop's editor
# Top-level names that are plumbing wherever they appear: none of them may be defined before `train`.
PLUMBING = {"Run", "Logger", "ProcgenVecEnv", "FramesToDevice", "PROCGEN_RANGES", "RUNTIME_FLAGS", "CPU_NOTE",
            "normalized_score", "evaluate", "write_video", "setup_distributed", "thread_split", "thread_budget",
            "all_reduce_mean", "average_gradients", "global_moments", "gather", "catch_interrupt", "StopOnSignal",
            "start_run", "open_run", "create_run_dir", "count_iterations", "restore", "checkpoint_state",
            "log_iteration", "evaluate_and_log", "evaluate_checkpoint", "on_track_line", "close_run", "exit_nonfinite",
            "save_checkpoint", "load_checkpoint", "reward_statistics", "rank_state", "restore_rank_state", "require",
            "check_ranges", "check_args", "mean_or_none", "run_folder", "game_seed", "end_run", "last_saved",
            "checkpoint_bytes", "Interrupted", "drop_rows_after", "write_atomically", "stop_in_startup", "hold_signal",
            "restore_signal_handlers", "remove_if_empty"}
# A name that is part of one script's story (the RLHF toy's evaluation stage) is not plumbing there.
STORY_NAMES = {"ppo_rlhf_toy.py": {"evaluate"}}
# What the diff of the PPO and PPG stories may not call (judged on the code's calls, not on substrings): logging,
# evaluation, timing, signals, torch.distributed, checkpoints, the placement of PPG's buffer and print. Calls by name,
# and calls of a method on these objects. Both stories time and log their parts in lines they share; PPG's one line
# that creates its buffer B (`allocate_buffer`, which places it in the appendix) is the algorithm's.
PLUMBING_CALLS = {"print", "Logger", "log_iteration", "evaluate_and_log", "StopOnSignal", "save_checkpoint",
                  "load_checkpoint", "restore", "checkpoint_state", "torch.save", "torch.load", "time.perf_counter",
                  "time.time", "aux_buffer_device", "available_memory", "log_aux_phase", "run.logger.log"}
PLUMBING_RECEIVERS = {"logger", "run.logger", "signal", "dist", "torch.distributed", "time"}


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
    assert main_guard and main_guard[-1] > lines.index(MARKER)
    # One guard may come before: Ctrl-C's default action while the third-party libraries load (no traceback).
    for number in main_guard[:-1]:
        guarded = lines[number + 1].split("#")[0].strip()
        assert guarded == "signal.signal(signal.SIGINT, signal.SIG_DFL)", f"line {number + 1}: a second main guard"


def changed_lines(first, second):
    """Lines that `diff` reports as changed between two texts (given as lists of lines)."""
    with tempfile.TemporaryDirectory() as directory:
        paths = [os.path.join(directory, name) for name in ("first.py", "second.py")]
        for path, text in zip(paths, (first, second)):
            with open(path, "w") as f:
                f.write("\n".join(text) + "\n")
        result = subprocess.run(["diff", *paths], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if line[:1] in "<>"]


# The pages that say what `diff ppo_procgen.py <script>` shows, with the number of changed lines they quote.
DIFF_CLAIMS = {"ppg_procgen.py": "docs/ppg.md", "vtrace.py": "docs/impala.md"}


def documented_diff_size(page, script):
    """The N of "`diff ppo_procgen.py <script>` ... N changed lines" on `page`."""
    text = " ".join(read(page).split())
    match = re.search(rf"`diff ppo_procgen.py {re.escape(script)}`[^.]*?\b([0-9][0-9,]*) changed lines", text)
    assert match, f"{page} does not say how many lines `diff ppo_procgen.py {script}` changes"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("script", sorted(DIFF_CLAIMS))
def test_the_docs_say_what_the_diff_with_ppo_holds(script):
    """The reader is told to read `diff ppo_procgen.py <script>` and how long it is; the count stays true (within 10 %,
    so that a comment does not fail the suite, but a diff that doubles does)."""
    changed = changed_lines(read("ppo_procgen.py").splitlines(), read(script).splitlines())
    documented = documented_diff_size(DIFF_CLAIMS[script], script)
    assert abs(len(changed) - documented) <= 0.1 * documented, (
        f"`diff ppo_procgen.py {script}` changes {len(changed)} lines; {DIFF_CLAIMS[script]} says {documented}")


def test_ppg_train_shows_both_phases_of_algorithm_1():
    """PPG's `train` shows Algorithm 1: a policy phase that adds (s_t, V_targ) to B, then the auxiliary phase under
    its own heading, calling `auxiliary_phase` itself, then the iteration's log line (shared with PPO); the auxiliary
    minibatch rule (`aux_rollouts_per_rank`) is part of the story, defined before `train`."""
    source = read("ppg_procgen.py")
    node = train_node(source)
    body = ast.get_source_segment(source, node)
    calls = [dotted_name(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)]
    assert {"ppo_update", "compute_gae", "auxiliary_phase"} <= set(calls)
    lines = body.splitlines()
    policy = next(i for i, line in enumerate(lines) if line.strip().startswith("# Policy phase"))
    add_to_b = next(i for i, line in enumerate(lines) if "Add all (s_t, V_targ" in line)
    log = next(i for i, line in enumerate(lines) if "log_iteration(" in line)
    auxiliary = next(i for i, line in enumerate(lines) if line.strip().startswith("# Auxiliary phase (every N_pi"))
    phase_call = next(i for i, line in enumerate(lines) if "auxiliary_phase(" in line)
    assert policy < add_to_b < auxiliary < phase_call < log
    definitions = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    assert definitions.index("aux_rollouts_per_rank") < definitions.index("train")


def dotted_name(node):
    """`a.b.c` of a call's function (None for calls of calls, subscripts, ...)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        receiver = dotted_name(node.value)
        return receiver and f"{receiver}.{node.attr}"
    return None


def plumbing_calls(source, lines):
    """The calls into plumbing (PLUMBING_CALLS, methods of PLUMBING_RECEIVERS or of a `with StopOnSignal(...) as`
    target) that touch one of `lines` (1-based) of `source`."""
    tree = ast.parse(source)
    receivers = set(PLUMBING_RECEIVERS)
    for node in ast.walk(tree):
        if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
            if isinstance(node.context_expr, ast.Call) and dotted_name(node.context_expr.func) == "StopOnSignal":
                receivers.add(node.optional_vars.id)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted_name(node.func) or ""
        plumbing = name in PLUMBING_CALLS or name.rpartition(".")[0] in receivers
        if plumbing and set(range(node.lineno, node.end_lineno + 1)) & set(lines):
            found.append(f"line {node.lineno}: {name}()")
    return found


def changed_line_numbers(first, second):
    """1-based numbers of the lines of each text that its diff with the other changes."""
    matcher = difflib.SequenceMatcher(None, first, second, autojunk=False)
    changed = ([], [])
    for tag, first_start, first_end, second_start, second_end in matcher.get_opcodes():
        if tag != "equal":
            changed[0].extend(range(first_start + 1, first_end + 1))
            changed[1].extend(range(second_start + 1, second_end + 1))
    return changed


def story_diff_plumbing(first_source, second_source):
    first, second = story(first_source), story(second_source)
    first_changed, second_changed = changed_line_numbers(first, second)
    stories = ("\n".join(first) + "\n", "\n".join(second) + "\n")
    return bool(first_changed or second_changed), (plumbing_calls(stories[0], first_changed)
                                               + plumbing_calls(stories[1], second_changed))


def test_ppo_to_ppg_story_diff_holds_the_algorithm_only():
    changed, plumbing = story_diff_plumbing(read("ppo_procgen.py"), read("ppg_procgen.py"))
    assert changed and not plumbing, "plumbing in the story diff:\n" + "\n".join(plumbing)


def test_the_story_diff_check_can_fail():
    """A plumbing call in the changed lines is found, also inside a `with StopOnSignal(...) as` block and across a
    call's lines; the same words in a comment, a string or an unchanged line are not calls (a passing story-diff test
    means something)."""
    base = "def train(args):\n    with StopOnSignal(args) as halt:\n        x = 1\n"
    assert story_diff_plumbing(base, base.replace("x = 1", "x = 2  # print(logger)")) == (True, [])
    _, found = story_diff_plumbing(base, base.replace("x = 1", "x = halt.requested()"))
    assert found == ["line 3: halt.requested()"]
    _, found = story_diff_plumbing(base, base.replace("x = 1", "x = f(\n            dist.get_rank())"))
    assert found == ["line 4: dist.get_rank()"]
    _, found = story_diff_plumbing(base, base.replace("x = 1", "print(x)\n        y = logger.log(x)"))
    assert found == ["line 3: print()", "line 4: logger.log()"]
    _, found = story_diff_plumbing(base, base.replace("x = 1", "x = time.perf_counter()\n        run.logger.log(x)"))
    assert found == ["line 3: time.perf_counter()", "line 4: run.logger.log()"]
    assert changed_lines(["a", "b"], ["a", "c"]) == ["< b", "> c"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_appendix_function_or_class_is_long(name):
    source = read(name)
    marker_line = source.splitlines().index(MARKER) + 1
    long_blocks = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.lineno > marker_line:
            first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            if node.end_lineno - first + 1 > SCREEN_LINES:
                long_blocks.append(f"{node.name} ({node.end_lineno - first + 1} lines)")
    assert not long_blocks, f"appendix blocks over {SCREEN_LINES} lines: {long_blocks}"


# The equations' own signatures, which the papers give (GAE's seven inputs, V-trace's, IMPALA's loss with its
# coefficients b and e), may be longer.
EQUATIONS = {"compute_gae", "from_importance_weights", "from_logits", "vtrace_loss"}


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_function_takes_more_than_six_parameters(name):
    """Many values that travel together are one record (the run's), not a long parameter list."""
    long = []
    for node in ast.walk(ast.parse(read(name))):
        if isinstance(node, ast.FunctionDef) and node.name not in EQUATIONS:
            parameters = [a for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                          if a.arg not in ("self", "cls")]
            if len(parameters) + bool(node.args.vararg) > 6:
                long.append(f"{node.name} ({len(parameters)})")
    assert not long, f"functions with more than 6 parameters: {long}"


# ---- --help: what the program is, and every default ----
HELP_PROGRAMS = ["ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py"] + [
    f"benchmarks/{name}.py" for name in (
        "bench", "procgen_cpu", "lag_experiment", "rlhf_seeds", "rlhf_estimators", "reward_wrappers", "env_backends",
        "backend_parity", "allreduce_cost", "amp_learning", "fault_campaign", "sigterm_latency", "gpu_flops",
        "threads_at_load", "evidence", "launch", "results", "gpu_check", "gpu_preflight", "mutate")]


def help_of(program, monkeypatch, capsys):
    """`python PROGRAM --help`'s text, run in this process as the interpreter would run it (runpy as __main__)."""
    import runpy
    import signal
    import sys
    path = os.path.join(ROOT, program)
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    monkeypatch.setattr(sys, "path", [os.path.dirname(path), *sys.path])
    monkeypatch.setenv("COLUMNS", "100")
    sigint = signal.getsignal(signal.SIGINT)  # the scripts' own until their imports are done
    try:
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(path, run_name="__main__")
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert ended.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("program", HELP_PROGRAMS)
def test_help_says_what_the_program_is_and_shows_every_default(program, monkeypatch, capsys):
    """The docstring's first line near the top of --help (after the usage line), and each option's default."""
    text = help_of(program, monkeypatch, capsys)
    first_line = " ".join(ast.get_docstring(ast.parse(read(program))).splitlines()[0].split())
    plain = " ".join(text.replace("│", " ").split())
    usage_end = plain.index("options") if "options" in plain else len(plain)
    assert first_line in plain[:usage_end], f"{program} --help does not begin with {first_line!r}"
    options = re.split(r"\n(?:│ |  )(?=-)", text.split("options", 1)[1])  # at each option's own line
    for option in options[1:]:
        flag = option.split()[0]
        if flag not in ("-h,", "--help"):
            assert "(default:" in option or "(required)" in option, f"{program} --help: {flag} shows no default"
