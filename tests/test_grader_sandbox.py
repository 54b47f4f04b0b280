"""exercises/sandbox.py: the instructor's batch grades each submission in a child process of its own, and no
submission can change a grade, its own or a neighbour's. One batch (a module-scoped fixture) grades every attacker
below beside an honest script and a victim graded after them; each test reads its part of that batch.

Two kinds of attack: on the children (the student's code: signals, /proc, daemons, the grader's modules, limits),
and on the parent, which runs as root and reads what the students hand in (links, FIFOs, devices, names of any
bytes, huge files and messages, a function hidden from a scan of the source, leftovers in /tmp and System V IPC).
Every test of the second kind fails on the grader of commit bc49cdf.

The instructor runs from a private copy of the repository (a folder only its owner may read, as
docs/assignments.md asks): a child that finds the repository's path in the instructor's command line then finds
nothing it may read there."""
import csv
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
    for pid in filter(str.isdigit, os.listdir("/proc")):  # every command line: a wrapper's (timeout) too
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append(f.read().decode(errors="replace"))
        except OSError:
            pass
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


# ---------------------------------------------------------------- attacks on the parent (it reads as root)
RAISES = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise ValueError("no")


def policy_loss(ratio, advantages, kl, kind, clip_coef, kl_beta):
    raise ValueError("no")


def value_loss(new_value, old_value, returns, clip_coef, clip_vloss):
    raise ValueError("no")
'''
WRONG_LOSSES = '''
def _wrong_policy_loss(ratio, advantages, kl, kind, clip_coef, kl_beta):
    return (ratio * advantages).mean()


def _wrong_value_loss(new_value, old_value, returns, clip_coef, clip_vloss):
    return (new_value - returns).abs().mean()
'''
# The losses bound through globals(): a scan of the source finds no `def policy_loss` nor `value_loss = ...`.
HIDDEN_LOSSES = WRONG_LOSSES + '''
globals()["policy" + "_loss"] = _wrong_policy_loss
globals()["value" + "_loss"] = _wrong_value_loss
'''
VISIBLE_LOSSES = WRONG_LOSSES + '''
policy_loss = _wrong_policy_loss
value_loss = _wrong_value_loss
'''
DELETED_LOSSES = "\ndel policy_loss, value_loss\n"
FLOOD = '\nraise RuntimeError("x" * 15_000_000)\n'
# Leftovers: a file in /tmp and /dev/shm, a System V shared-memory segment, 3000 nested folders in its own folder.
LEFTOVERS = ZEROS + '''
import ctypes as _ctypes
import os as _os

for _folder in ("/tmp", "/dev/shm"):
    with open(f"{_folder}/sandbox_leftover_{_os.getpid()}", "w") as _f:
        _f.write("left")
_ctypes.CDLL(None).shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
_start = _os.getcwd()
for _ in range(3000):
    _os.mkdir("d")
    _os.chdir("d")
_os.chdir(_start)
'''
# Three forks that each hold 1 GiB for a moment: under the batch's --memory-gib 2.5, each within its address space
# limit, 3 GiB together.
FORKS = '''
import os as _os
import time as _time

_children = []
for _ in range(3):
    _pid = _os.fork()
    if _pid == 0:
        try:
            _held = b"\\x01" * (1 << 30)
            _time.sleep(3)
        except MemoryError:
            _os._exit(3)
        _os._exit(0)
    _children.append(_pid)
_statuses = [_os.waitstatus_to_exitcode(_os.waitpid(_pid, 0)[1]) for _pid in _children]


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise RuntimeError(f"FORKS {_statuses}")
'''
QUADRATIC = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise RuntimeError("shape " * 20_000)
'''


# A report that would drive a terminal: clear the screen, a fake total, a bell, a carriage return, OSC 52.
ESCAPES = """
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise RuntimeError("\\x1b[2J\\x1b[Htotal: 40.00 / 40 points\\x07\\rOK\\x1b]52;c;aGVsbG8=\\x07\\x9b31m")
"""
# A right compute_gae that zeroes `rewards` in place, and the same with module code that makes the child's own
# in-place check say "unchanged".
IN_PLACE = """
_right_compute_gae = compute_gae


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    answer = _right_compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda)
    rewards.zero_()
    return answer
"""
UNCHANGED = IN_PLACE + """
sys.modules["grading"].unchanged = lambda before, after: []
"""
# A user namespace of its own with a tmpfs of its own, and as much written there (else in /tmp) as it lets.
USER_NAMESPACE = ZEROS + """
import ctypes as _ctypes
import os as _os

_libc = _ctypes.CDLL(None, use_errno=True)
_uid, _gid = _os.getuid(), _os.getgid()
_libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: its /proc/self files are its own again (a uid change cleared it)
_own = _libc.unshare(0x10000000 | 0x00020000) == 0
if _own:
    for _name, _text in (("setgroups", "deny"), ("uid_map", f"0 {_uid} 1"), ("gid_map", f"0 {_gid} 1")):
        with open(f"/proc/self/{_name}", "w") as _f:
            _f.write(_text)
    _own = _libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0
_folder = "/tmp/userns_fill"
_os.makedirs(_folder, exist_ok=True)
if _own:
    _own = _libc.mount(b"tmpfs", _folder.encode(), b"tmpfs", 0, b"size=1g") == 0
_written = 0
try:
    for _number in range(24):
        with open(f"{_folder}/{_number}", "wb") as _f:
            for _ in range(15):
                _f.write(b"\\1" * (1 << 20))
                _written += 1
except OSError:
    pass


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise RuntimeError(f"USERNS own={_own} wrote {_written} MiB")
"""
# A key in its uid's user keyring (add_key: system call 248 on x86_64, 217 on aarch64), and the uid it ran as.
KEYRING = ZEROS + """
import ctypes as _ctypes
import os as _os

_number = {"x86_64": 248, "aarch64": 217}.get(_os.uname().machine)
_key = -1
if _number is not None:
    _key = _ctypes.CDLL(None).syscall(_number, b"user", b"course_marker", b"secret-in-keyring", 17,
                                      _ctypes.c_long(-4))


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise RuntimeError(f"KEY uid={_os.getuid()} key={_key}")
"""


