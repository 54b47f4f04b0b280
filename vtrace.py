"""IMPALA with V-trace on Procgen (Espeholt et al. 2018, arXiv 1802.01561): an actor thread plays
unrolls with a possibly stale copy of the policy; the learner corrects for that lag with V-trace
(truncated importance weights pi/mu) and steps once per unroll, overlapping as Cleanba (2310.00036).

Run:  python vtrace.py --env-id starpilot          (all flags: python vtrace.py --help)
Read top to bottom: the environment, the network, V-trace, the learner, the actor, then `train`, the
story; the appendix below `train` is plumbing (evaluation, torchrun, logs, checkpoints, signals,
flags, the hand-over of parameters between threads and CUDA streams)."""
import collections
import contextlib
import copy
import datetime
import functools
import glob
import importlib.util
import io
import json
import math
import os
import pickle
import queue
import random
import secrets
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, NamedTuple, Optional, Union

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): no traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the process just ends: nothing exists yet

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
# Now, before any process group: imported later (by torch.optim) gloo's threads may abort the exit.
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F
import tyro
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import RecordEpisodeStatistics


@dataclass
class Args:
    # Algorithm: V-trace and the actor-learner lag. Adam on mean losses, lr, gamma, clip and reward
    # normalization are the PPO script's Procgen settings; IMPALA's Atari ones (RMSProp, lr 6e-4 on
    # summed losses, gamma 0.99, clip 40) are in its paper, Table G.1.
    rho_bar: float = 1.0
    """rho-bar: truncation of the importance weights in V-trace's TD terms; sets the fixed point
    (IMPALA paper: 1)"""
    c_bar: float = 1.0
    """c-bar: truncation of the traces c_s; changes only the contraction speed (IMPALA paper: 1)"""
    pg_rho_bar: float = 1.0
    """truncation of the policy gradient's importance weight (scalable_agent and torchbeast: 1)"""
    vtrace_lambda: float = 1.0
    """lambda of the IMPALA paper's Remark 2, multiplied into the traces c_s (scalable_agent and
    torchbeast: none, 1)"""
    correction: Literal["vtrace", "none"] = "vtrace"
    """off-policy correction: V-trace, or none (importance weights fixed to 1: the unrolls are
    learned from as if on-policy, the baseline V-trace improves on; IMPALA paper Table 2)"""
    unroll_length: int = 20
    """T: steps in each actor's unroll (IMPALA paper Table G.1: 20)"""
    updates_per_iteration: int = 25
    """learner updates per iteration, the unit of logging, evaluation and checkpoints
    (25 x 32 x 20 = 16,000 steps); a signal stops at the next update, saving the last whole iteration"""
    max_policy_lag: int = 1
    """k: the actor waits before an unroll whose parameters would be more than k updates old when
    trained; 0 is synchronous, 1 lets acting and learning overlap with a lag of at most one update
    (Cleanba's IMPALA)"""
    deterministic_lag: bool = False
    """play unroll n with the parameters of exactly k = max_policy_lag updates before (version 0 for
    the first k), not the newest available: the same seed gives the same run on CPU, at any speed of
    actor and learner"""
    baseline_cost: float = 0.5
    """weight of the value (baseline) loss (IMPALA paper Table G.1 and torchbeast: 0.5)"""
    entropy_cost: float = 0.01
    """weight of the entropy bonus (IMPALA paper Table G.1: 0.01, as CleanRL's Procgen PPO)"""
    learning_rate: float = 5e-4
    """Adam learning rate"""
    anneal_lr: bool = False
    """decay the learning rate linearly to 0 over the run"""
    gamma: float = 0.999
    """discount factor"""
    max_grad_norm: float = 0.5
    """gradient-norm clip, of each network on its own (PPG's code: none, inf; CleanRL's PPG: 0.5 jointly)"""
    adam_eps: float = 1e-5
    """Adam epsilon (baselines PPO: 1e-5; the PPG code and CleanRL's PPG: PyTorch's default 1e-8)"""
    reward_norm_gamma: float = 0.999
    """discount of the running return whose std divides the rewards (CleanRL: 0.999; the PPG code: 0.99)"""
    reward_clip: float = 10.0
    """clip normalized rewards to [-reward_clip, reward_clip]"""
    channels: tuple[int, ...] = (16, 32, 32)
    """IMPALA-CNN channels, one conv sequence per entry"""
    hidden_size: int = 256
    """width of the dense layer after the convolutions"""
    init: Literal["default", "normed", "glorot"] = "default"
    """weight init: PyTorch default + orthogonal heads (CleanRL PPO), the PPG code's per-unit normed init, or
    glorot: baselines' TensorFlow default (glorot-uniform trunk, zero biases, the same heads)"""
    # Environment
    env_id: str = "starpilot"
    """the Procgen game, one of the 16 in PROCGEN_RANGES"""
    distribution_mode: Literal["easy", "hard", "extreme", "memory", "exploration"] = "easy"
    """Procgen difficulty (the CleanRL and train-procgen 25M-step results use easy)"""
    num_levels: int = 0
    """number of training levels; 0 trains on the full distribution (unlimited levels)"""
    start_level: int = 0
    """first training level seed (evaluation draws from the unbounded level distribution: see `evaluate`)"""
    env_backend: Literal["auto", "procgen", "envpool"] = "auto"
    """the games' implementation, both built from Procgen 0.10.7's C++ code: procgen-mirror (the official
    package; CPython 3.11/3.12 on Linux x86-64) or EnvPool (elsewhere); auto: the one installed"""
    # 32, not PPO's 64: one actor thread steps all games and its unroll of them is one learner batch
    # (one update per unroll keeps the lag exact), so 32 games = IMPALA's 32 unrolls (Table G.1).
    num_envs: int = 32
    """games played at once, over all ranks; each rank plays its share in two pools of equal size
    (one pool where the share is odd)"""
    # The run: seed and length; evaluation; logs; checkpoints; speed
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the experiment's name, part of the run's name"""
    seed: int = 1
    """seed of python, numpy, torch and the games; the same seed gives the same run on a CPU with
    --deterministic-lag (otherwise the timing of actor and learner decides each unroll's lag)"""
    total_timesteps: int = 25_000_000
    """environment steps of the whole run (rounded down to whole iterations)"""
    torch_deterministic: bool = True
    """make cuDNN pick deterministic algorithms: a GPU run is then bit-reproducible, at the cost
    of cuDNN's autotuner, which --no-torch-deterministic turns on (it times the convolution
    algorithms for these shapes and keeps the fastest). No effect on a CPU"""
    cuda: bool = True
    """use the GPU when one is available"""
    eval_every: int = 100
    """evaluate on held-out levels every this many iterations and at the end (0: only at the end)"""
    eval_episodes: int = 32
    """evaluation episodes, one per env so that short episodes are not over-counted"""
    capture_video: bool = False
    """film one episode of each evaluation to runs/<run>/videos/*.mp4"""
    track: bool = False
    """log to Weights & Biases too"""
    wandb_project: str = "rl-reference"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (user or team)"""
    wandb_mode: Literal["online", "offline"] = "online"
    """'offline': log to ./wandb without an account (`wandb sync` later)"""
    save_model: bool = False
    """write runs/<run>/checkpoint.pt every --save-every iterations and at the end"""
    save_every: int = 128
    """iterations between checkpoints (with --save-model)"""
    resume: Optional[str] = None
    """continue the run of this checkpoint with its flags, bit for bit as if never stopped, but for
    the games in progress (fresh ones) and the lag of the actor's first unrolls (docs/reliability.md)"""
    eval_only: bool = False
    """only evaluate the agent of --checkpoint (with --capture-video: and film it)"""
    checkpoint: Optional[str] = None
    """the checkpoint that --eval-only evaluates"""
    env_threads: int = 0
    """procgen worker threads, split between the two pools of games where --num-envs is even (0: one
    on a CPU, the cores on a GPU: see `start_run`; each pool has at least one)"""
    torch_threads: int = 0
    """torch CPU threads (0: one on a GPU; on a CPU a quarter of the cores, at least one, for the actor and
    the learner side by side in the half of the cores that the Procgen scripts give torch: a team of
    threads waits for its slowest member, and on a busy machine teams as large as the machine collapse)"""
    channels_last: bool = True
    """NHWC memory layout for the convolutions (faster on GPUs and on CPUs)"""
    compile: bool = False
    """torch.compile the network (pays off on long GPU runs; the first iterations are slow)"""
    amp: bool = False
    """bfloat16 autocast of the forward passes, losses in float32 (off, as in the papers)"""


def make_env(args, num_envs):
    """Training envs. Episode statistics record raw game scores; the agent sees rewards divided by
    the std of a running discounted return (`NormalizeReward`) and clipped, as Procgen's baselines."""
    # Two pools of games, each with half the threads, where they split evenly (--overlap-games on or
    # off then plays the same levels).
    halves = 2 - num_envs % 2
    envs = ProcgenVecEnv(num_envs, args.env_id, args.distribution_mode, args.env_backend, halves, num_levels=args.num_levels,
                         start_level=args.start_level, num_threads=max(1, args.env_threads // halves))
    return NormalizeReward(RecordEpisodeStatistics(envs), gamma=args.reward_norm_gamma, clip=args.reward_clip)


class NormalizeReward(gym.vector.VectorWrapper):
    """Rewards divided by the running std of each game's discounted return G_t = r_t + gamma G_{t-1}
    (the Procgen baselines, the PPG code's RewardNormalizer, gym 0.23 in CleanRL), then clipped to
    [-clip, clip]. Every step's G updates the statistics `return_rms`, and G restarts after an
    episode's last step, so G_T keeps the episode's history (gymnasium 1.x's NormalizeReward
    restarts it at that step: G_T = r_T). The clip is one numpy call here, as in the baselines'
    VecNormalize: gymnasium's vector ClipReward clips each game's reward in a Python loop."""

    def __init__(self, env, gamma, clip, epsilon=1e-8):
        super().__init__(env)
        self.return_rms = gym.wrappers.utils.RunningMeanStd(shape=())
        self.returns = np.zeros(self.num_envs)
        self.gamma, self.clip, self.epsilon = gamma, clip, epsilon

    def reset(self, *, seed=None, options=None):
        self.returns = np.zeros(self.num_envs)  # fresh games
        return self.env.reset(seed=seed, options=options)

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(actions)
        self.returns = self.returns * self.gamma + reward
        self.return_rms.update(self.returns)
        reward = np.clip(reward / np.sqrt(self.return_rms.var + self.epsilon), -self.clip, self.clip)
        self.returns[terminated | truncated] = 0.0  # SAME_STEP autoreset: the next step is a new game
        return obs, reward, terminated, truncated, info


def normed_(layer, scale):
    """The PPG code's "normed" init: each output unit's weight vector gets L2 norm `scale`, biases 0."""
    with torch.no_grad():
        weight = layer.weight.view(layer.weight.shape[0], -1)
        weight.mul_(scale / weight.norm(dim=1, keepdim=True))
        layer.bias.zero_()
    return layer


def init_layer(layer, init, normed_scale):
    """A trunk layer's --init: PyTorch's default (CleanRL's), the PPG code's normed, or glorot:
    TensorFlow's default in baselines' IMPALA-CNN (train-procgen's PPO), zero biases."""
    if init == "normed":
        normed_(layer, normed_scale)
    elif init == "glorot":
        nn.init.xavier_uniform_(layer.weight)
        nn.init.zeros_(layer.bias)
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels, init, scale):
        super().__init__()
        self.conv0 = init_layer(nn.Conv2d(channels, channels, 3, padding=1), init, scale)
        self.conv1 = init_layer(nn.Conv2d(channels, channels, 3, padding=1), init, scale)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ImpalaCNN(nn.Module):
    """IMPALA's deep network (Espeholt et al. 2018, Fig. 3): per entry of `channels` a conv, a
    stride-2 max-pool, two residual blocks; then a ReLU dense layer. Takes uint8 NHWC frames."""

    def __init__(self, channels, hidden_size, init, channels_last=True):
        super().__init__()
        self.channels_last = channels_last
        # The PPG code's normed residual scale: the stacks share the variance, 2 blocks of 2 convs.
        residual_scale = (1 / len(channels) ** 0.5 / 2**0.5) ** 0.5
        layers = []
        in_channels = 3
        size = 64
        for out_channels in channels:
            conv = init_layer(nn.Conv2d(in_channels, out_channels, 3, padding=1), init, 1.0)
            layers += [conv, nn.MaxPool2d(3, stride=2, padding=1), ResidualBlock(out_channels, init, residual_scale),
                       ResidualBlock(out_channels, init, residual_scale)]
            in_channels = out_channels
            size = (size + 1) // 2
        dense = init_layer(nn.Linear(in_channels * size * size, hidden_size), init, 1.4)
        self.net = nn.Sequential(*layers, nn.Flatten(), nn.ReLU(), dense, nn.ReLU())

    def forward(self, obs):
        # NHWC -> NCHW by a permute keeps the NHWC strides, i.e. the input is already channels_last.
        x = obs.permute(0, 3, 1, 2).float() / 255.0
        return self.net(x if self.channels_last else x.contiguous())


def make_head(in_features, out_features, std, init):
    """Heads: orthogonal init with a small std for the policy (near-uniform first policy), or normed 0.1."""
    head = nn.Linear(in_features, out_features)
    if init == "normed":
        return normed_(head, 0.1)
    nn.init.orthogonal_(head.weight, std)
    nn.init.zeros_(head.bias)
    return head


class Agent(nn.Module):
    """The actor-critic: one IMPALA-CNN trunk shared by the policy and value heads."""

    def __init__(self, args, num_actions):
        super().__init__()
        self.trunk = ImpalaCNN(args.channels, args.hidden_size, args.init, args.channels_last)
        self.actor = make_head(args.hidden_size, num_actions, 0.01, args.init)
        self.critic = make_head(args.hidden_size, 1, 1.0, args.init)

    def forward(self, obs):
        hidden = self.trunk(obs)
        return self.actor(hidden), self.critic(hidden).squeeze(-1)


def sample_action(logits, generator=None):
    """Gumbel-max: argmax(logits + Gumbel noise) ~ softmax(logits), with no host sync; or `generator`'s."""
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=logits.dtype)
    return torch.argmax(logits - torch.log(-torch.log(uniform)), dim=-1)


# ---- V-trace (IMPALA paper, Section 4.1 and Remark 1) ----
class VTraceReturns(NamedTuple):
    vs: torch.Tensor  # v_s, the V-trace value targets, [T, B, ...]
    pg_advantages: torch.Tensor  # rho^pg_s * (r_s + gamma_s * v_{s+1} - V(x_s)), [T, B, ...]


class VTraceFromLogitsReturns(NamedTuple):
    vs: torch.Tensor
    pg_advantages: torch.Tensor
    log_rhos: torch.Tensor  # log pi(a_s|x_s) - log mu(a_s|x_s)
    behaviour_action_log_probs: torch.Tensor
    target_action_log_probs: torch.Tensor


def action_log_probs(policy_logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """log softmax(policy_logits)[actions]: [T, B, A], [T, B] -> [T, B]. log_softmax, not
    log(softmax), so tiny probabilities do not underflow to log(0)."""
    if policy_logits.shape[:-1] != actions.shape:
        raise ValueError(f"actions: expected shape policy_logits.shape[:-1] = {tuple(policy_logits.shape[:-1])} "
                         f"([T, B] for logits [T, B, A]), got {tuple(actions.shape)}")
    return F.log_softmax(policy_logits, dim=-1).gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value,
                            clip_rho_threshold: Optional[float] = 1.0, clip_c_threshold: Optional[float] = 1.0,
                            clip_pg_rho_threshold: Optional[float] = 1.0,
                            lambda_: Union[float, torch.Tensor] = 1.0) -> VTraceReturns:
    """V-trace targets and policy-gradient advantages from log importance weights
    log(pi(a_s|x_s) / mu(a_s|x_s)).

    Time-major: log_rhos, discounts (gamma_s = gamma * (1 - done_s)), rewards, values are
    [T, B, ...] with the rank of values (trailing dims may be 1 and broadcast); bootstrap_value is
    V(x_T), shape values.shape[1:]. Thresholds: rho_bar (clip_rho_threshold) clips the TD weight and
    sets the fixed point, c_bar (clip_c_threshold) clips the trace and only sets the contraction
    speed (the paper's analysis assumes rho_bar >= c_bar), and clip_pg_rho_threshold clips the
    policy-gradient weight; None disables a clip. lambda_ is a float, a 0-dim tensor or a per-step
    [T, B, ...] tensor (Remark 2). Outputs are constants: no gradient flows through them.

    lambda convention (SEED RL): lambda multiplies only the trace, c_s = lambda * min(c_bar, rho_s),
    and the pg target keeps v_{s+1}. Consequences: on-policy, vs - V equals GAE(gamma, lambda), but
    pg_advantages equals GAE only at lambda = 1 (rlax instead uses lambda * v_{s+1} + (1 - lambda) *
    V(x_{s+1}) in the pg target), and a per-step lambda_s = 0 cuts the trace of vs but not the pg
    target. To truncate an episode at step s, fold the time-out bootstrap into the reward,
    r_s += gamma * V(final obs), and set discounts[s] = 0.
    """
    check_vtrace_inputs(log_rhos, discounts, rewards, values, bootstrap_value, lambda_)

    def clip(x, threshold):  # min(threshold, x); None means no truncation
        return x if threshold is None else torch.clamp(x, max=threshold)

    rhos = torch.exp(log_rhos)
    clipped_rhos = clip(rhos, clip_rho_threshold)  # rho_bar_s = min(rho_bar, rho_s): the TD weight
    cs = lambda_ * clip(rhos, clip_c_threshold)  # c_s = lambda * min(c_bar, rho_s): the traces
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)  # V(x_{s+1})
    # delta_s V = rho_bar_s * (r_s + gamma_s V(x_{s+1}) - V(x_s))  (Eq. 1)
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)
    trace_decay = (discounts * cs).expand_as(deltas)
    # Remark 1: v_s - V(x_s) = delta_s V + gamma_s c_s (v_{s+1} - V(x_{s+1})), accumulated backwards
    # from 0 after step T-1: O(T) instead of Eq. 1's O(T^2) double sum (a Python loop: T is small).
    running = torch.zeros_like(deltas[0])
    vs_minus_v = []
    for s in reversed(range(deltas.shape[0])):
        running = deltas[s] + trace_decay[s] * running
        vs_minus_v.append(running)
    vs = values + torch.stack(vs_minus_v[::-1], dim=0)
    # Section 4.2: the pg target is r_s + gamma_s v_{s+1} (the next state's V-trace target, v_T :=
    # bootstrap), an estimate of Q^{pi_rho_bar}(x_s, a_s) (App. A.3); with V(x_{s+1}) instead it
    # works worse (Appendix E.3).
    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    pg_advantages = clip(rhos, clip_pg_rho_threshold) * (rewards + discounts * vs_t_plus_1 - values)
    return VTraceReturns(vs=vs.detach(), pg_advantages=pg_advantages.detach())


