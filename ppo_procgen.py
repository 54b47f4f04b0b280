"""PPO on Procgen: play a rollout with the current policy, estimate advantages with GAE, then take
a few epochs of clipped policy-gradient steps on it (Schulman et al. 2017, arXiv 1707.06347), with
the IMPALA-CNN and reward normalization of the Procgen benchmark (Cobbe et al. 2020, 1912.01588).

Run:  python ppo_procgen.py --env-id starpilot          (all flags: python ppo_procgen.py --help)
Read top to bottom: the environment, the network, the algorithm's pieces, then `train`, the story;
the appendix below `train` is plumbing (evaluation, torchrun, logs, checkpoints, signals, flags)."""
import collections
import contextlib
import datetime
import functools
import glob
import importlib.util
import io
import json
import math
import os
import pickle
import random
import secrets
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

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
    # Algorithm
    num_steps: int = 256
    """steps per env in each rollout"""
    learning_rate: float = 5e-4
    """Adam learning rate"""
    anneal_lr: bool = False
    """decay the learning rate linearly to 0 over the run"""
    gamma: float = 0.999
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalized advantage estimation"""
    num_minibatches: int = 8
    """minibatches per epoch; must divide num_envs * num_steps"""
    update_epochs: int = 3
    """epochs over each rollout (PPO's K)"""
    adv_norm: Literal["minibatch", "batch", "off"] = "minibatch"
    """normalize advantages per minibatch (baselines PPO), over the whole batch (PPG), or not at all"""
    policy_loss: Literal["clip", "kl-penalty"] = "clip"
    """PPO's surrogate: 'clip' (PPO paper Eq. 7), or 'kl-penalty', the PPO paper's section-4 variant
    (Eq. 8: r A - beta KL(pi_old || pi)), off by default"""
    clip_coef: float = 0.2
    """PPO's epsilon: the surrogate clipping range, also used for the value clipping"""
    clip_vloss: bool = True
    """clip the value loss around the rollout's values (baselines PPO; PPG's L_value is unclipped)"""
    ent_coef: float = 0.01
    """weight of the entropy bonus S[pi] (PPO Eq. 9's c2; PPG's beta_S)"""
    vf_coef: float = 0.5
    """weight of the value loss 1/2 E[(V - V_targ)^2] (PPO Eq. 9's c1: 0.5 in baselines and CleanRL; PPG Eq. 2:
    1, which the PPG code writes as 0.5 x the mean squared error)"""
    max_grad_norm: float = 0.5
    """gradient-norm clip, of each network on its own (PPG's code: none, inf; CleanRL's PPG: 0.5 jointly)"""
    target_kl: Optional[float] = None
    """clip: stop an update after an epoch whose mean approximate KL passes this; kl-penalty: d_targ"""
    kl_beta: Optional[float] = None
    """kl-penalty's beta: a number fixes it; None adapts it from 1 (PPO paper section 4, `adapt_kl_beta`)"""
    kl_estimator: Literal["exact", "official"] = "exact"
    """kl-penalty's KL: 'exact' (PPO paper), or the PPG code's 1/2 (log r)^2 ('official'; its ppgkl runs)"""
    minibatch_unit: Literal["frames", "games"] = "frames"
    """minibatches of random frames (CleanRL, baselines) or of whole games (the PPG code; see `minibatches`)"""
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
    num_envs: int = 64
    """games played at once, over all ranks; each rank plays its share in two pools of equal size
    (one pool where the share is odd)"""
    # The run: seed and length; evaluation; logs; checkpoints; speed
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the experiment's name, part of the run's name"""
    seed: int = 1
    """seed of python, numpy, torch and the games: the same seed gives the same run on a CPU"""
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
    """continue the run of this checkpoint with its flags, weights, optimizer, RNG and reward
    statistics as saved; the games in progress start afresh (docs/reliability.md)"""
    eval_only: bool = False
    """only evaluate the agent of --checkpoint (with --capture-video: and film it)"""
    checkpoint: Optional[str] = None
    """the checkpoint that --eval-only evaluates"""
    env_threads: int = 0
    """procgen worker threads, split between the two pools of games where --num-envs is even (0: one
    on a CPU, the cores on a GPU: see `start_run`; each pool has at least one)"""
    torch_threads: int = 0
    """torch CPU threads (0: one on a GPU; on a CPU half the cores, at least one, not torch's
    default of all: a team of threads waits for its slowest member, so on a busy machine
    all-core teams collapse)"""
    overlap_games: bool = False
    """step half of the games in their threads while the network computes the other half's actions
    (needs an even number of games per rank; the same games and, for the same actions, the same
    trajectories; the network's outputs on half batches may differ from a full batch's in the last bits)"""
    cuda_graph: bool = False
    """on CUDA, capture each rollout step's network, sampling and log-probability as one CUDA graph
    and replay it: one launch where eager PyTorch pays host time for each of its kernels. The graph
    replays the eager step's kernels on fixed tensors and the same random numbers (with --compile,
    all but the captured step runs compiled); off by default: docs/speed.md says where its rollouts
    are shown equal to the eager ones bit for bit. Without CUDA it does nothing"""
    channels_last: bool = True
    """NHWC memory layout for the convolutions (faster on GPUs and on CPUs)"""
    compile: bool = False
    """torch.compile the network (pays off on long GPU runs; the first iterations are slow)"""
    amp: bool = False
    """bfloat16 autocast of the forward passes, losses in float32 (off, as in the papers)"""
    amp_rollout: bool = True
    """with --amp, the rollout's forward passes in bfloat16 too; --no-amp-rollout keeps them in
    float32, bfloat16 for the optimization alone (docs/speed.md: which is faster where)"""


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


def act(policy, obs):
    """pi's logits, V, a sampled action and its log-probability for every game in `obs`: device work
    alone, with no host sync, so that --cuda-graph can capture it as one CUDA graph."""
    logits, value = policy(obs)
    action = sample_action(logits.float())
    return logits, value, action, log_prob_entropy(logits, action)[0]


def policy_step(acts, obs, games=None):
    """An `act` on every game, and the actions on the host. `acts` holds one act per pool of games
    (two with --overlap-games), eager or captured (--cuda-graph). With `games` (--overlap-games) each
    half is sent its actions at once: half A's games step in their own threads while the network
    computes half B's."""
    outputs = []
    for half, (act_half, half_obs) in enumerate(zip(acts, obs.chunk(len(acts)))):
        logits, value, action, log_prob = act_half(half_obs)
        action_cpu = action.cpu().numpy()  # the step's one host sync (one per half)
        if games is not None:
            games.send(half, action_cpu)
        outputs.append((logits, value, action, log_prob, action_cpu))
    if len(outputs) == 1:
        return outputs[0]
    *tensors, action_cpu = zip(*outputs)
    return *(torch.cat(halves) for halves in tensors), np.concatenate(action_cpu)