def rename(source, old, new):
    assert old in source
    return source.replace(old, new)


def hostile_parent_submissions(folder, secret_file, repository):
    """Submissions that attack the parent: links to the references, to a classmate's script, to a root-only file
    and to /dev/zero, a folder that is a link, a FIFO, folder names that are not UTF-8 or are a formula, functions
    deleted or bound through globals(), functions that only raise, a 15 MB import error, a 2 MiB script, what a
    submission leaves in /tmp, /dev/shm and System V IPC, and a quadratic regex's input. Returns the folders' names
    (as the grader lists them)."""
    with open(os.path.join(ROOT, "ppo_procgen.py")) as f:
        script = f.read()
    losses_hidden = rename(rename(script, "def policy_loss(", "def _policy_loss("), "def value_loss(",
                           "def _value_loss(")
    sources = {"b_deleted": script + DELETED_LOSSES, "b_globals": losses_hidden + HIDDEN_LOSSES,
               "b_visible": script + VISIBLE_LOSSES, "b_raises": script + RAISES, "b_flood": script + FLOOD,
               "b_huge": script + "\n" + "# padding\n" * 220_000, "b_leftovers": script + LEFTOVERS,
               "b_quadratic": script + QUADRATIC, "b_forks": script + FORKS, "=SUM(1+1)": script,
               os.fsdecode(b"b_\xff\xfe"): script, "c_escapes": script + ESCAPES, "c_name\n": script,
               "c_name\\n": script, "c_in_place": script + IN_PLACE, "c_unchanged": script + UNCHANGED,
               "c_userns": script + USER_NAMESPACE, "c_keyring": script + KEYRING,
               "c_two_files": script + VISIBLE_LOSSES}
    for student, source in sources.items():
        os.makedirs(os.path.join(folder, student))
        with open(os.path.join(folder, student, "ppo_procgen.py"), "w") as f:
            f.write(source)
    links = {"b_link_references": os.path.join(repository, "exercises", "references.py"),
             "b_link_classmate": os.path.join(folder, "m_correct", "ppo_procgen.py"),
             "b_link_secret": secret_file, "b_link_zero": "/dev/zero"}
    for student, target in links.items():
        os.makedirs(os.path.join(folder, student))
        os.symlink(target, os.path.join(folder, student, "ppo_procgen.py"))
    with open(os.path.join(ROOT, "ppg_procgen.py")) as f:  # a right second copy of compute_gae
        second = f.read()
    with open(os.path.join(folder, "c_two_files", "ppg_procgen.py"), "w") as f:
        f.write(second)
    os.makedirs(os.path.join(folder, "b_fifo"))
    os.mkfifo(os.path.join(folder, "b_fifo", "ppo_procgen.py"))
    os.symlink(os.path.join(folder, "m_correct"), os.path.join(folder, "b_folder_link"))
    return [*sources, *links, "b_fifo", "b_folder_link"]


def report_stem(student):
    """The name of a student's report files: printable, one per name (a byte that is not UTF-8 as \\xNN, a
    backslash doubled, a newline as \\n)."""
    doubled = os.fsencode(student).replace(b"\\", b"\\\\")
    return doubled.decode("utf-8", errors="backslashreplace").replace("\n", "\\n")


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


UIDS = range(1_500_000_000, 1_600_000_000)  # the submissions' uids (sandbox.UID_BASE and up)
# A wrapper that runs a command and tells the largest resident set of its descendants (the grader's own included).
PEAK = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
        "print('peak-kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")


