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
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "reference"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_reference  # noqa: E402
import results  # noqa: E402
from test_results import write_run  # noqa: E402

REFERENCE = os.path.join(ROOT, "benchmarks", "reference")
# The published hard ranges (phasic_policy_gradient/constants.py HARD_GAME_RANGES), typed out again.
HARD = {"coinrun": (5, 10), "starpilot": (1.5, 35), "caveflyer": (2, 13.4), "dodgeball": (1.5, 19),
        "fruitbot": (-0.5, 27.2), "chaser": (0.5, 14.2), "miner": (1.5, 20), "jumper": (1, 10), "leaper": (1.5, 10),
        "maze": (4, 10), "bigfish": (0, 40), "heist": (2, 10), "climber": (1, 12.6), "plunder": (3, 30),
        "ninja": (2, 10), "bossfight": (0.5, 13)}


def load(name):
    with gzip.open(os.path.join(REFERENCE, name), "rt") as f:
        return json.load(f)


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
    """Spot values copied by hand from the raw CSVs: the final row and row 400 (PPG) or 800 (train-procgen)."""
    for run, game, final, row_400 in (("ppg-run0", "starpilot", 22.482500076293945, 17.100000381469727),
                                      ("ppo-run1", "bigfish", 19.727500915527344, 7.369999885559082),
                                      ("ppgsingle-run2", "coinrun", 8.824999809265137, 8.600000381469727),
                                      ("ppgkl-run0", "heist", 5.599999904632568, 2.5),
                                      ("e-pi-3", "maze", 9.225000381469727, 5.050000190734863)):
        curve = ppg["curves"][run][game]
        assert len(curve["steps"]) == 382  # rows 4, 8, ..., 1524 and the last, 1526
        assert curve["steps"][-1] == 1526 * 4 * 64 * 256 == 100_007_936
        assert curve["returns"][-1] == pytest.approx(final, abs=1e-5)
        assert curve["returns"][curve["steps"].index(400 * 65_536)] == pytest.approx(row_400, abs=1e-5)
    for run, game, final, row_800, workers in (("easy-all-run2", "starpilot", 35.83000183105469, 34.650001525878906, 1),
                                               ("easy-200-run1:test", "bigfish", 10.130000114440918,
                                                3.390000104904175, 1),
                                               ("hard-all-run0", "fruitbot", 23.39750051498413, 20.482500076293945, 4)):
        curve = train_procgen["curves"][run if ":" in run else f"{run}:train"][game]
        assert curve["steps"][-1] == 49_987_584 * workers  # misc/total_timesteps of the last row, x workers
        assert curve["returns"][-1] == pytest.approx(final, abs=1e-5)
        assert curve["returns"][curve["steps"].index(13_107_200 * workers)] == pytest.approx(row_800, abs=1e-5)
    assert sorted(train_procgen["experiments"]) == ["easy-200-test", "easy-200-train", "easy-all", "hard-500-test",
                                                    "hard-500-train", "hard-all"]
    assert all(len(curves) == 16 for curves in list(ppg["curves"].values()) + list(train_procgen["curves"].values()))
    assert len(ppg["curves"]) == 12 + 16 and len(train_procgen["curves"]) == 18
    for name in ("LICENSE-phasic-policy-gradient", "LICENSE-train-procgen"):
        with open(os.path.join(REFERENCE, name)) as f:
            assert "The MIT License" in f.read()


