"""Write starter code: copies of the scripts with the chosen exercises' functions blanked.

  python exercises/make_starter.py --exercises gae,ppo_loss,ppg_aux,vtrace,rlhf,grpo_rloo --out DIR

Each chosen function keeps its signature, decorators and docstring; its body becomes a stub that raises
NotImplementedError with the exercise's text (exercises/texts.py). A function that several scripts share
(compute_gae, policy_loss and value_loss are in ppo_procgen.py and ppg_procgen.py) gets the same stub in every copy,
so the shared blocks stay identical. Everything else is untouched, so the starter scripts import and run all that
does not need a blank. DIR also gets the public grader (BUNDLE: the grading engine, the exercises' texts, the cue
task and the public cases as data), so that in DIR

  python exercises/grade.py gae ppo_procgen.py

grades the student's copy. No solution ships: not the references, not the instructor's grader, not the hidden cases
(tests/test_exercises.py checks that no reference body is in the bundle)."""
import argparse
import ast
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from exercises.texts import EXERCISE_OF, EXERCISES, STUB_TEXT  # noqa: E402

SCRIPTS = ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py")
BUNDLE = ("__init__.py", "grading.py", "grade.py", "texts.py", "cue_env.py", "conftest.py", "test_grade.py", "cases")


def stub_body(function_name, indent):
    """The stub: a comment and a raise whose message is the exercise's text. The same for every copy."""
    text = STUB_TEXT[function_name]
    if '"""' in text or "\\" in text:
        raise ValueError(f"the text of {function_name} may not contain triple quotes or backslashes")
    exercise = EXERCISE_OF[function_name]
    body = "\n".join((indent + line) if line else "" for line in text.splitlines())
    return (f"{indent}# Exercise {exercise}: your code here (replace this raise). Check it with\n"
            f"{indent}#   python exercises/grade.py {exercise} <this script>\n"
            f'{indent}raise NotImplementedError("""\n{body}\n{indent}""")\n')


def blank_functions(source, function_names):
    """`source` with the bodies of the top-level functions in `function_names` replaced by their stubs.
    Returns the new source and the names that were blanked."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name in function_names):
            continue
        body = node.body
        has_docstring = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                         and isinstance(body[0].value.value, str))
        if has_docstring and len(body) == 1:
            start = body[0].end_lineno  # only a docstring: the stub goes after it
        else:
            start = (body[1] if has_docstring else body[0]).lineno - 1
        indent = " " * (body[0].col_offset)
        edits.append((start, node.end_lineno, stub_body(node.name, indent), node.name))
    for start, end, stub, _ in sorted(edits, reverse=True):
        lines[start:end] = [stub]
    return "".join(lines), [name for *_, name in edits]


def make_starter(exercises, out, with_graders=True, root=ROOT):
    """Write the starter scripts to `out`; returns {script: [blanked functions]}."""
    unknown = [name for name in exercises if name not in EXERCISES]
    if unknown:
        raise SystemExit(f"error: unknown exercise(s) {', '.join(unknown)}; choose from {', '.join(EXERCISES)}")
    functions = {function for name in exercises for function in EXERCISES[name]["functions"]}
    os.makedirs(out, exist_ok=True)
    written = {}
    for script in SCRIPTS:
        with open(os.path.join(root, script)) as f:
            source = f.read()
        new_source, blanked = blank_functions(source, functions)
        if not blanked:
            continue
        compile(new_source, script, "exec")  # the starter must at least parse
        with open(os.path.join(out, script), "w") as f:
            f.write(new_source)
        written[script] = blanked
    missing = functions - {name for names in written.values() for name in names}
    if missing:
        raise SystemExit(f"error: no script defines {', '.join(sorted(missing))}")
    if with_graders:
        copy_bundle(os.path.join(out, "exercises"))
    return written


def copy_bundle(target):
    """The public grader, and nothing else of exercises/."""
    if os.path.abspath(target) == HERE:
        raise SystemExit("error: --out may not be the repository itself (the bundle would replace exercises/)")
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for name in BUNDLE:
        source = os.path.join(HERE, name)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(target, name), ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, target)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exercises", default=",".join(EXERCISES),
                        help=f"comma-separated, from {', '.join(EXERCISES)} (default: all)")
    parser.add_argument("--out", required=True, help="folder for the starter scripts")
    parser.add_argument("--no-graders", action="store_true", help="do not copy the public grader into the folder")
    options = parser.parse_args(argv)
    exercises = [name.strip() for name in options.exercises.split(",") if name.strip()]
    written = make_starter(exercises, options.out, with_graders=not options.no_graders)
    for script, blanked in written.items():
        print(f"{os.path.join(options.out, script)}: blanked {', '.join(blanked)}")
    print(f"grade a filled-in copy with: python exercises/grade.py EXERCISE {os.path.join(options.out, 'SCRIPT')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
