"""exercises/sandbox.py: the instructor's batch grades each submission in a child process of its own, and no
submission can change a grade, its own or a neighbour's (issue 32). One batch (a module-scoped fixture) grades every
attacker below beside an honest script and a victim graded after them; each test reads its part of that batch.

The instructor runs from a private copy of the repository (a folder only its owner may read, as
docs/assignments.md asks): a child that finds the repository's path in the instructor's command line then finds
nothing it may read there."""
import csv
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import ROOT

SECRET = "S3CRET-7d1f-sandbox"
MARKER = "# VICTIM-MARKER-c41b9e"  # in the victim's file only: a submission that reads it has read another's
EXERCISE_POINTS = 40
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="without root the child has no uid of its own and can read "
                             "and write what the instructor can (docs/assignments.md): run the grader as root")

ZEROS = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    return torch.zeros_like(rewards)
'''

# compute_gae answered by the references: from sys.modules (the old grader's own process), else from the repository
# whose path the instructor's command line names.
REFERENCE_CALL = '''
def reference_roots():
    import os
    roots = [os.getcwd()]
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            arguments = f.read().decode(errors="replace").split("\\0")
        roots += [os.path.dirname(os.path.dirname(a)) for a in arguments if a.endswith("instructor.py")]
    except OSError:
        pass
    return roots


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    import importlib
    import sys
    found = sys.modules.get("exercises.references")
    for root in reference_roots():
        if found is not None:
            break
        sys.path.insert(0, root)
        try:
            found = importlib.import_module("exercises.references")
        except Exception:
            sys.path.pop(0)
    if found is None:
        return torch.zeros_like(rewards)
    inputs = dict(rewards=rewards, values=values, dones=dones, next_value=next_value, next_done=next_done)
    arrays = {key: value.detach().double().cpu().numpy() for key, value in inputs.items()}
    answer = found.gae(gamma=gamma, gae_lambda=gae_lambda, **arrays)[0]
    return torch.as_tensor(answer, dtype=rewards.dtype)
'''

# A wrong compute_gae, and module-level code that makes the grader's comparison pass everything.
PATCHER = ZEROS + '''
import sys as _sys


def _always_close(*args, **kwargs):
    return True


for _name in ("exercises.grading", "grading"):
    if _name in _sys.modules:
        _sys.modules[_name].close = _always_close
'''

# A wrong compute_gae that rewrites grades.csv at exit, and from a daemon that outlives its process group and waits
# for the final CSV.
REWRITER = ZEROS + '''
import atexit as _atexit
import os as _os
import time as _time


def _out_folder():
    arguments = list(sys.argv)  # the grader's own, when it runs the submission in its process
    try:
        with open(f"/proc/{_os.getppid()}/cmdline", "rb") as f:
            arguments += f.read().decode(errors="replace").split("\\0")
    except OSError:
        pass
    if "--out" in arguments:
        return arguments[arguments.index("--out") + 1]
    return None


def _rewrite():
    folder = _out_folder()
    try:
        with open(_os.path.join(folder, "grades.csv"), "w") as f:
            f.write("student,points,max_points\\na_rewriter,999,1\\n")
        return True
    except (OSError, TypeError):
        return False


def _daemon():
    if _os.fork() == 0:
        _os.setsid()
        if _os.fork() == 0:
            for _ in range(600):
                if _os.path.exists(_os.path.join(str(_out_folder()), "grades.csv")):
                    _time.sleep(0.3)
                    _rewrite()
                    break
                _time.sleep(0.2)
        _os._exit(0)


