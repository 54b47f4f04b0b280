"""vtrace.py's actor-learner: index alignment of an unroll, the learner's use of it (V-trace, or no correction), the
parameter hand-over between actor and learner, learning with a throttled lag, reproducible runs with a deterministic
lag, consistent checkpoints, clean stops (actor errors, Ctrl-C, NaN; a signal inside an iteration saves the last
whole one), and the CLI end to end on Procgen. The V-trace
math is in test_vtrace.py."""
import contextlib
import glob
import json
import os
import random
import signal
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

import fault_driver
import forked_run
import vtrace

# Columns of every per-iteration row of metrics.jsonl (documented in vtrace.py's train), for --max-policy-lag K.
ITERATION_KEYS = {
    "global_step", "iteration", "time", "charts/SPS", "charts/learning_rate", "charts/episodes",
    "charts/episodic_return", "charts/episodic_length", "charts/episodic_return_last100", "losses/policy_loss",
    "losses/value_loss", "losses/entropy", "losses/approx_kl", "losses/explained_variance", "policy_lag/mean",
    "policy_lag/max", "time/wait", "time/learn", "time/actor_wait", "time/actor_play", "perf/gpu_memory_gb"}
lag_keys = lambda max_lag: {f"policy_lag/count_{k}" for k in range(max_lag + 1)}  # noqa: E731
EVAL_KEYS = {"global_step", "iteration", "eval/episodic_return", "eval/normalized_score", "time/eval"}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class ChainEnv(gym.vector.VectorEnv):
    """Deterministic: game b's episodes last lengths[b] steps; the frame shows (step in episode t, game b, episode
    count) in pixel (0, 0); action a at step t earns 16 t + a, so each reward names the (state, action) it belongs to.
    SAME_STEP autoreset like ProcgenVecEnv: the last step returns done and the next episode's first frame."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, lengths):
        self.lengths = np.array(lengths)
        self.num_envs = len(lengths)
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(15)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)

    def frames(self):
        self.last_frames = np.zeros((self.num_envs, 64, 64, 3), dtype=np.uint8)
        self.last_frames[:, 0, 0] = np.stack([self.t, np.arange(self.num_envs), self.episode], 1)
        return self.last_frames.copy()

    def reset(self, *, seed=None, options=None):
        self.t = np.zeros(self.num_envs, dtype=int)
        self.episode = np.zeros(self.num_envs, dtype=int)
        return self.frames(), {}

    def step(self, actions):
        reward = 16.0 * self.t + np.asarray(actions)
        self.t += 1
        done = self.t == self.lengths
        self.t[done] = 0
        self.episode[done] += 1
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
    lengths = [3, 4, 5]
    T = 7
    envs = RecordEpisodeStatistics(ChainEnv(lengths))
    policy = TablePolicy()
    obs = torch.as_tensor(envs.reset()[0])
    first = vtrace.collect_unroll(policy, envs, obs, T)
    assert torch.equal(first["obs"][-1], torch.as_tensor(envs.env.last_frames))  # x_T: after the last action
    second = vtrace.collect_unroll(policy, envs, first["obs"][-1], T)
    assert torch.equal(second["obs"][0], first["obs"][-1])
    assert first["obs"].shape == (T + 1, 3, 64, 64, 3) and first["behaviour_logits"].shape == (T, 3, 15)
    assert first["actions"].shape == first["rewards"].shape == first["dones"].shape == (T, 3)

    running = np.zeros(3)
    expected_returns = []
    for unroll in (first, second):
        state = unroll["obs"][:, :, 0, 0].long()  # [T+1, B, (t, game, episode)]
        t = state[:-1, :, 0]
        actions = unroll["actions"]
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
        # RecordEpisodeStatistics agrees: each episode's (return, length), in the order they ended
        assert [r for r, _ in unroll["episodes"]] == pytest.approx(episode_returns)
        assert [length for _, length in unroll["episodes"]] == [
            lengths[game] for step in range(T) for game in np.flatnonzero(unroll["dones"][step].numpy())]
        expected_returns += episode_returns
    assert len(expected_returns) == 4 + 3 + 2  # 14 steps in games whose episodes last 3, 4 and 5 steps


def test_actor_samples_with_its_own_generator():
    """The actor's sampling reads only its generator: the global RNG (which evaluation uses) does not move it."""
    envs = ChainEnv([3, 4])
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        unroll = vtrace.collect_unroll(TablePolicy(), envs, torch.as_tensor(envs.reset()[0]), 6,
                                       generator=torch.Generator().manual_seed(7))
        runs.append(unroll["actions"])
    assert torch.equal(runs[0], runs[1])


