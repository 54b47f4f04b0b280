"""benchmarks/reference/: the anchors' committed runs reproduce the PPG paper's headline and their raw CSV values, and
benchmarks/results.py draws them behind our runs, tables them beside ours and says whether a run is on track."""
import dataclasses
import gzip
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "reference"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_reference  # noqa: E402
import on_track  # noqa: E402
import results  # noqa: E402
from test_results import write_run  # noqa: E402

REFERENCE = os.path.join(ROOT, "benchmarks", "reference")
# The published hard ranges (phasic_policy_gradient/constants.py HARD_GAME_RANGES), typed out again.
HARD = {"coinrun": (5, 10), "starpilot": (1.5, 35), "caveflyer": (2, 13.4), "dodgeball": (1.5, 19),
        "fruitbot": (-0.5, 27.2), "chaser": (0.5, 14.2), "miner": (1.5, 20), "jumper": (1, 10), "leaper": (1.5, 10),
        "maze": (4, 10), "bigfish": (0, 40), "heist": (2, 10), "climber": (1, 12.6), "plunder": (3, 30),
        "ninja": (2, 10), "bossfight": (0.5, 13)}


def load(name):
    """The file's JSON with every curve's steps filled in (the file writes an experiment's steps once)."""
    return on_track.read_reference_file(os.path.join(REFERENCE, name))


@pytest.fixture(scope="module")
def ppg():
    return load("phasic_policy_gradient.json.gz")


@pytest.fixture(scope="module")
def train_procgen():
    return load("train_procgen.json.gz")


def mean_normalized_final(data, experiment):
    """The PPG paper's headline: per game the mean over seeds of the final logged EpRewMean, normalized with the hard
    ranges, then the mean over the 16 games."""
    seeds = data["experiments"][experiment]["seeds"]
    per_game = []
    for game, (low, high) in HARD.items():
        final = np.mean([data["curves"][seed][game]["returns"][-1] for seed in seeds])
        per_game.append((final - low) / (high - low))
    assert len(per_game) == 16
    return float(np.mean(per_game))


def test_reference_data_reproduces_the_ppg_papers_headline(ppg):
    assert [len(ppg["experiments"][name]["seeds"]) for name in ("ppo", "ppg", "ppgsingle", "ppgkl")] == [3, 3, 3, 3]
    assert round(mean_normalized_final(ppg, "ppg"), 3) == 0.757
    assert round(mean_normalized_final(ppg, "ppo"), 3) == 0.589
    assert round(mean_normalized_final(ppg, "ppgsingle"), 3) == 0.758
    assert round(mean_normalized_final(ppg, "ppgkl"), 3) == 0.758
    assert round(mean_normalized_final(ppg, "e-pi-1"), 3) == 0.765  # the one-seed ablations are there too
    assert round(mean_normalized_final(ppg, "n-pi-2"), 3) == 0.631


