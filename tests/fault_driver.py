"""Kill -9 at a chosen moment: one Procgen script's train() on CueEnv runs in a child process that
SIGKILLs itself at the n-th occurrence of a named moment, as a preempting cluster would, but exactly there; the run
is then resumed from its checkpoint until it ends. The same run stopped cleanly (SIGTERM at an iteration's end) at
the iterations the kills resumed from is the reference it must equal, bit for bit.

Children are forked from a forkserver that has imported torch and the scripts once (a child starts in
milliseconds instead of seconds). Used by tests/test_faults.py (a few kills per script) and
benchmarks/fault_campaign.py (many, with a figure for docs/reliability.md)."""
import functools
import glob
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import sys
import threading

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The smallest runs that still have every moment: 6 iterations, a checkpoint after each (--save-every 1) and an
# evaluation after each (--eval-every 1: the reference stops after one), one torch thread (bit-identical reruns).
# PPG resumes only at the end of a phase: a checkpoint after each phase of N_pi = 2 iterations, and 8 iterations, so
# that each of its campaign's kills comes after a child's first checkpoint.
COMMON = dict(env_id="coinrun", channels=(4,), hidden_size=16, eval_every=1, eval_episodes=1,
              save_model=True, save_every=1, torch_threads=1, env_threads=1)
FLAGS = {
    "ppo_procgen": dict(COMMON, num_envs=4, num_steps=8, num_minibatches=2, update_epochs=2, total_timesteps=192),
    "ppg_procgen": dict(COMMON, num_envs=4, num_steps=8, num_minibatches=2, total_timesteps=256, n_pi=2, e_aux=1,
                        num_aux_rollouts=2, save_every=2),
    "vtrace": dict(COMMON, num_envs=4, unroll_length=4, updates_per_iteration=3, total_timesteps=288,
                   deterministic_lag=True),
}
# moment: (the script's function whose call it is, the scripts that have it). "mid-save" and "mid-rewrite" are the
# instant between a complete temporary file and its rename over the checkpoint or metrics.jsonl.
MOMENTS = {
    "start-up": ("make_env", ("ppo_procgen", "ppg_procgen", "vtrace")),
    "mid-rollout": ("FramesToDevice.__call__", ("ppo_procgen", "ppg_procgen")),
    "mid-update": ("policy_loss", ("ppo_procgen", "ppg_procgen")),
    "aux-phase": ("ppg_aux_loss", ("ppg_procgen",)),
    "mid-iteration": ("vtrace_backward", ("vtrace",)),
    "mid-save": ("os.replace checkpoint.pt", ("ppo_procgen", "ppg_procgen", "vtrace")),
    "mid-rewrite": ("os.replace metrics.jsonl", ("ppo_procgen", "ppg_procgen", "vtrace")),
    "final-eval": ("evaluate", ("ppo_procgen", "ppg_procgen", "vtrace")),
}
# Columns that measure time, not the run: they differ between any two runs.
TIMING = ("time", "charts/SPS")


def iterations(script):
    """The run's number of iterations at FLAGS."""
    flags = FLAGS[script]
    if script == "vtrace":
        return flags["total_timesteps"] // (flags["num_envs"] * flags["unroll_length"] * flags["updates_per_iteration"])
    return flags["total_timesteps"] // (flags["num_envs"] * flags["num_steps"])


def kill_self(*_):
    os.kill(os.getpid(), signal.SIGKILL)


def counting(function, at, then):
    """`function`, whose `at`-th call runs `then` first."""
    calls = [0]

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            then()
        return function(*args, **kwargs)
    return wrapped


