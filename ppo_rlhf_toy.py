"""RLHF with PPO, end to end, on a toy language small enough to train in minutes on a CPU.

Stages (read `train` top to bottom): synthetic sentiment language -> SFT of a tiny causal transformer (the
initial policy and the frozen reference) -> preference pairs labelled by a Bradley-Terry coin flip of a HIDDEN
gold reward -> reward model (RM) -> PPO against the RM with a per-token KL penalty to the reference (Ziegler et
al. 2019, arXiv 1909.08593; Stiennon et al. 2020) -> evaluation against the gold reward and a best-of-n baseline.
The gold reward gates grammar and penalises repeated adjectives, which the preference data almost never shows,
so the RM can be over-optimised (Gao et al. 2022, arXiv 2210.10760): `--sweep` shows it. Look first at
`collect_rollout` and `ppo_losses`. Implementation details (EOS, padding, temperature, whitening, inits) follow
OpenAI's lm-human-preferences code ("OAI") and Huang et al., "The N+ implementation details of RLHF with PPO",
arXiv 2403.17031 ("N+"); comments name them where the code applies them.

    python ppo_rlhf_toy.py                                               # all stages, about a minute on CPU
    python ppo_rlhf_toy.py --sweep --ppo-iterations 150 --sweep-plot docs/rlhf_sweep.png
    python ppo_rlhf_toy.py --load-sft runs/<run>/sft.pt --load-rm runs/<run>/rm.pt   # after --save-model

Metrics (runs/{run_name}/metrics.jsonl, one JSON object per line, "stage" = sft | rm | ppo | eval | bon |
summary). PPO records use TRL's names: means over the rollout batch of per-sequence sums over response tokens
for objective/kl (k1), objective/kl_k3, objective/entropy (-log pi of the sampled tokens),
objective/non_score_reward (-beta * penalty KL), objective/rlhf_reward (= objective/scores - beta * KL);
objective/scores = proxy/score (RM); objective/kl_coef = beta; policy/approxkl_avg = 0.5 E[(log pi/pi_old)^2];
policy/clipfrac_avg, val/clipfrac_avg (share of tokens where the policy / value clip binds);
policy/entropy_avg (exact entropy during the update); loss/policy_avg, loss/value_avg; val/ratio, val/ratio_var
(mean, variance of minibatch-mean pi/pi_old: ~1); val/num_eos_tokens; lr; episode (sequences so far); eps
(episodes/s). The toy adds gold/score and the gates gold/grammar_rate, gold/eos_rate, gold/repeat_rate,
gold/distinct_frac (distinct responses / batch), samples. rm: rm/heldout_acc (vs noisy labels),
rm/heldout_acc_gold (vs noise-free gold order), rm/label_ceiling (best accuracy possible vs noisy labels),
rm/bias, rm/gain. bon: n, kl_bound, proxy/score, gold/score.
"""
import copy
import json
import math
import os
import random
import re
import time
from dataclasses import dataclass
from typing import Literal, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro

