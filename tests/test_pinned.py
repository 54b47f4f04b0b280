"""Exact tests that pin each piece of the algorithms to its paper's definition, written
independently of the scripts: one SGD step of PPO (Schulman et al. 2017, Eq. 9) and of PPG's policy
phase (Cobbe et al. 2021, Eq. 1-2) against the loss written out per sample; what enters PPG's buffer
B (V_targ = A + V of the same rollout, by a naive GAE sum) and PPG's auxiliary phase (Eq. 2-3:
KL(pi_old || pi), V_aux on its own head); the IMPALA learner's step against V-trace's double sum
(Espeholt et al. 2018, Eq. 1) on a policy that tells every frame apart; evaluation on levels that
training never plays, in all three Procgen scripts; and the schedules that only a learning curve
would otherwise see. A one-line slip in any of them changes a number here far beyond the
tolerance, instead of lowering a learning curve by luck."""
import contextlib
import copy
import functools
import json
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import CueEnv, train_in
from gymnasium.vector import AutoresetMode

import ppg_procgen as ppg
import ppo_procgen as ppo
import vtrace


# ---------------------------------------------------------------- PPO's step and PPG's policy phase
def naive_mean_std(values):
    """Mean and sample standard deviation (ddof 1, torch's and CleanRL's) by plain sums, in
    float64."""
    values = [float(value) for value in values]
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))


def normalized(advantages, index):
    """(A - mean) / (std + 1e-8) with the moments of the samples `index`, for every sample."""
    mean, std = naive_mean_std(advantages[index])
    return (advantages.double() - mean) / (std + 1e-8)


def paper_ppo_loss(agent, batch, index, advantages, args, kl_beta, policy_term=True, value_term=True):
    """PPO Eq. 9 on the samples `index`, negated for descent, each sample's terms written out in
    float64: -L^CLIP (Eq. 7; or Eq. 8's r A - beta KL(pi_old || pi)) + c1 L^VF - c2 S[pi], with L^VF
    the squared error halved, clipped around the rollout's value as in baselines when asked.
    `advantages` are already normalized."""
    logits, values = agent(batch["obs"][index])
    terms = []
    for row, i in enumerate(index.tolist()):
        log_pi = torch.log_softmax(logits[row].double(), -1)
        old_log_pi = torch.log_softmax(batch["logits"][i].double(), -1)
        ratio = torch.exp(log_pi[batch["actions"][i]] - batch["log_probs"][i].double())
        advantage = advantages[i]
        if args.policy_loss == "clip":
            clipped_ratio = torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            surrogate = torch.minimum(ratio * advantage, clipped_ratio * advantage)
        else:
            kl = sum(old_log_pi[a].exp() * (old_log_pi[a] - log_pi[a]) for a in range(len(log_pi)))
            surrogate = ratio * advantage - kl_beta * kl
        entropy = -sum(log_pi[a].exp() * log_pi[a] for a in range(len(log_pi)))
        value, old_value, target = values[row].double(), batch["values"][i].double(), batch["returns"][i].double()
        squared_error = (value - target) ** 2
        if args.clip_vloss:
            clipped_value = old_value + torch.clamp(value - old_value, -args.clip_coef, args.clip_coef)
            squared_error = torch.maximum(squared_error, (clipped_value - target) ** 2)
        term = 0.0
        if policy_term:
            term = term - surrogate - args.ent_coef * entropy
        if value_term:
            term = term + args.vf_coef * 0.5 * squared_error
        terms.append(term)
    return sum(terms) / len(terms)


def sgd_step(parameter_groups, loss, lr, max_grad_norm):
    """One plain SGD step on `loss`, each group's gradient norm clipped to max_grad_norm on its own
    (as torch.nn.utils.clip_grad_norm_: a factor max_norm / (norm + 1e-6), at most 1); parameters
    outside the loss stay in place. Returns each group's clip factor."""
    params = [param for group in parameter_groups for param in group]
    factors = []
    grads = dict(zip(params, torch.autograd.grad(loss, params, allow_unused=True)))
    with torch.no_grad():
        for group in parameter_groups:
            present = [param for param in group if grads[param] is not None]
            norm = math.sqrt(sum(float((grads[param].double() ** 2).sum()) for param in present))
            factor = min(1.0, max_grad_norm / (norm + 1e-6))
            for param in present:
                param -= lr * factor * grads[param]
            factors.append(factor)
    return factors


def non_uniform_agent(module, args, seed):
    """A tiny agent whose policy is far from uniform (the entropy's gradient vanishes at a uniform
    policy) but far from deterministic too (logits of std 1 over random frames), and whose values
    are not small."""
    torch.manual_seed(seed)
    agent = module.Agent(args, num_actions=15)
    frames = torch.randint(0, 256, (32, 64, 64, 3), dtype=torch.uint8)
    with torch.no_grad():
        agent.actor.weight.normal_()
        agent.critic.weight.normal_()
        logits, values = agent(frames)
        agent.actor.weight /= logits.std()
        agent.critic.weight /= values.std()
    return agent


