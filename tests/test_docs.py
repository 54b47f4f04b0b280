"""The docs cannot drift from the code. Every `python <script>.py ...` and `torchrun ... <script>.py ...`
command in README.md and docs/*.md parses against that script's flags (tyro, in-process; the argparse tools: their
flags exist; bench.py: its --config/--common flags parse against its --script); every --flag named on a page exists;
every cited result file and figure exists and every committed benchmarks/results/*.json is cited; the speed, bf16 and
lag tables agree with their JSON. Every default the pages name and every hyperparameter table's "ours"
column against Args, results.md's per-game numbers against benchmarks/reference/ (through anchors.py), rlhf.md's
tables and the prose numbers that cite a JSON, the quoted exit statuses and console lines against a real SIGINT and
SIGTERM (the one test that runs a script), the cited .md pages, the exercises' count on the pages and their
topic markers. Every name in a map from a paper to the code is bound in its script; every pytest line parses under
pytest.ini (one subprocess, no collection) and the tests the pages name exist; every example console line is its
command's; assignments.md's points are the graders'; a stated test count is one file's, as pytest collects it. Each
planted wrong edit (eight, then eleven for the checks added last) is reported."""
import ast
import contextlib
import fnmatch
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

CI_TEST_COMMAND = "pip install -r requirements.txt && python -m pytest -q -n 2 --dist loadfile tests"  # .ci/run's, after its venv
CPU_TORCH = "pip install torch=={} --index-url https://download.pytorch.org/whl/cpu"
TYRO_SCRIPTS = {  # script -> (module, dataclass): parsed in-process with tyro.cli(Args, args=argv)
    "ppo_procgen.py": ("ppo_procgen", "Args"), "ppg_procgen.py": ("ppg_procgen", "Args"),
    "vtrace.py": ("vtrace", "Args"),
    "ppo_rlhf_toy.py": ("ppo_rlhf_toy", "Args"), "benchmarks/results.py": ("benchmarks/results.py", "Args"),
    "benchmarks/rlhf_seeds.py": ("benchmarks/rlhf_seeds.py", "SeedsArgs"),
    "benchmarks/rlhf_estimators.py": ("benchmarks/rlhf_estimators.py", "EstimatorArgs"),
}
PROCGEN_SCRIPTS = ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py")
# Flags of other programs that the pages name: torchrun, SLURM, pip, pytest's options added in exercises/, and
# pytest's and pytest-xdist's own (docs/testing.md's runtime).
EXTERNAL_FLAGS = {"--nproc-per-node", "--standalone", "--nnodes", "--rdzv-id", "--rdzv-backend", "--rdzv-endpoint",
                  "--signal", "--requeue", "--index-url", "--dry-run", "--script", "--no-train", "--help",
                  "--logdir", "--no-deps", "--only-binary", "--platform", "--python-version", "--durations", "--dist",
                  "--no-loadscope-reorder"}
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


def split_command_lines(text, inline_pattern):
    """(source, tokens) of each shell line of a page's code blocks and of each inline span that matches
    `inline_pattern`, split as a shell splits them; half a command in prose (an unclosed quote) is skipped."""
    sources = [line for language, body in code_blocks(text) if language in CODE_LANGUAGES for line in shell_lines(body)]
    sources += [span for span in inline_spans(text) if re.search(inline_pattern, span)]
    for source in sources:
        try:
            yield source, shlex.split(source, comments=True)
        except ValueError:
            continue


def commands_of(text):
    """Every python/torchrun invocation of a .py file on a page: (script, argv, the text it came from)."""
    found = []
    for source, tokens in split_command_lines(text, r"\b(python3?|torchrun|srun)\b"):
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
def readme_blocks():
    """The README's shell blocks in order: the laptop's commands, the GPU's, then one install block per platform."""
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = [body.strip().splitlines() for language, body in code_blocks(text)
              if language in ("bash", "sh", "", "powershell")]
    return [[line.removesuffix(" &&") for line in block] for block in blocks]


PLATFORMS = ("**Linux, CPU only**", "**Linux with an NVIDIA GPU.**", "**macOS 14 or newer on Apple Silicon.**",
             "**Windows (x86-64)**")


def test_the_readmes_first_screen_is_the_pitch_the_scripts_and_commands():
    """A newcomer reads what this is, the scripts table, then two commands for a laptop (one that shows learning in
    minutes, the tests exactly as CI runs them) and two for a GPU (the default runs of PPG and PPO), all on the first
    screen; the install for each platform follows. The GPU check is a maintainer's tool: named further down, not on
    the first screen."""
    text = open(os.path.join(ROOT, "README.md")).read()
    laptop, gpu = readme_blocks()[:2]
    first_screen = "\n".join(text.splitlines()[:30])
    assert "| `ppg_procgen.py` |" in first_screen and text.index("| script |") < text.index("```bash")
    assert [line.split("#")[0].strip() for line in laptop] == ["python ppo_rlhf_toy.py",
                                                               "python -m pytest -q -n 2 --dist loadfile tests"]
    assert [line.split("#")[0].strip() for line in gpu] == ["python ppg_procgen.py --env-id starpilot",
                                                            "python ppo_procgen.py --env-id starpilot"]
    assert all(line in first_screen for line in laptop + gpu), "the commands are on the README's first screen"
    gpu_check = "bash benchmarks/gpu_bench.sh"
    assert gpu_check in text and gpu_check not in first_screen, "the GPU check is named below the first screen"
    assert CI_TEST_COMMAND in open(os.path.join(ROOT, ".ci", "run")).read()
    positions = [text.index(label) for label in PLATFORMS]
    assert text.index(gpu[-1]) < positions[0] and positions == sorted(positions)
    assert len(text.splitlines()) <= 250, "README.md is the front page: at most 250 lines"


NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
                "ten": 10}


def exercise_counts(text):
    """The numbers a text gives as "N exercises" in words: "six exercises", not "three silent-bug exercises"."""
    return [NUMBER_WORDS[word.lower()] for word in re.findall(r"\b(\w+) exercises\b", text, re.I)
            if word.lower() in NUMBER_WORDS]


def test_the_exercises_are_counted_and_marked_everywhere():
    """Every exercise of exercises/texts.py has its row in assignments.md's table, a topic marker registered in
    pytest.ini and in exercises/conftest.py (for a starter folder), a row in the topic subsets' table, and test
    names in tests/conftest.py's TOPIC_TESTS whose patterns each match a test of that file; the README,
    testing.md and assignments.md's introduction count them right."""
    import configparser

    import conftest
    from exercises import conftest as exercises_conftest
    from exercises.texts import EXERCISES
    names = set(EXERCISES)
    assignments = open(os.path.join(ROOT, "docs", "assignments.md")).read()
    exercise_table = assignments[assignments.index("| exercise |"):assignments.index("## The handouts")]
    assert set(re.findall(r"^\| `(\w+)` \|", exercise_table, re.M)) == names
    assert names <= set(re.findall(r"^\| `pytest -m (\w+) tests` \|", assignments, re.M))
    ini = configparser.ConfigParser()
    ini.read(os.path.join(ROOT, "pytest.ini"))
    registered = {line.split(":")[0].strip() for line in ini["pytest"]["markers"].strip().splitlines()}
    assert names <= registered and names == set(exercises_conftest.MARKERS) == set(conftest.TOPIC_TESTS)
    for topic, table in conftest.TOPIC_TESTS.items():
        for stem, patterns in table.items():
            source = open(os.path.join(ROOT, "tests", stem + ".py")).read()
            defined = re.findall(r"^def (test_\w+)", source, re.M)
            for pattern in patterns:
                assert fnmatch.filter(defined, pattern), f"{topic}: {stem}.py has no test named {pattern}"
    pages = {"README.md": open(os.path.join(ROOT, "README.md")).read(),
             "docs/testing.md": open(os.path.join(ROOT, "docs", "testing.md")).read(),
             "docs/assignments.md's introduction": assignments[:assignments.index("## The handouts")]}
    for page, text in pages.items():
        counts = exercise_counts(text)
        assert counts and set(counts) == {len(names)}, f"{page} counts {counts} exercises, not {len(names)}"


