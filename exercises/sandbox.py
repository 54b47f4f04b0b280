"""The instructor's sandbox: each submission runs in a child process of its own, which only computes; this process
(the parent) decides every point and trusts nothing it reads.

  parent: reads each script only as a regular file of the student's folder's owner, never through a link, a FIFO
          or a device, at most SCRIPT_BYTES; decides what is graded (every exercise function of the repository's
          script of that name); draws the cases, computes the expected outputs with the references, sends the
          child the INPUTS only
  zygote: one per batch: a fresh interpreter (python -I -B) in an empty temporary folder holding the public engine
          (exercises/sandbox_child.py, grading.py, texts.py) and nothing else; no repository on its sys.path, no
          secret in its argv, environment or files; it imports the standard library, torch, gymnasium, tyro and
          the engine, as root, and then only forks: it never runs a student's code nor holds a case or a grade
  child:  per submission, a fork of that pristine zygote (a copy of a freshly started interpreter that never saw
          the references, the secret or another submission); as root, cgroups of its own (memory and processes
          summed over the submission), mount, IPC and network namespaces of its own (a private tmpfs /tmp with
          its copy of the submission, and the interpreter read-only where it lies under /tmp; no network), and a
          uid of its own (no access to the instructor's files, no signal to other processes, the zygote included);
          limits on wall clock, CPU time, memory, file size and processes
  back:   one JSON line per observed case (outputs as arrays, dtypes, devices, errors): data, never code; the parent
          reads it within caps, line by line, and checks every field's type and shape before it judges them
          (grading.judge_exercise). A case the child never reported (killed at a limit, crashed) scores 0: "timed
          out". Then every process of the child's uid is killed and what it left behind is removed.

What a process sandbox does not do (docs/assignments.md): it is not a container. The child can read every file
that its uid may read (with a uid of its own: every world-readable file, the references' source among them,
unless the repository is private), and claim anything about its own function in its report (a dtype, a step
count): only values it could not compute without solving the exercise are out of its reach. Without root there is
no uid, cgroup or namespace of its own (instructor.py refuses to run then, unless told otherwise)."""
import ast
import dataclasses
import ctypes
import errno
import fcntl
import functools
import itertools
import json
import os
import re
import shutil
import signal
import stat
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
UID_BASE = 1_500_000_000  # as root, submission i of a grader holding uid range r runs as UID_BASE + r * 100000 + i
ARRAY_DTYPES = {"float64", "float32", "int64", "int32", "bool"}  # what an array from the child may be


@dataclasses.dataclass
class Limits:
    """What one submission's child may use; a case it did not finish within them scores 0."""
    seconds: float = 120.0  # wall clock of the whole child (start-up, imports, every case)
    cpu_seconds: int = 90  # its CPU time (RLIMIT_CPU)
    memory_bytes: int = 4 << 30  # each process's address space beyond what the imports reserved (RLIMIT_AS) and,
    # as root where the machine has cgroups, the memory of all its processes together
    output_bytes: int = 16 << 20  # each file it writes, its results and stderr included (RLIMIT_FSIZE)
    files_bytes: int = 256 << 20  # as root: its private /tmp (with /var/tmp, /dev/shm), all files together
    processes: int = 64  # processes and threads of its uid (RLIMIT_NPROC, and a cgroup's pids.max where there is
    # one; only as root, with a uid of its own)
    case_seconds: float = 10.0  # a function that runs past this on one case is not run on its later cases


# ---------------------------------------------------------------- what the parent reads of a submission
SCRIPT_BYTES = 1 << 20  # a submitted script larger than this is not read (the repository's are under 90 KB)
LINE_BYTES = 1 << 20  # a line of the child's report longer than this ends the report
TEXT_CHARS = 4000  # every string the child sends (an error's message, its frames) is cut to this length


class Refused(Exception):
    """A submitted file or folder that the parent does not read; the message says why, for the report."""


