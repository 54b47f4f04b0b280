"""ppo_procgen.py: GAE against its definition, the Procgen adapter, the PPO loss, learning, and the CLI end to end."""
import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import ROOT, cpu_has_bfloat16_instructions
from gymnasium.vector import AutoresetMode

import exercises.references
import forked_run
import ppo_procgen as ppo

# Columns of every per-iteration row of runs/<run>/metrics.jsonl (documented in docs/ppo.md).
ITERATION_KEYS = {
    "global_step", "iteration", "time", "charts/SPS", "charts/learning_rate", "charts/episodes",
    "charts/episodic_return", "charts/episodic_length", "charts/episodic_return_last100", "losses/policy_loss",
    "losses/value_loss", "losses/entropy", "losses/old_approx_kl", "losses/approx_kl", "losses/clipfrac",
    "losses/explained_variance", "losses/kl", "losses/kl_beta", "time/rollout", "time/env", "time/update",
    "perf/gpu_memory_gb"}
EVAL_KEYS = {"global_step", "iteration", "eval/episodic_return", "eval/normalized_score", "time/eval"}
TINY = ["--env-id", "starpilot", "--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2",
        "--update-epochs", "1", "--channels", "4", "--hidden-size", "16", "--eval-episodes", "2", "--eval-every", "0",
        "--torch-threads", "1"]  # a runtime flag: a resume or an evaluation is given it again


def naive_gae(rewards, values, dones, next_value, next_done, gamma, lam):
    """The definition, A_t = sum_{k>=t} (gamma*lam)^(k-t) delta_k summed until the episode ends: the graders' float64
    loop (exercises/references.py), one copy for both."""
    return exercises.references.gae(rewards, values, dones, next_value, next_done, gamma, lam)[0]


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.999, 1.0), (0.9, 0.0)])
def test_gae_matches_naive_definition(gamma, lam):
    rng = np.random.default_rng(0)
    T, N = 17, 5
    rewards, values = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    dones = (rng.random((T, N)) < 0.2).astype(float)
    dones[0] = 0
    next_value, next_done = rng.normal(size=N), np.array([0, 1, 0, 1, 0], dtype=float)
    assert dones[1:].sum() > 3  # episode ends inside the rollout
    expected = naive_gae(rewards, values, dones, next_value, next_done, gamma, lam)
    got = ppo.compute_gae(*(torch.tensor(x) for x in (rewards, values, dones, next_value, next_done)), gamma, lam)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-10)


def test_invalid_env_name_is_an_error_not_an_abort():
    with pytest.raises(ValueError, match="unknown Procgen game 'notagame'"):
        ppo.ProcgenVecEnv(1, "notagame")
    with pytest.raises(SystemExit, match="--env-id 'notagame' is not a Procgen game; choose one of: bigfish"):
        ppo.check_args(ppo.Args(env_id="notagame"))


@pytest.mark.parametrize("flags,message", [
    (["--env-id", "pong"], "--env-id 'pong' is not a Procgen game"),
    (["--num-minibatches", "3"], "--num-minibatches 3 must divide the batch size 16384"),
    (["--total-timesteps", "-5"], "--total-timesteps -5 must be > 0"),
    (["--num-envs", "0"], "--num-envs 0 must be > 0"),
    (["--eval-only"], "--eval-only needs --checkpoint PATH"),
    (["--resume", "missing.pt"], "--resume missing.pt: no such file"),
])
def test_bad_flags_fail_at_once_with_one_line(flags, message, in_tmp):
    start = time.time()
    result = run_script(*flags, timeout=120)
    assert result.returncode != 0 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not os.path.exists("runs") and time.time() - start < 60


def tiny_agent(init="default"):
    args = ppo.Args(channels=(4,), hidden_size=16, init=init, num_minibatches=1, update_epochs=1)
    torch.manual_seed(0)
    return args, ppo.Agent(args, num_actions=15)


