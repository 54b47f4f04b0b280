"""The instructor's sandbox: each submission runs in a child process of its own, which only computes; this process
(the parent) decides every point.

  parent: draws the cases, computes the expected outputs with the references, sends the child the INPUTS only
  zygote: one per batch: a fresh interpreter (python -I -B) in an empty temporary folder holding the public engine
          (exercises/sandbox_child.py, grading.py, texts.py) and nothing else; no repository on its sys.path, no
          secret in its argv, environment or files; it imports the standard library, torch, gymnasium, tyro and
          the engine, as root, and then only forks: it never runs a student's code nor holds a case or a grade
  child:  per submission, a fork of that pristine zygote (a copy of a freshly started interpreter that never saw
          the references, the secret or another submission) in a temporary folder holding a copy of the
          submission; as root, a uid of its own (no access to the instructor's files, no signal to other
          processes, the zygote included); limits on wall clock, CPU time, memory, file size and processes
  back:   one JSON line per observed case (outputs as arrays, dtypes, devices, errors): data, never code; the parent
          checks their type and shape and judges them (grading.judge_exercise). A case the child never reported
          (killed at a limit, crashed) scores 0: "timed out".

What a process sandbox does not do (docs/assignments.md): it is not a container. The child can read every file
that its uid may read (with a uid of its own: every world-readable file, the references' source among them,
unless the repository is private), use the network, and claim anything about its own function in its report (a dtype, a
step count): only values it could not compute without solving the exercise are out of its reach."""
import ast
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from exercises import grading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD_FILES = ("sandbox_child.py", "grading.py", "texts.py")
SCRIPTS = ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py")
UID_BASE = 1_500_000_000  # as root, submission i of grader process p runs as UID_BASE + (p % 1000) * 100000 + i
ARRAY_DTYPES = {"float64", "float32", "int64", "int32", "bool"}  # what an array from the child may be


@dataclasses.dataclass
class Limits:
    """What one submission's child may use; a case it did not finish within them scores 0."""
    seconds: float = 120.0  # wall clock of the whole child (start-up, imports, every case)
    cpu_seconds: int = 90  # its CPU time (RLIMIT_CPU)
    memory_bytes: int = 4 << 30  # its address space (RLIMIT_AS); importing torch reserves ~0.6 GiB of it
    output_bytes: int = 16 << 20  # each file it writes, its results and stderr included (RLIMIT_FSIZE)
    processes: int = 64  # processes and threads of its uid (RLIMIT_NPROC; only as root, with a uid of its own)
    case_seconds: float = 10.0  # a function that runs past this on one case is not run on its later cases


# ---------------------------------------------------------------- what a file defines, read without running it
def top_level_names(statements):
    """The names a module's statements bind at top level (also inside if/try/with blocks), without running it."""
    names = set()
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        for block in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names |= top_level_names(getattr(node, block, []))
    return names


def read_submission(files):
    """{file: names it defines} and {file: why it does not import} for the syntax errors. A file that does not
    parse is taken to define what the repository's script of that name defines, so that its cases are all scored
    (0, with the reason): the same maximum whatever the failure."""
    defined, broken = {}, {}
    for path in files:
        name = os.path.basename(path)
        with open(path, errors="replace") as f:
            source = f.read()
        try:
            defined[name] = top_level_names(ast.parse(source, name).body)
        except SyntaxError as error:
            broken[name] = f"{name} does not import: SyntaxError at line {error.lineno}: {error.msg}"
            with open(os.path.join(ROOT, name)) as f:
                defined[name] = set(grading.ALL_FUNCTIONS) & top_level_names(ast.parse(f.read()).body)
    return defined, broken


# ---------------------------------------------------------------- the child process
SIDE_EFFECTS = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "tkinter", "webbrowser"}


