"""IMPALA with V-trace on Procgen (Espeholt et al. 2018, arXiv 1802.01561): actor threads play with a possibly stale
copy of the policy and queue unrolls of T steps; the learner batches them, corrects for the lag with V-trace (value
targets and policy-gradient advantages from truncated importance weights pi/mu) and takes one gradient step per batch.
IMPALA-CNN, reward normalization and Adam as in the Procgen PPO script (Cobbe et al. 2020, arXiv 1912.01588).

Run:  python vtrace.py --env-id starpilot          (all flags: python vtrace.py --help)
Read first: `diff ppo_procgen.py vtrace.py` (IMPALA and nothing else), then `train` (actors and learner),
`collect_unroll` (which reward goes with which frame) and `from_importance_weights` (V-trace itself).
"""
import collections
import contextlib
import copy
import io
import json
import os
import queue
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass
from typing import Literal, NamedTuple, Optional, Union

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import ClipReward, NormalizeReward, RecordEpisodeStatistics


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of python, numpy, torch and procgen's levels; the actors' timing still varies from run to run"""
    torch_deterministic: bool = True
    """make cuDNN pick deterministic algorithms"""
    cuda: bool = True
    """use the GPU when one is available"""
    total_timesteps: int = 25_000_000
    """environment steps the learner trains on (rounded down to whole iterations; dropped unrolls do not count)"""
    # Environment
    env_id: str = "starpilot"
    """the Procgen game, one of the 16 in PROCGEN_RANGES"""
    distribution_mode: Literal["easy", "hard", "extreme", "memory", "exploration"] = "easy"
    """Procgen difficulty (the CleanRL and train-procgen 25M-step results use easy)"""
    num_levels: int = 0
    """number of training levels; 0 trains on the full distribution (unlimited levels)"""
    start_level: int = 0
    """first training level seed (evaluation draws from the unbounded level distribution: see `evaluate`)"""
    num_actors: int = 4
    """IMPALA's actors: threads, each with its own games and its own copy of the network"""
    envs_per_actor: int = 16
    """games per actor, stepped and acted on as one batch (4 x 16 = the 64 games of CleanRL's Procgen PPO)"""
    env_threads: int = 0
    """procgen worker threads of each actor; 0 picks a value from the machine's cores (see `thread_budget`)"""
    # Algorithm. Adam on mean losses, lr, gamma, clip and reward normalization are the PPO script's Procgen settings;
    # IMPALA's Atari ones (RMSProp, lr 6e-4 on summed losses, gamma 0.99, clip 40) are in its paper, Table G.1.
    unroll_length: int = 20
    """T: steps in each actor's unroll (IMPALA paper Table G.1: 20)"""
    batch_size: int = 32
    """unrolls per learner update (IMPALA paper Table G.1: 32); a multiple of envs_per_actor"""
    updates_per_iteration: int = 25
    """learner updates per iteration, the unit of logging, evaluation and checkpoints (25 x 32 x 20 = 16,000 steps)"""
    max_policy_lag: int = 8
    """drop unrolls whose policy is more than this many learner updates old (as Sample Factory's max_policy_lag)"""
    learning_rate: float = 5e-4
    """Adam learning rate"""
    anneal_lr: bool = False
    """decay the learning rate linearly to 0 over the run"""
    gamma: float = 0.999
    """discount factor; also the discount of the reward normalizer's running return"""
    rho_bar: float = 1.0
    """rho-bar: truncation of the importance weights in V-trace's TD terms; sets the fixed point (IMPALA paper: 1)"""
    c_bar: float = 1.0
    """c-bar: truncation of the trace coefficients c_s; changes only the contraction speed (IMPALA paper: 1)"""
    pg_rho_bar: float = 1.0
    """truncation of the importance weight of the policy gradient (scalable_agent and torchbeast default: 1)"""
    vtrace_lambda: float = 1.0
    """lambda of the IMPALA paper's Remark 2, multiplied into the traces c_s (scalable_agent and torchbeast: none, 1)"""
    baseline_cost: float = 0.5
    """weight of the value (baseline) loss (IMPALA paper Table G.1 and torchbeast: 0.5)"""
    entropy_cost: float = 0.01
    """weight of the entropy bonus (IMPALA paper Table G.1: 0.01, as CleanRL's Procgen PPO)"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip"""
    adam_eps: float = 1e-5
    """Adam epsilon (baselines PPO uses 1e-5)"""
    reward_clip: float = 10.0
    """clip normalized rewards to [-reward_clip, reward_clip]"""
    channels: tuple[int, ...] = (16, 32, 32)
    """IMPALA-CNN channels, one conv sequence per entry"""
    hidden_size: int = 256
    """width of the dense layer after the convolutions"""
    init: Literal["default", "normed"] = "default"
    """weight init: PyTorch default + orthogonal heads (CleanRL PPO) or the PPG code's per-unit normed init"""
    # Evaluation, logging, checkpoints
    eval_every: int = 100
    """evaluate on held-out levels every this many iterations (and at the end); 0: only at the end"""
    eval_episodes: int = 32
    """evaluation episodes, one per env so that short episodes are not over-counted"""
    capture_video: bool = False
    """write an MP4 of one episode at each evaluation to runs/<run_name>/videos/ (uploaded with --track)"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "rl-reference"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (user or team)"""
    wandb_mode: Literal["online", "offline"] = "online"
    """'offline' logs to ./wandb without an account; sync later with `wandb sync`"""
    save_model: bool = False
    """write runs/<run_name>/checkpoint.pt every --save-every iterations and at the end"""
    save_every: int = 128
    """iterations between checkpoints (with --save-model)"""
    resume: Optional[str] = None
    """continue the run saved in this checkpoint, to its original total steps"""
    eval_only: bool = False
    """only evaluate the agent in --checkpoint (with --capture-video: and film it)"""
    checkpoint: Optional[str] = None
    """checkpoint to evaluate with --eval-only"""
    # Speed
    torch_threads: int = 0
    """torch CPU threads; 0 picks a value from the machine's cores (see `thread_budget`)"""
    channels_last: bool = True
    """NHWC memory layout for the convolutions' inputs and weights (faster on GPUs and on CPUs)"""
    compile: bool = False
    """torch.compile the learner's network (pays off on long GPU runs; the first iterations are slow)"""
    amp: bool = False
    """bfloat16 autocast for the forward passes on CUDA (the losses stay float32)"""