def test_the_readmes_install_is_two_commands_per_platform():
    """Each platform: make and enter a venv, then install; on a Linux CPU machine the CPU build of torch (the pin
    of requirements.txt) before requirements.txt, elsewhere requirements.txt alone. The system package that EnvPool
    needs is named beside each block as in requirements.txt."""
    requirements = open(os.path.join(ROOT, "requirements.txt")).read()
    pin = re.search(r"^torch==([\d.]+)$", requirements, re.M).group(1)
    install = readme_blocks()[2:2 + len(PLATFORMS)]
    assert len(install) == len(PLATFORMS) and all(len(block) == 2 for block in install)
    linux_cpu, linux_gpu, macos, windows = install
    assert linux_cpu[0] == linux_gpu[0] == macos[0] == "python3 -m venv .venv && . .venv/bin/activate"
    assert windows[0] == "py -m venv .venv; .venv\\Scripts\\Activate.ps1"
    assert linux_cpu[1] == CPU_TORCH.format(pin) + " && pip install -r requirements.txt"
    assert linux_gpu[1] == macos[1] == windows[1] == "pip install -r requirements.txt"
    text = open(os.path.join(ROOT, "README.md")).read()
    for package in ("apt-get install libqt5gui5", "brew install qt@5"):
        assert package in requirements and package in text


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


RUN_FOLDER_PARTS = {  # the README's placeholders, as a run's folder spells them
    "env": lambda args: re.escape(args.env_id), "exp-name": lambda args: re.escape(args.exp_name),
    "seed": lambda args: str(args.seed), "unix time": lambda args: "[0-9]{10}",
    "8 random hex digits": lambda args: "[0-9a-f]{8}"}


@pytest.mark.parametrize("script", PROCGEN_SCRIPTS)
def test_the_readmes_run_folder_is_the_one_a_run_makes(script, tmp_path, monkeypatch):
    """'What a run writes' names the folder each Procgen script makes, part by part (a stale pattern, such as the
    old `-2` suffix or a missing random part, fails)."""
    text = open(os.path.join(ROOT, "README.md")).read().split("## What a run writes", 1)[1]
    pattern = re.search(r"`runs/([^`]+)/`", text).group(1)
    parts = re.split(r"<([^>]+)>", pattern)  # literal, placeholder, literal, ...
    assert set(parts[1::2]) <= set(RUN_FOLDER_PARTS), f"README.md names an unknown part in runs/{pattern}/"
    module = load(script[:-3])
    args = module.Args()
    regex = "".join(re.escape(part) if i % 2 == 0 else RUN_FOLDER_PARTS[part](args)
                    for i, part in enumerate(parts))
    monkeypatch.chdir(tmp_path)
    name, _ = module.run_folder(args, None, rank=0)
    assert re.fullmatch(regex, name), (pattern, name)


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
    """Every result JSON directly in benchmarks/results/ is cited by name; a folder of whole runs there (its runs'
    args.json and metrics.jsonl, e.g. procgen_cpu/) is cited by the folder's path."""
    committed = subprocess.run(["git", "ls-files", "benchmarks/results/*.json"], cwd=ROOT, capture_output=True,
                               text=True).stdout.split()
    if not committed:  # not a git checkout: the files on disk
        committed = [relative(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "**", "*.json"),
                                                    recursive=True)]
    text = "".join(open(page).read() for page in pages())
    cited = cited_files(text)
    runs = [path for path in committed if path.count("/") >= 4]  # benchmarks/results/<folder>/<run>/<file>
    folders = {"/".join(path.split("/")[:3]) for path in runs}
    assert sorted(folder for folder in folders if f"{folder}/" not in text) == []
    assert sorted(set(committed) - set(runs) - cited) == []


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


def test_the_procgen_backends_table_matches_its_json():
    """docs/speed.md's procgen-mirror / EnvPool rows: medians, ranges and ratios of cpu_env_backends.json."""
    text = open(os.path.join(ROOT, "docs", "speed.md")).read()
    section = text.split("## Procgen backends: procgen-mirror and EnvPool")[1].split("\n## ")[0]
    data = json.load(open(os.path.join(ROOT, "benchmarks", "results", "cpu_env_backends.json")))
    rows = [row for row in table_rows(section) if row[0] != "game"]
    assert [row[0].lower() for row in rows] == list(data["summary"])

    def cell(timings):
        speeds = [timing["steps_per_second"] for timing in timings]
        return f"{statistics.median(speeds):,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f})"

    for row in rows:
        timings, summary = data["timings"][row[0].lower()], data["summary"][row[0].lower()]
        assert row[1:] == [cell(timings["procgen"]), cell(timings["envpool"]),
                           f"{summary['envpool_over_procgen']:.2f}"], row[0]


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


def test_the_quoted_on_track_line_is_the_committed_seed_2_runs():
    """results.md quotes the windowed on-track line that PPO seed 2 on StarPilot (benchmarks/results/procgen_cpu/)
    gets at 524,288 steps from benchmarks/reference/on_track.py."""
    on_track = load("benchmarks/reference/on_track.py")
    folder = os.path.join(ROOT, "benchmarks", "results", "procgen_cpu")
    (run,) = [os.path.join(folder, name) for name in sorted(os.listdir(folder))
              if json.load(open(os.path.join(folder, name, "args.json")))["seed"] == 2 and "__ppo_procgen__" in name]
    line = on_track.run_on_track_line(json.load(open(os.path.join(run, "args.json"))), 524_288,
                                      os.path.join(run, "metrics.jsonl"))
    assert line.startswith("starpilot @ 0.5M (mean of the last 131k steps): ours ")
    assert line in inline_spans(open(os.path.join(ROOT, "docs", "results.md")).read())

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


# ---- every number checked: defaults, hyperparameter tables, anchors, RLHF tables, prose, real runs ----
# Each check reads the pages from a {path: text} dict, so that the planted-edit test below can run it on a changed
# copy; the data (Args, benchmarks/reference/, the JSON files) are always the repository's.
PAGE_SCRIPTS = {"docs/ppo.md": "ppo_procgen.py", "docs/ppg.md": "ppg_procgen.py", "docs/impala.md": "vtrace.py",
                "docs/rlhf.md": "ppo_rlhf_toy.py"}


def page_texts():
    return {relative(page): open(page).read() for page in pages()}


@functools.lru_cache(maxsize=None)
def flag_defaults(script):
    """{'--flag': default} of a tyro script's dataclass; a bool flag also as '--no-flag': not default."""
    import dataclasses
    defaults = {}
    for field in dataclasses.fields(dataclass_of(script)):
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            continue  # a positional argument (results.py's RUNS)
        value = field.default_factory() if field.default is dataclasses.MISSING else field.default
        defaults["--" + field.name.replace("_", "-")] = value
        if isinstance(value, bool):
            defaults["--no-" + field.name.replace("_", "-")] = not value
    return defaults


