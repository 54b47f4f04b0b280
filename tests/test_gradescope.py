"""The Gradescope autograder (exercises/instructor.py gradescope): the bundle is built, unpacked into a folder laid
out as Gradescope's /autograder ($AUTOGRADER_ROOT), and its own run_autograder run as root on an honest, a wrong
and a hostile submission; results.json must follow Gradescope's schema (gradescope-autograders.readthedocs.io,
"Autograder Specifications"), and the hostile one reads neither the references nor the secret and cannot write
results.json itself."""
import contextlib
import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest
from conftest import ROOT

SECRET = "gradescope-S3CRET-51c2"
EXERCISE_POINTS = 40
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="Gradescope runs run_autograder as root; so must this")

WRONG = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    return torch.zeros_like(rewards)
'''
HOSTILE = WRONG + '''
import os as _os

_found = []
for _path in ("{root}/source/secret", "{root}/source/exercises/references.py", "{root}/submission_metadata.json"):
    try:
        with open(_path) as _f:
            _found.append(_f.read()[:2000])
    except OSError as _error:
        _found.append(type(_error).__name__)
for _path in ("{root}/results/results.json", "{root}/results/forged.json"):
    try:
        with open(_path, "w") as _f:
            _f.write('{{"score": 999, "tests": []}}')
        _found.append("WROTE " + _path)
    except OSError as _error:
        _found.append(type(_error).__name__)


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    raise RuntimeError("HOSTILE " + " | ".join(_found))
'''


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from exercises import instructor

    folder = tmp_path_factory.mktemp("bundle")
    (folder / "secret").write_text(SECRET + "\n")
    out = str(folder / "autograder.zip")
    assert instructor.main(["gradescope", "gae", "--out", out, "--secret-file", str(folder / "secret")]) == 0
    return out


PREVIOUS = "PREVIOUS-HIDDEN-OUTPUT-7f3e"  # a hidden test's output of an earlier submission, in the metadata
METADATA = {"id": 1, "users": [{"email": "student@example.edu", "name": "A Student", "id": 7},
                               {"email": "partner@example.edu", "name": "A Partner", "id": 8}],
            "previous_submissions": [{"score": 20.0, "results": {"tests": [
                {"name": "gae: hidden case", "output": PREVIOUS, "visibility": "after_published"}]}}]}


def run_bundle(bundle, source_text, hardlink=None, memory_cap=None):
    """Lay out /autograder in a folder every user may cross (as Gradescope's is), unpack the bundle into source/
    (files 0644: the zip's modes are not applied), with submission_metadata.json as Gradescope writes it (the
    group's names and emails, an earlier submission's results) and, with `hardlink`, that name in the submission a
    hard link to source/secret; run its run_autograder as root (with `memory_cap`, in a cgroup v1 memory cgroup of
    that many bytes, as a container's limit); returns (results.json, the folder's root, stdout and stderr, whether
    results/forged.json was written)."""
    from exercises import sandbox

    # Not in /tmp, /var/tmp or /dev/shm, which the child sees as folders of its private /tmp: in the grader's
    # folder (root's, 0711), a folder every user may cross, as Gradescope's /autograder is.
    root = tempfile.mkdtemp(dir=sandbox.work_folder(), prefix="autograder_test_")
    try:
        os.chmod(root, 0o755)
        with zipfile.ZipFile(bundle) as archive:
            archive.extractall(os.path.join(root, "source"))
        shutil.copy(os.path.join(root, "source", "run_autograder"), os.path.join(root, "run_autograder"))
        os.chmod(os.path.join(root, "run_autograder"), 0o755)
        os.makedirs(os.path.join(root, "submission"))
        os.makedirs(os.path.join(root, "results"))
        os.chmod(os.path.join(root, "results"), 0o777)  # as open as it may be: the grader closes it
        with open(os.path.join(ROOT, "ppo_procgen.py")) as f:
            script = f.read()
        with open(os.path.join(root, "submission", "ppo_procgen.py"), "w") as f:
            f.write(script + source_text.format(root=root))
        if hardlink:
            os.link(os.path.join(root, "source", "secret"), os.path.join(root, "submission", hardlink))
        with open(os.path.join(root, "submission_metadata.json"), "w") as f:
            json.dump(METADATA, f)
        os.chmod(os.path.join(root, "submission_metadata.json"), 0o644)
        environment = {key: value for key, value in os.environ.items() if key != "GRADER_SECRET"}
        environment.update(AUTOGRADER_ROOT=root, AUTOGRADER_PYTHON=sys.executable)
        with memory_cgroup(memory_cap) as join:
            ran = subprocess.run([os.path.join(root, "run_autograder")], cwd=root, env=environment,
                                 capture_output=True, text=True, timeout=300, preexec_fn=join)
        with open(os.path.join(root, "results", "results.json")) as f:
            results = json.load(f)
        forged = os.path.exists(os.path.join(root, "results", "forged.json"))
        return results, root, ran.stdout + ran.stderr, forged
    finally:
        shutil.rmtree(root)


@contextlib.contextmanager
def memory_cgroup(limit):
    """A cgroup v1 memory cgroup of `limit` bytes under this process's own (a container's limit), or nothing
    with None; yields what joins it (a preexec_fn). On leaving, it must hold no process and no sub-cgroup: what
    the grader leaves behind fails the test (and is then cleared)."""
    if limit is None:
        yield None
        return
    from exercises import sandbox

    own = sandbox.own_cgroup("memory")
    base = os.path.join(sandbox.CGROUP, "memory", (own or "").lstrip("/"))
    if os.path.exists(os.path.join(sandbox.CGROUP, "cgroup.controllers")) or not os.access(base, os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory hierarchy to stand for a container's limit")
    folder = tempfile.mkdtemp(dir=base, prefix="autograder_test_")  # mkdir in cgroupfs makes a cgroup
    with open(os.path.join(folder, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))

    def join():
        with open(os.path.join(folder, "cgroup.procs"), "w") as f:
            f.write("0")

    try:
        yield join
    finally:
        left = [entry.name for entry in os.scandir(folder) if entry.is_dir()]
        with open(os.path.join(folder, "cgroup.procs")) as f:
            members = [int(pid) for pid in f.read().split()]
        for pid in members:
            os.kill(pid, signal.SIGKILL)
        for name in left:
            sandbox.remove_cgroups([os.path.join(folder, name)])
        sandbox.remove_cgroups([folder])
    assert not left and not members, (left, members)


def submission_processes():
    """The pids of every live process that runs as a submission's uid (the sandbox's uids start at UID_BASE). A
    zombie is dead, holds no memory and runs nothing: it waits for its new parent (pid 1) to reap it."""
    from exercises import sandbox

    pids = []
    for entry in os.scandir("/proc"):
        try:
            with open(os.path.join(entry.path, "status")) as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            uid, state = int(fields["Uid"].split()[0]), fields["State"].split()[0]
        except (OSError, ValueError, KeyError, IndexError):
            continue
        if uid >= sandbox.UID_BASE and state != "Z":
            pids.append(int(entry.name))
    return pids


def check_schema(results):
    """Gradescope's results.json: a numeric score, tests with name, score, max_score, output and a visibility."""
    assert isinstance(results["score"], (int, float)) and isinstance(results["output"], str)
    assert results["tests"]
    for test in results["tests"]:
        assert isinstance(test["name"], str) and isinstance(test["output"], str)
        assert isinstance(test["score"], (int, float)) and isinstance(test["max_score"], (int, float))
        assert test["visibility"] in ("visible", "hidden", "after_due_date", "after_published")
    assert abs(sum(test["max_score"] for test in results["tests"]) - EXERCISE_POINTS) < 1e-3
    assert abs(sum(test["score"] for test in results["tests"]) - results["score"]) < 1e-2
    assert any(test["visibility"] == "after_published" for test in results["tests"])  # the hidden cases


def test_the_bundle_holds_what_gradescope_runs(bundle):
    with zipfile.ZipFile(bundle) as archive:
        names = set(archive.namelist())
        setup = archive.read("setup.sh").decode()
        modes = {info.filename: (info.external_attr >> 16) & 0o777 for info in archive.infolist()}
    assert modes["secret"] == modes["exercises/references.py"] == 0o600  # root's alone once unpacked
    assert modes["run_autograder"] & 0o100 and not modes["run_autograder"] & 0o077
    assert {"setup.sh", "run_autograder", "secret", "exercises/instructor.py", "exercises/references.py",
            "ppo_procgen.py", "requirements.txt"} <= names
    assert "download.pytorch.org/whl/cpu" in setup and "requirements.txt" in setup
    with zipfile.ZipFile(bundle) as archive:
        for name in ("setup.sh", "run_autograder"):  # both parse as bash
            checked = subprocess.run(["bash", "-n"], input=archive.read(name), capture_output=True)
            assert checked.returncode == 0, (name, checked.stderr)


@pytest.fixture(scope="module")
def graded(bundle):
    """Two submissions through run_autograder, once each (a few seconds each), for the tests that read them: the
    honest script, and the hostile one, which also reads the metadata file and hands in vtrace.py as a hard link
    to source/secret."""
    return {"honest": run_bundle(bundle, ""), "hostile": run_bundle(bundle, HOSTILE, hardlink="vtrace.py")}


def test_an_honest_and_a_hostile_wrong_submission_through_run_autograder(graded):
    honest, _, log, _ = graded["honest"]
    check_schema(honest)
    assert honest["score"] == EXERCISE_POINTS, log[-3000:]
    hostile, root, log, forged = graded["hostile"]  # a wrong compute_gae too
    check_schema(hostile)
    text = json.dumps(hostile)
    assert "HOSTILE" in text, log[-3000:]  # it ran and told what it found
    assert SECRET not in text and "def gae" not in text  # neither the secret nor the references read
    assert "WROTE" not in text and not forged  # nothing written in results/
    assert 0 < hostile["score"] < EXERCISE_POINTS  # its other functions (the repository's) still score
    failed = [test for test in hostile["tests"] if test["score"] < test["max_score"]]
    assert failed and all(test["name"].startswith("gae: compute_gae") for test in failed)


def test_a_grader_that_cannot_grade_still_writes_a_zero_with_its_reason(bundle, monkeypatch, tmp_path):
    from exercises import instructor

    os.makedirs(tmp_path / "results")
    monkeypatch.setenv("AUTOGRADER_ROOT", str(tmp_path))  # no submission folder at all
    assert instructor.gradescope_run("gae", SECRET, None) == 0
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["score"] == 0 and "not graded" in results["output"]
    assert results["tests"] and all(test["score"] == 0 for test in results["tests"])


MEMORY_HOG = '''
import os as _os
import select as _select
import sys as _sys
import time as _time