def log_prob_entropy(logits, actions):
    log_probs = F.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1), entropy


def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """Generalized advantage estimation (Schulman et al. 2016, Eq. 16) on [T, N] tensors. dones[t]
    = 1: obs[t] starts a new episode, so step t-1's TD error must not look past it; the rollout's
    last step bootstraps from V(next_obs).
      delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_{t+1}) - V(s_t)
      A_t     = delta_t + gamma * lambda * (1 - done_{t+1}) * A_{t+1}"""
    advantages = torch.zeros_like(rewards)
    last_advantage = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        next_nonterminal = 1.0 - (next_done if t == rewards.shape[0] - 1 else dones[t + 1])
        next_values = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + gamma * next_values * next_nonterminal - values[t]
        last_advantage = delta + gamma * gae_lambda * next_nonterminal * last_advantage
        advantages[t] = last_advantage
    return advantages


def categorical_kl(old_logits, logits):
    """KL(pi_old(.|s) || pi(.|s)) per state, exactly, summed over the actions."""
    old_log_probs = F.log_softmax(old_logits, dim=-1)
    return (old_log_probs.exp() * (old_log_probs - F.log_softmax(logits, dim=-1))).sum(-1)


def penalty_kl(old_logits, logits, log_ratio, estimator):
    """The per-sample KL(pi_old || pi): exact, or the PPG code's 1/2 (log r)^2 ('official')."""
    if estimator == "official":  # the sampled action's second-order estimate
        return 0.5 * log_ratio**2
    return categorical_kl(old_logits, logits.float())


