"""The docs cannot drift from the code (issue 20). Every `python <script>.py ...` and `torchrun ... <script>.py ...`
command in README.md and docs/*.md parses against that script's flags (tyro, in-process; the argparse tools: their
flags exist; bench.py: its --config/--common flags parse against its --script); every --flag named on a page exists;
every cited result file and figure exists and every committed benchmarks/results/*.json is cited; the speed, bf16 and
lag tables agree with their JSON. Fast: nothing runs but the parsers."""
import ast
import contextlib
import functools
import glob
import importlib
import importlib.util
import io
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FIRST_COMMANDS = [  # the README's first two shell commands; CI (.ci/run) runs the second verbatim
    "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt && python ppg_procgen.py "
    "--env-id starpilot",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt && python -m pytest -q tests",
]
TYRO_SCRIPTS = {  # script -> (module, dataclass): parsed in-process with tyro.cli(Args, args=argv)
    "ppo_procgen.py": ("ppo_procgen", "Args"), "ppg_procgen.py": ("ppg_procgen", "Args"),
    "vtrace.py": ("vtrace", "Args"),
    "ppo_rlhf_toy.py": ("ppo_rlhf_toy", "Args"), "benchmarks/results.py": ("benchmarks/results.py", "Args"),
    "benchmarks/rlhf_seeds.py": ("benchmarks/rlhf_seeds.py", "SeedsArgs"),
}
PROCGEN_SCRIPTS = ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py")
# Flags of other programs that the pages name: torchrun, SLURM, pip, and pytest's options added in exercises/.
EXTERNAL_FLAGS = {"--nproc-per-node", "--standalone", "--nnodes", "--rdzv-id", "--rdzv-backend", "--rdzv-endpoint",
                  "--signal", "--requeue", "--index-url", "--dry-run", "--script", "--no-train", "--help",
                  "--logdir"}
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1"}
CODE_LANGUAGES = {"", "bash", "sh", "shell", "console", "yaml"}  # yaml: shell in a block scalar


def pages():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def relative(path):
    return os.path.relpath(path, ROOT)


# ---- reading the pages ----
def code_blocks(text):
    """(language, body) of each fenced block."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```", text, flags=re.S | re.M)


def prose(text):
    return re.sub(r"^```[\w-]*\n.*?^```", "", text, flags=re.S | re.M)


def inline_spans(text):
    spans = re.findall(r"`([^`]+)`", prose(text))  # a span may wrap onto the next line
    return [" ".join(span.replace("\\|", "|").split()) for span in spans]


def shell_lines(body):
    """The block's lines with backslash continuations joined."""
    return body.replace("\\\n", " ").splitlines()


def commands_of(text):
    """Every python/torchrun invocation of a .py file on a page: (script, argv, the text it came from)."""
    sources = [line for language, body in code_blocks(text) if language in CODE_LANGUAGES for line in shell_lines(body)]
    sources += [span for span in inline_spans(text) if re.search(r"\b(python3?|torchrun|srun)\b", span)]
    found = []
    for source in sources:
        try:
            tokens = shlex.split(source, comments=True)
        except ValueError:  # half a command in prose, e.g. an unclosed quote
            continue
        for start, token in enumerate(tokens):
            if os.path.basename(token) not in ("python", "python3", "torchrun"):
                continue
            rest = tokens[start + 1 :]
            if os.path.basename(token) == "torchrun":
                scripts = [i for i, t in enumerate(rest) if t.endswith(".py")]
                if not scripts:
                    continue
                rest = rest[scripts[0]:]
            if not rest or not rest[0].endswith(".py") or "<" in rest[0]:
                continue  # python -m ..., python -c ..., python <script>.py
            argv = []
            for word in rest[1:]:
                if word in SHELL_SEPARATORS or word.startswith((">", "2>")):
                    break
                ends_statement = word.endswith(";")
                word = word.rstrip(";")
                argv.append("1" if "$" in word else word)  # a shell variable: any value of the flag's type
                if ends_statement:
                    break
            found.append((rest[0], argv, source))
    return found


# ---- the scripts' flags ----
@functools.lru_cache(maxsize=None)
def load(name):
    if name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("docs_" + os.path.basename(name)[:-3], os.path.join(ROOT, name))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name)


def dataclass_of(script):
    module_name, class_name = TYRO_SCRIPTS[script]
    return getattr(load(module_name), class_name)


