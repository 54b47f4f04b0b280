"""The GPU check (benchmarks/gpu_bench.sh -> gpu_check.py, gpu_preflight.py, gpu_flops.py, gpu_pytest_log.py,
bench.py) on the CPU: what no GPU has measured comes first and the default steps' budgets add up, checked on a given
clock (no assertion here depends on how fast this machine is); one dry run at tiny flags (started with the module, read
by its last three tests) runs five steps into whole files, at most 8 in OUT, with the speed figures that tell which
bound binds; the whole table at a scaled deadline gives every step a budget or "no time", injects a failure, flags a
failed and a stopped learning run and packs the runs as they end; a cut pytest still reports the tests that ran, the
never-measured ones first. The real run needs a CUDA GPU."""
import json
import os
import re
import subprocess
import sys
import tarfile

import conftest
import pytest
from conftest import ROOT
# tiny_gpu_check and tiny_gpu_check_started: fixtures shared by the whole test run
from gpu_bench_commands import DRY_RUN_STEPS, parsed_commands, tiny_gpu_check, tiny_gpu_check_started  # noqa: F401

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench  # noqa: E402
import gpu_check  # noqa: E402

ORDER = ["preflight", "cuda-tests", "ppo-flags", "ppo-speed", "ppg-speed", "learning", "results", "impala-speed",
         "nccl"]


@pytest.fixture(scope="module", autouse=True)
def dry_run_in_the_background(tiny_gpu_check_started):  # noqa: F811
    """The shared dry run starts with this module, before its first test: it runs while the other tests do (the
    scaled-deadline test waits out its budgets: 20 s of sleeping stand-ins); the last two tests read it."""


def settings_in(tmp_path, **changes):
    """The check's settings with OUT and the work folder in tmp_path."""
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "work").mkdir(exist_ok=True)
    fields = dict(python=sys.executable, out=str(tmp_path / "out"), work=str(tmp_path / "work"), tiny=True,
                  deadline_s=gpu_check.DEADLINE_S, started=gpu_check.time.time())
    return gpu_check.Settings(**{**fields, **changes})


def test_what_no_gpu_measured_comes_first_and_the_default_budgets_add_up(tmp_path):
    """By default the preflight, the CUDA tests and PPO's new speed flags against its defaults in one run; at the
    default deadline each gets its whole budget; the docstring's and docs' tables are TABLE."""
    steps = gpu_check.plan(settings_in(tmp_path))
    assert [step.name for step in steps] == ORDER
    assert list(gpu_check.DEFAULT_STEPS) == ORDER[:3]
    usable = gpu_check.DEADLINE_S - gpu_check.RESERVE_S
    assert sum(step.budget_s for step in steps if step.name in gpu_check.DEFAULT_STEPS) <= usable
    assert all(0 < step.need_s <= step.budget_s for step in steps)
    learning = steps[ORDER.index("learning")]
    assert learning.need_s >= 90 and learning.budget_s - gpu_check.LEARNING_STARTUP_S >= 40  # a share up front
    for tiny, rounds in ((False, "2"), (True, "1")):
        ppo_flags = gpu_check.plan(settings_in(tmp_path, tiny=tiny))[ORDER.index("ppo-flags")].command
        configs = [ppo_flags[i + 1] for i, word in enumerate(ppo_flags) if word == "--config"]
        assert configs[0] == "defaults=" and ppo_flags[ppo_flags.index("--repeats") + 1] == rounds
        for flag in ("--cuda-graph", "--overlap-games", "--no-amp-rollout"):  # each against the defaults, one run
            assert any(flag in config for config in configs), flag
        assert any("--compile" in config for config in configs) != tiny  # minutes of compiling on a CPU
    documented = re.findall(r"^  ([a-z-]+) +(\d+) +(\d+)  ", gpu_check.__doc__, re.MULTILINE)
    assert [(name, int(need), int(budget)) for name, need, budget in documented] == gpu_check.TABLE
    default = sum(budget for name, _, budget in gpu_check.TABLE if name in gpu_check.DEFAULT_STEPS)
    every = sum(budget for _, _, budget in gpu_check.TABLE)
    assert f"default                {default}  <= DEADLINE_S 540 - RESERVE_S 15; all steps: {every} " in \
        gpu_check.__doc__
    with open(os.path.join(ROOT, "docs", "speed.md")) as f:
        rows = re.findall(r"^\| ([a-z-]+) \| (\d+) / (\d+) \|", f.read(), re.MULTILINE)
    assert [(name, int(need), int(budget)) for name, need, budget in rows] == gpu_check.TABLE