def test_build_script_on_a_tiny_results_tree(tmp_path):
    """build_reference.py on fake CSVs in the repos' layouts: stride, the last row kept, steps, empty cells."""
    ppg_results = tmp_path / "ppg" / "phasic_policy_gradient" / "results"
    for run in ("ppo-run0", "ppg-run0", "e-pi-2"):
        os.makedirs(ppg_results / run)
        for game in build_reference.GAMES:
            rows = ["EpRewMean"] + ["" if row == 4 else str(row + 0.5) for row in range(1, 11)]  # row 4 empty
            (ppg_results / run / f"progress-{game}.csv").write_text("\n".join(rows) + "\n")
    tp_results = tmp_path / "tp" / "train_procgen" / "results"
    for stem in ("easy-all", "easy-200", "hard-all", "hard-500"):
        os.makedirs(tp_results / f"{stem}-run0")
        for game in build_reference.GAMES:
            for suffix in (("-train", "-test") if "all" not in stem else ("",)):
                rows = ["eplenmean,eprewmean,misc/total_timesteps"] + [f"1,{i}.25,{i * 16384}.0" for i in range(1, 20)]
                (tp_results / f"{stem}-run0" / f"progress-{game}{suffix}.csv").write_text("\n".join(rows) + "\n")
    build_reference.main(["--ppg", str(tmp_path / "ppg"), "--train-procgen", str(tp_results), "--out",
                          str(tmp_path / "out")])
    ppg = json.load(gzip.open(tmp_path / "out" / "phasic_policy_gradient.json.gz", "rt"))
    curve = ppg["curves"]["ppg-run0"]["maze"]
    assert curve == {"steps": [4 * 65536, 8 * 65536, 10 * 65536], "returns": [None, 8.5, 10.5]}
    assert ppg["experiments"]["e-pi-2"]["seeds"] == ["e-pi-2"] and ppg["experiments"]["ppgkl"]["seeds"] == []
    tp = json.load(gzip.open(tmp_path / "out" / "train_procgen.json.gz", "rt"))
    assert tp["curves"]["hard-500-run0:test"]["coinrun"] == {"steps": [8 * 16384 * 4, 16 * 16384 * 4, 19 * 16384 * 4],
                                                             "returns": [8.25, 16.25, 19.25]}
    assert tp["experiments"]["easy-200-test"]["seeds"] == ["easy-200-run0:test"]
    again = tmp_path / "again"
    build_reference.main(["--ppg", str(tmp_path / "ppg"), "--train-procgen", str(tp_results), "--out", str(again)])
    for name in ("phasic_policy_gradient.json.gz", "train_procgen.json.gz"):  # the same bytes every time
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


def test_on_track_lines_for_runs_in_progress(tmp_path, capsys, ppg):
    """Seeds at different steps: the line is at the latest step all of them reached, their last-100 returns
    interpolated there, against the official seeds' mean [min, max] there."""
    runs = tmp_path / "runs"
    ppg_runs(runs, "starpilot", [12.5, 25.0], stop_after=3)  # seeds 1, 2 at 12M (iteration 3 of 25)
    ppg_runs(runs, "starpilot", [50.0], stop_after=2, first_seed=3)  # seed 3 at 8M
    summary = results.main(["--on-track", str(runs)])
    ours = np.array([12.5 * 2 / 25, 25.0 * 2 / 25, 50.0 * 2 / 25])  # all three at 8M (seed 3 is there)
    theirs = reference_returns(ppg, "ppg", "starpilot", 8e6)
    expected = (f"PPG (hard) starpilot @ 8.0M: ours {ours.mean():.1f} ± {ours.std(ddof=1):.1f} (3 seeds) vs official "
                f"PPG {theirs.mean():.1f} [{theirs.min():.1f}, {theirs.max():.1f}] (below)")
    assert summary["on_track"] == [expected]
    out = capsys.readouterr().out
    assert expected in out and "wrote" not in out  # no figures, no tables
    # The scripts' one-run version (benchmarks/results.py's format for one seed, without the seed count).
    line = results.on_track_line("starpilot", 8e6, [4.0], "official PPG", theirs)
    assert line == (f"starpilot @ 8.0M: ours 4.0 (1 seed) vs official PPG {theirs.mean():.1f} [{theirs.min():.1f}, "
                    f"{theirs.max():.1f}] (below)")
    # No reference: say so in one line.
    plain = tmp_path / "plain"
    write_run(plain, "vtrace", "starpilot", 1, 5.0)
    assert results.main(["--on-track", str(plain)])["on_track"] == []
    assert "no run matches a reference" in capsys.readouterr().out