# Flags that may differ from a checkpoint's when resuming or evaluating it: they change speed or logging only.
RUNTIME_FLAGS = ("cuda", "env_threads", "torch_threads", "compile", "eval_episodes", "capture_video", "track",
                 "wandb_project", "wandb_entity", "wandb_mode")

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


class ProcgenVecEnv(gym.vector.VectorEnv):
    """A gymnasium VectorEnv over procgen's gym3 `ProcgenGym3Env`, so gymnasium's vector wrappers work on it.

    Autoreset is SAME_STEP: the step that ends an episode returns terminated=True with that episode's last reward
    and the *first* frame of the next episode (gym3's `first` flag). Procgen has no time-limit signal, so
    truncated is always False: time-outs count as terminations. `reset(seed=s)` builds fresh games whose levels
    and dynamics are fully determined by s (procgen's `rand_seed`).
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs, env_id, distribution_mode="easy", num_levels=0, start_level=0, num_threads=1):
        if env_id not in PROCGEN_RANGES:  # procgen itself would abort the whole process from C++
            raise ValueError(f"unknown Procgen game {env_id!r}; choose one of {', '.join(PROCGEN_RANGES)}")
        with contextlib.redirect_stderr(io.StringIO()):  # `import procgen` imports old gym, which prints a notice
            from procgen import ProcgenGym3Env
        self._make = lambda seed: ProcgenGym3Env(
            num=num_envs, env_name=env_id, distribution_mode=distribution_mode, num_levels=num_levels,
            start_level=start_level, rand_seed=seed, num_threads=num_threads)
        self.num_envs, self.env = num_envs, None
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(15)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)  # seeds self.np_random, which picks procgen's seed when none is given
        if self.env is not None:
            self.env.close()
        self.env = self._make(int(self.np_random.integers(2**31 - 1)) if seed is None else seed)
        _, obs, _ = self.env.observe()
        return obs["rgb"], {}

    def step(self, actions):
        self.env.act(np.asarray(actions, dtype=np.int32))
        reward, obs, first = self.env.observe()
        return obs["rgb"], reward.astype(np.float64), first, np.zeros(self.num_envs, dtype=bool), {}

    def close_extras(self, **kwargs):
        if self.env is not None:
            self.env.close()


def make_env(args, num_envs):
    """Training envs. Episode statistics record raw game scores; the agent sees rewards divided by the std of a
    running discounted return (gamma = args.gamma, as in CleanRL) and clipped, as in the Procgen baselines."""
    envs = ProcgenVecEnv(num_envs, args.env_id, args.distribution_mode, args.num_levels, args.start_level,
                         args.env_threads)
    return ClipReward(NormalizeReward(RecordEpisodeStatistics(envs), gamma=args.gamma), -args.reward_clip,
                      args.reward_clip)


def normed_(layer, scale):
    """The PPG code's "normed" init: each output unit's weight vector gets L2 norm `scale`, biases 0."""
    with torch.no_grad():
        weight = layer.weight.view(layer.weight.shape[0], -1)
        weight.mul_(scale / weight.norm(dim=1, keepdim=True))
        layer.bias.zero_()
    return layer


class ResidualBlock(nn.Module):
    def __init__(self, channels, init):
        super().__init__()
        # sqrt(1/sqrt(3)/sqrt(2)): the PPG code's scale for residual convs, so the residual sum keeps its variance
        scale = (1 / 3**0.5 / 2**0.5) ** 0.5
        self.conv0, self.conv1 = (nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2))
        if init == "normed":
            normed_(self.conv0, scale), normed_(self.conv1, scale)

    def forward(self, x):
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class ImpalaCNN(nn.Module):
    """IMPALA's deep network (Espeholt et al. 2018, Fig. 3): per entry of `channels` a conv, a stride-2 max-pool
    and two residual blocks; then a ReLU dense layer. Takes uint8 NHWC frames as the env returns them."""

    def __init__(self, channels, hidden_size, init, channels_last=True):
        super().__init__()
        layers, in_channels, size, self.channels_last = [], 3, 64, channels_last
        for out_channels in channels:
            conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
            if init == "normed":
                normed_(conv, 1.0)
            layers += [conv, nn.MaxPool2d(3, stride=2, padding=1),
                       ResidualBlock(out_channels, init), ResidualBlock(out_channels, init)]
            in_channels, size = out_channels, (size + 1) // 2
        dense = nn.Linear(in_channels * size * size, hidden_size)
        if init == "normed":
            normed_(dense, 1.4)
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
    """Gumbel-max sampling: argmax(logits + Gumbel noise) ~ softmax(logits); no host sync, unlike
    torch.distributions' argument validation. A thread that must not share torch's global RNG passes its own
    `generator` (on the logits' device)."""
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=logits.dtype)
    return torch.argmax(logits - torch.log(-torch.log(uniform)), dim=-1)