def open_entry(name, folder_descriptor=None, directory=False):
    """A descriptor of `name` (in the folder open as `folder_descriptor`), opened without following a symbolic link
    and without blocking on a FIFO: a regular file, or with `directory` a folder. Refused(why) otherwise; None when
    there is no such entry."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | (os.O_DIRECTORY if directory else 0)
    what = "folder" if directory else "file"
    shown = display(name)
    try:
        descriptor = os.open(name, flags, dir_fd=folder_descriptor)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP or stat.S_ISLNK(os.stat(name, dir_fd=folder_descriptor,
                                                              follow_symlinks=False).st_mode):
            raise Refused(f"{shown} is a symbolic link: only a {what} of the student's own is read") from None
        raise Refused(f"{shown} cannot be opened as a {what} ({error.strerror})") from None
    if not directory and not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise Refused(f"{shown} is not a regular file (a FIFO, a device or a folder): it is not read")
    return descriptor


def read_bytes(descriptor, limit):
    """Up to `limit` + 1 bytes of an open file (one more than allowed tells that it is too large)."""
    parts, size = [], 0
    while size <= limit:
        chunk = os.read(descriptor, min(1 << 20, limit + 1 - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


def read_script(name, folder_descriptor):
    """The bytes of the script `name` of a student's folder (open as `folder_descriptor`), or None when it has none.
    Refused(why) unless it is a regular file (no link, hard or symbolic, FIFO or device) of the folder's owner, on
    its file system, at most SCRIPT_BYTES long: the parent reads with privileges the student lacks (root's), so it
    never reads what a name points to."""
    descriptor = open_entry(name, folder_descriptor)
    if descriptor is None:
        return None
    try:
        found, folder = os.fstat(descriptor), os.fstat(folder_descriptor)
        if found.st_uid != folder.st_uid:
            raise Refused(f"{name} belongs to another user than the student's folder: it is not read")
        if found.st_nlink != 1 or found.st_dev != folder.st_dev:  # where every file is root's, the owner tells
            # nothing: a hard link to a grader's file (the secret) would pass
            raise Refused(f"{name} is a hard link (another name of a file elsewhere): it is not read")
        data = read_bytes(descriptor, SCRIPT_BYTES)
    finally:
        os.close(descriptor)
    if len(data) > SCRIPT_BYTES:
        raise Refused(f"{name} is larger than {SCRIPT_BYTES >> 20} MiB: it is not read")
    return data


def read_submission(folder_descriptor, names):
    """({script: its bytes}, {script: why it was not read}) of the named scripts in a student's folder."""
    scripts, refused = {}, {}
    for name in names:
        try:
            data = read_script(name, folder_descriptor)
        except Refused as why:
            refused[name] = str(why)
            continue
        if data is not None:
            scripts[name] = data
    return scripts, refused


def display(name):
    """A file or folder name of any bytes as printable text, one text per name: a byte that is not UTF-8 as \\xNN,
    a control character escaped (a newline as \\n), and a backslash doubled, so that a folder named "a\\n" (a
    backslash and an n) and one named "a" + a newline never read the same (a name is shown in reports, JSON and
    CSV, and used for the report's own file names)."""
    if isinstance(name, str):
        name = os.fsencode(name)
    shown = []
    for character in name.decode("utf-8", errors="surrogateescape"):
        if "\udc80" <= character <= "\udcff":  # a byte that is not UTF-8
            shown.append(f"\\x{ord(character) - 0xdc00:02x}")
        elif character == "\\":
            shown.append("\\\\")
        elif character.isprintable():
            shown.append(character)
        else:
            shown.append(character.encode("unicode_escape").decode("ascii"))
    return "".join(shown)


def printable_text(text):
    """A report's text that is safe to `cat` in a terminal: every character that is not printable, except a line's
    end and a tab, escaped (ESC, BEL, a carriage return, C1 controls, bidirectional overrides): a message of the
    student's can neither move the cursor, nor write a line over another, nor set the clipboard (OSC 52)."""
    if text.isprintable():
        return text
    shown = []
    for character in text:
        if character.isprintable() or character in "\n\t":
            shown.append(character)
        else:
            shown.append(character.encode("unicode_escape").decode("ascii"))
    return "".join(shown)


@functools.lru_cache(maxsize=None)
def script_functions(name):
    """The exercise functions that the repository's script `name` defines: the parent grades every one of them in a
    submitted file of that name, whatever the file holds (one missing, renamed or unreachable there scores 0 for
    its cases). No source of a student's is parsed here."""
    if name not in SCRIPTS:
        return frozenset()
    with open(os.path.join(ROOT, name)) as f:
        tree = ast.parse(f.read())
    return frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef)) & set(
        grading.ALL_FUNCTIONS)