def number(text):
    """A number as the pages write it (Unicode minus, thousands commas, underscores, a sign), else None."""
    cleaned = text.replace("−", "-").replace(",", "").replace("_", "").lstrip("+")
    try:
        return float(cleaned)
    except ValueError:
        return None


def shows(text, value):
    """`text` is `value` as a page may write it: a number to the digits shown, on/off/yes/no for a bool, a word."""
    text = text.strip("`").strip()
    if isinstance(value, bool):
        return text in (("on", "yes", "true") if value else ("off", "no", "false"))
    if value is None:
        return text in ("none", "None")
    if isinstance(value, (int, float)):
        shown = number(text)
        if shown is None:
            return False
        digits = len(text.split(".")[1]) if "." in text and "e" not in text else 0
        return abs(shown - value) <= 0.5 * 10 ** -digits + 1e-12 * abs(value) if digits else shown == value
    return text == str(value)


def named_defaults(text):
    """(flag, value shown, where) for every default a page names in its prose: `--flag` (0.05), `--flag` (default
    `games`), `--flag` iterations (default 128), `--flag value` (default), `--flag value`, the default."""
    found = []
    body = prose(text)
    for match in re.finditer(r"`(--[a-z][a-z0-9-]*)`[^`()\n]{0,40}?\((?:default )?(`?[\w.+−-]+`?)(?:[),;:]| per)",
                             body):
        value = match.group(2)
        explicit = "(default" in match.group(0)
        if explicit or match.group(0).index("(") == len(match.group(1)) + 3:  # right after the flag, or 'default'
            if explicit or number(value) is not None or value.strip("`") in ("on", "off"):
                found.append((match.group(1), value, match.group(0)))
    for match in re.finditer(r"`(--[a-z][a-z0-9-]*)(?: ([^`\s]+))?`(?:,? the default\b| \((?:the )?default\))", body):
        found.append((match.group(1), match.group(2) or "on", match.group(0)))
    return found


@functools.lru_cache(maxsize=None)
def argparse_defaults():
    """{'--flag': [its literal defaults]} of the argparse tools' add_argument calls (read from their source)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                names = [arg.value for arg in node.args
                         if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")]
                for keyword in node.keywords:
                    if keyword.arg == "default":
                        with contextlib.suppress(ValueError):
                            value = ast.literal_eval(keyword.value)
                            for name in names:
                                found.setdefault(name, []).append(value)
    return found


@functools.lru_cache(maxsize=None)
def effective_defaults():
    """Defaults that Args leaves at None for the script to size: their value at the other defaults, one process."""
    ppg = load("ppg_procgen")
    return {"--num-aux-rollouts": ppg.aux_rollouts_per_rank(ppg.Args(), world_size=1)}


def default_problems(texts):
    problems = []
    for page, text in texts.items():
        scripts = [PAGE_SCRIPTS[page]] if page in PAGE_SCRIPTS else list(TYRO_SCRIPTS)
        for flag, value, where in named_defaults(text):
            defaults = [flag_defaults(script)[flag] for script in scripts if flag in flag_defaults(script)]
            if not defaults and page in PAGE_SCRIPTS:  # another script's flag on this page
                defaults = [flag_defaults(script)[flag] for script in TYRO_SCRIPTS if flag in flag_defaults(script)]
            if flag in effective_defaults():
                defaults.append(effective_defaults()[flag])
            if not defaults:  # a benchmark tool's flag
                defaults = argparse_defaults().get(flag, [])
            if not any(shows(value, default) for default in defaults):
                problems.append(f"{page}: `{where}`: the default is {defaults or 'unknown'}")
    return problems


class Shown(__import__("string").Formatter):
    """Renders a row's template from Args the way the tables write values: {x:M} 25M, {x:e} 5e-4, {x:g} 0.999,
    {x:n} 2,048, {x:yn} yes/no, {x:onoff} on/off, {x:none} none."""

    def format_field(self, value, spec):
        if spec == "M":
            return f"{value / 1e6:g}M"
        if spec == "e":
            return f"{value:.0e}".replace("e-0", "e-")
        if spec in ("yn", "onoff"):
            return {"yn": ("no", "yes"), "onoff": ("off", "on")}[spec][bool(value)]
        if spec == "none":
            return "none" if value is None else str(value)
        if spec == "n":
            return f"{value:,}"
        return super().format_field(value, spec)


# Every row of each page's hyperparameter table: the template of its "ours (default)" cell from the script's Args
# (None: the row names no flag's value). A row missing here fails, so a new row gets its check.
OURS_COLUMN = {
    "docs/ppo.md": {
        "games × steps per rollout": "{num_envs} × {num_steps}",
        "distribution / steps": "{distribution_mode} / {total_timesteps:M}",
        "levels": "all ({num_levels})",
        "γ / λ": "{gamma:g} / {gae_lambda:g}",
        "learning rate, Adam ε": "{learning_rate:e}, {adam_eps:e}",
        "LR annealing": "{anneal_lr:onoff}",
        "minibatches × epochs": "{num_minibatches} × {update_epochs}",
        "clip ε / value clipping": "{clip_coef:g} / {clip_vloss:yn}",
        "entropy / value coefficient": "{ent_coef:g} / {vf_coef:g}",
        "gradient-norm clip": "{max_grad_norm:g}",
        "advantage normalization": "per {adv_norm}",
        "reward normalization": "γ {reward_norm_gamma:g}, clip ±{reward_clip:g}",
        "network": None,  # "the same" as CleanRL's cell
        "target KL early stop": "{target_kl:none}",
    },
    "docs/ppg.md": {
        "distribution / steps / games": "{distribution_mode} / {total_timesteps:M} / {num_envs}",
        "steps per rollout; γ / λ": "{num_steps}; {gamma:g} / {gae_lambda:g}",
        "N_π / E_π / E_V / E_aux": "{n_pi} / {e_pi} / {e_v} / {e_aux}",
        "β_clone": "{beta_clone:.1f}",
        "policy minibatches": "{num_minibatches} ({minibatch_frames:n} frames), each {minibatch_games} whole games",
        "auxiliary minibatch": "{aux_rollouts} rollouts per {num_envs} games",
        "learning rate (both phases)": "{learning_rate:e}",
        "optimizers, Adam ε": "ε {adam_eps:e}",
        "LR annealing": "{anneal_lr:onoff}",
        "clip ε / value clipping": "{clip_coef:g} / {clip_vloss:yn}",
        "entropy coefficient β_S / value term of the policy phase": "{ent_coef:g} / {vf_coef:g} × ½·MSE",
        "gradient clip": "none ({max_grad_norm:g})",
        "advantage normalization": "full {adv_norm}",
        "reward normalizer γ, clip": "{reward_norm_gamma:g}, ±{reward_clip:g}",
        "init": "{init}",
        "architecture": "{arch}",
        "gradient accumulation": None,
    },
    "docs/impala.md": {
        "unroll T / batch": "{unroll_length} / {num_envs} games",
        "γ": "{gamma:g}",
        "baseline cost / entropy cost": "{baseline_cost:g} / {entropy_cost:g}",
        "ρ̄ / c̄ / ρ̄_pg / λ": "{rho_bar:g} / {c_bar:g} / {pg_rho_bar:g} / {vtrace_lambda:g}",
        "optimizer, lr": "Adam ε {adam_eps:e}, {learning_rate:e}",
        "gradient-norm clip": "{max_grad_norm:g}",
        "loss reduction": None,
        "policy lag": "at most {max_policy_lag}",
        "frames, rewards": "reward normalization (γ {reward_norm_gamma:g}), clip ±{reward_clip:g}",
    },
    "docs/rlhf.md": {
        "β (KL)": "{beta:g}, {kl_estimator}",
        "learning rate": "{ppo_lr:e}",
        "batch, minibatches, epochs": "{rollout_batch_size}, {num_minibatches}, {ppo_epochs}",
        "clip / value clip / value coefficient": "{clip_coef:g} / {clip_coef_value:g} / {vf_coef:g}",
        "γ, λ": "{gamma:g}, {lam:g}",
        "reward whitening": "{whiten_rewards:yn}",
        "temperature": "{temperature:g}",
        "missing EOS": "{missing_eos_penalty:g}",
        "critic": None,
    },
}


def hyperparameter_table(text):
    """{row label: the 'ours (default)' cell} of the page's table whose header has that column."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and "ours (default)" in line)
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    column = header.index("ours (default)")
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[column]
    return rows