@torch.no_grad()
def from_logits(behaviour_policy_logits, target_policy_logits, actions, discounts, rewards, values,
                bootstrap_value, clip_rho_threshold: Optional[float] = 1.0,
                clip_c_threshold: Optional[float] = 1.0, clip_pg_rho_threshold: Optional[float] = 1.0,
                lambda_: Union[float, torch.Tensor] = 1.0) -> VTraceFromLogitsReturns:
    """V-trace from behaviour (mu) and target (pi) logits [T, B, A] and the actions [T, B] taken by
    mu; the other arguments are as in from_importance_weights. All outputs are constants: recompute
    log pi(a) with gradient for the loss (vtrace_loss does)."""
    behaviour_shape, target_shape = behaviour_policy_logits.shape, target_policy_logits.shape
    if behaviour_shape != target_shape or len(target_shape) != 3:
        raise ValueError(f"behaviour_policy_logits, target_policy_logits: expected the same shape "
                         f"[T, B, A], got {tuple(behaviour_shape)} and {tuple(target_shape)}")
    behaviour_log_probs = action_log_probs(behaviour_policy_logits, actions)
    target_log_probs = action_log_probs(target_policy_logits, actions)
    log_rhos = target_log_probs - behaviour_log_probs  # log(pi/mu): no overflow from exp, divide
    vtrace_returns = from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value,
                                             clip_rho_threshold, clip_c_threshold, clip_pg_rho_threshold,
                                             lambda_)
    return VTraceFromLogitsReturns(*vtrace_returns, log_rhos, behaviour_log_probs, target_log_probs)