# ---------------------------------------------------------------- the child process
SIDE_EFFECTS = {"antigravity", "this", "idlelib", "turtle", "turtledemo", "tkinter", "webbrowser"}
IMPORT_LINE = re.compile(rb"^[ \t]*(?:from|import)[ \t]+([A-Za-z_][A-Za-z0-9_.]*)", re.MULTILINE)  # linear


def imported_modules(statements):
    """The modules that import statements name (top-level absolute imports, anywhere in the file)."""
    names = set()
    for node in ast.walk(ast.Module(body=list(statements), type_ignores=[])):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def preload_list(scripts):
    """What the child imports before it drops to its uid (sandbox_child.preload): the standard library's modules
    that this process has loaded or that the submission's import lines name (read line by line, never parsed), and
    the modules that the repository's four scripts import (torch, gymnasium, tyro, ...): installed code, never the
    student's."""
    wanted = {name for name in sys.modules if name.split(".")[0] in sys.stdlib_module_names}
    for name in SCRIPTS:
        with open(os.path.join(ROOT, name)) as f:
            wanted |= imported_modules(ast.parse(f.read()).body)
    for data in scripts.values():
        imports = {match.decode("ascii") for match in IMPORT_LINE.findall(data)}
        wanted |= {name for name in imports if name.split(".")[0] in sys.stdlib_module_names}
    return sorted(name for name in wanted if name.split(".")[0] not in SIDE_EFFECTS and not name.startswith("_")
                  and name != "__main__")


def child_request(files, requests, limits, uid, preload, cgroups):
    """What the child reads (results/request.json): file names, limits, its cgroups, each (file, function)'s cases
    as INPUTS only."""
    return {"files": files, "case_seconds": limits.case_seconds, "uid": uid, "preload": preload, "cgroups": cgroups,
            "limits": {"memory_bytes": limits.memory_bytes, "output_bytes": limits.output_bytes,
                       "files_bytes": limits.files_bytes, "cpu_seconds": limits.cpu_seconds,
                       "processes": limits.processes if uid is not None else None},
            "requests": [{"file": file, "function": function,
                          "cases": [{"function": case.function, "name": case.name, "kind": case.kind,
                                     "inputs": grading.encode(case.inputs), "grads": list(case.grads)}
                                    for case in cases]}
                         for (file, function), cases in requests.items()]}


WORK = "/var/lib/course_grader"  # as root: the grader's folders and its uid ranges' locks (work_folder)


def work_folder():
    """Where the folders that the parent and the children use go. As root: WORK, root's own, mode 0711 (every uid
    may cross it to its own folder, none may list or write it), outside every folder a submission may write: a
    child that fills /tmp, /var/tmp or /dev/shm (where they are file systems of their own) takes no space from
    the copies and reports of the submissions graded beside it. Otherwise None (the usual temporary folder)."""
    if os.geteuid() != 0:
        return None
    os.makedirs(WORK, mode=0o711, exist_ok=True)
    info = os.lstat(WORK)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
        raise RuntimeError(f"{WORK} is not a folder of root's: the grader does not use it")
    os.chmod(WORK, 0o711)
    return WORK


def prepare_folder(scripts, uid):
    """A fresh folder for one submission, (outer, home): home/submission/ holds the bytes the parent read, nothing
    else, readable by the child's uid alone (folders 0700, files 0600): no other submission, nor any other user
    of the machine, reads the copy while it is graded. As root, home is the child's uid's own and the outer folder
    root's, which the child may cross but not change: it cannot move its home away (or put a link in its place)
    before the parent removes it."""
    outer = tempfile.mkdtemp(prefix="sandbox_", dir=work_folder())
    home = os.path.join(outer, "home")
    os.makedirs(os.path.join(home, "submission"), mode=0o700)
    os.chmod(home, 0o700)
    for name, data in scripts.items():
        path = os.path.join(home, "submission", name)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(data)
    if uid is not None:
        os.chmod(outer, 0o711)
        for directory, _, names in os.walk(home):
            os.chown(directory, uid, uid)
            for name in names:
                os.chown(os.path.join(directory, name), uid, uid)
    return outer, home