def test_the_budgets_on_a_given_clock(tmp_path):
    """The budget arithmetic at given times, not the clock's: each default step starts when the one before has used
    its whole budget and still gets its whole budget; a step that starts late is cut to what is left before the
    deadline (less the reserve), and one whose need is not left is skipped with both numbers."""
    settings = settings_in(tmp_path, started=1000.0)
    steps = gpu_check.plan(settings)
    selected = list(gpu_check.DEFAULT_STEPS)
    now = settings.started
    for step in steps:
        if step.name in selected:
            assert gpu_check.skip_reason(step, settings, {}, selected, now) is None, step.name
            assert gpu_check.timeout_for(step, settings, now) == step.budget_s
            now += step.budget_s
        else:
            assert gpu_check.skip_reason(step, settings, {}, selected, now) == "not selected (--steps)"
    assert settings.left(now) >= 0
    ppo_flags = steps[ORDER.index("ppo-flags")]
    late = settings.started + settings.deadline_s - settings.reserve_s - (ppo_flags.need_s + 30)
    assert gpu_check.skip_reason(ppo_flags, settings, {}, selected, late) is None
    assert gpu_check.timeout_for(ppo_flags, settings, late) == ppo_flags.need_s + 30 < ppo_flags.budget_s
    too_late = late + 30.5
    assert gpu_check.skip_reason(ppo_flags, settings, {}, selected, too_late) == \
        f"no time: {ppo_flags.need_s - 0.5:.1f} s left, needs {ppo_flags.need_s:.1f} s"
    assert gpu_check.skip_reason(ppo_flags, settings, {}, selected, late + 1000).startswith("no time: 0.0 s left")
    scaled = settings_in(tmp_path, started=0.0, scale=0.1, reserve_s=1.5, deadline_s=54.0)  # a scaled deadline
    cuda_tests = gpu_check.plan(scaled)[ORDER.index("cuda-tests")]
    assert (cuda_tests.need_s, cuda_tests.budget_s) == pytest.approx((6.5, 11.0))
    assert gpu_check.timeout_for(cuda_tests, scaled, now=50.0) == pytest.approx(2.5)


def collected_cuda_tests(session):
    """The node ids of the tests marked cuda in CUDA_TEST_FILES: from the running pytest where it
    collected those files (the whole suite), else from pytest --collect-only -m cuda on them."""
    files = set(gpu_check.CUDA_TEST_FILES)
    if files <= {item.nodeid.split("::")[0] for item in session.items}:
        return [item.nodeid for item in session.items
                if item.nodeid.split("::")[0] in files and item.get_closest_marker("cuda")]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-n", "0",
                             "-p", "no:cacheprovider", *gpu_check.CUDA_TEST_FILES], cwd=ROOT, capture_output=True,
                            text=True)
    return [line for line in listed.stdout.splitlines() if "::" in line]


def test_the_cuda_tests_budget_follows_their_count(request):
    """CUDA_TESTS is the number of tests marked cuda in CUDA_TEST_FILES (update it when a CUDA test is added: the
    budget follows); the need is their estimate at CUDA_TEST_S each, the budget has headroom and the grace."""
    collected = collected_cuda_tests(request.session)
    assert len(collected) == gpu_check.CUDA_TESTS, collected
    need, budget = gpu_check.cuda_tests_budget(gpu_check.CUDA_TESTS)
    assert ("cuda-tests", need, budget) in gpu_check.TABLE
    assert gpu_check.CUDA_TESTS * gpu_check.CUDA_TEST_S <= need < budget - gpu_check.GRACE_S
    assert budget - gpu_check.GRACE_S >= 1.5 * gpu_check.CUDA_TESTS * gpu_check.CUDA_TEST_S
    assert gpu_check.cuda_tests_budget(2 * gpu_check.CUDA_TESTS)[1] > budget  # more tests, a larger budget
    for name in gpu_check.CUDA_TESTS_FIRST:  # the tests it runs first are among them
        assert any(f"::{name}" in line for line in collected), name


