"""The GPU check (benchmarks/gpu_bench.sh -> gpu_check.py, gpu_preflight.py, bench.py) dry-run on the CPU at tiny
flags: it keeps a 30 s deadline, skips in the order of value, reports a failing step and still runs the next one,
flags a failed learning run, and leaves its summary and at most 8 files. The real run needs the lent GPU machine."""
import json
import os
import subprocess
import sys
import tarfile

import pytest
from conftest import ROOT
from gpu_bench_commands import parsed_commands

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench  # noqa: E402
import gpu_check  # noqa: E402

ORDER = ["preflight", "cuda-tests", "ppo-speed", "ppg-speed", "impala-speed", "nccl", "learning", "results"]


def gpu_bench(tmp_path, **environment):
    """The one command, as on the GPU machine but with GPU_CHECK_TINY=1 and no carried wheels."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_TINY": "1", "TMPDIR": str(tmp_path),
           "WHEELS": str(tmp_path / "no-wheels"), **environment}
    finished = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_bench.sh")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    log = (out / "gpu_bench.log").read_text()
    return finished, summary, sorted(os.listdir(out)), log


def test_a_30_s_deadline_skips_in_order_and_a_failing_step_does_not_stop_the_rest(tmp_path):
    finished, summary, files, log = gpu_bench(tmp_path, DEADLINE="30", GPU_CHECK_FAIL_STEP="cuda-tests")
    steps = summary["steps"]
    assert [step["name"] for step in steps] == ORDER
    assert finished.returncode == 1, finished.stdout[-2000:]  # steps failed, and the exit status says so
    preflight, cuda_tests, ppo = steps[:3]
    # On this CPU the preflight finds everything but CUDA, says so in one line, and the dry run goes on.
    assert preflight["status"] == "failed" and preflight["exit_code"] == 2
    assert preflight["missing"].startswith("missing: CUDA:") and ";" not in preflight["missing"]
    assert preflight["report"]["procgen_step"] == "ok" and preflight["report"]["packages"]["procgen-mirror"]
    assert "preflight: missing: CUDA:" in log
    # The injected failure is reported with its output, and the next step still started.
    assert cuda_tests["status"] == "failed" and "failure injected" in cuda_tests["output_tail"]
    assert ppo["status"] != "skipped" and ppo["timeout_s"] <= 30
    # Every step that ran was given at most what was left; once the deadline skips one, it skips all later ones.
    skipped = [step["status"] == "skipped" for step in steps]
    first_skipped = skipped.index(True)
    assert first_skipped >= 3 and all(skipped[first_skipped:])
    assert all(step["reason"].startswith("deadline:") for step in steps[first_skipped:ORDER.index("learning") + 1])
    assert "needs 150 s" in steps[ORDER.index("learning")]["reason"]
    assert steps[-1]["reason"] == "no learning runs"
    assert summary["elapsed_s"] < 30 + 10  # the deadline, plus what starting bash and Python costs
    assert "summary.json" in files and "gpu_bench.log" in files and len(files) <= 8


def test_the_learning_step_runs_its_runs_and_results_into_at_most_8_files(tmp_path):
    finished, summary, files, _ = gpu_bench(tmp_path, GPU_CHECK_STEPS="learning,results")
    steps = {step["name"]: step for step in summary["steps"]}
    assert [step["name"] for step in summary["steps"]] == ORDER
    assert all(steps[name]["reason"] == "not selected (--steps)" for name in ORDER[:6])
    learning = steps["learning"]
    assert learning["status"] == "ok", finished.stdout[-3000:]
    assert {name: run["status"] for name, run in learning["runs"].items()} == {"ppo_procgen": "ok", "ppg_procgen": "ok"}
    assert steps["results"]["status"] == "ok" and steps["results"]["on_track"]
    assert finished.returncode == 0
    assert set(files) == {"gpu_bench.log", "summary.json", "learning.tar.gz", "bigfish_easy.png", "aggregate.md"}
    with tarfile.open(tmp_path / "out" / "learning.tar.gz") as archive:
        names = archive.getnames()
    assert sum(name.endswith("/metrics.jsonl") for name in names) == 2
    assert {"ppo_procgen.log", "ppg_procgen.log", "results/aggregate.md"} <= set(names)


def test_a_failed_or_stopped_learning_run_is_flagged(tmp_path, monkeypatch):
    """Each run's own exit status, where a bare `wait` would have reported none: a run that fails is flagged with its
    output, a run past the step's time is stopped (SIGTERM, then SIGKILL) and flagged as such."""
    commands = {"ppo_procgen.py": [sys.executable, "-c", "import time; print('playing', flush=True); time.sleep(60)"],
                "ppg_procgen.py": [sys.executable, "-c", "print('error: no games'); raise SystemExit(3)"]}
    monkeypatch.setattr(gpu_check, "learning_command", lambda settings, script, steps: commands[script])
    settings = gpu_check.Settings(python=sys.executable, out=str(tmp_path), work=str(tmp_path), tiny=True,
                                  deadline_s=60, started=0, reserve_s=0, grace_s=1)
    entry = gpu_check.run_learning(None, 3, settings, inject=False)
    assert entry["status"] == "failed"
    assert entry["runs"]["ppg_procgen"]["status"] == "failed" and entry["runs"]["ppg_procgen"]["exit_code"] == 3
    assert "error: no games" in entry["runs"]["ppg_procgen"]["output_tail"]
    assert entry["runs"]["ppo_procgen"]["status"] == "stopped at the deadline"
    assert entry["runs"]["ppo_procgen"]["last_line"] == "playing"


