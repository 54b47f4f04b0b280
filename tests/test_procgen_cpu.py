"""docs/results.md's StarPilot-on-a-CPU tables are the committed runs' numbers
(benchmarks/procgen_cpu.py over benchmarks/results/procgen_cpu/); runs are grouped by the flags that
differ from their script's defaults; IMPALA is read at its own iteration size and has no anchor; a
resumed run's wall time is summed over its processes; the points and windows are the on-track rule's
(benchmarks/reference/on_track.py) over the anchor's every logged row."""
import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import procgen_cpu  # noqa: E402
import on_track  # noqa: E402  (benchmarks/reference/, on the path procgen_cpu set)
import ppo_procgen  # noqa: E402
import vtrace  # noqa: E402

REFERENCE = os.path.join(ROOT, "benchmarks", "reference")


def test_the_docs_tables_are_the_committed_runs(capsys):
    tables = procgen_cpu.main([procgen_cpu.RUNS])
    capsys.readouterr()
    doc = open(os.path.join(ROOT, "docs", "results.md")).read()
    missing = [line for line in tables.splitlines() if line and line not in doc]
    assert not missing, ("docs/results.md differs from `python benchmarks/procgen_cpu.py`:\n"
                         + "\n".join(missing))


def test_points_and_windows_are_the_on_track_rules():
    """At 131k, 262k and 524k, by loops over the stored rows here: the anchor's point is its row at
    the step, and each window (the anchor seeds' and each committed PPO run's) is the plain mean of
    the 8 logged iterations that end at the step; the on-track line of these runs
    (on_track.windowed_line, as results.py --on-track prints it) is made of the same numbers."""
    data = on_track.read_reference_file(os.path.join(REFERENCE, "train_procgen.json.gz"))
    anchor = [dict(zip(data["curves"][seed]["starpilot"]["steps"],
                       data["curves"][seed]["starpilot"]["returns"]))
              for seed in data["experiments"]["easy-all"]["seeds"]]
    runs = procgen_cpu.read_groups(procgen_cpu.RUNS)[("ppo_procgen.py", ())]
    checked = 0
    for step in procgen_cpu.STEPS:
        theirs = [sum(rows[step - k * 16_384] for k in range(8)) / 8 for rows in anchor]
        width, means = procgen_cpu.anchor_window(step)
        assert width == 8 * 16_384 and means.tolist() == pytest.approx(theirs, abs=1e-12)
        assert procgen_cpu.anchor_at(step).tolist() == [rows[step] for rows in anchor]
        reached = [run for run in runs if procgen_cpu.row_step(run, step) is not None]
        ours = []
        for run in reached:
            rows = {row["global_step"]: row["charts/episodic_return_last100"]
                    for row in procgen_cpu.training_rows(run)}
            ours.append(sum(rows[step - k * 16_384] for k in range(8)) / 8)
            assert procgen_cpu.window_mean(run, step) == pytest.approx(ours[-1], abs=1e-12)
            checked += 1
        line = on_track.windowed_line("starpilot", step,
                                      [procgen_cpu.results.last100_curve(run) for run in reached],
                                      procgen_cpu.anchor_reference())
        heading = f"starpilot @ {on_track.format_step(step)} (mean of the last 131k steps)"
        assert line == on_track.on_track_line(heading, ours, "official baselines PPO (easy-all)",
                                              np.array(theirs))
    assert checked >= 3


# ---- Synthetic runs: args.json from the scripts' own Args, rows as log_iteration writes them ----

def script_args(module, script, **changes):
    """A run's args.json as the scripts write it: the script's name and every flag of its Args."""
    args = dataclasses.asdict(module.Args(**changes))
    return {"script": script, **json.loads(json.dumps(args))}  # tuples become lists, as in the file