def learning_runs(out):
    """Stand-ins for the learning runs: on StarPilot PPG fails at once and PPO says 'packed' once learning.tar.gz is
    in OUT (packed as the other runs end: the periodic packing comes after the step's budget), then plays on past the
    step's budget; on BigFish both end well."""
    ppo = ("import os, time\n"
           f"while not os.path.exists({str(out / 'learning.tar.gz')!r}):\n"
           "    time.sleep(0.05)\n"
           "print('packed', flush=True); time.sleep(60)")
    return {("ppo_procgen.py", "starpilot"): [sys.executable, "-c", ppo],
            ("ppg_procgen.py", "starpilot"): [sys.executable, "-c", "print('error: no games'); raise SystemExit(3)"],
            ("ppo_procgen.py", "bigfish"): [sys.executable, "-c", "print('learned')"],
            ("ppg_procgen.py", "bigfish"): [sys.executable, "-c", "print('learned')"]}


def test_a_scaled_deadline_gives_every_step_a_budget_or_no_time(tmp_path, monkeypatch, capsys):
    """Every step of the table at 10 % of its time, each command a stand-in, the deadline short of the table (as in a
    job whose time limit is shorter than the table): ppo-speed plays past its budget and is cut with its JSON so far in
    OUT, ppg-speed's injected failure does not stop learning, learning's two runs are flagged (failed, stopped) within
    its budget and packed as they end, and the steps after it find no time, each with the seconds it needed. A kill's
    leftover .tmp is gone. What each step is given depends on how fast this machine runs the steps before; the
    assertions hold at any speed (the budgets' arithmetic is checked on a given clock above)."""
    # 10 %; the deadline: the reserve, ppo-speed's budget, learning's budget and 4 s. Learning starts if the steps
    # before it take less than 5 s past ppo-speed's budget (its need is 9 s), and after it at most 4 s are left:
    # short of impala-speed's need (4.5 s), however slowly the steps ran.
    scale = 0.1
    budget = {name: seconds for name, _, seconds in gpu_check.TABLE}
    need = {name: seconds for name, seconds, _ in gpu_check.TABLE}
    assert need["impala-speed"] * scale > 0.4 and need["learning"] <= budget["learning"] - 10
    deadline = gpu_check.RESERVE_S + budget["ppo-speed"] + budget["learning"] + 40
    settings = settings_in(tmp_path, scale=scale, reserve_s=gpu_check.RESERVE_S * scale,
                           grace_s=gpu_check.GRACE_S * scale, deadline_s=scale * deadline)
    out = tmp_path / "out"
    (out / "summary.json.1234.tmp").write_text("{")  # what a kill mid-write would leave
    bench_so_far = json.dumps({"configs": {}, "results": [{"config": "defaults", "sps_median": 1.0}]})
    ppo_speed = (f"open({str(tmp_path / 'work' / 'ppo-speed.json')!r}, 'w').write({bench_so_far!r}); "
                 "import time; time.sleep(60)")
    steps = []
    for step in gpu_check.plan(settings):
        if step.command is not None:
            command = [sys.executable, "-c", ppo_speed] if step.name == "ppo-speed" else ["true"]
            step = gpu_check.dataclasses.replace(step, command=command)
        steps.append(step)
    runs = learning_runs(out)

    def stand_in(settings, script, total_timesteps, game, mode):
        return runs[script, game]

    monkeypatch.setattr(gpu_check, "learning_command", stand_in)
    assert gpu_check.run_check(settings, steps, ORDER, "ppg-speed") == 1
    summary = json.loads((out / "summary.json").read_text())
    entries = {entry["name"]: entry for entry in summary["steps"]}
    assert [entry["name"] for entry in summary["steps"]] == ORDER
    assert [entries[name]["status"] for name in ORDER[:3]] == ["ok", "ok", "ok"]
    assert entries["ppo-speed"]["status"] == "timeout" and entries["ppo-speed"]["results"][0]["sps_median"] == 1.0
    assert json.loads((out / "ppo.json").read_text())["results"][0]["config"] == "defaults"
    assert entries["ppg-speed"]["status"] == "failed" and "failure injected" in entries["ppg-speed"]["output_tail"]
    learning = entries["learning"]
    assert 0 < learning["timeout_s"] <= budget["learning"] * scale
    assert learning["status"] == "failed"
    ppg, ppo = learning["runs"]["starpilot_ppg_procgen"], learning["runs"]["starpilot_ppo_procgen"]
    assert ppg["status"] == "failed" and ppg["exit_code"] == 3 and "error: no games" in ppg["output_tail"]
    assert ppo == {"exit_code": ppo["exit_code"], "last_line": "packed", "status": "stopped at the deadline"}
    assert [learning["runs"][f"bigfish_{name}"]["status"] for name in ("ppo_procgen", "ppg_procgen")] == ["ok", "ok"]
    for entry in summary["steps"]:
        if entry["status"] != "skipped":
            assert entry["timeout_s"] <= entry["budget_s"], entry
        elif entry["reason"].startswith("no time"):
            left, needed = map(float, re.fullmatch(r"no time: (\d+\.\d) s left, needs (\d+\.\d) s",
                                                   entry["reason"]).groups())
            assert left < needed == round(entry["need_s"], 1), entry
    assert entries["impala-speed"]["status"] == "skipped" and entries["impala-speed"]["reason"].startswith("no time")
    with tarfile.open(out / "learning.tar.gz") as archive:
        assert {"starpilot_ppo_procgen.log", "starpilot_ppg_procgen.log", "bigfish_ppg_procgen.log"} <= set(
            archive.getnames())
    assert sorted(os.listdir(out)) == ["learning.tar.gz", "ppo.json", "summary.json"] == summary["files"]
    assert "== ppg-speed: failed" in capsys.readouterr().out