def plant(module, fault):
    """Patches `module` (a script) for `fault`: ("kill", moment, n) or ("stop-after", iteration)."""
    if fault[0] == "stop-after":  # the reference: a clean SIGTERM stop once that iteration has ended
        original = module.evaluate_and_log

        def evaluate_then_stop(*args, **kwargs):
            original(*args, **kwargs)
            if args[2] == fault[1]:  # its `iteration`
                os.kill(os.getpid(), signal.SIGTERM)
        module.evaluate_and_log = evaluate_then_stop
        return
    _, moment, at = fault
    target = MOMENTS[moment][0]
    if target.startswith("os.replace"):
        name = target.split()[1]
        renames = [0]
        real_replace = os.replace

        def replace(source, destination):
            if os.path.basename(destination) == name:
                renames[0] += 1
                if renames[0] == at:
                    kill_self()
            return real_replace(source, destination)
        os.replace = replace
    elif target == "evaluate":  # the final evaluation: the one of the last iteration
        original = module.evaluate_and_log

        def evaluate_and_die(*args, **kwargs):
            if args[2] == at:
                kill_self()
            return original(*args, **kwargs)
        module.evaluate_and_log = evaluate_and_die
    elif "." in target:
        owner, attribute = target.split(".")
        setattr(getattr(module, owner), attribute, counting(getattr(getattr(module, owner), attribute), at, kill_self))
    else:
        setattr(module, target, counting(getattr(module, target), at, kill_self))


def child(script, flags, workdir, fault):
    """The child process: `script`'s train() at `flags` in `workdir` on CueEnv, with `fault` planted."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    from exercises.cue_env import CueEnv

    module = __import__(script)
    module.ProcgenVecEnv = functools.partial(cue_env, CueEnv)
    log = os.open(os.path.join(workdir, "children.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(workdir)
    if fault is not None:
        plant(module, fault)
    module.train(module.Args(**flags))


def cue_env(cue_class, num_envs, *args, **kwargs):
    return cue_class(num_envs)


def forkserver(extra=()):
    """A multiprocessing context whose children are forked from a server that imported torch and the scripts
    (and the modules `extra`)."""
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: the first torch.optim.Adam imports it (2.5 s of a tiny run's 3.8 s)
    context.set_forkserver_preload(["torch", "torch._dynamo", "torch.utils.tensorboard", "exercises.cue_env",
                                    "ppo_procgen", "ppg_procgen", "vtrace", "fault_driver", *extra])
    return context


def run_child(context, script, flags, workdir, fault):
    """Runs one child to its end; returns its exit code (-9: killed). A fault ("after", seconds) is a SIGKILL
    from outside at that instant, wherever the child is then."""
    if fault is not None and fault[0] == "after":
        return run_child_process(context, child, (script, flags, workdir, None), fault[1])
    return run_child_process(context, child, (script, flags, workdir, fault))


# A forkserver child's exit status comes once, down a pipe, to whichever thread reads it first, and Process.start()
# reads those of every other running child (multiprocessing.process._cleanup): a thread that reads after another one
# gets EOF, which multiprocessing reports as 255. test_faults.py runs two campaigns in two threads (255 for a child
# that exited 143: seen in the suite, 3 of 600 children in a stress run), so the reads take turns.
STATUS_LOCK = threading.Lock()


def run_child_process(context, target, args, kill_after=None):
    """target(*args) in a child; SIGKILLed from outside after `kill_after` seconds if still running. Returns its
    exit code."""
    process = context.Process(target=target, args=args)
    with STATUS_LOCK:
        process.start()
    if not multiprocessing.connection.wait([process.sentinel], kill_after):
        os.kill(process.pid, signal.SIGKILL)  # still running: its status is not in the pipe yet
    multiprocessing.connection.wait([process.sentinel])
    with STATUS_LOCK:
        process.join()
    return process.exitcode


def occurrences(script, moment):
    """How often `moment` comes between two checkpoints of a run at FLAGS: in --save-every iterations (PPG: one
    phase, whose auxiliary phase comes once)."""
    flags = FLAGS[script]
    if moment == "mid-rollout":
        return flags["num_steps"] * flags["save_every"]
    if moment == "mid-update":
        return flags["num_minibatches"] * flags.get("update_epochs", 1) * flags["save_every"]
    if moment == "aux-phase":
        return flags["e_aux"] * flags["n_pi"] * flags["num_envs"] // flags["num_aux_rollouts"]
    if moment == "mid-iteration":
        return flags["updates_per_iteration"] * flags["save_every"]
    return 1


def seeded_faults(script, moments, seed):
    """A kill per moment at a seeded n-th occurrence between the child's first checkpoint and its second (its second
    iteration; PPG's: its second phase, whose auxiliary phase is the child's second): each kill is reached and the
    run moves on. Start-up and the rewrite of a resume's metrics come once (the former leaves no checkpoint: the
    next child starts anew); the final evaluation's kill comes in the last iteration."""
    rng = random.Random(f"{script} {seed}")
    faults = []
    for moment in moments:
        count = occurrences(script, moment)
        if moment == "final-eval":
            faults.append(("kill", moment, iterations(script)))
        elif moment in ("start-up", "mid-rewrite"):
            faults.append(("kill", moment, rng.randint(1, count)))
        elif moment == "mid-rollout":  # the rollout's frames: one at the start, then one per step
            faults.append(("kill", moment, 1 + count + rng.randint(1, count)))
        else:
            faults.append(("kill", moment, count + rng.randint(1, count)))
    return faults