def policy_loss(ratio, advantages, kl, kind, clip_coef, kl_beta):
    """PPO's surrogate objective on one minibatch, negated; r = pi(a|s) / pi_old(a|s), kl the
    per-state KL(pi_old || pi) (`penalty_kl`). Both keep pi near pi_old, which collected the data:
      'clip'       (PPO Eq. 7): L = E[min(r A, clip(r, 1 - eps, 1 + eps) A)]
      'kl-penalty' (PPO Eq. 8): L = E[r A - beta KL(pi_old(.|s) || pi(.|s))]"""
    if kind == "kl-penalty":
        return (-advantages * ratio + kl_beta * kl).mean()
    return torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()


def value_loss(new_value, old_value, returns, clip_coef, clip_vloss):
    """0.5 E[(V(s) - V_targ)^2]. With clip_vloss (baselines PPO; not in the PPO paper) the value
    may not move more than clip_coef from its rollout value: the larger squared error counts."""
    squared_error = (new_value - returns) ** 2
    if clip_vloss:
        clipped_value = old_value + (new_value - old_value).clamp(-clip_coef, clip_coef)
        squared_error = torch.max(squared_error, (clipped_value - returns) ** 2)
    return 0.5 * squared_error.mean()


def adapt_kl_beta(kl_beta, kl, target_kl):
    """PPO paper, section 4, after each update: d < d_targ / 1.5 -> beta / 2; d > 1.5 d_targ -> 2 beta."""
    if kl < target_kl / 1.5:
        return kl_beta / 2
    if kl > target_kl * 1.5:
        return kl_beta * 2
    return kl_beta


