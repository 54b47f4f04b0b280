"""The instructor's sandbox: each submission runs in a child process of its own, which only computes; this process
(the parent) decides every point.

  parent: draws the cases, computes the expected outputs with the references, sends the child the INPUTS only
  child:  a fresh interpreter (python -I -B) in an empty temporary folder holding a copy of the submission and the
          public engine (exercises/sandbox_child.py, grading.py, texts.py); no repository on its sys.path, no secret
          in its argv, environment or files; as root, a uid of its own (no access to the instructor's files, no
          signal to other processes); limits on wall clock, CPU time, memory, file size and processes
  back:   one JSON line per observed case (outputs as arrays, dtypes, devices, errors): data, never code; the parent
          checks their type and shape and judges them (grading.judge_exercise). A case the child never reported
          (killed at a limit, crashed) scores 0: "timed out".

What a process sandbox does not do (docs/assignments.md): it is not a container. The child can read every file
that its uid may read (with a uid of its own: every world-readable file, the references' source among them,
unless the repository is private), use the network, and claim anything about its own function in its report (a dtype, a
step count): only values it could not compute without solving the exercise are out of its reach."""
import ast
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

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
    """What the child is sent on stdin: file names, limits, and each (file, function)'s cases as INPUTS only."""
    return {"files": files, "case_seconds": limits.case_seconds, "uid": uid, "preload": preload,
            "limits": {"memory_bytes": limits.memory_bytes, "output_bytes": limits.output_bytes,
                       "cpu_seconds": limits.cpu_seconds, "processes": limits.processes if uid is not None else None},
            "requests": [{"file": file, "function": function,
                          "cases": [{"function": case.function, "name": case.name, "kind": case.kind,
                                     "inputs": grading.encode(case.inputs), "grads": list(case.grads)}
                                    for case in cases]}
                         for (file, function), cases in requests.items()]}


def prepare_folder(files, uid):
    """A fresh folder: grader/ (the public engine) and submission/ (copies of the student's files), nothing else;
    as root, owned by the child's uid and closed to everyone else."""
    folder = tempfile.mkdtemp(prefix="sandbox_")
    os.makedirs(os.path.join(folder, "grader"))
    os.makedirs(os.path.join(folder, "submission"))
    for name in CHILD_FILES:
        shutil.copy(os.path.join(HERE, name), os.path.join(folder, "grader", name))
    for path in files:
        shutil.copy(path, os.path.join(folder, "submission", os.path.basename(path)))
    if uid is not None:
        for directory, _, names in os.walk(folder):
            os.chown(directory, uid, uid)
            for name in names:
                os.chown(os.path.join(directory, name), uid, uid)
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


def run_child(files, requests, limits, uid=None):
    """Run one submission's child; returns (its JSON lines, how it ended: "ok", "timed out", or the last line of
    its stderr). The results come through a file this process opened (the child holds only the descriptor), read
    after the child has ended."""
    folder = prepare_folder(files, uid)
    private = tempfile.mkdtemp(prefix="sandbox_results_")  # the parent's own: the child never learns its name
    try:
        with open(os.path.join(private, "out"), "w+b") as out, open(os.path.join(private, "err"), "w+b") as err:
            process = subprocess.Popen([sys.executable, "-I", "-B", os.path.join(folder, "grader", "sandbox_child.py")],
                                       cwd=os.path.join(folder, "submission"), env=child_environment(folder),
                                       stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True,
                                       close_fds=True)
            request = child_request([os.path.basename(f) for f in files], requests, limits, uid, preload_list(files))
            ended = send_and_wait(process, request, limits.seconds)
            kill_all_of(uid, process.pid)
            out.seek(0)
            lines = out.read(limits.output_bytes).decode("utf-8", errors="replace").splitlines()
            err.seek(0)
            tail = err.read()[-4000:].decode("utf-8", errors="replace").strip().splitlines()
        if ended == "ok" and process.returncode == -signal.SIGXCPU:
            ended = "timed out (its CPU time limit)"
        elif ended == "ok" and process.returncode != 0:
            ended = tail[-1] if tail else f"the process ended with status {process.returncode}"
        return lines, ended
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def send_and_wait(process, request, seconds):
    """Write the request (from a thread: a child that never reads cannot block us), wait up to `seconds`."""
    def write():
        try:
            process.stdin.write(json.dumps(request, allow_nan=True).encode())
            process.stdin.close()
        except (BrokenPipeError, OSError):
            pass
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        process.wait(timeout=seconds)
        return "ok"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "timed out"


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
def grade(files, exercises, cases_for, limits, uid=None):
    """{exercise: [Result]} for one submission, its code observed in a child; plus how the child ended.
    `cases_for(function)` gives a function's cases (with their expectations: they stay here)."""
    defined, broken = read_submission(files)
    plans = {exercise: grading.plan_exercise(exercise, defined, cases_for) for exercise in exercises}
    planned = {}
    for plan in plans.values():
        for file, functions in (plan or {}).items():
            for function, cases in functions.items():
                planned[(file, function)] = cases
    requests = {key: cases for key, cases in planned.items() if key[0] not in broken}
    runnable = [path for path in files if os.path.basename(path) not in broken]
    lines, ended = run_child(runnable, requests, limits, uid) if requests else ([], "ok")
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