def ours_column_problems(texts):
    problems = []
    for page, templates in OURS_COLUMN.items():
        script = PAGE_SCRIPTS[page]
        values = {flag[2:].replace("-", "_"): value for flag, value in flag_defaults(script).items()
                  if not flag.startswith("--no-")}
        if "num_minibatches" in values and "num_steps" in values:  # a policy minibatch in frames and in games
            values["minibatch_frames"] = values["num_envs"] * values["num_steps"] // values["num_minibatches"]
            values["minibatch_games"] = values["num_envs"] // values["num_minibatches"]
        values["aux_rollouts"] = effective_defaults()["--num-aux-rollouts"]
        rows = hyperparameter_table(texts[page])
        if sorted(rows) != sorted(templates):
            problems.append(f"{page}: table rows {sorted(set(rows) ^ set(templates))} have no check or are gone")
        for label, template in templates.items():
            if template is None or label not in rows:
                continue
            expected = Shown().format(template, **values)
            if expected not in rows[label].replace("−", "-"):
                problems.append(f"{page}: row '{label}': ours is '{rows[label]}', {script}'s Args give '{expected}'")
    return problems


@functools.lru_cache(maxsize=None)
def anchor_table_lines():
    """The rows of the three per-game tables, from benchmarks/reference/ through anchors.py's own `table` (the
    tables' generator, with its seed and resamples), in the order its main() draws them."""
    anchors = load("benchmarks/reference/anchors.py")
    import numpy as np
    references = anchors.results.load_references()
    rng = np.random.default_rng(0)
    return [line for _, _, entries, marks in anchors.TABLES
            for line in anchors.table(references, entries, marks, rng, 50_000) if line]


def anchor_table_problems(texts):
    """results.md's three per-game tables, every cell, against the anchors' data."""
    return [f"docs/results.md lacks the anchors' row `{line[:120]}`" for line in anchor_table_lines()
            if line not in texts["docs/results.md"]]


def game_number_problems(texts):
    """A per-game return in the prose ("StarPilot 35.12 ± 3.37", "BossFight 9.03") must be in that game's row of a
    results.md table: the anchors' tables are checked against the data, CleanRL's quoted table names its source."""
    rows = {}
    for row in table_rows(texts["docs/results.md"]):
        rows.setdefault(row[0].lower(), set()).update(re.findall(r"-?\d+\.\d+(?: ± \d+\.\d+)?", " ".join(row[1:])))
    problems = []
    for page, text in texts.items():
        body = " ".join(prose(text).split())
        for game, value in re.findall(r"\b(StarPilot|BossFight|BigFish) (\d+\.\d\d(?: ± \d+\.\d\d)?)(?![\d.])", body):
            if value not in rows.get(game.lower(), ()) and value.split(" ±")[0] not in {
                    number.split(" ±")[0] for number in rows.get(game.lower(), ())}:
                problems.append(f"{page}: {game} {value} is in no {game} row of docs/results.md")
    return problems


def signed(value, digits):
    return f"{value:+.{digits}f}".replace("-", "−")


def rlhf_table_problems(texts):
    """rlhf.md's five-seed table and β-sweep table, every number, against their JSON (mean ± standard error)."""
    text = texts["docs/rlhf.md"]
    rows = {row[0]: row for row in table_rows(text)}
    seeds = json.load(open(os.path.join(ROOT, "docs", "rlhf_seeds_default.json")))["aggregate"]
    sweep = json.load(open(os.path.join(ROOT, "docs", "rlhf_sweep_seeds.json")))["aggregate"]
    best_of = {entry["n"]: entry for entry in seeds["bon"]}
    expected = {}  # row label -> the cells after it, as the JSON gives them

    def cell(stat, digits, sign=True):
        shown = signed(stat["mean"], digits) if sign else f"{stat['mean']:.{digits}f}"
        return f"{shown} ± {stat['se']:.{digits}f}"

    expected["SFT policy"] = [cell(seeds["sft"]["gold/score"], 3), cell(seeds["sft"]["proxy/score"], 3), "0"]
    ppo = seeds["ppo"]["0.05"]
    expected["PPO, β = 0.05, 100 iterations"] = [f"**{cell(ppo['gold/score'], 3)}**", cell(ppo["proxy/score"], 3),
                                                  cell(ppo["objective/kl"], 2, sign=False)]
    for n in (64, 256):
        entry = best_of[n]
        expected[f"best-of-{n} from SFT"] = [cell(entry["gold/score"], 3), cell(entry["proxy/score"], 3),
                                             f"≤ {entry['kl_bound']:.2f}"]
    for beta in ("0", "0.01", "0.05", "0.2"):
        key = str(float(beta))
        peak = sweep["smoothed_peak"][key]
        final = sweep["ppo"][key]
        gold = cell(final["gold/score"], 2)
        expected[beta] = [f"{signed(peak['gold/score'], 2)} ± {peak['gold/score se']:.2f} "
                          f"({peak['objective/kl']:.1f} ± {peak['objective/kl se']:.1f}, it {peak['iteration']})",
                          f"**{gold}**" if rows.get(beta, [""] * 3)[2].startswith("**") else gold,
                          cell(final["proxy/score"], 2),
                          cell(final["objective/kl"], 2 if final["objective/kl"]["mean"] < 10 else 1, sign=False)]
    problems = []
    for label, cells in expected.items():
        shown = rows.get(label, [label])[1:len(cells) + 1]
        if shown != cells:
            problems.append(f"docs/rlhf.md row '{label}': {shown} where the JSON gives {cells}")
    return problems