def minibatches(batch_size, args, device):
    """One epoch's minibatches of a flat [num_steps * num_games] batch (index t * num_games + n), by
    --minibatch-unit: random frames, or every step of num_games / num_minibatches random games."""
    num_games = batch_size // args.num_steps
    if args.minibatch_unit == "frames":
        return torch.randperm(batch_size, device=device).split(batch_size // args.num_minibatches)
    games = torch.randperm(num_games, device=device).split(num_games // args.num_minibatches)
    steps = torch.arange(0, batch_size, num_games, device=device)  # t * num_games
    return [(steps[:, None] + group[None, :]).flatten() for group in games]


def clip_grad_norms(optimizer, max_grad_norm):
    """Clip the gradient norm of each parameter group on its own (PPO: one group; PPG: one per
    network: the value network's gradient cannot shrink the policy's step). Returns the norms before."""
    return torch.stack([nn.utils.clip_grad_norm_(group["params"], max_grad_norm) for group in optimizer.param_groups])


def explained_variance(returns, values):
    """1 - Var[R - V] / Var[R] over all ranks: 1 when the values predict the returns, 0 when they explain nothing."""
    _, residual_std = global_moments(returns - values)
    _, returns_std = global_moments(returns)
    return (1 - (residual_std / returns_std) ** 2).item()


def ppo_update(agent, optimizer, batch, args, kl_beta=None, check_stop=None):
    """PPO on one rollout `batch` (flat tensors): K = --update-epochs epochs of the policy and value
    losses. Returns mean statistics; "kl" is the KL before each step of the last epoch; kl-penalty
    adds "kl_after", after the update. `check_stop()`, called before each minibatch, may raise to
    drop the update (a signal)."""
    epochs_pi = epochs_v = args.update_epochs
    autocast = functools.partial(torch.autocast, batch["obs"].device.type, torch.bfloat16, enabled=args.amp)
    batch_size = batch["obs"].shape[0]
    minibatch_size = batch_size // args.num_minibatches
    advantages = batch["advantages"]
    if args.adv_norm == "batch":  # over the whole batch of all ranks, as the PPG code's mpi_moments
        mean, std = global_moments(advantages)
        advantages = (advantages - mean) / (std + 1e-8)
    stats = {}
    steps_taken = 0  # minibatch steps over all epochs so far: a KL early stop ends the update early
    for epoch in range(max(epochs_pi, epochs_v)):
        epoch_kl = epoch_approx_kl = 0.0  # this epoch's sums, for "kl" and for --target-kl
        for minibatch in minibatches(batch_size, args, batch["obs"].device):
            if check_stop is not None:
                check_stop()
            with autocast():
                logits, new_value = agent(batch["obs"][minibatch])
            new_log_prob, entropy = log_prob_entropy(logits, batch["actions"][minibatch])
            mb_advantages = advantages[minibatch]
            if args.adv_norm == "minibatch":  # over the minibatch of all ranks
                mean, std = global_moments(mb_advantages)
                mb_advantages = (mb_advantages - mean) / (std + 1e-8)
            log_ratio = new_log_prob - batch["log_probs"][minibatch]
            ratio = log_ratio.exp()
            kl = penalty_kl(batch["logits"][minibatch], logits, log_ratio, args.kl_estimator)
            pg_loss = policy_loss(ratio, mb_advantages, kl, args.policy_loss, args.clip_coef, kl_beta)
            v_loss = value_loss(new_value.float(), batch["values"][minibatch], batch["returns"][minibatch],
                                args.clip_coef, args.clip_vloss)
            # PPO Eq. 9: L = -L_policy + c1 L_VF - c2 S. A term outside its epochs is left out of
            # the graph: its parameters get no gradient (a zero one would still move them in Adam).
            loss = 0.0
            if epoch < epochs_pi:
                loss = pg_loss - args.ent_coef * entropy.mean()
            if epoch < epochs_v:
                loss = loss + args.vf_coef * v_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(optimizer)
            grad_norms = clip_grad_norms(optimizer, args.max_grad_norm)
            if not torch.isfinite(grad_norms).all():  # one sync: stop before a NaN reaches weights
                raise FloatingPointError(f"non-finite loss {loss.item()} or gradient in epoch {epoch}")
            optimizer.step()
            with torch.no_grad():
                minibatch_stats = {"policy_loss": pg_loss, "value_loss": v_loss, "entropy": entropy.mean(),
                                   "approx_kl": ((ratio - 1) - log_ratio).mean(),
                                   "old_approx_kl": (-log_ratio).mean(),
                                   "clipfrac": ((ratio - 1).abs() > args.clip_coef).float().mean()}
                for key, value in minibatch_stats.items():
                    stats[key] = stats.get(key, 0.0) + value
                epoch_kl = epoch_kl + kl.mean()
                epoch_approx_kl = epoch_approx_kl + minibatch_stats["approx_kl"]
            steps_taken += 1
        stop_early = args.policy_loss == "clip" and args.target_kl is not None  # all ranks agree
        if stop_early and all_reduce_mean(epoch_approx_kl / args.num_minibatches) > args.target_kl:
            break
    stats = {key: value / steps_taken for key, value in stats.items()}
    stats["kl"] = epoch_kl / args.num_minibatches
    if args.policy_loss == "kl-penalty":  # PPO section 4 adapts beta to the KL the update reached
        with torch.no_grad(), autocast():
            logits = torch.cat([agent(obs)[0].float() for obs in batch["obs"].split(minibatch_size)])
        log_ratio = log_prob_entropy(logits, batch["actions"])[0] - batch["log_probs"]
        stats["kl_after"] = penalty_kl(batch["logits"], logits, log_ratio, args.kl_estimator).mean()
    return dict(zip(stats, all_reduce_mean(torch.stack(list(stats.values()))).tolist()))

def train(args):
    run = start_run(args)  # flags checked, torchrun, device, seeds, the run's folder and log
    args, device = run.args, run.device  # a resumed run: its checkpoint's flags
    local_envs = args.num_envs // run.world_size  # this rank's games; --num-envs is global
    batch_size = args.num_envs * args.num_steps
    num_iterations = count_iterations(args, batch_size, device)
    amp_rollout = args.amp and args.amp_rollout  # the update's own autocast follows --amp alone
    autocast = functools.partial(torch.autocast, device.type, torch.bfloat16, enabled=amp_rollout)
    agent = Agent(args, num_actions=15).to(device)
    if args.channels_last:
        agent = agent.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    optimizers = {"optimizer": optimizer}  # by their names in a checkpoint
    envs = make_env(args, local_envs)  # (procgen makes the games at reset)
    start_iteration = restore(run, agent, optimizers, envs)
    policy = torch.compile(agent) if args.compile else agent  # the same weights
    if args.eval_only:  # the checkpoint's agent on held-out levels: one row, one line
        return evaluate_checkpoint(run, agent, envs)
    # Rollout storage lives on the device; frames stay uint8 (4x smaller than float32).
    obs = torch.zeros((args.num_steps, local_envs, 64, 64, 3), dtype=torch.uint8, device=device)
    actions = torch.zeros((args.num_steps, local_envs), dtype=torch.long, device=device)
    log_probs, rewards, dones, values = (torch.zeros((args.num_steps, local_envs), device=device) for _ in range(4))
    rollout_logits = torch.zeros((args.num_steps, local_envs, 15), device=device)  # pi_old, for KL
    frames_to_device = FramesToDevice(local_envs, device)
    games = envs.unwrapped if args.overlap_games else None  # the pools that policy_step starts half by half
    halves = games.halves if games else 1  # one act for all the games, or one per half
    acts = [functools.partial(act, policy)] * halves
    if args.cuda_graph and device.type == "cuda":  # the same steps, each replayed in one launch
        acts = [CapturedAct(functools.partial(act, agent)) for _ in range(halves)]  # the eager network
    kl_beta = args.kl_beta if args.kl_beta is not None else 1.0  # kl-penalty's first beta
    kl_beta = run.checkpoint["kl_beta"] if args.resume else kl_beta
    # New episodes in fresh games, seeded by (seed, iteration, rank): a resumed run replays no level.
    next_obs = frames_to_device(envs.reset(seed=game_seed(args.seed, start_iteration, run.rank))[0])
    next_done = torch.zeros(local_envs, device=device)
    global_step = (start_iteration - 1) * batch_size
    # A signal stops the run at the next rollout step or minibatch, saving the last whole iteration.
    with StopOnSignal(run, closing=(envs,)) as stop:
        for iteration in range(start_iteration, num_iterations + 1):
            if args.anneal_lr:  # linearly to 0 over the run
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (iteration - 1) / num_iterations)

            # 1. Rollout: num_steps steps in each of num_envs games with the current policy.
            episodes = []  # (return, length) of each episode that ends in this rollout
            rollout_start, env_seconds = time.perf_counter(), 0.0  # env_seconds: time inside the games
            for step in range(args.num_steps):
                stop.check()  # after a signal: raises Interrupted
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done
                with torch.no_grad(), autocast():
                    logits, value, action, log_prob, action_cpu = policy_step(acts, next_obs, games)
                values[step] = value.float()
                actions[step] = action
                rollout_logits[step] = logits.float()
                log_probs[step] = log_prob
                env_start = time.perf_counter()
                frames, reward, terminated, truncated, info = envs.step(action_cpu)
                env_seconds += time.perf_counter() - env_start
                rewards[step] = torch.as_tensor(reward, dtype=torch.float32).to(device, non_blocking=True)
                next_done = torch.as_tensor(terminated | truncated, dtype=torch.float32).to(device, non_blocking=True)
                next_obs = frames_to_device(frames)
                if "_episode" in info:  # every episode that ended here, not only the first
                    finished = info["_episode"]
                    episodes += zip(info["episode"]["r"][finished].tolist(), info["episode"]["l"][finished].tolist())
            with torch.no_grad(), autocast():
                next_value = policy(next_obs)[1].float()

            # 2. Advantages and value targets, then 3. the PPO update on the flattened rollout.
            update_start = time.perf_counter()
            # On a GPU the loop's ~2,300 tiny kernels cost more than its arithmetic: it runs on the host,
            # the same float32 operations (the same advantages, bit for bit), one copy each way.
            on_host = [x.cpu() for x in (rewards, values, dones, next_value, next_done)]
            advantages = compute_gae(*on_host, args.gamma, args.gae_lambda).to(device)
            returns = advantages + values
            batch = dict(obs=obs.flatten(0, 1), actions=actions.flatten(), log_probs=log_probs.flatten(),
                         logits=rollout_logits.flatten(0, 1), advantages=advantages.flatten(),
                         returns=returns.flatten(), values=values.flatten())
            stats = ppo_update(policy, optimizer, batch, args, kl_beta, stop.check)
            stats["kl_beta"] = kl_beta if args.policy_loss == "kl-penalty" else None
            if args.policy_loss == "kl-penalty" and args.kl_beta is None:
                kl_beta = adapt_kl_beta(kl_beta, stats["kl_after"], args.target_kl)
            stats["explained_variance"] = explained_variance(returns, values)

            # 4. Log; then evaluate, save a checkpoint and stop where the flags or a signal ask.
            stats.update({"time/rollout": update_start - rollout_start, "time/env": env_seconds,
                          "time/update": time.perf_counter() - update_start,
                          "charts/learning_rate": optimizer.param_groups[0]["lr"]})
            log_iteration(run, iteration, global_step, episodes, stats)
            if args.eval_every and iteration % args.eval_every == 0 or iteration == num_iterations:
                evaluate_and_log(run, agent, iteration, global_step)
            state = checkpoint_state(run, iteration, agent, optimizers, envs, kl_beta)
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


class FramesToDevice:
    """The games' frames onto the device; on CUDA via a pinned staging buffer, asynchronously."""

    def __init__(self, num_envs, device):
        self.device = device
        pinned = device.type == "cuda"
        self.staging = torch.zeros((num_envs, 64, 64, 3), dtype=torch.uint8, pin_memory=pinned)

    def __call__(self, frames):
        if self.device.type != "cuda":
            return torch.from_numpy(frames)
        return self.staging.copy_(torch.from_numpy(frames)).to(self.device, non_blocking=True)


class CapturedAct:
    """--cuda-graph: `act` captured once as a CUDA graph, then replayed at every rollout step. A
    replay launches the eager step's kernels in one call, on the graph's own input and output
    tensors: each replay overwrites the last step's outputs, which the rollout has stored by then.
    The graph draws its random numbers from the default CUDA generator and advances it as the eager
    calls would, so the actions are the eager path's."""

    def __init__(self, act):
        self.act, self.graph = act, None

    def __call__(self, obs):
        if self.graph is None:
            self.capture(obs)
        self.obs.copy_(obs)
        self.graph.replay()
        return self.outputs

    def capture(self, obs):
        # Under the caller's no_grad and autocast, with autocast's cache of bf16 weights off: a
        # cached cast would be replayed with the weights of the step it was made on.
        dtype, amp = torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda")
        no_cache = functools.partial(torch.autocast, "cuda", dtype, enabled=amp, cache_enabled=False)
        self.obs, rng = obs.clone(), torch.cuda.get_rng_state()
        side = torch.cuda.Stream()  # warm-up, as PyTorch asks: cuDNN and cuBLAS set up first
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), no_cache():
            for _ in range(3):
                self.act(self.obs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.set_rng_state(rng)  # the warm-up's draws undone: the run's numbers stay the eager ones
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), no_cache():
            self.outputs = self.act(self.obs)
        self.graph = graph  # only once whole: a capture that failed is never replayed


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


