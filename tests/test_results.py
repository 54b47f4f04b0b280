"""benchmarks/results.py against hand computations on synthetic runs, and benchmarks/procgen_suite.sh's command list."""
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import forked_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import results  # noqa: E402

RANGES = {"bigfish": (1, 40), "starpilot": (2.5, 64)}  # Procgen's published easy ranges, written out by hand
# The tiny case: normalized scores of 3 seeds per game for two algorithms.
TINY = {"ppo_procgen": {"bigfish": [0.1, 0.2, 0.3], "starpilot": [0.4, 0.5, 0.9]},
        "ppg_procgen": {"bigfish": [0.2, 0.3, 0.5], "starpilot": [0.5, 0.6, 0.7]}}
# By hand. PPO pooled: 0.1 0.2 0.3 0.4 0.5 0.9; 6 scores, trim 6 // 4 = 1 from each end: IQM = (0.2 + 0.3 + 0.4 + 0.5)
# / 4 = 0.35; game means 0.2 and 0.6: median = mean = 0.4. PPG pooled: 0.2 0.3 0.5 0.5 0.6 0.7: IQM = (0.3 + 0.5 +
# 0.5 + 0.6) / 4 = 0.475; game means 1/3 and 0.6: median = mean = 7/15.
# P(PPG > PPO): bigfish, PPG's 0.2 beats 0.1, ties 0.2 -> 1.5; 0.3 beats two, ties one -> 2.5; 0.5 beats all -> 3:
# 7/9. starpilot: 0.5 beats 0.4, ties 0.5 -> 1.5; 0.6 -> 2; 0.7 -> 2: 5.5/9. Mean over games: 12.5/18.
HAND = {"PPO": {"IQM": 0.35, "median": 0.4, "mean": 0.4}, "PPG": {"IQM": 0.475, "median": 7 / 15, "mean": 7 / 15}}
P_PPG_OVER_PPO = 12.5 / 18


