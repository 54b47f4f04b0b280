"""The PPG paper's result on one GPU: PPO and PPG at the paper's settings on hard StarPilot and hard BigFish,
side by side to 8M steps, against the official runs' three seeds at the same steps.

  python benchmarks/evidence.py                    # trains for --minutes, then the table and the figures
  python benchmarks/evidence.py                    # once more: each run resumes where it stopped

The runs are benchmarks/procgen_suite.sh's hard-mode jobs (its MODE=hard flags: PPO as the PPG paper's baseline,
PPG at its defaults, 256 games each), started side by side by benchmarks/launch.py (the cores split between them)
in OUT/<game>__<script>__<seed>/, with --save-model. At the deadline each saves its resume point and stops: PPO
its last whole iteration, PPG the end of its last auxiliary phase (B is not saved), so a PPG run loses the
iterations it played since then, up to N_pi (2.1M steps at 256 games): give each call a window that holds a
PPG phase (after a window, each PPG run that lost steps says so, with its phase's time at its pace). The next
call resumes every run that has not reached its steps (`--resume`) and starts the missing ones. A run folder
left without a checkpoint (stopped before its first resume point) is started again. OUT may move between calls,
to another path or machine: the runs are found under OUT and resumed from there.

Then, whether or not the runs are done, OUT/evidence.md (and evidence.json) holds per game, at the latest step
that every run of the game has reached (8M once they are done): each algorithm's return, as `results.py
--on-track` computes it (each seed's mean of the last 100 episodes over the official runs' last 8 logged
iterations before that step, then the mean over seeds), beside the official runs' three seeds over the same
window (their mean and range); whether our PPG is above our PPO; and whether each is inside the official range.
OUT/_results/ holds results.py's figures (one per game, the official runs drawn behind ours) and aggregate.md.
Exit status: 0 when every run has reached its steps, 3 when some have not yet (run the command again), 1 when a
run failed, 130 when interrupted.
"""
import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys

import numpy as np

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, BENCHMARKS)
import launch  # noqa: E402
import results  # noqa: E402  (it puts benchmarks/reference/ on the path, for on_track)
from on_track import format_step, load_references, no_match_reason, reference_window, window_mean  # noqa: E402

ALGORITHMS = {"ppo_procgen.py": "PPO", "ppg_procgen.py": "PPG"}