def test_glorot_init_is_baselines_tensorflow_default():
    """--init glorot: every trunk conv and the dense layer drawn from U(+-sqrt(6 / (fan_in + fan_out))) (TF's
    glorot_uniform, the fans counting the 3x3 kernel), biases 0; the heads orthogonal with std 0.01 / 1 as in
    baselines. PyTorch's default (U(+-1/sqrt(fan_in)), non-zero biases) fails every check on the large layers."""
    args = ppo.Args(init="glorot")  # the default network: 16, 32, 32 channels, 256 units
    torch.manual_seed(0)
    agent = ppo.Agent(args, num_actions=15)
    layers = [m for m in agent.trunk.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert len(layers) == 3 * 5 + 1
    for layer in layers:
        receptive = layer.weight[0, 0].numel()
        fan_in, fan_out = layer.weight.shape[1] * receptive, layer.weight.shape[0] * receptive
        limit = (6 / (fan_in + fan_out)) ** 0.5
        assert layer.weight.abs().max() <= limit and layer.weight.abs().max() > 0.95 * limit
        if layer.weight.numel() > 5000:  # the sample std of U(+-limit) is limit / sqrt(3)
            assert abs(layer.weight.std().item() / (limit / 3**0.5) - 1) < 0.05
        assert layer.bias.abs().max() == 0
    for head, std in ((agent.actor, 0.01), (agent.critic, 1.0)):
        weight = head.weight.double()
        torch.testing.assert_close(weight @ weight.T, std**2 * torch.eye(len(weight), dtype=torch.float64))
        assert head.bias.abs().max() == 0


def test_first_minibatch_has_ratio_one_and_no_clipping():
    """With the rollout's own network the first minibatch's ratio is exactly 1: no KL, nothing clipped."""
    args, agent = tiny_agent()
    obs = torch.randint(0, 256, (64, 64, 64, 3), dtype=torch.uint8)
    with torch.no_grad():
        logits, values = agent(obs)
    actions = ppo.sample_action(logits)
    log_probs = ppo.log_prob_entropy(logits, actions)[0]
    batch = dict(obs=obs, actions=actions, log_probs=log_probs, logits=logits, values=values,
                 advantages=torch.randn(64), returns=values + torch.randn(64))
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    stats = ppo.ppo_update(agent, optimizer, batch, args)
    assert stats["approx_kl"] == 0 and stats["old_approx_kl"] == 0 and stats["clipfrac"] == 0 and stats["kl"] == 0
    stats = ppo.ppo_update(agent, optimizer, batch, args)
    assert stats["approx_kl"] > 0 and stats["kl"] > 0  # the weights moved: the second pass sees a ratio != 1


def test_clipped_surrogate_on_a_hand_made_example():
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    new_log_prob = ratio.log().requires_grad_()
    kl = torch.full((5,), 123.0)  # ignored by the clipped surrogate
    pg_loss = ppo.policy_loss(new_log_prob.exp(), advantages, kl, "clip", 0.2, None)
    # -min(rA, clip(r)A) per sample: -1.2 (clipped), 1.5, -0.5, 0.8 (clipped), -2.2
    assert pg_loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8 - 2.2) / 5)
    pg_loss.backward()
    grad = new_log_prob.grad
    assert grad[0] == 0 and grad[3] == 0  # clipped samples carry no gradient
    np.testing.assert_allclose(grad[[1, 2, 4]].numpy(), [1.5 / 5, -0.5 / 5, -2.2 / 5], rtol=1e-6)


def test_kl_penalty_surrogate_and_beta_adaptation_on_hand_made_examples():
    """PPO Eq. 8: -E[r A - beta KL]; every sample keeps its gradient (no clip). Section 4's rule moves beta towards
    the target: halved when the KL is far below it, doubled when far above, unchanged within a factor 1.5."""
    ratio = torch.tensor([1.5, 0.5, 1.1], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 2.0])
    kl = torch.tensor([0.02, 0.04, 0.0], requires_grad=True)
    loss = ppo.policy_loss(ratio, advantages, kl, "kl-penalty", 0.2, 3.0)
    assert loss.item() == pytest.approx((-1.5 + 0.5 - 2.2 + 3.0 * (0.02 + 0.04)) / 3)
    loss.backward()
    np.testing.assert_allclose(ratio.grad.numpy(), -advantages.numpy() / 3, rtol=1e-6)
    np.testing.assert_allclose(kl.grad.numpy(), [1.0, 1.0, 1.0], rtol=1e-6)
    assert ppo.adapt_kl_beta(1.0, kl=0.001, target_kl=0.01) == 0.5  # policy barely moved: weaker leash
    assert ppo.adapt_kl_beta(1.0, kl=0.1, target_kl=0.01) == 2.0  # moved too far: stronger leash
    assert ppo.adapt_kl_beta(1.0, kl=0.012, target_kl=0.01) == 1.0
    assert ppo.adapt_kl_beta(1.0, kl=0.0066, target_kl=0.01) == 0.5  # the 1.5 band's edges
    assert ppo.adapt_kl_beta(1.0, kl=0.0151, target_kl=0.01) == 2.0