def write_run(root, script, game, seed, last100, steps_per_iteration=512, iterations=8, eval_every=4,
              stop_after=None, cut_last_line=False, mode="easy"):
    """A run folder as the scripts write it: args.json, then one row per iteration (the training return climbs
    linearly to `last100`) and an evaluation row every `eval_every` iterations and at the end."""
    path = os.path.join(root, f"{game}__{script}__{seed}__{1000 + seed}")
    os.makedirs(path)
    num_envs = 4
    args = {"script": f"{script}.py", "exp_name": script, "env_id": game, "distribution_mode": mode, "seed": seed,
            "total_timesteps": steps_per_iteration * iterations, "num_levels": 0, "eval_only": False,
            "num_envs": num_envs, "num_steps": steps_per_iteration // num_envs}
    with open(os.path.join(path, "args.json"), "w") as f:
        json.dump(args, f)
    lines = []
    for iteration in range(1, (stop_after or iterations) + 1):
        value = last100 * iteration / iterations
        lines.append(json.dumps({"global_step": iteration * steps_per_iteration, "iteration": iteration,
                                 "charts/episodes": 2, "charts/episodic_return": value,
                                 "charts/episodic_return_last100": value}))
        if iteration % eval_every == 0 or iteration == iterations:
            lines.append(json.dumps({"global_step": iteration * steps_per_iteration, "iteration": iteration,
                                     "eval/episodic_return": value + 1, "eval/normalized_score": None}))
    text = "\n".join(lines) + "\n"
    if cut_last_line:  # a crash in the middle of writing a row
        text = text[: text.rstrip("\n").rfind("\n") + 1] + lines[-1][:20]
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(text)
    return path


def raw_return(game, normalized):
    low, high = RANGES[game]
    return low + normalized * (high - low)


def as_task_scores(per_game):
    return [np.array(scores) for scores in per_game.values()]


def test_aggregate_statistics_match_the_hand_computation():
    ppo = as_task_scores(TINY["ppo_procgen"])
    ppg = as_task_scores(TINY["ppg_procgen"])
    assert results.interquartile_mean(ppo) == pytest.approx(0.35, abs=1e-12)
    assert results.interquartile_mean(ppg) == pytest.approx(0.475, abs=1e-12)
    assert results.median_of_task_means(ppo) == pytest.approx(0.4, abs=1e-12)
    assert results.mean_of_task_means(ppg) == pytest.approx(7 / 15, abs=1e-12)
    # Three games: the median is the middle game mean, not the mean of game means.
    three = [np.array([0.0, 0.2]), np.array([0.5]), np.array([0.9, 1.1])]
    assert results.median_of_task_means(three) == pytest.approx(0.5)
    assert results.mean_of_task_means(three) == pytest.approx((0.1 + 0.5 + 1.0) / 3)
    # 8 pooled scores: trim 2 from each end.
    assert results.interquartile_mean([np.array([0.0, 1, 2, 3]), np.array([4.0, 5, 6, 70])]) == pytest.approx(3.5)
    assert results.probability_of_improvement(ppg, ppo) == pytest.approx(P_PPG_OVER_PPO, abs=1e-12)
    assert results.probability_of_improvement(ppo, ppg) == pytest.approx(1 - P_PPG_OVER_PPO, abs=1e-12)
    assert results.probability_of_improvement(ppo, ppo) == pytest.approx(0.5)  # ties count 1/2


def test_stratified_bootstrap_intervals_are_exact_where_the_bootstrap_distribution_is_known():
    rng = np.random.default_rng(0)
    # Stratified: runs are resampled within each game, so two games with identical runs give no spread at all
    # (resampling the four runs pooled would give means anywhere from 0 to 1).
    resampled = results.stratified_bootstrap([np.array([0.0, 0.0]), np.array([1.0, 1.0])], 2000, rng)
    assert [r.shape for r in resampled] == [(2000, 2), (2000, 2)]
    assert results.percentile_interval(results.mean_of_task_means(resampled), 0.95) == (0.5, 0.5)
    # One game, runs 0 and 1: a resample's mean is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4, so the 95% interval
    # is [0, 1] and the 40% interval (the 30% and 70% quantiles) is [1/2, 1/2].
    means = results.interquartile_mean(results.stratified_bootstrap([np.array([0.0, 1.0])], 20000, rng))
    assert np.mean(means == 0.5) == pytest.approx(0.5, abs=0.02)
    assert results.percentile_interval(means, 0.95) == (0.0, 1.0)
    assert results.percentile_interval(means, 0.4) == (0.5, 0.5)
    # P(X > Y) with X's runs resampled: X = {0, 1} against Y = {1/2, 1/2} is 0, 1/2 or 1 as above.
    improvement = results.probability_of_improvement(results.stratified_bootstrap([np.array([0.0, 1.0])], 20000, rng),
                                                     results.stratified_bootstrap([np.array([0.5, 0.5])], 20000, rng))
    assert results.percentile_interval(improvement, 0.95) == (0.0, 1.0)
    assert results.percentile_interval(improvement, 0.4) == (0.5, 0.5)


def test_bootstrap_interval_of_the_tiny_case_matches_exact_enumeration():
    """All 27 x 27 equally likely stratified resamples of PPO's runs, enumerated: their IQM's 2.5% and 97.5% quantiles
    against the Monte Carlo interval of aggregate_scores."""
    games = list(TINY["ppo_procgen"].values())
    exact = []
    for first in itertools.product(games[0], repeat=3):
        for second in itertools.product(games[1], repeat=3):
            pooled = sorted(first + second)
            exact.append(np.mean(pooled[1:5]))
    low, high = np.percentile(exact, [2.5, 97.5])
    metrics, improvement = results.aggregate_scores({"PPO": as_task_scores(TINY["ppo_procgen"]),
                                                     "PPG": as_task_scores(TINY["ppg_procgen"])}, 20000, 0.95,
                                                    np.random.default_rng(1))
    value, (boot_low, boot_high) = metrics["PPO"]["IQM"]
    assert value == pytest.approx(0.35)
    assert boot_low == pytest.approx(low, abs=0.01)
    assert boot_high == pytest.approx(high, abs=0.01)
    assert improvement[("PPG", "PPO")][0] == pytest.approx(P_PPG_OVER_PPO)
    assert improvement[("PPG", "PPO")][1][0] < P_PPG_OVER_PPO < improvement[("PPG", "PPO")][1][1]


def test_student_t_quantiles():
    for probability in (0.9, 0.975, 0.995):  # closed forms for 1 and 2 degrees of freedom
        assert results.student_t_quantile(probability, 1) == pytest.approx(math.tan(math.pi * (probability - 0.5)))
        two = (2 * probability - 1) / math.sqrt(2 * probability * (1 - probability))
        assert results.student_t_quantile(probability, 2) == pytest.approx(two)
    table = {3: 3.182446, 4: 2.776445, 5: 2.570582, 10: 2.228139, 30: 2.042272}  # t_{0.975}, any statistics table
    for df, value in table.items():
        assert results.student_t_quantile(0.975, df) == pytest.approx(value, abs=1e-6)


def test_curves_align_seeds_and_smooth_over_episodes():
    # Run B lacks step 10 (interpolated: 3) and run C ends at step 10 (nothing after its end).
    curves = [(np.array([0.0, 10, 20]), np.array([0.0, 1, 2])), (np.array([0.0, 20]), np.array([2.0, 4])),
              (np.array([0.0, 10]), np.array([1.0, 2]))]
    steps, mean, low, high, count = results.mean_and_band(curves, 0.95)
    assert steps.tolist() == [0, 10, 20]
    assert count.tolist() == [3, 3, 2]
    assert mean.tolist() == pytest.approx([1, 2, 3])
    t2, t1 = 4.302653, 12.706205  # t_{0.975} with 2 and 1 degrees of freedom
    assert (high - mean).tolist() == pytest.approx([t2 * 1 / math.sqrt(3), t2 * 1 / math.sqrt(3),
                                                    t1 * math.sqrt(2) / math.sqrt(2)], rel=1e-5)
    assert (mean - low).tolist() == pytest.approx((high - mean).tolist())
    # One run: a mean, no band.
    _, mean, low, _, _ = results.mean_and_band(curves[:1], 0.95)
    assert mean.tolist() == [0, 1, 2] and np.isnan(low).all()
    # Training curve: episode-weighted mean over a trailing window of 2 iterations; the first iteration (no episode)
    # is left out.
    run = results.Run("x", "PPO", "bigfish", "easy", 1, {})
    for step, value, episodes in ((10, None, 0), (20, 1.0, 2), (30, None, 0), (40, 4.0, 1), (50, 2.0, 1)):
        run.rows.append({"global_step": step, "charts/episodic_return": value, "charts/episodes": episodes})
    steps, returns = results.training_curve(run, window=2)
    assert steps.tolist() == [20, 30, 40, 50]
    assert returns.tolist() == pytest.approx([1, 1, 4, 3])


def test_results_on_synthetic_runs(tmp_path, capsys):
    """The tiny case end to end: tables and figures; then a crashed run, read up to its last complete row."""
    runs = tmp_path / "runs"
    for script, per_game in TINY.items():
        for game, scores in per_game.items():
            for seed, score in enumerate(scores, start=1):
                write_run(runs, script, game, seed, raw_return(game, score))
    os.makedirs(runs / "suite_logs")  # not a run: ignored
    summary = results.main([str(runs), "--reps", "2000", "--out", str(tmp_path / "out")])
    aggregate = summary["aggregates"]["easy"]
    assert aggregate["games"] == ["bigfish", "starpilot"]
    for algorithm, hand in HAND.items():
        for metric, value in hand.items():
            point, (low, high) = aggregate["metrics"][algorithm][metric]
            assert point == pytest.approx(value, abs=1e-9)
            assert low <= point <= high
    assert aggregate["improvement"][("PPG", "PPO")][0] == pytest.approx(P_PPG_OVER_PPO, abs=1e-9)
    table = (tmp_path / "out" / "aggregate.md").read_text()
    assert "| PPG | 6 | 0.475 [" in table and "| PPO | 6 | 0.350 [" in table
    assert "| PPG | 0.694 [" in table  # P(PPG > PPO): PPG's row, PPO's column
    for name in ("aggregate.png", "bigfish_easy.png", "starpilot_easy.png"):
        with open(tmp_path / "out" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # IMPALA on bigfish only, one run copied from another machine (a subfolder), one crashed mid-write: starpilot
    # leaves the aggregate, the crashed run is read up to its last complete row, marked, drawn and scored.
    write_run(runs / "other_machine", "vtrace", "bigfish", 1, 5.0)
    write_run(runs, "vtrace", "bigfish", 2, 8.0, stop_after=5, cut_last_line=True)
    summary = results.main([str(runs), "--reps", "2000", "--score", "eval", "--out", str(tmp_path / "out2")])
    assert summary["aggregates"]["easy"]["games"] == ["bigfish"]
    (crashed,) = [run for run in summary["runs"] if run.algorithm == "IMPALA" and run.seed == 2]
    assert crashed.partial == "metrics.jsonl line 6 cut off; read up to line 5"
    assert [row["iteration"] for row in crashed.rows if "charts/episodic_return" in row] == [1, 2, 3, 4]
    assert results.run_score(crashed, "eval") == pytest.approx(8.0 * 4 / 8 + 1)
    assert results.run_score(crashed, "train") == pytest.approx(8.0 * 4 / 8)
    table = (tmp_path / "out2" / "aggregate.md").read_text()
    assert "| IMPALA | 2 (1 partial) |" in table and "left out of the aggregate" in table.lower()
    assert f"partial: {crashed.path}: metrics.jsonl line 6 cut off" in capsys.readouterr().out
    assert (tmp_path / "out2" / "bigfish_easy.png").stat().st_size > 0


def colour_pixels(figure, axis, colour, tolerance=40):
    """Rows and columns of the rendered pixels inside `axis` within `tolerance` of `colour` (RGB)."""
    figure.canvas.draw()
    image = np.asarray(figure.canvas.buffer_rgba())[:, :, :3].astype(int)
    box = axis.get_window_extent()  # display coordinates: origin bottom-left
    height = image.shape[0]
    top, bottom = int(height - box.y1) + 2, int(height - box.y0) - 2  # inside the frame
    left, right = int(box.x0) + 2, int(box.x1) - 2
    panel = image[top:bottom, left:right]
    rows, columns = np.nonzero(np.abs(panel - np.array(colour)).max(axis=2) <= tolerance)
    return rows + top, columns + left


def test_an_evaluation_of_one_point_is_drawn(tmp_path, monkeypatch):
    """Runs shorter than --eval-every iterations evaluate once, at their end: the evaluation panel shows that point
    (a line of one point draws nothing), and two seeds' interval at it, as rendered pixels in each run's colour."""
    for seed, last100 in ((1, 5.0), (2, 9.0)):  # evaluation returns 6 and 10 at step 1024
        write_run(tmp_path, "ppo_procgen", "bigfish", seed, last100, iterations=2, eval_every=4)
    write_run(tmp_path, "vtrace", "bigfish", 1, 3.0, iterations=2, eval_every=4)  # one seed: a point, no interval
    runs = [results.read_run(path) for path in results.find_runs(str(tmp_path))]
    by_algorithm = {"PPO": [run for run in runs if run.algorithm == "PPO"],
                    "IMPALA": [run for run in runs if run.algorithm == "IMPALA"]}
    assert [len(results.evaluation_curve(run)[0]) for run in runs] == [1, 1, 1]
    figures = []
    monkeypatch.setattr(results, "save_figure", lambda figure, path: figures.append(figure))
    colours = {"PPO": (0x1F, 0x77, 0xB4), "IMPALA": (0xD6, 0x27, 0x28)}  # matplotlib's C0 and C3
    results.plot_game(str(tmp_path / "bigfish_easy.png"), "bigfish", "easy", by_algorithm,
                      {"PPO": "C0", "IMPALA": "C3"}, types.SimpleNamespace(smooth=2, confidence=0.95))
    (figure,) = figures
    evaluation = figure.axes[1]
    for algorithm, expected in (("PPO", 8.0), ("IMPALA", 4.0)):
        rows, columns = colour_pixels(figure, evaluation, colours[algorithm])
        assert len(rows) > 10, f"{algorithm}: its one evaluation is not drawn"
        x, y = evaluation.transData.transform((1024, expected))  # where the point belongs, in display pixels
        row = figure.canvas.get_width_height()[1] - y
        assert np.hypot(columns - x, rows - row).min() < 3, f"{algorithm}: drawn away from (1024, {expected})"
    # PPO's two seeds: the t-interval mean +- t_{0.975, 1} s / sqrt(2), s = 2 sqrt(2), drawn over its full height.
    half_width = 12.706205 * 2 * math.sqrt(2) / math.sqrt(2)
    ends = [evaluation.transData.transform((1024, 8.0 + sign * half_width))[1] for sign in (-1, 1)]
    rows, _ = colour_pixels(figure, evaluation, colours["PPO"])
    assert rows.max() - rows.min() > 0.9 * abs(ends[1] - ends[0])
    results.plt.close(figure)


# ---- real runs of the three Procgen scripts, once per test run ----
TINY_RUNS = {  # a few seconds each on a 2-core CPU; PPG in hard mode, so that its anchor is missed for its flags
    "ppo_procgen.py": ["--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2", "--total-timesteps", "128"],
    "ppg_procgen.py": ["--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2", "--total-timesteps", "128",
                       "--n-pi", "2", "--e-aux", "1", "--distribution-mode", "hard"],
    "vtrace.py": ["--num-envs", "4", "--unroll-length", "8", "--updates-per-iteration", "2", "--total-timesteps",
                  "192", "--deterministic-lag"],
}
COMMON = ["--eval-every", "1", "--eval-episodes", "2", "--channels", "4", "--hidden-size", "8", "--torch-threads", "1",
          "--env-threads", "1"]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """runs/ of one tiny real run of each Procgen script (started together, a few seconds each; forked from a server
    that has imported torch, tests/forked_run.py)."""
    folder = tmp_path_factory.mktemp("real_runs")
    processes = {script: forked_run.ForkedRun(os.path.join(ROOT, script), [*flags, *COMMON], cwd=str(folder),
                                                 stderr_to_stdout=True)
                 for script, flags in TINY_RUNS.items()}
    for script, process in processes.items():
        output = process.communicate(timeout=300)[0]
        assert process.returncode == 0, f"{script}: {output[-3000:]}"
    return folder / "runs"


def test_real_runs_of_every_script_are_read_whole(real_runs, tmp_path, capsys):
    """Each script's own args.json and metrics.jsonl: nothing skipped, every run finished (its last iteration at the
    run's trained steps, as the script computed them, and a final evaluation there)."""
    summary = results.main([str(real_runs), "--reps", "1000", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "skipped" not in out and "partial" not in out, out
    runs = {run.algorithm: run for run in summary["runs"]}
    assert sorted(runs) == ["IMPALA", "PPG", "PPO"]
    trained = {"PPO": 128, "PPG": 128, "IMPALA": 192}  # 2 x 4 x 16; 2 x 4 x 16; 3 x (2 updates x 4 games x 8 steps)
    for algorithm, run in runs.items():
        assert run.partial is None, (algorithm, run.partial)
        iterations = [row for row in run.rows if "charts/episodic_return" in row]
        assert iterations[-1]["global_step"] == trained[algorithm]
        assert [row["global_step"] for row in run.rows if "eval/episodic_return" in row][-1] == trained[algorithm]
    assert (tmp_path / "out" / "starpilot_easy.png").exists() and (tmp_path / "out" / "starpilot_hard.png").exists()


def test_real_runs_without_an_anchor_say_why(real_runs, tmp_path, capsys):
    """One line per run group with no anchor: the script (IMPALA), the flags (PPG's N_pi and E_aux together) and the
    steps (PPO easy matches baselines PPO, whose first row is long after 128 steps); in --on-track mode too."""
    expected = [
        "no anchor: IMPALA (easy) starpilot: vtrace.py: no anchor ran it on Procgen (the official runs are PPO and PPG)",
        "no anchor: PPG (hard) starpilot: ppg_procgen.py --n-pi 2 --e-aux 1: no official run changed these together "
        "(or with this variant)",
    ]
    reference = results.load_references()["train_procgen/easy-all"]
    first = max(x[0] for x, _ in reference.curves["starpilot"])
    last = min(x[-1] for x, _ in reference.curves["starpilot"])
    expected.append(f"no anchor: PPO (easy) starpilot @ 0.1k: steps outside the anchor's curve (official baselines "
                    f"PPO (easy-all) logged from {results.format_step(first)} to {results.format_step(last)})")
    assert 128 < first
    summary = results.main([str(real_runs), "--reps", "1000", "--out", str(tmp_path / "out")])
    assert sorted(summary["missing_anchors"]) == sorted(expected)
    out = capsys.readouterr().out
    assert all(line in out for line in expected), out
    summary = results.main([str(real_runs), "--on-track"])
    assert sorted(summary["missing_anchors"]) == sorted(expected) and summary["on_track"] == []
    summary = results.main([str(real_runs), "--reps", "1000", "--out", str(tmp_path / "off"), "--no-reference"])
    assert summary["missing_anchors"] == []


def test_partial_runs_and_duplicate_seeds(tmp_path):
    short = results.read_run(write_run(tmp_path, "ppo_procgen", "bigfish", 1, 5.0, stop_after=6))
    assert short.partial.startswith("ends at step 3,072 of 4,096") and len(short.rows) == 7
    finished = results.read_run(write_run(tmp_path, "ppo_procgen", "bigfish", 2, 5.0))
    assert finished.partial is None
    # The seed-1 run again, finished: it replaces the stopped one.
    os.rename(tmp_path / "bigfish__ppo_procgen__1__1001", tmp_path / "crashed_seed_1")
    write_run(tmp_path, "ppo_procgen", "bigfish", 1, 3.0)
    summary = results.main([str(tmp_path), "--reps", "1000", "--out", str(tmp_path / "out")])
    kept = summary["groups"][("easy", "bigfish")]["PPO"]
    assert sorted(run.path for run in kept) == sorted(str(tmp_path / f"bigfish__ppo_procgen__{seed}__{1000 + seed}")
                                                       for seed in (1, 2))


def test_runs_with_nothing_to_report_yet_get_one_line_each(tmp_path, capsys):
    """A sweep in progress: beside a finished run, one run whose metrics.jsonl is still empty, one with evaluation rows
    only, one whose only row is cut off, and one with no metrics.jsonl. Each is listed once with what it lacks and left
    out of the figures and tables; the finished run is reported as alone; with nothing to report, a one-line error."""
    runs = tmp_path / "runs"
    write_run(runs, "ppo_procgen", "bigfish", 1, 5.0)
    empty = write_run(runs, "ppo_procgen", "bigfish", 2, 5.0)
    open(os.path.join(empty, "metrics.jsonl"), "w").close()
    evaluations_only = write_run(runs, "ppo_procgen", "starpilot", 3, 5.0)
    with open(os.path.join(evaluations_only, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"global_step": 0, "iteration": 0, "eval/episodic_return": 1.5}) + "\n")
    cut = write_run(runs, "ppo_procgen", "bigfish", 4, 5.0)
    with open(os.path.join(cut, "metrics.jsonl"), "w") as f:
        f.write('{"global_step": 512, "iter')
    no_file = write_run(runs, "ppg_procgen", "bigfish", 1, 5.0)
    os.remove(os.path.join(no_file, "metrics.jsonl"))
    lacking = {empty: "no rows yet", evaluations_only: "no training rows yet (only 1 evaluation row)",
               cut: "no rows yet (metrics.jsonl line 1 cut off; read up to line 0)",
               no_file: "no rows yet (no metrics.jsonl)"}

    summary = results.main([str(runs), "--reps", "1000", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert [(run.seed, run.algorithm) for run in summary["runs"]] == [(1, "PPO")]
    assert sorted(summary["left_out"]) == sorted(lacking.items())
    for path, why in lacking.items():
        assert out.count(path) == 1 and f"left out: {path}: {why}" in out, out
    assert sorted(os.listdir(tmp_path / "out")) == ["aggregate.md", "aggregate.png", "bigfish_easy.png"]
    table = (tmp_path / "out" / "aggregate.md").read_text()
    assert "| PPO | 1 |" in table and "starpilot" not in table.split("Left out")[0]
    assert all(f"`{path}`: {why}" in table for path, why in lacking.items())

    summary = results.main([str(runs), "--on-track"])
    assert [run.seed for run in summary["runs"]] == [1] and len(summary["left_out"]) == len(lacking)
    out = capsys.readouterr().out
    assert all(f"left out: {path}: {why}" in out for path, why in lacking.items())

    # Nothing to report at all: a nonzero exit with one line, from the command line as from main().
    shutil.rmtree(runs / "bigfish__ppo_procgen__1__1001")
    finished = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "results.py"), str(runs),
                               "--on-track"], capture_output=True, text=True)
    assert finished.returncode != 0 and "Traceback" not in finished.stderr, finished.stderr
    assert finished.stderr.strip().count("\n") == 0 and "has anything to report yet" in finished.stderr


def test_one_line_errors(tmp_path):
    for argv, message in (([str(tmp_path / "missing")], "is not a folder"), ([str(tmp_path)], "no runs under"),
                          ([str(tmp_path), "--reps", "10"], "--reps 10 must be >= 1000")):
        with pytest.raises(SystemExit) as error:
            results.main(argv)
        assert message in str(error.value) and "\n" not in str(error.value)


def suite(**variables):
    environment = {**os.environ, "DRY_RUN": "1", **variables}
    return subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "procgen_suite.sh")], env=environment,
                          capture_output=True, text=True)