def rollout_batch(agent, size=16, seed=0):
    """A hand-made rollout: pi_old is the agent's policy moved by noise (so that ratios are far from
    1 and some are clipped), rollout values away from the current ones (some value clips bite), and
    advantages with a mean far from 0 and a std far from 1 (so centring and scaling both matter)."""
    generator = torch.Generator().manual_seed(seed)
    obs = torch.randint(0, 256, (size, 64, 64, 3), dtype=torch.uint8, generator=generator)
    with torch.no_grad():
        logits, values = agent(obs)
    old_logits = logits + 0.6 * torch.randn(logits.shape, generator=generator)
    actions = torch.randint(0, 15, (size,), generator=generator)
    old_log_probs = torch.log_softmax(old_logits, -1).gather(-1, actions[:, None]).squeeze(-1)
    return dict(obs=obs, actions=actions, log_probs=old_log_probs, logits=old_logits,
                values=values + 0.3 * torch.randn(size, generator=generator),
                returns=values + torch.randn(size, generator=generator),
                advantages=1.5 + 2.0 * torch.randn(size, generator=generator))


def weights(agent):
    return {name: param.detach().clone() for name, param in agent.named_parameters()}


def assert_same_step(agent, reference, start):
    """The script's step and the reference's, parameter by parameter, against the size of the
    step."""
    moved = weights(agent)
    expected = weights(reference)
    largest = max((expected[name] - start[name]).abs().max().item() for name in start)
    assert largest > 1e-6
    for name in start:
        torch.testing.assert_close(moved[name] - start[name], expected[name] - start[name], rtol=1e-3,
                                   atol=1e-3 * largest, msg=lambda text: f"{name}: {text}")


FIXED_SPLIT = [torch.tensor([3, 12, 7, 0, 9, 14, 5, 10]), torch.tensor([1, 8, 15, 2, 11, 6, 13, 4])]


@pytest.mark.parametrize("flags", [
    dict(),  # clip, advantages normalized per minibatch, value clipping, no gradient clip
    dict(max_grad_norm=20.0),  # the gradient clip bites
    dict(adv_norm="batch", clip_vloss=False),
    dict(adv_norm="off"),
    dict(policy_loss="kl-penalty", kl_beta=0.7),  # PPO Eq. 8 with the exact KL(pi_old || pi)
], ids=["clip", "grad-clip", "batch-norm", "no-norm", "kl-penalty"])
def test_ppo_update_takes_the_sgd_steps_of_the_papers_loss(flags, monkeypatch):
    """Two minibatches (so that per-minibatch and whole-batch normalization differ), one epoch,
    plain SGD, and coefficients far from the defaults: every term of Eq. 9 moves the weights, and
    the script's update must move them exactly as the loss written out per sample does."""
    args = ppo.Args(**{**dict(channels=(4,), hidden_size=16, num_minibatches=2, update_epochs=1, ent_coef=0.37,
                              vf_coef=0.83, clip_coef=0.15, max_grad_norm=math.inf), **flags})
    monkeypatch.setattr(ppo, "minibatches", lambda batch_size, args, device: FIXED_SPLIT)
    agent = non_uniform_agent(ppo, args, seed=0)
    batch = rollout_batch(agent)
    reference, start = copy.deepcopy(agent), weights(agent)
    lr = 1e-4
    ppo.ppo_update(agent, torch.optim.SGD(agent.parameters(), lr=lr), batch, args, kl_beta=args.kl_beta)

    everything = torch.arange(16)
    for index in FIXED_SPLIT:
        if args.adv_norm == "minibatch":
            advantages = normalized(batch["advantages"], index)
        elif args.adv_norm == "batch":
            advantages = normalized(batch["advantages"], everything)
        else:
            advantages = batch["advantages"].double()
        loss = paper_ppo_loss(reference, batch, index, advantages, args, args.kl_beta)
        (factor,) = sgd_step([list(reference.parameters())], loss, lr, args.max_grad_norm)
        assert factor < 0.5 if args.max_grad_norm < math.inf else factor == 1.0
    assert_same_step(agent, reference, start)


@pytest.mark.parametrize("arch", ["dual", "detach"])
def test_ppg_policy_phase_takes_the_sgd_steps_of_its_loss(arch, monkeypatch):
    """PPG's policy phase at its own defaults (advantages normalized over the batch, no value clip,
    no gradient clip) with E_pi = 1 and E_V = 2: in the first epoch L^clip + beta_S S[pi] on
    theta_pi and L^value on theta_V (PPG Eq. 1-2), in the second L^value alone, so that the policy
    network's weights stay where the first epoch left them; the auxiliary value head is no part of
    the policy phase. Coefficients away from the defaults."""
    args = ppg.Args(channels=(4,), hidden_size=16, num_minibatches=2, e_pi=1, e_v=2, ent_coef=0.29, vf_coef=0.61,
                    clip_coef=0.15, arch=arch)
    monkeypatch.setattr(ppg, "minibatches", lambda batch_size, args, device: FIXED_SPLIT)
    agent = non_uniform_agent(ppg, args, seed=1)
    batch = rollout_batch(agent, seed=1)
    reference, start = copy.deepcopy(agent), weights(agent)
    lr = 1e-4
    ppg.ppo_update(agent, torch.optim.SGD(agent.networks(), lr=lr), batch, args)

    advantages = normalized(batch["advantages"], torch.arange(16))  # --adv-norm batch, PPG's default
    for epoch in range(2):
        for index in FIXED_SPLIT:
            loss = paper_ppo_loss(reference, batch, index, advantages, args, None, policy_term=epoch == 0)
            sgd_step([list(reference.parameters())], loss, lr, args.max_grad_norm)
    assert_same_step(agent, reference, start)
    assert torch.equal(start["aux_critic.weight"], weights(agent)["aux_critic.weight"])