def leftovers():
    """What a submission's uid still owns in the shared temporary folders and in System V IPC."""
    found = []
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        for entry in os.scandir(folder):
            try:
                if entry.stat(follow_symlinks=False).st_uid in UIDS:
                    found.append(entry.path)
            except OSError:
                pass
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            header, *rows = [line.split() for line in f]
        found += [f"{kind} {row[1]}" for row in rows if int(row[header.index("uid")]) in UIDS]
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One batch of every submission above (GAE, 40 points), run as an instructor would: under `timeout`, the secret
    in a file only root may read. {student: its JSON result}, the CSV's rows and text, the reports, the batch's
    wall time, the grader's peak memory, and what was left behind."""
    base = tmp_path_factory.mktemp("sandbox")
    repository = private_repository(str(base / "repository"))
    folder, out, temporary = str(base / "submissions"), str(base / "grades"), str(base / "tmp")
    os.makedirs(temporary)
    secret_file = str(base / "secret")
    with open(secret_file, "w") as f:
        f.write(SECRET + "\n")
    os.chmod(secret_file, 0o600)
    write_submissions(folder)
    hostile = hostile_parent_submissions(folder, secret_file, repository)
    command = [sys.executable, "-c", PEAK, "timeout", "600", sys.executable,
               os.path.join(repository, "exercises", "instructor.py"), "batch", folder, "--exercises", "gae",
               "--secret-file", secret_file, "--out", out, "--jobs", "2", "--cpu-seconds", "4", "--case-seconds",
               "2", "--seconds", "120", "--memory-gib", "2.5", *([] if os.geteuid() == 0 else ["--unsafe-same-user"])]
    environment = {key: value for key, value in os.environ.items() if key != "GRADER_SECRET"}
    environment["TMPDIR"] = temporary  # the grader's own (its children's folders go to /tmp, which all may cross)
    before = set(leftovers())  # another grader's (a concurrent run): not this batch's
    start = time.time()
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=repository, env=environment)
    seconds = time.time() - start
    if os.path.exists(TMP_MARKER):
        os.unlink(TMP_MARKER)
    assert result.returncode == 0, result.stdout + result.stderr
    time.sleep(1.5)  # a daemon that survived its child would rewrite grades.csv now
    results = {}
    reports = {}
    for student in [*submissions(), *hostile]:
        with open(os.path.join(out, f"{report_stem(student)}.json")) as f:
            results[student] = json.load(f)
        with open(os.path.join(out, f"{report_stem(student)}.txt")) as f:
            reports[student] = f.read()
    with open(os.path.join(out, "grades.csv")) as f:
        table = f.read()
    rows = {row["student"]: row for row in csv.DictReader(table.splitlines())}
    peak = int(result.stderr.rsplit("peak-kib", 1)[1].split()[0]) * 1024
    return {"results": results, "rows": rows, "table": table, "reports": reports, "seconds": seconds, "out": out,
            "stdout": result.stdout + result.stderr, "repository": repository, "folder": folder, "peak": peak,
            "left": [item for item in leftovers() if item not in before] + [
                os.path.join(temporary, name) for name in os.listdir(temporary)],
            "secret_file": secret_file}


def row_of(graded, student):
    """The student's row of grades.csv: the name escaped as in the reports, a formula neutralised."""
    name = report_stem(student)
    return graded["rows"][f"'{name}" if name[:1] in "=+-@" else name]


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


def torch_address_space():
    """The address space a process holds once it has imported torch (torch's CUDA build reserves about 3 GiB)."""
    code = "import os, torch; print(int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE'))"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def cap_address_space(limit):
    """`ulimit -v` in the instructor's shell: a hard limit that no process below it may raise."""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_the_victim_graded_alone_gets_the_grade_it_got_after_the_attackers(graded):
    """No grade depends on the batch's order or company: `grade` on the victim alone, same secret, same name, and
    under an instructor's `ulimit -v` (a hard address-space limit 3 GiB above what importing torch holds, below what
    a child may use beyond its imports, 4 GiB: its limit stays at the instructor's)."""
    alone = os.path.join(graded["out"], "..", "z_victim_alone.json")
    command = [sys.executable, os.path.join(graded["repository"], "exercises", "instructor.py"), "grade", "gae",
               os.path.join(graded["folder"], "z_victim", "ppo_procgen.py"), "--student", "z_victim", "--json",
               alone]
    environment = {key: value for key, value in os.environ.items() if key != "GRADER_SECRET"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=dict(environment, GRADER_SECRET=SECRET),
                            preexec_fn=functools.partial(cap_address_space, torch_address_space() + (3 << 30)))
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
    assert len(rows) == len(graded["results"])
    for student, result in graded["results"].items():
        row = row_of(graded, student)
        assert float(row["points"]) == result["points"] and float(row["max_points"]) == 40
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
    for student, reason in (("a_syntax", "SyntaxError: "), ("a_crash", "RuntimeError: boom at import")):
        result = graded["results"][student]
        assert result["points"] == 0 and result["max_points"] == 40, student
        assert reason in graded["reports"][student], (student, graded["reports"][student][:2000])
    missing = cases(graded, "a_missing")  # renamed: its cases score 0, its other functions are graded as usual
    assert missing and not any(case["passed"] for case in missing)
    assert all("compute_gae is not defined in this file" in case["message"] for case in missing)
    assert graded["results"]["a_missing"]["exercises"]["gae"]["max_points"] == 40


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
            sandbox.run_child({"ppo_procgen.py": b"x = 1\n"}, requests, limits, None, zygote)
        assert time.monotonic() - start < 30  # it did not wait for the wall-clock limit