def test_a_cut_pytest_still_reports_the_tests_that_ran(tmp_path):
    """The cuda-tests step's command on four tests: one passes, one skips, the third kills the step's whole process
    group (as a cut does) once those two are logged, the fourth never ends. No closing line, yet the counts are there."""
    settings = settings_in(tmp_path)
    environment = gpu_check.cuda_tests_environment(settings)
    tests = tmp_path / "test_cut.py"
    tests.write_text(f'''import os, signal, time
import pytest
pytestmark = pytest.mark.cuda
def test_a_passes():
    pass
def test_b_skips():
    pytest.skip("no GPU")
def test_c_cuts_the_step():
    for _ in range(600):
        with open({environment["GPU_CHECK_TEST_LOG"]!r}) as f:
            if f.read().count('"test"') >= 2:
                break
        time.sleep(0.1)
    os.killpg(os.getpgid(0), signal.SIGKILL)
def test_d_never_ends():
    time.sleep(600)
''')
    step = gpu_check.Step("cuda-tests", 1, 120, gpu_check.cuda_tests_command(settings, files=[str(tests)]),
                          environment=environment)
    entry = gpu_check.run_command_step(step, 120, settings, inject=False)
    assert entry["status"] == "failed" and entry["exit_code"] == -9
    assert entry["tests"] == {"passed": 1, "skipped": 1} and entry["collected"] == 4
    assert entry["pytest_finished"] is False and entry["failed_tests"] == []


def test_the_cuda_tests_step_runs_the_never_measured_tests_first(tmp_path):
    """gpu_pytest_log.py moves the tests named in the step's environment to the front, each group in its order."""
    tests = tmp_path / "test_order.py"
    tests.write_text("import pytest\ndef test_a(): pass\n@pytest.mark.parametrize('x', [1, 2])\n"
                     "def test_b(x): pass\ndef test_c(): pass\n")
    environment = gpu_check.cuda_tests_environment(settings_in(tmp_path), first=("test_c", "test_b"))
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "-p", "gpu_pytest_log", "-o", "addopts=", "--rootdir", str(tmp_path), str(tests)],
                            cwd=tmp_path, capture_output=True, text=True, env={**os.environ, **environment})
    order = [line.split("::")[1] for line in listed.stdout.splitlines() if "::" in line]
    assert order == ["test_b[1]", "test_b[2]", "test_c", "test_a"], listed.stdout[-2000:]


