"""The child side of the instructor's sandbox (exercises/sandbox.py): a zygote that forks one child per submission;
each child runs a student's scripts and reports, as plain data, what their functions do on the inputs it is sent;
it decides nothing.

The parent copies this file, grading.py and texts.py (the public engine, which the students' bundle holds anyway)
into a fresh temporary folder and nothing else, and starts it once per batch as

  python -I -B grader/sandbox_child.py        (cwd: that folder; a minimal environment; no secret)

The zygote reads JSON lines on stdin. The first is {"preload": [modules]}: it imports them (the standard library's
and the repository scripts' own: torch, gymnasium, tyro, ...; never a student's code) and warms torch up, as root,
then runs nothing more of its own. Each later line is a job: {"job": n, "folder": its folder (submission/ holds the
copy of one submission), "results": a folder that only root may open}. For each job the zygote forks; it writes
{"job": n, "pid": p} on stdout right after the fork and {"job": n, "returncode": r} once it has reaped that child.
The job's request waits in results/request.json, so that the zygote never holds one (a child could find in its
copy of the zygote's memory whatever the zygote read): {"files": [...], "preload": [...], "uid": u, "limits": {...},
"case_seconds": s, "requests": [{"file", "function", "cases": [...]}]}, where a case holds its inputs only (no
expected outputs, no mistakes' answers).

The forked child (a copy-on-write image of the pristine zygote, which never ran a student's code nor held a case
or a grade) leaves the zygote's pipes (setsid), opens results/out and results/err as root, joins the cgroups
the parent made for it and enters namespaces of its own (join_cgroups, isolate), then drops to its uid and its
limits and writes one JSON line per event to results/out: {"file", "loaded"} or {"file",
"import_error"}, then {"file", "function", "index", "observation"} per case as soon as it is observed, then
{"done": true}. The student's own prints go to /dev/null. Nothing here is trusted by the parent: whatever a child
writes is read as data and judged there."""
import ctypes
import importlib
import json
import os
import resource
import select
import sys
import traceback

GRADER = os.path.dirname(os.path.abspath(__file__))
POLL_SECONDS = 0.05  # how often the zygote looks for ended children while no job line arrives


def set_limits(limits):
    """Lower this process's own limits before any student code runs (unprivileged processes may lower them).
    The address space may grow by memory_bytes beyond what the zygote's imports reserved: torch's CUDA build
    reserves about 3 GiB of address space at import, the CPU build 0.6 GiB, and neither is memory in use. A limit
    the grader inherited lower (an instructor's `ulimit -v`, a wrapper's cap) stays: no process may raise its hard
    limit, so each is at most what it is already."""
    reserved = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cpu = int(limits["cpu_seconds"])
    for name, value, hard in (("RLIMIT_AS", reserved + limits["memory_bytes"], None),
                              ("RLIMIT_FSIZE", limits["output_bytes"], None),
                              ("RLIMIT_NPROC", limits["processes"], None), ("RLIMIT_CORE", 0, None),
                              ("RLIMIT_CPU", cpu, cpu + 1)):  # SIGXCPU at the soft limit, SIGKILL a second later
        if value is None:  # no uid of its own: RLIMIT_NPROC would count all the user's processes
            continue
        resource.setrlimit(getattr(resource, name), lowered(getattr(resource, name), value,
                                                              value if hard is None else hard))


def lowered(which, soft, hard):
    """(soft, hard) for limit `which`, neither above the hard limit this process has now."""
    _, inherited = resource.getrlimit(which)
    if inherited != resource.RLIM_INFINITY:
        hard = min(hard, inherited)
        soft = min(soft, hard)
    return soft, hard


def private_channel(results):
    """The result channel: results/out, opened as root in a folder only root may open (a student cannot swap it
    for a link or a FIFO that the parent would then read); the parent made it and results/err. Descriptors 0
    and 1 (the zygote's pipes: a child that wrote there could speak for the zygote) go to /dev/null, 2 to
    results/err."""
    flags = os.O_WRONLY | os.O_NOFOLLOW  # made by the parent, with their space reserved
    out = os.open(os.path.join(results, "out"), flags)
    err = os.open(os.path.join(results, "err"), flags)
    devnull = os.open(os.devnull, os.O_RDWR)
    for descriptor, target in ((0, devnull), (1, devnull), (2, err)):
        os.dup2(target, descriptor)
    os.close(devnull)
    os.close(err)
    return os.fdopen(out, "w", buffering=1)


def preload(modules):
    """Import the modules the parent names (the standard library's and the repository scripts' own, never the
    student's code) while this process may still read every file: after drop_to, an interpreter whose standard
    library is not readable by other users (a pyenv under /root) can import only what is loaded already."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S112 - a module this platform lacks (one of the parent's is Windows-only, say)
            continue


def warm_up():
    """Run what the cases will run once, on our own tensors: torch imports parts of itself on first use (the 'meta'
    device's kernels, autograd's), which would otherwise count against the student's first case's time. One
    thread first: a fork of a process whose OpenMP pool has started can hang in its first parallel region."""
    import torch
    torch.set_num_threads(1)
    value = torch.ones(3, dtype=torch.float64, requires_grad=True)
    torch.autograd.grad((value * 2).sum(), [value])
    (torch.zeros_like(torch.ones(3, device="meta")) + 1).sum()
    torch.ones(3, dtype=torch.float32).double().numpy()


def drop_to(uid):
    """From root to the submission's own uid and group, for good: no access to the instructor's files, no signal
    to any other process (the zygote included), and RLIMIT_NPROC counts this submission's processes only."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