@functools.lru_cache(maxsize=None)
def cited_numbers():
    """(page, text) of every prose number that cites a JSON, recomputed from that JSON."""
    results_dir = os.path.join(ROOT, "benchmarks", "results")
    rounds = json.load(open(os.path.join(results_dir, "cpu_vtrace_ab.json")))["rounds"]
    play = [r["new"]["seconds_per_iteration"]["actor_play"] for r in rounds]
    wait = [r["new"]["seconds_per_iteration"]["actor_wait"] for r in rounds]
    ppg = json.load(open(os.path.join(results_dir, "cpu_ppg_default_n_pi1_e_aux1.json")))["results"][0]
    rollout = ppg["seconds_per_iteration"]["rollout"]
    update = ppg["seconds_per_iteration"]["update"]
    policy_iteration = (f"about {rollout + update:.0f} s: rollout {rollout:.1f} s and update {update:.1f} s in "
                        "`benchmarks/results/cpu_ppg_default_n_pi1_e_aux1.json`")
    # A whole phase at the defaults: 32 policy iterations, then 6 epochs of 2,048 rollouts in minibatches of 4, each
    # as long as the measured run's (its auxiliary phase: 1 epoch of 64 rollouts = 16 minibatches).
    minibatch = ppg["aux_phase_s"] / 16
    phase = 32 * (rollout + update) + 6 * 2048 / 4 * minibatch
    seeds = json.load(open(os.path.join(ROOT, "docs", "rlhf_seeds_default.json")))["aggregate"]
    gap = seeds["ppo_minus_best_of_256"]["0.05"]
    rm = seeds["rm"]
    return [
        ("docs/speed.md", f"the actor plays {min(play):.1f}-{max(play):.1f} s and waits {min(wait):.1f}-"
                          f"{max(wait):.1f} s of each iteration (the 7 rounds of the one-actor design in "
                          "`benchmarks/results/cpu_vtrace_ab.json`)"),
        ("docs/ppg.md", policy_iteration),
        ("docs/reliability.md", policy_iteration),
        ("docs/speed.md", f"minibatches at the measured {minibatch:.1f} s each) would take about {phase / 3600:.1f} "
                          f"hours on this CPU: about {32 * 16384 / phase:.0f} SPS overall"),
        ("docs/rlhf.md", f"PPO minus best-of-256 is {signed(gap['gold/score']['mean'], 3)} ± "
                         f"{gap['gold/score']['se']:.3f} in gold and {signed(gap['proxy/score']['mean'], 3)} ± "
                         f"{gap['proxy/score']['se']:.3f} in proxy score"),
        ("docs/rlhf.md", f"held-out accuracy {rm['rm/heldout_acc']['mean']:.3f} ± {rm['rm/heldout_acc']['se']:.3f} "
                         f"against the noisy labels (the label noise caps it at {rm['rm/label_ceiling']['mean']:.3f} ± "
                         f"{rm['rm/label_ceiling']['se']:.3f}) and {rm['rm/heldout_acc_gold']['mean']:.3f} ± "
                         f"{rm['rm/heldout_acc_gold']['se']:.3f} against the noise-free gold order; held-out loss "
                         f"{rm['rm/heldout_loss']['mean']:.3f} ± {rm['rm/heldout_loss']['se']:.3f}"),
    ]


def cited_number_problems(texts):
    problems = []
    for page, expected in cited_numbers():
        if expected not in " ".join(texts[page].split()):
            problems.append(f"{page} lacks `{expected}` (recomputed from its JSON)")
    return problems


EXTERNAL_CONTEXT = re.compile(r"(CleanRL|openai/[\w-]+|vwxyzjn/[\w-]+)(?:(?!\. ).){0,60}$", re.S)


def heading_anchors(text):
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    headings = re.findall(r"(?m)^#+ (.+?)\s*$", prose(text))
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def cited_page_problems(texts):
    """Every .md a page cites exists, and so does the section a link names (`page.md#section`, `#section`): link
    targets relative to the page, paths of this repository (docs/..., shared/..., benchmarks/..., README.md)
    relative to its root; another repository's path (after its name) is not ours to check."""
    problems = []
    for page, text in texts.items():
        folder = os.path.dirname(os.path.join(ROOT, page))
        for target, anchor in re.findall(r"\]\(([^)#\s]*?\.md|)(?:#([^)\s]*))?\)", text):
            path = os.path.normpath(os.path.join(folder, target)) if target else os.path.join(ROOT, page)
            if "://" in target:
                continue
            if not os.path.exists(path):
                problems.append(f"{page}: link to {target}, which does not exist")
            elif anchor:
                cited = texts.get(relative(path)) or open(path).read()
                if anchor not in heading_anchors(cited):
                    problems.append(f"{page}: link to {target}#{anchor}, a section that {relative(path)} lacks")
        for match in re.finditer(r"(?<![\w/.(-])((?:docs|shared|benchmarks|tests|exercises)/[\w./-]+\.md|"
                                 r"(?:README|CHANGELOG)\.md)\b", prose(text)):
            if EXTERNAL_CONTEXT.search(prose(text)[max(0, match.start() - 60):match.start()]):
                continue
            if not os.path.exists(os.path.join(ROOT, match.group(1))):
                problems.append(f"{page}: cites {match.group(1)}, which is not in the repository")
    return problems


def quoted_exits(texts):
    """{(page, signal): exit status} that the pages quote for the Procgen scripts' first Ctrl-C / SIGTERM."""
    quoted = {}
    reliability = " ".join(texts["docs/reliability.md"].split())
    for status, name in re.findall(r"\*\*(\d+)\*\* for (Ctrl-C|SIGTERM)", reliability):
        quoted[("docs/reliability.md", "SIGINT" if name == "Ctrl-C" else name)] = int(status)
    readme = " ".join(texts["README.md"].split())
    match = re.search(r"Ctrl-C or SIGTERM [^.]*?exits (\d+) / (\d+)", readme)
    if match:
        quoted[("README.md", "SIGINT")] = int(match.group(1))
        quoted[("README.md", "SIGTERM")] = int(match.group(2))
    return quoted


def quoted_messages(texts):
    """The console lines reliability.md quotes for a first signal, as patterns (N: a number, <run>: a run folder)."""
    section = re.search(r"^## Interrupts.*?(?=^## )", texts["docs/reliability.md"], flags=re.S | re.M).group(0)
    patterns = []
    for span in inline_spans(section):
        if re.match(r"(SIGTERM: stopping|interrupted by SIGTERM)", span):
            pattern = re.escape(span).replace(r"\<run\>", r"[^/\s]+").replace("<run>", r"[^/\s]+")
            patterns.append((span, re.sub(r"\bN\b", r"\\d+", pattern)))
    return patterns


def exit_problems(texts, observed):
    """`observed`: {signal name: exit status} of real runs. Both pages must quote both statuses, and rightly."""
    quoted = quoted_exits(texts)
    problems = [f"{page} no longer quotes the exit status after {name} in the form this test reads"
                for page in ("README.md", "docs/reliability.md") for name in observed if (page, name) not in quoted]
    return problems + [f"{page} quotes exit {status} after {name}; a real run exits {observed[name]}"
                       for (page, name), status in quoted.items() if status != observed[name]]


def message_problems(texts, output):
    patterns = quoted_messages(texts)
    problems = [] if len(patterns) >= 2 else ["docs/reliability.md quotes fewer than the two first-signal lines"]
    return problems + [f"docs/reliability.md quotes `{span}`; a real run printed no such line"
                       for span, pattern in patterns if not re.search(r"(?m)^" + pattern + "$", output)]


def all_problems(texts):
    """Every check of this section but the real-run ones, on a {page: text} dict."""
    return (default_problems(texts) + ours_column_problems(texts) + anchor_table_problems(texts)
            + game_number_problems(texts) + rlhf_table_problems(texts) + cited_number_problems(texts)
            + cited_page_problems(texts))


def test_every_default_the_docs_name_is_the_scripts():
    texts = page_texts()
    assert sum(len(named_defaults(text)) for text in texts.values()) >= 10  # the reader finds them
    assert default_problems(texts) == []