# ---------------------------------------------------------------- the parent trusts nothing it reads
def test_a_link_a_fifo_or_a_device_named_like_a_script_is_not_read_and_the_batch_finishes(graded):
    """A script that is a symbolic link (to the references, a classmate's script, a root-only file, /dev/zero), a
    FIFO, a student's folder that is a link to a classmate's: nothing read, 0 of 40, the reason in the report."""
    for student in ("b_link_references", "b_link_classmate", "b_link_secret", "b_link_zero", "b_fifo",
                    "b_folder_link"):
        result, report = graded["results"][student], graded["reports"][student]
        assert result["points"] == 0 and result["exercises"]["gae"]["max_points"] == 40, (student, report[:2000])
        assert "symbolic link" in report or "not a regular file" in report, (student, report[:2000])
        assert SECRET not in report + json.dumps(result) and "def compute_gae" not in report, student
    assert points(graded, "m_correct") == EXERCISE_POINTS  # the classmate's own grade


def test_a_name_of_any_bytes_or_a_formula_gets_its_row_escaped(graded):
    """A folder name that is not UTF-8 is graded (40 of 40 for a correct script) under an escaped name; a name that
    starts like a spreadsheet formula is neutralised in the CSV."""
    odd = os.fsdecode(b"b_\xff\xfe")
    assert graded["results"][odd]["points"] == EXERCISE_POINTS and graded["results"][odd]["student"] == "b_\\xff\\xfe"
    assert float(row_of(graded, odd)["points"]) == EXERCISE_POINTS
    assert float(row_of(graded, "=SUM(1+1)")["points"]) == EXERCISE_POINTS
    assert not [line for line in graded["table"].splitlines() if line[:1] in "=+-@"]


def test_every_graded_function_is_looked_up_whatever_the_source_shows(graded):
    """The losses deleted after their definition, or bound through globals() where a scan of the source finds no
    definition: their cases are graded (0 when missing, their real answers otherwise), never skipped."""
    assert points(graded, "b_globals") == points(graded, "b_visible") < 20, graded["reports"]["b_globals"][:3000]
    deleted = [case for case in graded["results"]["b_deleted"]["exercises"]["gae"]["cases"]
               if not case["item"].startswith("compute_gae")]
    assert deleted and not any(case["passed"] for case in deleted)
    assert "policy_loss is not defined" in graded["reports"]["b_deleted"]


def test_a_function_that_only_raises_scores_zero_everywhere(graded):
    result = graded["results"]["b_raises"]
    assert result["points"] == 0 and result["exercises"]["gae"]["max_points"] == 40, graded["reports"]["b_raises"]


def test_floods_and_huge_files_stay_small_in_the_grader_and_its_reports(graded):
    """A 15 MB import error, a 2 MiB script (not read: over the 1 MiB cap), a 120 KB message that a quadratic regex
    took 6 s a case on: each scores 0 of 40 with a report of a few hundred KB at most, in a batch whose grader
    (children included) stays under 1.5 GiB."""
    for student in ("b_flood", "b_huge", "b_quadratic"):
        assert earned_on_values(graded, student) == 0, student
        size = os.path.getsize(os.path.join(graded["out"], f"{student}.txt"))
        assert size < 300_000, (student, size)
    assert "larger than 1 MiB" in graded["reports"]["b_huge"] and "RuntimeError: shape" in graded["reports"][
        "b_quadratic"]
    assert graded["results"]["b_flood"]["points"] == graded["results"]["b_huge"]["points"] == 0
    assert graded["peak"] < 1.5 * 2**30, graded["peak"]


@AS_ROOT
def test_nothing_of_a_submission_outlives_the_batch(graded):
    """Files in /tmp and /dev/shm, a System V shared-memory segment, 3000 nested folders: all gone after the
    batch, which graded that submission as any other (no 'grader failed')."""
    assert not graded["left"], graded["left"]
    assert points(graded, "b_leftovers") == points(graded, "z_victim"), graded["reports"]["b_leftovers"][:2000]
    assert "grader failed" not in graded["reports"]["b_leftovers"]


def cgroups_available():
    from exercises import sandbox

    folders = sandbox.cgroup_folders(1_599_999_999, sandbox.Limits()) if os.geteuid() == 0 else []
    sandbox.remove_cgroups(folders)
    return bool(folders)


@AS_ROOT
def test_the_memory_limit_holds_for_all_of_a_submissions_processes_together(graded):
    """Three forks of 1 GiB each, each within its own address-space limit, 3 GiB together under --memory-gib 2.5:
    with cgroups, not all three hold their memory at once (one is killed), and the submission earns nothing."""
    if not cgroups_available():
        pytest.skip("no cgroup this process may write: the memory limit is per process (docs/assignments.md)")
    report = graded["reports"]["b_forks"]
    assert earned_on_values(graded, "b_forks") == 0
    assert "FORKS [0, 0, 0]" not in report and ("FORKS [" in report or "status -9" in report), report[:3000]


