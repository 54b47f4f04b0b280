"""vtrace.py's actor-learner: index alignment of an unroll, the learner's use of it, learning with asynchronous actors
and bounded lag, clean stops (actor errors, Ctrl-C), and the CLI end to end on Procgen. The V-trace math is in
test_vtrace.py."""
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import ROOT
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import RecordEpisodeStatistics

import vtrace

# Columns of every per-iteration row of metrics.jsonl (documented in vtrace.py's train), for --max-policy-lag K.
ITERATION_KEYS = {
    "global_step", "iteration", "time", "charts/SPS", "charts/learning_rate", "charts/episodes",
    "charts/episodic_return", "charts/episodic_length", "charts/episodic_return_last100", "losses/policy_loss",
    "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/explained_variance", "policy_lag/mean",
    "policy_lag/max", "policy_lag/dropped", "time/wait", "time/learn", "perf/gpu_memory_gb"}
lag_keys = lambda max_lag: {f"policy_lag/count_{k}" for k in range(max_lag + 1)}  # noqa: E731
EVAL_KEYS = {"global_step", "iteration", "eval/episodic_return", "eval/normalized_score", "time/eval"}


class ChainEnv(gym.vector.VectorEnv):
    """Deterministic: game b's episodes last lengths[b] steps; the frame shows (step in episode t, game b, episode
    count) in pixel (0, 0); action a at step t earns 16 t + a, so each reward names the (state, action) it belongs to.
    SAME_STEP autoreset like ProcgenVecEnv: the last step returns done and the next episode's first frame."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, lengths):
        self.lengths, self.num_envs = np.array(lengths), len(lengths)
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(15)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)

    def frames(self):
        self.last_frames = np.zeros((self.num_envs, 64, 64, 3), dtype=np.uint8)
        self.last_frames[:, 0, 0] = np.stack([self.t, np.arange(self.num_envs), self.episode], 1)
        return self.last_frames.copy()

    def reset(self, *, seed=None, options=None):
        self.t, self.episode = np.zeros(self.num_envs, dtype=int), np.zeros(self.num_envs, dtype=int)
        return self.frames(), {}

    def step(self, actions):
        reward = 16.0 * self.t + np.asarray(actions)
        self.t += 1
        done = self.t == self.lengths
        self.t[done], self.episode[done] = 0, self.episode[done] + 1
        return self.frames(), reward, done, np.zeros(self.num_envs, dtype=bool), {}


class TablePolicy(nn.Module):
    """Fixed random logits per (t, game) read from the frame; the same frame always gets the same logits."""

    def __init__(self):
        super().__init__()
        self.table = torch.randn(16, 8, 15, generator=torch.Generator().manual_seed(0))

    def forward(self, obs):
        return self.table[obs[:, 0, 0, 0].long(), obs[:, 0, 0, 1].long()], torch.zeros(obs.shape[0])


def test_unroll_index_alignment():
    """The reward and done at index t are what step(a_t) returned for (x_t, a_t); a done cuts right after the
    episode's last step; obs[T] is the frame after the last action, and the next unroll starts from it."""
    lengths, T = [3, 4, 5], 7
    envs = RecordEpisodeStatistics(ChainEnv(lengths))
    policy = TablePolicy()
    obs = torch.as_tensor(envs.reset()[0])
    first = vtrace.collect_unroll(policy, envs, obs, T)
    assert torch.equal(first["obs"][-1], torch.as_tensor(envs.env.last_frames))  # x_T: after the last action
    second = vtrace.collect_unroll(policy, envs, first["obs"][-1], T)
    assert torch.equal(second["obs"][0], first["obs"][-1])
    assert first["obs"].shape == (T + 1, 3, 64, 64, 3) and first["behaviour_logits"].shape == (T, 3, 15)
    assert first["actions"].shape == first["rewards"].shape == first["dones"].shape == (T, 3)

    running, expected_returns = np.zeros(3), []
    for unroll in (first, second):
        state = unroll["obs"][:, :, 0, 0].long()  # [T+1, B, (t, game, episode)]
        t, actions = state[:-1, :, 0], unroll["actions"]
        torch.testing.assert_close(unroll["behaviour_logits"], policy(unroll["obs"][:-1].flatten(0, 1))[0]
                                   .view(T, 3, 15), rtol=0, atol=0)
        torch.testing.assert_close(unroll["rewards"], (16 * t + actions).float(), rtol=0, atol=0)
        last_step = t == torch.tensor(lengths) - 1
        torch.testing.assert_close(unroll["dones"], last_step.float(), rtol=0, atol=0)
        # after a done, x_{t+1} is the next episode's first frame; otherwise the same episode one step on
        torch.testing.assert_close(state[1:, :, 0], torch.where(last_step, 0, t + 1), rtol=0, atol=0)
        torch.testing.assert_close(state[1:, :, 2], state[:-1, :, 2] + last_step.long(), rtol=0, atol=0)
        assert (state[:, :, 1] == torch.arange(3)).all()
        episode_returns = []
        for step in range(T):
            running += unroll["rewards"][step].numpy()
            episode_returns += running[unroll["dones"][step].bool().numpy()].tolist()
            running[unroll["dones"][step].bool().numpy()] = 0
        assert unroll["episode_returns"] == pytest.approx(episode_returns)  # RecordEpisodeStatistics agrees
        expected_returns += episode_returns
    assert len(expected_returns) == 4 + 3 + 2  # 14 steps in games whose episodes last 3, 4 and 5 steps


