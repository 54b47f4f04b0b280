"""The larger kill -9 campaign (the suite runs a few kills per script: tests/test_faults.py).

Each Procgen script on CueEnv (tests/fault_driver.py) is killed with SIGKILL --kills times: at seeded moments of every
kind its plumbing has (start-up, inside a rollout, a minibatch, PPG's auxiliary phase, IMPALA's iteration, between a
complete .tmp and its rename over checkpoint.pt or metrics.jsonl, the final evaluation) and, one kill in three, from
outside at a seeded random instant; after each kill it is resumed, until the run ends. Then each is checked as the
tests check it (tests/fault_driver.py's *_problems): every kill landed and left a loadable checkpoint, no .tmp is
left, no row lost or repeated, and the final checkpoint and rows equal a clean stop-and-resume at the same
iterations bit for bit. The RLHF toy (no resume: its stages keep checkpoints) is killed at random instants of a
small run: every checkpoint it left loads and every whole line of its metrics parses.

  python benchmarks/fault_campaign.py --kills 24 --out fault_campaign.json --figure docs/reliability_campaign.png
"""
import argparse
import glob
import io
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import fault_driver as driver  # noqa: E402

# A small RLHF run (about 5 s on the 2-core CPU) whose every stage keeps its checkpoint.
RLHF_FLAGS = dict(corpus_size=500, sft_steps=30, num_pairs=300, rm_epochs=1, ppo_iterations=4, rollout_batch_size=32,
                  eval_samples=32, bon_pool=4, save_model=True, threads=1)


def procgen_faults(script, kills, seed):
    """`kills` faults: the script's moments in turn at seeded occurrences, one in three a kill from outside after
    a seeded delay; the final evaluation's kill last (a child that reaches it has nothing else left)."""
    rng = random.Random(f"{script} {seed} timed")
    moments = [moment for moment, (_, scripts) in driver.MOMENTS.items() if script in scripts and moment != "final-eval"]
    faults = []
    named = 0
    while len(faults) < kills - 1:
        if len(faults) % 3 == 2:
            faults.append(("after", round(rng.uniform(0.1, 0.8), 2)))
        else:
            faults.append(driver.seeded_faults(script, [moments[named % len(moments)]], seed + len(faults))[0])
            named += 1
    return faults + driver.seeded_faults(script, ["final-eval"], seed)