def tyro_flags(cls):
    names = set()
    for field in cls.__dataclass_fields__.values():
        flag = "--" + field.name.replace("_", "-")
        names.add(flag)
        if field.type in (bool, "bool"):
            names.add("--no-" + field.name.replace("_", "-"))
    return names


@functools.lru_cache(maxsize=None)
def argparse_flags(script):
    """The option strings of every add_argument call in an argparse tool, read from its source (nothing runs)."""
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    return {arg.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")}


def flags_of(script):
    if script in TYRO_SCRIPTS:
        return tyro_flags(dataclass_of(script))
    return argparse_flags(script)


def tyro_error(script, argv):
    """None if argv parses against the script's dataclass, else tyro's message."""
    import tyro
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            tyro.cli(dataclass_of(script), args=argv)
        except SystemExit as error:
            if error.code not in (0, None):
                return out.getvalue().strip()[-600:] or f"exit {error.code}"
    return None


def bench_problems(argv):
    """bench.py: its own flags, then each configuration (--common + the config's flags) against --script."""
    takes_value = {"--script", "--config", "--common", "--iterations", "--warmup", "--repeats", "--out"}
    bench_flags = flags_of("benchmarks/bench.py")
    problems = [f"unknown bench.py flag {word}" for previous, word in zip([""] + argv, argv)
                if word.startswith("--") and previous not in takes_value and word not in bench_flags]
    values = {"--script": "ppo_procgen.py", "--common": ""}
    configs = []
    for flag, value in zip(argv, argv[1:]):
        if flag in values:
            values[flag] = value
        if flag == "--config":
            configs.append(value.split("=", 1)[1] if "=" in value else "")
    if values["--script"] not in PROCGEN_SCRIPTS:
        return problems + [f"bench.py --script {values['--script']}: not one of {PROCGEN_SCRIPTS}"]
    for flags in configs or [""]:
        words = shlex.split(values["--common"]) + shlex.split(flags)
        if "--nproc-per-node" in words:  # bench.py's own: it runs the configuration under torchrun
            position = words.index("--nproc-per-node")
            del words[position : position + 2]
        error = tyro_error(values["--script"], words)
        if error:
            problems.append(f"bench.py --script {values['--script']} config {flags!r}: {error}")
    return problems


def command_problems(script, argv):
    path = os.path.join(ROOT, script)
    if not os.path.exists(path):
        return [f"no such script {script}"]
    if "--help" in argv or "-h" in argv:
        return []
    if script == "benchmarks/bench.py":
        return bench_problems(argv)
    if script in TYRO_SCRIPTS:
        error = tyro_error(script, argv)
        return [error] if error else []
    known = flags_of(script)
    return [f"unknown flag {a.split('=')[0]}" for a in argv if a.startswith("--") and a.split("=")[0] not in known]


def page_problems(text):
    problems = []
    for script, argv, source in commands_of(text):
        problems += [f"`{source.strip()}`: {problem}" for problem in command_problems(script, argv)]
    return problems


def all_flags():
    names = set(EXTERNAL_FLAGS)
    for script in TYRO_SCRIPTS:
        names |= flags_of(script)
    for script in glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.py"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "exercises", "*.py")):
        if relative(script) not in TYRO_SCRIPTS:
            names |= argparse_flags(relative(script))
    return names


def named_flags(text):
    """--flags in the page's inline code (not its commands); underscores mark other codebases' flags (--n_pi)."""
    names = set()
    for span in inline_spans(text):
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", span):
            if "_" not in flag:
                names.add(flag.rstrip("-"))
    return names


# ---- the tests ----
def test_the_readme_starts_with_the_two_commands_ci_runs():
    text = open(os.path.join(ROOT, "README.md")).read()
    commands = [body.strip() for language, body in code_blocks(text) if language in ("bash", "sh", "")]
    assert commands[:2] == FIRST_COMMANDS
    assert FIRST_COMMANDS[1] in open(os.path.join(ROOT, ".ci", "run")).read()
    assert len(text.splitlines()) <= 250, "README.md is the front page: at most 250 lines"


@pytest.mark.parametrize("page", pages(), ids=relative)
def test_every_command_parses_against_its_script(page):
    text = open(page).read()
    assert page_problems(text) == []


def test_the_pages_run_the_scripts():
    """The extractor finds the commands (a regex that found nothing would pass everything)."""
    found = {script for page in pages() for script, _, _ in commands_of(open(page).read())}
    assert set(PROCGEN_SCRIPTS) | {"ppo_rlhf_toy.py", "benchmarks/bench.py", "benchmarks/results.py"} <= found


@pytest.mark.parametrize("page", pages(), ids=relative)
def test_every_named_flag_exists(page):
    unknown = named_flags(open(page).read()) - all_flags()
    assert not unknown, f"{relative(page)} names flags no script has: {sorted(unknown)}"


@pytest.mark.parametrize("page, script", [("docs/ppo.md", "ppo_procgen.py"), ("docs/ppg.md", "ppg_procgen.py"),
                                          ("docs/impala.md", "vtrace.py"), ("docs/rlhf.md", "ppo_rlhf_toy.py")])
def test_a_pages_flags_section_names_its_scripts_flags(page, script):
    text = open(os.path.join(ROOT, page)).read()
    section = re.search(r"^## Flags\n(.*?)(?=^## )", text, flags=re.S | re.M).group(1)
    assert named_flags(section) - flags_of(script) - {"--help"} == set()


def test_the_resume_flags_are_listed_exactly():
    text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
    listed = re.search(r"besides `--resume`, `--eval-only` and `--checkpoint` themselves:\n\n(.*?)\n\n", text, re.S)
    flags = re.findall(r"`(--[a-z-]+)`", listed.group(1))
    for script in PROCGEN_SCRIPTS:
        expected = ["--" + name.replace("_", "-") for name in load(script[:-3]).RUNTIME_FLAGS]
        assert flags == expected, f"{script}'s RUNTIME_FLAGS"


def cited_files(text):
    paths = set(re.findall(r"(?:benchmarks|docs)/[\w./-]+\.(?:json|png)", text))
    return {path for path in paths if "<" not in path}


def test_every_cited_result_and_figure_exists():
    missing = []
    for page in pages() + [os.path.join(ROOT, "CHANGELOG.md")]:
        text = open(page).read()
        for path in cited_files(text):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{relative(page)}: {path}")
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):  # relative to the page
            if not os.path.exists(os.path.join(os.path.dirname(page), image)):
                missing.append(f"{relative(page)}: image {image}")
    assert missing == []