def test_every_hyperparameter_tables_ours_column_is_the_scripts_args():
    assert ours_column_problems(page_texts()) == []


def test_results_md_per_game_numbers_are_the_anchors_data():
    texts = page_texts()
    assert anchor_table_problems(texts) == [] and game_number_problems(texts) == []


def test_rlhf_tables_and_prose_numbers_match_their_json():
    texts = page_texts()
    assert rlhf_table_problems(texts) == [] and cited_number_problems(texts) == []


def test_every_cited_page_exists():
    assert cited_page_problems(page_texts()) == []


TINY_PPO = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1", "--channels",
            "4", "--hidden-size", "16", "--eval-episodes", "2", "--eval-every", "0", "--total-timesteps", "1000000",
            "--torch-threads", "1", "--env-threads", "1"]


@pytest.fixture(scope="module")
def interrupted_runs(tmp_path_factory):
    """{signal name: (exit status, console output)} of a tiny real PPO run sent that signal after its second
    iteration line, as Ctrl-C and SLURM send them."""
    import signal
    folder = tmp_path_factory.mktemp("interrupted")
    observed = {}
    processes = {name: subprocess.Popen([sys.executable, os.path.join(ROOT, "ppo_procgen.py"), *TINY_PPO], cwd=folder,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for name in ("SIGINT", "SIGTERM")}  # both start at once; each gets its signal when it has trained
    for name, process in processes.items():
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("iter 2/"):
                process.send_signal(getattr(signal, name))
                break
        lines.append(process.communicate(timeout=120)[0])
        observed[name] = (process.returncode, "".join(lines))
    return observed


def test_quoted_exit_statuses_and_messages_are_a_real_runs(interrupted_runs):
    texts = page_texts()
    assert exit_problems(texts, {name: status for name, (status, _) in interrupted_runs.items()}) == []
    assert message_problems(texts, interrupted_runs["SIGTERM"][1]) == [], interrupted_runs["SIGTERM"][1][-2000:]


# Eight wrong edits, each of which its check above must report (each once passed an older, weaker check).
POSIX_EXITS = {"SIGINT": 128 + 2, "SIGTERM": 128 + 15}  # what the real runs above exit with: 128 + the signal number
PLANTED_EDITS = [
    ("a flag default in the prose", "docs/rlhf.md", "`--threads` (default 1)", "`--threads` (default 2)",
     default_problems),
    ("StarPilot's anchor score", "docs/results.md", "35.12", "38.12", anchor_table_problems),
    ("the exit statuses", "README.md", "exits 130 / 143", "exits 1 / 2",
     functools.partial(exit_problems, observed=POSIX_EXITS)),
    ("a hyperparameter table's ours column", "docs/ppo.md", "| 0.999 / 0.95 | `--gamma`", "| 0.99 / 0.95 | `--gamma`",
     ours_column_problems),
    ("an rlhf.md table value", "docs/rlhf.md", "| +2.343 ± 0.227 |", "| +2.343 ± 0.272 |", rlhf_table_problems),
    ("a prose number citing a JSON", "docs/speed.md", "waits 15.8-19.9 s", "waits 16 s", cited_number_problems),
    ("a cited .md path", "docs/ppg.md", "[reliability.md](reliability.md)", "[reliability.md](reliable.md)",
     cited_page_problems),
    ("a cited section", "docs/ppo.md", "speed.md#gpu-one-h200-measured-once", "speed.md#gpu-not-measured-yet",
     cited_page_problems),
]


@pytest.mark.parametrize("what, page, old, new, check", PLANTED_EDITS, ids=[edit[0] for edit in PLANTED_EDITS])
def test_each_planted_edit_is_reported(what, page, old, new, check):
    texts = page_texts()
    assert old in texts[page], f"{page} no longer has `{old}`: plant another {what}"
    assert all_problems(texts) + exit_problems(texts, POSIX_EXITS) == []
    texts[page] = texts[page].replace(old, new)
    assert check(texts), f"{what}: not reported"


# ---- the maps, the pytest command lines, example output, points and test counts ----
# Kinds of claim that once slipped through: a map naming code that was renamed, a pytest line that pytest.ini's
# options refuse, an example console line from another command, a grade's points, a test count. Each check reads
# {page: text}, so that the planted edits below can run it on a changed copy.
def map_lines(text):
    """The table rows of a page's "The algorithm beside the code" section, its subsections included."""
    section = re.search(r"^## The algorithm beside the code\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    return [line for line in section.group(1).splitlines() if line.startswith("|")] if section else []


@functools.lru_cache(maxsize=None)
def script_names(script):
    """What a script's source binds: (names, {class: its members}, {function: its parameters}, comments)."""
    source = open(os.path.join(ROOT, script)).read()
    tree = ast.parse(source)
    names, members, parameters = set(dir(__import__("builtins"))), {}, {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            parameters.setdefault(node.name, set()).update(argument.arg for argument in arguments)
            names |= parameters[node.name]
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ClassDef):
            members[node.name] = {child.name for child in ast.walk(node) if isinstance(child, ast.FunctionDef)}
            members[node.name] |= {child.attr for child in ast.walk(node)
                                   if isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store)}
            members[node.name] |= {child.id for child in ast.walk(node)
                                   if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store)}
    comments = [line.split("#", 1)[1].strip() for line in source.splitlines() if "#" in line]
    return names, members, parameters, comments