def imported_modules(statements):
    """The modules that import statements name (top-level absolute imports, anywhere in the file)."""
    names = set()
    for node in ast.walk(ast.Module(body=list(statements), type_ignores=[])):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def preload_list(files):
    """What the child imports before it drops to its uid (sandbox_child.preload): the standard library's modules
    that this process has loaded or that the submission imports, and the modules that the repository's four
    scripts import (torch, gymnasium, tyro, ...): installed code, never the student's."""
    wanted = {name for name in sys.modules if name.split(".")[0] in sys.stdlib_module_names}
    for name in SCRIPTS:
        with open(os.path.join(ROOT, name)) as f:
            wanted |= imported_modules(ast.parse(f.read()).body)
    for path in files:
        try:
            with open(path, errors="replace") as f:
                imports = imported_modules(ast.parse(f.read()).body)
        except SyntaxError:
            continue
        wanted |= {name for name in imports if name.split(".")[0] in sys.stdlib_module_names}
    return sorted(name for name in wanted if name.split(".")[0] not in SIDE_EFFECTS and not name.startswith("_")
                  and name != "__main__")


def child_request(files, requests, limits, uid, preload):
    """What the child reads (results/request.json): file names, limits, each (file, function)'s cases as INPUTS only."""
    return {"files": files, "case_seconds": limits.case_seconds, "uid": uid, "preload": preload,
            "limits": {"memory_bytes": limits.memory_bytes, "output_bytes": limits.output_bytes,
                       "cpu_seconds": limits.cpu_seconds, "processes": limits.processes if uid is not None else None},
            "requests": [{"file": file, "function": function,
                          "cases": [{"function": case.function, "name": case.name, "kind": case.kind,
                                     "inputs": grading.encode(case.inputs), "grads": list(case.grads)}
                                    for case in cases]}
                         for (file, function), cases in requests.items()]}


def prepare_folder(files, uid):
    """A fresh folder for one submission: submission/ (copies of the student's files), nothing else; as root,
    owned by the child's uid and closed to everyone else."""
    folder = tempfile.mkdtemp(prefix="sandbox_")
    os.makedirs(os.path.join(folder, "submission"))
    for path in files:
        shutil.copy(path, os.path.join(folder, "submission", os.path.basename(path)))
    if uid is not None:
        for directory, _, names in os.walk(folder):
            os.chown(directory, uid, uid)
            for name in names:
                os.chown(os.path.join(directory, name), uid, uid)
    return folder


def engine_folder():
    """The zygote's folder: grader/ with the public engine only (what the students' bundle holds), readable by
    all (the children, under their own uids, read its sources for their tracebacks), writable by this user only."""
    folder = tempfile.mkdtemp(prefix="sandbox_zygote_")
    os.makedirs(os.path.join(folder, "grader"))
    for name in CHILD_FILES:
        shutil.copy(os.path.join(HERE, name), os.path.join(folder, "grader", name))
        os.chmod(os.path.join(folder, "grader", name), 0o644)
    os.chmod(os.path.join(folder, "grader"), 0o755)
    os.chmod(folder, 0o755)
    return folder