def global_moments(x):
    """Mean and standard deviation of x over all ranks' data (each rank holds as many elements)."""
    if not dist.is_initialized():
        return x.mean(), x.std()
    mean, mean_square = all_reduce_mean(torch.stack([x.mean(), (x * x).mean()]))
    count = x.numel() * dist.get_world_size()
    return mean, ((mean_square - mean**2) * count / (count - 1)).clamp(min=0).sqrt()


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


def checkpoint_state(run, iteration, agent, optimizers, normalizer, kl_beta):
    """All that --resume continues from after `iteration`, in one dict of tensors and plain data
    (what torch.load(weights_only=True) reads): the weights, the `optimizers` (by their keys),
    kl-penalty's beta, the flags and every rank's own reward statistics and RNG states (a
    collective: all ranks call it)."""
    args = run.args
    return {"agent": agent.state_dict(), **{key: optimizer.state_dict() for key, optimizer in optimizers.items()},
            "iteration": iteration, "global_step": iteration * args.num_envs * args.num_steps, "kl_beta": kl_beta,
            "args": asdict(args), "run_name": run.name, "ranks": gather([rank_state(normalizer)])}


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
    check_ranges(args, positive=("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                                 "eval_episodes", "hidden_size", "save_every", "learning_rate", "gamma", "clip_coef",
                                 "max_grad_norm", "target_kl", "adam_eps", "reward_norm_gamma", "reward_clip"),
                 non_negative=("seed", "num_levels", "start_level", "env_threads", "torch_threads", "eval_every",
                               "ent_coef", "vf_coef", "kl_beta"),
                 fractions=("gamma", "gae_lambda", "reward_norm_gamma"))
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's number of ranks
    require(args.num_envs % world_size == 0, f"--num-envs {args.num_envs} must be a multiple of the {world_size} "
            "ranks: each rank steps num_envs / ranks games")
    batch_size = args.num_envs // world_size * args.num_steps
    require(batch_size % args.num_minibatches == 0 and batch_size >= args.num_minibatches,
            f"--num-minibatches {args.num_minibatches} must divide the batch size {batch_size} (num_envs * num_steps"
            f"{f' / {world_size} ranks' if world_size > 1 else ''}); try one of "
            f"{[d for d in (1, 2, 4, 8, 16, 32) if batch_size % d == 0]}")
    local_envs = args.num_envs // world_size
    require(not args.overlap_games or local_envs % 2 == 0, f"--overlap-games steps each rank's {local_envs} games "
            "in two equal halves: make --num-envs an even number per rank")
    require(args.minibatch_unit == "frames" or local_envs % args.num_minibatches == 0,
            f"--minibatch-unit games splits each rank's {local_envs} envs into --num-minibatches "
            f"{args.num_minibatches} equal groups: make it a divisor of {local_envs}")
    require(args.total_timesteps >= args.num_envs * args.num_steps, f"--total-timesteps {args.total_timesteps} is "
            f"less than one iteration (num_envs * num_steps = {args.num_envs * args.num_steps})")
    require(len(args.channels) > 0 and min(args.channels) > 0, f"--channels {args.channels} must be positive")
    require(args.policy_loss == "clip" or args.kl_beta is not None or args.target_kl is not None, "--policy-loss "
            "kl-penalty adapts beta towards --target-kl: give one (the PPO paper's best is 0.01) or fix --kl-beta")


# Printed when a long run starts on a CPU: what it costs there and a run of minutes, both measured
# on 2-core VMs (docs/speed.md).
CPU_NOTE = ("note: training on the CPU. On a 2-core CPU the defaults ran at 147 steps/s with --torch-threads 2: 25M "
            "steps take 2 days (the default, half the cores, is slower on an idle CPU and steady when other programs "
            "keep the cores busy). A run of minutes: python ppo_procgen.py --num-envs 16 --num-steps 64 "
            "--num-minibatches 4 --total-timesteps 65536 (6 minutes on that CPU, idle, with --torch-threads 2). "
            "--amp (bfloat16) ran 1.8x faster on a CPU with AVX512-BF16.")


if __name__ == "__main__":
    train(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