def test_reference_data_keeps_the_raw_csv_values_at_their_exact_steps(ppg, train_procgen):
    """Spot values copied by hand from the raw CSVs: the final row, rows 400 and 401 (PPG) or 800 and 801
    (train-procgen); every logged row is kept (the on-track window averages the last 8)."""
    for run, game, final, row_400, row_401 in (
            ("ppg-run0", "starpilot", 22.482500076293945, 17.100000381469727, 17.584999084472656),
            ("ppo-run1", "bigfish", 19.727500915527344, 7.369999885559082, 7.989999771118164),
            ("ppgsingle-run2", "coinrun", 8.824999809265137, 8.600000381469727, 8.399999618530273),
            ("ppgkl-run0", "heist", 5.599999904632568, 2.5, 2.4749999046325684),
            ("e-pi-3", "maze", 9.225000381469727, 5.050000190734863, 5.0)):
        curve = ppg["curves"][run][game]
        assert curve["steps"] == [row * 65_536 for row in range(1, 1527)]  # rows 1, 2, ..., 1526
        assert curve["steps"][-1] == 1526 * 4 * 64 * 256 == 100_007_936
        assert curve["returns"][-1] == pytest.approx(final, abs=1e-5)
        assert curve["returns"][curve["steps"].index(400 * 65_536)] == pytest.approx(row_400, abs=1e-5)
        assert curve["returns"][curve["steps"].index(401 * 65_536)] == pytest.approx(row_401, abs=1e-5)
    for run, game, final, row_800, row_801, workers in (
            ("easy-all-run2", "starpilot", 35.83000183105469, 34.650001525878906, 32.560001373291016, 1),
            ("easy-200-run1:test", "bigfish", 10.130000114440918, 3.390000104904175, 3.0399999618530273, 1),
            ("hard-all-run0", "fruitbot", 23.39750051498413, 20.482500076293945, 20.40999984741211, 4)):
        curve = train_procgen["curves"][run if ":" in run else f"{run}:train"][game]
        assert curve["steps"] == [row * 16_384 * workers for row in range(1, 3052)]  # rows 1, 2, ..., 3051
        assert curve["steps"][-1] == 49_987_584 * workers  # misc/total_timesteps of the last row, x workers
        assert curve["returns"][-1] == pytest.approx(final, abs=1e-5)
        assert curve["returns"][curve["steps"].index(13_107_200 * workers)] == pytest.approx(row_800, abs=1e-5)
        assert curve["returns"][curve["steps"].index(13_123_584 * workers)] == pytest.approx(row_801, abs=1e-5)
    assert sorted(train_procgen["experiments"]) == ["easy-200-test", "easy-200-train", "easy-all", "hard-500-test",
                                                    "hard-500-train", "hard-all"]
    assert all(len(curves) == 16 for curves in list(ppg["curves"].values()) + list(train_procgen["curves"].values()))
    assert len(ppg["curves"]) == 12 + 16 and len(train_procgen["curves"]) == 18
    for name in ("LICENSE-phasic-policy-gradient", "LICENSE-train-procgen"):
        with open(os.path.join(REFERENCE, name)) as f:
            assert "The MIT License" in f.read()