def vtrace_loss(target_logits, values, actions, vs, pg_advantages, baseline_cost: float,
                entropy_cost: float, reduction: str = "sum"):
    """IMPALA's learner loss
        -sum log pi(a_s|x_s) A_s + b * 0.5 * sum (v_s - V(x_s))^2 - e * sum H(pi(.|x_s)).
    vs and pg_advantages are targets (detached), so values get gradient only from the baseline term.
    reduction "sum" over T and B as in the paper (Table D.1; the lr 6e-4 assumes it) or "mean" (T*B
    times smaller). Returns (total, pg_loss, baseline_loss, entropy); baseline_loss includes
    baseline_cost, entropy is the bare entropy (the total subtracts entropy_cost * entropy)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    reduce = torch.sum if reduction == "sum" else torch.mean
    log_probs = F.log_softmax(target_logits, dim=-1)
    pg_loss = reduce(-action_log_probs(target_logits, actions) * pg_advantages.detach())
    baseline_loss = baseline_cost * 0.5 * reduce((vs.detach() - values) ** 2)
    entropy = reduce(-(log_probs.exp() * log_probs).sum(-1))
    return pg_loss + baseline_loss - entropy_cost * entropy, pg_loss, baseline_loss, entropy


# ---- The actor's unroll and the learner's step ----
@torch.no_grad()
def collect_unroll(policy, envs, obs, unroll_length, autocast=contextlib.nullcontext,
                   generator=None):
    """IMPALA's actor: T = unroll_length steps of the behaviour policy mu in a vector env, from
    frames `obs` [B, ...]. Returns time-major tensors, aligned as V-trace reads them (the learner
    pairs index t of every field):
      obs[t], t < T         x_t, the frame mu acted on; obs[T] = x_T, the frame after the last
                            action, for V(x_T)
      actions[t]            a_t ~ mu(.|x_t), and behaviour_logits[t] the logits of mu(.|x_t)
      rewards[t], dones[t]  what step(a_t) returned: the reward credited to (x_t, a_t), and whether
                            that step ended the episode (x_{t+1} is then the next episode's first
                            frame, so gamma_t = 0 cuts there)
    plus `episodes`, the raw (return, length) of each episode that ended during the unroll. Actions
    are sampled with `generator` (the actor's own: nothing on the learner's thread moves its stream)."""
    steps = collections.defaultdict(list)
    episodes = []
    for _ in range(unroll_length):
        with autocast():
            logits = policy(obs)[0].float()
        action = sample_action(logits, generator)
        # .cpu() waits for this thread's stream only
        frames, reward, terminated, truncated, info = envs.step(action.cpu().numpy())
        rewards = torch.as_tensor(reward, dtype=torch.float32, device=obs.device)
        dones = torch.as_tensor(terminated | truncated, dtype=torch.float32, device=obs.device)
        step = {"obs": obs, "actions": action, "behaviour_logits": logits, "rewards": rewards, "dones": dones}
        for key, value in step.items():
            steps[key].append(value)
        obs = torch.as_tensor(frames, device=obs.device)
        if "_episode" in info:  # every episode that ended in this step
            finished = info["_episode"]
            episodes += zip(info["episode"]["r"][finished].tolist(), info["episode"]["l"][finished].tolist())
    steps["obs"].append(obs)
    unroll = {key: torch.stack(values) for key, values in steps.items()}
    return dict(unroll, episodes=episodes)


UNROLL_TENSORS = ("obs", "actions", "behaviour_logits", "rewards", "dones")


def clip_grad_norms(optimizer, max_grad_norm):
    """Clip the gradient norm of each parameter group on its own (PPO: one group; PPG: one per
    network: the value network's gradient cannot shrink the policy's step). Returns the norms before."""
    return torch.stack([nn.utils.clip_grad_norm_(group["params"], max_grad_norm) for group in optimizer.param_groups])


def vtrace_backward(policy, optimizer, batch, args, autocast):
    """The IMPALA learner's loss and gradients on unrolls laid out as `collect_unroll` returns them
    ([T+1, B] frames, [T, B] the rest); the caller steps the optimizer. pi's logits and values are
    recomputed on every frame, x_T included: the bootstrap V(x_T) comes from the learner, not from
    the actor. Losses are means over T x B, not the paper's sums: Adam divides the gradient's scale
    away, so the choice matters only for the gradient-norm clip and Adam's epsilon, whose PPO values
    assume mean-sized gradients (a sum is T x B = 640 times larger and would be clipped at every
    step). Returns the update's statistics as tensors."""
    T, B = batch["actions"].shape
    with autocast():
        logits, values = policy(batch["obs"].flatten(0, 1))
    logits = logits.float().view(T + 1, B, -1)
    values = values.float().view(T + 1, B)
    # log rho_s = log pi(a_s|x_s) - log mu(a_s|x_s), in log space (no overflow from exp then divide)
    log_rhos = (action_log_probs(logits[:-1].detach(), batch["actions"])
                - action_log_probs(batch["behaviour_logits"], batch["actions"]))
    # --correction none: every importance weight 1, the unrolls taken as on-policy (IMPALA Table 2)
    used_log_rhos = log_rhos if args.correction == "vtrace" else torch.zeros_like(log_rhos)
    # gamma_s = gamma * (1 - done_s): the step that ended an episode does not look past it
    # (Procgen has no time-outs)
    discounts = args.gamma * (1 - batch["dones"])
    vtrace_returns = from_importance_weights(used_log_rhos, discounts, batch["rewards"], values[:-1],
                                             values[-1], args.rho_bar, args.c_bar, args.pg_rho_bar,
                                             args.vtrace_lambda)
    vs = vtrace_returns.vs
    loss, pg_loss, value_loss, entropy = vtrace_loss(
        logits[:-1], values[:-1], batch["actions"], vs, vtrace_returns.pg_advantages, args.baseline_cost,
        args.entropy_cost, reduction="mean")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    average_gradients(optimizer)  # data parallel: the mean over all ranks' unrolls
    grad_norms = clip_grad_norms(optimizer, args.max_grad_norm)
    if not torch.isfinite(grad_norms).all():  # one host sync per update: stop before NaN weights
        raise FloatingPointError(f"non-finite loss {loss.item()} or gradient")
    return {"policy_loss": pg_loss.detach(), "value_loss": value_loss.detach(), "entropy": entropy.detach(),
            "approx_kl": (log_rhos.exp() - 1 - log_rhos).mean(),  # KL(mu || pi) on mu's actions
            "explained_variance": 1 - (vs - values[:-1].detach()).var() / vs.var()}


# ---- The actor: its own thread (and CUDA stream), fed parameters by the learner ----
class Actor:
    """IMPALA's actor, one thread of this process (procgen is not fork-safe; no copies between
    processes). It steps all games as one batch, behind one reward normalizer, with its own copy of
    the network, its own random generator and, on a GPU, its own CUDA stream, so its forward passes
    and the learner's backward passes can run at the same time (in Python the two threads take
    turns under the GIL; procgen's stepping and torch's kernels run without it).

    Update n trains on unroll n, so the lag of unroll n is n minus the version (updates so far) of
    the parameters it was played with. With --max-policy-lag k the actor starts unroll n only once
    version n - k exists: no unroll is older than k, none is dropped, k = 0 is synchronous. k = 1,
    learner slower (each Ln publishes v(n+1)):

        actor    P0 (v0) | P1 (v0) | wait ....... | P2 (v1) | wait ....... | P3 (v2) ...
        learner  wait .. | L0 on P0 ............. | L1 on P1 ............. | L2 on P2 ...

    --deterministic-lag: unroll n is always played with version n - k exactly. Parameters cross
    from the learner to the actor in `PolicySnapshots`, unrolls back in a queue. The games are
    reset with `seed`, which also seeds the actor's generator; `first_version` is the learner's
    first (a resumed run's updates so far)."""

    def __init__(self, agent, envs, snapshots, args, first_version, seed):
        self.network = copy.deepcopy(agent)  # loaded from `snapshots` before every unroll
        self.envs, self.snapshots, self.args = envs, snapshots, args
        self.first_version, self.seed = first_version, seed
        self.device = next(agent.parameters()).device
        self.autocast = functools.partial(torch.autocast, self.device.type, torch.bfloat16, enabled=args.amp)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.unrolls = queue.Queue()  # at most k unrolls: the actor waits for parameters
        self.stopping = threading.Event()
        self.errors = []  # an exception of the actor's, for the learner to raise
        self.thread = threading.Thread(target=self.run, name="actor", daemon=True)

    def start(self):
        self.thread.start()

    def run(self):
        try:
            with on_stream(self.stream):  # on GPU, also this thread's device (see `on_stream`)
                self.play()
        except BaseException as error:  # the learner re-raises it: the run stops with its message
            self.errors.append(error)

    def play(self):
        """Play unroll n with parameters at most k updates old (exactly k with --deterministic-lag);
        repeat until stopped."""
        args = self.args
        obs = torch.as_tensor(self.envs.reset(seed=self.seed)[0], device=self.device)
        unroll_index = self.first_version
        while True:
            wait_start = time.time()
            oldest = max(unroll_index - args.max_policy_lag, self.first_version)
            version = self.snapshots.load_into(self.network, oldest, args.deterministic_lag, self.stopping)
            if version is None:  # stopped while waiting
                return
            play_start = time.time()
            unroll = collect_unroll(self.network, self.envs, obs, args.unroll_length, self.autocast,
                                    self.generator)
            obs = unroll["obs"][-1]
            # The normalizer between unrolls: what a checkpoint after this unroll's update holds.
            unroll.update(version=version, reward_rms=reward_statistics(self.envs),
                          ready=stream_event(self.device), actor_wait=play_start - wait_start,
                          actor_play=time.time() - play_start)
            self.unrolls.put(unroll)
            unroll_index += 1

    def next_unroll(self):
        """The learner's end of the queue, on the learner's thread: the next unroll, once the
        learner's stream waits for the actor's to have written it. An actor's exception stops the
        run here."""
        while not self.errors:
            try:
                unroll = self.unrolls.get(timeout=0.1)
            except queue.Empty:
                continue
            wait_for(unroll["ready"], [unroll[key] for key in UNROLL_TENSORS])
            return unroll
        raise self.errors[0]

    def close(self):
        """The actor finishes its unroll (or its wait for parameters) and returns; then its stream's
        work is waited for. Bounded and never raises (see `end_thread`): the games and the process
        group are closed after it (`close_run`)."""
        self.stopping.set()
        end_thread(self.thread, self.stream)


