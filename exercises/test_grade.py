"""One test per exercise: `pytest exercises/ -m gae --script path/to/ppo_procgen.py` grades that copy (the report is
the failure message). Without --script, each exercise grades the repository's own script."""
import pytest

from exercises import grade

EXERCISES = ["gae", "ppo_loss", "ppg_aux", "vtrace", "rlhf"]


@pytest.mark.parametrize("exercise", [pytest.param(name, marks=getattr(pytest.mark, name)) for name in EXERCISES])
def test_exercise(exercise, request):
    lines = []
    passed = grade.grade(exercise, request.config.getoption("--script"),
                         train=not request.config.getoption("--no-train"), out=lines.append)
    print("\n".join(lines))
    assert passed, "\n".join(lines)
