"""The GPU check (benchmarks/gpu_bench.sh -> gpu_check.py, gpu_preflight.py, gpu_flops.py, gpu_pytest_log.py,
bench.py) on the CPU: its budgets add up in the order of value; one dry run at tiny flags (started with the module, read
by its last two tests) runs the first five steps into whole files, with the speed figures that tell which bound binds;
the whole table at a scaled deadline gives every step its budget or "no time", injects a failure, flags a failed and a
stopped learning run and packs the runs as they end; a cut pytest still reports the tests that ran. The real run needs
a CUDA GPU."""
import json
import os
import re
import sys
import tarfile

import conftest
import pytest
from conftest import ROOT
# tiny_gpu_check and tiny_gpu_check_started: fixtures shared by the whole test run
from gpu_bench_commands import parsed_commands, tiny_gpu_check, tiny_gpu_check_started  # noqa: F401

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench  # noqa: E402
import gpu_check  # noqa: E402

ORDER = ["preflight", "ppo-speed", "ppg-speed", "learning", "results", "ppo-fast", "impala-speed", "nccl",
         "cuda-tests"]


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


def test_the_budgets_add_up_in_the_order_of_value(tmp_path):
    """At the default deadline every step gets its whole budget: the budgets and the reserve fit 540 s; speed at the
    defaults, PPG's phases and learning come first; the docstring's and docs' tables are TABLE."""
    steps = gpu_check.plan(settings_in(tmp_path))
    assert [step.name for step in steps] == ORDER
    usable = gpu_check.DEADLINE_S - gpu_check.RESERVE_S
    assert sum(step.budget_s for step in steps) <= usable
    assert all(0 < step.need_s <= step.budget_s for step in steps)
    learning = steps[ORDER.index("learning")]
    assert learning.need_s >= 90 and learning.budget_s - gpu_check.LEARNING_STARTUP_S >= 40  # a share up front
    documented = re.findall(r"^  ([a-z-]+) +(\d+) +(\d+)  ", gpu_check.__doc__, re.MULTILINE)
    assert [(name, int(need), int(budget)) for name, need, budget in documented] == gpu_check.TABLE
    assert f"sum                    {sum(budget for _, _, budget in gpu_check.TABLE)}  = DEADLINE_S 540" in \
        gpu_check.__doc__
    with open(os.path.join(ROOT, "docs", "speed.md")) as f:
        rows = re.findall(r"^\| ([a-z-]+) \| (\d+) / (\d+) \|", f.read(), re.MULTILINE)
    assert [(name, int(need), int(budget)) for name, need, budget in rows] == gpu_check.TABLE


def learning_runs(out):
    """Stand-ins for the learning runs: on StarPilot PPG fails at once and PPO reports whether learning.tar.gz was in
    OUT a moment later (packed as PPG's run ended), then plays on past the step's budget; on BigFish both end well."""
    ppo = ("import os, time; time.sleep(1); "
           f"print('packed' if os.path.exists({str(out / 'learning.tar.gz')!r}) else 'not packed', flush=True); "
           "time.sleep(60)")
    return {("ppo_procgen.py", "starpilot"): [sys.executable, "-c", ppo],
            ("ppg_procgen.py", "starpilot"): [sys.executable, "-c", "print('error: no games'); raise SystemExit(3)"],
            ("ppo_procgen.py", "bigfish"): [sys.executable, "-c", "print('learned')"],
            ("ppg_procgen.py", "bigfish"): [sys.executable, "-c", "print('learned')"]}


def test_a_scaled_deadline_gives_every_step_its_budget_or_no_time(tmp_path, monkeypatch, capsys):
    """The whole table at 10 % of its time, each command a stand-in, the deadline short of the table (as in a job whose
    time limit is shorter than the table): ppo-speed plays past its budget and is cut with its JSON so far in OUT, ppg-speed's
    injected failure does not stop learning, learning's two runs are flagged (failed, stopped) within its budget and
    packed as they end, and each later step is skipped with the seconds it needed. A kill's leftover .tmp is gone."""
    # 10 %; the deadline: the reserve, ppo-speed's budget less the grace (its SIGTERM comes then), learning's budget
    # and 7.5 s: learning gets its whole budget with 7.5 s to spare, and what is left after it is short of the
    # results' 15 s by about as much: 0.75 s either way. At 3 % and 5 % a loaded machine's jitter (a step's kill, a
    # process start) went over the margins of 0.15 and 0.25-0.4 s, one way or the other.
    scale = 0.1
    budget = {name: seconds for name, _, seconds in gpu_check.TABLE}
    assert {name: need for name, need, _ in gpu_check.TABLE}["results"] == 15
    deadline = gpu_check.RESERVE_S + budget["ppo-speed"] - gpu_check.GRACE_S + budget["learning"] + 7.5
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
    assert gpu_check.run_check(settings, steps, [], "ppg-speed") == 1
    summary = json.loads((out / "summary.json").read_text())
    entries = {entry["name"]: entry for entry in summary["steps"]}
    assert [entry["name"] for entry in summary["steps"]] == ORDER
    assert entries["preflight"]["status"] == "ok"
    assert entries["ppo-speed"]["status"] == "timeout" and entries["ppo-speed"]["results"][0]["sps_median"] == 1.0
    assert json.loads((out / "ppo.json").read_text())["results"][0]["config"] == "defaults"
    assert entries["ppg-speed"]["status"] == "failed" and "failure injected" in entries["ppg-speed"]["output_tail"]
    learning = entries["learning"]
    assert learning["timeout_s"] == pytest.approx(budget["learning"] * scale)
    assert learning["seconds"] <= budget["learning"] * scale + 0.5
    assert learning["status"] == "failed"
    ppg, ppo = learning["runs"]["starpilot_ppg_procgen"], learning["runs"]["starpilot_ppo_procgen"]
    assert ppg["status"] == "failed" and ppg["exit_code"] == 3 and "error: no games" in ppg["output_tail"]
    assert ppo == {"exit_code": ppo["exit_code"], "last_line": "packed", "status": "stopped at the deadline"}
    assert [learning["runs"][f"bigfish_{name}"]["status"] for name in ("ppo_procgen", "ppg_procgen")] == ["ok", "ok"]
    for name in ORDER[ORDER.index("results"):]:
        need = entries[name]["need_s"]
        assert entries[name]["status"] == "skipped", entries[name]
        assert re.fullmatch(rf"no time: \d+\.\d s left, needs {need:.1f} s", entries[name]["reason"]), entries[name]
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
    assert pytest_line.split(" -m cuda ")[1].split(" -n ")[0].split() == list(gpu_check.CUDA_TEST_FILES)
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
        assert len(parsed) == 1 + 1 + 4 + 2 + 2 + 1, listing  # ppo-speed, ppg, ppo-fast, impala, learning, NCCL
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
    assert learning["seconds"] <= learning["budget_s"]
    assert run.steps["results"]["status"] == "ok" and run.steps["results"]["on_track"]
    assert all(run.steps[name]["reason"] == "not selected (--steps)" for name in ORDER[5:])
    assert run.files == sorted(["gpu_bench.log", "summary.json", "ppo.json", "ppg.json", "learning.tar.gz",
                                "starpilot_easy.png", "bigfish_hard.png", "aggregate.md"])
    assert run.summary["files"] == run.files  # its last rewrite lists them all
    with tarfile.open(run.out / "learning.tar.gz") as archive:
        names = archive.getnames()
    assert sum(name.endswith("/metrics.jsonl") for name in names) == 4
    assert {"starpilot_ppo_procgen.log", "bigfish_ppg_procgen.log", "results/aggregate.md"} <= set(names)


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