def suite_jobs(args):
    """(name, argv) of each run: procgen_suite.sh's own hard-mode commands (its dry run), so that the evidence
    runs exactly the protocol the suite runs and results.py matches to the official runs."""
    environment = dict(os.environ, MODE="hard", GAMES=" ".join(args.games), SEEDS=" ".join(map(str, args.seeds)),
                       SCRIPTS="ppo_procgen.py ppg_procgen.py", TOTAL_TIMESTEPS=str(args.total_timesteps),
                       PPO_FLAGS=args.ppo_flags, PPG_FLAGS=args.ppg_flags, DRY_RUN="1", PYTHON="python",
                       EXTRA_FLAGS="--save-model")
    listed = subprocess.run(["bash", os.path.join(BENCHMARKS, "procgen_suite.sh")], env=environment, cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        raise SystemExit(listed.stderr.strip() or f"error: procgen_suite.sh exited {listed.returncode}")
    jobs = []
    for line in listed.stdout.splitlines()[:-1]:  # the last line is the suite's results.py command
        words = shlex.split(line)[1:]  # without "python"
        flag = lambda name: words[len(words) - 1 - words[::-1].index(name) + 1]  # a flag's last value
        jobs.append((f"{flag('--env-id')}__{words[0][:-3]}__{flag('--seed')}", words))
    return jobs


def run_folder(folder):
    """The job's run folder (OUT/<job>/runs/<run>) that holds a checkpoint, or None; folders without one (stopped
    before their first iteration) are removed, so that a fresh start is the job's only run."""
    found = None
    for path in sorted(glob.glob(os.path.join(folder, "runs", "*", "args.json"))):
        run = os.path.dirname(path)
        if os.path.exists(os.path.join(run, "checkpoint.pt")) and found is None:
            found = run
        else:
            print(f"removed {run}: no checkpoint to resume (stopped before its first iteration)")
            shutil.rmtree(run)
    return found


def plan(args):
    """The jobs still to run, each a fresh start or a resume (`launch.Job`), and the runs that are done."""
    todo, done = [], []
    for name, words in suite_jobs(args):
        run = run_folder(os.path.join(args.out, name))
        if run is None:
            todo.append(launch.Job(name, words))
        elif results.read_run(run).partial is None:
            done.append(name)
        else:
            todo.append(launch.Job(name, [words[0], "--resume", os.path.abspath(os.path.join(run, "checkpoint.pt"))]))
    return todo, done


def steps_past_resume_point(folder):
    """A PPG job's (steps past its resume point, steps per phase): it resumes at the end of its last auxiliary
    phase (every N_pi iterations) or of the run, so the iterations logged after it are played again. None for
    a job that is not PPG with auxiliary phases, or has no rows."""
    run = run_folder_of(folder)
    if run is None:
        return None
    run = results.read_run(run)
    args = run.args
    if args.get("script") != "ppg_procgen.py" or not args.get("e_aux"):
        return None
    iterations = [row["iteration"] for row in run.rows if "charts/episodic_return" in row]
    if not iterations:
        return None
    batch = args["num_envs"] * args["num_steps"]
    last = iterations[-1]
    resume_point = last if last == args["total_timesteps"] // batch else last // args["n_pi"] * args["n_pi"]
    return (last - resume_point) * batch, args["n_pi"] * batch


def run_folder_of(folder):
    """The job's run folder (OUT/<job>/runs/<run>), without removing anything; None if it has none."""
    found = sorted(glob.glob(os.path.join(folder, "runs", "*", "args.json")))
    return os.path.dirname(found[0]) if found else None


def game_rows(out):
    """Per game, the table's row: the step every run of the game has reached, and per algorithm our seeds' and the
    official seeds' means over the official runs' window before that step (or why there is none)."""
    runs = [results.read_run(path) for path in glob.glob(os.path.join(out, "*", "runs", "*"))
            if os.path.exists(os.path.join(path, "args.json"))]
    references = load_references()
    rows = {}
    for game in sorted({run.game for run in runs}):
        mine = {label: [run for run in runs if run.game == game and run.args.get("script") == script]
                for script, label in ALGORITHMS.items()}
        curves = {label: [results.last100_curve(run) for run in seeds] for label, seeds in mine.items()}
        if not all(curves.values()) or any(not len(x) for seeds in curves.values() for x, _ in seeds):
            rows[game] = {"step": None, "note": "not every run has a finished episode yet"}
            continue
        step = min(x[-1] for seeds in curves.values() for x, _ in seeds)
        rows[game] = {"step": int(step), "done": all(run.partial is None for seeds in mine.values() for run in seeds)}
        for label, seeds in mine.items():
            rows[game][label] = compare(label, game, step, seeds, curves[label], references)
    return rows


def compare(label, game, step, runs, curves, references):
    """One algorithm at `step`: our seeds' window means, the official seeds' over the same window, or the reason
    there is no official run to compare with."""
    matched = results.run_references(runs, references=references)
    window = reference_window(matched[0], game, step) if matched else None
    if window is None:
        why = no_match_reason(runs[0].args) or f"the official runs have no window ending at {format_step(step)}"
        ours = [float(y[-1]) for _, y in curves]  # the last logged value of each seed, without a window
        return {"ours": ours, "official": None, "why": why}
    width, theirs = window
    ours = [window_mean(x, y, step, width) for x, y in curves]
    return {"ours": ours, "official": [float(value) for value in theirs], "window": int(width),
            "reference": matched[0].label}


def markdown(rows):
    lines = ["# PPO and PPG against the official runs (benchmarks/evidence.py)", "",
             "Per game at the latest step every run has reached: each side's mean of the last 100 episodes over the "
             "official runs' last 8 logged iterations before that step (ours: mean ± std over seeds; official: the "
             "mean [min, max] of its seeds); 'inside' says where our mean falls in the official range.", "",
             "| game | step | PPO (ours) | PPG (ours) | PPG above PPO | official PPO [range] | official PPG [range] "
             "| PPO inside | PPG inside |", "|---" * 9 + "|"]
    notes = []
    for game, row in rows.items():
        if row["step"] is None:
            lines.append(f"| {game} | — | — | — | — | — | — | — | — |")
            notes.append(f"{game}: {row['note']}")
            continue
        cells = [game, format_step(row["step"]) + ("" if row["done"] else " (not done)")]
        means = {label: float(np.mean(row[label]["ours"])) for label in ALGORITHMS.values()}
        for label in ALGORITHMS.values():
            spread = f" ± {np.std(row[label]['ours'], ddof=1):.1f}" if len(row[label]["ours"]) > 1 else ""
            seeds = len(row[label]["ours"])
            cells.append(f"{means[label]:.2f}{spread} ({seeds} seed{'s' * (seeds > 1)})")
        cells.append("yes" if means["PPG"] > means["PPO"] else "no")
        inside = []
        for label in ALGORITHMS.values():
            official = row[label]["official"]
            if official is None:
                cells.append("—")
                inside.append("—")
                notes.append(f"{game}, {label}: no official window ({row[label]['why']}); ours is each seed's last "
                             "logged value")
                continue
            cells.append(f"{np.mean(official):.2f} [{min(official):.2f}, {max(official):.2f}]")
            inside.append("yes" if min(official) <= means[label] <= max(official) else
                          "above" if means[label] > max(official) else "below")
        lines.append("| " + " | ".join(cells + inside) + " |")
    return "\n".join(lines + [""] + [f"- {note}" for note in notes]) + "\n"


def parse(argv=None):
    """The flags, checked: a bad one ends here with one line, before any run starts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="runs/evidence", help="the runs, evidence.md and _results/ go here")
    parser.add_argument("--games", nargs="+", default=["starpilot", "bigfish"],
                        help="Procgen games (the official runs separate at 8M on StarPilot and BigFish)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="seeds of each algorithm and game")
    parser.add_argument("--total-timesteps", type=int, default=8_000_000, help="each run's steps")
    parser.add_argument("--minutes", type=float, default=60.0,
                        help="training time of this call; then every run saves and stops (see --grace): long "
                             "enough for a PPG phase, else PPG's work of the call is lost")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds a stopping run has to save")
    parser.add_argument("--ppo-flags", default="", help="more flags for the PPO runs (e.g. smaller ones on a CPU)")
    parser.add_argument("--ppg-flags", default="", help="more flags for the PPG runs")
    parser.add_argument("--reps", type=int, default=50_000, help="results.py's bootstrap resamples")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.games) - set(results.PROCGEN_RANGES))
    if unknown:
        parser.error(f"--games {' '.join(unknown)}: choose from {' '.join(sorted(results.PROCGEN_RANGES))}")
    if args.minutes <= 0 or args.grace < 0 or args.total_timesteps <= 0:
        parser.error(f"--minutes {args.minutes} and --total-timesteps {args.total_timesteps} must be > 0, "
                     f"--grace {args.grace} >= 0")
    return args


def main(argv=None):
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)

    todo, done = plan(args)
    for name in done:
        print(f"{name}: done")
    status = 0
    if todo:
        report, interrupted = launch.launch(todo, args.out, args.minutes * 60, args.grace)
        launch.print_report(report)
        for name, run in report["runs"].items():
            lost = steps_past_resume_point(os.path.join(args.out, name))
            if lost is not None and lost[0] and run["steps_per_s"] > 0:
                print(f"{name}: the {lost[0]:,} steps since its last auxiliary phase are lost (PPG resumes at a "
                      f"phase's end); a phase of {lost[1]:,} steps takes {lost[1] / run['steps_per_s'] / 60:.0f} min "
                      f"at this call's {run['steps_per_s']:,.0f} steps/s: give --minutes at least that")
        if interrupted:
            return 130
        if any(run["status"].startswith(("failed", "killed")) for run in report["runs"].values()):
            status = 1
    todo, _ = plan(args)
    if todo and status == 0:
        status = 3
        print(f"not done: {', '.join(job.name for job in todo)}; run the same command again to resume them")

    rows = game_rows(args.out)
    table = markdown(rows)
    launch.write_json(os.path.join(args.out, "evidence.json"), rows)
    results.write_atomically(os.path.join(args.out, "evidence.md"), table.encode())
    print(table, end="")
    try:
        results.main([args.out, "--out", os.path.join(args.out, "_results"), "--reps", str(args.reps)])
    except SystemExit as error:  # no run has rows yet: the table says so too
        print(error)
    return status


if __name__ == "__main__":
    sys.exit(main())