def test_build_script_on_a_tiny_results_tree(tmp_path):
    """build_reference.py on fake CSVs in the repos' layouts: every row, steps (once per experiment, a curve's own
    where they differ), empty cells, the same bytes on a rebuild."""
    ppg_results = tmp_path / "ppg" / "phasic_policy_gradient" / "results"
    for run in ("ppo-run0", "ppg-run0", "e-pi-2"):
        os.makedirs(ppg_results / run)
        for game in build_reference.GAMES:
            rows = ["EpRewMean"] + ["" if row == 4 else str(row + 0.5) for row in range(1, 11)]  # row 4 empty
            (ppg_results / run / f"progress-{game}.csv").write_text("\n".join(rows) + "\n")
    tp_results = tmp_path / "tp" / "train_procgen" / "results"
    for stem in ("easy-all", "easy-200", "hard-all", "hard-500"):
        for run in (f"{stem}-run0", f"{stem}-run1"):
            os.makedirs(tp_results / run)
            for game in build_reference.GAMES:
                for suffix in (("-train", "-test") if "all" not in stem else ("",)):
                    last = 12 if (run, game) == ("easy-all-run1", "maze") else 19  # one curve stopped early
                    rows = ["eplenmean,eprewmean,misc/total_timesteps"] + [f"1,{i}.25,{i * 16384}.0"
                                                                           for i in range(1, last + 1)]
                    (tp_results / run / f"progress-{game}{suffix}.csv").write_text("\n".join(rows) + "\n")
    build_reference.main(["--ppg", str(tmp_path / "ppg"), "--train-procgen", str(tp_results), "--out",
                          str(tmp_path / "out")])
    assert sorted(os.listdir(tmp_path / "out")) == ["phasic_policy_gradient.json.gz", "train_procgen.json.gz"]
    raw = json.load(gzip.open(tmp_path / "out" / "phasic_policy_gradient.json.gz", "rt"))  # the layout as written
    assert raw["experiments"]["ppg"]["steps"] == [row * 65536 for row in range(1, 11)]
    assert raw["curves"]["ppg-run0"]["maze"] == {"returns": [1.5, 2.5, 3.5, None, 5.5, 6.5, 7.5, 8.5, 9.5, 10.5]}
    ppg = on_track.read_reference_file(tmp_path / "out" / "phasic_policy_gradient.json.gz")
    assert ppg["curves"]["ppg-run0"]["maze"] == {"steps": [row * 65536 for row in range(1, 11)],
                                                 "returns": [1.5, 2.5, 3.5, None, 5.5, 6.5, 7.5, 8.5, 9.5, 10.5]}
    assert ppg["experiments"]["e-pi-2"]["seeds"] == ["e-pi-2"] and ppg["experiments"]["ppgkl"]["seeds"] == []
    raw = json.load(gzip.open(tmp_path / "out" / "train_procgen.json.gz", "rt"))
    assert raw["experiments"]["easy-all"]["steps"] == [i * 16384 for i in range(1, 20)]
    assert raw["curves"]["easy-all-run1:train"]["maze"]["steps"] == [i * 16384 for i in range(1, 13)]  # its own
    assert sum("steps" in curve for games in raw["curves"].values() for curve in games.values()) == 1
    tp = on_track.read_reference_file(tmp_path / "out" / "train_procgen.json.gz")
    assert tp["curves"]["hard-500-run0:test"]["coinrun"] == {"steps": [i * 16384 * 4 for i in range(1, 20)],
                                                             "returns": [i + 0.25 for i in range(1, 20)]}
    assert tp["curves"]["easy-all-run1:train"]["maze"] == {"steps": [i * 16384 for i in range(1, 13)],
                                                           "returns": [i + 0.25 for i in range(1, 13)]}
    assert tp["curves"]["easy-all-run1:train"]["coinrun"]["steps"] == [i * 16384 for i in range(1, 20)]
    assert tp["experiments"]["easy-200-test"]["seeds"] == ["easy-200-run0:test", "easy-200-run1:test"]
    again = tmp_path / "again"
    build_reference.main(["--ppg", str(tmp_path / "ppg"), "--train-procgen", str(tp_results), "--out", str(again)])
    assert len(os.listdir(again)) == 2
    for name in os.listdir(again):  # the same bytes every time
        assert (again / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_matching_runs_to_references():
    def match(script, mode="easy", **flags):
        return results.match_references({"script": script, "distribution_mode": mode, "num_levels": 0, **flags})
    assert match("ppo_procgen.py") == (["train_procgen/easy-all"], ["train_procgen/easy-all"])
    assert match("ppo_procgen.py", num_levels=200) == (["train_procgen/easy-200-train"],
                                                       ["train_procgen/easy-200-test"])
    assert match("ppo_procgen.py", "hard")[0] == ["train_procgen/hard-all", "phasic_policy_gradient/ppo"]
    assert match("ppo_procgen.py", "hard", init="normed", exp_name="ppo_paper_baseline")[0] == [
        "phasic_policy_gradient/ppo", "train_procgen/hard-all"]
    assert match("ppo_procgen.py", policy_loss="kl-penalty") == ([], [])
    assert match("ppg_procgen.py", "hard", arch="dual")[0] == ["phasic_policy_gradient/ppg"]
    assert match("ppg_procgen.py", "hard", arch="detach")[0] == ["phasic_policy_gradient/ppgsingle"]
    assert match("ppg_procgen.py", "hard", arch="dual", policy_loss="kl-penalty")[0] == ["phasic_policy_gradient/ppgkl"]
    assert match("ppg_procgen.py", "hard", arch="dual", e_pi=3)[0] == ["phasic_policy_gradient/e-pi-3"]
    assert match("ppg_procgen.py", "hard", arch="dual", e_pi=3, n_pi=8) == ([], [])
    assert match("ppg_procgen.py", "easy") == ([], []) and match("vtrace.py", "hard") == ([], [])
    assert match("ppg_procgen.py", "hard", num_levels=500) == ([], [])
    # exp_name does not matter; the script does.
    assert match("ppo_procgen.py", exp_name="my_ppo")[0] == ["train_procgen/easy-all"]
    references = results.load_references()
    assert references["phasic_policy_gradient/ppg"].label == "official PPG"
    assert references["phasic_policy_gradient/e-pi-3"].label == "official PPG (E_pi = 3)"


def reference_returns(data, experiment, game, step):
    """The reference seeds' returns at `step`, by interpolation computed here from the stored lists."""
    return np.array([np.interp(step, data["curves"][seed][game]["steps"], data["curves"][seed][game]["returns"])
                     for seed in data["experiments"][experiment]["seeds"]])


def ppg_runs(root, game, finals, steps=4_000_000, iterations=25, stop_after=None, arch="dual", first_seed=1):
    """PPG runs in hard mode, their training return climbing linearly to `finals` at 100M steps."""
    for seed, final in enumerate(finals, start=first_seed):
        path = write_run(root, "ppg_procgen", game, seed, final, steps_per_iteration=steps, iterations=iterations,
                         mode="hard", stop_after=stop_after)
        with open(os.path.join(path, "args.json")) as f:
            args = json.load(f)
        with open(os.path.join(path, "args.json"), "w") as f:
            json.dump({**args, "arch": arch, "policy_loss": "clip", "n_pi": 32, "e_pi": 1, "e_aux": 6}, f)


def test_table_rows_against_the_reference_at_the_same_step(tmp_path, train_procgen):
    """PPO on two easy games to 8M steps: the reference rows are the official seeds at 8M, through the same
    estimators; ours far above them on one game and far below on the other gives P(ours > reference) = 1/2."""
    runs = tmp_path / "runs"
    for seed, (starpilot, bigfish) in enumerate(((60.0, 1.0), (61.0, 1.5), (62.0, 2.0)), start=1):
        write_run(runs, "ppo_procgen", "starpilot", seed, starpilot, steps_per_iteration=1_000_000, iterations=8)
        write_run(runs, "ppo_procgen", "bigfish", seed, bigfish, steps_per_iteration=1_000_000, iterations=8)
    summary = results.main([str(runs), "--reps", "2000", "--out", str(tmp_path / "out")])
    comparison = summary["reference"]["easy"][("PPO", "train_procgen/easy-all")]
    assert comparison["games"] == ["bigfish", "starpilot"] and comparison["steps"] == {"bigfish": 8e6, "starpilot": 8e6}
    easy = {"bigfish": (1, 40), "starpilot": (2.5, 64)}
    raw = {game: reference_returns(train_procgen, "easy-all", game, 8e6) for game in easy}
    theirs = {game: (raw[game] - low) / (high - low) for game, (low, high) in easy.items()}
    label = "official baselines PPO (easy-all)"
    metrics = comparison["metrics"][label]
    assert metrics["mean"][0] == pytest.approx(np.mean([values.mean() for values in theirs.values()]))
    assert metrics["IQM"][0] == pytest.approx(results.interquartile_mean(list(theirs.values())))
    assert metrics["mean"][1][0] <= metrics["mean"][0] <= metrics["mean"][1][1]
    assert comparison["improvement"][0] == pytest.approx(0.5)  # 1 on starpilot, 0 on bigfish
    ours = summary["aggregates"]["easy"]["metrics"]["PPO"]
    assert comparison["metrics"]["PPO"]["IQM"][0] == pytest.approx(ours["IQM"][0])
    table = (tmp_path / "out" / "aggregate.md").read_text()
    assert "## easy mode: against the anchors' own runs" in table
    assert f"| {label} | 6 | {metrics['IQM'][0]:.3f} [" in table
    assert f"P(PPO > {label}) = 0.500 [" in table
    assert f"| starpilot | 8.0M | 61.00 +- 1.00 (3) | {raw['starpilot'].mean():.2f} +- " in table
    # --no-reference: no reference section, the rest as before.
    summary = results.main([str(runs), "--reps", "2000", "--out", str(tmp_path / "plain"), "--no-reference"])
    assert summary["reference"] == {} and "anchors" not in (tmp_path / "plain" / "aggregate.md").read_text()


def test_overlay_draws_the_matching_reference_behind_our_runs(tmp_path, monkeypatch):
    drawn = []
    draw = results.plot_reference

    def record(axis, reference, game, color, until):
        if draw(axis, reference, game, color, until):
            drawn.append((reference.label, game, color, until))
            return True
        return False
    monkeypatch.setattr(results, "plot_reference", record)
    runs = tmp_path / "runs"
    ppg_runs(runs, "starpilot", [10.0, 11.0], arch="detach", stop_after=3)  # in progress at 12M of 100M
    write_run(runs, "vtrace", "starpilot", 1, 5.0, steps_per_iteration=1_000_000, mode="hard")  # no reference
    write_run(runs, "ppo_procgen", "bigfish", 1, 5.0)  # easy, but only 4,096 steps: before the first reference row
    results.main([str(runs), "--reps", "1000", "--out", str(tmp_path / "out")])
    # The training and the evaluation panel, up to our last step, in PPG's colour (C1: PPO C0 exists, PPG C1).
    assert drawn == [("official PPG single-network", "starpilot", "C1", 12_000_000)] * 2
    assert (tmp_path / "out" / "starpilot_hard.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "bigfish_easy.png").exists()  # drawn without a reference
    drawn.clear()
    results.main([str(runs), "--reps", "1000", "--out", str(tmp_path / "off"), "--no-reference"])
    assert drawn == []


def naive_window(data, experiment, game, step, width):
    """Each reference seed's mean over its stored rows in (step - width, step], by a loop over the stored lists."""
    means = []
    for seed in data["experiments"][experiment]["seeds"]:
        curve = data["curves"][seed][game]
        inside = [value for at, value in zip(curve["steps"], curve["returns"]) if step - width < at <= step]
        means.append(sum(inside) / len(inside))
    return np.array(means)


def write_metrics(path, spacing, until, last100):
    """A metrics.jsonl as the scripts log it: a training row every `spacing` steps to `until` (the last-100 return
    `last100(step)`), an evaluation row (no last-100 return) at the end; returns its path."""
    rows = [{"global_step": step, "iteration": step // spacing, "charts/episodic_return_last100": last100(step)}
            for step in range(spacing, until + 1, spacing)]
    rows.append({"global_step": until, "iteration": until // spacing, "eval/episodic_return": 1.0})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_on_track_lines_for_runs_in_progress(tmp_path, capsys, ppg, train_procgen):
    """Seeds at different steps: the line is at the latest step all of them reached; each of our seeds and each
    official seed is the mean of its rows in the last 8 official iterations before it (8 x 65,536 steps for PPG)."""
    runs = tmp_path / "runs"
    ppg_runs(runs, "starpilot", [12.5, 25.0], stop_after=3)  # seeds 1, 2 at 12M (iteration 3 of 25)
    ppg_runs(runs, "starpilot", [50.0], stop_after=2, first_seed=3)  # seed 3 at 8M
    summary = results.main(["--on-track", str(runs)])
    ours = np.array([12.5 * 2 / 25, 25.0 * 2 / 25, 50.0 * 2 / 25])  # all three at 8M, their one row in the window
    theirs = naive_window(ppg, "ppg", "starpilot", 8e6, 8 * 65_536)
    expected = (f"PPG (hard) starpilot @ 8.0M (mean of the last 524k steps): ours {ours.mean():.1f} ± "
                f"{ours.std(ddof=1):.1f} (3 seeds) vs official PPG {theirs.mean():.1f} [{theirs.min():.1f}, "
                f"{theirs.max():.1f}] (below)")
    assert summary["on_track"] == [expected]
    out = capsys.readouterr().out
    assert expected in out and "wrote" not in out  # no figures, no tables
    # Rows finer than the window (PPO easy, an iteration of 16,384 steps as baselines PPO's): 8 rows of each seed.
    easy = tmp_path / "easy"
    for seed, final in ((1, 4.0), (2, 6.0)):
        write_run(easy, "ppo_procgen", "starpilot", seed, final, steps_per_iteration=16_384, iterations=32)
    ours = np.array([np.mean([final * iteration / 32 for iteration in range(25, 33)]) for final in (4.0, 6.0)])
    theirs = naive_window(train_procgen, "easy-all", "starpilot", 32 * 16_384, 8 * 16_384)
    verdict = "below" if ours.mean() < theirs.min() else "above" if ours.mean() > theirs.max() else "within"
    assert results.main(["--on-track", str(easy)])["on_track"] == [
        f"PPO (easy) starpilot @ 0.5M (mean of the last 131k steps): ours {ours.mean():.1f} ± {ours.std(ddof=1):.1f} "
        f"(2 seeds) vs official baselines PPO (easy-all) {theirs.mean():.1f} [{theirs.min():.1f}, {theirs.max():.1f}] "
        f"({verdict})"]
    # No reference: say so in one line.
    plain = tmp_path / "plain"
    write_run(plain, "vtrace", "starpilot", 1, 5.0)
    assert results.main(["--on-track", str(plain)])["on_track"] == []
    assert "no run matches a reference" in capsys.readouterr().out


def test_a_single_point_spike_flips_no_windowed_verdict():
    """One iteration's last-100 mean moves by ~0.4, so a verdict from single points is chance. A spike in our
    row at the step, or in an anchor seed's, flips the single-point verdict (np.interp at the step, the rule before)
    but not the windowed one; moving the whole window does flip it. The window is 8 reference rows, (step - W, step]."""
    import on_track

    def anchor(curves):
        return on_track.Reference("test/anchor", "the anchor", "", "easy", 0, "train", {"starpilot": curves})

    def single_point(ours, reference):
        theirs = on_track.reference_at(reference, "starpilot", step)
        return on_track.on_track_line("x", [np.interp(step, steps, ours)], "the anchor", theirs).split()[-1]

    def windowed(ours, reference):
        return on_track.windowed_line("starpilot", step, [(steps, ours)], reference).split()[-1]

    steps = np.arange(1, 41) * 16_384.0
    step = 32 * 16_384  # row 32
    flat = anchor([(steps, np.full(40, level)) for level in (3.5, 4.0, 4.5)])
    ours = np.full(40, 3.0)
    assert single_point(ours, flat) == windowed(ours, flat) == "(below)"
    spike = ours.copy()
    spike[31] = 6.0  # our one good iteration at the step
    assert single_point(spike, flat) == "(above)" and windowed(spike, flat) == "(below)"  # (7 x 3 + 6) / 8 = 3.375
    dip = [(steps, np.full(40, level)) for level in (3.5, 4.0, 4.5)]
    dip[0][1][31] = 0.0  # the anchor's lowest seed has a bad iteration at the step
    assert single_point(ours, anchor(dip)) == "(within)" and windowed(ours, anchor(dip)) == "(below)"  # 3.06
    assert windowed(ours + 2.0, flat) == "(above)" and windowed(ours + 0.75, flat) == "(within)"
    assert on_track.windowed_line("starpilot", step, [(steps, spike)], flat) == (
        "starpilot @ 0.5M (mean of the last 131k steps): ours 3.4 (1 seed) vs the anchor 4.0 [3.5, 4.5] (below)")
    # The window: rows 25..32 count, row 24 does not; from 0 before 8 rows; none past the anchor's last row, and none
    # where we logged no row in it.
    assert on_track.reference_window(flat, "starpilot", step)[0] == 8 * 16_384
    assert on_track.window_mean(steps, np.arange(40.0), step, 8 * 16_384) == np.mean(np.arange(24, 32))
    assert on_track.window_mean(steps, np.arange(40.0), 3 * 16_384, 8 * 16_384) == 1.0  # rows 1, 2, 3
    assert on_track.windowed_line("starpilot", 41 * 16_384, [(steps, ours)], flat) is None
    assert on_track.windowed_line("starpilot", step, [(steps[:10], ours[:10])], flat) is None


@pytest.mark.parametrize("step", [131_072, 262_144, 524_288])
def test_windows_of_the_committed_cpu_runs_are_the_last_8_iterations(step, train_procgen, tmp_path):
    """benchmarks/results/procgen_cpu/ (PPO on StarPilot, 2-core CPU): at 131k, 262k, 524k the windowed line's numbers
    are the means over the 8 iterations ending at the step (16,384 steps each), both sides, computed here by a loop
    over the raw rows; the in-run line of a run is results.py's line of that one run."""
    import on_track
    folder = os.path.join(ROOT, "benchmarks", "results", "procgen_cpu")
    theirs = []
    for seed in train_procgen["experiments"]["easy-all"]["seeds"]:
        by_step = dict(zip(train_procgen["curves"][seed]["starpilot"]["steps"],
                           train_procgen["curves"][seed]["starpilot"]["returns"]))
        theirs.append(sum(by_step[step - k * 16_384] for k in range(8)) / 8)
    reference = results.load_references()["train_procgen/easy-all"]
    width, means = on_track.reference_window(reference, "starpilot", step)
    assert width == 131_072 and means == pytest.approx(theirs, abs=1e-9)
    checked = 0
    for run in sorted(os.listdir(folder)):
        path = os.path.join(folder, run, "metrics.jsonl")
        with open(path) as f:
            rows = {row["global_step"]: row for row in map(json.loads, f) if "charts/episodic_return_last100" in row}
        with open(os.path.join(folder, run, "args.json")) as f:
            args = json.load(f)
        line = on_track.run_on_track_line(args, step, path)
        if step not in rows:
            assert line is None  # a partial run that has not logged the step
            continue
        ours = sum(rows[step - k * 16_384]["charts/episodic_return_last100"] for k in range(8)) / 8
        assert on_track.window_mean(*on_track.read_last100(path), step, width) == pytest.approx(ours, abs=1e-9)
        assert line == on_track.on_track_line(f"starpilot @ {results.format_step(step)} (mean of the last 131k "
                                              "steps)", [ours], "official baselines PPO (easy-all)", np.array(theirs))
        copy = tmp_path / run  # the run as it was at `step`: results.py --on-track gives the same line
        copy.mkdir()
        (copy / "args.json").write_text(json.dumps(args))
        with open(path) as f:
            (copy / "metrics.jsonl").write_text("".join(line for line in f if json.loads(line)["global_step"] <= step))
        assert results.main(["--on-track", str(copy)])["on_track"] == [f"PPO (easy) {line}"]
        checked += 1
    assert checked >= 1


def test_one_rule_set_for_the_in_run_line_and_results_py(tmp_path):
    """benchmarks/reference/on_track.py picks the anchor for both: the in-run line of one seed is `windowed_line` of its
    logged rows against the anchor the rules pick (PPO easy and hard, PPG and its variants), and None where none
    matches or the anchor did not log the step."""
    import on_track
    base = {"env_id": "starpilot", "num_levels": 0, "policy_loss": "clip", "arch": "dual"}
    cases = [({"script": "ppo_procgen.py", "distribution_mode": "easy"}, 1_490_944, "train_procgen/easy-all"),
             ({"script": "ppo_procgen.py", "distribution_mode": "hard", "init": "normed"}, 12e6,
              "phasic_policy_gradient/ppo"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard"}, 12e6, "phasic_policy_gradient/ppg"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard", "arch": "detach"}, 12e6,
              "phasic_policy_gradient/ppgsingle"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard", "policy_loss": "kl-penalty"}, 12e6,
              "phasic_policy_gradient/ppgkl"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard", "n_pi": 16}, 12e6,
              "phasic_policy_gradient/n-pi-16")]
    metrics = write_metrics(tmp_path / "metrics.jsonl", 16_384, 12_500_000, lambda step: step / 1e6)
    curve = on_track.read_last100(metrics)
    references = results.load_references()
    for flags, step, key in cases:
        args = {**base, **flags}
        expected = on_track.windowed_line("starpilot", step, [curve], references[key])
        assert expected is not None and references[key].label in expected
        assert on_track.run_on_track_line(args, step, metrics) == expected, key
        assert on_track.no_match_reason(args) is None
    for flags in ({"script": "vtrace.py", "distribution_mode": "easy"},
                  {"script": "ppo_procgen.py", "distribution_mode": "easy", "policy_loss": "kl-penalty"},
                  {"script": "ppg_procgen.py", "distribution_mode": "easy"},
                  {"script": "ppg_procgen.py", "distribution_mode": "hard", "n_pi": 16, "e_aux": 3}):
        args = {**base, **flags}
        assert on_track.run_on_track_line(args, 12e6, metrics) is None
        assert on_track.no_match_reason(args)  # a reason in words
    # A step before the anchor's first row, or after its last: no line.
    assert on_track.run_on_track_line({**base, **cases[2][0]}, 1_000, metrics) is None
    assert on_track.run_on_track_line({**base, **cases[0][0]}, 60e6, metrics) is None


def test_rules_module_imports_no_script():
    source = open(os.path.join(ROOT, "benchmarks", "reference", "on_track.py")).read()
    for script in ("ppo_procgen", "ppg_procgen", "vtrace", "ppo_rlhf_toy", "results"):
        assert f"import {script}" not in source and f"from {script}" not in source


def test_a_missing_anchor_is_named_with_its_reason(tmp_path):
    """missing_anchors' other reasons (the real runs of test_results.py cover script, flags and steps): the mode, seeds
    of one group that ran different flags, and an anchor that logged no row at the step the seeds reached."""
    runs = tmp_path / "runs"
    write_run(runs, "ppg_procgen", "bigfish", 1, 5.0)  # easy mode
    ppg_runs(runs, "starpilot", [5.0, 6.0])  # hard, at the defaults: matched, and 100M is inside the anchor's curve
    with open(os.path.join(write_run(runs, "ppg_procgen", "starpilot", 3, 5.0, mode="hard", steps_per_iteration=4e6,
                                     iterations=25), "args.json")) as f:
        args = json.load(f)
    path = max(runs.glob("starpilot__ppg_procgen__3__*"))
    (path / "args.json").write_text(json.dumps({**args, "n_pi": 8, "e_aux": 2}))  # two changed: no ablation has both
    write_run(runs, "ppo_procgen", "starpilot", 1, 5.0, mode="hard", steps_per_iteration=100, iterations=2)
    lines = results.missing_anchors(results.main([str(runs), "--on-track"])["groups"])
    reference = results.load_references()["train_procgen/hard-all"]
    first = max(x[0] for x, _ in reference.curves["starpilot"])
    assert lines == [
        "no anchor: PPG (easy) bigfish: ppg_procgen.py --distribution-mode easy --num-levels 0: the official PPG runs "
        "are hard mode on all levels (--num-levels 0)",
        "no anchor: PPG (hard) starpilot: its seeds ran different flags: seed 1: an anchor matches it alone; "
        "seed 2: an anchor matches it alone; seed 3: ppg_procgen.py --n-pi 8 --e-aux 2: no official run changed "
        "these together (or with this variant)",
        f"no anchor: PPO (hard) starpilot @ 0.2k: steps outside the anchor's curve (official baselines PPO (hard-all) "
        f"logged from {results.format_step(first)} to 200.0M)",
    ]