def map_span_problems(span, script):
    """A map's code span against its script: `--flags` are its flags, `# heading` one of its comments, and every
    name of an expression (`ppo_update(..., epochs_pi=E_π)`, `Actor.play`) is bound there: a function's keyword is
    its parameter, a class's attribute its member. Paper symbols (non-ASCII names) and file names are not code."""
    names, members, parameters, comments = script_names(script)
    if span.startswith("#"):
        found = any(comment.startswith(span.lstrip("# ")) for comment in comments)
        return [] if found else [f"`{span}`: {script} has no such comment"]
    flags = re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)
    if flags:
        return [f"`{span}`: {script} has no flag {flag}" for flag in flags if flag not in flags_of(script)]
    if re.fullmatch(r"[\w/.-]+\.(py|md|json)", span):
        return []
    if re.fullmatch(r"[a-z_]+(/\w+)+", span):  # a metric key, `aux/rollouts`: each part is in the script's text
        source = open(os.path.join(ROOT, script)).read()
        missing = [part for part in span.split("/") if not re.search(rf"\b{part}\b", source)]
        return [f"`{span}`: {script} never writes {part}" for part in missing]
    keyword = re.fullmatch(r"(\w+)=\S+", span)  # `epochs_v=E_V`: a keyword of a call, the value a paper symbol
    if keyword:
        found = any(keyword.group(1) in names for names in parameters.values())
        return [] if found else [f"`{span}`: no function of {script} takes {keyword.group(1)}="]
    try:  # `f(..., k=v, ...)`: the elisions dropped, so that Python reads it
        tree = ast.parse(re.sub(r"\.\.\.,?\s*", "", span))
    except SyntaxError:
        return [f"`{span}`: neither a flag, a comment nor Python"]
    symbols = {id(node) for call in ast.walk(tree) if isinstance(call, ast.Call)
               for keyword in call.keywords for node in ast.walk(keyword.value)}  # values: paper symbols
    problems = []
    for node in ast.walk(tree):
        if id(node) in symbols:
            continue
        if isinstance(node, ast.Name) and node.id.isascii() and node.id not in names:
            problems.append(f"`{span}`: {script} binds no {node.id}")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in members
              and node.attr not in members[node.value.id]):
            problems.append(f"`{span}`: {script}'s {node.value.id} has no {node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in parameters:
            problems += [f"`{span}`: {node.func.id} in {script} takes no {keyword.arg}=" for keyword in node.keywords
                         if keyword.arg not in parameters[node.func.id]]
    return problems


def map_problems(texts, pages=tuple(PAGE_SCRIPTS)):
    """Every code span of each page's map from the paper to the code exists in the script: the page's own, or the
    one a row names (ppo.md's template table reads across the scripts)."""
    problems = []
    for page in pages:
        lines = map_lines(texts[page])
        if not lines:
            problems.append(f"{page} has no table in 'The algorithm beside the code'")
        for line in lines:
            spans = inline_spans(line)
            named = [span for span in spans if span in TYRO_SCRIPTS]
            script = named[0] if named else PAGE_SCRIPTS[page]
            problems += [f"{page}: {problem}" for span in spans for problem in map_span_problems(span, script)]
    return problems


@pytest.mark.parametrize("page", sorted(PAGE_SCRIPTS))
def test_every_name_in_a_map_from_the_paper_to_the_code_exists(page):
    assert map_problems(page_texts(), pages=(page,)) == []


PYTEST_PARSER = r"""
import contextlib, io, json, sys
from _pytest.config import UsageError, _prepareconfig  # pytest's own: plugins, pytest.ini's addopts, conftests
errors = {}
for argv in json.loads(sys.argv[1]):
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            _prepareconfig(list(argv))._ensure_unconfigure()
        errors[json.dumps(argv)] = None
    except (UsageError, SystemExit) as error:
        errors[json.dumps(argv)] = str(error).strip().splitlines()[-3:] if str(error).strip() else repr(error)
open(sys.argv[2], "w").write(json.dumps(errors))
"""
PYTEST_VALUE_OPTIONS = {"-m", "-k", "-p", "-n", "-c", "-o", "--dist", "--durations", "--script", "--tb", "--maxfail",
                        "--exercises", "--basetemp", "--rootdir", "--deselect", "--ignore"}


def pytest_commands(text):
    """The argument lists of every `pytest ...` and `python -m pytest ...` line on a page (code and inline)."""
    found = []
    for _, tokens in split_command_lines(text, r"\bpytest\b"):
        for start, token in enumerate(tokens):
            before = tokens[start - 1] if start else ""
            runs = (start == 0 or before in SHELL_SEPARATORS or before.isdigit()
                    or (before == "-m" and start >= 2 and os.path.basename(tokens[start - 2]) in ("python", "python3")))
            if token != "pytest" or not runs:
                continue
            argv = []
            for word in tokens[start + 1:]:
                if word in SHELL_SEPARATORS or word.startswith((">", "2>")):
                    break
                argv.append(word)
            found.append(tuple(argv))
    return found


PARSED = {}  # argv -> pytest's error (None: parsed), filled by one subprocess per new batch of command lines


def pytest_parse_errors(commands):
    """pytest's own parse of each command line (plugins, pytest.ini's addopts and the conftests' options), in one
    subprocess, without collecting (the first one also parses the planted edits' lines, so that they cost none)."""
    if not PARSED:
        texts = page_texts()
        commands = list(commands) + [argv for _, page, old, new, check in NEW_PLANTED_EDITS
                                     if check is pytest_command_problems
                                     for argv in pytest_commands(texts[page].replace(old, new, 1))]
    new = sorted(set(commands) - set(PARSED))
    if new:
        import tempfile
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "errors.json")
            subprocess.run([sys.executable, "-c", PYTEST_PARSER, json.dumps(new), out], cwd=ROOT, check=True,
                           timeout=120, capture_output=True)
            PARSED.update({tuple(json.loads(argv)): error for argv, error in json.load(open(out)).items()})
    return {argv: PARSED[argv] for argv in commands}


def markers():
    import configparser
    ini = configparser.ConfigParser()
    ini.read(os.path.join(ROOT, "pytest.ini"))
    return {line.split(":")[0].strip() for line in ini["pytest"]["markers"].strip().splitlines()}


def defined_tests():
    """{test file: the test functions it defines}, tests/ and exercises/."""
    files = glob.glob(os.path.join(ROOT, "tests", "test_*.py")) + glob.glob(os.path.join(ROOT, "exercises", "test_*.py"))
    return {relative(path): set(re.findall(r"^def (test_\w+)", open(path).read(), re.M)) for path in files}


def named_test_problems(reference):
    """`tests/test_x.py`, `tests/test_x.py::test_name` or a bare `test_name`: the file and the test exist."""
    tests = defined_tests()
    if "::" in reference:
        path, name = reference.split("::", 1)
    else:
        path, name = (reference, "") if "/" in reference or reference in ("tests", "exercises") else ("", reference)
    name = name.split("[")[0]
    if path and not os.path.exists(os.path.join(ROOT, path)):
        return [f"`{reference}`: no such file"]
    if name and not any(name in defined for file, defined in tests.items() if not path or file == path):
        return [f"`{reference}`: no test of that name" + (f" in {path}" if path else "")]
    return []


def pytest_command_problems(texts):
    """Every pytest line parses under pytest.ini (e.g. `-p no:xdist` refuses the ini's xdist option), its -m
    expression names registered markers, and the test files and tests it names exist; so does every test a page
    names in its prose (`test_ppo_learns_the_cue_task`, `tests/test_preemption.py::test_...`)."""
    commands = {page: pytest_commands(text) for page, text in texts.items()}
    errors = pytest_parse_errors([argv for found in commands.values() for argv in found])
    problems = []
    for page, found in commands.items():
        for argv in found:
            line = "pytest " + shlex.join(argv)
            if errors[argv]:
                problems.append(f"{page}: `{line}`: {errors[argv]}")
            for option, value in zip(argv, argv[1:]):
                if option == "-m":
                    unknown = set(re.findall(r"\w+", value)) - {"and", "or", "not"} - markers()
                    problems += [f"{page}: `{line}`: no marker {name} in pytest.ini" for name in sorted(unknown)]
            for previous, word in zip(("",) + argv, argv):
                if previous not in PYTEST_VALUE_OPTIONS and re.match(r"(tests|exercises)(/|$)", word):
                    problems += [f"{page}: `{line}`: {problem}" for problem in named_test_problems(word)
                                 if word.split("::")[0].endswith(".py") or "::" not in word]
    for page, text in texts.items():
        for span in set(inline_spans(text)):
            if re.fullmatch(r"(tests/test_\w+\.py(::test_\w+)?|test_\w+)", span) and span not in {"test_grade.py"}:
                problems += [f"{page}: {problem}" for problem in named_test_problems(span)]
    return problems


def test_every_pytest_line_parses_and_every_named_test_exists():
    texts = page_texts()
    assert sum(len(pytest_commands(text)) for text in texts.values()) >= 5  # the extractor finds them
    assert pytest_command_problems(texts) == []


EXAMPLE_LINE = re.compile(r"\biter (\d+)/(\d+) \| step ([\d,]+)")


def steps_per_iteration(script, argv):
    """Environment steps per logged iteration of a Procgen script run with argv (tyro's parse of its flags)."""
    import tyro
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        args = tyro.cli(dataclass_of(script), args=argv)
    if script == "vtrace.py":
        return args.total_timesteps, args.updates_per_iteration * args.num_envs * args.unroll_length
    return args.total_timesteps, args.num_envs * args.num_steps