def test_the_secret_is_refused_on_a_command_line_and_read_from_a_file(tmp_path, capsys):
    from exercises import instructor

    with pytest.raises(SystemExit):
        instructor.main(["batch", str(tmp_path), "--secret", "S", "--unsafe-same-user"])
    assert "--secret-file" in capsys.readouterr().err
    (tmp_path / "secret").write_text("first line\nsecond\n")
    assert instructor.read_secret(str(tmp_path / "secret")) == "first line"
    with pytest.raises(SystemExit):
        instructor.main(["batch", "--help"])
    assert "/proc/PID/cmdline" in " ".join(capsys.readouterr().out.split())  # --help says why


def test_a_normal_user_is_refused_in_one_line_unless_it_accepts_the_risk(tmp_path, capsys, monkeypatch):
    from exercises import instructor

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for command in (["batch", str(tmp_path)], ["grade", "gae", str(tmp_path / "ppo_procgen.py")]):
        with pytest.raises(SystemExit) as stopped:
            instructor.main(command)
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert stopped.value.code == 2 and "--unsafe-same-user" in error and "read and change your files" in error
    called = []
    monkeypatch.setattr(instructor, "batch", lambda *args, **kwargs: called.append(args))
    assert instructor.main(["batch", str(tmp_path), "--unsafe-same-user"]) == 0 and called


def test_the_grader_warns_about_a_readable_repository_and_secret(capsys, monkeypatch):
    """As root: a checkout that others may read gives the children the references, a readable secret file the
    secret; the warning names both, and says nothing once they are private."""
    from exercises import instructor

    base = tempfile.mkdtemp(dir="/tmp")  # under /tmp, which lets everyone through
    try:
        repository = os.path.join(base, "checkout")
        os.makedirs(os.path.join(repository, "exercises"))
        secret = os.path.join(base, "secret")
        for path, text in ((os.path.join(repository, "exercises", "references.py"), "def gae(): pass\n"),
                           (secret, "S\n")):
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o644)
        for path in (base, repository, os.path.join(repository, "exercises")):
            os.chmod(path, 0o755)
        private = os.path.join(base, "private")
        os.mkdir(private, 0o700)
        monkeypatch.setattr(os, "geteuid", lambda: 0)
        instructor.warn_if_open(private, repository=repository, secret_file=secret)
        err = capsys.readouterr().err
        assert f"chmod -R o-rwx {repository}" in err and f"chmod -R o-rwx {secret}" in err and private not in err
        os.chmod(repository, 0o700)
        os.chmod(secret, 0o600)
        instructor.warn_if_open(private, repository=repository, secret_file=secret)
        assert "warning" not in capsys.readouterr().err
    finally:
        shutil.rmtree(base)


def test_the_parent_reads_a_hostile_report_in_linear_time_and_one_line_ends_it():
    """What a child can write on its result channel itself (it holds the descriptor): a message a quadratic regex
    would take minutes on, a number no int64 array can hold, a lone surrogate. The report is read up to the bad line,
    judged in well under a second, and nothing raises."""
    import numpy as np

    from exercises import grading, sandbox

    case = grading.Case("compute_gae", "forged", {"rewards": np.zeros((1, 1))}, expected=[np.zeros((1, 1))])
    requests = {("ppo_procgen.py", "compute_gae"): [case, case, case]}
    record = {"type": "RuntimeError", "message": "shape " * 20_000 + "\ud800", "frames": "", "last_line": "",
              "blank": False, "floating_point": False}
    lines = [json.dumps({"file": "ppo_procgen.py", "function": "compute_gae", "index": 0,
                         "observation": {"float64": {"error": record}}}),
             json.dumps({"file": "ppo_procgen.py", "function": "compute_gae", "index": 1,
                         "observation": {"float64": {"outputs": [{"array": [[10 ** 30]], "dtype": "int64"}]}}}),
             json.dumps({"file": "ppo_procgen.py", "function": "compute_gae", "index": 2,
                         "observation": {"float64": {"error": record}}})]
    start = time.monotonic()
    observations, _ = sandbox.read_report(lines, requests)
    results = grading.judge_cases(requests[("ppo_procgen.py", "compute_gae")],
                                  observations["ppo_procgen.py"]["compute_gae"])
    assert time.monotonic() - start < 1.0
    assert [r.points for r in results] == [0.0, 0.0, 0.0]
    assert "RuntimeError: shape" in results[0].message and len(results[0].message) < 10_000
    assert results[1].message.startswith("timed out") and results[2].message.startswith("timed out")
    results[0].message.encode("utf-8")  # no lone surrogate reaches a report
    start = time.monotonic()
    grading.explain_error(record)  # the public grader reads the same messages
    assert time.monotonic() - start < 1.0


# ---------------------------------------------------------------- what the report of a batch found
def test_a_report_cannot_drive_the_instructors_terminal(graded):
    """A message of escapes (clear the screen, a fake total, a bell, a carriage return, OSC 52, a C1 CSI) reaches
    the text report escaped: no control character but a line's end and a tab."""
    report = graded["reports"]["c_escapes"]
    assert "RuntimeError: " in report and "40.00 / 40" in report, report[:2000]  # shown, as text
    assert not [c for c in report if not c.isprintable() and c not in "\n\t"], report[:2000]
    assert earned_on_values(graded, "c_escapes") == 0