# 12 processes of 270 MB each, more than the container holds, each a fresh small interpreter (so that the
# grader and its zygote, which hold torch, are the container's largest processes) that lives on after the grade.
# The submission waits until each has its 270 MB or has died, so that the memory is taken before it is graded.
_ready, _tell = _os.pipe()
_HOLD = ("import os, time; block = bytes([1]) * 270_000_000; os.write(%d, b'.'); "
         "time.sleep(120)" % _tell)
_children = 0
for _ in range(12):
    try:
        _pid = _os.fork()
    except OSError:
        break
    if _pid == 0:
        _os.set_inheritable(_tell, True)
        for _python in (_sys.executable, "/usr/bin/python3"):  # the first this uid may run
            try:
                _os.execv(_python, [_python, "-I", "-S", "-c", _HOLD])
            except OSError:
                pass
        _os._exit(0)
    _children += 1
_settled, _deadline = 0, _time.monotonic() + 60
while _settled < _children and _time.monotonic() < _deadline:
    if _select.select([_ready], [], [], 0.1)[0]:
        _settled += len(_os.read(_ready, 64))
    while _settled < _children:
        try:
            _pid, _ = _os.waitpid(-1, _os.WNOHANG)
        except ChildProcessError:
            break
        if _pid == 0:
            break
        _settled += 1