_atexit.register(_rewrite)
_daemon()
'''

# A wrong compute_gae whose error message carries everything it could read: its argv and environment, the
# instructor's command line and environment, and every file under the folders those name (the other submissions).
SNOOP = '''
def snoop():
    import os
    found = [" ".join(sys.argv), repr(dict(os.environ))]
    folders = [os.getcwd(), os.path.dirname(os.getcwd())]
    for path in ("/proc/self/cmdline", f"/proc/{os.getppid()}/cmdline", f"/proc/{os.getppid()}/environ"):
        try:
            with open(path, "rb") as f:
                text = f.read().decode(errors="replace")
            found.append(text)
            folders += [a for a in text.split("\\0") if a.startswith("/")]
        except OSError as error:
            found.append(str(error))
    for folder in folders:
        for directory, _, names in os.walk(folder if os.path.isdir(folder) else os.path.dirname(folder)):
            for name in names:
                try:
                    with open(os.path.join(directory, name), errors="replace") as f:
                        found.append(f.read(100000))
                except OSError:
                    pass
    return " | ".join(found)


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise RuntimeError("FOUND " + snoop())
'''


def lookup_source():
    """compute_gae answered from the shipped public cases (what the bundle gives every student), else zeros."""
    with open(os.path.join(ROOT, "exercises", "cases", "compute_gae.json")) as f:
        shipped = f.read()
    return f'''
_SHIPPED = json.loads({shipped!r})


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    for case in _SHIPPED:
        inputs = case["inputs"]
        if np.array_equal(np.array(inputs["rewards"]["array"]), rewards.detach().cpu().numpy()) and np.array_equal(
                np.array(inputs["values"]["array"]), values.detach().cpu().numpy()):
            return torch.tensor(case["expected"][0]["array"], dtype=rewards.dtype, device=rewards.device)
    return torch.zeros_like(rewards)
'''


# A fork bomb at import, bounded at 200 processes even without RLIMIT_NPROC (its children sleep: a bomb that spins
# would only burn the shared cores), and a compute_gae that asks for 8 GiB and tells how many forks it got.
HOG = """
import os as _os
import time as _time

_forks = 0
for _ in range(200):
    try:
        _child = _os.fork()
    except OSError:
        break
    if _child == 0:
        _time.sleep(600)
        _os._exit(0)
    _forks += 1


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    try:
        hog = bytearray(8 << 30)
    except MemoryError:
        raise MemoryError(f"8 GiB refused; the fork bomb got {_forks} processes") from None
    return torch.zeros_like(rewards) + len(hog)
"""

# An endless loop: one that the per-function limit stops, and one that blocks the alarm (the CPU limit stops it).
LOOP = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    while True:
        pass
'''
STUBBORN = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    while True:
        pass
'''

CRASH = '''
raise RuntimeError("boom at import")
'''

# At import: a try to kill the zygote (its parent) where it runs as another uid, then SIGKILL to itself.
KILLER = '''
import os as _os
import signal as _signal

with open(f"/proc/{_os.getppid()}/status") as _f:
    _parent_uid = [_line.split()[1] for _line in _f if _line.startswith("Uid:")][0]
if int(_parent_uid) != _os.getuid():  # as root: the zygote is root and this child is not
    try:
        _os.kill(_os.getppid(), _signal.SIGKILL)
    except PermissionError:
        pass
_os.kill(_os.getpid(), _signal.SIGKILL)
'''

# Marks left by one submission's process (a module global of the engine, sys.modules, builtins, the environment,
# a file in /tmp), and a compute_gae graded later in the same batch that tells which of them it finds.
TMP_MARKER = f"/tmp/sandbox_marker_{os.getpid()}"
MARKER_WRITER = ZEROS + f'''
import builtins as _builtins
import os as _os
import types as _types

sys.modules["grading"].SANDBOX_MARKER = True
sys.modules["sandbox_marker"] = _types.ModuleType("sandbox_marker")
_builtins.sandbox_marker = True
_os.environ["SANDBOX_MARKER"] = "1"
with open({TMP_MARKER!r}, "w") as _f:
    _f.write("marker")
'''
MARKER_SEEKER = f'''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    import builtins
    import os
    found = []
    if hasattr(sys.modules["grading"], "SANDBOX_MARKER"):
        found.append("module-global")
    if "sandbox_marker" in sys.modules:
        found.append("sys.modules")
    if hasattr(builtins, "sandbox_marker"):
        found.append("builtins")
    if "SANDBOX_MARKER" in os.environ:
        found.append("environ")
    try:
        with open({TMP_MARKER!r}) as f:
            found.append("tmp-file:" + f.read())
    except OSError:
        pass
    raise RuntimeError("SEEN[" + ",".join(found) + "]")