def learner_batch(args):
    """A batch as the actor hands it over, played by a fixed policy mu that is not the agent's."""
    torch.manual_seed(0)
    agent = vtrace.Agent(args, num_actions=15)
    envs = ChainEnv([2, 3, 4, 5])
    unroll = vtrace.collect_unroll(TablePolicy(), envs, torch.as_tensor(envs.reset()[0]), 6)
    return agent, unroll


def test_learner_feeds_vtrace_the_aligned_batch(monkeypatch):
    """vtrace_backward pairs pi's logits and values on x_0..x_{T-1} with log rho = log pi(a_t) - log mu(a_t),
    r_t and gamma_t = gamma (1 - done_t), and bootstraps from the learner's V(x_T)."""
    args = vtrace.Args(channels=(4,), hidden_size=16, gamma=0.9)
    agent, unroll = learner_batch(args)
    seen = {}

    def spy(*arguments):
        seen.update(zip(["log_rhos", "discounts", "rewards", "values", "bootstrap"], arguments))
        return from_importance_weights(*arguments)

    from_importance_weights = vtrace.from_importance_weights
    monkeypatch.setattr(vtrace, "from_importance_weights", spy)
    stats = vtrace.vtrace_backward(agent, torch.optim.Adam(agent.parameters()), unroll, args, contextlib.nullcontext)
    with torch.no_grad():
        logits, values = zip(*(agent(frames) for frames in unroll["obs"]))
    log_pi = torch.log_softmax(torch.stack(logits[:-1]), -1).gather(-1, unroll["actions"].unsqueeze(-1)).squeeze(-1)
    log_mu = torch.log_softmax(unroll["behaviour_logits"], -1).gather(-1, unroll["actions"].unsqueeze(-1)).squeeze(-1)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["log_rhos"], log_pi - log_mu, **close)
    assert seen["log_rhos"].abs().min() > 0.01  # off-policy: mu is not pi
    torch.testing.assert_close(seen["values"], torch.stack(values[:-1]), **close)
    torch.testing.assert_close(seen["bootstrap"], values[-1], **close)  # V(x_T) from the learner's network
    torch.testing.assert_close(seen["discounts"], 0.9 * (1 - unroll["dones"]), rtol=0, atol=0)
    assert seen["discounts"].min() == 0  # episodes do end inside this unroll
    assert torch.equal(seen["rewards"], unroll["rewards"])
    assert all(p.grad is not None for p in agent.parameters()) and all(v.isfinite() for v in stats.values())