def newest_run(workdir):
    runs = sorted(glob.glob(os.path.join(workdir, "runs", "*")), key=os.path.getmtime)
    return runs[-1] if runs else None


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def chain(context, script, workdir, faults):
    """Runs `script` killed by each fault of `faults` in turn, each time resumed from its checkpoint (a run
    killed before its first checkpoint starts anew), then to its end (a timed kill may come after it: the faults
    left are not used). Returns (the final run directory, a record per child: its fault, exit code, the
    checkpoint iteration it resumed from and left, the .tmp files in the run directory before and after it)."""
    os.makedirs(workdir, exist_ok=True)
    records = []
    run_dir = None
    for fault in [*faults, None]:
        checkpoint = os.path.join(run_dir, "checkpoint.pt") if run_dir else None
        resume = checkpoint if checkpoint and os.path.exists(checkpoint) else None
        flags = dict(FLAGS[script], resume=os.path.abspath(resume) if resume else None)
        resumed_from = load(resume)["iteration"] if resume else None
        leftovers_before = sorted(os.listdir(run_dir)) if run_dir else []
        code = run_child(context, script, flags, workdir, fault)
        run_dir = newest_run(workdir)
        left = os.path.join(run_dir, "checkpoint.pt") if run_dir else None
        saved = load(left)["iteration"] if left and os.path.exists(left) else None  # loads: or it raises here
        records.append(dict(fault=fault, exit=code, resumed_from=resumed_from, saved=saved,
                            tmp_before=[name for name in leftovers_before if name.endswith(".tmp")],
                            tmp_after=[name for name in os.listdir(run_dir) if name.endswith(".tmp")]))
        if code == 0:
            break
    return run_dir, records


def reference(context, script, workdir, resume_points):
    """The same run stopped cleanly (SIGTERM) after each iteration of `resume_points` and resumed there.
    Returns (its run directory, the exit code of each child)."""
    os.makedirs(workdir, exist_ok=True)
    records = []
    for iteration in [*resume_points, None]:
        run_dir = newest_run(workdir)
        resume = os.path.abspath(os.path.join(run_dir, "checkpoint.pt")) if records else None
        fault = ("stop-after", iteration) if iteration is not None else None
        code = run_child(context, script, dict(FLAGS[script], resume=resume), workdir, fault)
        records.append(code)
    return newest_run(workdir), records


def resume_points(records):
    """The distinct iterations the chain resumed from, in order (a kill before any progress resumes twice)."""
    points = []
    for record in records:
        if record["resumed_from"] is not None and record["resumed_from"] not in points:
            points.append(record["resumed_from"])
    return points


def training_rows(run_dir):
    """The run's metrics rows without their timing columns, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{key: value for key, value in row.items() if key not in TIMING and not key.startswith(("time/", "perf/"))}
            for row in rows]


def differences(first, second, where=""):
    """Where two checkpoints differ (flags, names and paths aside): [] when equal bit for bit."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        same = first.dtype == second.dtype and first.shape == second.shape and torch.equal(first, second)
        return [] if same else [where]
    if isinstance(first, dict) and isinstance(second, dict):
        if set(first) != set(second):
            return [f"{where}: keys {sorted(set(first) ^ set(second), key=str)}"]
        return [place for key in first if key not in ("args", "run_name")
                for place in differences(first[key], second[key], f"{where}/{key}")]
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)) and len(first) == len(second):
        return [place for index, (a, b) in enumerate(zip(first, second))
                for place in differences(a, b, f"{where}[{index}]")]
    return [] if first == second else [where]


def campaign(context, script, workdir, faults):
    """The kill chain and its clean reference, in workdir/killed and workdir/clean."""
    run_dir, records = chain(context, script, os.path.join(workdir, "killed"), faults)
    reference_dir, codes = reference(context, script, os.path.join(workdir, "clean"), resume_points(records))
    return dict(script=script, run_dir=run_dir, records=records, reference_dir=reference_dir, codes=codes)