def test_categorical_kl_against_its_definition():
    torch.manual_seed(0)
    old_logits, logits = torch.randn(6, 15), torch.randn(6, 15) * 2
    p, q = old_logits.softmax(-1).double(), logits.softmax(-1).double()
    naive = [sum(p[s, a] * (p[s, a] / q[s, a]).log() for a in range(15)) for s in range(6)]
    np.testing.assert_allclose(ppo.categorical_kl(old_logits, logits).numpy(), torch.stack(naive).numpy(), rtol=1e-5)
    assert ppo.categorical_kl(logits, logits).abs().max() == 0


def test_clipped_value_loss_on_a_hand_made_example():
    new_value, old_value, returns = torch.tensor([1.0, 0.1, -1.0]), torch.zeros(3), torch.tensor([2.0, 0.0, 0.0])
    clipped = ppo.value_loss(new_value, old_value, returns, 0.2, True)
    unclipped = ppo.value_loss(new_value, old_value, returns, 0.2, False)
    # unclipped 0.5*mean([1, 0.01, 1]); clipped values [0.2, 0.1, -0.2] -> max with [3.24, 0.01, 0.04]
    assert unclipped.item() == pytest.approx(0.5 * (1 + 0.01 + 1) / 3)
    assert clipped.item() == pytest.approx(0.5 * (3.24 + 0.01 + 1) / 3)


def test_normalized_score_uses_the_published_ranges():
    assert ppo.normalized_score("starpilot", "easy", 34.11) == pytest.approx(0.514, abs=1e-3)
    assert ppo.normalized_score("coinrun", "easy", 9.17) == pytest.approx(0.834, abs=1e-3)
    assert ppo.normalized_score("fruitbot", "easy", 28.37) == pytest.approx(0.881, abs=1e-3)
    assert ppo.normalized_score("starpilot", "hard", 1.5) == 0.0
    assert ppo.normalized_score("starpilot", "memory", 10.0) is None
    assert len(ppo.PROCGEN_RANGES) == 16


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def cue_args(module, **overrides):
    base = dict(env_id="coinrun", total_timesteps=6144, num_envs=16, num_steps=32, num_minibatches=4,
                channels=(8,), hidden_size=32, learning_rate=2e-3, eval_every=0, eval_episodes=16, torch_threads=1)
    return module.Args(**{**base, **overrides})


# 20 iterations of 128 steps: the clip (or the KL penalty) bounds how far one iteration moves the policy, so the number
# of iterations, more than of steps, is what learning the cue takes. Final evaluations over seeds 1-3 and the three
# variants below: 6.6-7.8 here; 4.2-6.8 at cue_args' 12 iterations of 512 steps, in twice the time.
CUE_LEARNING = dict(num_steps=8, num_minibatches=1, total_timesteps=20 * 128)


# --amp on a CPU without bfloat16 instructions: torch emulates the bfloat16 convolutions and this run takes minutes,
# so it runs only where the CPU has them. On a 2-core Xeon with AVX512-BF16 and AMX, loaded by other jobs: 22 s with
# --amp against 30 s in float32; with oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), 202 s against 47 s.
EMULATED_BFLOAT16 = pytest.mark.skipif(not cpu_has_bfloat16_instructions(), reason="--amp's bfloat16 is emulated "
                                       "on a CPU without AVX512-BF16 or AMX-BF16: this learning run would take "
                                       "minutes (the float32 variants still run)")


@pytest.mark.parametrize("variant", [{}, {"policy_loss": "kl-penalty", "target_kl": 0.01},
                                     pytest.param({"amp": True}, marks=EMULATED_BFLOAT16)])
def test_ppo_learns_the_cue_task(variant, cue_env, in_tmp):
    """The real training loop on a pixel task: random play earns 8/15 ~ 0.53 per episode, a solved task 8. PPO-clip,
    PPO-penalty (adaptive beta) and PPO-clip with bfloat16 autocast (--amp, here on the CPU) all learn it."""
    cue_env(ppo)
    rows = read_rows(ppo.train(cue_args(ppo, **CUE_LEARNING, **variant)))
    train_returns = [r["charts/episodic_return"] for r in rows if r.get("charts/episodic_return") is not None]
    assert np.mean(train_returns[:2]) < 1.5
    assert rows[-1]["eval/episodic_return"] > 5.0, rows[-1]