def test_the_scripts_in_run_line_is_the_rules_modules():
    """Each Procgen script's on-track line is on_track.run_on_track_line of its own args.json dict: PPO easy against
    baselines PPO, PPG's variants against their official folders, IMPALA none (issue 24 item 3)."""
    import on_track
    import ppg_procgen
    import ppo_procgen
    import vtrace
    for module, args, step in ((ppo_procgen, ppo_procgen.Args(), 1_500_000),
                               (ppg_procgen, ppg_procgen.Args(distribution_mode="hard", arch="detach"), 12e6),
                               (ppg_procgen, ppg_procgen.Args(distribution_mode="hard", policy_loss="kl-penalty",
                                                              target_kl=0.01), 12e6),
                               (vtrace, vtrace.Args(), 1_500_000)):
        run_args = {"script": os.path.basename(module.__file__), **dataclasses.asdict(args)}
        assert module.on_track_line(args, step, 3.0) == on_track.run_on_track_line(run_args, step, 3.0)
    assert ppo_procgen.on_track_line(ppo_procgen.Args(), 1_500_000, 3.0).startswith(
        "starpilot @ 1.5M: ours 3.0 (1 seed) vs official baselines PPO (easy-all) ")
    assert "official PPG single-network" in ppg_procgen.on_track_line(
        ppg_procgen.Args(distribution_mode="hard", arch="detach"), 12e6, 3.0)
    assert vtrace.on_track_line(vtrace.Args(), 1_500_000, 3.0) is None


def test_one_rule_set_for_the_in_run_line_and_results_py():
    """benchmarks/reference/on_track.py picks the anchor for both: the in-run line of one seed is results.py's line,
    for every anchor the rules can pick (PPO easy and hard, PPG and its variants), and None where none matches."""
    import on_track
    base = {"env_id": "starpilot", "num_levels": 0, "policy_loss": "clip", "arch": "dual"}
    cases = [({"script": "ppo_procgen.py", "distribution_mode": "easy"}, 1_500_000, "train_procgen/easy-all"),
             ({"script": "ppo_procgen.py", "distribution_mode": "hard", "init": "normed"}, 12e6,
              "phasic_policy_gradient/ppo"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard"}, 12e6, "phasic_policy_gradient/ppg"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard", "arch": "detach"}, 12e6,
              "phasic_policy_gradient/ppgsingle"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard", "policy_loss": "kl-penalty"}, 12e6,
              "phasic_policy_gradient/ppgkl"),
             ({"script": "ppg_procgen.py", "distribution_mode": "hard", "n_pi": 16}, 12e6,
              "phasic_policy_gradient/n-pi-16")]
    references = results.load_references()
    for flags, step, key in cases:
        args = {**base, **flags}
        theirs = results.reference_at(references[key], "starpilot", step)
        expected = results.on_track_line("starpilot", step, [3.0], references[key].label, theirs)
        assert on_track.run_on_track_line(args, step, 3.0) == expected, key
        assert on_track.no_match_reason(args) is None
    for flags in ({"script": "vtrace.py", "distribution_mode": "easy"},
                  {"script": "ppo_procgen.py", "distribution_mode": "easy", "policy_loss": "kl-penalty"},
                  {"script": "ppg_procgen.py", "distribution_mode": "easy"},
                  {"script": "ppg_procgen.py", "distribution_mode": "hard", "n_pi": 16, "e_aux": 3}):
        args = {**base, **flags}
        assert on_track.run_on_track_line(args, 12e6, 3.0) is None
        assert on_track.no_match_reason(args)  # a reason in words
    # A step the anchor never logged: no line.
    assert on_track.run_on_track_line({**base, **cases[2][0]}, 1_000, 3.0) is None


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
