"""The child side of the instructor's sandbox (exercises/sandbox.py): it runs a student's scripts and reports, as
plain data, what their functions do on the inputs it is sent; it decides nothing.

The parent copies this file, grading.py and texts.py (the public engine, which the students' bundle holds anyway)
into a fresh temporary folder with a copy of the submission and nothing else, and starts it as

  python -I -B grader/sandbox_child.py        (cwd: the submission's copy; a minimal environment)

It reads one JSON request from stdin: {"files": [...], "preload": [modules], "uid": u, "limits": {...},
"case_seconds": s, "requests": [{"file", "function", "cases": [...]}]}, where a case holds its inputs only (no
expected outputs, no mistakes' answers). It writes one JSON line per event to what was its stdout: {"file", "loaded"} or {"file", "import_error"}, then
{"file", "function", "index", "observation"} per case as soon as it is observed, then {"done": true}. The student's
own prints go to /dev/null. Nothing here is trusted by the parent: whatever this process sends is read as data and
judged there."""
import importlib
import json
import os
import resource
import sys

GRADER = os.path.dirname(os.path.abspath(__file__))


def set_limits(limits):
    """Lower this process's own limits before any student code runs (unprivileged processes may lower them)."""
    for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["output_bytes"]),
                        ("RLIMIT_NPROC", limits["processes"]), ("RLIMIT_CORE", 0)):
        if value is None:  # no uid of its own: RLIMIT_NPROC would count all the user's processes
            continue
        resource.setrlimit(getattr(resource, name), (value, value))
    cpu = int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later


def private_channel():
    """The result channel: a copy of stdout; fd 1 then goes to /dev/null, so that the student's prints (even
    os.write(1, ...)) cannot interleave with the results."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    return channel


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
    device's kernels, autograd's), which would otherwise count against the student's first case's time."""
    import torch
    value = torch.ones(3, dtype=torch.float64, requires_grad=True)
    torch.autograd.grad((value * 2).sum(), [value])
    (torch.zeros_like(torch.ones(3, device="meta")) + 1).sum()
    torch.ones(3, dtype=torch.float32).double().numpy()


def drop_to(uid):
    """From root to the submission's own uid and group, for good: no access to the instructor's files, no signal
    to any other process, and RLIMIT_NPROC counts this submission's processes only."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def main():
    request = json.load(sys.stdin)
    channel = private_channel()
    sys.path.insert(0, GRADER)  # -I leaves the script's folder off sys.path; the engine is next to this file
    import grading  # noqa: E402
    preload(request["preload"])
    warm_up()
    if request["uid"] is not None:
        drop_to(request["uid"])
    set_limits(request["limits"])  # from here on the student's code may run

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
    os._exit(0)  # no atexit hook of the student's runs (it could not change a grade anyway)


if __name__ == "__main__":
    main()