def test_same_seed_same_run_on_cpu(in_tmp):
    args = ppo.Args(env_id="bigfish", num_envs=4, num_steps=32, num_minibatches=2, total_timesteps=256, channels=(4,),
                    hidden_size=16, eval_episodes=2, torch_threads=1)
    first = read_rows(ppo.train(args))
    second = read_rows(ppo.train(dataclasses.replace(args, exp_name="again")))  # another run directory
    losses = lambda rows: [(r["global_step"], r.get("losses/policy_loss"), r.get("losses/value_loss"),
                            r.get("eval/episodic_return")) for r in rows]
    assert losses(first) == losses(second)
    assert all(r["losses/value_loss"] > 0 for r in first if "losses/value_loss" in r)


def test_nonfinite_loss_stops_with_one_line_and_the_last_checkpoint_intact(cue_env, monkeypatch, in_tmp):
    """A NaN in iteration 2's advantages: no step is taken with it; the run stops (exit status 1) with one line
    naming the last checkpoint, iteration 1's, whose weights are finite."""
    cue_env(ppo)
    real_gae, calls = ppo.compute_gae, []

    def nan_from_iteration_2(rewards, *args):
        calls.append(1)
        return real_gae(rewards, *args) * (float("nan") if len(calls) == 2 else 1.0)
    monkeypatch.setattr(ppo, "compute_gae", nan_from_iteration_2)
    args = ppo.Args(num_envs=2, num_steps=8, num_minibatches=1, total_timesteps=48, channels=(4,), hidden_size=16,
                    torch_threads=1, eval_every=0, eval_episodes=1, save_model=True, save_every=1)
    with pytest.raises(SystemExit, match="^error: non-finite loss .*; the last checkpoint is iteration 1 in runs/"
                                         ".*checkpoint.pt \\(continue with --resume\\) \\(a lower --learning-rate"
                       ) as raised:
        ppo.train(args)
    assert len(str(raised.value).splitlines()) == 1
    (run,) = os.listdir("runs")
    checkpoint = torch.load(os.path.join("runs", run, "checkpoint.pt"), weights_only=True)
    assert checkpoint["iteration"] == 1 and all(torch.isfinite(p).all() for p in checkpoint["agent"].values())


def run_script(*flags, timeout=240):
    """`python ppo_procgen.py FLAGS`, forked from a server that has imported torch (tests/forked_run.py)."""
    return forked_run.run(os.path.join(ROOT, "ppo_procgen.py"), *flags, timeout=timeout)


def test_end_to_end_interrupt_resume_and_eval_only(in_tmp):
    """A real run: metrics and checkpoint; SIGTERM (as SLURM or torchrun send it) saves and exits 143; --resume
    finishes the same total; --eval-only loads."""
    flags = [*TINY, "--total-timesteps", str(32 * 60), "--save-model", "--save-every", "1"]
    process = forked_run.ForkedRun(os.path.join(ROOT, "ppo_procgen.py"), flags, stderr_to_stdout=True)
    deadline = time.time() + 120
    while not glob.glob("runs/*/checkpoint.pt"):
        assert time.time() < deadline and process.poll() is None
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 128 + signal.SIGTERM and "interrupted by SIGTERM: saved iteration" in output, output
    (run,) = os.listdir("runs")
    path = os.path.join("runs", run, "checkpoint.pt")
    saved = torch.load(path, weights_only=True)  # tensors and plain data only
    assert 1 <= saved["iteration"] < 60 and saved["global_step"] == saved["iteration"] * 32
    assert set(saved) >= {"agent", "optimizer", "ranks", "args", "global_step", "iteration"}
    assert set(saved["ranks"][0]) == {"reward_rms", "rng"} and saved["ranks"][0]["reward_rms"][2] > 1

    result = run_script("--resume", path, "--eval-episodes", "2", "--torch-threads", "1")
    assert result.returncode == 0, result.stderr
    assert f"resuming {run} at iteration {saved['iteration'] + 1}" in result.stdout
    rows = read_rows(os.path.join("runs", run))
    iterations = [r for r in rows if "losses/policy_loss" in r]
    assert [r["iteration"] for r in iterations] == list(range(1, 61))  # every iteration exactly once
    assert iterations[-1]["global_step"] == 32 * 60
    assert all(set(r) == ITERATION_KEYS for r in iterations)
    assert set(rows[-1]) == EVAL_KEYS and rows[-1]["global_step"] == 32 * 60
    # TensorBoard agrees with metrics.jsonl: the resumed run's event file hides the first run's later events.
    scalars = tensorboard_scalars(os.path.join("runs", run))
    assert [event.step for event in scalars["losses/policy_loss"]] == [32 * i for i in range(1, 61)]
    assert [event.value for event in scalars["charts/SPS"]] == pytest.approx([r["charts/SPS"] for r in iterations])
    assert torch.load(path, weights_only=True)["iteration"] == 60

    result = run_script("--eval-only", "--checkpoint", path, "--eval-episodes", "3", "--capture-video",
                        "--torch-threads", "1")
    assert result.returncode == 0, result.stderr
    assert "eval @ 1,920 steps: return" in result.stdout and "over 3 episodes" in result.stdout
    (video,) = [os.path.join(d, f) for d, _, files in os.walk("runs") for f in files if f.endswith(".mp4")]
    assert os.path.getsize(video) > 1000