# ---------------------------------------------------------------- the IMPALA learner: V-trace on aligned frames
class LabelledFrames(gym.vector.VectorEnv):
    """Deterministic games whose frame says where it is: pixel (0, 0) holds (step in the episode t,
    game b); game b's episodes last lengths[b] steps; action a at step t earns 0.1 (t + 1) + 0.01 a.
    SAME_STEP autoreset, as the scripts' ProcgenVecEnv: the last step returns done and the next
    episode's first frame."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, lengths):
        self.lengths = np.array(lengths)
        self.num_envs = len(lengths)
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(15)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)

    def frames(self):
        frames = np.zeros((self.num_envs, 64, 64, 3), dtype=np.uint8)
        frames[:, 0, 0, 0], frames[:, 0, 0, 1] = self.t, np.arange(self.num_envs)
        return frames

    def reset(self, *, seed=None, options=None):
        self.t = np.zeros(self.num_envs, dtype=int)
        return self.frames(), {}

    def step(self, actions):
        reward = 0.1 * (self.t + 1) + 0.01 * np.asarray(actions)
        self.t += 1
        done = self.t == self.lengths
        self.t[done] = 0
        return self.frames(), reward, done, np.zeros(self.num_envs, dtype=bool), {}


class FrameTable(nn.Module):
    """A network that tells every frame apart: logits and a value looked up by the frame's (t,
    game), each entry drawn at random, so that pairing a frame with its neighbour's action changes
    log rho by about 1."""

    def __init__(self, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.logits = nn.Parameter(torch.randn(8, 4, 15, generator=generator))
        self.values = nn.Parameter(torch.randn(8, 4, generator=generator))

    def forward(self, obs):
        t, game = obs[:, 0, 0, 0].long(), obs[:, 0, 0, 1].long()
        return self.logits[t, game], self.values[t, game]


def impala_unroll(T=6):
    """An unroll as the actor hands it to the learner, played by a behaviour policy mu that is not
    pi."""
    envs = LabelledFrames([2, 3, 4, 5])
    mu = FrameTable(seed=1)
    return vtrace.collect_unroll(mu, envs, torch.as_tensor(envs.reset()[0]), T,
                                 generator=torch.Generator().manual_seed(0))


def naive_vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar, c_bar, pg_rho_bar, lam):
    """IMPALA Eq. 1 as its double sum, per game, in float64: v_s = V(x_s) + sum_{t>=s}
    (prod_{s<=i<t} gamma_i c_i) rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)), rho_t = min(rho_bar,
    pi/mu), c_i = lambda min(c_bar, pi/mu); the policy gradient's advantage min(pg_rho_bar, pi/mu)
    (r_s + gamma_s v_{s+1} - V(x_s)), v_T = V(x_T)."""
    T, B = len(rewards), len(rewards[0])
    ratios = [[math.exp(log_rhos[t][b]) for b in range(B)] for t in range(T)]
    vs = [[0.0] * B for _ in range(T + 1)]
    advantages = [[0.0] * B for _ in range(T)]
    for b in range(B):
        next_values = [values[t + 1][b] if t + 1 < T else bootstrap[b] for t in range(T)]
        vs[T][b] = bootstrap[b]
        for s in range(T):
            total, trace = 0.0, 1.0
            for t in range(s, T):
                delta = min(rho_bar, ratios[t][b]) * (rewards[t][b] + discounts[t][b] * next_values[t] - values[t][b])
                total += trace * delta
                trace *= discounts[t][b] * lam * min(c_bar, ratios[t][b])
            vs[s][b] = values[s][b] + total
        for s in range(T):
            advantages[s][b] = min(pg_rho_bar, ratios[s][b]) * (rewards[s][b] + discounts[s][b] * vs[s + 1][b]
                                                                 - values[s][b])
    return torch.tensor(vs[:T], dtype=torch.float64), torch.tensor(advantages, dtype=torch.float64)


VTRACE_FLAGS = dict(gamma=0.9, rho_bar=1.3, c_bar=0.8, pg_rho_bar=1.1, vtrace_lambda=0.9, baseline_cost=0.7,
                    entropy_cost=0.05, max_grad_norm=math.inf)


def test_learner_pairs_each_frame_with_its_own_action_and_behaviour_policy(monkeypatch):
    """log rho_s = log pi(a_s|x_s) - log mu(a_s|x_s), each term of step s, on a policy that tells
    the frames apart: a frame paired with its neighbour's logits changes log rho by far more than
    the tolerance."""
    args = vtrace.Args(**VTRACE_FLAGS)
    unroll = impala_unroll()
    pi = FrameTable(seed=2)
    seen = {}

    def spy(log_rhos, *arguments):
        seen["log_rhos"] = log_rhos
        return from_importance_weights(log_rhos, *arguments)

    from_importance_weights = vtrace.from_importance_weights
    monkeypatch.setattr(vtrace, "from_importance_weights", spy)
    vtrace.vtrace_backward(pi, torch.optim.SGD(pi.parameters(), lr=0.0), unroll, args, contextlib.nullcontext)
    T, B = unroll["actions"].shape
    expected = torch.zeros(T, B, dtype=torch.float64)
    with torch.no_grad():
        for t in range(T):
            logits = pi(unroll["obs"][t])[0].double()
            for b in range(B):
                action = unroll["actions"][t, b]
                expected[t, b] = (torch.log_softmax(logits[b], -1)[action]
                                  - torch.log_softmax(unroll["behaviour_logits"][t, b].double(), -1)[action])
    torch.testing.assert_close(seen["log_rhos"].double(), expected, rtol=0, atol=1e-5)
    assert (expected[1:] - expected[:-1]).abs().mean() > 0.5  # a one-step shift would be seen at once


def test_learner_gradient_is_the_vtrace_loss_of_the_double_sum():
    """The learner's gradient on one unroll equals that of IMPALA's loss written out from V-trace's
    definition (means over T x B, as the script documents): -log pi(a_s|x_s) A_s + b 1/2 (v_s -
    V(x_s))^2 - e H(pi(.|x_s)), v_s and A_s held constant, bootstrapped from the learner's V(x_T),
    gamma_s = gamma (1 - done_s); every clip and lambda away from 1 and every coefficient away from
    its default."""
    args = vtrace.Args(**VTRACE_FLAGS)
    unroll = impala_unroll()
    pi = FrameTable(seed=2)
    vtrace.vtrace_backward(pi, torch.optim.SGD(pi.parameters(), lr=0.0), unroll, args, contextlib.nullcontext)
    got = [param.grad.clone() for param in pi.parameters()]

    reference = FrameTable(seed=2)
    T, B = unroll["actions"].shape
    logits, values = zip(*(reference(frames) for frames in unroll["obs"]))  # x_0 .. x_T, one step at a time
    log_pi = [torch.log_softmax(step_logits.double(), -1) for step_logits in logits]
    log_mu = torch.log_softmax(unroll["behaviour_logits"].double(), -1)
    actions, dones = unroll["actions"].tolist(), unroll["dones"].tolist()
    log_rhos = [[(log_pi[t][b, actions[t][b]] - log_mu[t, b, actions[t][b]]).item() for b in range(B)]
                for t in range(T)]
    discounts = [[args.gamma * (1 - dones[t][b]) for b in range(B)] for t in range(T)]
    plain_values = [[values[t][b].item() for b in range(B)] for t in range(T)]
    vs, advantages = naive_vtrace(log_rhos, discounts, unroll["rewards"].double().tolist(), plain_values,
                                  values[T].tolist(), args.rho_bar, args.c_bar, args.pg_rho_bar, args.vtrace_lambda)
    loss = 0.0
    for t in range(T):
        for b in range(B):
            entropy = -(log_pi[t][b].exp() * log_pi[t][b]).sum()
            loss = loss + (-log_pi[t][b, actions[t][b]] * advantages[t, b]
                           + args.baseline_cost * 0.5 * (vs[t, b] - values[t][b].double()) ** 2
                           - args.entropy_cost * entropy)
    want = torch.autograd.grad(loss / (T * B), list(reference.parameters()))
    assert unroll["dones"].sum() > 0 and (torch.tensor(log_rhos).exp() > args.rho_bar).any()
    for name, got_grad, want_grad in zip(["logits", "values"], got, want):
        assert want_grad.abs().max() > 1e-3
        torch.testing.assert_close(got_grad.double(), want_grad.double(), rtol=1e-4, atol=1e-6,
                                   msg=lambda text: f"{name}: {text}")


# ---------------------------------------------------------------- V_targ = A + V: PPO's batch, PPG's buffer B
class RecordedGames(gym.vector.VectorWrapper):
    """The training games as the agent sees them: the first frames, then each step's frames,
    (normalized) rewards and episode ends."""

    def __init__(self, env):
        super().__init__(env)
        self.frames, self.rewards, self.ends = [], [], []

    def __getattr__(self, name):  # the reward normalizer's statistics, which checkpoints read
        return getattr(self.env, name)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.frames.append(obs.copy())
        return obs, info

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(actions)
        self.frames.append(obs.copy())
        self.rewards.append(np.asarray(reward, dtype=np.float64).copy())
        self.ends.append(terminated | truncated)
        return obs, reward, terminated, truncated, info


def naive_gae(rewards, values, ends, bootstrap, gamma, lam):
    """GAE's definition for one game, in float64: A_t = sum_{k>=t} (gamma lambda)^(k-t) delta_k,
    summed until the episode ends, delta_k = r_k + gamma V(s_{k+1}) (1 - end_k) - V(s_k), V(s_T) the
    bootstrap."""
    T = len(rewards)
    next_values = list(values[1:]) + [bootstrap]
    advantages = []
    for t in range(T):
        total, weight = 0.0, 1.0
        for k in range(t, T):
            total += weight * (rewards[k] + gamma * next_values[k] * (1 - ends[k]) - values[k])
            if ends[k]:
                break
            weight *= gamma * lam
        advantages.append(total)
    return advantages


def record_play(script, monkeypatch):
    """Play CueEnv games of 4-step episodes in `script`'s train(), recording the games (RecordedGames)
    and every no-gradient pass of the agent: the rollout's steps and the bootstrap V(s_T)."""
    monkeypatch.setattr(script, "ProcgenVecEnv", lambda num_envs, *args, **options: CueEnv(num_envs, length=4))
    games, forwards = [], []
    make_env = script.make_env

    def recorded_env(args, num_envs):
        games.append(RecordedGames(make_env(args, num_envs)))
        return games[-1]

    class RecordedAgent(script.Agent):
        def forward(self, obs):
            logits, value = super().forward(obs)
            if not torch.is_grad_enabled():
                forwards.append((obs.clone(), value.clone()))
            return logits, value

    monkeypatch.setattr(script, "make_env", recorded_env)
    monkeypatch.setattr(script, "Agent", RecordedAgent)
    return games, forwards