def metric_rows(steps_per_iteration, returns, seconds_per_iteration=100.0, resume_after=None):
    """Training rows with last-100 means `returns`; with `resume_after` = k the run is resumed after
    iteration k, and the new process's time (and its SPS) counts from there."""
    rows = []
    for iteration, value in enumerate(returns, start=1):
        began = 0
        if resume_after is not None and iteration > resume_after:
            began = resume_after
        time = (iteration - began) * seconds_per_iteration
        step = iteration * steps_per_iteration
        rows.append({"global_step": step, "iteration": iteration, "time": time,
                     "charts/SPS": (step - began * steps_per_iteration) / time,
                     "charts/episodes": 160, "charts/episodic_return": value,
                     "charts/episodic_return_last100": value})
    return rows


def write_run(folder, name, args, rows):
    path = folder / name
    path.mkdir()
    (path / "args.json").write_text(json.dumps(args))
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def synthetic_runs(tmp_path):
    """PPO at its defaults (2 seeds, one resumed with other runtime flags), PPO with
    --reward-norm-gamma 0.99 and IMPALA at its defaults: each last-100 mean is its iteration's
    number (+ 1 for PPO's seed 2, + 0.5 for the changed γ), so every number has a closed form."""
    ppo = script_args(ppo_procgen, "ppo_procgen.py", seed=1, total_timesteps=524_288)
    write_run(tmp_path, "ppo_1", ppo, metric_rows(16_384, [float(k) for k in range(1, 33)]))
    resumed = script_args(ppo_procgen, "ppo_procgen.py", seed=2, total_timesteps=524_288,
                          torch_threads=1, save_model=True, save_every=4, cuda=False,
                          resume="runs/x/checkpoint.pt")
    write_run(tmp_path, "ppo_2", resumed,
              metric_rows(16_384, [k + 1.0 for k in range(1, 33)], resume_after=20))
    gamma = script_args(ppo_procgen, "ppo_procgen.py", seed=1, total_timesteps=262_144,
                        reward_norm_gamma=0.99)
    write_run(tmp_path, "ppo_gamma_1", gamma, metric_rows(16_384, [k + 0.5 for k in range(1, 17)]))
    impala = script_args(vtrace, "vtrace.py", seed=1, total_timesteps=524_288)
    write_run(tmp_path, "vtrace_1", impala, metric_rows(16_000, [float(k) for k in range(1, 33)]))
    return tmp_path


def cells(line):
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_runs_are_grouped_by_the_flags_that_differ_from_the_defaults(synthetic_runs, capsys):
    just_started = script_args(vtrace, "vtrace.py", seed=2, total_timesteps=524_288)
    write_run(synthetic_runs, "vtrace_2", just_started, [])  # no row yet: left out, with a warning
    groups = procgen_cpu.read_groups(str(synthetic_runs))
    assert "vtrace_2: no training row yet" in capsys.readouterr().err
    labels = [procgen_cpu.group_label(key) for key in groups]
    # seed, threads, saving, cuda, resume and total steps are ignored
    assert labels == ["PPO", "IMPALA", "PPO, --reward-norm-gamma 0.99"]
    assert [run.seed for run in groups[("ppo_procgen.py", ())]] == [1, 2]
    assert [run.seed for run in groups[("vtrace.py", ())]] == [1]
    assert procgen_cpu.flag_text("anneal_lr", "true") == "--anneal-lr"
    assert procgen_cpu.flag_text("clip_vloss", "false") == "--no-clip-vloss"
    assert procgen_cpu.flag_text("channels", "[32, 64, 64]") == "--channels 32 64 64"
    unknown = script_args(ppo_procgen, "ppo_procgen.py", seed=1)
    unknown["new_flag"] = 3  # a flag the defaults table does not know shows rather than vanish
    assert procgen_cpu.changed_flags(unknown) == (("new_flag", "3"),)