def log_prob_entropy(logits, actions):
    log_probs = F.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1), entropy


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
    """log softmax(policy_logits)[actions]: [T, B, A], [T, B] -> [T, B]. log_softmax, not log(softmax), so tiny
    probabilities do not underflow to log(0)."""
    if policy_logits.shape[:-1] != actions.shape:
        raise ValueError(f"actions: expected shape policy_logits.shape[:-1] = {tuple(policy_logits.shape[:-1])} "
                         f"([T, B] for logits [T, B, A]), got {tuple(actions.shape)}")
    return F.log_softmax(policy_logits, dim=-1).gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


def _check_time_major(values, bootstrap_value, **others):
    # Only shapes are inspected (never tensor contents), so validation costs no device->host sync.
    if values.dim() < 2 or values.shape[0] < 1:
        raise ValueError(f"values: expected shape [T, B, ...] with rank >= 2 and T >= 1, got {tuple(values.shape)}")
    if tuple(bootstrap_value.shape) != tuple(values.shape[1:]):
        raise ValueError(f"bootstrap_value: expected shape values.shape[1:] = {tuple(values.shape[1:])} "
                         f"(V(x_T) for each [B, ...] entry), got {tuple(bootstrap_value.shape)}")
    for name, x in others.items():
        ok = x.dim() == values.dim() and x.shape[:2] == values.shape[:2] and all(
            d in (1, v) for d, v in zip(x.shape[2:], values.shape[2:]))
        if not ok:
            raise ValueError(f"{name}: expected shape [T, B, ...] = {tuple(values.shape)} (same rank as values, "
                             f"trailing dims may be 1 to broadcast), got {tuple(x.shape)}")


@torch.no_grad()
def from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value,
                            clip_rho_threshold: Optional[float] = 1.0, clip_c_threshold: Optional[float] = 1.0,
                            clip_pg_rho_threshold: Optional[float] = 1.0,
                            lambda_: Union[float, torch.Tensor] = 1.0) -> VTraceReturns:
    """V-trace targets and policy-gradient advantages from log importance weights log(pi(a_s|x_s) / mu(a_s|x_s)).

    Time-major: log_rhos, discounts (gamma_s = gamma * (1 - done_s)), rewards, values are [T, B, ...] with the
    rank of values (trailing dims may be 1 and broadcast); bootstrap_value is V(x_T), shape values.shape[1:].
    Thresholds: rho_bar (clip_rho_threshold) clips the TD weight and sets the fixed point, c_bar (clip_c_threshold)
    clips the trace and only sets the contraction speed (the paper's analysis assumes rho_bar >= c_bar), and
    clip_pg_rho_threshold clips the policy-gradient weight; None disables a clip. lambda_ is a float or a
    per-step [T, B, ...] tensor (Remark 2). Outputs are constants: no gradient flows through them.

    lambda convention (SEED RL): lambda multiplies only the trace, c_s = lambda * min(c_bar, rho_s), and the
    pg target keeps v_{s+1}. Consequences: on-policy, vs - V equals GAE(gamma, lambda), but pg_advantages equals
    GAE only at lambda = 1 (rlax instead uses lambda * v_{s+1} + (1 - lambda) * V(x_{s+1}) in the pg target), and
    a per-step lambda_s = 0 cuts the trace of vs but not the pg target. To truncate an episode at step s,
    fold the time-out bootstrap into the reward, r_s += gamma * V(final obs), and set discounts[s] = 0.
    """
    others = dict(log_rhos=log_rhos, discounts=discounts, rewards=rewards)
    if torch.is_tensor(lambda_):
        others["lambda_"] = lambda_
    elif not 0.0 <= lambda_ <= 1.0:
        raise ValueError(f"lambda_: expected a float in [0, 1] or a [T, B, ...] tensor, got {lambda_}")
    _check_time_major(values, bootstrap_value, **others)

    def clip(x, threshold):  # min(threshold, x); None means no truncation
        return x if threshold is None else torch.clamp(x, max=threshold)

    rhos = torch.exp(log_rhos)
    clipped_rhos = clip(rhos, clip_rho_threshold)  # rho_bar_s = min(rho_bar, rho_s), weights the TD error
    cs = lambda_ * clip(rhos, clip_c_threshold)  # c_s = lambda * min(c_bar, rho_s), the trace coefficients
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)  # V(x_{s+1}), V(x_T) := bootstrap
    # delta_s V = rho_bar_s * (r_s + gamma_s V(x_{s+1}) - V(x_s))  (Eq. 1)
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)
    trace_decay = (discounts * cs).expand_as(deltas)
    # Remark 1: v_s - V(x_s) = delta_s V + gamma_s c_s (v_{s+1} - V(x_{s+1})), accumulated backwards from 0 after
    # step T-1. O(T) instead of the O(T^2) double sum of Eq. 1; a Python loop is fine since T is small.
    acc = torch.zeros_like(deltas[0])
    vs_minus_v = []
    for s in reversed(range(deltas.shape[0])):
        acc = deltas[s] + trace_decay[s] * acc
        vs_minus_v.append(acc)
    vs = values + torch.stack(vs_minus_v[::-1], dim=0)
    # Section 4.2: the pg target is r_s + gamma_s v_{s+1} (the V-trace target of the next state, v_T := bootstrap),
    # an estimate of Q^{pi_rho_bar}(x_s, a_s) (App. A.3); Appendix E.3 finds V(x_{s+1}) here works worse.
    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    pg_advantages = clip(rhos, clip_pg_rho_threshold) * (rewards + discounts * vs_t_plus_1 - values)
    return VTraceReturns(vs=vs.detach(), pg_advantages=pg_advantages.detach())