def example_line_problems(texts):
    """An example console line (`iter i/N | step S`) is what the command it illustrates prints: the last Procgen
    command before it in its section (none: the page's script at its defaults), N = total_timesteps // steps per
    iteration and S = i × steps per iteration."""
    problems = []
    for page, text in texts.items():
        for match in EXAMPLE_LINE.finditer(text):
            section = text[:match.start()].rsplit("\n## ", 1)[-1]
            commands = [(script, argv) for script, argv, _ in commands_of(section) if script in PROCGEN_SCRIPTS]
            script, argv = commands[-1] if commands else (PAGE_SCRIPTS.get(page, "ppo_procgen.py"), [])
            total, per_iteration = steps_per_iteration(script, argv)
            iteration, shown_n, shown_step = int(match.group(1)), int(match.group(2)), match.group(3)
            expected = f"iter {iteration}/{total // per_iteration} | step {iteration * per_iteration:,}"
            if match.group(0) != expected:
                problems.append(f"{page}: `{match.group(0)}`, where `python {script} {shlex.join(argv)}` prints "
                                f"`{expected}`")
    return problems


def test_every_example_console_line_is_its_commands():
    texts = page_texts()
    assert sum(len(EXAMPLE_LINE.findall(text)) for text in texts.values()) >= 1
    assert example_line_problems(texts) == []


@functools.lru_cache(maxsize=None)
def public_points():
    """{exercise: the points of its public grade on the repository's script}, from the public grader's own plan
    (every case of every exercise function in the file, the contract cases on a CPU), without running a case."""
    from exercises import grading
    from exercises.texts import EXERCISES
    points = {}
    for exercise, spec in EXERCISES.items():
        module = load(spec["script"][:-3])
        plan = grading.plan_exercise(exercise, {spec["script"]: set(vars(module))}, grading.load_cases)
        points[exercise] = sum(case.points for functions in plan.values() for cases in functions.values()
                               for case in cases if case.kind != "cuda")
    return points


def point_problems(texts):
    """assignments.md's public points (the exercise table's column and each "N public points") are the public
    grader's, and its points per exercise are the instructor grader's EXERCISE_POINTS."""
    text = texts["docs/assignments.md"]
    problems = []
    rows = {row[0].strip("`"): row for row in table_rows(text) if row[0].startswith("`")}
    header = next(row for row in table_rows(text) if row[0] == "exercise")
    column = next(i for i, cell in enumerate(header) if "points" in cell)
    for exercise, points in public_points().items():
        shown = rows.get(exercise, [""] * (column + 1))[column]
        if shown != f"{points:g}":
            problems.append(f"docs/assignments.md: {exercise}'s public points are {shown!r}; its grade gives {points:g}")
    body = " ".join(prose(text).split())
    for exercise, shown in re.findall(r"grade\.py (\w+)[^(]*\((\d+) public points", body):
        if float(shown) != public_points().get(exercise):
            problems.append(f"docs/assignments.md: {exercise}: {shown} public points; its grade gives "
                            f"{public_points().get(exercise):g}")
    instructor = open(os.path.join(ROOT, "exercises", "instructor.py")).read()
    exercise_points = int(re.search(r"^EXERCISE_POINTS = (\d+)", instructor, re.M).group(1))
    for shown in re.findall(r"worth (\d+) points \(`EXERCISE_POINTS`\)", body):
        if int(shown) != exercise_points:
            problems.append(f"docs/assignments.md: {shown} points per exercise; EXERCISE_POINTS is {exercise_points}")
    return problems


def test_documented_points_are_the_graders():
    assert point_problems(page_texts()) == []


FILE_COUNT = re.compile(r"`(tests/test_\w+\.py)` \((\d+) tests\b")
ANY_COUNT = re.compile(r"\b(\d[\d,]*) tests\b(?!/)")  # not `-n 0 tests/...`


def collected_counts(files):
    """{test file: the tests pytest collects in it}, one collect-only subprocess for all."""
    if not files:
        return {}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *sorted(files)], cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    ids = [line.split("::")[0] for line in out.splitlines() if "::" in line]
    return {file: ids.count(file) for file in files}


def count_problems(texts, counts=None):
    """A test count on a page is one file's (`tests/test_x.py` (N tests)), checked against pytest's collection;
    any other count (the suite's, a marker's) changes with every test added, so no page states it."""
    claims = [(page, file, int(n)) for page, text in texts.items() for file, n in FILE_COUNT.findall(prose(text))]
    counts = counts if counts is not None else collected_counts({file for _, file, _ in claims})
    problems = [f"{page}: `{file}` ({n} tests); pytest collects {counts.get(file)}" for page, file, n in claims
                if counts.get(file) != n]
    for page, text in texts.items():
        body = re.sub(r"`[^`\n]*\n?[^`\n]*`", "", FILE_COUNT.sub("", prose(text)))  # prose, not commands
        problems += [f"{page}: states a test count that no check keeps true ({n} tests): drop it or name its file"
                     for n in ANY_COUNT.findall(body)]
    return problems


def test_every_stated_test_count_is_pytests():
    assert count_problems(page_texts()) == []


# Planted wrong edits for the checks of this section: each must be reported, as a problem the page did not have.
NEW_PLANTED_EDITS = [
    ("a renamed function in a map", "docs/impala.md", "| `vtrace_loss` (", "| `vtrace_losses` (", map_problems),
    ("a class member in a map", "docs/impala.md", "`Actor.play`", "`Actor.plays`", map_problems),
    ("a flag in a map", "docs/ppo.md", "`--update-epochs` K", "`--epochs` K", map_problems),
    ("a keyword in a map", "docs/impala.md", "| `from_importance_weights` (", "| `from_importance_weights(lam=1)` (",
     map_problems),
    ("a pytest option the ini refuses", "README.md", "python -m pytest -q -n 2 --dist loadfile tests",
     "python -m pytest -q -p no:xdist tests", pytest_command_problems),
    ("an unregistered marker", "docs/testing.md", "pytest -q -m gae tests", "pytest -q -m gae_tests tests",
     pytest_command_problems),
    ("a renamed test", "docs/scale-out.md", "::test_a_batch_shell_that_forwards_sigterm_gets_the_checkpoint",
     "::test_a_batch_shell_forwards_sigterm", pytest_command_problems),
    ("an example line of another command", "README.md", "`iter 3/32 | step 49,152", "`iter 3/64 | step 3,072",
     example_line_problems),
    ("a public grade's points", "docs/assignments.md", "| 15 |", "| 16 |", point_problems),
    ("a file's test count", "docs/assignments.md", "`tests/test_grader_sandbox.py`:",
     "`tests/test_grader_sandbox.py` (3 tests):", functools.partial(count_problems, counts={})),
    ("the suite's test count", "docs/rlhf.md", "## Metrics\n", "## Metrics\nThe suite has 700 tests.\n",
     functools.partial(count_problems, counts={})),
]


@pytest.mark.parametrize("what, page, old, new, check", NEW_PLANTED_EDITS, ids=[edit[0] for edit in NEW_PLANTED_EDITS])
def test_each_planted_edit_of_the_new_checks_is_reported(what, page, old, new, check):
    texts = page_texts()
    assert old in texts[page], f"{page} no longer has `{old}`: plant another {what}"
    before = set(check(texts))
    texts[page] = texts[page].replace(old, new, 1)
    assert set(check(texts)) - before, f"{what}: not reported"