# Knobs that experiments here never needed to change: constants rather than flags, to keep --help short.
SFT_BATCH_SIZE = 128  # SFT sentences per step
RM_BATCH_SIZE = 64  # preference pairs per RM step
HELDOUT_FRAC = 0.1  # fraction of the preference pairs held out to measure RM accuracy
SAMPLE_EVERY = 25  # print (and log) sample texts every this many PPO iterations


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of random, numpy and torch: same seed, same run on CPU"""
    torch_deterministic: bool = True
    """set torch.backends.cudnn.deterministic"""
    cuda: bool = True
    """use CUDA when available"""
    # task: the toy language and the preference data
    corpus_size: int = 20000
    """sentences in the SFT corpus"""
    max_response_len: int = 12
    """response tokens sampled after the prompt (<bos> DET NOUN); every corpus response fits"""
    num_pairs: int = 4000
    """preference pairs sampled from the SFT policy (pairs without EOS are then dropped)"""
    label_noise: float = 0.5
    """tau of the labeller p(a preferred) = sigmoid((r*(a) - r*(b)) / tau); small = near-deterministic"""
    # algorithm: models, SFT, reward model
    d_model: int = 64
    """transformer width; policy, reference, RM and critic share it (with --load-sft, the saved model's)"""
    n_layers: int = 2
    """transformer blocks (with --load-sft, the saved model's)"""
    n_heads: int = 4
    """attention heads (with --load-sft, the saved model's)"""
    sft_steps: int = 600
    """SFT optimizer steps on the corpus"""
    sft_lr: float = 3e-3
    """SFT Adam learning rate, linearly decayed to 0"""
    rm_epochs: int = 4
    """passes over the training pairs (OAI/N+ use 1 epoch of many more labels; our ~3.6k pairs need more)"""
    rm_lr: float = 1e-3
    """RM Adam learning rate, linearly decayed to 0 (as OAI)"""
    # algorithm: PPO
    ppo_iterations: int = 100
    """PPO iterations (rollout + update)"""
    rollout_batch_size: int = 128
    """sequences sampled per iteration"""
    num_minibatches: int = 4
    """minibatches per PPO epoch"""
    ppo_epochs: int = 4
    """passes over each rollout batch"""
    ppo_lr: float = 3e-4
    """Adam learning rate of policy and critic, linearly decayed to 0 (as OAI); Adam eps 1e-5"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    temperature: float = 0.7
    """sampling temperature (OAI/N+ value); logits are divided by it in rollout, reference and update alike"""
    beta: float = 0.05
    """KL coefficient: per-token reward -beta*(log pi - log pi_ref); initial value with --adaptive-kl"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL in the reward: k1 = log pi - log pi_ref, or k3 = (r - 1) - log r with r = pi_ref / pi"""
    adaptive_kl: bool = False
    """adapt beta with Ziegler et al.'s proportional controller towards --kl-target"""
    kl_target: float = 6.0
    """adaptive controller: target KL in nats (Ziegler et al.)"""
    kl_horizon: int = 10000
    """adaptive controller: horizon in episodes (Ziegler et al.; at 128 episodes per iteration beta moves slowly)"""
    clip_coef: float = 0.2
    """PPO policy ratio clip epsilon"""
    clip_coef_value: float = 0.2
    """clip range of the value prediction around its rollout value"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    gamma: float = 1.0
    """discount over response tokens"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: bool = False
    """whiten per-token rewards (without re-centring) before GAE, as OAI did for stylistic tasks"""
    missing_eos_penalty: float = -1.0
    """score given instead of the RM's to a response that never emits EOS (the 'EOS trick' of OAI and N+)"""
    # evaluation
    eval_samples: int = 512
    """samples for the final evaluation of the SFT and PPO policies"""
    bon_pool: int = 256
    """best-of-n baseline: SFT samples per prompt (32 prompts); n = 1, 2, 4, ... up to this"""
    sweep: bool = False
    """run PPO once per --sweep-betas (same SFT and RM) and plot gold and proxy vs sqrt(KL)"""
    sweep_betas: Tuple[float, ...] = (0.0, 0.01, 0.05, 0.2)
    """KL coefficients of the sweep"""
    sweep_plot: Optional[str] = None
    """where the sweep writes its plot (default runs/{run_name}/sweep.png)"""
    # logging and checkpoints
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "rl-reference"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (team)"""
    wandb_mode: Literal["online", "offline"] = "online"
    """wandb mode; offline needs no account or network"""
    save_model: bool = False
    """write sft.pt, rm.pt and the PPO policy checkpoints under runs/{run_name}/"""
    load_sft: Optional[str] = None
    """load the SFT policy from this checkpoint instead of training it"""
    load_rm: Optional[str] = None
    """load the reward model from this checkpoint (needs --load-sft: its normalisation refers to that policy)"""
    # speed
    threads: int = 1
    """torch CPU threads; 1 is fastest for these tiny matrices (2 measured 3-28x slower on a busy 2-core CPU)"""


# ---------------------------------------------------------------- 1. the language and its hidden gold reward
DETS, NOUNS, VERBS = ["the", "a"], ["movie", "plot", "cast", "ending", "music"], ["was", "is", "felt"]
ADVS, CONJS = ["very", "really", "quite"], ["and", "but"]
POSITIVE = ["great", "superb", "fun", "moving", "clever", "lovely"]
NEGATIVE = ["boring", "awful", "dull", "messy", "silly", "bland"]
VOCAB = ["<pad>", "<bos>"] + DETS + NOUNS + VERBS + ["not"] + ADVS + POSITIVE + NEGATIVE + CONJS + ["."]
TOKEN = {w: i for i, w in enumerate(VOCAB)}
PAD, BOS, EOS = TOKEN["<pad>"], TOKEN["<bos>"], TOKEN["."]  # PAD != EOS, else SFT never learns to stop (N+)
PROMPT_LEN = 3
CATEGORY = {w: c for ws, c in [(DETS, "D"), (NOUNS, "N"), (VERBS, "V"), (["not"], "T"), (ADVS, "A"), (POSITIVE, "P"),
                               (NEGATIVE, "M"), (CONJS, "C"), (["."], "E"), (["<pad>", "<bos>"], "_")] for w in ws}
GRAMMAR = re.compile(r"V(T?A?[PM])(CT?A?[PM])*E")  # response: VERB [not] [ADV] ADJ (CONJ [not] [ADV] ADJ)* "."


def make_sentence(rng, max_response_len):
    """A corpus sentence. Its adjectives are distinct, so the preference pairs (SFT samples) rarely show a
    repeated adjective and never an ungrammatical sentence: the RM cannot learn those parts of the gold reward."""
    while True:
        words = [rng.choice(DETS), rng.choice(NOUNS), rng.choice(VERBS)]
        for i, adjective in enumerate(rng.sample(POSITIVE + NEGATIVE, rng.choice([1, 1, 2, 2, 3]))):
            words += ([rng.choice(CONJS)] if i else []) + (["not"] if rng.random() < 0.15 else [])
            words += ([rng.choice(ADVS)] if rng.random() < 0.4 else []) + [adjective]
        if len(words) - 2 + 1 <= max_response_len:  # response = words after DET NOUN, plus "."
            return words + ["."]


def judge(response_words):
    """Hidden gold judgement of one response -> (r*, has EOS, grammatical, repeated adjectives). r* = negation-
    aware (#positive - #negative adjectives) clipped to [-2, 2], minus 0.5 per repeated adjective; r* = -1 when
    the response never ends (no EOS) and -2 when it is ungrammatical."""
    if "." not in response_words:
        return -1.0, False, False, 0
    words = response_words[: response_words.index(".") + 1]
    if not GRAMMAR.fullmatch("".join(CATEGORY[w] for w in words)):
        return -2.0, True, False, 0
    sentiment, negated, seen, repeats = 0, False, set(), 0
    for w in words:
        negated = (negated or w == "not") and w not in CONJS  # "not" negates up to the next conjunction
        if CATEGORY[w] in "PM":
            sentiment += (1 if w in POSITIVE else -1) * (-1 if negated else 1)
            repeats, seen = repeats + (w in seen), seen | {w}
    return max(-2, min(2, sentiment)) - 0.5 * repeats, True, True, repeats


def decode(tokens):
    return [VOCAB[t] for t in tokens if t not in (PAD, BOS)]


def language_stats(responses):
    """Gold score and the gates it checks, over a batch of response token rows."""
    words = [decode(r) for r in responses.tolist()]
    gold, eos, grammatical, repeats = zip(*map(judge, words))
    return {"gold/score": float(np.mean(gold)), "gold/eos_rate": float(np.mean(eos)),
            "gold/grammar_rate": float(np.mean(grammatical)),
            "gold/repeat_rate": float(np.mean([r > 0 for r in repeats])),
            "gold/distinct_frac": len(set(map(tuple, words))) / len(words)}


def random_prompts(n, device):
    """Prompts are <bos> DET NOUN: fixed length, so queries never need (left) padding."""
    dets = torch.randint(0, len(DETS), (n,)) + TOKEN[DETS[0]]
    nouns = torch.randint(0, len(NOUNS), (n,)) + TOKEN[NOUNS[0]]
    return torch.stack([torch.full((n,), BOS), dets, nouns], 1).to(device)


# ---------------------------------------------------------------- 2. the model: a tiny GPT with an LM or scalar head
class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.ln1, self.ln2 = n_heads, nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, mask):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Pre-LN causal transformer with no dropout anywhere: dropout would make the first PPO ratio != 1 (N+).
    out_dim = vocab size: a policy (logits); out_dim = 1: a scalar per position (reward model, critic).
    PAD keys are masked and position ids skip PADs, so any padding gives the same outputs."""

    def __init__(self, vocab_size, out_dim, d_model, n_layers, n_heads, max_len, banned_tokens=()):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, out_dim=out_dim, d_model=d_model, n_layers=n_layers,
                           n_heads=n_heads, max_len=max_len, banned_tokens=tuple(banned_tokens))
        self.tok, self.pos = nn.Embedding(vocab_size, d_model), nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, out_dim)
        if out_dim == 1:  # OAI's reward head init: N(0, 1/sqrt(d_model + 1)), bias 0
            nn.init.normal_(self.head.weight, std=1 / math.sqrt(d_model + 1)), nn.init.zeros_(self.head.bias)
        banned = torch.isin(torch.arange(out_dim), torch.tensor(banned_tokens, dtype=torch.long))
        self.register_buffer("banned", banned)

    def forward(self, tokens):
        real, T = tokens != PAD, tokens.shape[1]
        ones = torch.ones(T, T, dtype=torch.bool, device=tokens.device)
        mask = (ones.tril() & (real[:, None, :] | ones.diag().diag()))[:, None]  # a PAD query sees itself only
        x = self.tok(tokens) + self.pos((real.cumsum(1) - 1).clamp(min=0))
        for block in self.blocks:
            x = block(x, mask)
        out = self.head(self.ln_f(x))
        # <pad>/<bos> are never sampled; -1e9 rather than -inf keeps p * log p finite in entropies
        return out.squeeze(-1) if out.shape[-1] == 1 else out.masked_fill(self.banned, -1e9)