def tensorboard_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def test_track_offline_logs_to_a_local_wandb_run_and_tensorboard(in_tmp):
    result = run_script(*TINY, "--total-timesteps", "64", "--track", "--wandb-mode", "offline", "--capture-video")
    assert result.returncode == 0, result.stderr
    (run_dir,) = glob.glob("runs/*")
    rows = read_rows(run_dir)
    scalars = tensorboard_scalars(run_dir)  # the same tags and numbers as metrics.jsonl, at step global_step
    logged = {key for row in rows for key, value in row.items() if "/" in key and value is not None}
    assert set(scalars) == logged and {"charts/SPS", "losses/policy_loss", "eval/episodic_return"} <= logged
    for key in logged:
        expected = [r for r in rows if r.get(key) is not None]
        assert [e.step for e in scalars[key]] == [r["global_step"] for r in expected]
        assert [e.value for e in scalars[key]] == pytest.approx([r[key] for r in expected], rel=1e-6)
    assert os.listdir(os.path.join(run_dir, "videos")) == ["eval_00002.mp4"]  # the final evaluation's episode
    (run_file,) = glob.glob("runs/*/wandb/offline-run-*/run-*.wandb")
    assert os.path.getsize(run_file) > 0
    assert glob.glob("runs/*/wandb/offline-run-*/files/media/videos/eval/*.mp4")  # the eval video was uploaded