def train(args):
    run = start_run(args)  # flags checked, torchrun, device, seeds, threads, the run's folder and log
    args, device = run.args, run.device  # a resumed run: its checkpoint's flags
    actor_learner_threads(run)  # on a CPU the actor's and the learner's forward passes share the cores
    # One update per unroll of all games: an iteration is updates_per_iteration unrolls.
    steps_per_iteration = args.updates_per_iteration * args.num_envs * args.unroll_length
    num_iterations = count_iterations(args, steps_per_iteration, device)
    autocast = functools.partial(torch.autocast, device.type, torch.bfloat16, enabled=args.amp)
    agent = Agent(args, num_actions=15).to(device)
    if args.channels_last:
        agent = agent.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    envs = make_env(args, args.num_envs // run.world_size)  # this rank's games, all stepped by its actor
    start_iteration = restore(run, agent, {"optimizer": optimizer}, envs)
    policy = torch.compile(agent) if args.compile else agent  # the same weights
    if args.eval_only:  # the checkpoint's agent on held-out levels: one row, one line
        return evaluate_checkpoint(run, agent, envs)

    # version: the learner's updates so far, the number of the parameters it publishes; update n
    # trains on unroll n.
    version = (start_iteration - 1) * args.updates_per_iteration
    reward_rms = reward_statistics(envs)  # the normalizer as the last unroll trained on left it
    snapshots = PolicySnapshots(keep=args.max_policy_lag + 1 if args.deterministic_lag else 1)
    snapshots.publish(version, agent.parameters(), device)
    # New episodes in fresh games, seeded by (seed, iteration, rank): a resumed run replays no level.
    actor = Actor(agent, envs, snapshots, args, version, game_seed(args.seed, start_iteration, run.rank))
    global_step = (start_iteration - 1) * steps_per_iteration
    # A signal stops the run at the next update, saving the last whole iteration; leaving the block
    # stops the actor, then closes the games.
    with StopOnSignal(run, closing=(actor, envs)) as stop:
        # Actor: from here on a thread plays unrolls of T steps in all games with the latest
        # parameters the learner has published (mu, possibly a few updates old) and queues them.
        actor.start()
        # Learner: one V-trace update per unroll, in the order the actor played them.
        for iteration in range(start_iteration, num_iterations + 1):
            if args.anneal_lr:  # linearly to 0 over the run
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (iteration - 1) / num_iterations)
            lags, update_stats, episodes = [], [], []
            times = collections.Counter()
            for _ in range(args.updates_per_iteration):
                stop.check()  # after a signal: raises Interrupted (this iteration's updates are dropped)
                # 1. Take the next unroll from the actor's queue (waiting if it is still playing it).
                wait_start = time.perf_counter()
                unroll = actor.next_unroll()
                lags.append(version - unroll["version"])  # updates between mu's parameters and now
                episodes += unroll["episodes"]

                # 2. V-trace targets and one gradient step on the unroll; then publish the new
                # parameters as version + 1, for the actor's next unroll.
                learn_start = time.perf_counter()
                update_stats.append(vtrace_backward(policy, optimizer, unroll, args, autocast))
                optimizer.step()
                version += 1
                snapshots.publish(version, agent.parameters(), device)
                reward_rms = unroll["reward_rms"]  # the normalizer as this unroll left it (the actor is ahead)
                times.update(wait=learn_start - wait_start, learn=time.perf_counter() - learn_start,
                             actor_wait=unroll["actor_wait"], actor_play=unroll["actor_play"])
            global_step += steps_per_iteration

            # 3. Log (losses: means over the iteration's updates; the lags of its unrolls); then
            # evaluate, save a checkpoint and stop where the flags or a signal ask.
            stats = {**mean_over_updates(update_stats), **policy_lag_columns(lags, args.max_policy_lag),
                     **{f"time/{key}": seconds for key, seconds in times.items()},
                     "charts/learning_rate": optimizer.param_groups[0]["lr"]}
            log_iteration(run, iteration, global_step, episodes, stats)
            if args.eval_every and iteration % args.eval_every == 0 or iteration == num_iterations:
                evaluate_and_log(run, agent, iteration, global_step)
            state = checkpoint_state(run, iteration, agent, optimizer, envs, reward_rms)
            stop.end_iteration(state, last=iteration == num_iterations)
    return run.dir


# ---- Appendix: plumbing ----
# (R_min, R_max) per game for the normalized score, easy and hard: train-procgen's constants.py.
PROCGEN_RANGES = {
    "bigfish": {"easy": (1, 40), "hard": (0, 40)}, "bossfight": {"easy": (0.5, 13), "hard": (0.5, 13)},
    "caveflyer": {"easy": (3.5, 12), "hard": (2, 13.4)}, "chaser": {"easy": (0.5, 13), "hard": (0.5, 14.2)},
    "climber": {"easy": (2, 12.6), "hard": (1, 12.6)}, "coinrun": {"easy": (5, 10), "hard": (5, 10)},
    "dodgeball": {"easy": (1.5, 19), "hard": (1.5, 19)}, "fruitbot": {"easy": (-1.5, 32.4), "hard": (-0.5, 27.2)},
    "heist": {"easy": (3.5, 10), "hard": (2, 10)}, "jumper": {"easy": (1, 10), "hard": (1, 10)},
    "leaper": {"easy": (1.5, 10), "hard": (1.5, 10)}, "maze": {"easy": (5, 10), "hard": (4, 10)},
    "miner": {"easy": (1.5, 13), "hard": (1.5, 20)}, "ninja": {"easy": (3.5, 10), "hard": (2, 10)},
    "plunder": {"easy": (4.5, 30), "hard": (3, 30)}, "starpilot": {"easy": (2.5, 64), "hard": (1.5, 35)},
}


def normalized_score(env_id, distribution_mode, episodic_return):
    """(R - R_min) / (R_max - R_min); None for modes without published ranges."""
    if distribution_mode not in PROCGEN_RANGES[env_id]:
        return None
    low, high = PROCGEN_RANGES[env_id][distribution_mode]
    return (episodic_return - low) / (high - low)


def evaluate_and_log(run, agent, iteration, global_step):
    """Held-out levels, the episodes shared among the ranks: a row and a line; with
    --capture-video rank 0 films its first episode."""
    args = run.args
    video = None
    if args.capture_video and run.rank == 0:
        video = os.path.join(run.dir, "videos", f"eval_{iteration:05d}.mp4")
    start = time.perf_counter()
    num_episodes = len(range(run.rank, args.eval_episodes, run.world_size))
    seed = game_seed(args.seed, iteration, run.rank, evaluation=True)
    eval_return = float(np.mean(gather(evaluate(agent, args, run.device, num_episodes, seed, video))))
    score = normalized_score(args.env_id, args.distribution_mode, eval_return)
    run.logger.log({"global_step": global_step, "iteration": iteration, "eval/episodic_return": eval_return,
                    "eval/normalized_score": score, "time/eval": time.perf_counter() - start}, video)
    print(f"eval @ {global_step:,} steps: return {eval_return:.2f} over {args.eval_episodes} episodes"
          + (f", normalized score {score:.3f}" if score is not None else "") + (f", video {video}" if video else ""))


def evaluate_checkpoint(run, agent, envs):
    """--eval-only: the checkpoint's agent, one row and one line; then the run is closed."""
    evaluate_and_log(run, agent, run.checkpoint["iteration"], run.checkpoint["global_step"])
    close_run(run, (envs,))
    restore_signal_handlers(run)
    return run.dir


@torch.no_grad()
def evaluate(agent, args, device, num_episodes, seed, video_path=None):
    """Raw returns of the stochastic policy, one episode per env, on levels drawn from the unbounded
    level distribution (num_levels=0; procgen then ignores start_level): with --num-levels N > 0
    these are levels it did not train on, up to a vanishing chance (as train-procgen's test worker);
    with N = 0 training covers them all."""
    if num_episodes == 0:  # more ranks than evaluation episodes
        return []
    envs = RecordEpisodeStatistics(ProcgenVecEnv(num_episodes, args.env_id, args.distribution_mode, args.env_backend,
                                                 num_threads=args.env_threads))
    obs, _ = envs.reset(seed=seed)
    returns = np.full(num_episodes, np.nan)
    frames = [obs[0]]
    while np.isnan(returns).any():
        logits, _ = agent(torch.as_tensor(obs, device=device))
        obs, _, _, _, info = envs.step(sample_action(logits).cpu().numpy())
        if "_episode" in info:
            first_end = info["_episode"] & np.isnan(returns)
            returns[first_end] = info["episode"]["r"][first_end]
        if video_path and np.isnan(returns[0]):
            frames.append(obs[0])
    envs.close()
    if video_path:
        write_video(video_path, [frame.repeat(4, 0).repeat(4, 1) for frame in frames])  # to 256x256
    return returns.tolist()


def write_video(path, frames, fps=15):
    import imageio.v3 as iio  # via PyAV, which ships libx264 (gym3 pins an imageio-ffmpeg too old)
    video = iio.imwrite("<bytes>", frames, plugin="pyav", extension=".mp4", codec="libx264", fps=fps)
    write_atomically(path, video)


