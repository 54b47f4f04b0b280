"""Issue 27: docs/results.md's StarPilot-on-a-CPU tables are the committed runs' numbers (benchmarks/procgen_cpu.py over
benchmarks/results/procgen_cpu/), and the anchor's every-row file agrees with the downsampled reference it extends."""
import gzip
import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import procgen_cpu  # noqa: E402

REFERENCE = os.path.join(ROOT, "benchmarks", "reference")


def test_the_docs_tables_are_the_committed_runs(capsys):
    tables = procgen_cpu.main([procgen_cpu.RUNS])
    capsys.readouterr()
    doc = open(os.path.join(ROOT, "docs", "results.md")).read()
    missing = [line for line in tables.splitlines() if line and line not in doc]
    assert not missing, "docs/results.md differs from `python benchmarks/procgen_cpu.py`:\n" + "\n".join(missing)


def test_the_early_anchor_file_agrees_with_the_downsampled_one():
    """train_procgen_first_1M.json.gz keeps every row to 1,048,576 steps; at the rows both keep, they are equal."""
    with gzip.open(os.path.join(REFERENCE, "train_procgen_first_1M.json.gz"), "rt") as f:
        early = json.load(f)
    with gzip.open(os.path.join(REFERENCE, "train_procgen.json.gz"), "rt") as f:
        sparse = json.load(f)
    checked = 0
    for seed in early["experiments"]["easy-all"]["seeds"]:
        for game, curve in early["curves"][seed].items():
            by_step = dict(zip(curve["steps"], curve["returns"]))
            assert curve["steps"] == [16_384 * (row + 1) for row in range(64)]  # every iteration of 64 x 256 steps
            other = sparse["curves"][seed][game]
            for step, value in zip(other["steps"], other["returns"]):
                if step <= early["until"]:
                    assert by_step[step] == value
                    checked += 1
    assert checked == 3 * 16 * 8  # 3 seeds x 16 games x the 8 stored rows to 1M


def test_windows_are_means_of_logged_iterations():
    """The windowed column is the plain mean of the 8 logged rows that end at the step, on both sides."""
    with gzip.open(os.path.join(REFERENCE, "train_procgen_first_1M.json.gz"), "rt") as f:
        early = json.load(f)
    seeds = early["experiments"]["easy-all"]["seeds"]
    curve = early["curves"][seeds[0]]["starpilot"]
    expected = sum(curve["returns"][24:32]) / 8  # rows 25..32: 409,600 .. 524,288 steps
    assert abs(procgen_cpu.anchor_window_means("starpilot", 524_288)[0] - expected) < 1e-12