def test_learner_feeds_vtrace_the_aligned_batch(monkeypatch):
    """vtrace_backward pairs pi's logits and values on x_0..x_{T-1} with mu's logits, a_t, r_t and
    gamma_t = gamma (1 - done_t), and bootstraps from the learner's V(x_T)."""
    args = vtrace.Args(channels=(4,), hidden_size=16, gamma=0.9)
    torch.manual_seed(0)
    agent = vtrace.Agent(args, num_actions=15)
    envs = ChainEnv([2, 3, 4, 5])
    unroll = vtrace.collect_unroll(TablePolicy(), envs, torch.as_tensor(envs.reset()[0]), 6)
    seen = {}

    def spy(*arguments):
        seen.update(zip(["mu", "pi", "actions", "discounts", "rewards", "values", "bootstrap"], arguments))
        return from_logits(*arguments)

    from_logits = vtrace.from_logits
    monkeypatch.setattr(vtrace, "from_logits", spy)
    optimizer = torch.optim.Adam(agent.parameters())
    stats = vtrace.vtrace_backward(agent, optimizer, unroll, args, contextlib.nullcontext)
    with torch.no_grad():
        logits, values = zip(*(agent(frames) for frames in unroll["obs"]))
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seen["mu"], unroll["behaviour_logits"], rtol=0, atol=0)
    torch.testing.assert_close(seen["pi"], torch.stack(logits[:-1]), **close)
    torch.testing.assert_close(seen["values"], torch.stack(values[:-1]), **close)
    torch.testing.assert_close(seen["bootstrap"], values[-1], **close)  # V(x_T) from the learner's network
    torch.testing.assert_close(seen["discounts"], 0.9 * (1 - unroll["dones"]), rtol=0, atol=0)
    assert seen["discounts"].min() == 0  # episodes do end inside this unroll
    assert torch.equal(seen["actions"], unroll["actions"]) and torch.equal(seen["rewards"], unroll["rewards"])
    assert all(p.grad is not None for p in agent.parameters()) and all(v.isfinite() for v in stats.values())


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def actor_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("actor-")]


def cue_args(**overrides):
    # gamma 0.9: the cue task is a contextual bandit whose frames do not show the time left in the episode, so with
    # 0.999 the value targets mostly carry that unobservable remaining return, pure noise in V-trace's advantages
    # (PPO's advantage normalization hides it). max_policy_lag 1 is below the lag of 2 that a busy 2-core learner
    # sees, so dropping is exercised there.
    base = dict(env_id="coinrun", num_actors=2, envs_per_actor=8, unroll_length=8, batch_size=16,
                updates_per_iteration=10, total_timesteps=12800, max_policy_lag=1, channels=(8,), hidden_size=32,
                learning_rate=2e-3, gamma=0.9, eval_every=0, eval_episodes=16)
    return vtrace.Args(**{**base, **overrides})