def test_every_committed_result_file_is_cited():
    committed = subprocess.run(["git", "ls-files", "benchmarks/results/*.json"], cwd=ROOT, capture_output=True,
                               text=True).stdout.split()
    if not committed:  # not a git checkout: the files on disk
        committed = [relative(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json"))]
    cited = set()
    for page in pages():
        cited |= cited_files(open(page).read())
    assert sorted(set(committed) - cited) == []


# ---- numbers in tables against their JSON ----
def table_rows(text):
    lines = [line.strip() for line in text.splitlines()]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines
            if line.startswith("|") and not line.startswith("|---")]


def test_the_speed_table_matches_its_json():
    text = open(os.path.join(ROOT, "docs", "speed.md")).read()
    checked = 0
    for row in table_rows(text):
        match = re.search(r"`(benchmarks/results/[\w.-]+\.json)` \(`([^`]+)`\)", row[-1])
        if not match:
            continue
        data = json.load(open(os.path.join(ROOT, match.group(1))))
        sps_cell = row[2]
        if "results" in data:
            result = next(r for r in data["results"] if r["config"] == match.group(2))
            expected = f"{round(result['sps_median'])}"
            if "(" in sps_cell and "-" in sps_cell.split("(")[1].split(")")[0]:
                expected += f" ({round(result['sps_min'])}-{round(result['sps_max'])})"
            assert sps_cell.startswith(expected), (row[0], sps_cell, expected)
            for phase in ("rollout", "update"):
                number = re.search(rf"\b{phase} ([\d.]+)", row[3])
                if number:
                    digits = len(number.group(1).split(".")[1])
                    assert float(number.group(1)) == round(result["seconds_per_iteration"][phase], digits), \
                        (row[0], phase)
            assert row[4] == f"{result['peak_rss_gb']:.1f} GB", row[0]
        else:  # cpu_vtrace_ab.json: medians over alternated rounds
            expected = f"{round(data['median_over_rounds'][match.group(2)]['sps_overall'])}"
            assert sps_cell.startswith(expected), (row[0], sps_cell, expected)
        checked += 1
    assert checked >= 10


def test_the_bf16_learning_table_matches_its_json():
    text = open(os.path.join(ROOT, "docs", "speed.md")).read()
    summary = json.load(open(os.path.join(ROOT, "benchmarks", "results", "cpu_amp_learning.json")))["summary"]
    rows = {row[0]: row for row in table_rows(text)}
    for label, key in [("PPO float32", "PPO fp32"), ("PPO `--amp`", "PPO bf16"), ("PPG float32", "PPG fp32"),
                       ("PPG `--amp`", "PPG bf16")]:
        for column, name in [(1, "final_eval"), (2, "mean_train_return")]:
            mean, error = summary[key][name]
            assert rows[label][column] == f"{mean:.2f} ± {error:.2f}", (label, name)
        assert rows[label][3] == f"{summary[key]['seconds'][0]:.1f}", label


def test_the_allreduce_figures_match_their_json():
    text = " ".join(open(os.path.join(ROOT, "docs", "speed.md")).read().split())
    for result in json.load(open(os.path.join(ROOT, "benchmarks", "results", "cpu_allreduce.json")))["results"]:
        figure = (f"{result['all_reduce_ms_median']:.2f} ms" + " median" * ("PPO" in result["network"][:3])
                  + f" ({result['all_reduce_ms_min']:.2f}-{result['all_reduce_ms_max']:.2f})")
        assert figure in text, figure
        assert f"{result['parameters']:,} parameters" in text


def test_the_lag_table_matches_its_json():
    text = open(os.path.join(ROOT, "docs", "impala.md")).read()
    runs = json.load(open(os.path.join(ROOT, "benchmarks", "results", "lag_experiment.json")))["results"]
    header = next(row for row in table_rows(text) if row[:2] == ["task", "correction"])
    lags = [int(cell.split("=")[1]) for cell in header[2:]]
    checked = 0
    for row in table_rows(text):
        if row[0] not in ("cue", "corridor"):
            continue
        for lag, cell in zip(lags, row[2:]):
            cell_key = (row[0], row[1], lag)
            finals = [r["final_return"] for r in runs if (r["task"], r["correction"], r["lag"]) == cell_key]
            error = statistics.stdev(finals) / math.sqrt(len(finals))
            assert cell == f"{statistics.mean(finals):.2f} ± {error:.2f}", (row[0], row[1], lag)
            checked += 1
    assert checked == 20


# ---- the checks can fail ----
def test_the_checks_catch_a_bad_flag_a_bad_config_and_a_missing_file():
    bad = ("```bash\npython ppo_procgen.py --env-id starpilot --no-such-flag 3\n```\n"
           "`torchrun --standalone --nproc-per-node 2 vtrace.py --unroll-lenght 20`\n"
           "`python benchmarks/bench.py --script ppg_procgen.py --config \"x=--update-epochs 2\"`\n"
           "`python benchmarks/lag_experiment.py --lag 4`\n")
    problems = page_problems(bad)
    assert len(problems) == 4, problems
    assert named_flags("`--learning-rat`") - all_flags() == {"--learning-rat"}
    assert cited_files("see `benchmarks/results/cpu_nothing.json`") == {"benchmarks/results/cpu_nothing.json"}


@pytest.mark.parametrize("page, script", [("docs/ppo.md", "ppo_procgen.py"), ("docs/ppg.md", "ppg_procgen.py"),
                                          ("docs/impala.md", "vtrace.py"), ("docs/rlhf.md", "ppo_rlhf_toy.py")])
def test_the_code_named_beside_the_algorithm_exists(page, script):
    """Every function, class or variable the page maps the paper to is still in the script (a rename breaks this)."""
    text = open(os.path.join(ROOT, page)).read()
    section = re.search(r"^## The algorithm beside the code\n(.*?)(?=^##)", text, flags=re.S | re.M).group(1)
    source = open(os.path.join(ROOT, script)).read()
    names = {span for span in inline_spans(section) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", span)}
    names = {name for name in names if "_" in name or name[0].isupper() or name == "train"}
    missing = sorted(name for name in names if not re.search(r"\b" + re.escape(name.split(".")[-1]) + r"\b", source))
    assert len(names) >= 3 and missing == [], f"{page} names {missing}, which {script} lacks"