def make_model(args, out_dim):
    return TinyTransformer(len(VOCAB), out_dim, args.d_model, args.n_layers, args.n_heads,
                           PROMPT_LEN + args.max_response_len, banned_tokens=(PAD, BOS) if out_dim > 1 else ())


# ---------------------------------------------------------------- 3. the algorithm's pure pieces
@torch.no_grad()
def sample(policy, queries, max_new_tokens, temperature, eos_id=EOS, pad_id=PAD):
    """Pure ancestral sampling at `temperature` (no top-k / top-p). A row stops at its first EOS and is padded
    with PAD. Returns responses (B, max_new_tokens) and the log-probs of the sampled tokens."""
    tokens, done, logprobs = queries, torch.zeros(len(queries), dtype=torch.bool, device=queries.device), []
    for _ in range(max_new_tokens):
        logp = F.log_softmax(policy(tokens)[:, -1] / temperature, -1)
        nxt = torch.multinomial(logp.exp(), 1).squeeze(1).masked_fill(done, pad_id)
        logprobs.append(logp.gather(1, nxt[:, None]).squeeze(1).masked_fill(done, 0.0))
        tokens, done = torch.cat([tokens, nxt[:, None]], 1), done | (nxt == eos_id)
        if done.all():
            break
    pad = max_new_tokens - len(logprobs)
    return F.pad(tokens[:, queries.shape[1]:], (0, pad), value=pad_id), F.pad(torch.stack(logprobs, 1), (0, pad))


def response_logprobs(model, queries, responses, temperature):
    """log pi(y_t | x, y_<t) of each response token and the full log-softmax, with the logits divided by the
    sampling temperature. The logits at position t predict token t + 1, hence the shift."""
    all_logp = F.log_softmax(model(torch.cat([queries, responses], 1))[:, queries.shape[1] - 1: -1] / temperature, -1)
    return all_logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1), all_logp


def response_values(critic, queries, responses):
    """V(x, y_<t), read at the same position as the logits that chose y_t."""
    return critic(torch.cat([queries, responses], 1))[:, queries.shape[1] - 1: -1]


def response_mask(responses, eos_id=EOS):
    """1.0 on response tokens up to and including the first EOS, 0.0 after it."""
    is_eos = (responses == eos_id).int()
    return ((is_eos.cumsum(1) - is_eos) == 0).float()


def score_at_eos(per_token_scores, tokens, eos_id=EOS):
    """The RM score is the scalar at each row's first EOS token (as N+): not the last position (a PAD when
    right-padded), not one step after EOS. Rows without EOS read position 0; callers replace them (EOS trick)."""
    return per_token_scores.gather(1, (tokens == eos_id).int().argmax(1, keepdim=True)).squeeze(1)  # argmax: first max