def child_environment(folder):
    """A minimal environment: no secret, no PYTHONPATH, one thread (the cases are tiny)."""
    return {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


def kill_all_of(uid, group):
    """Stop the child's process group, and (with a uid of its own) every process of that uid: a fork that left
    the group (setsid) is gone too."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[], capture_output=True, timeout=30)


class ZygoteError(RuntimeError):
    """The zygote ended or stopped answering: no submission can be graded with it."""


class Zygote:
    """One pristine interpreter per batch that forks a child per submission (exercises/sandbox_child.py): it
    imports the standard library, the scripts' imports and the public engine once, as a fresh child did, and
    never runs a student's code nor sees a case's answer, the secret or a grade. Use it as a context manager;
    jobs may be started from several threads at once."""

    def __init__(self, files=()):
        self.folder = engine_folder()
        self.private = tempfile.mkdtemp(prefix="sandbox_zygote_err_")
        self.events = {}  # job number -> {"pid": p, "returncode": r} as the zygote reports them
        self.ended = None  # why the zygote is gone, once it is
        self.condition = threading.Condition()
        self.writing = threading.Lock()  # not the condition: a write that waits must not hold up the reader
        self.numbers = itertools.count()
        self.stderr = open(os.path.join(self.private, "err"), "w+b")
        self.process = subprocess.Popen([sys.executable, "-I", "-B", os.path.join(self.folder, "grader",
                                                                              "sandbox_child.py")],
                                        cwd=self.folder, env=child_environment(self.folder), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.stderr, start_new_session=True,
                                        close_fds=True)
        self.reader = threading.Thread(target=self.read_events, daemon=True)
        self.reader.start()
        self.send({"preload": preload_list(files)})

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def send(self, message):
        """One line to the zygote; ZygoteError when it is gone."""
        with self.writing:
            try:
                self.process.stdin.write((json.dumps(message) + "\n").encode())
                self.process.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                raise ZygoteError(f"the sandbox's zygote process is gone ({self.why_ended()})") from None

    def read_events(self):
        """The reader thread: record each pid and exit status the zygote reports; at its end, wake every waiter."""
        for line in self.process.stdout:
            try:
                message = json.loads(line)
                job = message["job"]
            except (ValueError, KeyError, TypeError):
                continue  # its "ready" line
            with self.condition:
                self.events.setdefault(job, {}).update(message)
                self.condition.notify_all()
        self.process.wait()
        with self.condition:
            self.ended = self.why_ended()
            self.condition.notify_all()

    def why_ended(self):
        """The zygote's exit status and the last line of its stderr."""
        self.stderr.flush()
        with open(os.path.join(self.private, "err"), "rb") as f:
            tail = f.read()[-2000:].decode("utf-8", errors="replace").strip().splitlines()
        status = self.process.poll()
        last = f": {tail[-1]}" if tail else ""
        return f"status {status}{last}" if status is not None else f"still running{last}"

    def start(self, folder, results):
        """Ask for a child on `folder` (results/request.json holds its request); returns the job's number."""
        number = next(self.numbers)
        self.send({"job": number, "folder": folder, "results": results})
        return number

    def wait_for(self, number, key, deadline):
        """The job's `key` ("pid" or "returncode") once reported, or None at `deadline` (time.monotonic()).
        ZygoteError when the zygote ended without reporting it."""
        with self.condition:
            while key not in self.events.get(number, {}):
                if self.ended is not None:
                    raise ZygoteError(f"the sandbox's zygote process ended ({self.ended})")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.condition.wait(left)
            return self.events[number][key]

    def forget(self, number):
        """Drop a finished job's events."""
        with self.condition:
            self.events.pop(number, None)

    def close(self):
        """End the zygote (it exits once its input ends and its children are reaped) and remove its folders."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.reader.join(timeout=30)
        self.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.rmtree(self.private, ignore_errors=True)


def run_child(files, requests, limits, uid, zygote):
    """Run one submission's child, forked by `zygote`; returns (its JSON lines, how it ended: "ok", "timed out", or
    the last line of its stderr). The results come through a file in a folder only this user may open, read after
    the child has ended."""
    folder = prepare_folder(files, uid)
    private = tempfile.mkdtemp(prefix="sandbox_results_")  # root's own: the child opens its files before dropping
    try:
        request = child_request([os.path.basename(f) for f in files], requests, limits, uid, preload_list(files))
        with open(os.path.join(private, "request.json"), "w") as f:
            json.dump(request, f, allow_nan=True)
        deadline = time.monotonic() + limits.seconds
        number = zygote.start(folder, private)
        try:
            pid = zygote.wait_for(number, "pid", deadline)
            if pid is None:
                raise ZygoteError(f"the sandbox's zygote did not fork a child within {limits.seconds:g} s")
            returncode = zygote.wait_for(number, "returncode", deadline)
            ended = "ok"
            if returncode is None:
                ended = "timed out"
                kill_all_of(uid, pid)
                returncode = zygote.wait_for(number, "returncode", time.monotonic() + 30)
            kill_all_of(uid, pid)
        finally:
            zygote.forget(number)
        lines = read_file(os.path.join(private, "out"), limits.output_bytes).splitlines()
        tail = read_file(os.path.join(private, "err"), None)[-4000:].strip().splitlines()
        if ended == "ok" and returncode == -signal.SIGXCPU:
            ended = "timed out (its CPU time limit)"
        elif ended == "ok" and returncode != 0:
            ended = tail[-1] if tail else f"the process ended with status {returncode}"
        return lines, ended
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def read_file(path, size):
    """Up to `size` bytes of a file the child wrote (all of it for None), as text; '' when it never opened it."""
    try:
        with open(path, "rb") as f:
            return f.read(-1 if size is None else size).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------- reading the child's report as data
def plain(value):
    """A decoded JSON value with its arrays as numpy arrays of a plain numeric dtype; ValueError otherwise."""
    if isinstance(value, dict) and set(value) == {"array", "dtype"}:
        if value["dtype"] not in ARRAY_DTYPES:
            raise ValueError(f"an array of dtype {value['dtype']!r:.40}")
        return np.array(value["array"], dtype=value["dtype"])
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"a {type(value).__name__}")


UNREADABLE = {"check_error": {"type": "ValueError", "message": "the submission's process sent an answer the grader "
                              "cannot read", "frames": "", "last_line": "", "blank": False, "floating_point": False}}


RECORD = {"type": str, "message": str, "frames": str, "last_line": str, "blank": bool, "floating_point": bool}
CALL = {"outputs": "arrays", "dtypes": "strings", "devices": "strings", "changed": "strings", "failed": str,
        "error": RECORD, "requires_grad": bool, "grad_error": RECORD, "grads": "arrays or None"}
OBSERVATION = {"float64": CALL, "grad": CALL, "float32": CALL, "meta": CALL, "cuda": CALL, "missing": bool,
               "not_run": (int, float), "out_of_time": (int, float), "check_error": RECORD, "failed": str,
               "error": RECORD, "stats": "numbers or None", "stats_repr": str, "steps": "integers",
               "calls": "lists of numbers", "initial": "array", "weights": "array"}


def well_formed(value, schema):
    """True when `value` has the types `schema` says (a dict of keys to types, or one of the names below): the
    judge reads only observations whose every field is what an honest child sends."""
    if isinstance(schema, dict):
        return isinstance(value, dict) and all(key in schema and well_formed(item, schema[key])
                                               for key, item in value.items())
    if schema == "array":
        return isinstance(value, np.ndarray) and value.dtype.kind in "fiub"
    if schema == "arrays":
        return isinstance(value, list) and all(well_formed(item, "array") for item in value)
    if schema == "arrays or None":
        return isinstance(value, list) and all(item is None or well_formed(item, "array") for item in value)
    if schema == "strings":
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if schema == "integers":
        return isinstance(value, list) and all(type(item) is int for item in value)
    if schema == "lists of numbers":
        return isinstance(value, list) and all(isinstance(item, list) and all(
            isinstance(number, (int, float)) for number in item) for item in value)
    if schema == "numbers or None":
        return value is None or (isinstance(value, dict) and all(isinstance(item, (int, float))
                                                                 for item in value.values()))
    return isinstance(value, schema) and not (schema in (int, float, (int, float)) and isinstance(value, bool))


def read_report(lines, requests):
    """The child's lines -> ({file: {function: [observation or None per case]}}, {file: import error record}).
    Only what was asked is kept; a malformed line ends the report (what came before it stands)."""
    observations = {file: {} for file, _ in requests}
    for (file, function), cases in requests.items():
        observations[file][function] = [None] * len(cases)
    import_errors = {}
    for line in lines:
        try:
            message = plain(json.loads(line))
        except (ValueError, RecursionError):
            break
        if not isinstance(message, dict):
            break
        file, function, index = message.get("file"), message.get("function"), message.get("index")
        if not (isinstance(file, str) and isinstance(function, (str, type(None)))):
            break
        if well_formed(message.get("import_error"), RECORD):
            import_errors.setdefault(file, message["import_error"])
        slot = observations.get(file, {}).get(function)
        if slot is None or type(index) is not int or not 0 <= index < len(slot) or slot[index] is not None:
            continue
        observed = message.get("observation")
        slot[index] = observed if well_formed(observed, OBSERVATION) else UNREADABLE
    return observations, import_errors


def import_failure(record):
    """Why a file did not import, for the report: the last line of its traceback, with the student's frames."""
    return grading.explain_error({**UNREADABLE["check_error"], **record})