def test_actor_learner_learns_the_cue_task_with_bounded_lag(cue_env, in_tmp):
    """Two actor threads and the learner on the pixel cue task: random play earns 8/15 ~ 0.53 per episode, a solved
    task 8. Every unroll trained on is at most --max-policy-lag updates old, and some are older than 0."""
    cue_env(vtrace)
    args = cue_args()
    rows = read_rows(vtrace.train(args))
    assert not actor_threads()
    iterations = [r for r in rows if "losses/policy_loss" in r]
    assert [r["iteration"] for r in iterations] == list(range(1, 11))  # 10 iterations of 10 x 16 x 8 steps
    assert all(set(r) == ITERATION_KEYS | lag_keys(args.max_policy_lag) for r in iterations)
    counts = np.array([[r[f"policy_lag/count_{k}"] for k in range(args.max_policy_lag + 1)] for r in iterations])
    assert (counts.sum(1) == args.updates_per_iteration * args.batch_size).all()  # every unroll trained on, counted
    assert all(0 <= r["policy_lag/mean"] <= r["policy_lag/max"] <= args.max_policy_lag for r in iterations)
    assert counts[:, 1:].sum() > 0  # real asynchrony: the learner moved on while actors played
    train_returns = [r["charts/episodic_return"] for r in iterations if r["charts/episodic_return"] is not None]
    assert np.mean(train_returns[:1]) < 2.5
    assert set(rows[-1]) == EVAL_KEYS and rows[-1]["eval/episodic_return"] > 4.0, rows[-1]


@pytest.mark.parametrize("where", ["actor", "learner", "second_ctrl_c", "nonfinite"])
def test_errors_and_interrupts_stop_every_actor(where, cue_env, in_tmp, monkeypatch):
    """An actor's exception stops the run with its message; Ctrl-C in the learner finishes the iteration and saves a
    checkpoint; a second Ctrl-C stops at once; a non-finite loss saves the last finite weights; none of them leaves a
    thread behind or hangs."""
    cue_env(vtrace)
    calls, collect_unroll, vtrace_backward, vtrace_loss = [], vtrace.collect_unroll, vtrace.vtrace_backward, \
        vtrace.vtrace_loss

    def failing_actor(*arguments):
        calls.append(1)
        if len(calls) == 5:
            raise ValueError("boom in an actor")
        return collect_unroll(*arguments)

    def interrupted_learner(*arguments):
        calls.append(1)
        if len(calls) == 13:  # in iteration 2, after iteration 1 was logged
            if where == "learner":
                os.kill(os.getpid(), signal.SIGINT)  # a real first Ctrl-C: the iteration finishes, then it stops
            else:
                raise KeyboardInterrupt  # what the second Ctrl-C raises
        return vtrace_backward(*arguments)

    monkeypatch.setattr(vtrace, *{
        "actor": ("collect_unroll", failing_actor), "learner": ("vtrace_backward", interrupted_learner),
        "second_ctrl_c": ("vtrace_backward", interrupted_learner),
        "nonfinite": ("vtrace_loss", lambda *a, **k: tuple(x * float("nan") for x in vtrace_loss(*a, **k)))}[where])
    expected = {"actor": pytest.raises(ValueError, match="boom in an actor"),
                "learner": pytest.raises(SystemExit, match="130"), "second_ctrl_c": pytest.raises(KeyboardInterrupt),
                "nonfinite": pytest.raises(SystemExit, match="non-finite loss .* after iteration 0; the weights before")}
    start = time.time()
    with expected[where]:
        vtrace.train(cue_args(updates_per_iteration=10, total_timesteps=10 * 1280))
    assert time.time() - start < 30 and not actor_threads()
    if where in ("actor", "second_ctrl_c"):
        assert not glob.glob("runs/*/checkpoint*.pt")  # nothing half done was saved
    else:
        (path,) = glob.glob("runs/*/checkpoint*.pt")
        saved = torch.load(path, weights_only=False)
        assert saved["iteration"] == (2 if where == "learner" else 0)
        assert all(torch.isfinite(p).all() for p in saved["agent"].values())