def test_cause_study_compares_with_the_defaults_group_at_262k(synthetic_runs):
    groups = procgen_cpu.read_groups(str(synthetic_runs))
    lines = procgen_cpu.cause_study_table(groups)
    assert len(lines) == 3
    row = cells(lines[2])
    # 262,144 steps = iteration 16: ours 16.5, the defaults' seeds 16 and 17; the windows are the
    # means over iterations 9..16: 13.0 against 12.5 and 13.5
    spread = np.std([16, 17], ddof=1)
    assert row[:3] == ["PPO, --reward-norm-gamma 0.99", "16.50 (1 seed)",
                       f"16.50 ± {spread:.2f} (2 seeds)"]
    assert row[4:6] == ["13.00 (1 seed)", f"13.00 ± {spread:.2f} (2 seeds)"]
    anchor = procgen_cpu.anchor_at(262_144)
    assert row[3] == f"{anchor.mean():.2f} [{anchor.min():.2f}, {anchor.max():.2f}]"
    at_defaults = {key: runs for key, runs in groups.items() if not key[1]}
    assert procgen_cpu.cause_study_table(at_defaults) == []  # no cause-study run: no table


def test_impala_is_read_at_its_own_rows_and_has_no_anchor(synthetic_runs):
    lines = procgen_cpu.pace_table(procgen_cpu.read_groups(str(synthetic_runs)))
    impala = [cells(line) for line in lines if line.startswith("| IMPALA")]
    # 131,072 -> its row at 128,000 = iteration 8 (value 8), its window iterations 1..8 (mean 4.5)
    assert impala[0] == ["IMPALA", "131,072 (its row at 128,000)", "8.00 (1 seed)", "no anchor",
                         "4.50 (1 seed)", "no anchor"]
    assert impala[2][1:3] == ["524,288 (its row at 512,000)", "32.00 (1 seed)"]
    ppo = cells([line for line in lines if line.startswith("| PPO | 131,072 |")][0])
    anchor = procgen_cpu.anchor_at(131_072)
    assert ppo[2:4] == [f"8.50 ± {np.std([8, 9], ddof=1):.2f} (2 seeds)",
                        f"{anchor.mean():.2f} [{anchor.min():.2f}, {anchor.max():.2f}]"]


def test_wall_time_is_summed_over_a_resume(synthetic_runs):
    groups = procgen_cpu.read_groups(str(synthetic_runs))
    resumed = groups[("ppo_procgen.py", ())][1]
    steps, seconds = procgen_cpu.wall_clock_seconds(resumed)
    assert [row["time"] for row in resumed.rows][19:22] == [2000.0, 100.0, 200.0]  # back to 0
    assert seconds.tolist() == [100.0 * k for k in range(1, 33)]  # 20 iterations, then 12, 100 s each
    assert procgen_cpu.processes(resumed) == 2
    # A resumed process that runs longer than the one before it: its time rises across the resume.
    rows = metric_rows(16_384, [1.0] * 4, resume_after=1)
    rows[0]["time"] = 50.0
    rows[0]["charts/SPS"] = 16_384 / 50.0
    run = procgen_cpu.results.Run("x", "PPO", "starpilot", "easy", 1, {}, rows)
    assert procgen_cpu.wall_clock_seconds(run)[1].tolist() == [50.0, 150.0, 250.0, 350.0]
    # 524,288 steps in 3,200 s
    assert ("| PPO | ppo_procgen.py | 2 | 524,288 | 0.89 h (2 processes) | 164 | 33.00 |"
            in procgen_cpu.runs_table(groups))


def test_the_defaults_table_is_the_scripts_args():
    """Every flag of ppo_procgen.py's and vtrace.py's Args is runtime-only or in DEFAULTS with its
    default there."""
    known = set()
    for module, script in ((ppo_procgen, "ppo_procgen.py"), (vtrace, "vtrace.py")):
        defaults = script_args(module, script)
        table = procgen_cpu.DEFAULTS[script]
        assert set(defaults) - procgen_cpu.RUNTIME_FLAGS == set(table), script
        assert {flag: defaults[flag] for flag in table} == table, script
        known |= set(defaults)
    assert procgen_cpu.RUNTIME_FLAGS <= known  # a runtime flag some script has (a typo is caught)


def test_the_figure_is_written(synthetic_runs, tmp_path):
    path = tmp_path / "figure" / "starpilot_ppo_vs_impala.png"
    procgen_cpu.plot_figure(procgen_cpu.read_groups(str(synthetic_runs)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