def bradley_terry_loss(r_chosen, r_rejected):
    """-log sigma(r_chosen - r_rejected): negative log-likelihood of the labeller's choice under Bradley-Terry."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def kl_estimate(logp, ref_logp, estimator="k1"):
    """Per-token KL(pi || pi_ref) estimates from tokens sampled from pi (Schulman, "Approximating KL"): k1 = log pi -
    log pi_ref, unbiased but negative for some tokens; k3 = (r - 1) - log r with r = pi_ref / pi, unbiased, never
    negative, lower variance."""
    log_r = ref_logp - logp
    return -log_r if estimator == "k1" else log_r.exp() - 1 - log_r


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over unmasked entries with the population variance, as TF; shift_mean=False
    adds the mean back (OAI does that for rewards)."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_mean((x - mean) ** 2, mask) + eps)
    return whitened if shift_mean else whitened + mean


def per_token_rewards(kl, scores, mask, beta):
    """r_t = -beta * KL_t on every response token, plus the sequence score on the last one (the EOS token, or
    the final token when there is none): Ziegler et al.'s R(x, y) - beta log(pi/pi_ref) spread over tokens."""
    rewards = -beta * kl * mask
    rewards[torch.arange(len(scores), device=scores.device), mask.sum(1).long() - 1] += scores
    return rewards


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16) over response tokens: delta_t = r_t +
    gamma V_{t+1} - V_t with V = 0 after the last token; A_t = delta_t + gamma lam A_{t+1}; returns = A + V."""
    rewards, values = rewards * mask, values * mask
    advantages, running, T = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0]), rewards.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else 0.0
        running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    return advantages * mask, (advantages + values) * mask


def ppo_losses(logp, old_logp, advantages, values, old_values, returns, mask, clip_coef, clip_coef_value):
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) and the clipped value loss of OAI / N+, masked
    means over response tokens. Returns (policy loss, value loss, diagnostics)."""
    log_ratio = (logp - old_logp) * mask
    ratio = log_ratio.exp()
    pg_unclipped, pg_clipped = -advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)
    values_clipped = old_values + (values - old_values).clamp(-clip_coef_value, clip_coef_value)
    vf_unclipped, vf_clipped = (values - returns) ** 2, (values_clipped - returns) ** 2
    stats = {"ratio": masked_mean(ratio, mask), "approxkl": 0.5 * masked_mean(log_ratio ** 2, mask),
             "clipfrac": masked_mean((pg_clipped > pg_unclipped).float(), mask),
             "vf_clipfrac": masked_mean((vf_clipped > vf_unclipped).float(), mask)}
    policy_loss = masked_mean(torch.max(pg_unclipped, pg_clipped), mask)
    return policy_loss, 0.5 * masked_mean(torch.max(vf_unclipped, vf_clipped), mask), stats


def adaptive_kl_beta(beta, kl, target, n_steps, horizon):
    """Ziegler et al.'s proportional controller: e = clip(KL/target - 1, -0.2, 0.2); beta *= 1 + e n_steps/horizon."""
    return beta * (1 + float(np.clip(kl / target - 1, -0.2, 0.2)) * n_steps / horizon)


def best_of_n_kl_bound(n):
    """KL(best-of-n || base) <= log n - (n - 1)/n (Stiennon et al. App. G.3; an upper bound, Beirami et al. 2024)."""
    return math.log(n) - (n - 1) / n


def best_of_n_weights(m, n):
    """P(the i-th lowest-scored of m samples is the best of a uniformly random n-subset) = C(i-1, n-1) / C(m, n):
    weighting a sorted pool by these gives an unbiased best-of-n estimate that uses every sample."""
    return torch.tensor([math.comb(i - 1, n - 1) / math.comb(m, n) for i in range(1, m + 1)], dtype=torch.float64)


@torch.no_grad()
def collect_rollout(policy, ref_policy, critic, queries, score_fn, beta, args, eos_id=EOS, pad_id=PAD):
    """Sample responses, score them, and turn the scores into per-token rewards, advantages and returns."""
    responses = sample(policy, queries, args.max_response_len, args.temperature, eos_id, pad_id)[0]
    mask = response_mask(responses, eos_id)
    # log-probs recomputed by a plain forward (as OAI); a test checks they equal the sampling ones
    logp = response_logprobs(policy, queries, responses, args.temperature)[0] * mask
    ref_logp = response_logprobs(ref_policy, queries, responses, args.temperature)[0] * mask
    values, scores = response_values(critic, queries, responses) * mask, score_fn(queries, responses)
    kl = kl_estimate(logp, ref_logp, args.kl_estimator) * mask
    rewards = per_token_rewards(kl, scores, mask, beta)
    if args.whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False) * mask
    advantages, returns = gae(rewards, values, mask, args.gamma, args.lam)
    advantages = whiten(advantages, mask) * mask  # advantages are whitened with re-centring (OAI)
    return dict(queries=queries, responses=responses, mask=mask, logp=logp, ref_logp=ref_logp, values=values,
                scores=scores, kl=kl, advantages=advantages, returns=returns)


