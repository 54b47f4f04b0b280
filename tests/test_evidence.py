"""benchmarks/launch.py (runs side by side: the cores split, the deadline, steps/s) and benchmarks/evidence.py (PPO
and PPG against the official runs): the launcher on stand-in scripts; the evidence's table against the official
runs' own file; the evidence command end to end at tiny flags on CPU, cut by a Ctrl-C, moved to another folder and
resumed there; the PPG steps a cut loses past the last auxiliary phase."""
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import evidence  # noqa: E402
import launch  # noqa: E402

# A stand-in for a training script: a metrics row every 0.05 s, 100 steps each; on SIGTERM it exits 143 as the
# scripts do, unless told to ignore it. It records the thread flags and the cores it was given.
STAND_IN = textwrap.dedent('''
    import json, os, signal, sys, time
    argv = sys.argv[1:]
    rows, ignore = int(argv[argv.index("--rows") + 1]), "--ignore-sigterm" in argv
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else lambda *_: sys.exit(143))
    os.makedirs("runs/run", exist_ok=True)
    with open("runs/run/seen.json", "w") as f:
        json.dump({"argv": argv, "cores": sorted(os.sched_getaffinity(0))}, f)
    with open("runs/run/metrics.jsonl", "a") as f:
        for row in range(rows):
            f.write(json.dumps({"global_step": 100 * (row + 1)}) + "\\n")
            f.flush()
            time.sleep(0.05)
''')