def played_rollout(recorded, passes, iteration, T, gamma, lam):
    """One iteration's rollout as it was played: its frames [T, games, 64, 64, 3], the values the agent
    computed while playing [T, games], and V_targ = A + V [T, games] by a naive GAE sum (float64)."""
    steps = range(iteration * T, (iteration + 1) * T)
    frames = np.stack([recorded.frames[step] for step in steps])
    assert all(np.array_equal(obs.numpy(), frames[t]) for t, (obs, _) in enumerate(passes[:-1]))
    values = torch.stack([value for _, value in passes]).double()  # [T + 1, games]: V(s_0) .. V(s_T)
    targets = torch.zeros(T, values.shape[1], dtype=torch.float64)
    for game in range(values.shape[1]):
        rewards = [recorded.rewards[step][game] for step in steps]
        ends = [bool(recorded.ends[step][game]) for step in steps]
        assert any(ends)  # episodes end inside the rollout: the sum must stop there
        advantages = naive_gae(rewards, values[:T, game].tolist(), ends, values[T, game].item(), gamma, lam)
        targets[:, game] = torch.tensor(advantages, dtype=torch.float64) + values[:T, game]
    return frames, values[:T], targets


def test_ppo_update_gets_each_rollouts_frames_with_returns_a_plus_v(in_tmp, monkeypatch):
    """PPO's value target, the return that L^VF regresses on, is V_targ = A + V of the rollout: in
    the batch that `train` hands `ppo_update`, every step of every game holds the frame it played,
    the value the agent computed while playing it, and that value plus a naive GAE sum over the
    (normalized) rewards the agent saw and the values of the rollout (gamma and lambda away from
    the defaults, episodes ending inside the rollout), at each of two iterations."""
    games, forwards = record_play(ppo, monkeypatch)
    updates = []

    def recorded_update(agent, optimizer, batch, *rest):
        updates.append(({key: value.clone() for key, value in batch.items()}, len(forwards)))
        return ppo_update(agent, optimizer, batch, *rest)

    ppo_update = ppo.ppo_update
    monkeypatch.setattr(ppo, "ppo_update", recorded_update)
    num_envs, T, iterations = 4, 6, 2
    args = ppo.Args(env_id="coinrun", total_timesteps=iterations * num_envs * T, num_envs=num_envs,
                    num_steps=T, num_minibatches=2, update_epochs=1, channels=(4,), hidden_size=16,
                    eval_every=0, eval_episodes=2, gamma=0.9, gae_lambda=0.8, torch_threads=1)
    train_in(in_tmp, ppo, args)

    (recorded,) = games
    assert len(updates) == iterations
    for iteration, (batch, forwards_before) in enumerate(updates):
        passes = forwards[forwards_before - (T + 1): forwards_before]  # T steps, then V(s_T)
        frames, values, targets = played_rollout(recorded, passes, iteration, T, 0.9, 0.8)
        # The batch is the rollout flattened step by step: row t * num_envs + game.
        assert np.array_equal(batch["obs"].view(T, num_envs, 64, 64, 3).numpy(), frames)
        played_values = batch["values"].view(T, num_envs).double()
        torch.testing.assert_close(played_values, values, rtol=0, atol=1e-6)
        assert values.abs().min() > 1e-3  # targets without V would miss by 100x the tolerance
        returns = batch["returns"].view(T, num_envs).double()
        torch.testing.assert_close(returns, targets, rtol=1e-5, atol=1e-5)