@torch.no_grad()
def from_logits(behaviour_policy_logits, target_policy_logits, actions, discounts, rewards, values, bootstrap_value,
                clip_rho_threshold: Optional[float] = 1.0, clip_c_threshold: Optional[float] = 1.0,
                clip_pg_rho_threshold: Optional[float] = 1.0,
                lambda_: Union[float, torch.Tensor] = 1.0) -> VTraceFromLogitsReturns:
    """V-trace from behaviour (mu) and target (pi) logits [T, B, A] and the actions [T, B] taken by mu; the other
    arguments are as in from_importance_weights. All outputs are constants: recompute log pi(a) with gradient for
    the loss (vtrace_loss does)."""
    if behaviour_policy_logits.shape != target_policy_logits.shape or target_policy_logits.dim() != 3:
        raise ValueError(f"behaviour_policy_logits, target_policy_logits: expected the same shape [T, B, A], got "
                         f"{tuple(behaviour_policy_logits.shape)} and {tuple(target_policy_logits.shape)}")
    behaviour_log_probs = action_log_probs(behaviour_policy_logits, actions)
    target_log_probs = action_log_probs(target_policy_logits, actions)
    log_rhos = target_log_probs - behaviour_log_probs  # log pi/mu in log space: no overflow from exp then divide
    vtrace_returns = from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value,
                                             clip_rho_threshold, clip_c_threshold, clip_pg_rho_threshold, lambda_)
    return VTraceFromLogitsReturns(*vtrace_returns, log_rhos, behaviour_log_probs, target_log_probs)


