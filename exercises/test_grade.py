"""One test per exercise: `pytest exercises/ --script path/to/ppo_procgen.py` grades the exercises that copy holds
(the others are skipped, saying why); `-m gae` picks one. The report is the failure message. Without --script,
each exercise grades the script of its name next to exercises/."""
import pytest

from exercises import grade, grading
from exercises.texts import EXERCISES


@pytest.mark.parametrize("exercise", [pytest.param(name, marks=getattr(pytest.mark, name)) for name in EXERCISES])
def test_exercise(exercise, request):
    script = request.config.getoption("--script")
    if script is not None:
        module = grading.load_script(script)
        missing = [f for f in EXERCISES[exercise]["functions"] if not hasattr(module, f)]
        if missing:
            pytest.skip(f"{script} does not hold exercise {exercise} ({', '.join(missing)} is in "
                        f"{EXERCISES[exercise]['script']})")
    lines = []
    passed = grade.grade(exercise, script, train=not request.config.getoption("--no-train"), out=lines.append)
    print("\n".join(lines))
    assert passed, "\n".join(lines)