# ---------------------------------------------------------------- one submission, graded
def grade(files, exercises, cases_for, limits, uid=None, zygote=None):
    """{exercise: [Result]} for one submission, its code observed in a child that `zygote` forks (without one, a
    zygote of its own, for this submission only); plus how the child ended. `cases_for(function)` gives a
    function's cases (with their expectations: they stay here)."""
    defined, broken = read_submission(files)
    plans = {exercise: grading.plan_exercise(exercise, defined, cases_for) for exercise in exercises}
    planned = {}
    for plan in plans.values():
        for file, functions in (plan or {}).items():
            for function, cases in functions.items():
                planned[(file, function)] = cases
    requests = {key: cases for key, cases in planned.items() if key[0] not in broken}
    runnable = [path for path in files if os.path.basename(path) not in broken]
    lines, ended = [], "ok"
    if requests and zygote is None:
        with Zygote(runnable) as own:
            lines, ended = run_child(runnable, requests, limits, uid, own)
    elif requests:
        lines, ended = run_child(runnable, requests, limits, uid, zygote)
    observations, import_errors = read_report(lines, planned)
    not_imported = dict(broken)
    for file, record in import_errors.items():
        not_imported[file] = f"{file} does not import:\n{import_failure(record)}"
    for file, why in not_imported.items():
        for function, slot in observations.get(file, {}).items():
            slot[:] = [{"not_imported": why}] * len(slot)
    if ended != "ok":
        for functions in observations.values():
            for slot in functions.values():
                slot[:] = [{"stopped": ended} if observed is None else observed for observed in slot]
    graded = {}
    for exercise, plan in plans.items():
        if plan is None:
            graded[exercise] = grading.nothing_defines(exercise, [os.path.basename(f) for f in files])
        else:
            graded[exercise] = grading.judge_exercise(plan, observations)
    return graded, ended


def weighted(results, points, hidden_share=0.5):
    """The results rescaled to `points` in all: the hidden cases share `hidden_share` of them (at least half: the
    public cases are the student's feedback, their answers ship with the bundle), the others the rest, each case
    an equal part of its share. Any failure keeps the same maximum."""
    public = [r for r in results if not r.hidden]
    hidden = [r for r in results if r.hidden]
    if not hidden or not public:
        shares = [(results, points)]
    else:
        shares = [(public, points * (1 - hidden_share)), (hidden, points * hidden_share)]
    scaled = []
    for group, share in shares:
        for result in group:
            part = share / len(group)
            earned = part * result.points / result.max_points if result.max_points else 0.0
            scaled.append(dataclasses.replace(result, points=earned, max_points=part))
    return scaled


def uid_for(number):
    """As root: the uid that submission number `number` runs as, unnamed and owning nothing else; two graders
    running at once (two `grade` calls of an autograder) get different ones, so neither kills the other's child.
    None: not root, no uid of its own."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + (os.getpid() % 1000) * 100_000 + number % 100_000