def vtrace_loss(target_logits, values, actions, vs, pg_advantages, baseline_cost: float, entropy_cost: float,
                reduction: str = "sum"):
    """IMPALA learner loss -sum log pi(a_s|x_s) A_s + b * 0.5 * sum (v_s - V(x_s))^2 - e * sum H(pi(.|x_s)).
    vs and pg_advantages are targets (detached), so values get gradient only from the baseline term.
    reduction "sum" over T and B as in the paper (Table D.1; the lr 6e-4 assumes it) or "mean" (T*B times smaller).
    Returns (total, pg_loss, baseline_loss, entropy); baseline_loss includes baseline_cost, entropy is the bare
    entropy (the total subtracts entropy_cost * entropy)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    reduce = torch.sum if reduction == "sum" else torch.mean
    log_probs = F.log_softmax(target_logits, dim=-1)
    pg_loss = reduce(-action_log_probs(target_logits, actions) * pg_advantages.detach())
    baseline_loss = baseline_cost * 0.5 * reduce((vs.detach() - values) ** 2)
    entropy = reduce(-(log_probs.exp() * log_probs).sum(-1))
    return pg_loss + baseline_loss - entropy_cost * entropy, pg_loss, baseline_loss, entropy


@torch.no_grad()
def collect_unroll(policy, envs, obs, unroll_length, autocast=contextlib.nullcontext):
    """IMPALA's actor: T = unroll_length steps of the behaviour policy mu in a vector env, from frames `obs` [B, ...].
    Returns time-major tensors, aligned as V-trace reads them (the learner pairs index t of every field):
      obs[t], t < T          x_t, the frame mu acted on; obs[T] = x_T, the frame after the last action, for V(x_T)
      actions[t]             a_t ~ mu(.|x_t), and behaviour_logits[t] the logits of mu(.|x_t)
      rewards[t], dones[t]   what step(a_t) returned: the reward credited to (x_t, a_t), and whether that step ended
                             the episode (x_{t+1} is then the next episode's first frame, so gamma_t = 0 cuts there)
    plus the raw returns and lengths of the episodes that ended during the unroll."""
    steps, episode_returns, episode_lengths = collections.defaultdict(list), [], []
    for _ in range(unroll_length):
        with autocast():
            logits = policy(obs)[0].float()
        action = sample_action(logits)
        frames, reward, terminated, truncated, info = envs.step(action.cpu().numpy())
        for key, value in (("obs", obs), ("actions", action), ("behaviour_logits", logits),
                           ("rewards", torch.as_tensor(reward, dtype=torch.float32, device=obs.device)),
                           ("dones", torch.as_tensor(terminated | truncated, dtype=torch.float32, device=obs.device))):
            steps[key].append(value)
        obs = torch.as_tensor(frames, device=obs.device)
        if "_episode" in info:  # every episode that ended in this step
            episode_returns += info["episode"]["r"][info["_episode"]].tolist()
            episode_lengths += info["episode"]["l"][info["_episode"]].tolist()
    steps["obs"].append(obs)
    return dict({key: torch.stack(values) for key, values in steps.items()}, episode_returns=episode_returns,
                episode_lengths=episode_lengths)


def vtrace_backward(policy, optimizer, batch, args, autocast):
    """The IMPALA learner's loss and gradients on unrolls laid out as `collect_unroll` returns them, stacked along B
    ([T+1, B] frames, [T, B] the rest); the caller steps the optimizer. pi's logits and values are recomputed on every
    frame, x_T included: the bootstrap V(x_T) comes from the learner, not from the actor.
    Losses are means over T x B, not the paper's sums: Adam divides the gradient's scale away, so the choice matters
    only for the gradient-norm clip and Adam's epsilon, whose PPO values assume mean-sized gradients (a sum is
    T x B = 640 times larger and would be clipped at every step). Returns the update's statistics as tensors."""
    T, B = batch["actions"].shape
    with autocast():
        logits, values = policy(batch["obs"].flatten(0, 1))
    logits, values = logits.float().view(T + 1, B, -1), values.float().view(T + 1, B)
    # gamma_s = gamma * (1 - done_s): the step that ended an episode does not look past it (Procgen has no time-outs)
    vtrace_returns = from_logits(batch["behaviour_logits"], logits[:-1], batch["actions"],
                                 args.gamma * (1 - batch["dones"]), batch["rewards"], values[:-1], values[-1],
                                 args.rho_bar, args.c_bar, args.pg_rho_bar, args.vtrace_lambda)
    loss, pg_loss, value_loss, entropy = vtrace_loss(logits[:-1], values[:-1], batch["actions"], vtrace_returns.vs,
                                                     vtrace_returns.pg_advantages, args.baseline_cost,
                                                     args.entropy_cost, reduction="mean")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    if not torch.isfinite(grad_norm):  # one host sync per update: stop before a NaN reaches the weights
        raise FloatingPointError(f"non-finite loss {loss.item()} or gradient")
    log_rhos, vs = vtrace_returns.log_rhos, vtrace_returns.vs
    return {"policy_loss": pg_loss.detach(), "value_loss": value_loss.detach(), "entropy": entropy.detach(),
            "approx_kl": (log_rhos.exp() - 1 - log_rhos).mean(),  # KL(mu || pi) estimated on mu's actions
            "explained_variance": 1 - (vs - values[:-1].detach()).var() / vs.var()}