class ScriptedRewards(gym.vector.VectorEnv):
    """Rewards and episode ends given in advance ([T, N] arrays), SAME_STEP autoreset as ProcgenVecEnv."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, rewards, dones):
        self.rewards, self.dones, self.t = rewards, dones, 0
        self.num_envs = rewards.shape[1]
        self.single_observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros((self.num_envs, 1), np.float32), {}

    def step(self, actions):
        reward, done = self.rewards[self.t], self.dones[self.t]
        self.t += 1
        return np.zeros((self.num_envs, 1), np.float32), reward, done, np.zeros_like(done), {}


def test_reward_normalizer_keeps_the_episode_history_at_its_last_step():
    """4-step episodes of reward 1, gamma 0.5: the statistics see G = 1, 1.5, 1.75, 1.875 and then
    a new episode's 1, 1.5, ... (gymnasium 1.x's wrapper would feed 1.0 at the last step); each reward is divided by
    the std of all G so far."""
    rewards = np.ones((8, 1))
    dones = np.tile([False, False, False, True], 2)[:, None]
    normalizer = ppo.NormalizeReward(ScriptedRewards(rewards, dones), gamma=0.5, clip=np.inf)
    fed = []
    update = normalizer.return_rms.update
    normalizer.return_rms.update = lambda x: (fed.append(x.tolist()), update(x))
    normalizer.reset(seed=0)
    reference = gym.wrappers.utils.RunningMeanStd(shape=())
    for expected in [1, 1.5, 1.75, 1.875] * 2:
        reward = normalizer.step(np.zeros(1, dtype=int))[1]
        reference.update(np.array([expected]))
        assert reward == pytest.approx(1 / np.sqrt(reference.var + 1e-8))
    assert fed == [[value] for value in [1, 1.5, 1.75, 1.875] * 2]
    assert (normalizer.return_rms.mean, normalizer.return_rms.var) == (reference.mean, reference.var)


def test_reward_normalizer_matches_gym_0_23_semantics():
    """gym 0.26.2's NormalizeReward keeps gym 0.23's loop (CleanRL's): G = gamma G + r, update, divide, reset G where
    an episode ended. On random rewards with random episode ends both give the same rewards and statistics."""
    old_gym = pytest.importorskip("gym")
    from gym.wrappers import NormalizeReward as OldNormalizeReward
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(300, 4)) * rng.integers(0, 2, size=(300, 4))
    dones = rng.random((300, 4)) < 0.05

    class OldVectorEnv(old_gym.Env):
        is_vector_env = True
        num_envs = 4

        def __init__(self):
            self.t = 0

        def step(self, actions):
            self.t += 1
            return None, rewards[self.t - 1], dones[self.t - 1], np.zeros(4, dtype=bool), {}

    old = OldNormalizeReward(OldVectorEnv(), gamma=0.99)
    new = ppo.NormalizeReward(ScriptedRewards(rewards, dones), gamma=0.99, clip=np.inf)
    new.reset(seed=0)
    for _ in range(300):
        np.testing.assert_allclose(new.step(np.zeros(4, dtype=int))[1], old.step(None)[1], rtol=1e-12)
    for key in ("mean", "var", "count"):
        assert getattr(new.return_rms, key) == pytest.approx(getattr(old.return_rms, key), rel=1e-12)


def test_reward_clip_matches_gymnasiums_clip_reward_in_one_numpy_call(monkeypatch):
    """The normalizer clips as gymnasium's vector ClipReward over it did (bit for bit), but in one numpy call per
    step whatever the number of games: gymnasium's calls np.clip once per game, in a Python loop."""
    from gymnasium.wrappers.vector import ClipReward
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(200, 64)) * np.where(rng.random((200, 64)) < 0.01, 1000, 1)  # rare large ones
    dones = rng.random((200, 64)) < 0.05
    stacked = ClipReward(ppo.NormalizeReward(ScriptedRewards(rewards, dones), gamma=0.99, clip=np.inf), -10.0, 10.0)
    folded = ppo.NormalizeReward(ScriptedRewards(rewards, dones), gamma=0.99, clip=10.0)
    stacked.reset(seed=0)
    folded.reset(seed=0)
    clipped = 0
    for _ in range(199):  # the last step is left for the count below
        expected, got = stacked.step(np.zeros(64, dtype=int))[1], folded.step(np.zeros(64, dtype=int))[1]
        np.testing.assert_array_equal(got, expected)
        clipped += int((np.abs(got) == 10.0).sum())
    assert clipped > 0  # the clip was reached
    calls = []
    clip = np.clip
    monkeypatch.setattr(np, "clip", lambda *args, **kwargs: (calls.append(1), clip(*args, **kwargs))[1])
    folded.step(np.zeros(64, dtype=int))
    assert len(calls) == 1


def test_beta_is_adapted_to_the_kl_after_the_update(cue_env, in_tmp, monkeypatch):
    """PPO section 4 adapts beta to d, the KL the update reached. With one minibatch and one epoch
    the KL before the step is exactly 0, the KL after it is not: ppo_update measures it in a pass after the update,
    and train() feeds that one to beta's rule."""
    args, agent = tiny_agent()
    args = dataclasses.replace(args, policy_loss="kl-penalty", kl_beta=1.0, num_steps=64)
    obs = torch.randint(0, 256, (64, 64, 64, 3), dtype=torch.uint8)
    with torch.no_grad():
        logits, values = agent(obs)
    actions = ppo.sample_action(logits)
    batch = dict(obs=obs, actions=actions, log_probs=ppo.log_prob_entropy(logits, actions)[0], logits=logits,
                 values=values, advantages=torch.randn(64), returns=values + torch.randn(64))
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    stats = ppo.ppo_update(agent, optimizer, batch, args, kl_beta=1.0)
    with torch.no_grad():
        expected = ppo.categorical_kl(logits, agent(obs)[0]).mean().item()
    assert stats["kl"] == 0 and stats["kl_after"] == pytest.approx(expected, rel=1e-5) and expected > 0

    cue_env(ppo)
    fed, measured = [], []
    real_update, real_adapt = ppo.ppo_update, ppo.adapt_kl_beta

    def update(*args, **kwargs):
        measured.append(real_update(*args, **kwargs))
        return measured[-1]

    def adapt(kl_beta, kl, target_kl):
        fed.append(kl)
        return real_adapt(kl_beta, kl, target_kl)
    monkeypatch.setattr(ppo, "ppo_update", update)
    monkeypatch.setattr(ppo, "adapt_kl_beta", adapt)
    run_dir = ppo.train(cue_args(ppo, policy_loss="kl-penalty", target_kl=0.01, num_steps=8, total_timesteps=256))
    assert fed == [stats["kl_after"] for stats in measured] and fed != [stats["kl"] for stats in measured]
    rows = [row for row in read_rows(run_dir) if "losses/kl_after" in row]
    assert [row["losses/kl_after"] for row in rows] == pytest.approx(fed) and len(rows) == 2