def ppo_update(policy, critic, optimizer, batch, args):
    """args.ppo_epochs passes over the batch in args.num_minibatches minibatches; one diagnostics dict each."""
    n, stats, params = len(batch["queries"]), [], [p for g in optimizer.param_groups for p in g["params"]]
    for _ in range(args.ppo_epochs):
        for idx in torch.randperm(n, device=batch["queries"].device).split(n // args.num_minibatches):
            b = {k: v[idx] for k, v in batch.items()}
            logp, all_logp = response_logprobs(policy, b["queries"], b["responses"], args.temperature)
            values = response_values(critic, b["queries"], b["responses"])
            pg_loss, vf_loss, s = ppo_losses(logp * b["mask"], b["logp"], b["advantages"], values, b["values"],
                                             b["returns"], b["mask"], args.clip_coef, args.clip_coef_value)
            optimizer.zero_grad()
            (pg_loss + args.vf_coef * vf_loss).backward()
            nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            entropy = masked_mean(-(all_logp.exp() * all_logp).sum(-1), b["mask"])
            s.update(pg_loss=pg_loss, vf_loss=vf_loss, entropy=entropy)
            stats.append({k: v.item() for k, v in s.items()})
    return stats


def run_ppo(args, beta, policy, ref_policy, critic, score_fn, prompt_fn, eval_fn=None, log=None, eos_id=EOS,
            pad_id=PAD):
    """PPO against score_fn with a KL leash to ref_policy. Generic over the models (token ids -> logits or
    values) and the reward: the tests run it on an enumerable task. Returns one metrics dict per iteration."""
    # Plain PyTorch Adam, eps 1e-5. TF's Adam (OAI) effectively uses eps / sqrt(1 - beta2^t), far larger in the
    # first steps, so PyTorch's early updates are bigger (~6x approxkl in lm-human-preference-details).
    optimizer = torch.optim.Adam([*policy.parameters(), *critic.parameters()], lr=args.ppo_lr, eps=1e-5)
    history, start = [], time.time()
    for iteration in range(1, args.ppo_iterations + 1):
        lr = args.ppo_lr * (1 - (iteration - 1) / args.ppo_iterations)  # linear decay to 0 (as OAI)
        optimizer.param_groups[0]["lr"] = lr
        queries = prompt_fn(args.rollout_batch_size)
        batch = collect_rollout(policy, ref_policy, critic, queries, score_fn, beta, args, eos_id, pad_id)
        stats = ppo_update(policy, critic, optimizer, batch, args)
        mean = {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}
        seq = lambda x: float((x * batch["mask"]).sum(1).mean())  # mean over sequences of a per-token sum
        episodes, score, kl = iteration * args.rollout_batch_size, float(batch["scores"].mean()), seq(batch["kl"])
        m = {"stage": "ppo", "episode": episodes, "lr": lr, "eps": episodes / (time.time() - start),
             "objective/kl": seq(batch["logp"] - batch["ref_logp"]),
             "objective/kl_k3": seq(kl_estimate(batch["logp"], batch["ref_logp"], "k3")),
             "objective/entropy": seq(-batch["logp"]), "objective/kl_coef": beta, "objective/scores": score,
             "objective/non_score_reward": -beta * kl, "objective/rlhf_reward": score - beta * kl,
             "policy/approxkl_avg": mean["approxkl"], "policy/clipfrac_avg": mean["clipfrac"],
             "policy/entropy_avg": mean["entropy"], "loss/policy_avg": mean["pg_loss"],
             "loss/value_avg": mean["vf_loss"], "val/clipfrac_avg": mean["vf_clipfrac"], "val/ratio": mean["ratio"],
             "val/ratio_var": float(np.var([s["ratio"] for s in stats])),
             "val/num_eos_tokens": int((batch["responses"] == eos_id).sum()),
             **(eval_fn(batch, iteration) if eval_fn else {})}
        if args.adaptive_kl:
            beta = adaptive_kl_beta(beta, m["objective/kl"], args.kl_target, args.rollout_batch_size, args.kl_horizon)
        history.append(m)
        if log is not None:
            eta = (time.time() - start) / iteration * (args.ppo_iterations - iteration)
            log(m, f"ppo beta={m['objective/kl_coef']:.3g} it {iteration}/{args.ppo_iterations} | "
                   f"{m['eps']:.0f} eps | ETA {eta:.0f}s | kl {m['objective/kl']:.2f} | proxy {score:+.2f} | "
                   f"gold {m.get('gold/score', math.nan):+.2f} | ent {m['objective/entropy']:.2f} | "
                   f"clipfrac {m['policy/clipfrac_avg']:.3f} | ratio {m['val/ratio']:.3f}")
    return history


# ---------------------------------------------------------------- 4. plumbing: validation, logging, checkpoints
def validate_args(args):
    positive = ["corpus_size", "num_pairs", "label_noise", "d_model", "n_layers", "n_heads", "sft_steps",
                "rm_epochs", "ppo_iterations", "rollout_batch_size", "num_minibatches", "ppo_epochs",
                "temperature", "kl_target", "kl_horizon", "eval_samples", "threads"]
    checks = [(getattr(args, f) > 0, f"--{f.replace('_', '-')} {getattr(args, f)} must be > 0") for f in positive] + [
        (args.rollout_batch_size % args.num_minibatches == 0 and args.rollout_batch_size // args.num_minibatches >= 8,
         f"--num-minibatches {args.num_minibatches} must split --rollout-batch-size {args.rollout_batch_size} "
         "into equal minibatches of >= 8 sequences (whitening needs them)"),
        (args.d_model % args.n_heads == 0, f"--n-heads {args.n_heads} must divide --d-model {args.d_model}"),
        (args.max_response_len >= 6, f"--max-response-len {args.max_response_len} must be >= 6 (shortest sentence: 3)"),
        (args.beta >= 0, f"--beta {args.beta} must be >= 0"),
        (len(args.sweep_betas) > 0 and min(args.sweep_betas) >= 0, f"--sweep-betas {args.sweep_betas} must be >= 0"),
        (args.bon_pool >= 2, f"--bon-pool {args.bon_pool} must be >= 2"),
        (args.load_rm is None or args.load_sft is not None,
         f"--load-rm {args.load_rm} needs --load-sft: the RM's normalisation and the critic refer to that SFT policy"),
    ] + [(p is None or os.path.isfile(p), f"--load-{k} {p}: no such file") for k, p in (("sft", args.load_sft),
                                                                                         ("rm", args.load_rm))]
    for ok, message in checks:
        if not ok:
            raise SystemExit(f"error: {message}")
    # A loaded model keeps its own architecture (--d-model etc. do not apply), but it must know every token and
    # have a position embedding for every position the other flags will feed it.
    for flag, path, out_dim in (("--load-sft", args.load_sft, len(VOCAB)), ("--load-rm", args.load_rm, 1)):
        config = torch.load(path, map_location="cpu")["config"] if path else {}
        if config and (config["vocab_size"], config["out_dim"]) != (len(VOCAB), out_dim):
            raise SystemExit(f"error: {flag} {path} is not a {'policy' if out_dim > 1 else 'reward model'} over the "
                             f"{len(VOCAB)} tokens of this language (vocabulary {config['vocab_size']}, "
                             f"output size {config['out_dim']})")
        if config and config["max_len"] < PROMPT_LEN + args.max_response_len:
            raise SystemExit(f"error: --max-response-len {args.max_response_len} is longer than {flag} {path} "
                             f"supports; use at most {config['max_len'] - PROMPT_LEN}")


class Logger:
    """One record per call: runs/{run_name}/metrics.jsonl, an optional console line, and wandb with --track."""

    def __init__(self, args, run_dir, run_name):
        self.file, self.wandb, self.step = open(os.path.join(run_dir, "metrics.jsonl"), "a"), None, 0
        if args.track:
            import wandb  # slow to import: only when asked
            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, mode=args.wandb_mode,
                                    name=run_name, config=vars(args), dir=run_dir)

    def __call__(self, record, line=None):
        self.file.write(json.dumps(record) + "\n"), self.file.flush()
        if self.wandb is not None:  # step = record count: monotonic across the runs of a sweep
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=self.step)
        self.step += 1
        if line is not None:
            print(line, flush=True)

    def close(self):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def save_checkpoint(path, model, **extra):
    torch.save({"config": model.config, "state_dict": model.state_dict(), **extra}, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a crash never leaves a half-written checkpoint


def load_checkpoint(path, device):
    checkpoint = torch.load(path, map_location=device)
    model = TinyTransformer(**checkpoint["config"]).to(device)
    model.load_state_dict(checkpoint["state_dict"])
    return model, checkpoint


# ---------------------------------------------------------------- 5. the stages
def train_sft(args, corpus, device, log):
    """Next-token cross-entropy on the corpus; PAD targets are ignored, the EOS target is kept."""
    model = make_model(args, len(VOCAB)).to(device)
    width = PROMPT_LEN + args.max_response_len
    data = torch.tensor([[BOS] + [TOKEN[w] for w in s] + [PAD] * (width - 1 - len(s)) for s in corpus], device=device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.sft_lr)
    for step in range(args.sft_steps):
        optimizer.param_groups[0]["lr"] = args.sft_lr * (1 - step / args.sft_steps)
        tokens = data[torch.randint(0, len(data), (SFT_BATCH_SIZE,), device=device)]
        loss = F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:], ignore_index=PAD)
        optimizer.zero_grad(), loss.backward(), optimizer.step()
        if (step + 1) % max(1, args.sft_steps // 5) == 0:
            log({"stage": "sft", "step": step + 1, "sft/loss": loss.item()},
                f"sft step {step + 1}/{args.sft_steps} | loss {loss.item():.3f}")
    return model


@torch.no_grad()
def make_preference_pairs(args, sft, device):
    """Two SFT samples (temperature 1) per prompt, labelled "a over b" with p = sigmoid((r*(a) - r*(b)) / tau).
    Pairs with a sample lacking EOS are dropped: the RM score is defined at EOS (missing EOS -> fixed penalty)."""
    queries = random_prompts(args.num_pairs, device).repeat_interleave(2, 0)
    responses = sample(sft, queries, args.max_response_len, 1.0)[0]
    tokens = torch.cat([queries, responses], 1).view(args.num_pairs, 2, -1)
    gold = torch.tensor([judge(decode(r))[0] for r in responses.tolist()]).view(-1, 2)
    keep = (responses == EOS).any(1).view(-1, 2).all(1).cpu()
    tokens, gold = tokens[keep.to(device)], gold[keep]
    p_first = torch.sigmoid((gold[:, 0] - gold[:, 1]) / args.label_noise)
    first_wins = torch.rand(len(gold)) < p_first
    chosen, rejected = [torch.where(first_wins.to(device)[:, None], tokens[:, i], tokens[:, 1 - i]) for i in (0, 1)]
    gold_margin = torch.where(first_wins, 1.0, -1.0) * (gold[:, 0] - gold[:, 1])  # > 0: gold agrees with the label
    return chosen, rejected, gold_margin, torch.maximum(p_first, 1 - p_first)


def train_reward_model(args, sft, pairs, device, log):
    """Bradley-Terry RM: the SFT transformer with a fresh scalar head, read at EOS. Returns the RM and its stats."""
    chosen, rejected, gold_margin, p_label = pairs
    n_train = len(chosen) - max(1, int(len(chosen) * HELDOUT_FRAC))
    rm = TinyTransformer(**{**sft.config, "out_dim": 1, "banned_tokens": ()}).to(device)  # the SFT's architecture
    body = {k: v for k, v in sft.state_dict().items() if not k.startswith("head") and k != "banned"}
    rm.load_state_dict(body, strict=False)
    optimizer = torch.optim.Adam(rm.parameters(), lr=args.rm_lr)
    reward = lambda tokens: score_at_eos(rm(tokens), tokens)
    total, step = args.rm_epochs * math.ceil(n_train / RM_BATCH_SIZE), 0
    for epoch in range(args.rm_epochs):
        for idx in torch.randperm(n_train, device=device).split(RM_BATCH_SIZE):
            optimizer.param_groups[0]["lr"] = args.rm_lr * (1 - step / total)
            loss = bradley_terry_loss(reward(chosen[idx]), reward(rejected[idx]))
            optimizer.zero_grad(), loss.backward(), optimizer.step()
            step += 1
        log({"stage": "rm", "epoch": epoch + 1, "rm/loss": loss.item()},
            f"rm epoch {epoch + 1}/{args.rm_epochs} | loss {loss.item():.3f}")
    with torch.no_grad():
        right = (reward(chosen[n_train:]) > reward(rejected[n_train:])).cpu()
        informative = gold_margin[n_train:] != 0  # a gold tie has no right order
        info = {"rm/heldout_acc": float(right.float().mean()),
                "rm/heldout_acc_gold": float((right == (gold_margin[n_train:] > 0))[informative].float().mean()),
                "rm/label_ceiling": float(p_label[n_train:].mean()), "rm/train_pairs": n_train,
                "rm/heldout_pairs": len(chosen) - n_train}
        # Normalise to mean 0 / std 1 on 512 samples of the PPO initial policy (OAI's gain and bias; N+ uses the
        # bias only): beta then means the same thing whatever scale this RM happened to learn.
        queries = random_prompts(512, device)
        responses = sample(sft, queries, args.max_response_len, args.temperature)[0]
        raw = reward(torch.cat([queries, responses], 1)[(responses == EOS).any(1)])
        info.update({"rm/bias": float(raw.mean()), "rm/gain": float(raw.std())})
    return rm, info


@torch.no_grad()
def evaluate(args, policy, ref_policy, score_fn, device):
    """Fresh samples at the training temperature: proxy and gold scores, gates, and the summed k1 KL."""
    queries = random_prompts(args.eval_samples, device)
    responses = sample(policy, queries, args.max_response_len, args.temperature)[0]
    logp, ref_logp = (response_logprobs(m, queries, responses, args.temperature)[0] for m in (policy, ref_policy))
    kl = float(((logp - ref_logp) * response_mask(responses)).sum(1).mean())
    samples = [" ".join(decode(r)) for r in torch.cat([queries, responses], 1)[:4].tolist()]
    return {"proxy/score": float(score_fn(queries, responses).mean()), "objective/kl": kl,
            **language_stats(responses), "samples": samples}


@torch.no_grad()
def best_of_n(args, sft, score_fn, device):
    """Best-of-n from the SFT policy, n = 1, 2, 4, ... <= bon_pool, estimated from a pool of bon_pool samples for
    each of 32 prompts (best_of_n_weights). Its KL to the SFT policy is quoted by the upper bound log n - (n-1)/n."""
    m = args.bon_pool
    queries = random_prompts(32, device).repeat_interleave(m, 0)
    responses = sample(sft, queries, args.max_response_len, args.temperature)[0]
    proxy = score_fn(queries, responses).view(-1, m).cpu().double()
    gold = torch.tensor([judge(decode(r))[0] for r in responses.tolist()], dtype=torch.float64).view(-1, m)
    order = proxy.argsort(1)
    proxy, gold = proxy.gather(1, order), gold.gather(1, order)
    weights = {2 ** k: best_of_n_weights(m, 2 ** k) for k in range(int(math.log2(m)) + 1)}
    return [{"stage": "bon", "n": n, "kl_bound": best_of_n_kl_bound(n), "proxy/score": float((proxy @ w).mean()),
             "gold/score": float((gold @ w).mean())} for n, w in weights.items()]


def plot_sweep(histories, bon_rows, path):
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global state

    smooth = lambda x: np.convolve(x, np.ones(5) / 5, mode="valid")  # 5-iteration moving average of batch means
    fig = Figure(figsize=(17, 4.8))
    axes = fig.subplots(1, 3)
    colors = ["tab:purple", "tab:blue", "tab:green", "tab:orange", "tab:brown"] * 9
    for (beta, h), color in zip(histories.items(), colors):
        get = lambda key: np.array([x[key] for x in h])
        sqrt_kl = smooth(np.sqrt(np.maximum(get("objective/kl"), 0)))
        for key, style, what in (("gold/score", "-", "gold"), ("proxy/score", "--", "proxy (RM)")):
            axes[0].plot(sqrt_kl, smooth(get(key)), style, color=color, label=f"PPO beta={beta:g}: {what}")
            axes[1].plot(smooth(get("episode")), smooth(get(key)), style, color=color)
        axes[2].plot(get("episode"), get("objective/kl"), color=color, label=f"beta={beta:g}")
    for key, style in (("gold/score", "o-"), ("proxy/score", "o--")):
        label = f"best-of-n (n <= {bon_rows[-1]['n']}): {key.split('/')[0]}, KL upper bound"
        axes[0].plot([math.sqrt(r["kl_bound"]) for r in bon_rows], [r[key] for r in bon_rows], style, ms=4,
                     color="tab:red", label=label)
    ylabel = "score (solid: hidden gold, dashed: proxy RM)"
    axes[0].set(xlabel="sqrt(KL(pi || pi_ref))  [sqrt nats]", ylabel=ylabel, title="gold and proxy vs sqrt(KL)")
    axes[1].set(xlabel="episodes", ylabel=ylabel, title="gold and proxy during PPO (5-iteration means)")
    axes[2].set(xlabel="episodes", ylabel="KL(pi || pi_ref)  [nats]", title="KL to the SFT reference during PPO")
    axes[0].legend(fontsize=7), axes[2].legend(fontsize=8), fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110), os.replace(path + ".tmp.png", path)