'''


def submissions():
    """{student: the source of ppo_procgen.py}. Sorted by name, the attackers come before the victim."""
    with open(os.path.join(ROOT, "ppo_procgen.py")) as f:
        script = f.read()
    missing = script.replace("def compute_gae(", "def compute_gae_renamed(")
    syntax = script.replace("def compute_gae(rewards", "def compute_gae(:rewards", 1)
    return {"a_reference": script + REFERENCE_CALL, "a_patcher": script + PATCHER, "a_rewriter": script + REWRITER,
            "a_snoop": script + SNOOP, "a_lookup": script + lookup_source(), "a_hog": script + HOG,
            "a_loop": script + LOOP, "a_stubborn": script + STUBBORN, "a_crash": script + CRASH,
            "a_syntax": syntax, "a_missing": missing, "a_killer": script + KILLER, "a_marker": script + MARKER_WRITER,
            "m_correct": script, "y_seeker": script + MARKER_SEEKER,
            "z_victim": script + ZEROS + "\n" + MARKER + "\n"}


def private_repository(target):
    """The scripts and exercises/ copied into `target` (pytest's folders are readable by their owner only)."""
    os.makedirs(target)
    shutil.copytree(os.path.join(ROOT, "exercises"), os.path.join(target, "exercises"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py"):
        shutil.copy(os.path.join(ROOT, name), target)
    return target


def write_submissions(folder):
    for student, source in submissions().items():
        os.makedirs(os.path.join(folder, student))
        with open(os.path.join(folder, student, "ppo_procgen.py"), "w") as f:
            f.write(source)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One batch of every submission above (GAE, 40 points): {student: its JSON result}, the CSV's rows, the
    reports, and the batch's wall time."""
    base = tmp_path_factory.mktemp("sandbox")
    repository = private_repository(str(base / "repository"))
    folder, out = str(base / "submissions"), str(base / "grades")
    write_submissions(folder)
    command = [sys.executable, os.path.join(repository, "exercises", "instructor.py"), "batch", folder,
               "--exercises", "gae", "--secret", SECRET, "--out", out, "--jobs", "2", "--cpu-seconds", "4",
               "--case-seconds", "2", "--seconds", "120"]
    environment = {key: value for key, value in os.environ.items() if key != "GRADER_SECRET"}
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=repository, env=environment)
    seconds = time.time() - start
    if os.path.exists(TMP_MARKER):
        os.unlink(TMP_MARKER)
    assert result.returncode == 0, result.stdout + result.stderr
    time.sleep(1.5)  # a daemon that survived its child would rewrite grades.csv now
    results = {}
    reports = {}
    for student in submissions():
        with open(os.path.join(out, f"{student}.json")) as f:
            results[student] = json.load(f)
        with open(os.path.join(out, f"{student}.txt")) as f:
            reports[student] = f.read()
    with open(os.path.join(out, "grades.csv")) as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    return {"results": results, "rows": rows, "reports": reports, "seconds": seconds, "out": out,
            "stdout": result.stdout + result.stderr, "repository": repository, "folder": folder}


def cases(graded, student, function="compute_gae"):
    return [case for case in graded["results"][student]["exercises"]["gae"]["cases"]
            if case["item"].startswith(function)]


def points(graded, student):
    return graded["results"][student]["exercises"]["gae"]["points"]


def earned_on_values(graded, student):
    """The points of the student's compute_gae cases that check values (the 'meta' device case checks where the
    output lives, which torch.zeros_like gets right)."""
    return sum(case["points"] for case in cases(graded, student) if "'meta'" not in case["item"])


def test_the_honest_script_gets_full_marks_and_every_grade_has_the_same_maximum(graded):
    assert points(graded, "m_correct") == EXERCISE_POINTS, graded["reports"]["m_correct"]
    assert {r["exercises"]["gae"]["max_points"] for r in graded["results"].values()} == {EXERCISE_POINTS}
    hidden = sum(c["max_points"] for c in graded["results"]["m_correct"]["exercises"]["gae"]["cases"] if c["hidden"])
    assert hidden >= EXERCISE_POINTS / 2 - 1e-6  # the hidden cases carry at least half of the points


@AS_ROOT
def test_a_call_to_the_references_earns_nothing(graded):
    assert earned_on_values(graded, "a_reference") == 0, graded["reports"]["a_reference"]


def test_patching_the_grader_earns_nothing_and_the_victim_graded_after_it_keeps_its_grade(graded):
    assert earned_on_values(graded, "a_patcher") == 0
    assert earned_on_values(graded, "z_victim") == 0, graded["reports"]["z_victim"]
    victim = graded["results"]["z_victim"]["exercises"]["gae"]["cases"]
    assert all(c["passed"] for c in victim if not c["item"].startswith("compute_gae"))  # its own honest parts
    assert points(graded, "z_victim") == points(graded, "a_patcher")  # the same wrong code, the same grade


def test_the_victim_graded_alone_gets_the_grade_it_got_after_the_attackers(graded):
    """No grade depends on the batch's order or company: `grade` on the victim alone, same secret, same name."""
    alone = os.path.join(graded["out"], "..", "z_victim_alone.json")
    command = [sys.executable, os.path.join(graded["repository"], "exercises", "instructor.py"), "grade", "gae",
               os.path.join(graded["folder"], "z_victim", "ppo_procgen.py"), "--student", "z_victim", "--json",
               alone]
    environment = {key: value for key, value in os.environ.items() if key != "GRADER_SECRET"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=dict(environment, GRADER_SECRET=SECRET))
    assert result.returncode == 1, result.stdout + result.stderr  # a wrong compute_gae: not full marks
    with open(alone) as f:
        single = json.load(f)
    batch = graded["results"]["z_victim"]
    assert single["seed"] == batch["seed"] and single["points"] == batch["points"]
    assert [c["passed"] for c in single["exercises"]["gae"]["cases"]] == [
        c["passed"] for c in batch["exercises"]["gae"]["cases"]]


@AS_ROOT
def test_no_exit_hook_or_daemon_rewrites_the_csv(graded):
    rows = graded["rows"]
    assert set(rows) == set(graded["results"])
    for student, result in graded["results"].items():
        assert float(rows[student]["points"]) == result["points"] and float(rows[student]["max_points"]) == 40
    assert earned_on_values(graded, "a_rewriter") == 0


@AS_ROOT
def test_the_secret_and_the_other_submissions_never_reach_a_submission(graded):
    report = graded["reports"]["a_snoop"] + json.dumps(graded["results"]["a_snoop"])
    assert "FOUND" in report  # it ran and told what it found
    assert SECRET not in report and MARKER not in report
    assert "def reference_roots" not in report  # not the other submissions either
    assert "compute_gae_renamed" not in report and "S3CRET" not in report


def test_a_lookup_of_the_shipped_public_cases_earns_nothing(graded):
    assert earned_on_values(graded, "a_lookup") == 0, graded["reports"]["a_lookup"]


@AS_ROOT
def test_a_fork_bomb_and_a_memory_hog_stay_within_their_limits(graded):
    assert earned_on_values(graded, "a_hog") == 0
    report = graded["reports"]["a_hog"]
    assert "MemoryError: 8 GiB refused; the fork bomb got" in report, report[:3000]
    forks = int(report.split("MemoryError: 8 GiB refused; the fork bomb got ", 1)[1].split()[0])
    assert forks < 64  # RLIMIT_NPROC stopped it (the submission's threads count too)
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        zombie = status.get("State", "").split()[:1] == ["Z"]  # killed; this container's init may not reap it
        if 1_500_000_000 <= int(status["Uid"].split()[0]) < 1_600_000_000 and not zombie:
            left.append(pid)
    assert not left  # every process of every submission is gone (the bomb's sleepers, the daemon)


def test_an_endless_loop_scores_zero_for_what_it_never_finished(graded):
    loop = cases(graded, "a_loop")
    assert not any(c["passed"] for c in loop) and "ran past 2 s" in loop[0]["message"]
    others = [c for c in graded["results"]["a_loop"]["exercises"]["gae"]["cases"] if c not in loop]
    assert others and all(c["passed"] for c in others)  # its policy_loss and value_loss still score
    stubborn = graded["results"]["a_stubborn"]
    assert stubborn["points"] == 0 and stubborn["exercises"]["gae"]["max_points"] == 40
    assert all("timed out" in c["message"] for c in stubborn["exercises"]["gae"]["cases"])


def test_a_broken_file_scores_zero_of_the_same_maximum_with_its_reason(graded):
    for student, reason in (("a_syntax", "SyntaxError at line"), ("a_crash", "RuntimeError: boom at import"),
                            ("a_missing", "no file defines compute_gae")):
        result = graded["results"][student]
        assert result["points"] == 0 and result["max_points"] == 40, student
        assert reason in graded["reports"][student], (student, graded["reports"][student][:2000])


def test_a_forged_or_malformed_report_scores_nothing_and_stops_nothing():
    """What the child sends is read as data: a field of the wrong type, an array of objects, a name that is not a
    string, a line that is not JSON score 0 for their cases; nothing raises in the parent (no batch stops)."""
    import numpy as np

    from exercises import grading, sandbox

    case = grading.Case("compute_gae", "forged", {"rewards": np.zeros((1, 1))}, expected=[np.zeros((1, 1))])
    requests = {("ppo_procgen.py", "compute_gae"): [case, case, case]}
    lines = [json.dumps({"file": "ppo_procgen.py", "function": "compute_gae", "index": 1,
                         "observation": {"float64": [1.0]}}),
             json.dumps({"file": ["ppo_procgen.py"], "function": "compute_gae", "index": 2, "observation": {}}),
             json.dumps({"file": "ppo_procgen.py", "function": "compute_gae", "index": 0,
                         "observation": {"float64": {"outputs": [{"array": [[0.0]], "dtype": "object"}]}}}),
             "not json"]
    observations, import_errors = sandbox.read_report(lines, requests)
    results = grading.judge_cases(requests[("ppo_procgen.py", "compute_gae")], observations["ppo_procgen.py"]
                                  ["compute_gae"])
    assert [r.points for r in results] == [0.0, 0.0, 0.0] and not import_errors
    assert results[0].message.startswith("timed out") and "cannot read" in results[1].message
    assert results[2].message.startswith("timed out")  # the line with a list for a name ended the report


def test_a_submission_sees_nothing_that_another_left_in_its_process_or_files(graded):
    """Each child is a fork of the pristine zygote: what one submission changed in its interpreter (the engine's
    globals, sys.modules, builtins, os.environ) is not in the next one's; a file it left in /tmp is its uid's
    alone (umask 077)."""
    report = graded["reports"]["y_seeker"]
    seen = report.split("RuntimeError: SEEN[", 1)[1].split("]", 1)[0]
    found = set(filter(None, seen.split(",")))
    assert not found & {"module-global", "sys.modules", "builtins", "environ"}, report[:2000]
    if os.geteuid() == 0:
        assert not found, report[:2000]
    assert points(graded, "a_marker") == points(graded, "z_victim")  # it ran: the same zeros, the same grade


def test_a_child_that_kills_itself_scores_zero_and_the_batch_goes_on(graded):
    killer = graded["results"]["a_killer"]
    assert killer["points"] == 0 and killer["exercises"]["gae"]["max_points"] == 40
    assert "status -9" in killer["process"], killer["process"]
    assert points(graded, "m_correct") == EXERCISE_POINTS and points(graded, "y_seeker") < EXERCISE_POINTS


def test_a_dead_zygote_fails_the_submission_with_its_reason_and_does_not_hang():
    from exercises import grading, sandbox

    case = grading.Case("compute_gae", "one", {"rewards": [0.0]}, expected=[None])
    requests = {("ppo_procgen.py", "compute_gae"): [case]}
    limits = sandbox.Limits(seconds=60)
    with sandbox.Zygote() as zygote:
        zygote.process.kill()
        zygote.process.wait()
        start = time.monotonic()
        with pytest.raises(sandbox.ZygoteError, match="zygote"):
            sandbox.run_child([os.path.join(ROOT, "ppo_procgen.py")], requests, limits, None, zygote)
        assert time.monotonic() - start < 30  # it did not wait for the wall-clock limit