def test_buffer_b_holds_each_rollouts_frames_with_v_targ_a_plus_v(in_tmp, monkeypatch):
    """PPG Algorithm 1: "add all (s_t, V_targ(s_t)) to B", V_targ = A + V of the rollout that played
    s_t. Every game's whole rollout of the phase's iterations enters B once, frames exactly, targets
    equal to a naive GAE sum over the rewards the agent saw plus the values it computed while
    playing (gamma and lambda away from the defaults)."""
    games, forwards = record_play(ppg, monkeypatch)
    phases = []

    def recorded_phase(forward_aux, optimizer, aux_obs, aux_value_targets, *rest):
        phases.append((aux_obs.clone(), aux_value_targets.clone(), len(forwards)))
        return auxiliary_phase(forward_aux, optimizer, aux_obs, aux_value_targets, *rest)

    auxiliary_phase = ppg.auxiliary_phase
    monkeypatch.setattr(ppg, "auxiliary_phase", recorded_phase)
    num_envs, T, n_pi = 4, 6, 2
    args = ppg.Args(env_id="coinrun", total_timesteps=3 * num_envs * T, num_envs=num_envs, num_steps=T,
                    num_minibatches=2, channels=(4,), hidden_size=16, eval_every=0, eval_episodes=2, n_pi=n_pi,
                    e_aux=1, num_aux_rollouts=4, gamma=0.9, gae_lambda=0.8, torch_threads=1)
    train_in(in_tmp, ppg, args)

    (aux_obs, aux_targets, forwards_before), = phases  # one phase, after iteration 2 of 3
    assert forwards_before == n_pi * (T + 1)  # each iteration: T rollout steps and the bootstrap V(s_T)
    (recorded,) = games
    rollouts = []  # every (iteration, game): its frames [T, 64, 64, 3] and V_targ [T]
    for iteration in range(n_pi):
        passes = forwards[iteration * (T + 1): (iteration + 1) * (T + 1)]
        frames, _, targets = played_rollout(recorded, passes, iteration, T, 0.9, 0.8)
        rollouts += [(frames[:, game], targets[:, game]) for game in range(num_envs)]

    assert aux_obs.shape[:2] == aux_targets.shape == (n_pi * num_envs, T)
    unmatched = list(range(len(rollouts)))
    for row in range(len(aux_obs)):  # each of B's rollouts is one of the played ones, each played one is in B once
        matches = [index for index in unmatched if np.array_equal(aux_obs[row].numpy(), rollouts[index][0])
                   and torch.allclose(aux_targets[row].double(), rollouts[index][1], rtol=1e-5, atol=1e-5)]
        assert matches, f"B's rollout {row} is no rollout of the phase with its V_targ = A + V"
        unmatched.remove(matches[0])
    assert not unmatched


