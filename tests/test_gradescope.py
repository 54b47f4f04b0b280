"""The Gradescope autograder (exercises/instructor.py gradescope): the bundle is built, unpacked into a folder laid
out as Gradescope's /autograder ($AUTOGRADER_ROOT), and its own run_autograder run as root on an honest, a wrong
and a hostile submission; results.json must follow Gradescope's schema (gradescope-autograders.readthedocs.io,
"Autograder Specifications"), and the hostile one reads neither the references nor the secret and cannot write
results.json itself."""
import json
import os
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
for _path in ("{root}/source/secret", "{root}/source/exercises/references.py"):
    try:
        with open(_path) as _f:
            _found.append(_f.read()[:200])
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


def run_bundle(bundle, source_text):
    """Lay out /autograder in a folder every user may cross (as Gradescope's is), unpack the bundle into source/
    (files 0644: the zip's modes are not applied),
    run its run_autograder as root; returns (results.json, the folder's root, stdout and stderr)."""
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
        with open(os.path.join(root, "submission_metadata.json"), "w") as f:
            json.dump({"id": 1, "users": [{"email": "student@example.edu", "name": "A Student", "id": 7}]}, f)
        environment = {key: value for key, value in os.environ.items() if key != "GRADER_SECRET"}
        environment.update(AUTOGRADER_ROOT=root, AUTOGRADER_PYTHON=sys.executable)
        ran = subprocess.run([os.path.join(root, "run_autograder")], cwd=root, env=environment, capture_output=True,
                             text=True, timeout=300)
        with open(os.path.join(root, "results", "results.json")) as f:
            results = json.load(f)
        forged = os.path.exists(os.path.join(root, "results", "forged.json"))
        return results, root, ran.stdout + ran.stderr, forged
    finally:
        shutil.rmtree(root)


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


def test_an_honest_and_a_hostile_wrong_submission_through_run_autograder(bundle):
    honest, _, log, _ = run_bundle(bundle, "")
    check_schema(honest)
    assert honest["score"] == EXERCISE_POINTS, log[-3000:]
    hostile, root, log, forged = run_bundle(bundle, HOSTILE)  # a wrong compute_gae too
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