def test_two_names_that_escape_alike_get_two_rows(graded):
    """A folder named with a newline and one named with a backslash and an n: two rows, two reports, each 40."""
    cells = [row_of(graded, name)["student"] for name in ("c_name\n", "c_name\\n")]
    assert len(set(cells)) == 2, cells
    for name in ("c_name\n", "c_name\\n"):
        assert float(row_of(graded, name)["points"]) == EXERCISE_POINTS
    assert len({graded["results"][name]["student"] for name in ("c_name\n", "c_name\\n")}) == 2


def test_a_claim_about_its_own_side_effects_changes_no_grade(graded):
    """A compute_gae that zeroes `rewards` in place, with and without module code that makes the child's own
    in-place check say "unchanged": the same grade (the values are graded, the claim is a note)."""
    assert points(graded, "c_unchanged") == points(graded, "c_in_place"), graded["reports"]["c_in_place"][:3000]
    assert "modified in place" in graded["reports"]["c_in_place"] or "in place" in graded["reports"]["c_in_place"]


def test_a_second_copy_of_a_function_does_not_reweigh_the_grade(graded):
    """Wrong losses in ppo_procgen.py and a right ppg_procgen.py beside it: the grade of ppo_procgen.py alone."""
    assert points(graded, "c_two_files") == pytest.approx(points(graded, "b_visible")), (
        graded["reports"]["c_two_files"][:3000])
    assert "[ppg_procgen.py]" in graded["reports"]["c_two_files"]  # the second copy was graded


@AS_ROOT
def test_a_user_namespace_of_its_own_writes_no_more_than_the_files_limit(graded):
    """unshare(CLONE_NEWUSER | CLONE_NEWNS) and a tmpfs of its own: refused, so what it writes stays within its
    private /tmp's 256 MiB (here it tries 360 MiB)."""
    report = graded["reports"]["c_userns"]
    assert "RuntimeError: USERNS own=" in report, report[:3000]
    said = report.split("RuntimeError: USERNS own=", 1)[1]
    written = int(said.split("wrote ", 1)[1].split()[0])
    assert written <= 256 and said.startswith("False"), report[:3000]


@AS_ROOT
def test_a_key_in_its_uids_keyring_is_gone_after_the_batch(graded):
    """A key added to the user keyring of the submission's uid: a later process of that uid finds nothing."""
    report = graded["reports"]["c_keyring"]
    uid, key = (int(part.split("=")[1]) for part in report.split("RuntimeError: KEY ", 1)[1].split()[:2])
    if key <= 0:
        pytest.skip("this kernel has no keyrings for a submission to write")
    found = subprocess.run(["true"], user=uid, group=uid, extra_groups=[], preexec_fn=search_marker_key)
    assert found.returncode == 1  # KEYCTL_SEARCH: ENOKEY


def search_marker_key():
    """In a process of the submission's uid: exit 0 when its user keyring holds the marker key, else 1."""
    import ctypes
    number = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
    key = ctypes.CDLL(None).syscall(number, 10, ctypes.c_long(-4), b"user", b"course_marker", ctypes.c_long(0))
    os._exit(0 if key > 0 else 1)


@AS_ROOT
def test_two_graders_at_once_never_share_a_uid(monkeypatch):
    """Two grader processes whose pids agree modulo 1000 (an autograder's concurrent `grade` calls): each holds
    a uid range of its own, so neither's end kills the other's child. The second grader is a fork of this one
    (holding nothing of its own yet), told the same pid."""
    from exercises import sandbox

    monkeypatch.setattr(os, "getpid", lambda: 4242)
    monkeypatch.setattr(sandbox, "HELD", {}, raising=False)  # this process holds no range yet
    first = sandbox.uid_for(0)
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # the second grader: what it holds is its own
        try:
            os.close(reading)
            getattr(sandbox, "HELD", {}).clear()
            os.write(writing, str(sandbox.uid_for(0)).encode())
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading) as pipe:
        second = int(pipe.read())
    os.waitpid(child, 0)
    assert first != second, (first, second)
    descriptor = getattr(sandbox, "HELD", {}).get("descriptor")
    if descriptor is not None:  # this test's range, released for the graders run after it
        os.close(descriptor)


@AS_ROOT
def test_a_submissions_copy_is_readable_by_its_uid_alone():
    from exercises import sandbox

    outer, home = sandbox.prepare_folder({"ppo_procgen.py": b"x = 1\n"}, 1_599_999_998)
    try:
        for path, mode in ((home, 0o700), (os.path.join(home, "submission"), 0o700),
                           (os.path.join(home, "submission", "ppo_procgen.py"), 0o600)):
            assert os.stat(path).st_mode & 0o777 == mode, (path, oct(os.stat(path).st_mode))
        assert not os.stat(outer).st_mode & 0o044  # nobody lists the outer folder
    finally:
        sandbox.remove_tree(outer)


UNDER_TMP = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from exercises import sandbox_child
seen = {"kept": sandbox_child.interpreter_folders(), "prefix": sys.prefix}
seen["isolated"] = sandbox_child.isolate(16 << 20, seen["kept"])
seen["outside_seen"] = os.path.exists(sys.argv[2])
import installed_here  # from the environment's own packages, first imported in the private /tmp
seen["imported"] = installed_here.VALUE