def test_the_cuda_tests_step_collects_only_the_files_that_hold_cuda_tests():
    """Every file with a test that tests/conftest.py marks cuda, or that marks itself, and no other."""
    marked = {f"tests/{stem}.py" for stem in conftest.NEEDS["cuda"]}
    for name in os.listdir(os.path.join(ROOT, "tests")):
        if name.startswith("test_") and name.endswith(".py") and name != "test_gpu_check.py":
            with open(os.path.join(ROOT, "tests", name)) as f:
                text = f.read()
            if "pytest.mark.cuda" in text or 'pytest.param("cuda"' in text:
                marked.add(f"tests/{name}")
    assert sorted(gpu_check.CUDA_TEST_FILES) == sorted(marked)
    listing, _ = parsed_commands("")
    (pytest_line,) = [line for line in listing.splitlines() if " -m pytest " in line]
    files = [word for word in pytest_line.split(" -m cuda ")[1].split() if word.endswith(".py")]
    assert files == list(gpu_check.CUDA_TEST_FILES)
    assert "-p gpu_pytest_log" in pytest_line


def test_bench_keeps_the_configurations_that_ran_and_records_a_failed_ones_error(tmp_path):
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit, match="2 of 3 configurations failed: indivisible, unknown"):
        bench.main(["--script", "ppo_procgen.py", "--iterations", "1", "--warmup", "1", "--common",
                    gpu_check.TINY_FLAGS["ppo_procgen.py"],  # one torch thread, as in test_speed.py
                    "--config", "indivisible=--num-minibatches 3",
                    "--config", "plain=", "--config", "unknown=--no-such-flag", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == ["indivisible", "plain", "unknown"]
    assert "--num-minibatches" in results[0]["error"] and "exited with" in results[0]["error"]
    assert "--no-such-flag" in results[2]["error"]
    assert results[1]["iterations"] == 1 and results[1]["sps_median"] > 0 and results[1]["warmup_s"] > 0
    assert results[1]["sps_ratio_to_first"]["median"] == pytest.approx(1.0)  # the first that ran is the baseline


def test_ppg_policy_and_auxiliary_phases_are_measured_apart():
    """Hand-made PPG rows, N_pi = 2, warm-up 3: a policy update takes 0.5 s, and an auxiliary phase, inside the
    iteration that ends its policy phase, adds its seconds to that row's time/update. The first (cold) phase falls
    in the warm-up, the others are taken out of the policy phase's time."""
    def iteration(number, time, aux_seconds=None):
        row = {"global_step": 100 * number, "iteration": number, "time": time, "charts/SPS": 0.0,
               "time/update": 0.5 + (aux_seconds or 0.0)}
        return row if aux_seconds is None else dict(row, **{"aux/kl": 0.0})

    rows = [iteration(1, 1.0), iteration(2, 7.0, 5.0), {"global_step": 200, "eval/episodic_return": 1.0},
            iteration(3, 8.0), iteration(4, 11.0, 2.0), iteration(5, 12.0), iteration(6, 15.0, 2.0), iteration(7, 16.0)]
    measured = bench.measure(rows, warmup=3)
    assert measured["aux_phases_warmup"] == [5.0] and measured["aux_phases"] == [2.0, 2.0]
    assert measured["warmup_s"] == 8.0
    assert [(r["steps"], r["seconds"], r["aux_seconds"]) for r in measured["measured"]] == [
        (100, 3.0, 2.0), (100, 1.0, 0.0), (100, 3.0, 2.0), (100, 1.0, 0.0)]
    summary = bench.summarize("n_pi_2", [dict(measured, process_s=20.0, rss=2**30)])
    assert summary["sps_policy_phase"] == pytest.approx(100.0)  # 100 steps in 1 s, every iteration
    assert summary["sps_overall"] == pytest.approx(400 / 8.0) and summary["aux_phase_s"] == 2.0


def test_every_step_command_parses_at_tiny_and_at_real_flags():
    for tiny in ("", "1"):
        listing, parsed = parsed_commands(tiny)
        # ppo-flags, ppo-speed, ppg, impala, learning, NCCL
        assert len(parsed) == len(gpu_check.PPO_FLAGS) + 1 + 1 + 2 + 2 + 1, listing
        assert ("--num-envs 2 " in listing) == bool(tiny)
        assert "--env-id bigfish --distribution-mode hard" in listing  # the learning check's second game


def test_the_dry_run_reports_every_step_into_whole_files(tiny_gpu_check):  # noqa: F811
    run = tiny_gpu_check
    assert [step["name"] for step in run.summary["steps"]] == ORDER
    # Only the preflight fails (no CUDA here), and the exit status says so.
    assert [name for name, step in run.steps.items() if step["status"] not in ("ok", "skipped")] == ["preflight"]
    assert run.finished.returncode == 1, run.finished.stdout[-3000:]
    # On this CPU the preflight finds everything but CUDA, says so in one line, and the dry run goes on.
    preflight = run.steps["preflight"]
    assert preflight["status"] == "failed" and preflight["exit_code"] == 2
    assert preflight["missing"].startswith("missing: CUDA:") and ";" not in preflight["missing"]
    packages = preflight["report"]["packages"]
    assert preflight["report"]["procgen_step"] == "ok" and (packages.get("procgen-mirror") or packages.get("envpool"))
    assert "preflight: missing: CUDA:" in run.log
    for name in ("ppo-speed", "ppg-speed"):  # with the figures that tell which bound binds
        (result,) = run.steps[name]["results"]
        assert run.steps[name]["status"] == "ok" and result["sps_median"] > 0
        assert 0 < result["env_ms_per_vector_step"] <= result["ms_per_vector_step"]
        assert result["update_flop"] > 0 and result["update_tflops"] > 0
    learning = run.steps["learning"]
    assert learning["status"] == "ok", run.finished.stdout[-3000:]
    assert {name: r["status"] for name, r in learning["runs"].items()} == {
        f"{game}_{name}": "ok" for game in ("starpilot", "bigfish") for name in ("ppo_procgen", "ppg_procgen")}
    assert run.steps["results"]["status"] == "ok" and run.steps["results"]["on_track"]
    selected = DRY_RUN_STEPS.split(",")
    assert all(step["reason"] == "not selected (--steps)" for name, step in run.steps.items() if name not in selected)
    assert run.files == sorted(["gpu_bench.log", "summary.json", "ppo.json", "ppg.json", "learning.tar.gz"])
    assert run.summary["files"] == run.files  # its last rewrite lists them all
    with tarfile.open(run.out / "learning.tar.gz") as archive:
        names = archive.getnames()
    assert sum(name.endswith("/metrics.jsonl") for name in names) == 4
    assert {"starpilot_ppo_procgen.log", "bigfish_ppg_procgen.log", "results/aggregate.md",
            "results/starpilot_easy.png", "results/bigfish_hard.png"} <= set(names)  # figures: in the tarball alone


def test_a_whole_run_puts_at_most_8_files_in_out(tiny_gpu_check, tmp_path):  # noqa: F811
    """The results of a remote GPU machine come back as at most 8 files. The dry run's files, and
    those that the steps it leaves out write (each its JSON: a step writes only its `output`,
    learning.tar.gz and summary.json), are at most 8."""
    left_out = [step for step in gpu_check.plan(settings_in(tmp_path)) if step.name not in tiny_gpu_check.steps
                or tiny_gpu_check.steps[step.name]["status"] == "skipped"]
    whole = set(tiny_gpu_check.files) | {step.output for step in left_out if step.output}
    assert {"ppo_flags.json", "impala.json"} <= whole and len(whole) <= 8, sorted(whole)


def test_benchmark_harness_at_tiny_flags(tiny_gpu_check):  # noqa: F811
    """bench.py's JSONs of the GPU check's CPU dry run (tests/gpu_bench_commands.py; its tiny runs take one torch thread:
    these tiny convolutions gain nothing from two, and with other jobs on the cores a team of two runs them many times
    slower): PPO at its defaults, PPG with its auxiliary phases timed apart."""
    (ppo,) = json.loads((tiny_gpu_check.out / "ppo.json").read_text())["results"]
    (ppg,) = json.loads((tiny_gpu_check.out / "ppg.json").read_text())["results"]
    assert ppo["config"] == "defaults" and ppg["config"] == "n_pi_2"
    for r in (ppo, ppg):
        assert r["iterations"] == 2 and 0 < r["sps_min"] <= r["sps_median"] <= r["sps_max"]
        assert {"env", "rollout", "update"} <= set(r["seconds_per_iteration"])
        assert 0 <= r["seconds_per_iteration"]["env"] <= r["seconds_per_iteration"]["rollout"]
        assert r["peak_rss_gb"] > 0.1 and r["peak_gpu_gb"] is None and r["warmup_s"] > 0
        assert r["sps_ratio_to_first"]["median"] == pytest.approx(1.0)
    assert ppo["aux_phase_s"] is None and ppo["sps_policy_phase"] is None
    assert ppg["aux_phase_s"] > 0 and ppg["sps_policy_phase"] > ppg["sps_overall"] > 0  # the phase taken out