def results_folder(limits):
    """The folder of a child's result channel (root's own, 0700), with results/out and results/err made here and
    their space reserved (fallocate, output_bytes each): a submission that fills the disk while this one is graded
    cannot make its report fail ("No space left on device")."""
    private = tempfile.mkdtemp(prefix="sandbox_results_", dir=work_folder())
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("out", "err"):
        descriptor = os.open(os.path.join(private, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o600)
        try:  # FALLOC_FL_KEEP_SIZE: the blocks are the file's, its size stays 0; where unsupported, no reserve
            libc.fallocate(descriptor, 1, ctypes.c_long(0), ctypes.c_long(limits.output_bytes))
        finally:
            os.close(descriptor)
    return private


CGROUP = "/sys/fs/cgroup"
SWAP_LIMITS = ("memory.swap.max", "memory.memsw.limit_in_bytes")  # set where the kernel has swap accounting


def own_cgroup(controller):
    """This process's cgroup folder for `controller` ("" for cgroup v2's unified tree), from /proc/self/cgroup."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):  # "" is cgroup v2's line, "0::/path"
                return path
    return None


def ancestors():
    """This process's pid and its ancestors' (the commands that started it: a shell, timeout, systemd-run)."""
    pids, pid = set(), os.getpid()
    while pid > 0 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


@functools.lru_cache(maxsize=None)
def cgroup_v2_base():
    """cgroup v2, as root: the folder under which the submissions' cgroups go, or None. A cgroup that holds
    processes cannot hand memory and pids limits to sub-cgroups (the "no internal processes" rule), so the
    processes of the grader's cgroup first move into a leaf of it, when they are only the grader and the commands
    that started it (a scope of its own: `systemd-run --scope`); any other cgroup is left as it is (None: the limits
    stay per process). Called before the zygote starts."""
    path = own_cgroup("")
    if path is None:
        return None
    folder = os.path.join(CGROUP, path.lstrip("/"))
    try:
        with open(os.path.join(folder, "cgroup.subtree_control")) as f:
            enabled = set(f.read().split())
        if not {"memory", "pids"} <= enabled:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                members = {int(pid) for pid in f.read().split()}
            if members and not members <= ancestors():
                return None
            leaf = os.path.join(folder, "course_grader")
            os.makedirs(leaf, exist_ok=True)
            for pid in members:
                with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            with open(os.path.join(folder, "cgroup.subtree_control"), "w") as f:
                f.write("+memory +pids")
        return folder
    except OSError:
        return None


GRADER_MARGIN = 512 << 20  # what stays for the grader (its own process and the zygote) below the memory left


def memory_left():
    """The bytes that this process and its children may still take, or None where nothing says: the least of
    the machine's MemAvailable and, for its memory cgroup and every one above it (a container's, a job's), the
    cgroup's limit less its usage (less the page cache it may drop, as `docker stats` counts)."""
    left = []
    try:
        with open("/proc/meminfo") as f:
            left += [int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    if os.path.exists(os.path.join(CGROUP, "cgroup.controllers")):
        tree, path = CGROUP, own_cgroup("")
        names = ("memory.max", "memory.current", "inactive_file")
    else:
        tree, path = os.path.join(CGROUP, "memory"), own_cgroup("memory")
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    parts = [part for part in (path or "").split("/") if part]
    for depth in range(len(parts), -1, -1):
        folder = os.path.join(tree, *parts[:depth])
        try:
            with open(os.path.join(folder, names[0])) as f:
                limit = f.read().strip()
            with open(os.path.join(folder, names[1])) as f:
                used = int(f.read())
            with open(os.path.join(folder, "memory.stat")) as f:
                cache = sum(int(line.split()[1]) for line in f if line.split()[0] == names[2])
        except (OSError, ValueError, IndexError):
            continue
        if limit != "max" and int(limit) < 1 << 62:  # v1 writes "no limit" as a number near 2**63
            left.append(int(limit) - max(used - cache, 0))
    return min(left) if left else None


def within_memory(limits):
    """`limits` with its memory lowered to what the machine has left less GRADER_MARGIN (at least 64 MiB): where
    a container's memory is below the sandbox's limit, the submission, not the grader, meets the limit."""
    left = memory_left()
    if left is None:
        return limits
    return dataclasses.replace(limits, memory_bytes=max(min(limits.memory_bytes, left - GRADER_MARGIN), 64 << 20))


def oom_kills(folders):
    """How many of the submission's processes its memory cgroup killed at the limit (0 where none says)."""
    for folder in folders:
        for name in ("memory.events", "memory.oom_control"):  # cgroup v2's, v1's
            try:
                with open(os.path.join(folder, name)) as f:
                    counts = dict(line.split() for line in f if len(line.split()) == 2)
                return int(counts.get("oom_kill", 0))
            except (OSError, ValueError):
                continue
    return 0


def cgroup_folders(uid, limits):
    """As root: cgroups of the submission's own, with its memory (memory_bytes) and process count (processes)
    summed over all its processes; the folders made, which the child joins (sandbox_child.join_cgroups). cgroup v2
    where /sys/fs/cgroup is its tree (cgroup_v2_base), else cgroup v1's memory and pids hierarchies; [] where they
    cannot be written (a container without them: the limits stay per process)."""
    if os.path.exists(os.path.join(CGROUP, "cgroup.controllers")):
        base = cgroup_v2_base()
        if base is None:
            return []
        settings = {base: {"memory.max": limits.memory_bytes, "memory.swap.max": 0, "pids.max": limits.processes}}
    else:
        memory, pids = own_cgroup("memory"), own_cgroup("pids")
        if memory is None or pids is None:
            return []
        memory_limits = {key: limits.memory_bytes for key in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")}
        settings = {os.path.join(CGROUP, "memory", memory.lstrip("/")): memory_limits,
                    os.path.join(CGROUP, "pids", pids.lstrip("/")): {"pids.max": limits.processes}}
    made = []
    try:
        for base, values in settings.items():
            folder = os.path.join(base, f"course_grader_{uid}")
            os.makedirs(folder, exist_ok=True)
            made.append(folder)
            for key, value in values.items():
                if key not in SWAP_LIMITS or os.path.exists(os.path.join(folder, key)):
                    with open(os.path.join(folder, key), "w") as f:
                        f.write(str(value))
    except OSError:
        remove_cgroups(made)
        return []
    return made


def remove_cgroups(folders):
    """Remove the submission's cgroups: every process still in one is killed first (cgroup v2's cgroup.kill, else
    each pid of cgroup.procs), then the folder goes once they have left (a killed one may take a moment)."""
    for folder in folders:
        try:
            with open(os.path.join(folder, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            try:
                with open(os.path.join(folder, "cgroup.procs")) as f:
                    pids = [int(pid) for pid in f.read().split()]
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for _ in range(50):
            try:
                os.rmdir(folder)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def remove_tree(path):
    """rm -rf: coreutils walks a tree of any depth without recursion and never follows a link inside it (a folder
    that a submission nested 3000 deep stops shutil.rmtree with a RecursionError)."""
    subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True, timeout=600)


SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
IPC_KINDS = {"shm": "-m", "msg": "-q", "sem": "-s"}  # /proc/sysvipc/KIND -> ipcrm's flag


def sweep(uid):
    """As root, after every process of `uid` has been killed: remove what it left in the folders every uid may write
    (/tmp, /var/tmp, /dev/shm, /run/lock: files, folders, POSIX shared memory), its System V shared memory,
    message queues and semaphores, and its kernel keyrings' keys, so that nothing of a submission outlives it."""
    for folder in SHARED_FOLDERS:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    remove_tree(entry.path)
            except OSError:
                continue
    for kind, flag in IPC_KINDS.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except (OSError, ValueError):
            continue
        for row in rows:
            if len(row) == len(header) and int(row[header.index("uid")]) == uid:
                subprocess.run(["ipcrm", flag, row[1]], capture_output=True, timeout=30)
    clear_keys(uid)


KEYCTL = {"x86_64": 250, "aarch64": 219}  # keyctl's system call number per machine
LIBC = ctypes.CDLL(None, use_errno=True)


def clear_own_keys():
    """In a process of the submission's uid (subprocess's preexec_fn, after it took the uid): empty its persistent
    keyring (KEYCTL_GET_PERSISTENT 22, linked into the user keyring -4) and its user and user-session keyrings
    (-4, -5: KEYCTL_CLEAR 7)."""
    number = KEYCTL.get(os.uname().machine)
    if number is None:
        return
    persistent = LIBC.syscall(number, 22, ctypes.c_long(-1), ctypes.c_long(-4))
    if persistent > 0:
        LIBC.syscall(number, 7, ctypes.c_long(persistent))
    for ring in (-4, -5):
        LIBC.syscall(number, 7, ctypes.c_long(ring))


def clear_keys(uid):
    """Empty the kernel keyrings that outlive a uid's processes: a key a submission added there is gone before
    another process of that uid runs. Only for a uid that has keys (/proc/key-users lists it)."""
    try:
        with open("/proc/key-users") as f:
            users = {line.split(":", 1)[0].strip() for line in f}
    except OSError:
        return
    if str(uid) in users:
        subprocess.run(["true"], user=uid, group=uid, extra_groups=[], preexec_fn=clear_own_keys,
                       capture_output=True, timeout=30)


def engine_folder():
    """The zygote's folder: grader/ with the public engine only (what the students' bundle holds), readable by
    all (the children, under their own uids, read its sources for their tracebacks), writable by this user only."""
    folder = tempfile.mkdtemp(prefix="sandbox_zygote_", dir=work_folder())
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
        if group is not None:  # None: the zygote never said which pid the child had
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

    def __init__(self, scripts=None):
        if os.geteuid() == 0 and os.path.exists(os.path.join(CGROUP, "cgroup.controllers")):
            cgroup_v2_base()  # before the zygote starts: the grader's cgroup must hold only the grader's commands
        self.folder = engine_folder()
        self.private = tempfile.mkdtemp(prefix="sandbox_zygote_err_", dir=work_folder())
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
        self.send({"preload": preload_list(scripts or {})})

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


def run_child(scripts, requests, limits, uid, zygote):
    """Run one submission's child ({script: bytes}), forked by `zygote`; returns (its report's lines, how it ended:
    "ok", "timed out", or the last line of its stderr). The results come through a file in a folder only this user
    may open, read after the child has ended; then every process of its uid is killed and, as root, what it left
    in the shared temporary folders and System V IPC is removed."""
    outer, home = prepare_folder(scripts, uid)
    private = results_folder(limits)  # root's own: the child opens its files before dropping
    limits = within_memory(limits)
    cgroups = cgroup_folders(uid, limits) if uid is not None else []
    try:
        request = child_request(sorted(scripts), requests, limits, uid, preload_list(scripts), cgroups)
        with open(os.path.join(private, "request.json"), "w") as f:
            json.dump(request, f, allow_nan=True)
        deadline = time.monotonic() + limits.seconds
        number, pid = zygote.start(home, private), None
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
        finally:  # after a ZygoteError too: no process of the submission outlives its grading
            zygote.forget(number)
            kill_all_of(uid, pid)
            killed = oom_kills(cgroups)
            if uid is not None:
                sweep(uid)
                remove_cgroups(cgroups)
        lines = report_lines(os.path.join(private, "out"), limits.output_bytes)
        tail = tail_of(os.path.join(private, "err")).strip().splitlines()
        if ended == "ok" and returncode == -signal.SIGXCPU:
            ended = "timed out (its CPU time limit)"
        elif ended == "ok" and returncode == -signal.SIGKILL and killed:
            ended = (f"killed at its memory limit ({limits.memory_bytes >> 20} MiB for all its processes together: "
                     "the sandbox's limit or what the machine had left for it)")
        elif ended == "ok" and returncode != 0:
            ended = tail[-1][:TEXT_CHARS] if tail else f"the process ended with status {returncode}"
        return lines, ended
    finally:
        remove_tree(outer)
        remove_tree(private)


def report_lines(path, limit):
    """The lines of the child's report, `limit` bytes in all at most; a line longer than LINE_BYTES, or one cut by
    the limit, ends it. [] when the child never opened it (or it is not a regular file)."""
    try:
        descriptor = open_entry(path)
    except Refused:
        return []
    if descriptor is None:
        return []
    try:
        data = read_bytes(descriptor, limit)
    finally:
        os.close(descriptor)
    lines = []
    for line in data[:limit].split(b"\n")[:-1]:  # the last piece has no end of line: cut, or empty
        if len(line) > LINE_BYTES:
            break
        lines.append(line)
    return lines


def tail_of(path, size=4000):
    """The last `size` bytes of the child's stderr as text, '' when there is none (a flood is never read whole)."""
    try:
        descriptor = open_entry(path)
    except Refused:
        return ""
    if descriptor is None:
        return ""
    try:
        end = os.fstat(descriptor).st_size
        os.lseek(descriptor, max(0, end - size), os.SEEK_SET)
        return read_bytes(descriptor, size)[:size].decode("utf-8", errors="replace")
    finally:
        os.close(descriptor)


# ---------------------------------------------------------------- reading the child's report as data
def plain(value):
    """A decoded JSON value with its arrays as numpy arrays of a plain numeric dtype; ValueError otherwise."""
    if isinstance(value, dict) and set(value) == {"array", "dtype"}:
        if value["dtype"] not in ARRAY_DTYPES:
            raise ValueError(f"an array of dtype {value['dtype']!r:.40}")
        return np.array(value["array"], dtype=value["dtype"])
    if isinstance(value, dict):
        return {str(key)[:TEXT_CHARS]: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, str):
        # No text from the child reaches a regex or a report whole, nor a lone surrogate a UTF-8 file.
        return value[:TEXT_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
    if value is None or isinstance(value, (bool, int, float)):
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
    Only what was asked is kept; a malformed line ends the report (what came before it stands): one that is not
    JSON, nests too deep, holds a number no array can hold, or whose names are not strings."""
    observations = {file: {} for file, _ in requests}
    for (file, function), cases in requests.items():
        observations[file][function] = [None] * len(cases)
    import_errors = {}
    for line in lines:
        try:
            message = plain(json.loads(line))
        except Exception:  # noqa: BLE001 - whatever the child wrote, it ends its own report and nothing else
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
def grade(scripts, refused, exercises, cases_for, limits, uid=None, zygote=None):
    """{exercise: [Result]} for one submission ({script: the bytes the parent read}, {script: why it was not read}),
    its code observed in a child that `zygote` forks (without one, a zygote of its own, for this submission only);
    plus how the child ended. `cases_for(function)` gives a function's cases (with their expectations: they stay
    here). What is graded is the parent's choice: every exercise function that the repository's script of each name
    defines, looked up in the child's module (script_functions), whatever the student's source holds."""
    defined = {name: set(script_functions(name)) for name in [*scripts, *refused]}
    plans = {exercise: grading.plan_exercise(exercise, defined, cases_for) for exercise in exercises}
    planned = {}
    for plan in plans.values():
        for file, functions in (plan or {}).items():
            for function, cases in functions.items():
                planned[(file, function)] = cases
    requests = {key: cases for key, cases in planned.items() if key[0] in scripts}
    lines, ended = [], "ok"
    if requests and zygote is None:
        with Zygote(scripts) as own:
            lines, ended = run_child(scripts, requests, limits, uid, own)
    elif requests:
        lines, ended = run_child(scripts, requests, limits, uid, zygote)
    observations, import_errors = read_report(lines, planned)
    claims = unverified_changes(observations)
    not_run = dict(refused)
    for file, record in import_errors.items():
        not_run[file] = f"{file} does not import:\n{import_failure(record)}"
    for file, why in not_run.items():
        for function, slot in observations.get(file, {}).items():
            slot[:] = [{"not_imported": why}] * len(slot)
    if ended != "ok":
        for functions in observations.values():
            for slot in functions.values():
                slot[:] = [{"stopped": ended} if observed is None else observed for observed in slot]
    graded = {}
    for exercise, plan in plans.items():
        if plan is None:
            graded[exercise] = grading.nothing_defines(exercise, [*scripts, *refused])
        else:
            graded[exercise] = grading.judge_exercise(plan, observations) + change_notes(plan, claims)
    return graded, ended


def unverified_changes(observations):
    """{(file, function): the inputs that the child says the function changed in place}, each such claim taken out
    of its observation: the child runs the student's code, whose module may rewrite the child's own check
    (grading.unchanged) to say "unchanged", so the claim is not graded either way (the values are); it is shown as
    a note. What a function changes in place shows in training, which the public grader runs."""
    claims = {}
    for file, functions in observations.items():
        for function, slot in functions.items():
            for observed in slot:
                call = observed.get("float64") if isinstance(observed, dict) else None
                if isinstance(call, dict) and call.get("changed"):
                    claims.setdefault((file, function), set()).update(call["changed"])
                    call["changed"] = []
    return claims


def change_notes(plan, claims):
    """A note (worth no points) per function of the plan whose child said it changed an input in place."""
    notes = []
    for (file, function), names in sorted(claims.items()):
        if function in plan.get(file, {}):
            notes.append(grading.Result(
                f"{function} [{file}]: its inputs are left as they were", 0.0, 0.0,
                f"the submission's process reports that {function} changed {', '.join(sorted(names))} in place.\n"
                "hint: a caller still needs them (train logs and reuses them). Build new tensors instead of "
                "x += ..., x[i] = ... or x.clamp_(...).\n(not graded: a process that runs the submission's code "
                "can say anything about its own side effects; the values it returns are graded)",
                function=function))
    return notes


def weighted(results, points, hidden_share=0.5):
    """The results rescaled to `points` in all. Each graded function weighs what its cases in ONE copy weigh,
    however many copies of it a submission hands in (a second file with a right copy neither adds nor dilutes):
    the hidden cases of one copy of every function share `hidden_share` of the points (at least half: the public
    cases are the student's feedback, their answers ship with the bundle), the public ones the rest, each such
    case an equal part; a function's part is split evenly among its copies. A note (a result of a function with no
    file: the copies' agreement, a claim the grader cannot verify) is worth nothing; it fails with its message.
    Any failure keeps the same maximum."""
    copies = {}
    for result in results:
        if result.copy:
            copies.setdefault(result.function, set()).add(result.copy)

    def is_note(result):
        return bool(result.function) and not result.copy

    one_copy = [r for r in results if not is_note(r) and (not r.copy or r.copy == min(copies[r.function]))]
    public = sum(1 for r in one_copy if not r.hidden)
    hidden = len(one_copy) - public
    scaled = []
    for result in results:
        if is_note(result):
            scaled.append(dataclasses.replace(result, points=0.0, max_points=0.0))
            continue
        if not hidden or not public:
            unit = points / len(one_copy)
        elif result.hidden:
            unit = points * hidden_share / hidden
        else:
            unit = points * (1 - hidden_share) / public
        part = unit / len(copies.get(result.function, [result.copy]))
        earned = part * result.points / result.max_points if result.max_points else 0.0
        scaled.append(dataclasses.replace(result, points=earned, max_points=part))
    return scaled


SLOTS = 1000  # uid ranges: a grader process holds one for its lifetime
HELD = {}  # {"slot": the range this process holds, "descriptor": its lock's}
HOLDING = threading.Lock()


def held_slot():
    """The uid range this grader process holds: the first of SLOTS, from its pid on, whose lock file (in WORK) no
    other process holds (flock: the kernel releases it when its holder exits, however it ends)."""
    with HOLDING:
        if "slot" not in HELD:
            start = os.getpid() % SLOTS
            for offset in range(SLOTS):
                slot = (start + offset) % SLOTS
                descriptor = os.open(os.path.join(work_folder(), f"uids_{slot}.lock"),
                                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(descriptor)
                    continue
                HELD.update(slot=slot, descriptor=descriptor)
                break
            else:
                raise RuntimeError(f"all {SLOTS} uid ranges are held by graders running now")
        return HELD["slot"]


def uid_for(number):
    """As root: the uid that submission number `number` runs as, unnamed and owning nothing else. Each grader
    process holds a range of uids of its own (held_slot), so two graders running at once (two `grade` calls of an
    autograder) never share one, and neither kills the other's child. None: not root, no uid of its own."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + held_slot() * 100_000 + number % 100_000