# Linux's seccomp constants (linux/seccomp.h, linux/filter.h, linux/audit.h) and the system calls that make
# namespaces, per machine: {machine: (audit architecture, unshare, clone, clone3)}.
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 272, 56, 435), "aarch64": (0xC00000B7, 97, 220, 435)}
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x45, 0x06


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class SockProgram(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def forbid_user_namespaces():
    """A seccomp filter (what Docker's default profile does): unshare() and clone() with CLONE_NEWUSER fail with
    EPERM, clone3() (whose flags a filter cannot read) with ENOSYS, so the C library falls back to clone(). In a
    user namespace of its own a process may mount file systems (a tmpfs beyond its private /tmp's size) and
    more; without one it may not. False where the machine or kernel has no such filter (the docs say what then)."""
    machine = SECCOMP_ARCHES.get(os.uname().machine)
    if machine is None:
        return False
    arch, unshare, clone, clone3 = machine
    eperm, enosys = 1, 38
    program = [
        (BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (BPF_JEQ_K, 1, 0, arch),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),  # another ABI (x32, i386 on x86_64): not filtered
        (BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (BPF_JEQ_K, 0, 1, clone3),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | enosys),
        (BPF_JEQ_K, 1, 0, unshare),
        (BPF_JEQ_K, 0, 3, clone),
        (BPF_LD_W_ABS, 0, 0, 16),  # the low half of args[0], the flags (little-endian)
        (BPF_JSET_K, 0, 1, CLONE_NEWUSER),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | eperm),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    filters = (SockFilter * len(program))(*[SockFilter(*row) for row in program])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    code = libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(SockProgram(len(program), filters)), 0, 0)
    return code == 0


def fresh_state(folder):
    """What a freshly started interpreter of its own would have: HOME and TMPDIR in its folder, new random seeds
    (a fork shares the zygote's), files private to its uid unless it says otherwise."""
    import random
    import tempfile

    import numpy as np
    os.environ["HOME"] = folder
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # recomputed from TMPDIR on first use
    random.seed()
    np.random.seed()
    os.umask(0o077)


def serve(request, channel, grading):
    """Load the student's files and observe each requested function on its cases; report each event."""
    def send(message):
        channel.write(json.dumps(grading.encode(message), allow_nan=True) + "\n")

    modules = {}
    for name in request["files"]:
        try:
            modules[name] = grading.load_script(name)
        except BaseException as error:  # SystemExit at import time too: the file does not import
            send({"file": name, "import_error": grading.error_record(error)})
            continue
        send({"file": name, "loaded": True})
    for item in request["requests"]:
        module = modules.get(item["file"])
        if module is None:
            continue
        cases = [grading.Case(case["function"], case["name"], grading.decode(case["inputs"]),
                              grads={key: None for key in case["grads"]}, kind=case["kind"])
                 for case in item["cases"]]

        def report(index, observed, file=item["file"], function=item["function"]):
            send({"file": file, "function": function, "index": index, "observation": observed})
        grading.observe_cases(module, cases, seconds=request["case_seconds"], report=report)
    send({"done": True})
    channel.close()


# Linux's constants (linux/sched.h, linux/mount.h): what Python 3.11's os module does not name yet.
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 0x1, 0x2, 0x4, 0x20
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 0x1000, 0x4000, 0x40000, 0x2
SHARED_FOLDERS = ("/var/tmp", "/dev/shm", "/run/lock")  # the folders any uid may write besides /tmp