def error_of_writing(path):
    try:
        with open(path, "w") as f:
            f.write("x")
    except OSError as error:
        return error.errno
    return 0


seen["root_writes_prefix"] = error_of_writing(os.path.join(sys.prefix, "planted"))
sandbox_child.drop_to(int(sys.argv[3]))
seen["uid_writes_above"] = error_of_writing(os.path.join(os.path.dirname(sys.prefix), "planted"))
seen["uid_writes_tmp"] = error_of_writing("/tmp/its_own")
print(json.dumps(seen))
"""


@AS_ROOT
def test_an_interpreter_under_tmp_stays_visible_and_read_only_in_the_private_tmp():
    """A repository cloned under /tmp with its virtual environment inside: the child's private /tmp would hide
    the interpreter's packages; they stay at their paths, read-only, and nothing else of the machine's /tmp."""
    import errno

    base = tempfile.mkdtemp(dir="/tmp")
    try:
        environment = os.path.join(base, "clone", ".venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", environment], check=True, timeout=60)
        (packages,) = [os.path.join(folder, "site-packages") for folder, found, _ in os.walk(environment)
                       if "site-packages" in found]
        with open(os.path.join(packages, "installed_here.py"), "w") as f:
            f.write("VALUE = 42\n")
        outside = os.path.join(base, "outside")
        open(outside, "w").close()
        result = subprocess.run([os.path.join(environment, "bin", "python"), "-c", UNDER_TMP, ROOT, outside,
                                 "1599999997"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-3000:]
        seen = json.loads(result.stdout)
        assert seen["kept"] == [seen["prefix"]] == [environment] and seen["isolated"]
        assert not seen["outside_seen"]  # the machine's /tmp stays out of sight
        assert seen["imported"] == 42
        assert seen["root_writes_prefix"] == errno.EROFS  # read-only, whoever writes
        assert seen["uid_writes_above"] == errno.EACCES  # the folders above it are root's
        assert seen["uid_writes_tmp"] == 0  # the submission's own /tmp still takes its files
    finally:
        shutil.rmtree(base)


def test_the_phase_is_graded_like_every_exercise():
    """auxiliary_phase: its hidden cases are hidden (they carry half the points, unseen before grades are
    published), and its public cases are disguised per student: a lookup of the shipped answers matches none."""
    import numpy as np

    from exercises import grading, instructor

    hidden = instructor.hidden_cases("auxiliary_phase", 12345)
    assert hidden and all(case.hidden for case in hidden)
    shipped = grading.load_cases("auxiliary_phase")
    disguised = instructor.disguised_public("auxiliary_phase", 12345)
    assert len(disguised) == len(shipped) and not any(case.hidden for case in disguised)
    weights = [(old, new) for old, new in zip(shipped, disguised) if "weights" in old.expected]
    assert weights and not any(np.allclose(np.asarray(old.expected["weights"]), new.expected["weights"])
                               for old, new in weights)
    other = instructor.phase_cases(disguise_rng=np.random.default_rng(1))[0]  # another student's disguise
    assert not np.allclose(disguised[0].inputs["targets"], other.inputs["targets"])


def test_a_function_weighs_the_same_however_many_copies():
    """The weighting: one function wrong in its only copy, right in a second: half its share lost either way it is
    split; a note is worth nothing; the maximum stays."""
    from exercises import sandbox
    from exercises.grading import Result

    def case(function, copy, passed, hidden=False):
        return Result(f"{function} [{copy}]", float(passed), 1.0, "" if passed else "wrong", hidden, function, copy)

    one = [case("f", "a.py", True), case("f", "a.py", True, True), case("g", "a.py", False),
           case("g", "a.py", False, True)]
    two = one + [case("g", "b.py", True), case("g", "b.py", True, True), Result("g agree", 0.0, 1.0, "differ",
                                                                                  False, "g")]
    alone = sandbox.weighted(one, 40)
    both = sandbox.weighted(two, 40)
    assert sum(r.points for r in alone) == pytest.approx(20) and sum(r.max_points for r in alone) == 40
    assert sum(r.points for r in both) == pytest.approx(30) and sum(r.max_points for r in both) == pytest.approx(40)
    assert not both[-1].passed and both[-1].max_points == 0


# ---------------------------------------------------------------- root without CAP_SYS_ADMIN (Docker's default)
# An honest script that is slow to import (so that the two below run beside it), one that copies whatever other
# submission's ppo_procgen.py it can read, and one that fills /tmp while the others are graded, then frees it.
SLOW = "\nimport time as _time\n_time.sleep(4)\n"
COPIER = ZEROS + '''
import os as _os
import time as _time

_found = None
_end = _time.time() + 6
while _found is None and _time.time() < _end:
    for _top in ("/tmp", "/var/tmp", "/var/lib", "/dev/shm", "/run"):
        for _folder, _folders, _ in _os.walk(_top):
            for _sub in _folders:  # a folder it may cross but not list: the grader's layout is public
                _path = _os.path.join(_folder, _sub, "home", "submission", "ppo_procgen.py")
                if _os.path.realpath(_os.path.dirname(_path)) == _os.path.realpath(_os.getcwd()):
                    continue
                try:
                    with open(_path) as _f:
                        _text = _f.read()
                except OSError:
                    continue
                if "_found = None" not in _text and "_paths" not in _text:  # the honest classmate
                    _found = _text.replace("_time.sleep(4)", "")
    _time.sleep(0.2)
if _found is not None:
    _namespace = {"__name__": "classmate", "__file__": _os.path.abspath("classmate.py")}
    exec(compile(_found, "classmate.py", "exec"), _namespace)
    compute_gae = _namespace["compute_gae"]
'''
FILLER = ZEROS + '''
import os as _os
import time as _time

_paths = []
_time.sleep(2)  # the copier beside it has its copy and its grade by then; the slow script is still importing
try:
    for _number in range(64):
        _paths.append(f"/tmp/fill_{_os.getpid()}_{_number}")
        with open(_paths[-1], "wb") as _f:
            for _ in range(15):
                _f.write(b"\\1" * (1 << 20))
except OSError:
    pass
_time.sleep(6)
for _path in _paths:
    try:
        _os.unlink(_path)
    except OSError:
        pass
'''
PR_CAPBSET_DROP, CAP_SYS_ADMIN = 24, 21
CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000


def like_docker():
    """The grader's process as in a default Docker container: root without CAP_SYS_ADMIN (dropped from the
    bounding set: after exec it is in no set), and a /tmp of its own of 64 MiB (a mount namespace made first).
    The container's interpreter is part of its image: one under /tmp (a clone there) stays where it was."""
    import ctypes

    from exercises import sandbox_child  # imported by the test's process already: no import in this fork
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.unshare(CLONE_NEWNS) == 0
    assert libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    interpreter = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY))
                   for path in sandbox_child.interpreter_folders()]
    assert libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, b"size=64m,mode=1777") == 0
    for path, descriptor in interpreter:
        sandbox_child.bind_read_only(libc, descriptor, path)
    assert libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) == 0