def on_policy_actor_critic_loss(agent, batch, args):
    """The on-policy actor-critic (A2C) loss written from its definition, independently of vtrace.py: n-step returns
    G_s = sum_{t>=s} (prod_{i<t} gamma_i) r_t + (prod gamma_i) V(x_T) by a double loop, advantages
    r_s + gamma_s G_{s+1} - V(x_s) (G_T = V(x_T)), means over T x B, targets and advantages held constant."""
    T, B = batch["actions"].shape
    logits, values = agent(batch["obs"].flatten(0, 1))
    logits = logits.view(T + 1, B, -1)
    values = values.view(T + 1, B)
    discounts = (args.gamma * (1 - batch["dones"])).double()
    rewards = batch["rewards"].double()
    bootstrap = values[-1].detach().double()
    returns = torch.zeros(T + 1, B, dtype=torch.float64)
    returns[T] = bootstrap
    for s in range(T):
        for t in range(s, T):
            returns[s] += torch.prod(discounts[s:t], dim=0) * rewards[t]
        returns[s] += torch.prod(discounts[s:T], dim=0) * bootstrap
    advantages = (rewards + discounts * returns[1:] - values[:-1].detach().double()).float()
    log_probs = torch.log_softmax(logits[:-1], -1)
    chosen = log_probs.gather(-1, batch["actions"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return ((-chosen * advantages).mean() + args.baseline_cost * 0.5 * ((returns[:-1].float() - values[:-1]) ** 2)
            .mean() - args.entropy_cost * entropy.mean())


def test_correction_none_is_the_on_policy_actor_critic_loss():
    """--correction none: importance weights fixed to 1, so the learner's gradient is the on-policy actor-critic's
    on the same (off-policy) batch; with V-trace it is not."""
    gradients = {}
    for correction in ("none", "vtrace"):
        args = vtrace.Args(channels=(4,), hidden_size=16, gamma=0.9, max_grad_norm=float("inf"),
                           correction=correction)
        agent, unroll = learner_batch(args)
        vtrace.vtrace_backward(agent, torch.optim.Adam(agent.parameters()), unroll, args, contextlib.nullcontext)
        gradients[correction] = [p.grad.clone() for p in agent.parameters()]
    agent, unroll = learner_batch(args)
    on_policy_actor_critic_loss(agent, unroll, args).backward()
    for got, want in zip(gradients["none"], [p.grad for p in agent.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert max((v - n).abs().max() for v, n in zip(gradients["vtrace"], gradients["none"])) > 1e-3


def hand_over(device, k, exact, num_updates=30):
    """train's protocol, with a linear layer for the network: the learner publishes version u + 1 after taking
    unroll u; the actor loads at least (or exactly) version max(n - k, 0) before "playing" unroll n. Random sleeps
    shuffle the two threads' timing. Returns (unroll, version used, weight the actor's network had) triples."""
    learner = nn.Linear(3, 2).to(device)
    actor_network = nn.Linear(3, 2).to(device)
    snapshots = vtrace.PolicySnapshots(keep=k + 1 if exact else 1)
    with torch.no_grad():
        learner.weight.fill_(0.0)
    snapshots.publish(0, learner.parameters(), device)
    handed = []
    played = []
    stop = threading.Event()
    rng = random.Random(k)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def actor():
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for n in range(num_updates):
                version = snapshots.load_into(actor_network, max(n - k, 0), exact, stop)
                played.append((n, version, actor_network.weight.detach().clone()))
                time.sleep(rng.uniform(0, 0.002))
                handed.append(vtrace.stream_event(device))

    thread = threading.Thread(target=actor)
    thread.start()
    deadline = time.time() + 20
    for update in range(num_updates):
        while len(handed) <= update:  # the learner waits for unroll `update`
            assert time.time() < deadline and thread.is_alive()
            time.sleep(0.0005)
        vtrace.wait_for(handed[update], [])
        time.sleep(rng.uniform(0, 0.002))
        with torch.no_grad():
            learner.weight.fill_(update + 1.0)  # version v has every weight equal to v
        snapshots.publish(update + 1, learner.parameters(), device)
    thread.join(timeout=10)
    assert not thread.is_alive()
    if device.type == "cuda":
        torch.cuda.synchronize()  # the actor's stream has written `played`
    return [(n, version, weight.cpu()) for n, version, weight in played]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_policy_snapshots_hand_over_whole_versions(device, k):
    """The actor's network holds exactly the version it was given, whole; with --deterministic-lag it is
    max(n - k, 0) for unroll n, otherwise the newest available, never older than n - k (k = 0: synchronous)."""
    for exact in (True, False):
        played = hand_over(torch.device(device), k, exact)
        assert [n for n, _, _ in played] == list(range(30))
        for n, version, weight in played:
            assert torch.equal(weight, torch.full_like(weight, float(version)))  # one whole version, not a mix
            if exact:
                assert version == max(n - k, 0)
            else:
                assert max(n - k, 0) <= version <= n


def test_policy_snapshots_are_copies_and_stop_ends_a_wait():
    network = nn.Linear(3, 2)
    target = nn.Linear(3, 2)
    snapshots = vtrace.PolicySnapshots(keep=2)
    published = network.weight.detach().clone()
    snapshots.publish(0, network.parameters(), torch.device("cpu"))
    with torch.no_grad():
        network.weight.add_(1.0)  # the learner moves on: the snapshot does not
    assert snapshots.load_into(target, 0, True, threading.Event()) == 0
    assert torch.equal(target.weight, published)
    for version in (1, 2, 3):
        snapshots.publish(version, network.parameters(), torch.device("cpu"))
    assert sorted(snapshots.versions) == [2, 3]  # keep = 2
    assert snapshots.load_into(target, 1, False, threading.Event()) == 3  # the newest at least as new as asked
    with pytest.raises(RuntimeError, match="version 1 were dropped"):
        snapshots.load_into(target, 1, True, threading.Event())
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    start = time.time()
    assert snapshots.load_into(target, 9, False, stop) is None  # waited for a version that never came
    assert 0.15 < time.time() - start < 2


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def load_saved(path):
    """A checkpoint file, loaded as the scripts load it: tensors and plain data only (weights_only=True)."""
    return torch.load(path, weights_only=True)


def actor_threads():
    return [thread for thread in threading.enumerate() if thread.name == "actor"]


def cue_args(**overrides):
    # gamma 0.9: the cue task is a contextual bandit whose frames do not show the time left in the episode, so with
    # 0.999 the value targets mostly carry that unobservable remaining return, pure noise in V-trace's advantages
    # (PPO's advantage normalization hides it).
    base = dict(env_id="coinrun", num_envs=16, unroll_length=8, updates_per_iteration=10, total_timesteps=10240,
                max_policy_lag=1, channels=(8,), hidden_size=32, learning_rate=2e-3, gamma=0.9, eval_every=0,
                eval_episodes=16)
    return vtrace.Args(**{**base, **overrides})


def count_unrolls(monkeypatch):
    """Count the unrolls the actor plays."""
    played = []
    collect_unroll = vtrace.collect_unroll

    def counting(*arguments):
        played.append(1)
        return collect_unroll(*arguments)
    monkeypatch.setattr(vtrace, "collect_unroll", counting)
    return played


def test_actor_learner_learns_the_cue_task_with_a_throttled_lag(cue_env, in_tmp, monkeypatch):
    """The actor thread and the learner on the pixel cue task, --max-policy-lag 1: random play earns 8/15 ~ 0.53 per
    episode, a solved task 8. No unroll trains more than 1 update old, some are 1 old (acting and learning overlapped),
    and none is dropped: the actor played only the unrolls trained on, plus at most k + 1 in flight at the end."""
    cue_env(vtrace)
    played = count_unrolls(monkeypatch)
    args = cue_args()
    rows = read_rows(vtrace.train(args))
    assert not actor_threads()
    iterations = [r for r in rows if "losses/policy_loss" in r]
    assert [r["iteration"] for r in iterations] == list(range(1, 9))  # 8 iterations of 10 x 16 x 8 steps
    assert all(set(r) == ITERATION_KEYS | lag_keys(args.max_policy_lag) for r in iterations)
    counts = np.array([[r[f"policy_lag/count_{k}"] for k in range(args.max_policy_lag + 1)] for r in iterations])
    assert (counts.sum(1) == args.updates_per_iteration).all()  # every update counted, at lag 0 or 1
    assert all(0 <= r["policy_lag/mean"] <= r["policy_lag/max"] <= args.max_policy_lag for r in iterations)
    assert counts[:, 1].sum() > 0  # real overlap: the actor played while the learner learned
    assert 80 <= len(played) <= 80 + args.max_policy_lag + 1
    train_returns = [r["charts/episodic_return"] for r in iterations if r["charts/episodic_return"] is not None]
    assert np.mean(train_returns[:1]) < 2.5
    assert set(rows[-1]) == EVAL_KEYS and rows[-1]["eval/episodic_return"] > 4.0, rows[-1]


def test_deterministic_lag_gives_identical_runs(cue_env, in_tmp):
    """--deterministic-lag 4: unroll n is played with parameters of version max(n - 4, 0), so two runs with the same
    seed log the same losses, returns, lags and evaluations on CPU (only timings differ); another seed does not."""
    cue_env(vtrace)
    timing = lambda row: {k: v for k, v in row.items() if k.startswith("time") or k == "charts/SPS"}  # noqa: E731
    runs = []
    for seed in (1, 1, 2):
        args = cue_args(num_envs=8, max_policy_lag=4, deterministic_lag=True, total_timesteps=2 * 640, eval_every=1,
                        seed=seed)
        rows = read_rows(vtrace.train(args))
        runs.append([{k: v for k, v in row.items() if k not in timing(row)} for row in rows])
    assert len(runs[0]) == 4 and runs[0] == runs[1]
    assert runs[0] != runs[2]
    iterations = [r for r in runs[0] if "losses/policy_loss" in r]
    assert [r["policy_lag/count_4"] for r in iterations] == [6, 10]  # lags 0, 1, 2, 3, then always 4
    assert [iterations[0][f"policy_lag/count_{k}"] for k in range(4)] == [1, 1, 1, 1]


@pytest.mark.parametrize("where", ["actor", "learner", "second_ctrl_c", "nonfinite"])
def test_errors_and_interrupts_stop_the_actor(where, cue_env, in_tmp, monkeypatch, capsys):
    """An actor's exception stops the run with its message; Ctrl-C in the learner finishes that update, starts no
    other and saves the last whole iteration, whose reward normalizer is the one after its last unroll (while the
    actor is already playing further); a second Ctrl-C stops at once; a non-finite loss stops the run with one line
    before its step, the last checkpoint intact; none of them leaves a thread behind or hangs."""
    cue_env(vtrace)
    calls = []
    weights_before = []
    collect_unroll = vtrace.collect_unroll
    vtrace_backward = vtrace.vtrace_backward
    vtrace_loss = vtrace.vtrace_loss

    def failing_actor(*arguments):
        calls.append(1)
        if len(calls) == 5:
            raise ValueError("boom in an actor")
        return collect_unroll(*arguments)

    def interrupted_learner(*arguments):
        calls.append(1)
        if len(calls) == 13:  # in iteration 2, after iteration 1 was logged
            os.kill(os.getpid(), signal.SIGINT)  # a real first Ctrl-C: the update finishes, then it stops
            if where == "second_ctrl_c":
                time.sleep(2.1)  # a second one (within 2 s it would count as torchrun's copy of the first)
                os.kill(os.getpid(), signal.SIGINT)
        return vtrace_backward(*arguments)

    def watched_learner(policy, *arguments):
        weights_before.append({k: v.clone() for k, v in policy.state_dict().items()})
        return vtrace_backward(policy, *arguments)

    def nonfinite_loss(*arguments, **keywords):  # the 13th update's loss is NaN
        calls.append(1)
        return tuple(x * (float("nan") if len(calls) == 13 else 1.0) for x in vtrace_loss(*arguments, **keywords))

    if where == "nonfinite":
        monkeypatch.setattr(vtrace, "vtrace_backward", watched_learner)
    monkeypatch.setattr(vtrace, *{
        "actor": ("collect_unroll", failing_actor), "learner": ("vtrace_backward", interrupted_learner),
        "second_ctrl_c": ("vtrace_backward", interrupted_learner), "nonfinite": ("vtrace_loss", nonfinite_loss)}[where])
    expected = {"actor": pytest.raises(ValueError, match="boom in an actor"),
                "learner": pytest.raises(SystemExit, match="130"), "second_ctrl_c": pytest.raises(SystemExit, match="130"),
                "nonfinite": pytest.raises(SystemExit, match=r"^error: non-finite loss nan or gradient; the last "
                                           r"checkpoint is iteration 1 in runs/.*/checkpoint.pt \(continue with")}
    args = cue_args(max_policy_lag=2, save_model=where == "nonfinite", save_every=1)
    start = time.time()
    with expected[where] as raised:
        vtrace.train(args)
    assert time.time() - start < 30 and not actor_threads()
    said = {"learner": "interrupted by SIGINT: saved iteration 1 to runs/",
            "second_ctrl_c": "stopped at once by a second SIGINT: no checkpoint of this run was saved"}
    assert said.get(where, "") in capsys.readouterr().out
    if where in ("actor", "second_ctrl_c"):
        assert not glob.glob("runs/*/checkpoint*.pt")  # nothing half done was saved
        return
    (path,) = glob.glob("runs/*/checkpoint*.pt")
    saved = load_saved(path)
    # iteration 1 of 10 updates, whole: update 13 is the 3rd of iteration 2, whose updates are not in it
    assert saved["iteration"] == 1 and saved["updates"] == 10 and saved["global_step"] == 10 * 128
    if where == "learner":
        assert len(calls) == 13  # the update in progress finished, none started after the signal
    else:
        assert len(str(raised.value).splitlines()) == 1 and len(weights_before) == 13
        for key, value in saved["agent"].items():
            assert torch.equal(value, weights_before[10][key])  # iteration 1's weights, untouched since
    # The normalizer after exactly the trained unrolls: it counts one return per game per step (from 1e-4).
    trained_steps = saved["updates"] * args.num_envs * args.unroll_length
    (rank_state,) = saved["ranks"]
    assert rank_state["reward_rms"][2] == pytest.approx(1e-4 + trained_steps, abs=1e-9)
    assert all(type(value) is float for value in rank_state["reward_rms"])


def signal_at_call(monkeypatch, name, at, signum=signal.SIGTERM):
    """vtrace.`name`'s `at`-th call sends this process `signum` first; returns the list of calls."""
    function, calls = getattr(vtrace, name), []

    def wrapped(*arguments, **keywords):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signum)
        return function(*arguments, **keywords)
    monkeypatch.setattr(vtrace, name, wrapped)
    return calls


def without_timing(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("time", "perf/")) and k != "charts/SPS"} for row in rows]


def test_a_signal_inside_an_iteration_saves_the_last_whole_one_and_resumes_as_a_stop_at_its_end(
        cue_env, in_tmp, monkeypatch, capsys):
    """A real SIGTERM during update 13 (the 3rd of iteration 2): that update finishes, no other starts, the run exits
    143, and its checkpoint is iteration 1's as a stop at iteration 1's end saves it, bit for bit (its 10 updates,
    steps and reward normalizer: iteration 2's updates are dropped). --resume plays iteration 2 from there: both runs
    end with the same checkpoint and the same rows, every iteration logged once and whole (--deterministic-lag: the
    same seed gives the same run)."""
    cue_env(vtrace)
    flags = dict(save_model=True, save_every=100, total_timesteps=2 * 1280, deterministic_lag=True)
    with monkeypatch.context() as patch:  # the reference: SIGTERM in iteration 1's log line, saved at its end
        signal_at_call(patch, "log_iteration", 1)
        with pytest.raises(SystemExit, match="143"):
            vtrace.train(cue_args(exp_name="clean", **flags))
    with monkeypatch.context() as patch:
        calls = signal_at_call(patch, "vtrace_backward", 13)
        with pytest.raises(SystemExit, match="143"):
            vtrace.train(cue_args(exp_name="stopped", **flags))
    assert len(calls) == 13 and not actor_threads()
    assert "interrupted by SIGTERM: saved iteration 1 to runs/" in capsys.readouterr().out
    paths = {name: glob.glob(f"runs/*__{name}__*/checkpoint.pt")[0] for name in ("clean", "stopped")}
    clean, stopped = (load_saved(paths[name]) for name in ("clean", "stopped"))
    assert stopped["iteration"] == 1 and stopped["updates"] == 10 and stopped["global_step"] == 1280
    assert stopped["ranks"][0]["reward_rms"][2] == pytest.approx(1e-4 + 1280, abs=1e-9)
    assert fault_driver.differences(clean, stopped) == []

    finished = {name: vtrace.train(vtrace.Args(resume=path)) for name, path in paths.items()}
    assert not actor_threads()
    rows = {name: read_rows(run_dir) for name, run_dir in finished.items()}
    trained = [r for r in rows["stopped"] if "losses/policy_loss" in r]
    assert [r["iteration"] for r in trained] == [1, 2] and [r["global_step"] for r in trained] == [1280, 2560]
    assert [sum(r[f"policy_lag/count_{k}"] for k in range(2)) for r in trained] == [10, 10]
    assert [r["charts/episodes"] for r in trained] == [160, 160]  # 16 games x 8-step episodes, one per update
    assert without_timing(rows["stopped"]) == without_timing(rows["clean"])
    ends = {name: load_saved(os.path.join(run_dir, "checkpoint.pt")) for name, run_dir in finished.items()}
    assert ends["stopped"]["iteration"] == 2 and ends["stopped"]["updates"] == 20
    assert fault_driver.differences(ends["stopped"], ends["clean"]) == []


def test_actor_stop_is_bounded_and_a_ctrl_c_during_it_does_not_escape(capsys):
    """`end_thread`, the actor's stop as StopOnSignal closes the run: a Ctrl-C while it waits (a third signal) neither
    escapes nor cuts the wait short (the games are closed after it); a thread that never returns is given up after
    the timeout, with one line."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        slow = threading.Thread(target=time.sleep, args=(1.0,))
        slow.start()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.time()
        vtrace.end_thread(slow, None, timeout=20)
        assert not slow.is_alive() and time.time() - start < 5
        stuck = threading.Event()
        never = threading.Thread(target=stuck.wait, daemon=True)
        never.start()
        start = time.time()
        vtrace.end_thread(never, None, timeout=0.5)
        assert 0.4 < time.time() - start < 3 and never.is_alive()
        assert "warning: the actor thread did not stop within 0.5 s" in capsys.readouterr().err
        stuck.set()
        vtrace.end_thread(threading.Thread(target=None), None)  # never started: returns at once
    finally:
        signal.signal(signal.SIGINT, previous)


def run_script(*flags, timeout=120):
    """`python vtrace.py FLAGS`, forked from a server that has imported torch (tests/forked_run.py)."""
    return forked_run.run(os.path.join(ROOT, "vtrace.py"), *flags, timeout=timeout)


TINY = ["--env-id", "starpilot", "--num-envs", "4", "--unroll-length", "8", "--updates-per-iteration", "25",
        "--max-policy-lag", "3", "--channels", "4", "--hidden-size", "16", "--eval-episodes", "2", "--eval-every", "0"]


def test_end_to_end_interrupt_resume_and_eval_only(in_tmp):
    """Real Procgen: metrics and checkpoints; SIGTERM stops at the next update (25 in an iteration), within seconds,
    and saves the last whole iteration; --resume finishes the same total; --eval-only loads and films."""
    total = 800 * 4  # 4 iterations of 25 updates x 4 unrolls x 8 steps
    process = forked_run.ForkedRun(os.path.join(ROOT, "vtrace.py"),
                                   [*TINY, "--total-timesteps", str(total), "--save-model", "--save-every", "1"],
                                   stderr_to_stdout=True)
    deadline = time.time() + 120
    while not glob.glob("runs/*/checkpoint.pt"):
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)  # into iteration 2
    process.send_signal(signal.SIGTERM)
    signalled = time.time()
    output = process.communicate(timeout=30)[0]
    assert time.time() - signalled < 10  # the process (and with it the actor thread) is gone
    assert process.returncode == 143 and "interrupted by SIGTERM: saved iteration" in output, output
    (run,) = os.listdir("runs")
    path = os.path.join("runs", run, "checkpoint.pt")
    saved = load_saved(path)
    assert 1 <= saved["iteration"] < 4 and saved["updates"] == 25 * saved["iteration"]  # whole iterations
    assert saved["global_step"] == saved["updates"] * 32
    assert set(saved) >= {"agent", "optimizer", "ranks", "args", "global_step", "iteration", "updates"}
    assert saved["ranks"][0]["reward_rms"][2] == pytest.approx(1e-4 + saved["global_step"], abs=1e-9)

    result = run_script("--resume", path, "--eval-episodes", "2")
    assert result.returncode == 0, result.stderr
    assert f"resuming {run} at iteration {saved['iteration'] + 1}" in result.stdout
    rows = read_rows(os.path.join("runs", run))
    iterations = [r for r in rows if "losses/policy_loss" in r]
    assert [r["iteration"] for r in iterations] == list(range(1, 5))  # every iteration exactly once
    assert iterations[-1]["global_step"] == total
    assert all(set(r) == ITERATION_KEYS | lag_keys(3) for r in iterations)
    assert all(r["policy_lag/max"] <= 3 for r in iterations)
    assert set(rows[-1]) == EVAL_KEYS and rows[-1]["global_step"] == total
    resumed = load_saved(path)
    assert resumed["iteration"] == 4 and resumed["updates"] == 100
    assert resumed["ranks"][0]["reward_rms"][2] == pytest.approx(1e-4 + total, abs=1e-9)  # carried over, continued

    result = run_script("--eval-only", "--checkpoint", path, "--eval-episodes", "3", "--capture-video")
    assert result.returncode == 0, result.stderr
    assert "eval @ 3,200 steps: return" in result.stdout and "over 3 episodes" in result.stdout
    (video,) = glob.glob("runs/*/videos/*.mp4")
    assert os.path.getsize(video) > 1000


@CUDA
def test_actor_and_learner_on_cuda_streams(cue_env, in_tmp):
    """On a GPU the actor plays on its own stream: a short run trains, logs finite losses and stops cleanly."""
    cue_env(vtrace)
    rows = read_rows(vtrace.train(cue_args(total_timesteps=2 * 1280, cuda=True)))
    iterations = [r for r in rows if "losses/policy_loss" in r]
    assert len(iterations) == 2 and all(np.isfinite(r["losses/policy_loss"]) for r in iterations)
    assert iterations[0]["perf/gpu_memory_gb"] > 0 and not actor_threads()


# The CUDA hand-overs with their race windows widened: torch.cuda._sleep keeps one stream busy (~0.1 s at ~2 GHz)
# while the other goes on, so a missing wait_event (the consumer reads before the producer wrote) or record_stream
# (the allocator hands a tensor's memory to the producer again while the consumer's reads are still queued) shows as
# wrong values, not as a rare flake.
SLEEP_CYCLES = 200_000_000


def snapshot_values(network):
    return [parameter.detach().clone() for parameter in network.parameters()]


def filled(network, value):
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.fill_(value)
    return network


@CUDA
def test_cuda_snapshot_hand_over_waits_for_the_learners_copies():
    """publish() copies the parameters on the learner's stream while it is still busy; the actor's stream must wait
    for those copies (wait_event) before it loads them."""
    device = torch.device("cuda")
    learner = filled(nn.Linear(256, 256).to(device), 7.25)
    actor_network = filled(nn.Linear(256, 256).to(device), 0.0)
    snapshots = vtrace.PolicySnapshots(keep=1)
    actor_stream = torch.cuda.Stream(device)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the learner's stream: the copies below run ~0.1 s from now
    snapshots.publish(1, learner.parameters(), device)
    with torch.cuda.stream(actor_stream):
        assert snapshots.load_into(actor_network, 1, True, threading.Event()) == 1
        loaded = snapshot_values(actor_network)
    torch.cuda.synchronize()
    assert all(torch.equal(value, torch.full_like(value, 7.25)) for value in loaded)


@CUDA
def test_cuda_snapshot_memory_is_not_reused_while_the_actor_copies():
    """The actor's stream is busy when it queues its copy of version 1; the learner then publishes versions 2 and 3,
    which drops version 1 on the host. record_stream keeps version 1's memory from version 3's copies until the
    actor's stream has read it."""
    device = torch.device("cuda")
    learner = filled(nn.Linear(256, 256).to(device), 1.0)
    actor_network = filled(nn.Linear(256, 256).to(device), 0.0)
    snapshots = vtrace.PolicySnapshots(keep=1)
    actor_stream = torch.cuda.Stream(device)
    snapshots.publish(1, learner.parameters(), device)
    torch.cuda.synchronize()
    with torch.cuda.stream(actor_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the actor's copy of version 1 runs ~0.1 s from now
        assert snapshots.load_into(actor_network, 1, True, threading.Event()) == 1
    for version in (2, 3):  # on the idle learner's stream: these copies run at once
        snapshots.publish(version, filled(learner, float(version)).parameters(), device)
    torch.cuda.synchronize()
    assert sorted(snapshots.versions) == [3]
    assert all(torch.equal(value, torch.ones_like(value)) for value in snapshot_values(actor_network))


def cuda_actor():
    """An Actor on the GPU that is never started: its stream and its queue, for the unroll hand-over."""
    device = torch.device("cuda")
    return vtrace.Actor(nn.Linear(2, 2).to(device), None, vtrace.PolicySnapshots(keep=1), cue_args(),
                        first_version=0, seed=0)


def hand_over_unroll(actor, busy):
    """The actor's end of the queue as `Actor.play` uses it: tensors written on its stream (after a sleep if `busy`),
    the event after them, the unroll into the queue, no reference kept. Returns what each tensor holds."""
    values = {key: float(index + 1) for index, key in enumerate(vtrace.UNROLL_TENSORS)}
    with torch.cuda.stream(actor.stream):
        if busy:
            torch.cuda._sleep(SLEEP_CYCLES)
        unroll = {key: torch.full((21, 32, 64), value, device=actor.device) for key, value in values.items()}
        unroll["ready"] = vtrace.stream_event(actor.device)
    actor.unrolls.put(unroll)
    return values


@CUDA
def test_cuda_unroll_hand_over_waits_for_the_actors_stream():
    """The learner's stream must wait for the actor's (wait_event) before it reads an unroll the actor's stream is
    still writing."""
    actor = cuda_actor()
    values = hand_over_unroll(actor, busy=True)
    unroll = actor.next_unroll()  # on the learner's (default) stream
    read = {key: unroll[key].clone() for key in values}
    torch.cuda.synchronize()
    assert all(torch.equal(read[key], torch.full_like(read[key], value)) for key, value in values.items())


@CUDA
def test_cuda_unroll_memory_is_not_reused_while_the_learner_reads():
    """The learner's stream is busy when it queues its reads of an unroll and then drops the unroll; the actor's next
    tensors (same sizes, its stream idle) must not get that memory before the reads ran (record_stream)."""
    actor = cuda_actor()
    values = hand_over_unroll(actor, busy=False)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the learner's stream: its reads run ~0.1 s from now
    unroll = actor.next_unroll()
    read = {key: unroll[key].clone() for key in values}
    del unroll  # the learner is done with it (on the host)
    with torch.cuda.stream(actor.stream):  # the actor plays on into fresh tensors, at once
        played_on = [torch.full((21, 32, 64), -1.0, device=actor.device) for _ in values]
    torch.cuda.synchronize()
    assert all(torch.equal(read[key], torch.full_like(read[key], value)) for key, value in values.items())
    assert all(bool((tensor == -1).all()) for tensor in played_on)


@CUDA
def test_cuda_actor_thread_keeps_its_device_and_its_stream_is_waited_for():
    """The actor's thread sets its device before it enters its stream (a new thread starts on GPU 0; under torchrun
    a rank's actor would switch there on leaving the stream), and `end_thread` waits for the work it queued."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    stream = torch.cuda.Stream(device)
    devices = []

    def actor():
        with vtrace.on_stream(stream):
            devices.append(torch.cuda.current_device())
            torch.cuda._sleep(SLEEP_CYCLES)  # still queued when the thread returns
        devices.append(torch.cuda.current_device())

    thread = threading.Thread(target=actor)
    thread.start()
    vtrace.end_thread(thread, stream)
    assert not thread.is_alive() and stream.query()  # the stream's sleep is over when end_thread returns
    assert devices == [device.index, device.index]


@pytest.mark.parametrize("flags,message", [
    (["--env-id", "pong"], "--env-id 'pong' is not a Procgen game"),
    (["--num-envs", "0"], "--num-envs 0 must be > 0"),
    (["--max-policy-lag", "-1"], "--max-policy-lag -1 must be >= 0"),
    (["--total-timesteps", "1000"], "--total-timesteps 1000 is less than one iteration"),
    (["--vtrace-lambda", "1.5"], "--vtrace-lambda 1.5 must be in [0, 1]"),
    (["--eval-only"], "--eval-only needs --checkpoint PATH"),
])
def test_bad_flags_fail_with_one_line(flags, message):
    import tyro
    with pytest.raises(SystemExit) as error:  # start_run checks the files named, then check_args the flags
        vtrace.start_run(tyro.cli(vtrace.Args, args=flags))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_rho_bar_below_c_bar_warns(capsys):
    vtrace.check_args(vtrace.Args(rho_bar=1.0, c_bar=1.0))
    assert capsys.readouterr().err == ""
    vtrace.check_args(vtrace.Args(rho_bar=0.5, c_bar=1.0))
    assert capsys.readouterr().err == ("warning: --rho-bar 0.5 < --c-bar 1.0: V-trace's analysis (IMPALA paper, "
                                       "Appendix A) assumes rho-bar >= c-bar\n")


def test_bad_flag_on_the_command_line_fails_at_once(in_tmp):
    result = run_script("--num-envs", "8", "--total-timesteps", "100", timeout=60)
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        "error: --total-timesteps 100 is less than one iteration (updates_per_iteration * num_envs * unroll_length "
        "= 4000)"]
    assert not os.path.exists("runs")