# ---- What a campaign must show; each returns what went wrong, [] when nothing did ----
def kill_problems(campaign):
    """Every kill landed (exit -9) and the last child ended the run; once a checkpoint exists every kill leaves one
    that loads (chain loaded each with weights_only=True), never an older one."""
    records = campaign["records"]
    exits = [record["exit"] for record in records]
    problems = []
    if exits[-1] != 0 or any(code != -9 for code in exits[:-1]):
        problems.append(f"exit statuses {exits}: each kill should land (-9) and the last child end the run (0)")
    saved = [record["saved"] for record in records]
    first = next((index for index, iteration in enumerate(saved) if iteration is not None), len(saved))
    if None in saved[first:] or saved[first:] != sorted(saved[first:]):
        problems.append(f"checkpoint iterations after each child {saved}: one lost or gone back")
    if saved[-1] != iterations(campaign["script"]):
        problems.append(f"the run ended at iteration {saved[-1]}, not {iterations(campaign['script'])}")
    return problems


def leftover_problems(campaign):
    """A kill between a complete .tmp and its rename leaves that .tmp; the next resume removes it; none is left."""
    records = campaign["records"]
    expected = {"mid-save": "checkpoint.pt.tmp", "mid-rewrite": "metrics.jsonl.tmp"}
    problems = []
    for record in records:
        moment = record["fault"][1] if record["fault"] else None
        if moment in expected and expected[moment] not in record["tmp_after"]:
            problems.append(f"{record['fault']}: no {expected[moment]} left, so the kill was not where it should be")
    if records[-1]["tmp_after"]:
        problems.append(f"left at the end: {records[-1]['tmp_after']}")
    return problems


def row_problems(campaign):
    """Each iteration has exactly one training row and one evaluation row, in order."""
    rows = training_rows(campaign["run_dir"])
    trained = [row["iteration"] for row in rows if "losses/policy_loss" in row]
    evaluated = [row["iteration"] for row in rows if "eval/episodic_return" in row]
    expected = list(range(1, iterations(campaign["script"]) + 1))
    if trained == evaluated == expected:
        return []
    return [f"training rows of iterations {trained}, evaluation rows of {evaluated}: expected {expected}"]


def aux_problems(campaign):
    """PPG: every auxiliary phase distilled the whole buffer B, N_pi x num_envs rollouts, in the killed run and in
    its reference; one phase after each policy phase but the run's last."""
    if campaign["script"] != "ppg_procgen":
        return []
    flags = FLAGS["ppg_procgen"]
    expected = [(iteration, flags["n_pi"] * flags["num_envs"])
                for iteration in range(flags["n_pi"], iterations("ppg_procgen"), flags["n_pi"])]
    problems = []
    for run_dir in (campaign["run_dir"], campaign["reference_dir"]):
        phases = [(row["iteration"], row.get("aux/rollouts")) for row in training_rows(run_dir) if "aux/kl" in row]
        if phases != expected:
            problems.append(f"{run_dir}: auxiliary phases (iteration, rollouts) {phases}, expected {expected}")
    return problems


def equality_problems(campaign):
    """The killed-and-resumed run equals the stopped-and-resumed one (clean SIGTERM stops at the iterations the
    kills resumed from) bit for bit: its final checkpoint and its rows, timing columns aside."""
    codes = campaign["codes"]
    problems = []
    if codes != [128 + signal.SIGTERM] * (len(codes) - 1) + [0]:
        problems.append(f"the reference's exit statuses {codes}: clean stops (143), then the end (0)")
    killed = load(os.path.join(campaign["run_dir"], "checkpoint.pt"))
    clean = load(os.path.join(campaign["reference_dir"], "checkpoint.pt"))
    problems += [f"checkpoints differ at {place}" for place in differences(killed, clean)]
    if training_rows(campaign["run_dir"]) != training_rows(campaign["reference_dir"]):
        problems.append("metrics rows differ")
    return problems


def all_problems(campaign):
    return (kill_problems(campaign) + leftover_problems(campaign) + row_problems(campaign) + aux_problems(campaign)
            + equality_problems(campaign))
