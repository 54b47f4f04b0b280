"""benchmarks/mutate.py and its catalogue benchmarks/mutants.toml, without running a mutant of the scripts: every
mutant still applies to the code as it is (a catalogue cannot go stale silently), names tests that exist, and the
runner tells a caught, a missed, an equivalent, a stale and a timed-out mutant apart on a tiny project of its own."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("mutate", os.path.join(ROOT, "benchmarks", "mutate.py"))
mutate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutate)

CATALOGUE = mutate.load_catalogue()


def test_the_catalogue_has_at_least_40_mutants_with_unique_ids_in_the_four_scripts():
    ids = [mutant["id"] for mutant in CATALOGUE]
    assert len(ids) >= 40
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)
    assert {mutant["file"] for mutant in CATALOGUE} == {"ppo_procgen.py", "ppg_procgen.py", "vtrace.py",
                                                        "ppo_rlhf_toy.py"}
    for mutant in CATALOGUE:
        assert {"id", "file", "original", "replacement", "description", "tests"} <= set(mutant), mutant["id"]
        assert mutant["description"].strip() and mutant["tests"], mutant["id"]
        assert set(mutant) <= {"id", "file", "original", "replacement", "description", "tests", "equivalent",
                               "timeout"}, mutant["id"]


@pytest.mark.parametrize("mutant", CATALOGUE, ids=[mutant["id"] for mutant in CATALOGUE])
def test_each_mutant_applies_once_to_one_line_and_changes_it(mutant):
    """The original text occurs exactly once in its file and within one line, and the replacement differs (a mutant
    that does not compile is reported as an `error` by the runner, never as caught)."""
    with open(os.path.join(ROOT, mutant["file"])) as f:
        text = f.read()
    assert "\n" not in mutant["original"] and "\n" not in mutant["replacement"]
    assert text.count(mutant["original"]) == 1, f"{mutant['id']}: its original text is not once in {mutant['file']}"
    assert mutant["replacement"] != mutant["original"]
    mutated = mutate.apply_mutant(text, mutant)
    assert mutated is not None and mutated != text


def test_every_test_a_mutant_names_exists():
    """Each selection names test files, or node ids file::test[params] whose test function is defined there."""
    sources = {}
    for mutant in CATALOGUE:
        for test in mutant["tests"]:
            path, _, name = test.partition("::")
            assert path.startswith("tests/test_") and path.endswith(".py"), (mutant["id"], test)
            assert os.path.exists(os.path.join(ROOT, path)), (mutant["id"], test)
            if name:
                if path not in sources:
                    sources[path] = open(os.path.join(ROOT, path)).read()
                function = name.split("[")[0]
                assert f"\ndef {function}(" in sources[path], (mutant["id"], test)


# ---- the runner on a tiny project: one function, two tests of it
CALC = "def add(a, b):\n    return a + b\n\n\ndef wait():\n    return 0\n"
TESTS = """\
    import calc


    def test_add_on_a_hand_computation():
        assert calc.add(2, 3) == 5


    def test_wait_returns():
        calc.wait()
    """


@pytest.fixture
def tiny_project(tmp_path):
    (tmp_path / "calc.py").write_text(CALC)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_calc.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    return tmp_path


def tiny_mutant(id, original, replacement, **extra):
    return {"id": id, "file": "calc.py", "original": original, "replacement": replacement, "description": id,
            "tests": ["tests/test_calc.py"], **extra}


def test_the_runner_tells_caught_missed_equivalent_stale_and_timeout_apart(tiny_project):
    caught = mutate.run_mutant(tiny_mutant("minus", "a + b", "a - b"), str(tiny_project))
    assert caught["status"] == "caught"
    assert caught["caught_by"] == "tests/test_calc.py::test_add_on_a_hand_computation"
    missed = mutate.run_mutant(tiny_mutant("swapped", "a + b", "b + a"), str(tiny_project))
    assert missed["status"] == "missed" and missed["caught_by"] is None
    argued = tiny_mutant("swapped", "a + b", "b + a", equivalent="addition commutes")
    assert mutate.classify(argued, 0, "") == ("equivalent", None)  # missed, as argued
    assert mutate.classify(argued, 1, "FAILED tests/test_calc.py::test_add - assert 2 == 5")[0] == "caught"
    for original in ("a * b", "return"):  # gone from the file; more than once in it
        stale = mutate.run_mutant(tiny_mutant("stale", original, "x"), str(tiny_project))
        assert stale["status"] == "stale" and stale["caught_by"] is None
    slow = tiny_mutant("slow", "    return 0", "    __import__('time').sleep(60)", timeout=1)
    assert mutate.run_mutant(slow, str(tiny_project))["status"] == "timeout"
    assert (tiny_project / "calc.py").read_text() == CALC  # the tree itself is never written


def test_a_failing_baseline_stops_the_runner_with_one_line(tiny_project, tmp_path_factory):
    (tiny_project / "calc.py").write_text(CALC.replace("a + b", "a + b + 1"))
    catalogue = tmp_path_factory.mktemp("catalogue") / "mutants.toml"
    catalogue.write_text('[[mutant]]\nid = "minus"\nfile = "calc.py"\noriginal = "a + b"\nreplacement = "a - b"\n'
                         'description = "minus"\ntests = ["tests/test_calc.py"]\n')
    out = tmp_path_factory.mktemp("out") / "mutation.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "mutate.py"), "--root",
                             str(tiny_project), "--catalogue", str(catalogue), "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and not out.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "tests/test_calc.py::test_add_on_a_hand_computation" in lines[0], lines