def check_args(args):
    """Fail at once, before anything heavy is allocated, with one line naming the flag."""
    def require(ok, message):
        if not ok:
            raise SystemExit(f"error: {message}")
    require(args.env_id in PROCGEN_RANGES, f"--env-id {args.env_id!r} is not a Procgen game; choose one of: "
            + ", ".join(PROCGEN_RANGES))
    for flag in ("total_timesteps", "num_actors", "envs_per_actor", "unroll_length", "batch_size",
                 "updates_per_iteration", "eval_episodes", "hidden_size", "save_every"):
        require(getattr(args, flag) > 0, f"--{flag.replace('_', '-')} {getattr(args, flag)} must be > 0")
    for flag in ("num_levels", "start_level", "env_threads", "torch_threads", "eval_every", "max_policy_lag"):
        require(getattr(args, flag) >= 0, f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 0")
    require(args.batch_size % args.envs_per_actor == 0, f"--batch-size {args.batch_size} must be a multiple of "
            f"--envs-per-actor {args.envs_per_actor} (an actor hands over the unrolls of all its games at once); try "
            f"--batch-size {args.envs_per_actor * max(1, round(args.batch_size / args.envs_per_actor))}")
    steps_per_iteration = args.updates_per_iteration * args.batch_size * args.unroll_length
    require(args.total_timesteps >= steps_per_iteration, f"--total-timesteps {args.total_timesteps} is less than one "
            f"iteration (updates_per_iteration * batch_size * unroll_length = {steps_per_iteration})")
    require(0 < args.gamma <= 1 and 0 <= args.vtrace_lambda <= 1,
            f"--gamma {args.gamma} must be in (0, 1], --vtrace-lambda {args.vtrace_lambda} in [0, 1]")
    require(args.learning_rate > 0 and min(args.rho_bar, args.c_bar, args.pg_rho_bar) > 0,
            "--learning-rate, --rho-bar, --c-bar and --pg-rho-bar must be > 0")
    require(len(args.channels) > 0 and min(args.channels) > 0, f"--channels {args.channels} must be positive")
    require(not args.eval_only or args.checkpoint, "--eval-only needs --checkpoint PATH")
    for flag in ("checkpoint", "resume"):
        path = getattr(args, flag)
        require(path is None or os.path.isfile(path), f"--{flag} {path}: no such file")


def thread_budget(args, device):
    """Busy threads beyond the cores preempt each other (most of the time goes to the kernel). Here each actor thread
    runs its own forward passes and procgen's C++ threads, and the learner its forward and backward, all sharing
    torch's per-process thread count. On CPU the networks dominate: the actors and the learner split the cores for
    torch, procgen gets one thread per actor. On GPU procgen gets the cores, split between the actors."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env_threads = args.env_threads or (max(1, min(cores // args.num_actors, args.envs_per_actor))
                                       if device.type == "cuda" else 1)
    torch_threads = args.torch_threads or (1 if device.type == "cuda" else max(1, cores // (args.num_actors + 1)))
    return env_threads, torch_threads


def catch_interrupt():
    """The first Ctrl-C only raises a flag that the training loop reads where it can stop cleanly, so a checkpoint
    never holds half an update; a second Ctrl-C stops at once (keeping the last checkpoint)."""
    requested = []

    def handler(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(True)
        print("\nCtrl-C: stopping at the next clean point to save a checkpoint (Ctrl-C again: stop now)", flush=True)
    signal.signal(signal.SIGINT, handler)
    return requested


class Logger:
    """Each row goes to runs/<run_name>/metrics.jsonl and, with --track, to wandb (step = global_step)."""

    def __init__(self, args, run_name, run_dir, resume_iteration=None):
        path = os.path.join(run_dir, "metrics.jsonl")
        if resume_iteration is not None and os.path.exists(path):  # drop rows of iterations done after the checkpoint
            with open(path) as f:
                kept = [line for line in f if json.loads(line)["iteration"] <= resume_iteration]
            with open(path, "w") as f:
                f.writelines(kept)
        with open(os.path.join(run_dir, "args.json"), "w") as f:  # the run's flags, for benchmarks/results.py
            json.dump({"script": os.path.basename(__file__), **asdict(args)}, f, indent=1)
        self.file, self.wandb = open(path, "a"), None
        if args.track:
            import wandb
            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, mode=args.wandb_mode,
                                    name=run_name, id=run_name, resume="allow", config=asdict(args), dir=run_dir)

    def log(self, row, video=None):
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            import wandb
            self.wandb.log({**row, **({"eval/video": wandb.Video(video, format="mp4")} if video else {})},
                           step=row["global_step"])

    def close(self):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def save_checkpoint(path, **state):
    """Atomic: a crash mid-write leaves the previous checkpoint intact."""
    state["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path, args):
    """The checkpoint's args win, except the RUNTIME_FLAGS given on this command line."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    saved = {**checkpoint["args"], **{flag: getattr(args, flag) for flag in RUNTIME_FLAGS}}
    unknown = set(saved) - set(Args.__dataclass_fields__)
    if unknown:
        raise SystemExit(f"error: {path} was written by another script (it has flags {sorted(unknown)})")
    return checkpoint, Args(**{**saved, "channels": tuple(saved["channels"]),
                               "resume": args.resume, "eval_only": args.eval_only, "checkpoint": args.checkpoint})


def write_video(path, frames, fps=15):
    import imageio.v3 as iio  # through PyAV, which ships libx264 (gym3 pins an imageio-ffmpeg too old to import)
    iio.imwrite(path[: -len(".mp4")] + ".tmp.mp4", frames, plugin="pyav", codec="libx264", fps=fps)
    os.replace(path[: -len(".mp4")] + ".tmp.mp4", path)


@torch.no_grad()
def evaluate(agent, args, device, seed, video_path=None):
    """Mean raw return of the stochastic policy, one episode per env, on levels drawn from the unbounded level
    distribution (num_levels=0; procgen then ignores start_level): with --num-levels N > 0 these are levels it did
    not train on, up to a vanishing chance (as train-procgen's test worker); with N = 0 training covers them all."""
    envs = RecordEpisodeStatistics(ProcgenVecEnv(args.eval_episodes, args.env_id, args.distribution_mode, 0, 0,
                                                 args.env_threads))
    obs, _ = envs.reset(seed=seed)
    returns, frames = np.full(args.eval_episodes, np.nan), [obs[0]]
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
        write_video(video_path, [frame.repeat(4, 0).repeat(4, 1) for frame in frames])  # 64x64 -> 256x256
    return float(returns.mean())


def train(args):
    check_args(args)
    if args.resume or args.eval_only:
        checkpoint, args = load_checkpoint(args.resume or args.checkpoint, args)
    items_per_update = args.batch_size // args.envs_per_actor  # an actor hands over envs_per_actor unrolls at once
    steps_per_iteration = args.updates_per_iteration * args.batch_size * args.unroll_length
    num_iterations = args.total_timesteps // steps_per_iteration
    if num_iterations * steps_per_iteration != args.total_timesteps and not args.eval_only:
        print(f"note: training {num_iterations * steps_per_iteration:,} steps ({num_iterations} whole iterations)")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cudnn.benchmark = not args.torch_deterministic  # autotuned kernels are faster, not reproducible
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    args.env_threads, torch_threads = thread_budget(args, device)
    torch.set_num_threads(torch_threads)
    autocast = lambda: torch.autocast("cuda", torch.bfloat16, enabled=args.amp and device.type == "cuda")
    start_iteration = checkpoint["iteration"] + 1 if args.resume else 1
    run_name = checkpoint["run_name"] if args.resume else \
        f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}" + ("__eval" if args.eval_only else "")
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if args.resume else os.path.join("runs", run_name)
    os.makedirs(os.path.join(run_dir, "videos") if args.capture_video else run_dir, exist_ok=True)
    logger = Logger(args, run_name, run_dir, resume_iteration=start_iteration - 1 if args.resume else None)

    agent = Agent(args, num_actions=15).to(device)
    if args.channels_last:
        agent = agent.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    if args.resume or args.eval_only:
        agent.load_state_dict(checkpoint["agent"])
    policy = torch.compile(agent) if args.compile else agent  # shares the weights; compiled forward

    def run_evaluation(iteration, global_step):
        video = os.path.join(run_dir, "videos", f"eval_{iteration:05d}.mp4") if args.capture_video else None
        start = time.time()
        eval_return = evaluate(agent, args, device, seed=args.seed + 10**6 + iteration, video_path=video)
        score = normalized_score(args.env_id, args.distribution_mode, eval_return)
        logger.log({"global_step": global_step, "iteration": iteration, "eval/episodic_return": eval_return,
                    "eval/normalized_score": score, "time/eval": time.time() - start}, video)
        print(f"eval @ {global_step:,} steps: return {eval_return:.2f} over {args.eval_episodes} episodes"
              + (f", normalized score {score:.3f}" if score is not None else "")
              + (f", video {video}" if video else ""))

    if args.eval_only:
        run_evaluation(checkpoint["iteration"], checkpoint["global_step"])
        return logger.close()

    # Actors are threads of this process: procgen's C++ stepping and torch's kernels release the GIL, threads share
    # the device (batched inference per actor, no copies between processes) and procgen needs no fork. Each actor has
    # its own games (with their own reward normalizer) and its own copy of the network.
    actor_envs = [make_env(args, args.envs_per_actor) for _ in range(args.num_actors)]
    actor_agents = [copy.deepcopy(agent) for _ in range(args.num_actors)]
    if args.resume:
        optimizer.load_state_dict(checkpoint["optimizer"])
        for envs, reward_rms in zip(actor_envs, checkpoint["reward_rms"]):
            envs.env.return_rms.mean, envs.env.return_rms.var, envs.env.return_rms.count = reward_rms
        print(f"resuming {run_name} at iteration {start_iteration}")  # RNG states not restored: timing decides anyway

    def checkpoint_state(iteration):
        rms = [envs.env.return_rms for envs in actor_envs]
        return dict(agent=agent.state_dict(), optimizer=optimizer.state_dict(), iteration=iteration,
                    global_step=iteration * steps_per_iteration, reward_rms=[(r.mean, r.var, r.count) for r in rms],
                    args=asdict(args), run_name=run_name)

    # A resumed run starts new episodes in fresh games, seeded by (seed, iteration, actor) so no level is replayed.
    first_obs = [torch.as_tensor(envs.reset(seed=args.seed + (start_iteration - 1) * args.num_actors + i)[0],
                                 device=device) for i, envs in enumerate(actor_envs)]
    version = (start_iteration - 1) * args.updates_per_iteration  # the learner's policy version: updates so far
    # The queue holds one batch: the learner always finds its next batch ready; a fuller queue only adds lag.
    lock, stop, unrolls, errors = threading.Lock(), threading.Event(), queue.Queue(maxsize=items_per_update), []

    def actor(index):  # IMPALA's actor: copy the learner's weights, play one unroll, hand it over; repeat
        obs = first_obs[index]
        try:
            while not stop.is_set():
                with lock:  # the learner steps the optimizer under this lock: whole weights, and their version
                    actor_agents[index].load_state_dict(agent.state_dict())
                    behaviour_version = version
                unroll = collect_unroll(actor_agents[index], actor_envs[index], obs, args.unroll_length, autocast)
                unroll["version"], obs = behaviour_version, unroll["obs"][-1]
                while not stop.is_set():  # the queue is bounded: an actor ahead of the learner waits here
                    with contextlib.suppress(queue.Full):
                        unrolls.put(unroll, timeout=0.1)
                        break
        except BaseException as error:  # handed to the learner, which re-raises it: the run stops with its message
            errors.append(error)

    def next_unroll():  # the learner's end of the queue, where an actor's exception stops the run
        while not errors:
            with contextlib.suppress(queue.Empty):
                return unrolls.get(timeout=0.1)
        raise errors[0]

    def stop_actors():  # each actor finishes its unroll (or its wait on the queue) and returns
        stop.set()
        for thread in threads:
            thread.join()

    threads = [threading.Thread(target=actor, args=(i,), name=f"actor-{i}", daemon=True)
               for i in range(args.num_actors)]
    for thread in threads:
        thread.start()
    global_step, completed = (start_iteration - 1) * steps_per_iteration, start_iteration - 1
    start_time, start_step, recent_returns = time.time(), global_step, collections.deque(maxlen=100)
    interrupted = catch_interrupt()
    try:
        for iteration in range(start_iteration, num_iterations + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1.0 - (iteration - 1) / num_iterations)
            wait_time, learn_time, lags, dropped, stats, episode_returns, episode_lengths = 0.0, 0.0, [], 0, [], [], []
            for _ in range(args.updates_per_iteration):
                # 1. Wait for batch_size unrolls; policy lag = learner version - the version the actor played with.
                wait_start, items = time.time(), []
                while len(items) < items_per_update:
                    item = next_unroll()
                    episode_returns += item["episode_returns"]
                    episode_lengths += item["episode_lengths"]
                    lag = version - item["version"]
                    if lag > args.max_policy_lag:  # too stale: drop it rather than make the actors wait
                        dropped += args.envs_per_actor
                        continue
                    lags += [lag] * args.envs_per_actor
                    items.append(item)
                learn_start = time.time()
                wait_time += learn_start - wait_start

                # 2. V-trace and one gradient step; the new weights and their version are published together.
                batch = {key: torch.cat([item[key] for item in items], dim=1)
                         for key in ("obs", "actions", "behaviour_logits", "rewards", "dones")}
                stats.append(vtrace_backward(policy, optimizer, batch, args, autocast))
                with lock:
                    optimizer.step()
                    version += 1
                learn_time += time.time() - learn_start
            global_step += steps_per_iteration

            # 3. Log: one row per iteration to metrics.jsonl (and wandb), one line to the console. Columns: global_step,
            # iteration, time, charts/{SPS, learning_rate, episodes, episodic_return, episodic_length,
            # episodic_return_last100}, losses/{policy_loss, value_loss, entropy, approx_kl,
            # explained_variance} (means over the iteration's updates), policy_lag/{mean, max, dropped} and
            # policy_lag/count_k for k = 0..max_policy_lag (unrolls trained on, by lag; dropped unrolls are not in
            # them), time/{wait, learn} (the learner waiting for unrolls, and learning), perf/gpu_memory_gb (peak;
            # None on CPU). Eval rows as in PPO.
            recent_returns.extend(episode_returns)
            sps = (global_step - start_step) / (time.time() - start_time)
            average = lambda xs: float(np.mean(xs)) if len(xs) else None
            losses = dict(zip(stats[0], torch.stack([torch.stack(list(s.values())) for s in stats]).mean(0).tolist()))
            lag_counts = np.bincount(lags, minlength=args.max_policy_lag + 1).tolist()
            logger.log({"global_step": global_step, "iteration": iteration, "time": time.time() - start_time,
                        "charts/SPS": sps, "charts/learning_rate": optimizer.param_groups[0]["lr"],
                        "charts/episodes": len(episode_returns), "charts/episodic_return": average(episode_returns),
                        "charts/episodic_length": average(episode_lengths),
                        "charts/episodic_return_last100": average(recent_returns),
                        **{f"losses/{key}": value for key, value in losses.items()},
                        "policy_lag/mean": average(lags), "policy_lag/max": max(lags), "policy_lag/dropped": dropped,
                        **{f"policy_lag/count_{lag}": count for lag, count in enumerate(lag_counts)},
                        "time/wait": wait_time, "time/learn": learn_time,
                        "perf/gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
                        else None})
            completed = iteration
            eta = (num_iterations - iteration) * steps_per_iteration / sps / 60
            print(f"iter {iteration}/{num_iterations} | step {global_step:,} | SPS {sps:,.0f} (wait {wait_time:.1f}s, "
                  f"learn {learn_time:.1f}s) | ETA {eta:.1f} min | lag {average(lags):.2f} (max {max(lags)}, dropped "
                  f"{dropped}) | return " + (f"{average(episode_returns):.2f} ({len(episode_returns)} eps)"
                                             if episode_returns else "-")
                  + f" | pg {losses['policy_loss']:.3f} v {losses['value_loss']:.3f} ent {losses['entropy']:.3f}"
                  f" kl {losses['approx_kl']:.4f}", flush=True)

            if args.eval_every and iteration % args.eval_every == 0 or iteration == num_iterations:
                run_evaluation(iteration, global_step)
            if args.save_model and (iteration % args.save_every == 0 or iteration == num_iterations):
                save_checkpoint(os.path.join(run_dir, "checkpoint.pt"), **checkpoint_state(iteration))
            if interrupted:  # Ctrl-C: stop here, between iterations, with nothing half done (actors first)
                stop_actors()
                save_checkpoint(os.path.join(run_dir, "checkpoint.pt"), **checkpoint_state(iteration))
                print(f"interrupted: saved iteration {iteration} to {run_dir}/checkpoint.pt; continue with --resume")
                raise SystemExit(130)
    except FloatingPointError as error:  # raised before the step that would have put a NaN into the weights
        stop_actors()
        path = os.path.join(run_dir, "checkpoint_nonfinite.pt")
        save_checkpoint(path, **checkpoint_state(completed))
        raise SystemExit(f"error: {error} after iteration {completed}; the weights before that step are saved in "
                         f"{path} (resume it with a lower --learning-rate, say)")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop_actors()
        for envs in actor_envs:
            envs.close()
        logger.close()
    return run_dir


if __name__ == "__main__":
    train(tyro.cli(Args))