def run_script(*flags, timeout=120):
    return subprocess.run([sys.executable, os.path.join(ROOT, "vtrace.py"), *flags], capture_output=True, text=True,
                          timeout=timeout)


TINY = ["--env-id", "starpilot", "--num-actors", "2", "--envs-per-actor", "2", "--unroll-length", "8",
        "--batch-size", "4", "--updates-per-iteration", "2", "--max-policy-lag", "3", "--channels", "4",
        "--hidden-size", "16", "--eval-episodes", "2", "--eval-every", "0"]


def test_end_to_end_interrupt_resume_and_eval_only(in_tmp):
    """Real Procgen: metrics and checkpoints; Ctrl-C exits at once and saves; --resume finishes the same total;
    --eval-only loads and films."""
    total = 64 * 60  # 60 iterations of 2 updates x 4 unrolls x 8 steps
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "vtrace.py"), *TINY, "--total-timesteps",
                                str(total), "--save-model", "--save-every", "1"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not glob.glob("runs/*/checkpoint.pt"):
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.2)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    interrupted = time.time()
    output = process.communicate(timeout=30)[0]
    assert time.time() - interrupted < 10  # the process (and with it every actor thread) is gone
    assert process.returncode != 0 and "interrupted: saved iteration" in output, output
    (run,) = os.listdir("runs")
    path = os.path.join("runs", run, "checkpoint.pt")
    saved = torch.load(path, weights_only=False)
    assert 1 <= saved["iteration"] < 60 and saved["global_step"] == saved["iteration"] * 64
    assert set(saved) >= {"agent", "optimizer", "reward_rms", "rng", "args", "global_step", "iteration"}
    assert len(saved["reward_rms"]) == 2  # one reward normalizer per actor

    result = run_script("--resume", path, "--eval-episodes", "2")
    assert result.returncode == 0, result.stderr
    assert f"resuming {run} at iteration {saved['iteration'] + 1}" in result.stdout
    rows = read_rows(os.path.join("runs", run))
    iterations = [r for r in rows if "losses/policy_loss" in r]
    assert [r["iteration"] for r in iterations] == list(range(1, 61))  # every iteration exactly once
    assert iterations[-1]["global_step"] == total
    assert all(set(r) == ITERATION_KEYS | lag_keys(3) for r in iterations)
    assert all(r["policy_lag/max"] <= 3 for r in iterations)
    assert set(rows[-1]) == EVAL_KEYS and rows[-1]["global_step"] == total
    assert torch.load(path, weights_only=False)["iteration"] == 60

    result = run_script("--eval-only", "--checkpoint", path, "--eval-episodes", "3", "--capture-video")
    assert result.returncode == 0, result.stderr
    assert "eval @ 3,840 steps: return" in result.stdout and "over 3 episodes" in result.stdout
    (video,) = glob.glob("runs/*/videos/*.mp4")
    assert os.path.getsize(video) > 1000


@pytest.mark.parametrize("flags,message", [
    (["--env-id", "pong"], "--env-id 'pong' is not a Procgen game"),
    (["--batch-size", "30"], "--batch-size 30 must be a multiple of --envs-per-actor 16"),
    (["--num-actors", "0"], "--num-actors 0 must be > 0"),
    (["--max-policy-lag", "-1"], "--max-policy-lag -1 must be >= 0"),
    (["--total-timesteps", "1000"], "--total-timesteps 1000 is less than one iteration"),
    (["--vtrace-lambda", "1.5"], "--vtrace-lambda 1.5 in [0, 1]"),
    (["--eval-only"], "--eval-only needs --checkpoint PATH"),
])
def test_bad_flags_fail_with_one_line(flags, message):
    import tyro
    with pytest.raises(SystemExit) as error:
        vtrace.check_args(tyro.cli(vtrace.Args, args=flags))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_flag_on_the_command_line_fails_at_once(in_tmp):
    result = run_script("--batch-size", "30", timeout=60)
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        "error: --batch-size 30 must be a multiple of --envs-per-actor 16 (an actor hands over the unrolls of all its "
        "games at once); try --batch-size 32"]
    assert not os.path.exists("runs")