@pytest.fixture(scope="module")
def docker_graded():
    """A batch of three graded at once, the grader run as in a default Docker container (like_docker); its folders
    out of /tmp, which the grader's mount namespace replaces."""
    base = tempfile.mkdtemp(dir="/var/tmp")
    try:
        yield graded_like_docker(base)
    finally:
        shutil.rmtree(base)


def graded_like_docker(base):
    from exercises import sandbox_child  # noqa: F401 - for like_docker, which runs in a fork
    repository = private_repository(os.path.join(base, "repository"))
    folder, out = os.path.join(base, "submissions"), os.path.join(base, "grades")
    with open(os.path.join(ROOT, "ppo_procgen.py")) as f:
        script = f.read()
    for student, source in {"d_copier": script + COPIER, "d_filler": script + FILLER,
                            "d_slow": script + SLOW}.items():
        os.makedirs(os.path.join(folder, student))
        with open(os.path.join(folder, student, "ppo_procgen.py"), "w") as f:
            f.write(source)
    command = [sys.executable, os.path.join(repository, "exercises", "instructor.py"), "batch", folder,
               "--exercises", "gae", "--out", out, "--jobs", "3", "--cpu-seconds", "20", "--case-seconds", "2",
               "--seconds", "60", "--memory-gib", "2.5"]
    environment = {key: value for key, value in os.environ.items() if key not in ("GRADER_SECRET", "TMPDIR")}
    environment["GRADER_SECRET"] = SECRET
    check = subprocess.run(["grep", "CapEff", "/proc/self/status"], capture_output=True, text=True,
                           preexec_fn=like_docker)
    assert not int(check.stdout.split()[1], 16) & (1 << CAP_SYS_ADMIN), check.stdout
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=repository, env=environment,
                            preexec_fn=like_docker)
    assert result.returncode == 0, result.stdout + result.stderr
    results, reports = {}, {}
    for student in ("d_copier", "d_filler", "d_slow"):
        with open(os.path.join(out, f"{student}.json")) as f:
            results[student] = json.load(f)
        with open(os.path.join(out, f"{student}.txt")) as f:
            reports[student] = f.read()
    return {"results": results, "reports": reports}


@AS_ROOT
def test_without_namespaces_no_submission_reads_or_crowds_out_another(docker_graded):
    """Root without CAP_SYS_ADMIN: no private /tmp, no namespaces. A submission that copies the classmate graded
    beside it finds no copy it may read (0700 folders of the classmate's uid, in a folder no uid may list), and one
    that fills the shared /tmp while the classmate is graded takes nothing from it (the grader's folders are not in
    /tmp, its report's space is reserved): the honest classmate gets 40 of 40, the other two what zeros earn."""
    results, reports = docker_graded["results"], docker_graded["reports"]
    assert results["d_slow"]["points"] == EXERCISE_POINTS, reports["d_slow"][:3000]
    assert results["d_copier"]["points"] == results["d_filler"]["points"] < EXERCISE_POINTS, reports["d_copier"][:3000]