# ---------------------------------------------------------------- PPG's auxiliary phase
def paper_heads(agent, obs, arch):
    """pi's logits, V and V_aux as paper 3.6 builds them, from the agent's modules: V_aux a head of
    its own on the policy network's features; V on the value network ('dual'), or on the policy
    network's features with no gradient into them ('detach', the PPG code's one trunk)."""
    hidden = agent.trunk(obs)
    value_hidden = agent.value_trunk(obs) if arch == "dual" else hidden.detach()
    return agent.actor(hidden), agent.critic(value_hidden).squeeze(-1), agent.aux_critic(hidden).squeeze(-1)


def paper_joint_loss(logits, old_logits, values, aux_values, targets, beta_clone):
    """PPG Eq. 3 plus Eq. 2, each sample's terms written out in float64: L_aux = 1/2 (V_aux -
    V_targ)^2, beta_clone KL(pi_old || pi) = beta_clone sum_a pi_old(a) (log pi_old(a) - log pi(a)),
    L_value = 1/2 (V - V_targ)^2, averaged over the samples."""
    terms = []
    for i in range(len(targets)):
        log_pi = torch.log_softmax(logits[i].double(), -1)
        old_log_pi = torch.log_softmax(old_logits[i].double(), -1)
        kl = sum(old_log_pi[a].exp() * (old_log_pi[a] - log_pi[a]) for a in range(len(log_pi)))
        target = targets[i].double()
        terms.append(0.5 * (aux_values[i].double() - target) ** 2 + beta_clone * kl
                     + 0.5 * (values[i].double() - target) ** 2)
    return sum(terms) / len(terms)


def moved_pi_old(obs):
    """A fixed shift of the logits for each frame, up to +-1 per action, read off its first pixels."""
    return obs[:, 0, :15, 0].float() / 127.5 - 1