def rlhf_child(flags, workdir):
    sys.path[:0] = [ROOT]
    import ppo_rlhf_toy

    log = os.open(os.path.join(workdir, "children.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(workdir)
    ppo_rlhf_toy.train(ppo_rlhf_toy.Args(**flags))


def rlhf_problems(run_dir):
    """What a killed RLHF run left that is not whole: a checkpoint that does not load, a line that does not parse
    (a last line cut off by the kill is not whole, and readers drop it)."""
    problems = []
    for path in glob.glob(os.path.join(run_dir, "*.pt")):
        try:
            driver.load(path)
        except Exception as error:  # noqa: BLE001 (any failure to load is the finding)
            problems.append(f"{os.path.basename(path)}: {type(error).__name__}")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            lines = f.read().split("\n")
        for number, line in enumerate(lines[:-1], 1):  # the text after the last newline is a cut line
            try:
                json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"metrics.jsonl line {number} does not parse")
    return problems


def rlhf_campaign(context, kills, seed, workdir):
    """`kills` runs of the toy, each killed at a seeded instant of its run time; returns a record per kill."""
    rng = random.Random(f"rlhf {seed}")
    start = time.perf_counter()
    process = context.Process(target=rlhf_child, args=(RLHF_FLAGS, os.path.join(workdir, "untimed")))
    os.makedirs(os.path.join(workdir, "untimed"))
    process.start()
    process.join()
    duration = time.perf_counter() - start
    records = [dict(fault=None, exit=process.exitcode, seconds=round(duration, 2))]
    for kill in range(kills):
        folder = os.path.join(workdir, f"kill{kill}")
        os.makedirs(folder)
        delay = round(rng.uniform(0.1, duration), 2)
        code = driver.run_child_process(context, rlhf_child, (RLHF_FLAGS, folder), delay)
        (run_dir,) = glob.glob(os.path.join(folder, "runs", "*")) or [folder]
        kept = sorted(os.path.basename(path) for path in glob.glob(os.path.join(run_dir, "*.pt")))
        records.append(dict(fault=("after", delay), exit=code, kept=kept, problems=rlhf_problems(run_dir),
                            tmp=sorted(os.path.basename(path) for path in glob.glob(os.path.join(run_dir, "*.tmp")))))
    return records


def plot(path, results):
    """One panel per script: the checkpoint's iteration after each kill, marked by the kill's moment."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 4))
    axes = figure.subplots(1, len(results))
    markers = dict(zip([*driver.MOMENTS, "after"], "osv^DPX*h"))
    for axis, (script, result) in zip(axes, results.items()):
        if script == "ppo_rlhf_toy":
            records = result["records"][1:]
            for index, record in enumerate(records, 1):
                axis.plot(index, len(record["kept"]), "h", color="tab:red" if record["problems"] else "tab:blue")
            axis.set(xlabel="kill", ylabel="stage checkpoints kept (sft, rm, ppo_policy)",
                     title=f"RLHF toy: {len(records)} kills, {sum(bool(r['problems']) for r in records)} damaged")
            continue
        drawn = set()
        for index, record in enumerate(result["records"], 1):
            moment = record["fault"][1] if record["fault"] and record["fault"][0] == "kill" else "after"
            label = None
            if moment not in drawn and record["fault"]:
                label = "from outside, at a random instant" if moment == "after" else moment
            drawn.add(moment)
            axis.plot(index, record["saved"] or 0, markers[moment], color="tab:blue", label=label)
        verdict = "all checks passed" if not result["problems"] else f"{len(result['problems'])} problems"
        axis.set(xlabel="child (each but the last killed)", ylabel="checkpoint iteration after it",
                 title=f"{script}.py: {len(result['records']) - 1} kills, {verdict}")
        axis.legend(fontsize=7)
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=90)
    write_atomically(path, image.getbuffer())


def write_atomically(path, data):
    """A temporary file in the same folder, on the disk, renamed over `path`: all of `data` or the old file."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--kills", type=int, default=24, help="kills per script (at least 20 for a campaign worth reporting)")
    parser.add_argument("--iterations", type=int, default=64, help="iterations of each Procgen run")
    parser.add_argument("--seed", type=int, default=1, help="seed of the kill moments")
    parser.add_argument("--out", help="JSON under benchmarks/results/")
    parser.add_argument("--figure", help="PNG path, e.g. docs/reliability_campaign.png")
    options = parser.parse_args(argv)
    context = driver.forkserver(extra=["ppo_rlhf_toy"])
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for script in driver.FLAGS:
            started = time.perf_counter()
            driver.FLAGS[script]["total_timesteps"] *= options.iterations // driver.iterations(script)
            faults = procgen_faults(script, options.kills, options.seed)
            campaign = driver.campaign(context, script, os.path.join(workdir, script), faults)
            problems = driver.all_problems(campaign)
            results[script] = dict(records=campaign["records"], resume_points=driver.resume_points(campaign["records"]),
                                   problems=problems, seconds=round(time.perf_counter() - started, 1))
            print(f"{script}: {len(campaign['records']) - 1} kills, {len(problems)} problems "
                  f"({results[script]['seconds']} s){''.join(chr(10) + '  ' + p for p in problems)}", flush=True)
        records = rlhf_campaign(context, options.kills, options.seed, os.path.join(workdir, "rlhf"))
        damaged = [record for record in records[1:] if record["problems"]]
        problems = [problem for record in damaged for problem in record["problems"]]
        if records[0]["exit"] != 0:
            problems.insert(0, f"the run without a kill exited {records[0]['exit']}")
        results["ppo_rlhf_toy"] = dict(records=records, problems=problems)
        print(f"ppo_rlhf_toy: {len(records) - 1} kills, {len(damaged)} left a damaged file "
              f"({records[0]['seconds']} s unkilled){''.join(chr(10) + '  ' + p for p in problems)}", flush=True)
    command = " ".join(["python", "benchmarks/fault_campaign.py", *(argv if argv is not None else sys.argv[1:])])
    record = {"command": command, "machine": f"{os.cpu_count()} cores", "results": results}
    if options.out:
        write_atomically(os.path.join(ROOT, "benchmarks", "results", options.out), json.dumps(record, indent=1).encode())
    if options.figure:
        plot(os.path.join(ROOT, options.figure), results)
    return record


if __name__ == "__main__":
    main()