def test_official_kl_estimator_on_a_hand_made_example():
    """the PPG code's PPG-KL (--clip_param 0 --kl_penalty 1) minimizes E[-r A] + 1 * 1/2 E[(log r)^2]
    over the sampled actions: --policy-loss kl-penalty --kl-beta 1 --kl-estimator official."""
    ratio = torch.tensor([2.0, 1.0, 0.25])
    advantages = torch.tensor([1.0, -1.0, 2.0])
    old_logits, logits = torch.zeros(3, 15), torch.randn(3, 15)  # ignored by the official estimate
    kl = ppo.penalty_kl(old_logits, logits, ratio.log(), "official")
    np.testing.assert_allclose(kl.numpy(), [0.5 * np.log(2) ** 2, 0, 0.5 * np.log(4) ** 2], rtol=1e-6)
    loss = ppo.policy_loss(ratio, advantages, kl, "kl-penalty", 0.2, 1.0)
    assert loss.item() == pytest.approx((-2 + 1 - 0.5 + 0.5 * np.log(2) ** 2 + 0.5 * np.log(4) ** 2) / 3, rel=1e-6)
    exact = ppo.penalty_kl(old_logits, logits, ratio.log(), "exact")
    np.testing.assert_allclose(exact.numpy(), ppo.categorical_kl(old_logits, logits).numpy())


def test_minibatches_of_games_hold_whole_games_and_frames_are_unchanged():
    """with --minibatch-unit games every step of a game (index t * num_games + n of the flattened
    [num_steps, num_games] batch) lands in one minibatch, each minibatch holds num_games / num_minibatches games;
    'frames' is the shuffled split it always was (the same random numbers)."""
    args = ppo.Args(num_steps=16, num_envs=8, num_minibatches=4, minibatch_unit="games")
    minibatches = ppo.minibatches(16 * 8, args, torch.device("cpu"))
    assert sorted(torch.cat(minibatches).tolist()) == list(range(128)) and len(minibatches) == 4
    for minibatch in minibatches:
        games = set((minibatch % 8).tolist())
        assert len(games) == 2 and sorted(minibatch.tolist()) == sorted(t * 8 + n for t in range(16) for n in games)
    torch.manual_seed(0)
    frames = ppo.minibatches(128, dataclasses.replace(args, minibatch_unit="frames"), torch.device("cpu"))
    torch.manual_seed(0)
    permutation = torch.randperm(128)
    assert all(torch.equal(a, permutation[32 * i : 32 * (i + 1)]) for i, a in enumerate(frames))
    with pytest.raises(SystemExit, match="--minibatch-unit games splits each rank's 6 envs into --num-minibatches 4"):
        ppo.check_args(dataclasses.replace(args, num_envs=6, num_minibatches=4, total_timesteps=10**6))


def test_paper_ppo_baseline_recipe_has_the_official_value_loss_scale():
    """the PPG code's PPO baseline minimizes vfcoef * MSE = 0.5 * mean((V - R)^2) (no value
    clipping); benchmarks/procgen_suite.sh's hard-mode PPO command must give the same value-loss term here."""
    import tyro
    environment = {**os.environ, "DRY_RUN": "1", "MODE": "hard", "GAMES": "coinrun", "SEEDS": "1",
                   "SCRIPTS": "ppo_procgen.py"}
    command = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "procgen_suite.sh")], env=environment,
                             capture_output=True, text=True, check=True).stdout.splitlines()[0].split()
    args = tyro.cli(ppo.Args, args=command[2:])
    new_value, old_value, returns = torch.tensor([1.0, 0.1, -1.0]), torch.zeros(3), torch.tensor([2.0, 0.0, 0.0])
    ours = args.vf_coef * ppo.value_loss(new_value, old_value, returns, args.clip_coef, args.clip_vloss)
    assert ours.item() == pytest.approx(0.5 * (1 + 0.01 + 1) / 3)  # official: 0.5 * mean([1, 0.01, 1])
    assert args.minibatch_unit == "games" and args.update_epochs == 3  # the official baseline's minibatches, epochs


