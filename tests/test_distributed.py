"""Data parallel under torchrun (gloo, 2 ranks on the CPU): gradients all-reduced across ranks equal one process's
gradient on the whole minibatch; real runs of each script finish, log every rank's episodes once, keep the ranks'
weights bitwise identical, stop every rank on SIGTERM with a checkpoint, resume under torchrun to the same total;
a rank that raises stops the other one; bad world sizes fail at once with one line."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT

import forked_run
import ppg_procgen
import ppo_procgen
import vtrace

DRIVER = os.path.join(ROOT, "tests", "torchrun_driver.py")
FORKED_TORCHRUN = os.path.join(ROOT, "tests", "torchrun_forked.py")
TINY = ["--num-envs", "4", "--channels", "4", "--hidden-size", "8", "--eval-episodes", "3", "--eval-every", "0",
        "--save-model", "--save-every", "2"]
# 64 steps per iteration, in 4 games: CueEnv's 8-step episodes make 8 of them per iteration, 4 in each rank's games
SCRIPT_FLAGS = {"ppo_procgen.py": ["--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1"],
                "ppg_procgen.py": ["--num-steps", "16", "--num-minibatches", "2", "--n-pi", "2", "--e-aux", "1"],
                "vtrace.py": ["--unroll-length", "8", "--updates-per-iteration", "2", "--max-policy-lag", "1"]}


def torchrun(*arguments, env=None):
    """`torchrun --standalone --nproc-per-node 2 *arguments` (python -m torch.distributed.run), output merged."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *arguments]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CUE_ENV": "1", **(env or {})})


def forked_torchrun(*arguments, env=None):
    """The same torchrun (its parser, agent, signals and exit status), forked from the preloaded server and forking
    its ranks (tests/torchrun_forked.py): no interpreter start-ups (the three SIGTERM tests: 18 s of CPU, not 77 s)."""
    return forked_run.ForkedRun(FORKED_TORCHRUN, ["--standalone", "--nproc-per-node", "2", *arguments],
                                env={**os.environ, "CUE_ENV": "1", **(env or {})}, stderr_to_stdout=True)


def briefly(output):
    """The output without its per-iteration lines, so that a failure's message (CI prints a part) shows the error."""
    return "\n".join(line for line in output.splitlines() if not line.startswith(("iter ", "aux phase:")))


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_two_ranks_take_the_step_of_one_process_on_the_whole_minibatch():
    """PPO's update (advantages normalized over the global minibatch), PPG's auxiliary phase, IMPALA's learner."""
    process = torchrun(os.path.join(ROOT, "tests", "distributed_exactness.py"))
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, briefly(output)
    assert all(f"{name}: weights moved" in output for name in ("ppo", "ppg", "vtrace")), briefly(output)


@pytest.mark.parametrize("script", ["ppo_procgen.py", "ppg_procgen.py", "vtrace.py"])
def test_torchrun_sigterm_and_resume_end_to_end(script, in_tmp):
    """8 iterations: the ranks save at iteration 2, wait at their next stop check for the SIGTERM (the driver's
    WAIT_FOR_SIGNAL: the stop lands mid-run however fast the machine), stop, and the resume trains the rest. Both
    launches are forked_torchrun's (the other two tests start the ranks as the command line does)."""
    iterations = 8
    flags = [*TINY, *SCRIPT_FLAGS[script], "--total-timesteps", str(64 * iterations)]
    process = forked_torchrun(DRIVER, script, *flags, env={"WAIT_FOR_SIGNAL": "1"})
    deadline = time.time() + 240
    while not glob.glob("runs/*/checkpoint.pt"):
        assert time.time() < deadline and process.poll() is None, briefly(process.communicate()[0])
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to both ranks
    output = process.communicate(timeout=120)[0]
    assert process.returncode != 0 and "interrupted by SIGTERM: saved iteration" in output, briefly(output)
    (run_dir,) = glob.glob("runs/*")
    path = os.path.join(run_dir, "checkpoint.pt")
    saved = torch.load(path, weights_only=True)
    assert 2 <= saved["iteration"] < iterations and len(saved["ranks"]) == 2
    assert saved["ranks"][0]["rng"]["torch"].ne(saved["ranks"][1]["rng"]["torch"]).any()  # each rank its own

    process = forked_torchrun(DRIVER, script, "--resume", path)
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, briefly(output)
    rows = [row for row in read_rows(run_dir) if "losses/policy_loss" in row]
    assert [row["iteration"] for row in rows] == list(range(1, iterations + 1))  # every iteration exactly once
    assert rows[-1]["global_step"] == 64 * iterations  # --num-envs and the step budget are global
    # CueEnv's episodes last 8 steps: 4 games x 16 steps = 8 episodes per iteration, 4 from each rank
    assert all(row["charts/episodes"] == 8 for row in rows[1:])
    with open(os.path.join(run_dir, "weights_rank0.txt")) as f0, open(os.path.join(run_dir, "weights_rank1.txt")) as f1:
        assert f0.read() == f1.read()  # the ranks' weights are bitwise identical after training

    result = forked_run.run(os.path.join(ROOT, script), "--resume", path, timeout=120)  # one process
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        f"error: --resume {path} was written by 2 ranks: resume it with as many (torchrun --nproc-per-node 2)"]


def test_a_rank_that_raises_stops_the_other(in_tmp):
    start = time.time()
    process = torchrun(DRIVER, "ppo_procgen.py", *TINY, *SCRIPT_FLAGS["ppo_procgen.py"], "--total-timesteps",
                       str(64 * 1000), env={"FAIL_RANK": "1", "FAIL_FUNCTION": "compute_gae"})
    output = process.communicate(timeout=180)[0]
    assert process.returncode != 0 and "RuntimeError: injected failure on rank 1" in output, briefly(output)
    assert time.time() - start < 120


@pytest.mark.parametrize("module", [ppo_procgen, ppg_procgen, vtrace])
def test_flags_that_do_not_split_over_the_ranks_fail_at_once(module, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match=f"--num-envs {module.Args().num_envs} must be a multiple of the 3 ranks"):
        module.check_args(module.Args())
    if module is vtrace:  # one update per unroll of all games: nothing else splits
        return
    monkeypatch.setenv("WORLD_SIZE", "4")  # 8 games x 6 steps split 8 ways, but 2 games x 6 steps per rank do not
    with pytest.raises(SystemExit, match=r"--num-minibatches 8 must divide the batch size 12 \(num_envs \* "
                                         r"num_steps / 4 ranks\)"):
        module.check_args(module.Args(num_envs=8, num_steps=6, num_minibatches=8))


def test_ppg_auxiliary_minibatch_is_global():
    """The paper's setup, 4 ranks x 64 games: the PPG code's 4 rollouts per worker make a 16-rollout (4,096-frame)
    auxiliary minibatch next to 8 policy minibatches of 8,192 frames; one process with 64 games: 4 rollouts."""
    paper = ppg_procgen.Args(num_envs=256)
    assert ppg_procgen.aux_rollouts_per_rank(paper, 4) * 4 * paper.num_steps == 4096
    assert paper.num_envs * paper.num_steps // paper.num_minibatches == 8192
    assert ppg_procgen.aux_rollouts_per_rank(ppg_procgen.Args(), 1) == 4
    assert ppg_procgen.aux_rollouts_per_rank(ppg_procgen.Args(num_aux_rollouts=8), 2) == 4