@pytest.mark.parametrize("arch", ["dual", "detach"])
def test_ppg_auxiliary_phase_takes_the_sgd_steps_of_l_joint_plus_l_value(arch):
    """PPG Algorithm 1's auxiliary phase: pi_old(.|s) stored for all of B at the phase's start, then
    E_aux epochs of one step on L_joint (Eq. 3) plus L_value (Eq. 2), checked against the loss
    written per sample, with beta_clone away from 1 and E_aux = 2 (the second step at a policy that
    the first one moved). At pi = pi_old the KL and its gradient vanish, so neither beta_clone nor
    the KL's direction would show: the network answers the passes without gradient (pi_old's) with
    logits moved by a fixed function of the frame."""
    R, T, beta_clone, lr = 4, 4, 0.37, 0.02
    args = ppg.Args(channels=(4,), hidden_size=16, arch=arch, e_aux=2, num_aux_rollouts=R, beta_clone=beta_clone)
    agent = non_uniform_agent(ppg, args, seed=2)
    generator = torch.Generator().manual_seed(2)
    aux_obs = torch.randint(0, 256, (R, T, 64, 64, 3), dtype=torch.uint8, generator=generator)
    aux_value_targets = 1.0 + torch.randn(R, T, generator=generator)
    reference, start = copy.deepcopy(agent), weights(agent)

    def forward_aux(obs):
        logits, value, aux_value = agent.forward_aux(obs)
        if not torch.is_grad_enabled():
            logits = logits + moved_pi_old(obs)
        return logits, value, aux_value

    stats = ppg.auxiliary_phase(forward_aux, torch.optim.SGD(agent.networks(), lr=lr), aux_obs, aux_value_targets,
                                args)

    obs, targets = aux_obs.flatten(0, 1), aux_value_targets.flatten()
    with torch.no_grad():
        old_logits = paper_heads(reference, obs, arch)[0] + moved_pi_old(obs)
    for epoch in range(args.e_aux):  # one minibatch of all R rollouts: the shuffle does not matter
        logits, values, aux_values = paper_heads(reference, obs, arch)
        loss = paper_joint_loss(logits, old_logits, values, aux_values, targets, beta_clone)
        sgd_step([list(reference.parameters())], loss, lr, args.max_grad_norm)
    assert stats["aux/kl"] > 0.05  # the clone term's gradient is far from 0
    assert_same_step(agent, reference, start)
    assert not torch.equal(start["aux_critic.weight"], weights(agent)["aux_critic.weight"])


# ---------------------------------------------------------------- evaluation on levels that training never plays
def procgen_level(rand_seed, num_levels, start_level, game, episode):
    """Procgen's level draws in closed form: game `game` of a vector env made with `rand_seed`
    plays, in its `episode`-th episode, a level drawn by a generator seeded from rand_seed:
    uniformly from [start_level, start_level + num_levels), or from all 2^31 - 1 level seeds when
    num_levels is 0 (then start_level is ignored). Two vector envs with the same rand_seed and level
    set play the same levels."""
    draw = int(np.random.SeedSequence([rand_seed, game, episode]).generate_state(1)[0])
    if num_levels == 0:
        return draw % (2**31 - 1)
    return start_level + draw % num_levels


class LevelGames:
    """procgen's gym3 env as the scripts' adapter drives it (observe, act, close), whose episodes
    last two steps and which records the level of every episode it starts under `role` ("train" or
    "eval")."""

    def __init__(self, num_envs, rand_seed, num_levels, start_level, role, played):
        self.level = functools.partial(procgen_level, rand_seed, num_levels, start_level)
        self.t, self.episode = np.zeros(num_envs, dtype=int), np.zeros(num_envs, dtype=int)
        self.first = np.ones(num_envs, dtype=bool)
        self.role, self.played = role, played
        for game in range(num_envs):
            played.append((role, self.level(game, 0)))

    def act(self, actions):
        self.t += 1
        self.first = self.t == 2
        for game in np.flatnonzero(self.first):
            self.t[game], self.episode[game] = 0, self.episode[game] + 1
            self.played.append((self.role, self.level(game, self.episode[game])))

    def observe(self):
        frames = np.zeros((len(self.t), 64, 64, 3), dtype=np.uint8)
        return np.zeros(len(self.t), dtype=np.float32), {"rgb": frames}, self.first.copy()

    def close(self):
        pass


LEVEL_RUNS = {  # two iterations, evaluated after each; an odd number of games: one pool, seeded by the run's seed
    "ppo": (ppo, dict(num_steps=4, num_minibatches=1, update_epochs=1, total_timesteps=2 * 3 * 4)),
    "ppg": (ppg, dict(num_steps=4, num_minibatches=1, n_pi=2, e_aux=1, num_aux_rollouts=3,
                      total_timesteps=2 * 3 * 4)),
    "vtrace": (vtrace, dict(unroll_length=4, updates_per_iteration=1, total_timesteps=2 * 3 * 4)),
}


@pytest.mark.parametrize("num_levels, start_level", [(0, 0), (2, 7)], ids=["all-levels", "two-levels"])
@pytest.mark.parametrize("script", LEVEL_RUNS)
def test_evaluation_plays_levels_that_training_never_plays(script, num_levels, start_level, in_tmp, monkeypatch):
    """The Procgen protocol: train on a level set (all levels, or --num-levels N from
    --start-level), evaluate on levels drawn from the full distribution. Whatever the training set,
    no level evaluated at any iteration is one that training played: with all levels, evaluation's
    games must not be seeded like training's."""
    module, flags = LEVEL_RUNS[script]
    played, role = [], ["train"]

    def games(backend, num_envs, seed, env_name, distribution_mode, num_levels=0, start_level=0, num_threads=1):
        return LevelGames(num_envs, seed, num_levels, start_level, role[0], played)

    def evaluation(*arguments, **keywords):
        role[0] = "eval"
        try:
            return evaluate(*arguments, **keywords)
        finally:
            role[0] = "train"

    evaluate = module.evaluate
    monkeypatch.setattr(module, "procgen_backend", lambda choice: "procgen")
    monkeypatch.setattr(module, "make_games", games)
    monkeypatch.setattr(module, "evaluate", evaluation)
    args = module.Args(env_id="coinrun", num_envs=3, channels=(4,), hidden_size=16, eval_every=1, eval_episodes=2,
                       torch_threads=1, num_levels=num_levels, start_level=start_level, **flags)
    train_in(in_tmp, module, args)
    trained = {level for who, level in played if who == "train"}
    evaluated = {level for who, level in played if who == "eval"}
    if num_levels:
        assert trained == set(range(start_level, start_level + num_levels))
    assert len(trained) >= 2 and len(evaluated) >= 4  # two evaluations of two games each
    assert not trained & evaluated