def test_target_kl_compares_each_epochs_own_mean_kl():
    """--target-kl (clip) stops the update after the first epoch whose own mean approximate KL
    passes it. With one minibatch per epoch the first epoch's KL is exactly 0 (the rollout's own network), so after
    epoch 2 the mean over both epochs is half of epoch 2's own: a target between the two stops there, while the
    cumulative mean would go on to epoch 3."""
    def update(epochs, target_kl):
        args, agent = tiny_agent()  # seeds torch: the same weights and minibatch order every time
        args = dataclasses.replace(args, update_epochs=epochs, target_kl=target_kl)
        generator = torch.Generator().manual_seed(1)
        obs = torch.randint(0, 256, (64, 64, 64, 3), dtype=torch.uint8, generator=generator)
        with torch.no_grad():
            logits, values = agent(obs)
        actions = ppo.sample_action(logits, generator)
        batch = dict(obs=obs, actions=actions, log_probs=ppo.log_prob_entropy(logits, actions)[0], logits=logits,
                     values=values, advantages=torch.randn(64, generator=generator), returns=values + 1)
        optimizer = torch.optim.Adam(agent.parameters(), lr=1e-2)
        steps = []
        real_step = optimizer.step

        def counted_step(*args, **kwargs):
            steps.append(1)
            return real_step(*args, **kwargs)
        optimizer.step = counted_step
        return ppo.ppo_update(agent, optimizer, batch, args), len(steps)

    stats, steps = update(2, None)
    second_epoch_kl = 2 * stats["approx_kl"]  # the mean of epoch 1's 0 and epoch 2's own
    assert steps == 2 and second_epoch_kl > 1e-4
    assert update(3, None)[1] == 3
    assert update(3, 0.75 * second_epoch_kl)[1] == 2  # the cumulative mean, 0.5 of it, would not have stopped


def test_cuda_flag_without_a_gpu_warns_once(cue_env, in_tmp, monkeypatch, capsys):
    """--cuda (the default) on a machine without a usable GPU: one line says so, and the run trains on the CPU;
    --no-cuda: no warning."""
    cue_env(ppo)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cue_args(ppo, num_steps=8, total_timesteps=128)  # one iteration
    ppo.train(args)
    warning = ("warning: --cuda is on but no CUDA GPU is usable (torch.cuda.is_available() is False); running on "
               "the CPU")
    assert capsys.readouterr().out.splitlines().count(warning) == 1
    ppo.train(dataclasses.replace(args, cuda=False))
    assert "warning: --cuda" not in capsys.readouterr().out


def test_resume_takes_the_checkpoints_flags_before_checking_them(cue_env, in_tmp, monkeypatch, capsys):
    """--resume reads the checkpoint's flags first and checks those, so a flag given with it that is not
    in RUNTIME_FLAGS is ignored (here a --total-timesteps below one default iteration), and an error names the run's
    own numbers (its --num-envs 16, not the default 64)."""
    cue_env(ppo)
    run_dir = ppo.train(cue_args(ppo, num_steps=8, total_timesteps=256, save_model=True))  # two iterations
    path = os.path.join(run_dir, "checkpoint.pt")
    assert ppo.train(ppo.Args(resume=path, total_timesteps=160, torch_threads=1)) == os.path.dirname(
        os.path.abspath(path))
    assert f"resuming {os.path.basename(run_dir)} at iteration 3" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match="^error: --num-envs 16 must be a multiple of the 3 ranks"):
        ppo.train(ppo.Args(resume=path, total_timesteps=160))


def test_checkpoints_keep_the_keys_earlier_versions_wrote(cue_env, in_tmp):
    """A checkpoint is one plain dict with the keys every release has written, so those resume as they are."""
    cue_env(ppo)
    run_dir = ppo.train(cue_args(ppo, total_timesteps=512, save_model=True))
    saved = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    assert set(saved) == {"agent", "optimizer", "iteration", "global_step", "kl_beta", "args", "run_name", "ranks"}