def test_the_launcher_splits_the_cores_stops_at_the_deadline_and_counts_each_runs_steps(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    jobs = [launch.Job("quick", [str(script), "--rows", "4"]),
            launch.Job("long", [str(script), "--rows", "10000"]),
            launch.Job("deaf", [str(script), "--rows", "10000", "--ignore-sigterm"])]
    report, interrupted = launch.launch(jobs, str(tmp_path / "out"), seconds=2.0, grace_s=1.0)
    assert not interrupted
    runs = report["runs"]
    assert runs["quick"]["status"] == "finished" and runs["quick"]["steps"] == 400
    assert runs["long"]["status"].startswith("stopped at the deadline") and runs["long"]["exit_code"] == 143
    assert runs["deaf"]["status"].startswith("killed")
    for name, run in runs.items():
        with open(tmp_path / "out" / name / "runs" / "run" / "metrics.jsonl") as f:
            assert run["steps"] == 100 * len(f.readlines())
        assert run["steps_per_s"] == pytest.approx(run["steps"] / run["seconds"], rel=0.05)
    assert runs["long"]["seconds"] >= 2.0 > runs["quick"]["seconds"]
    total = sum(run["steps"] for run in runs.values())
    assert report["aggregate_steps_per_s"] == pytest.approx(total / report["seconds"], rel=0.01)
    assert json.loads((tmp_path / "out" / "launch.json").read_text()) == report
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // 3)
    seen = [json.loads((tmp_path / "out" / name / "runs" / "run" / "seen.json").read_text()) for name in runs]
    for entry in seen:
        assert entry["argv"][-4:] == ["--env-threads", str(share), "--torch-threads", str(share)]
    if len(cores) >= 3:  # a core of its own each
        assert sorted(core for entry in seen for core in entry["cores"]) == cores[:3 * share]


def test_a_second_launch_counts_only_its_own_steps(tmp_path):
    """The same folder again (a resumed run): its steps are those past where its metrics stood at the start."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    for rows, steps in ((3, 300), (5, 200)):  # the second run's rows reach step 500, from 300
        report, _ = launch.launch([launch.Job("run", [str(script), "--rows", str(rows)])], str(tmp_path / "out"),
                                  seconds=30.0, grace_s=1.0)
        assert report["runs"]["run"]["steps"] == steps


# ---- the evidence's table against the official runs' own file ----
def official_window(experiment, game, step):
    """Each official seed's mean return over its rows in (step - 8 rows, step], read straight from the file."""
    with gzip.open(os.path.join(ROOT, "benchmarks", "reference", "phasic_policy_gradient.json.gz"), "rt") as f:
        data = json.load(f)
    meta = data["experiments"][experiment]
    means = []
    for seed in meta["seeds"]:
        curve = data["curves"][seed][game]
        steps = np.array(curve.get("steps", meta["steps"]), dtype=float)
        returns = np.array([np.nan if value is None else value for value in curve["returns"]])
        width = 8 * np.diff(steps).min()
        inside = (steps > step - width) & (steps <= step) & ~np.isnan(returns)
        means.append(returns[inside].mean())
    return np.array(means)


def write_run(folder, args, value):
    """A finished run at 256 games x 256 steps per iteration, its last-100 return `value` at every row."""
    os.makedirs(folder)
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump(args, f)
    iteration = 256 * 256
    final = args["total_timesteps"] // iteration * iteration
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(iteration, final + 1, iteration):
            f.write(json.dumps({"global_step": step, "iteration": step // iteration, "charts/episodes": 10,
                                "charts/episodic_return": value, "charts/episodic_return_last100": value}) + "\n")
        f.write(json.dumps({"global_step": final, "eval/episodic_return": value}) + "\n")


def test_the_table_compares_both_algorithms_with_the_official_seeds_at_8m(tmp_path):
    common = {"env_id": "starpilot", "distribution_mode": "hard", "num_levels": 0, "seed": 1, "num_envs": 256,
              "num_steps": 256, "total_timesteps": 8_000_000, "policy_loss": "clip"}
    step = 8_000_000 // 65_536 * 65_536
    ppo, ppg = official_window("ppo", "starpilot", step), official_window("ppg", "starpilot", step)
    assert ppg.min() > ppo.max()  # the paper's separation at 8M, which the table must show
    write_run(tmp_path / "starpilot__ppo_procgen__1" / "runs" / "a",
              {**common, "script": "ppo_procgen.py", "exp_name": "ppo_paper_baseline", "init": "normed",
               "adv_norm": "batch"}, ppo.min() - 0.5)
    write_run(tmp_path / "starpilot__ppg_procgen__1" / "runs" / "b",
              {**common, "script": "ppg_procgen.py", "exp_name": "ppg_procgen"}, float(ppg.mean()))
    rows = evidence.game_rows(str(tmp_path))
    assert rows["starpilot"]["step"] == step and rows["starpilot"]["done"]
    assert rows["starpilot"]["PPO"]["official"] == pytest.approx(list(ppo))
    assert rows["starpilot"]["PPG"]["official"] == pytest.approx(list(ppg))
    line = [line for line in evidence.markdown(rows).splitlines() if line.startswith("| starpilot")][0]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[1] == "8.0M" and cells[4] == "yes"
    assert cells[5] == f"{ppo.mean():.2f} [{ppo.min():.2f}, {ppo.max():.2f}]"
    assert cells[6] == f"{ppg.mean():.2f} [{ppg.min():.2f}, {ppg.max():.2f}]"
    assert cells[7:] == ["below", "yes"]


# ---- the command end to end, at tiny flags ----
TINY = "--num-envs 4 --num-steps 16 --num-minibatches 2 --channels 4 --hidden-size 8 --eval-every 0 --eval-episodes 1"


def evidence_command(out, minutes):
    return [sys.executable, os.path.join(ROOT, "benchmarks", "evidence.py"), "--out", str(out), "--games", "starpilot",
            "--total-timesteps", "1024", "--minutes", str(minutes), "--grace", "60", "--reps", "1000",
            "--ppo-flags", TINY, "--ppg-flags", TINY + " --n-pi 2 --e-aux 1 --num-aux-rollouts 2"]


def training_rows(out, job):
    rows = []
    for directory, _, files in os.walk(out / job / "runs"):
        if "metrics.jsonl" in files:
            with open(os.path.join(directory, "metrics.jsonl")) as f:
                rows += [json.loads(line) for line in f if line.endswith("\n") and "charts/episodic_return" in line]
    return rows


def test_the_evidence_command_cut_by_ctrl_c_moved_resumes_and_writes_its_table_and_figure(tmp_path, monkeypatch,
                                                                                             capsys):
    """Cut by a Ctrl-C, then the folder moved (as to another path or machine) and resumed there: every iteration
    once across the cut, the checkpoints read from the new place, nothing written to the old one."""
    out = tmp_path / "evidence"
    jobs = ("starpilot__ppo_procgen__1", "starpilot__ppg_procgen__1")
    first = subprocess.Popen(evidence_command(out, 10), cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not all(len(training_rows(out, job)) >= 2 for job in jobs):
        assert first.poll() is None, first.communicate()[0][-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)  # as a Ctrl-C: the runs save their last whole iteration and stop
    output = first.communicate(timeout=120)[0]
    assert first.returncode == 130, output[-3000:]
    cut = {job: len(training_rows(out, job)) for job in jobs}
    assert all(2 <= rows < 16 for rows in cut.values()), cut  # cut before its 16 iterations, rows kept

    moved = tmp_path / "elsewhere" / "evidence"
    shutil.move(out, moved)
    out = moved
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert evidence.main(evidence_command(out, 5)[2:]) == 0  # in this process: one interpreter start fewer
    second = capsys.readouterr().out
    assert second.count(f" --resume {out}{os.sep}") == 2, second[:3000]
    assert not (tmp_path / "evidence").exists()
    for job in jobs:  # every iteration once, across the cut
        assert [row["iteration"] for row in training_rows(out, job)] == list(range(1, 17)), job
    table = (out / "evidence.md").read_text()
    assert "| starpilot | 1.0k |" in table and "no official window" in table, table
    assert (out / "_results" / "starpilot_hard.png").stat().st_size > 0
    report = json.loads((out / "launch.json").read_text())
    assert all(run["status"] == "finished" and run["steps"] > 0 for run in report["runs"].values())
    todo, done = evidence.plan(evidence.parse(evidence_command(out, 5)[2:]))  # what a third call would do
    assert not todo and sorted(done) == sorted(jobs)


def test_a_ppg_cut_loses_the_steps_past_its_last_auxiliary_phase(tmp_path):
    """PPG resumes at the end of its last auxiliary phase (every N_pi iterations) or of its run: the steps logged
    after it are lost; PPO's are not counted."""
    args = {"script": "ppg_procgen.py", "env_id": "bigfish", "distribution_mode": "hard", "seed": 1, "e_aux": 6,
            "n_pi": 32, "num_envs": 256, "num_steps": 256, "total_timesteps": 8_000_000}
    batch = 256 * 256
    for last, lost in ((45, 13), (64, 0), (31, 31), (122, 0)):  # 122: the run's last iteration
        run = tmp_path / str(last) / "runs" / "a"
        run.mkdir(parents=True)
        (run / "args.json").write_text(json.dumps(args))
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"global_step": i * batch, "iteration": i, "charts/episodic_return": 1.0}) + "\n"
            for i in range(1, last + 1)))
        assert evidence.steps_past_resume_point(str(tmp_path / str(last))) == (lost * batch, 32 * batch), last
    (tmp_path / "45" / "runs" / "a" / "args.json").write_text(json.dumps(dict(args, script="ppo_procgen.py")))
    assert evidence.steps_past_resume_point(str(tmp_path / "45")) is None
    assert evidence.steps_past_resume_point(str(tmp_path / "none")) is None