def test_procgen_suite_dry_run():
    default = suite()
    assert default.returncode == 0, default.stderr
    commands = default.stdout.splitlines()
    assert len(commands) == 3 * 3 * 2 + 1  # CleanRL's protocol: 3 games x 3 seeds x {PPO, PPG}, then results.py
    assert commands[0] == "python ppo_procgen.py --env-id starpilot --seed 1 --distribution-mode easy " \
                          "--total-timesteps 25000000 --save-model"
    assert commands[1].startswith("python ppg_procgen.py --env-id starpilot --seed 1 ")
    assert commands[-1] == "python benchmarks/results.py runs --reference"  # against the anchors' own runs
    every_game = suite(GAMES="all", SEEDS="1", SCRIPTS="ppo_procgen.py ppg_procgen.py vtrace.py").stdout.splitlines()
    assert len(every_game) == 16 * 3 + 1
    hard = suite(MODE="hard", GAMES="coinrun", SEEDS="1").stdout.splitlines()
    assert hard[0].endswith("--distribution-mode hard --total-timesteps 100000000 --save-model --num-envs 256 "
                            "--exp-name ppo_paper_baseline --init normed --adv-norm batch --max-grad-norm inf "
                            "--no-clip-vloss --adam-eps 1e-8 --reward-norm-gamma 0.99 --vf-coef 1.0 --minibatch-unit games")
    assert hard[1].endswith("--num-envs 256")
    for variables, message in (({"MODE": "medium"}, "MODE=medium"), ({"GAMES": "pong"}, "GAMES contains pong"),
                               ({"SCRIPTS": "dqn.py"}, "SCRIPTS contains dqn.py")):
        bad = suite(**variables)
        assert bad.returncode == 2 and message in bad.stderr and bad.stdout == ""