def game_seed(seed, iteration, rank, evaluation=False):
    """The seed of fresh games: a hash of (--seed, iteration, rank) by numpy's SeedSequence, so that
    no two runs, ranks or resumes share their games' levels (a sum such as seed + rank would give
    --seed 1's rank 1 the games of --seed 2's rank 0)."""
    entropy = [seed, iteration, rank, int(evaluation)]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] % (2**31 - 1))

class ProcgenVecEnv(gym.vector.VectorEnv):
    """A gymnasium VectorEnv over the Procgen games of either backend (`procgen_backend`), with
    one contract for the algorithms whichever plays them:

    Autoreset is SAME_STEP: the step that ends an episode returns terminated=True with that
    episode's last reward and the *first* frame of the next episode (gym3's `first` flag). Procgen
    has no time-limit signal, so truncated is always False: time-outs count as terminations.
    `reset(seed=s)` builds fresh games whose levels and dynamics are fully determined by s
    (procgen's `rand_seed`; EnvPool's `seed` draws each game's level seeds the same way).

    With `halves=2` the games are two pools of num_envs / 2: `step` sends both their actions, then
    waits for both. `send(half, actions)` starts one half's games early, in their own threads, while
    the caller computes the other half's actions (--overlap-games); `step` then only waits for it."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs, env_id, distribution_mode="easy", backend="auto", halves=1, **options):
        """`options`: each pool's procgen num_levels, start_level and num_threads (its defaults: 0, 0, 1)."""
        if env_id not in PROCGEN_RANGES:  # procgen itself would abort the whole process from C++
            raise ValueError(f"unknown Procgen game {env_id!r}; choose one of {', '.join(PROCGEN_RANGES)}")
        if num_envs % halves:
            raise ValueError(f"{num_envs} games do not split into {halves} equal halves")
        self.backend = procgen_backend(backend)
        self.options = dict(env_name=env_id, distribution_mode=distribution_mode, **options)
        self.num_envs, self.halves = num_envs, halves
        self.pools, self.sent = [], [False] * halves  # made at reset, seeded then
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(15)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)  # seeds self.np_random, which picks the seed if none is given
        self.close_extras()
        if seed is None:
            seed = int(self.np_random.integers(2**31 - 1))
        # One pool plays the seed itself; two draw theirs from it by SeedSequence, as game_seed does.
        seeds = [seed] if self.halves == 1 else np.random.SeedSequence(seed).generate_state(2) % (2**31 - 1)
        self.pools = [make_games(self.backend, self.num_envs // self.halves, int(s), **self.options) for s in seeds]
        self.sent = [False] * self.halves
        if self.backend == "procgen":
            return np.concatenate([pool.observe()[1]["rgb"] for pool in self.pools]), {}
        return np.concatenate([pool.reset()[0] for pool in self.pools]), {}

    def send(self, half, actions):
        """Start `half`'s games on their `actions` (one per game of that half); returns at once."""
        send_step(self.backend, self.pools[half], np.asarray(actions, dtype=np.int32))
        self.sent[half] = True

    def step(self, actions):
        for half, half_actions in enumerate(np.split(np.asarray(actions), self.halves)):
            if not self.sent[half]:
                self.send(half, half_actions)
        results = [receive_step(self.backend, pool) for pool in self.pools]
        self.sent = [False] * self.halves
        obs, reward, ended = (np.concatenate(parts) for parts in zip(*results))
        return obs, reward, ended, np.zeros(self.num_envs, dtype=bool), {}  # never truncated

    def close_extras(self, **kwargs):
        for pool in self.pools:
            pool.close()
        self.pools = []


def send_step(backend, pool, actions):
    """One pool's games start a step on `actions` in their worker threads; this returns at once."""
    if backend == "procgen":
        pool.act(actions)  # procgen's act() returns at once; observe() waits for the threads
    else:
        pool.send(actions)


def receive_step(backend, pool):
    """Wait for one pool's games to finish the step they were sent: (frames, rewards, ends)."""
    if backend == "procgen":
        reward, obs, first = pool.observe()
        return obs["rgb"], reward.astype(np.float64), first
    obs, reward, terminated, truncated, _ = pool.recv()
    ended = terminated | truncated  # EnvPool calls a time-out a truncation; procgen does not
    if ended.any():
        # EnvPool starts a finished game's next episode on the step after its end (ignoring
        # that step's action, reward 0). Take that step now, for those games only, and return
        # its first frame with the end: a rollout never holds the extra transition, so GAE and
        # V-trace never bootstrap from one episode into the next.
        finished = np.flatnonzero(ended).astype(np.int32)
        first_frames, _, _, _, info = pool.step(np.zeros(len(finished), np.int32), finished)
        obs[info["env_id"]] = first_frames
    return obs, reward.astype(np.float64), ended


def procgen_backend(choice):
    """'procgen' or 'envpool' for --env-backend CHOICE; 'auto' takes procgen-mirror where it is
    installed (the official package), else EnvPool. Finding a package imports nothing."""
    installed = [name for name in ("procgen", "envpool") if importlib.util.find_spec(name)]
    backend = (installed or [None])[0] if choice == "auto" else choice
    if backend not in installed:
        missing = {None: "neither procgen-mirror nor envpool is", "envpool": "envpool is not",
                   "procgen": "procgen-mirror is not"}[backend]
        raise SystemExit(f"error: --env-backend {choice}: {missing} installed; `pip install -r "
                         "requirements.txt` installs the one for this platform (procgen-mirror on "
                         "Linux x86-64 with CPython 3.11 and 3.12, EnvPool elsewhere; "
                         "docs/platforms.md)")
    return backend


def make_games(backend, num_envs, seed, env_name, distribution_mode, **options):
    """`num_envs` games of one backend, seeded by `seed`: procgen's gym3 env or EnvPool's."""
    if backend == "procgen":
        with contextlib.redirect_stderr(io.StringIO()):  # `import procgen` imports gym: a notice
            from procgen import ProcgenGym3Env
        return ProcgenGym3Env(num=num_envs, env_name=env_name, distribution_mode=distribution_mode,
                              rand_seed=seed, **options)
    import envpool
    task = f"{env_name.capitalize()}{distribution_mode.capitalize()}-v0"  # e.g. StarpilotEasy-v0
    try:
        return envpool.make_gymnasium(task, num_envs=num_envs, seed=seed, channel_first=False,
                                      **options)
    except ImportError as error:  # EnvPool's Procgen loads the system's Qt 5 on Linux and macOS
        raise SystemExit(f"error: --env-backend envpool: {error} (Debian/Ubuntu: apt-get install "
                         "libqt5gui5; macOS: brew install qt@5)") from None


@dataclass
class Run:
    """One record of the run for the plumbing: its flags, this process's place in it, where it
    writes, and what it has saved."""
    args: Args
    name: str
    dir: str
    device: torch.device
    rank: int
    world_size: int
    logger: "Logger"
    checkpoint: Optional[dict] = None  # the checkpoint resumed or evaluated
    start: tuple = (0.0, 0)  # (time, global step) where this process began training: SPS, ETA
    recent_returns: collections.deque = field(default_factory=functools.partial(collections.deque, maxlen=100))
    last_whole: Optional[tuple] = None  # (iteration, checkpoint bytes): what a stop saves
    saved: Optional[tuple] = None  # (iteration, path) of the last checkpoint on disk
    signal_handlers: dict = field(default_factory=dict)  # SIGINT's, SIGTERM's of before the run


def start_run(args):
    """Set-up, before anything heavy is allocated: a run to resume or evaluate takes its
    checkpoint's flags (RUNTIME_FLAGS from the command line); the flags are checked; then
    torchrun's process group, this rank's device, seeds and threads, the run's folder and log."""
    checkpoint = None
    if args.resume or args.eval_only:
        checkpoint, args = load_checkpoint(args)
    check_args(args)
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # each rank's statistics, RNGs: its own
    saved_ranks = len(checkpoint["ranks"]) if args.resume else world_size
    require(saved_ranks == world_size, f"--resume {args.resume} was written by {saved_ranks} ranks: "
            f"resume it with as many (torchrun --nproc-per-node {saved_ranks})")
    rank, world_size, device = setup_distributed(args)
    random.seed(args.seed + rank)  # each rank its own actions and minibatches
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cudnn.benchmark = not args.torch_deterministic  # faster, not reproducible
    # The games step while the network waits and vice versa. On a CPU the network dominates: torch
    # gets half the cores, the games one thread. Not all the cores: a team of torch threads waits for
    # its slowest member, so when other programs keep the cores busy a team as large as the machine
    # is preempted at every operation (on 2 cores, 2 threads ran PPO 1.6-1.9x faster than 1 when
    # idle, several times slower under load: docs/speed.md). On a GPU the games get the cores. One
    # machine's ranks share its cores.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    on_gpu = device.type == "cuda"
    args.env_threads = args.env_threads or (min(cores, args.num_envs) if on_gpu else 1)
    torch.set_num_threads(args.torch_threads or (1 if on_gpu else max(1, cores // 2)))
    # From its folder to the training loop's StopOnSignal a signal ends the run at once: nothing is
    # saved yet (`stop_in_startup`). One that comes while the folder and the log are made waits for them.
    held = []
    handlers = {signum: signal.signal(signum, functools.partial(hold_signal, held))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        name, directory = run_folder(args, checkpoint, rank)
        logger = Logger(args, name, directory, rank, checkpoint["iteration"] if args.resume else None)
    except BaseException:  # e.g. an unwritable runs/: the handlers of before, and the error
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        raise
    saved = (checkpoint["iteration"], args.resume) if args.resume else None
    run = Run(args, name, directory, device, rank, world_size, logger, checkpoint, saved=saved,
              signal_handlers=handlers)
    for signum in handlers:
        signal.signal(signum, functools.partial(stop_in_startup, run=run))
    if held:
        stop_in_startup(held[0], None, run)
    return run


def run_folder(args, checkpoint, rank):
    """The run's name and folder: a resumed run's own (without the .tmp files of killed writes),
    else a new runs/<game>__<exp_name>__<seed>__<time>_<random>, made by rank 0 and named alike on
    every rank: runs started in the same second (a sweep) never share one."""
    if args.resume:
        directory = os.path.dirname(os.path.abspath(args.resume))
        require(os.access(directory, os.W_OK), f"--resume {args.resume}: folder not writable")
        if rank == 0:  # the .tmp files of killed writes (the files they were to replace are whole)
            for path in glob.glob(os.path.join(directory, "**", "*.tmp"), recursive=True):
                os.remove(path)
        return checkpoint["run_name"], directory
    kind = "__eval" if args.eval_only else ""
    name = [f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}_{secrets.token_hex(4)}{kind}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    directory = os.path.join("runs", name[0])
    try:
        if rank == 0:
            os.makedirs(directory)
    except OSError as error:  # read-only, no permission, runs is a file, ...
        require(False, f"cannot create the run directory {directory}: {error.strerror}")
    return name[0], directory


def count_iterations(args, steps_per_iteration, device):
    """Whole iterations of `steps_per_iteration` environment steps in --total-timesteps, with a note
    where that trains fewer steps, and the CPU note for a long run on a CPU."""
    num_iterations = args.total_timesteps // steps_per_iteration
    trained_steps = num_iterations * steps_per_iteration
    if trained_steps != args.total_timesteps and not args.eval_only:
        print(f"note: training {trained_steps:,} steps ({num_iterations} whole iterations)")
    if device.type == "cpu" and args.total_timesteps > 10**6 and not args.eval_only:
        print(CPU_NOTE)
    return num_iterations

def setup_distributed(args):
    """Data parallel under torchrun, which starts one process per GPU and sets RANK (global),
    WORLD_SIZE and LOCAL_RANK (the GPU's index on its machine); a plain `python script.py` is rank 0
    of 1, with no process group. NCCL connects GPUs, gloo CPUs; a collective that a failed rank
    never joins times out after 10 minutes (torchrun itself stops the other ranks 30 s after one
    fails)."""
    rank = int(os.environ.get("RANK", 0))
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 speaks for all; errors still reach stderr
    if args.cuda and not use_cuda:  # rank 0's line: the others' stdout is gone
        print("warning: --cuda is on but no CUDA GPU is usable (torch.cuda.is_available() is "
              "False); running on the CPU")
    return rank, int(os.environ.get("WORLD_SIZE", 1)), device


def all_reduce_mean(tensor):
    """In place: the mean of `tensor` over the ranks (each holds as much data); nothing to do in one
    process."""
    if dist.is_initialized():
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return tensor


def average_gradients(optimizer):
    """One all-reduce of every gradient in one flat bucket: each rank then steps with the gradient
    of the whole minibatch, all ranks alike. A parameter left out of the loss has no gradient on any
    rank."""
    if not dist.is_initialized():
        return
    grads = [param.grad for group in optimizer.param_groups for param in group["params"] if param.grad is not None]
    flat = all_reduce_mean(torch.cat([grad.flatten() for grad in grads]))
    for grad, mean in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(mean.view_as(grad))


def gather(items):
    """Every rank's list `items`, concatenated in rank order, on every rank."""
    if not dist.is_initialized():
        return items
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, items)
    return [item for rank_items in per_rank for item in rank_items]


class Interrupted(Exception):
    """Raised on every rank by `StopOnSignal.check` after a signal: the iteration in flight is dropped."""


class StopOnSignal:
    """Ctrl-C or SIGTERM (a cluster's preemption) asks for a stop: `check`, called at every rollout
    step and minibatch, then raises Interrupted on all ranks alike, and so does `end_iteration`.
    Leaving the block saves the last whole iteration and exits (`end_run`). A second signal stops
    at once; torchrun's copy of the first (within 2 s) is not a second."""

    def __init__(self, run, closing):
        self.run, self.closing, self.signum, self.first_time = run, closing, None, 0.0

    def __enter__(self):
        for signum in self.run.signal_handlers:  # in place of start-up's `stop_in_startup`
            signal.signal(signum, self.handler)
        return self

    def handler(self, signum, frame):
        if self.signum is None:
            self.signum, self.first_time = signum, time.monotonic()
            print(f"\n{signal.Signals(signum).name}: stopping at the next step to save a checkpoint (a second "
                  "signal stops at once)", flush=True)
        elif time.monotonic() - self.first_time > 2:
            raise KeyboardInterrupt  # `end_run` stops with one line

    def check(self):
        asked = self.signum is not None
        if dist.is_initialized():  # one all-reduce: every rank stops at the same step
            asked = all_reduce_mean(torch.tensor(float(asked), device=self.run.device)).item() > 0
        if asked:
            raise Interrupted

    def end_iteration(self, state, last):
        """After an iteration's log: its checkpoint `state`, kept in memory (what a stop inside the
        next iteration saves) and written every --save-every iterations and after the last."""
        data = checkpoint_bytes(state) if self.run.rank == 0 else b""  # rank 0 writes for all ranks
        self.run.last_whole = (state["iteration"], data)
        self.check()
        if self.run.args.save_model and (state["iteration"] % self.run.args.save_every == 0 or last):
            save_checkpoint(self.run, final=last)

    def __exit__(self, kind, error, traceback):
        for signum in self.run.signal_handlers:  # ending: no signal cuts the checkpoint's write
            signal.signal(signum, signal.SIG_IGN)
        try:
            end_run(self.run, self.closing, error, self.signum or signal.SIGTERM)  # SIGTERM: another rank's
        finally:
            restore_signal_handlers(self.run)


def stop_in_startup(signum, frame, run):
    """A signal between the run's folder and its training loop (the games, the network, the buffers):
    nothing is saved yet, so the run ends at once with one line and exit 128 + signal, and a new run
    leaves no folder behind (`remove_if_empty`)."""
    for handled in run.signal_handlers:  # no second signal cuts the clean-up short
        signal.signal(handled, signal.SIG_IGN)
    try:
        close_run(run, closing=())  # the games made so far close as the process ends
        remove_if_empty(run)
        name = signal.Signals(signum).name
        print(f"\ninterrupted by {name}: nothing new to save; {last_saved(run)}", flush=True)
    finally:
        restore_signal_handlers(run)
    raise SystemExit(128 + signum)


def hold_signal(held, signum, frame):
    held.append(signum)


def restore_signal_handlers(run):
    for signum, handler in run.signal_handlers.items():
        signal.signal(signum, handler)


def end_run(run, closing, error, signum):
    """How a run ends, once the games, the log and the process group are closed: after a signal,
    with the last whole iteration saved and exit 128 + signal; after a non-finite loss, with one
    line and exit 1 (the last checkpoint is intact: the step that would have put a NaN in the
    weights was not taken)."""
    close_run(run, closing)  # IMPALA's actor first: it plays no further while the checkpoint is written
    saved_now = isinstance(error, Interrupted) and run.last_whole is not None and save_checkpoint(run, final=False)
    if isinstance(error, (Interrupted, KeyboardInterrupt)):
        remove_if_empty(run)
    name = signal.Signals(signum).name
    if isinstance(error, Interrupted) and saved_now:
        print(f"interrupted by {name}: saved iteration {run.saved[0]} to {run.saved[1]}; continue with --resume")
    elif isinstance(error, Interrupted):
        print(f"interrupted by {name}: nothing new to save; {last_saved(run)}")
    elif isinstance(error, KeyboardInterrupt):
        print(f"\nstopped at once by a second {name}: {last_saved(run)}")
    elif isinstance(error, FloatingPointError):
        raise SystemExit(f"error: {error}; {last_saved(run)} (a lower --learning-rate may avoid it)") from None
    if isinstance(error, (Interrupted, KeyboardInterrupt)):
        raise SystemExit(128 + signum) from None


def remove_if_empty(run):
    """A run stopped before its first row and checkpoint: its folder holds only its flags and empty
    logs, so it goes (a resumed run has its checkpoint: its folder stays)."""
    metrics = os.path.join(run.dir, "metrics.jsonl")
    empty = not os.path.exists(metrics) or os.path.getsize(metrics) == 0
    if run.rank == 0 and run.saved is None and empty:
        shutil.rmtree(run.dir, ignore_errors=True)


def last_saved(run):
    if run.saved is None:
        return "no checkpoint of this run was saved"
    return "the last checkpoint is iteration %d in %s (continue with --resume)" % run.saved


def close_run(run, closing):
    """The games (and IMPALA's actor), the log, then torchrun's process group."""
    for thing in closing:
        thing.close()
    run.logger.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class Logger:
    """The run's rows: one JSON object a line in runs/<name>/metrics.jsonl, TensorBoard event files
    in the same folder (`tensorboard --logdir runs`: the numeric columns with a '/' in their name)
    and, with --track, wandb. Rank 0 writes for all; a resumed run first drops the rows after its
    checkpoint, since it plays those iterations again."""

    def __init__(self, args, name, directory, rank=0, resume_iteration=None):
        self.file = None
        if rank > 0:
            return
        os.makedirs(os.path.join(directory, "videos") if args.capture_video else directory, exist_ok=True)
        path = os.path.join(directory, "metrics.jsonl")
        purge_step = None  # TensorBoard hides its events from this step on
        if resume_iteration is not None and os.path.exists(path):
            purge_step = drop_rows_after(path, resume_iteration)
        flags = {"script": os.path.basename(__file__), **asdict(args)}  # for benchmarks/results.py
        write_atomically(os.path.join(directory, "args.json"), json.dumps(flags, indent=1).encode())
        self.file = open(path, "ab", buffering=0)
        from torch.utils.tensorboard import SummaryWriter
        self.tensorboard = SummaryWriter(directory, purge_step=purge_step)
        self.wandb = None
        if args.track:
            import wandb
            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, mode=args.wandb_mode,
                                    name=name, id=name, resume="allow", config=asdict(args), dir=directory)

    def log(self, row, video=None):
        if self.file is None:
            return
        line = (json.dumps(row) + "\n").encode()
        length = self.file.seek(0, os.SEEK_END)
        try:  # one unbuffered write a row; a failed one is cut off again: no row is half there
            if self.file.write(line) != len(line):
                raise OSError("a short write")
        except OSError as error:
            self.file.truncate(length)
            print(f"warning: could not write a row to {self.file.name} ({error.strerror or error}); it is left "
                  "out, the run goes on", file=sys.stderr, flush=True)
        for key, value in row.items():
            if "/" in key and isinstance(value, (int, float)):
                self.tensorboard.add_scalar(key, value, row["global_step"])
        self.tensorboard.flush()
        if self.wandb is not None:
            import wandb
            media = {"eval/video": wandb.Video(video, format="mp4")} if video else {}
            self.wandb.log({**row, **media}, step=row["global_step"])

    def close(self):
        if self.file is not None:
            self.file.close()
            self.tensorboard.close()
            if self.wandb is not None:
                self.wandb.finish()


def drop_rows_after(path, iteration):
    """A resumed run's metrics.jsonl without the rows after its checkpoint's `iteration` (or half a
    line a crash left); returns the first global step to hide in TensorBoard (its purge_step)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    kept = [row for row in rows if row["iteration"] <= iteration]
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in kept).encode())  # a kill loses no row
    return max((row["global_step"] for row in kept), default=-1) + 1


def log_iteration(run, iteration, global_step, episodes, stats):
    """One row (and one console line) per iteration: every rank's `episodes` (return, length),
    the last 100 of them, SPS and the ETA since this process began, and `stats`: the losses (means
    over the ranks; logged as losses/<name>) and the columns named with a '/' (time/..., charts/...,
    a script's own such as PPG's aux/...). The console shows four losses and the script's own."""
    episodes = gather(episodes)  # every rank's episodes count
    returns = [episode_return for episode_return, _ in episodes]
    run.recent_returns.extend(returns)
    elapsed = time.time() - run.start[0]
    sps = (global_step - run.start[1]) / elapsed
    gpu_memory = torch.cuda.max_memory_allocated() / 2**30 if run.device.type == "cuda" else None
    losses = {key: value for key, value in stats.items() if "/" not in key}
    run.logger.log({"global_step": global_step, "iteration": iteration, "time": elapsed, "charts/SPS": sps,
                    "charts/episodes": len(episodes), "charts/episodic_return": mean_or_none(returns),
                    "charts/episodic_length": mean_or_none([length for _, length in episodes]),
                    "charts/episodic_return_last100": mean_or_none(run.recent_returns),
                    **{f"losses/{key}": value for key, value in losses.items()},
                    **{key: value for key, value in stats.items() if "/" in key},
                    "perf/gpu_memory_gb": gpu_memory})
    num_iterations = run.args.total_timesteps * iteration // global_step
    eta = (num_iterations - iteration) * global_step / iteration / sps / 60
    timers = ", ".join(f"{key[5:]} {value:.1f}s" for key, value in stats.items() if key.startswith("time/"))
    mean_return = f"{np.mean(returns):.2f} ({len(returns)} eps)" if returns else "-"
    own = [(key, value) for key, value in stats.items() if "/" in key and key.split("/")[0] not in ("time", "charts")]
    shown = " ".join(f"{key} {value:.4g}" for key, value in list(losses.items())[:4] + own if value is not None)
    print(f"iter {iteration}/{num_iterations} | step {global_step:,} | SPS {sps:,.0f} ({timers}) | "
          f"ETA {eta:.1f} min | return {mean_return} | {shown}", flush=True)


def mean_or_none(values):
    return float(np.mean(values)) if len(values) else None


def checkpoint_state(run, iteration, agent, optimizer, normalizer, reward_rms):
    """All that --resume continues from after `iteration`, in one dict of tensors and plain data
    (what torch.load(weights_only=True) reads): the weights, the optimizer, the learner's updates
    (the version of its parameters), the flags and every rank's own reward statistics and RNG
    states (a collective: all ranks call it). The actor plays ahead of the learner: the reward
    statistics are `reward_rms`, `normalizer`'s as the last unroll trained on left them."""
    args = run.args
    updates = iteration * args.updates_per_iteration
    ranks = gather([dict(rank_state(normalizer), reward_rms=reward_rms)])
    return {"agent": agent.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration,
            "global_step": updates * args.num_envs * args.unroll_length, "updates": updates,
            "args": asdict(args), "run_name": run.name, "ranks": ranks}


def restore(run, agent, optimizers, normalizer):
    """A checkpoint's weights; with --resume also its `optimizers` (by their keys in it) and this
    rank's reward statistics and RNG states. Then rank 0's weights on every rank (a new run's too).
    Returns the first iteration to train; SPS and the ETA count from here."""
    checkpoint = run.checkpoint
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["agent"])
    for tensor in agent.state_dict().values() if dist.is_initialized() else ():
        dist.broadcast(tensor, src=0)
    run.start = (time.time(), checkpoint["global_step"] if run.args.resume else 0)
    if not run.args.resume:
        return 1
    for key, optimizer in optimizers.items():
        optimizer.load_state_dict(checkpoint[key])
    restore_rank_state(checkpoint["ranks"][run.rank], normalizer)
    print(f"resuming {checkpoint['run_name']} at iteration {checkpoint['iteration'] + 1}")
    return checkpoint["iteration"] + 1


def checkpoint_bytes(state):
    data = io.BytesIO()
    torch.save(state, data)
    return data.getvalue()


def save_checkpoint(run, final):
    """The last whole iteration's checkpoint to runs/<name>/checkpoint.pt, by rank 0, atomically:
    a crash or a kill mid-write leaves the previous one intact. A failed write (a full disk) is one
    line and the run goes on, retrying at its next save; a failed final one stops the run."""
    iteration, data = run.last_whole
    path = os.path.join(run.dir, "checkpoint.pt")
    try:
        if run.rank == 0:
            write_atomically(path, data)
    except OSError as error:
        disk = os.statvfs(run.dir)
        print(f"warning: could not write {path}: {error.strerror or error} (it needs {len(data) / 2**20:.1f} "
              f"MiB, {disk.f_bavail * disk.f_frsize / 2**20:.1f} MiB free); the previous checkpoint is kept",
              file=sys.stderr, flush=True)
        require(not final, f"the final checkpoint could not be written (see above); {last_saved(run)}")
        return False
    run.saved = (iteration, path)
    return True


def write_atomically(path, data):
    """`path` holds all of `data` (bytes) or what it held before, whatever happens: the bytes go to
    `path`.tmp in the same folder, reach the disk (fsync) and are renamed over `path`. A failed
    write (a full disk) leaves no temporary file; a kill leaves one, which a resumed run removes."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on the disk before the rename: a power cut leaves no empty file
        os.replace(temporary, path)
    finally:  # also when a second signal interrupts the write
        if os.path.exists(temporary):
            os.remove(temporary)


def reward_statistics(normalizer):
    """A NormalizeReward wrapper's running return statistics as plain floats: [mean, var, count]."""
    rms = normalizer.return_rms
    return [float(rms.mean), float(rms.var), float(rms.count)]


def rank_state(normalizer):
    """This process's own part of a checkpoint: its reward statistics and its RNG states, in the
    plain types that torch.load(weights_only=True) accepts (numpy's RNG key as a list)."""
    numpy_rng = np.random.get_state(legacy=False)
    numpy_rng["state"]["key"] = numpy_rng["state"]["key"].tolist()
    return {"reward_rms": reward_statistics(normalizer),
            "rng": {"python": random.getstate(), "numpy": numpy_rng, "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}}


def restore_rank_state(state, normalizer):
    mean, var, count = state["reward_rms"]
    normalizer.return_rms.mean = np.float64(mean)
    normalizer.return_rms.var = np.float64(var)
    normalizer.return_rms.count = count
    random.setstate(state["rng"]["python"])
    numpy_rng = state["rng"]["numpy"]
    numpy_rng["state"]["key"] = np.array(numpy_rng["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_rng)
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])


# Flags that may differ from a checkpoint's when resuming or evaluating it: they change speed or
# logging only (--env-backend plays the same games, so a run moves to a machine with the other one).
RUNTIME_FLAGS = ("cuda", "env_backend", "env_threads", "torch_threads", "compile", "eval_episodes", "capture_video",
                 "track", "wandb_project", "wandb_entity", "wandb_mode")


def load_checkpoint(args):
    """The checkpoint of --resume or --checkpoint and its flags (those in RUNTIME_FLAGS from this
    command line). Tensors and plain data only (weights_only=True: loading a file never runs code
    from it); every failure is one line naming the file."""
    path = args.resume or args.checkpoint
    flag = "--resume" if args.resume else "--checkpoint"
    require(path is not None, "--eval-only needs --checkpoint PATH")
    require(os.path.isfile(path), f"{flag} {path}: no such file")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # a pickled object that could run code: refused before it is built
        found = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line), "a Python object")
        raise SystemExit(f"error: {path}: refused to load ({found}); a checkpoint holds only tensors and plain "
                         "data (those of this script's first version, which pickled numpy RNG states, are refused too)")
    except Exception as error:  # truncated, not a zip archive, not a torch file at all
        raise SystemExit(f"error: {path} is damaged or not a checkpoint ({type(error).__name__}: "
                         f"{str(error).splitlines()[0].split('. ')[0][:100]})")
    missing = {"agent", "args", "iteration", "ranks"} - set(checkpoint if isinstance(checkpoint, dict) else ())
    require(not missing, f"{path} is not a checkpoint of {os.path.basename(__file__)} (missing {sorted(missing)})")
    saved = {**checkpoint["args"], **{flag: getattr(args, flag) for flag in RUNTIME_FLAGS}}
    unknown = set(saved) - set(Args.__dataclass_fields__)
    require(not unknown, f"{path} was written by another script (it has flags {sorted(unknown)})")
    return checkpoint, Args(**{**saved, "channels": tuple(saved["channels"]),
                               "resume": args.resume, "eval_only": args.eval_only, "checkpoint": args.checkpoint})


def require(ok, message):
    if not ok:
        raise SystemExit(f"error: {message}")


def check_ranges(args, positive=(), non_negative=(), fractions=()):
    """Each numeric flag finite (--max-grad-norm may be inf: no clipping) and in its range; None
    means unset."""
    for flag in (*positive, *non_negative, *fractions):
        value, name = getattr(args, flag), "--" + flag.replace("_", "-")
        if value is not None:
            require(math.isfinite(value) or flag == "max_grad_norm" and value == math.inf, f"{name} {value} must be finite")
            require(flag not in positive or value > 0, f"{name} {value} must be > 0")
            require(flag not in non_negative or value >= 0, f"{name} {value} must be >= 0")
            require(flag not in fractions or 0 <= value <= 1, f"{name} {value} must be in [0, 1]")

def check_args(args):
    """Fail at once, before anything heavy is allocated, with one line naming the flag."""
    require(args.env_id in PROCGEN_RANGES, f"--env-id {args.env_id!r} is not a Procgen game; choose one of: "
            + ", ".join(PROCGEN_RANGES))
    if args.env_backend != "auto":  # a backend asked for by name must be installed (auto: when the games are made)
        procgen_backend(args.env_backend)
    check_ranges(args, positive=("total_timesteps", "num_envs", "unroll_length", "updates_per_iteration",
                                 "eval_episodes", "hidden_size", "save_every", "learning_rate", "gamma", "rho_bar",
                                 "c_bar", "pg_rho_bar", "max_grad_norm", "adam_eps", "reward_norm_gamma",
                                 "reward_clip"),
                 non_negative=("seed", "num_levels", "start_level", "env_threads", "torch_threads", "eval_every",
                               "max_policy_lag", "baseline_cost", "entropy_cost"),
                 fractions=("gamma", "vtrace_lambda", "reward_norm_gamma"))
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's number of ranks
    require(args.num_envs % world_size == 0, f"--num-envs {args.num_envs} must be a multiple of the {world_size} "
            "ranks: each rank's actor steps num_envs / ranks games")
    steps_per_iteration = args.updates_per_iteration * args.num_envs * args.unroll_length
    require(args.total_timesteps >= steps_per_iteration, f"--total-timesteps {args.total_timesteps} is less than "
            f"one iteration (updates_per_iteration * num_envs * unroll_length = {steps_per_iteration})")
    require(len(args.channels) > 0 and min(args.channels) > 0, f"--channels {args.channels} must be positive")
    if args.rho_bar < args.c_bar:
        print(f"warning: --rho-bar {args.rho_bar} < --c-bar {args.c_bar}: V-trace's analysis (IMPALA paper, "
              "Appendix A) assumes rho-bar >= c-bar", file=sys.stderr)


# Printed when a long run starts on a CPU: what it costs there and a run of minutes, both measured
# on 2-core VMs (docs/speed.md).
CPU_NOTE = ("note: training on the CPU. On a 2-core CPU the defaults ran at about 290 steps/s: 25M steps take a day. A "
            "run that finishes in about 4 minutes there: python vtrace.py --total-timesteps 64000.")


# ---- IMPALA's own plumbing: CUDA streams, the threads' share of the cores, the lag's columns ----
class PolicySnapshots:
    """The learner's parameters by version (version = updates so far): the learner publishes a copy
    after every update, the actor loads one into its own network before every unroll. Copies, never
    the live weights: the actor never sees half an optimizer step, and the learner never waits for the
    actor. The Condition guards only this dict; the GPU's order comes from events (`wait_for`). `keep`
    versions are kept: the newest one, or the last k + 1 with --deterministic-lag (unroll n needs
    version n - k while the learner may be at version n)."""

    def __init__(self, keep):
        self.keep = keep
        self.versions = {}  # version -> (parameter copies, event after the copies)
        self.condition = threading.Condition()

    def publish(self, version, parameters, device):
        copies = [parameter.detach().clone() for parameter in parameters]
        event = stream_event(device)
        with self.condition:
            self.versions[version] = (copies, event)
            for old in [published for published in self.versions if published <= version - self.keep]:
                del self.versions[old]
            self.condition.notify_all()

    def load_into(self, network, version, exact, stop):
        """Wait until `version` (exact) or any version >= it (not exact) is published, copy it (the
        newest such) into `network` on this thread's stream and return its number; None when `stop` is
        set first."""
        def available():
            return [published for published in self.versions
                    if published == version or (published > version and not exact)]

        with self.condition:
            while not (stop.is_set() or available()):
                if exact and self.versions and min(self.versions) > version:
                    raise RuntimeError(f"parameters of version {version} were dropped before the actor took them")
                self.condition.wait(timeout=0.1)
            if stop.is_set():
                return None
            version = max(available())
            copies, event = self.versions[version]
        wait_for(event, copies)
        with torch.no_grad():
            for parameter, snapshot in zip(network.parameters(), copies):
                parameter.copy_(snapshot)
        return version


def stream_event(device):
    """A CUDA event recorded after the work queued so far on this thread's current stream; None on CPU,
    where every operation has finished when it returns."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def wait_for(event, tensors):
    """Before this thread's current stream uses `tensors`, written on another stream up to `event`: the
    stream waits for the event (on the GPU; the host goes on), and record_stream tells the caching
    allocator that the tensors are in use on this stream too, so that their memory is not handed out
    again before it is done. No-op on CPU."""
    if event is None:
        return
    stream = torch.cuda.current_stream()
    stream.wait_event(event)
    for tensor in tensors:
        tensor.record_stream(stream)


def on_stream(stream):
    """Run the block on the actor's CUDA stream; on CPU (no stream) there is nothing to switch. The
    thread's current device becomes the stream's first: a new thread starts on GPU 0, and
    torch.cuda.stream saves the stream current on entry and restores it on exit, so without
    set_device a torchrun rank on GPU 3 would create a context on GPU 0 and leave its actor there
    (where its errors land unread)."""
    if stream is None:
        return contextlib.nullcontext()
    torch.cuda.set_device(stream.device)
    return torch.cuda.stream(stream)


def end_thread(thread, stream, timeout=10.0):
    """Wait for the actor's thread to return (it was told to stop: at most the rest of an unroll),
    then for the work it queued on its CUDA stream, before the caller closes the games and the
    process group and the learner's tensors are freed. Called as the run ends (`close_run`), when
    the previous signal handlers are back, so it returns within about `timeout` seconds and never
    raises: a plain join would raise a Ctrl-C that arrives while it waits (a third signal) past the
    closing. Such a Ctrl-C is ignored until the thread has returned or the time is up: closing the
    games while the actor still steps them could crash the process before the process group is
    closed."""
    deadline = time.time() + timeout
    waiting = True
    while waiting:
        try:
            while thread.is_alive() and time.time() < deadline:
                thread.join(timeout=0.1)
            if stream is not None and not thread.is_alive():
                stream.synchronize()
            waiting = False
        except KeyboardInterrupt:
            pass
    if thread.is_alive():
        print(f"warning: the actor thread did not stop within {timeout:g} s; closing the games anyway",
              file=sys.stderr, flush=True)


def actor_learner_threads(run):
    """The actor's forward passes and the learner's forward and backward passes run side by side,
    and torch's thread count is per process: on a CPU they split the half of the cores that
    `start_run` gave torch (busy threads beyond the cores preempt each other, and a torch thread
    team waits for its slowest member: on the 2-core machine under load, 2 threads made the actor's
    forward passes 9-27x slower and the learner's updates 1.2-1.5x slower than 1). --torch-threads
    N: as given."""
    if run.device.type == "cpu" and not run.args.torch_threads:
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))


def mean_over_updates(stats):
    """Each statistic's mean over the iteration's updates and over the ranks, as floats."""
    per_update = torch.stack([torch.stack(list(update.values())) for update in stats])
    means = all_reduce_mean(per_update.mean(0))
    return dict(zip(stats[0], means.tolist()))


def policy_lag_columns(lags, max_policy_lag):
    """The iteration's policy lags (every rank's updates) as columns of its row: policy_lag/{mean,
    max} and policy_lag/count_k for k = 0..max_policy_lag, the updates whose unroll was played with
    parameters k updates old."""
    lags = gather(lags)
    counts = np.bincount(lags, minlength=max_policy_lag + 1).tolist()
    return {"policy_lag/mean": mean_or_none(lags), "policy_lag/max": max(lags),
            **{f"policy_lag/count_{lag}": count for lag, count in enumerate(counts)}}


def check_vtrace_inputs(log_rhos, discounts, rewards, values, bootstrap_value, lambda_):
    """from_importance_weights' shapes and lambda_, one line naming the argument on a mistake. Only
    shapes are inspected (never tensor contents), so validation costs no device->host sync; a 0-dim
    lambda_ tensor is not read either."""
    others = dict(log_rhos=log_rhos, discounts=discounts, rewards=rewards)
    if torch.is_tensor(lambda_) and lambda_.dim() > 0:
        others["lambda_"] = lambda_
    elif not torch.is_tensor(lambda_) and not 0.0 <= lambda_ <= 1.0:
        raise ValueError(f"lambda_: expected a float in [0, 1], a 0-dim tensor or a [T, B, ...] tensor, got {lambda_}")
    if values.dim() < 2 or values.shape[0] < 1:
        raise ValueError(f"values: expected shape [T, B, ...] with rank >= 2 and T >= 1, got {tuple(values.shape)}")
    if tuple(bootstrap_value.shape) != tuple(values.shape[1:]):
        raise ValueError(f"bootstrap_value: expected shape values.shape[1:] = {tuple(values.shape[1:])} "
                         f"(V(x_T) for each [B, ...] entry), got {tuple(bootstrap_value.shape)}")
    for name, tensor in others.items():
        trailing_broadcast = all(size in (1, expected) for size, expected in zip(tensor.shape[2:], values.shape[2:]))
        if tensor.dim() != values.dim() or tensor.shape[:2] != values.shape[:2] or not trailing_broadcast:
            raise ValueError(f"{name}: expected shape [T, B, ...] = {tuple(values.shape)} (same rank as values, "
                             f"trailing dims may be 1 to broadcast), got {tuple(tensor.shape)}")


if __name__ == "__main__":
    train(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