# ---------------------------------------------------------------- schedules and diagnostics
@pytest.mark.parametrize("script", ["ppo", "vtrace"])  # PPG's: the next test
def test_annealed_learning_rate_falls_linearly_to_zero_over_the_run(script, in_tmp, monkeypatch):
    """--anneal-lr: iteration i of N trains at lr (1 - (i - 1) / N), from the full rate down to lr /
    N."""
    module, flags = LEVEL_RUNS[script]
    monkeypatch.setattr(module, "procgen_backend", lambda choice: "procgen")
    monkeypatch.setattr(module, "make_games", lambda backend, num_envs, seed, *arguments, **options: LevelGames(
        num_envs, seed, 0, 0, "train", []))
    flags = {**flags, "total_timesteps": 3 * 3 * 4}
    args = module.Args(env_id="coinrun", num_envs=3, channels=(4,), hidden_size=16, eval_every=0, eval_episodes=1,
                       torch_threads=1, anneal_lr=True, learning_rate=3e-3, **flags)
    run_dir = train_in(in_tmp, module, args)
    with open(f"{run_dir}/metrics.jsonl") as rows:
        rates = [row["charts/learning_rate"] for row in map(json.loads, rows) if "charts/learning_rate" in row]
    assert rates == pytest.approx([3e-3, 2e-3, 1e-3], rel=1e-12)


def test_ppg_anneals_both_phases_learning_rates_over_the_run(in_tmp, monkeypatch):
    """--anneal-lr in PPG: iteration i of N trains at lr (1 - (i - 1) / N) in its policy phase, and the
    auxiliary phase that follows it at the same rate, in every parameter group of both phases'
    optimizers (the PPG code anneals both). 5 iterations, N_pi = 2: phases after iterations 2 and 4."""
    module, flags = LEVEL_RUNS["ppg"]
    monkeypatch.setattr(ppg, "procgen_backend", lambda choice: "procgen")
    monkeypatch.setattr(ppg, "make_games", lambda backend, num_envs, seed, *arguments, **options: LevelGames(
        num_envs, seed, 0, 0, "train", []))
    policy_rates, aux_rates = [], []
    ppo_update, auxiliary_phase = ppg.ppo_update, ppg.auxiliary_phase

    def recorded_update(agent, optimizer, *rest):
        policy_rates.append([group["lr"] for group in optimizer.param_groups])
        return ppo_update(agent, optimizer, *rest)

    def recorded_phase(forward_aux, optimizer, *rest):
        aux_rates.append([group["lr"] for group in optimizer.param_groups])
        return auxiliary_phase(forward_aux, optimizer, *rest)

    monkeypatch.setattr(ppg, "ppo_update", recorded_update)
    monkeypatch.setattr(ppg, "auxiliary_phase", recorded_phase)
    args = ppg.Args(env_id="coinrun", num_envs=3, channels=(4,), hidden_size=16, eval_every=0, eval_episodes=1,
                    torch_threads=1, anneal_lr=True, learning_rate=5e-3, **{**flags, "total_timesteps": 5 * 3 * 4})
    train_in(in_tmp, ppg, args)
    assert policy_rates == [[pytest.approx(5e-3 * (1 - i / 5), rel=1e-12)] * 2 for i in range(5)]
    assert aux_rates == [[pytest.approx(5e-3 * (1 - i / 5), rel=1e-12)] * 2 for i in (1, 3)]


def test_explained_variance_is_one_minus_the_residual_variance_share():
    """1 - Var[R - V] / Var[R]: 1 for perfect values, 0 for values that are the returns' mean, below
    0 for worse."""
    generator = torch.Generator().manual_seed(0)
    returns = torch.randn(50, generator=generator) * 2 + 1
    values = returns + 0.5 * torch.randn(50, generator=generator)
    expected = 1 - np.var((returns - values).numpy(), ddof=1) / np.var(returns.numpy(), ddof=1)
    assert ppo.explained_variance(returns, values) == pytest.approx(expected, rel=1e-5)
    assert ppo.explained_variance(returns, returns) == pytest.approx(1.0)
    assert ppo.explained_variance(returns, torch.full_like(returns, returns.mean())) == pytest.approx(0.0, abs=1e-6)
    assert ppo.explained_variance(returns, -returns) < -1