def join_cgroups(folders):
    """As root: move this process (and so whatever it starts) into the submission's cgroups, which the parent made
    with the limits summed over all of the submission's processes (memory, processes)."""
    for folder in folders:
        with open(os.path.join(folder, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def interpreter_folders():
    """The folders of this interpreter under /tmp: its prefixes (a virtual environment's, with its installed
    packages, and the Python it was made from), outermost only. A private /tmp would hide them from the child,
    which may still import a module that the zygote did not load (a repository cloned under /tmp, say)."""
    prefixes = {os.path.normpath(path) for path in (sys.prefix, sys.exec_prefix, sys.base_prefix,
                                                     sys.base_exec_prefix)}
    under_tmp = {prefix for prefix in prefixes if prefix.startswith("/tmp/")}
    return sorted(path for path in under_tmp if not any(path.startswith(other + "/") for other in under_tmp))


def isolate(size, keep=()):
    """As root, before any student code runs: mount, IPC and network namespaces of this process's own (what it
    starts shares them), in which /tmp is a fresh tmpfs of `size` bytes and /var/tmp, /dev/shm and /run/lock are
    folders of it; the folders `keep` (interpreter_folders) stay at their paths in it, read-only. What the
    submission leaves there, System V IPC included, is gone with its last process; it has no network. False when
    the kernel or a container refuses (the parent then removes the leftovers itself)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET) != 0:
        return False
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # no mount of ours reaches the machine
        return False
    kept = []
    for path in keep:  # opened before the tmpfs hides them (in this namespace: a bind takes only its own mounts)
        try:
            kept.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
        except OSError:
            continue
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777".encode()) != 0:
        return False
    for path, descriptor in kept:
        bind_read_only(libc, descriptor, path)
        os.close(descriptor)
    for folder in SHARED_FOLDERS:
        if os.path.isdir(folder):
            inside = "/tmp/." + folder.strip("/").replace("/", "_")
            os.mkdir(inside)
            os.chmod(inside, 0o1777)
            libc.mount(inside.encode(), folder.encode(), None, MS_BIND, None)
    return True


def bind_read_only(libc, descriptor, path):
    """Mount the folder open as `descriptor` at `path` in the private /tmp, read-only, under folders of root's
    that no other uid may write: the submission reads the interpreter's files there and changes none."""
    parts = path.strip("/").split("/")
    for depth in range(2, len(parts) + 1):
        folder = "/" + "/".join(parts[:depth])
        if not os.path.isdir(folder):
            os.mkdir(folder)
            os.chmod(folder, 0o755)
    source, target = f"/proc/self/fd/{descriptor}".encode(), path.encode()
    if libc.mount(source, target, None, MS_BIND, None) != 0:
        return
    if libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None) != 0:
        libc.umount2(target, MNT_DETACH)  # never left writable


def private_home(scripts, uid):
    """The submission's folder inside its private /tmp: home/submission/ holding its scripts, owned by its uid."""
    home = "/tmp/home"
    os.makedirs(os.path.join(home, "submission"))
    for name, data in scripts.items():
        with open(os.path.join(home, "submission", name), "xb") as f:
            f.write(data)
        os.chown(os.path.join(home, "submission", name), uid, uid)
    for folder in (home, os.path.join(home, "submission")):
        os.chown(folder, uid, uid)
        os.chmod(folder, 0o700)
    return home


def run_job(job, grading):
    """The forked child: one submission, start to end; it never returns into the zygote's loop."""
    try:
        os.setsid()  # a process group of its own, which the parent kills whole
        # Should the machine run out of memory, the kernel's OOM killer takes the submission's processes
        # (they inherit this score) before the grader's.
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        channel = private_channel(job["results"])
        with open(os.path.join(job["results"], "request.json")) as f:
            request = json.load(f)
        home = job["folder"]
        if request["uid"] is not None:
            join_cgroups(request["cgroups"])
            scripts = {}
            for name in request["files"]:  # written by the parent; no student code has run yet
                with open(os.path.join(home, "submission", name), "rb") as f:
                    scripts[name] = f.read()
            if isolate(request["limits"]["files_bytes"], interpreter_folders()):
                home = private_home(scripts, request["uid"])
        fresh_state(home)
        os.chdir(os.path.join(home, "submission"))
        preload(request["preload"])  # the standard modules this submission imports, loaded by root as before
        if request["uid"] is not None:
            drop_to(request["uid"])
        forbid_user_namespaces()
        set_limits(request["limits"])  # from here on the student's code may run
        serve(request, channel, grading)
    except BaseException:  # noqa: BLE001 - whatever happened, this process must not go on as the zygote
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # no atexit hook of the student's runs (it could not change a grade anyway)


def tell(message):
    """One line to the parent on the zygote's stdout (a single write: lines never interleave)."""
    os.write(1, (json.dumps(message) + "\n").encode())


def reap(children):
    """Report every child that has ended; `children` maps their pids to their jobs."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        job = children.pop(pid, None)
        if job is not None:
            tell({"job": job, "returncode": os.waitstatus_to_exitcode(status)})


def zygote():
    """Preload, then fork a child per job line until stdin ends and every child has been reaped."""
    sys.path.insert(0, GRADER)  # -I leaves the script's folder off sys.path; the engine is next to this file
    import grading  # noqa: E402
    buffered = b""
    while b"\n" not in buffered:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        buffered += chunk
    first, buffered = buffered.split(b"\n", 1)
    preload(json.loads(first)["preload"])
    warm_up()
    tell({"ready": True, "threads": len(os.listdir("/proc/self/task"))})  # 1: safe to fork
    children = {}
    open_input = True
    while open_input or children:
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                children.clear()  # the other jobs' numbers: nothing this child needs
                run_job(job, grading)
            children[pid] = job["job"]
            tell({"job": job["job"], "pid": pid})
        if open_input and select.select([0], [], [], POLL_SECONDS)[0]:
            chunk = os.read(0, 1 << 20)
            open_input = bool(chunk)
            buffered += chunk
        elif not open_input:
            select.select([], [], [], POLL_SECONDS)
        reap(children)
    os._exit(0)  # torch's teardown would only make the parent wait


if __name__ == "__main__":
    zygote()