FAKE_PYTHON = """#!{python}
# Stands in for python: a job 'trains' for {seconds} s, fails on seed 2, and exits 130 on Ctrl-C (as the scripts do
# after saving a checkpoint); results.py only says it ran.
import signal, sys, time
print(*sys.argv[1:], flush=True)
if sys.argv[1] != "benchmarks/results.py":
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    time.sleep({seconds})
    sys.exit(3 if "--seed 2" in " ".join(sys.argv) else 0)
"""


def fake_python(tmp_path, seconds):
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable, seconds=seconds))
    path.chmod(0o755)
    return str(path)


def test_procgen_suite_queues_survive_a_failed_job_and_stop_on_ctrl_c(tmp_path):
    environment = {**os.environ, "PYTHON": fake_python(tmp_path, 0.05), "LOG_DIR": str(tmp_path / "logs"),
                   "GPUS": "0 1", "GAMES": "bigfish coinrun", "SEEDS": "1 2"}
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "procgen_suite.sh")], env=environment, cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1  # the seed-2 jobs failed; every other job ran, then results.py
    assert done.stdout.count("FAILED (exit 3)") == 4 and done.stdout.count("] job ") == 8
    assert {line.split(" on GPU ")[1][0] for line in done.stdout.splitlines() if " on GPU " in line} == {"0", "1"}
    assert done.stdout.rstrip().endswith("benchmarks/results.py runs --reference")
    assert sorted(os.listdir(tmp_path / "logs"))[0] == "bigfish__ppg_procgen__1.log"

    # Ctrl-C reaches the running jobs (the process group, as from a terminal); no queue starts another job.
    environment["PYTHON"] = fake_python(tmp_path, 60)
    logs = tmp_path / "interrupted"
    environment["LOG_DIR"] = str(logs)
    suite = subprocess.Popen(["bash", os.path.join(ROOT, "benchmarks", "procgen_suite.sh")], env=environment, cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (logs.is_dir() and sum(log.stat().st_size > 0 for log in logs.iterdir()) == 2):  # both jobs started
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(suite.pid, signal.SIGINT)
    output, _ = suite.communicate(timeout=60)
    assert suite.returncode == 130
    assert output.count("] job ") == 2 and "interrupted" in output and "results.py" not in output