# ---------------------------------------------------------------- 6. the story
def train(args: Args):
    validate_args(args)
    run_name = f"rlhf_sentiment__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    log, start = Logger(args, run_dir, run_name), time.time()
    print(f"run {run_name} on {device}")

    # 1-2. language -> SFT policy, which is also the frozen reference policy
    if args.load_sft:
        sft = load_checkpoint(args.load_sft, device)[0]
    else:
        corpus = [make_sentence(random, args.max_response_len) for _ in range(args.corpus_size)]  # `random` is seeded
        print("corpus:", *[" ".join(s) for s in corpus[:3]], sep="\n    ")
        sft = train_sft(args, corpus, device, log)
    if args.save_model:
        save_checkpoint(os.path.join(run_dir, "sft.pt"), sft)
    ref_policy = copy.deepcopy(sft).requires_grad_(False)

    # 3-4. preference pairs labelled through the hidden gold reward -> reward model
    if args.load_rm:
        rm, checkpoint = load_checkpoint(args.load_rm, device)
        rm_info = checkpoint["rm_info"]
    else:
        rm, rm_info = train_reward_model(args, sft, make_preference_pairs(args, sft, device), device, log)
    log({"stage": "rm", **rm_info}, "reward model: " + ", ".join(f"{k} {v:.3f}" for k, v in rm_info.items()))
    if args.save_model:
        save_checkpoint(os.path.join(run_dir, "rm.pt"), rm, rm_info=rm_info)
    rm.requires_grad_(False)

    @torch.no_grad()
    def proxy_score(queries, responses):  # normalised RM score at EOS; the fixed penalty without EOS (EOS trick)
        tokens = torch.cat([queries, responses], 1)
        score = (score_at_eos(rm(tokens), tokens) - rm_info["rm/bias"]) / rm_info["rm/gain"]
        return torch.where((responses == EOS).any(1), score, torch.full_like(score, args.missing_eos_penalty))

    def eval_fn(batch, iteration):  # evaluation during PPO, on the rollout batch itself
        out = {"proxy/score": float(batch["scores"].mean()), **language_stats(batch["responses"])}
        if iteration % SAMPLE_EVERY == 0:
            texts = torch.cat([batch["queries"], batch["responses"]], 1)[:3].tolist()
            out["samples"] = [" ".join(decode(r)) for r in texts]
            print("    " + "\n    ".join(out["samples"]))
        return out

    # 5-6. PPO (once, or once per beta of the sweep from the same SFT policy and RM) -> evaluation
    sft_eval, histories, finals = evaluate(args, sft, ref_policy, proxy_score, device), {}, {}
    for beta in args.sweep_betas if args.sweep else (args.beta,):
        torch.manual_seed(args.seed)  # every run of a sweep sees the same random stream: only beta differs
        policy = copy.deepcopy(sft).requires_grad_(True)
        critic = copy.deepcopy(rm).requires_grad_(True)  # the RM, as Stiennon et al. and N+ (the N+ paper's detail 22)
        with torch.no_grad():  # ...with the normalisation folded into its head, so it starts on the reward's scale
            critic.head.bias.sub_(rm_info["rm/bias"]).div_(rm_info["rm/gain"])
            critic.head.weight.div_(rm_info["rm/gain"])
        prompt_fn = lambda n: random_prompts(n, device)
        histories[beta] = run_ppo(args, beta, policy, ref_policy, critic, proxy_score, prompt_fn, eval_fn, log)
        finals[beta] = evaluate(args, policy, ref_policy, proxy_score, device)
        log({"stage": "eval", "beta": beta, **finals[beta]})
        if args.save_model:
            name = f"ppo_policy_beta{beta:g}.pt" if args.sweep else "ppo_policy.pt"
            save_checkpoint(os.path.join(run_dir, name), policy, critic=critic.state_dict())
    bon = best_of_n(args, sft, proxy_score, device)
    for row in bon:
        log(row)

    print(f"\n=== summary ({time.time() - start:.0f}s) ===\nreward model: held-out accuracy "
          f"{rm_info['rm/heldout_acc']:.3f} vs noisy labels (label-noise ceiling {rm_info['rm/label_ceiling']:.3f}), "
          f"{rm_info['rm/heldout_acc_gold']:.3f} vs the noise-free gold order")
    line = lambda name, e: (
        f"{name:<18} gold {e['gold/score']:+.3f} | proxy {e['proxy/score']:+.3f} | KL {e['objective/kl']:6.2f} | "
        f"grammar {e['gold/grammar_rate']:.2f} | eos {e['gold/eos_rate']:.2f} | repeats {e['gold/repeat_rate']:.2f} | "
        f"distinct {e['gold/distinct_frac']:.2f}\n    " + "\n    ".join(e["samples"][:2]))
    print(line("SFT", sft_eval))
    for beta, e in finals.items():
        match = min(bon, key=lambda r: abs(r["kl_bound"] - e["objective/kl"]))  # best-of-n at the closest KL bound
        print(line(f"PPO beta={beta:g}" + (" (adaptive)" if args.adaptive_kl else ""), e))
        print(f"  vs best-of-{match['n']} (KL <= {match['kl_bound']:.2f}"
              f"{', the largest n' if match is bon[-1] else ''}): "
              f"gold {match['gold/score']:+.3f} | proxy {match['proxy/score']:+.3f}")
    summary = {"stage": "summary", **rm_info, "sft": sft_eval, "ppo": {str(b): e for b, e in finals.items()},
               "bon": bon, "wall_s": time.time() - start}
    log(summary)
    if args.sweep:
        plot_path = args.sweep_plot or os.path.join(run_dir, "sweep.png")
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        plot_sweep(histories, bon, plot_path)
        for beta, h in histories.items():
            peak, e = max(range(len(h)), key=lambda i: h[i]["gold/score"]), finals[beta]
            print(f"sweep beta={beta:g}: best rollout-batch gold {h[peak]['gold/score']:+.3f} at KL "
                  f"{h[peak]['objective/kl']:.2f} (iteration {peak + 1}); final gold {e['gold/score']:+.3f}, "
                  f"proxy {e['proxy/score']:+.3f}, KL {e['objective/kl']:.2f}")
        print(f"plot: {plot_path}")
    log.close()
    return {**summary, "histories": histories}


if __name__ == "__main__":
    train(tyro.cli(Args))