def test_bench_keeps_the_configurations_that_ran_and_records_a_failed_ones_error(tmp_path):
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit, match="2 of 3 configurations failed: indivisible, unknown"):
        bench.main(["--script", "ppo_procgen.py", "--iterations", "1", "--warmup", "1", "--common",
                    gpu_check.TINY_FLAGS["ppo_procgen.py"] + " --torch-threads 1",  # as in test_speed.py
                    "--config", "indivisible=--num-minibatches 3",
                    "--config", "plain=", "--config", "unknown=--no-such-flag", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == ["indivisible", "plain", "unknown"]
    assert "--num-minibatches" in results[0]["error"] and "exited with" in results[0]["error"]
    assert "--no-such-flag" in results[2]["error"]
    assert results[1]["iterations"] == 1 and results[1]["sps_median"] > 0 and results[1]["warmup_s"] > 0
    assert results[1]["sps_ratio_to_first"]["median"] == pytest.approx(1.0)  # the first that ran is the baseline


def test_ppg_policy_and_auxiliary_phases_are_measured_apart():
    """Hand-made PPG rows, N_pi = 2, warm-up 3: the first (cold) auxiliary phase falls in the warm-up, the others are
    taken out of the policy phase's time."""
    def iteration(number, time):
        return {"global_step": 100 * number, "iteration": number, "time": time, "charts/SPS": 0.0}

    def aux(number, seconds):
        return {"global_step": 100 * number, "iteration": number, "time/aux_phase": seconds}

    rows = [iteration(1, 1.0), iteration(2, 2.0), aux(2, 5.0), iteration(3, 8.0), iteration(4, 9.0), aux(4, 2.0),
            iteration(5, 12.0), iteration(6, 13.0), aux(6, 2.0), iteration(7, 16.0)]
    measured = bench.measure(rows, warmup=3)
    assert measured["aux_phases_warmup"] == [5.0] and measured["aux_phases"] == [2.0, 2.0]
    assert measured["warmup_s"] == 8.0
    assert [(r["steps"], r["seconds"], r["aux_seconds"]) for r in measured["measured"]] == [
        (100, 1.0, 0.0), (100, 3.0, 2.0), (100, 1.0, 0.0), (100, 3.0, 2.0)]
    summary = bench.summarize("n_pi_2", [dict(measured, process_s=20.0, rss=2**30)])
    assert summary["sps_policy_phase"] == pytest.approx(100.0)  # 100 steps in 1 s, every iteration
    assert summary["sps_overall"] == pytest.approx(400 / 8.0) and summary["aux_phase_s"] == 2.0


def test_every_step_command_parses_at_tiny_and_at_real_flags():
    for tiny in ("", "1"):
        listing, parsed = parsed_commands(tiny)
        assert len(parsed) == 3 + 1 + 2 + 1 + 1, listing
        assert ("--env-id bigfish" in listing) == bool(tiny)


def test_only_the_carried_libraries_the_machine_lacks_go_on_the_library_path(tmp_path):
    """gpu_bench.sh links a carried library into its private folder only where the loader finds none (libc.so.6 is
    on every machine; the other name on none)."""
    (tmp_path / "wheels" / "lib").mkdir(parents=True)
    for name in ("libc.so.6", "libgpucheck_absent.so.1"):
        (tmp_path / "wheels" / "lib" / name).write_bytes(b"")
    _, summary, files, log = gpu_bench(tmp_path, WHEELS=str(tmp_path / "wheels"), GPU_CHECK_STEPS="results")
    assert summary["libraries_linked"] == ["libgpucheck_absent.so.1"]
    assert "the machine lacks, on LD_LIBRARY_PATH: libgpucheck_absent.so.1\n" in log
    assert [step["status"] for step in summary["steps"]] == ["skipped"] * len(ORDER)
    assert files == ["gpu_bench.log", "summary.json"]