'''


def test_before_publication_the_visible_output_holds_no_hidden_case_and_no_seed(graded):
    from exercises import instructor

    for name in ("honest", "hostile"):  # the hostile compute_gae fails every case
        results = graded[name][0]
        check_schema(results)
        hidden = [test["name"].split(": ", 1)[1] for test in results["tests"]
                  if test["visibility"] == "after_published"]
        shown = [test["name"].split(": ", 1)[1] for test in results["tests"] if test["visibility"] == "visible"]
        assert hidden and shown
        assert all(name not in results["output"] for name in hidden), results["output"]
        assert all(name in results["output"] for name in shown)
        seed = instructor.submission_seed(SECRET, METADATA["users"][0]["email"])
        assert str(seed) not in results["output"] and "seed" not in results["output"]
        assert "total" not in results["output"].split("hidden cases", 1)[0]
        assert all(user["email"] not in results["output"] for user in METADATA["users"])
    wrong = [test for test in results["tests"] if test["score"] < test["max_score"]]
    assert any(test["visibility"] == "after_published" for test in wrong)  # their hints wait for publication


def test_the_metadata_file_is_out_of_the_submissions_reach(graded):
    results, _, log, _ = graded["hostile"]
    text = json.dumps(results)
    assert "HOSTILE PermissionError | PermissionError | PermissionError" in text, log[-3000:]  # the third: metadata
    assert PREVIOUS not in text and "partner@example.edu" not in text


def test_a_hard_link_to_a_grader_file_is_refused(graded):
    results, _, log, _ = graded["hostile"]
    text = json.dumps(results)
    assert SECRET not in text and SECRET not in log
    assert "vtrace.py is a hard link" in results["output"], results["output"]


def test_a_submission_past_the_containers_memory_meets_its_own_limit(bundle):
    """Under a container's 3 GiB the submission forks 12 processes of 270 MB: its own cgroup, below what the
    container has left, stops it; the grader writes its grade, and nothing of it outlives the grade."""
    from exercises import sandbox

    pids = os.path.join(sandbox.CGROUP, "pids", (sandbox.own_cgroup("pids") or "").lstrip("/"))
    before, cgroups = set(submission_processes()), set(os.listdir(pids))
    results, _, log, _ = run_bundle(bundle, MEMORY_HOG, memory_cap=3 << 30)
    check_schema(results)
    text = json.dumps(results) + log
    assert "ZygoteError" not in text and "not graded" not in text, log[-3000:]
    # Graded in full (its limit killed only the 270 MB processes) or 0 with the reason (it killed the submission's).
    assert results["score"] == 40 or "killed at its memory limit" in results["output"], results["output"][:3000]
    assert set(submission_processes()) <= before
    assert not [entry for entry in set(os.listdir(pids)) - cgroups if entry.startswith("course_grader_")]
