"""RLHF with PPO, end to end, on a toy language small enough to train in minutes on a CPU:
SFT a tiny transformer on a synthetic sentiment corpus, label pairs of its samples with a hidden
gold reward, fit a Bradley-Terry reward model, then PPO against it with a per-token KL leash to SFT
(or, --advantage grpo / rloo, its critic-free successors GRPO (2402.03300) and RLOO (2402.14740)).
Papers: InstructGPT (Ouyang et al. 2022, arXiv 2203.02155), Ziegler et al. 2019 (1909.08593),
Stiennon et al. 2020, Gao et al. 2022 (2210.10760). OAI = OpenAI's lm-human-preferences code;
N+ = Huang et al. 2024 (2403.17031). Run: `python ppo_rlhf_toy.py`; metrics: docs/rlhf.md.
Read top to bottom; the appendix below `train` is plumbing."""
import copy
import functools
import io
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Callable, Literal, Optional, Tuple

if __name__ == "__main__":  # Ctrl-C while the libraries below load (seconds): no traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the process just ends: nothing exists yet

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro

# Knobs that experiments here never needed to change: constants rather than flags, to keep --help short.
SFT_BATCH_SIZE = 128  # SFT sentences per step
RM_BATCH_SIZE = 64  # preference pairs per RM step
HELDOUT_FRAC = 0.1  # fraction of the preference pairs held out to measure RM accuracy
PTX_SENTENCES_PER_EPISODE = 8  # PPO-ptx: corpus sentences per episode in each minibatch (InstructGPT)
SAMPLE_EVERY = 25  # print (and log) sample texts every this many PPO iterations


@dataclass
class Args:
    # ---- the algorithm. The task: the toy language and the preference data
    corpus_size: int = 20000
    """sentences in the SFT corpus"""
    max_response_len: int = 12
    """response tokens sampled after the prompt (<bos> DET NOUN)"""
    num_pairs: int = 4000
    """preference pairs sampled from the SFT policy (those without EOS dropped; 10% held out)"""
    label_noise: float = 0.5
    """tau of the labeller p(a preferred) = sigmoid((r*(a) - r*(b)) / tau); small = near-certain"""
    # models, SFT, reward model
    d_model: int = 64
    """transformer width of policy, reference, RM and critic (with --load-sft, the saved model's)"""
    n_layers: int = 2
    """transformer blocks (with --load-sft, the saved model's)"""
    n_heads: int = 4
    """attention heads (with --load-sft, the saved model's)"""
    sft_steps: int = 600
    """SFT optimizer steps on the corpus"""
    sft_lr: float = 3e-3
    """SFT Adam learning rate, linearly decayed to 0"""
    rm_epochs: int = 4
    """passes over the training pairs (OAI/N+: 1 epoch of many more labels; our ~3k need more)"""
    rm_lr: float = 1e-3
    """RM Adam learning rate, linearly decayed to 0 (as OAI)"""
    # the RL stage: PPO, or a critic-free group baseline in the same loop
    advantage: Literal["gae", "grpo", "rloo"] = "gae"
    """the advantage estimator, all else the same. gae: PPO's critic (from the RM) and GAE; grpo:
    GRPO's group-normalised score; rloo: RLOO's leave-one-out baseline (docs/rlhf.md)"""
    group_size: int = 4
    """k: responses sampled per prompt for grpo and rloo, the batch still --rollout-batch-size"""
    kl_penalty: Optional[Literal["reward", "loss"]] = None
    """where the KL to pi_ref enters: reward: -beta * KL_t per token (InstructGPT Eq. 2); loss:
    + beta * k3 per token (GRPO eq. 3-4). Default: loss for grpo, reward otherwise, as the papers"""
    ppo_iterations: int = 100
    """RL iterations (rollout + update)"""
    rollout_batch_size: int = 128
    """sequences sampled per iteration"""
    num_minibatches: int = 4
    """minibatches per PPO epoch"""
    ppo_epochs: int = 4
    """passes over each rollout batch"""
    ppo_lr: float = 3e-4
    """Adam learning rate of policy and critic, linearly decayed to 0 (as OAI); Adam eps 1e-5"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip (inf: none)"""
    temperature: float = 0.7
    """sampling temperature (OAI/N+ value); rollout, reference and update all divide logits by it"""
    beta: float = 0.05
    """KL coefficient of InstructGPT Eq. 2, a leash to pi_ref (the SFT model) for the whole run (the
    initial value with --adaptive-kl)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL in the reward: k1 = log pi - log pi_ref; k3 = (r - 1) - log r, r = pi_ref / pi,
    whose gradient as a reward does not pull pi back to pi_ref (kl_estimate): offered to show that"""
    adaptive_kl: bool = False
    """adapt beta with Ziegler et al.'s proportional controller towards --kl-target"""
    kl_target: float = 6.0
    """adaptive controller: target KL in nats (Ziegler et al.)"""
    kl_horizon: int = 10000
    """adaptive controller: horizon in episodes (Ziegler et al.)"""
    clip_coef: float = 0.2
    """PPO ratio clip epsilon: a trust region around pi_old, the policy that sampled this batch"""
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
    """score given instead of the RM's to a response without EOS (the 'EOS trick' of OAI and N+)"""
    ptx_coef: float = 0.0
    """gamma of PPO-ptx (InstructGPT Eq. 2): weight of the SFT loss on corpus sentences in every
    minibatch loss; 0: plain PPO, InstructGPT's "PPO" models"""
    # ---- the run: seeding and device, evaluation, logging, checkpoints, speed
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of python, numpy and torch: the same seed gives the same run on CPU"""
    torch_deterministic: bool = True
    """make cuDNN pick deterministic algorithms"""
    cuda: bool = True
    """use the GPU when one is available"""
    eval_samples: int = 512
    """samples for the final evaluation of the SFT and PPO policies"""
    bon_pool: int = 256
    """best-of-n baseline: SFT samples per prompt (32 prompts); n = 1, 2, 4, ... up to this"""
    sweep: bool = False
    """run PPO once per --sweep-betas from the same SFT policy and RM (plot: benchmarks/rlhf_seeds.py)"""
    sweep_betas: Tuple[float, ...] = (0.0, 0.01, 0.05, 0.2)
    """KL coefficients of the sweep"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "rl-reference"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (user or team)"""
    wandb_mode: Literal["online", "offline"] = "online"
    """'offline' logs to ./wandb without an account; sync later with `wandb sync`"""
    save_model: bool = False
    """write runs/<run_name>/sft.pt and rm.pt as their stages end, and the PPO policy (also when
    interrupted)"""
    load_sft: Optional[str] = None
    """load the SFT policy from this checkpoint instead of training it"""
    load_rm: Optional[str] = None
    """load the reward model from this checkpoint (needs --load-sft, which its scale refers to)"""
    threads: int = 1
    """torch CPU threads; 1 is fastest for these tiny matrices (measured: docs/rlhf.md)"""


# ---------------------------------------------------------------- 1. the language and its hidden gold reward
DETS = ["the", "a"]
NOUNS = ["movie", "plot", "cast", "ending", "music"]
VERBS = ["was", "is", "felt"]
ADVS = ["very", "really", "quite"]
CONJS = ["and", "but"]
POSITIVE = ["great", "superb", "fun", "moving", "clever", "lovely"]
NEGATIVE = ["boring", "awful", "dull", "messy", "silly", "bland"]
VOCAB = ["<pad>", "<bos>"] + DETS + NOUNS + VERBS + ["not"] + ADVS + POSITIVE + NEGATIVE + CONJS + ["."]
TOKEN = {word: index for index, word in enumerate(VOCAB)}
PAD = TOKEN["<pad>"]  # PAD != EOS, else SFT never learns to stop (N+)
BOS = TOKEN["<bos>"]
EOS = TOKEN["."]
PROMPT_LEN = 3
CATEGORY = {word: category for words, category in [
    (DETS, "D"), (NOUNS, "N"), (VERBS, "V"), (["not"], "T"), (ADVS, "A"), (POSITIVE, "P"), (NEGATIVE, "M"),
    (CONJS, "C"), (["."], "E"), (["<pad>", "<bos>"], "_")] for word in words}
# a response: VERB [not] [ADV] ADJ (CONJ [not] [ADV] ADJ)* "."
GRAMMAR = re.compile(r"V(T?A?[PM])(CT?A?[PM])*E")


def make_sentence(rng, max_response_len):
    """A corpus sentence. Its adjectives are distinct, so the preference pairs (SFT samples) rarely
    show a repeated adjective and never an ungrammatical sentence: the RM cannot learn those parts
    of the gold reward."""
    while True:
        words = [rng.choice(DETS), rng.choice(NOUNS), rng.choice(VERBS)]
        for index, adjective in enumerate(rng.sample(POSITIVE + NEGATIVE, rng.choice([1, 1, 2, 2, 3]))):
            words += ([rng.choice(CONJS)] if index else []) + (["not"] if rng.random() < 0.15 else [])
            words += ([rng.choice(ADVS)] if rng.random() < 0.4 else []) + [adjective]
        if len(words) - 2 + 1 <= max_response_len:  # response = words after DET NOUN, plus "."
            return words + ["."]


def judge(response_words):
    """Hidden gold judgement of one response -> (r*, has EOS, grammatical, repeated adjectives). r* =
    negation-aware (#positive - #negative adjectives) clipped to [-2, 2], minus 0.5 per repeated
    adjective; r* = -1 when the response never ends (no EOS) and -2 when it is ungrammatical."""
    if "." not in response_words:
        return -1.0, False, False, 0
    words = response_words[: response_words.index(".") + 1]
    if not GRAMMAR.fullmatch("".join(CATEGORY[word] for word in words)):
        return -2.0, True, False, 0
    sentiment = 0
    negated = False
    seen = set()
    repeats = 0
    for word in words:
        negated = (negated or word == "not") and word not in CONJS  # "not" negates up to the next conjunction
        if CATEGORY[word] in "PM":
            sentiment += (1 if word in POSITIVE else -1) * (-1 if negated else 1)
            repeats += word in seen
            seen.add(word)
    return max(-2, min(2, sentiment)) - 0.5 * repeats, True, True, repeats


def decode(tokens):
    return [VOCAB[token] for token in tokens if token not in (PAD, BOS)]


def language_stats(responses):
    """Gold score and the gates it checks, over a batch of response token rows."""
    words = [decode(row) for row in responses.tolist()]
    gold, eos, grammatical, repeats = zip(*map(judge, words))
    return {"gold/score": float(np.mean(gold)), "gold/eos_rate": float(np.mean(eos)),
            "gold/grammar_rate": float(np.mean(grammatical)),
            "gold/repeat_rate": float(np.mean([count > 0 for count in repeats])),
            "gold/distinct_frac": len(set(map(tuple, words))) / len(words)}


def random_prompts(count, device):
    """Prompts are <bos> DET NOUN: fixed length, so queries never need (left) padding."""
    dets = torch.randint(0, len(DETS), (count,)) + TOKEN[DETS[0]]
    nouns = torch.randint(0, len(NOUNS), (count,)) + TOKEN[NOUNS[0]]
    return torch.stack([torch.full((count,), BOS), dets, nouns], 1).to(device)


def random_rows(tokens, count):
    """`count` rows of `tokens`, drawn uniformly with replacement: SFT's and PPO-ptx's batches."""
    return tokens[torch.randint(0, len(tokens), (count,), device=tokens.device)]


def encode_sentences(sentences, width, device):
    """<bos> + the sentence's tokens, right-padded with PAD to `width`."""
    rows = [[BOS] + [TOKEN[word] for word in sentence] + [PAD] * (width - 1 - len(sentence))
            for sentence in sentences]
    return torch.tensor(rows, device=device)


# ---------------------------------------------------------------- the model (stages 2, 4, 5) and sampling
class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, mask):
        batch, length, width = x.shape
        heads = self.qkv(self.ln1(x)).view(batch, length, 3, self.n_heads, width // self.n_heads)
        q, k, v = heads.permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


@dataclass
class ModelConfig:
    """A TinyTransformer's shape; a checkpoint stores it as a dict. out_dim = vocab size: a policy
    (logits); out_dim = 1: a scalar per position (reward model, critic)."""
    vocab_size: int
    out_dim: int
    d_model: int
    n_layers: int
    n_heads: int
    max_len: int
    banned_tokens: Tuple[int, ...] = ()  # logits never sampled (<pad>, <bos>)


class TinyTransformer(nn.Module):
    """Pre-LN causal transformer with no dropout anywhere: dropout would make the first PPO ratio !=
    1 (N+). PAD keys are masked and position ids skip PADs, so any padding gives the same outputs."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        d_model = config.d_model
        self.tok = nn.Embedding(config.vocab_size, d_model)
        self.pos = nn.Embedding(config.max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, config.n_heads) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, config.out_dim)
        if config.out_dim == 1:  # OAI's reward head init: N(0, 1/sqrt(d_model + 1)), bias 0
            nn.init.normal_(self.head.weight, std=1 / math.sqrt(d_model + 1))
            nn.init.zeros_(self.head.bias)
        banned = torch.tensor(config.banned_tokens, dtype=torch.long)
        self.register_buffer("banned", torch.isin(torch.arange(config.out_dim), banned))

    def forward(self, tokens):
        real = tokens != PAD
        length = tokens.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        itself = torch.eye(length, dtype=torch.bool, device=tokens.device)
        # a query attends to earlier real tokens; a PAD query sees itself only, so no row is all masked
        mask = (causal & (real[:, None, :] | itself))[:, None]
        x = self.tok(tokens) + self.pos((real.cumsum(1) - 1).clamp(min=0))
        for block in self.blocks:
            x = block(x, mask)
        out = self.head(self.ln_f(x))
        # <pad>/<bos> are never sampled; -1e9 rather than -inf keeps p * log p finite in entropies
        return out.squeeze(-1) if out.shape[-1] == 1 else out.masked_fill(self.banned, -1e9)


def make_model(args, out_dim):
    banned_tokens = (PAD, BOS) if out_dim > 1 else ()
    return TinyTransformer(ModelConfig(len(VOCAB), out_dim, args.d_model, args.n_layers, args.n_heads,
                                       PROMPT_LEN + args.max_response_len, banned_tokens))


@torch.no_grad()
def sample(policy, queries, max_new_tokens, temperature):
    """Pure ancestral sampling at `temperature` (no top-k / top-p). A row stops at its first EOS and
    is padded with PAD. Returns responses (B, max_new_tokens) and the log-probs of the sampled
    tokens."""
    tokens = queries
    done = torch.zeros(len(queries), dtype=torch.bool, device=queries.device)
    logprobs = []
    for _ in range(max_new_tokens):
        logp = F.log_softmax(policy(tokens)[:, -1] / temperature, -1)
        next_token = torch.multinomial(logp.exp(), 1).squeeze(1).masked_fill(done, PAD)
        logprobs.append(logp.gather(1, next_token[:, None]).squeeze(1).masked_fill(done, 0.0))
        tokens = torch.cat([tokens, next_token[:, None]], 1)
        done = done | (next_token == EOS)
        if done.all():
            break
    pad = max_new_tokens - len(logprobs)
    return F.pad(tokens[:, queries.shape[1]:], (0, pad), value=PAD), F.pad(torch.stack(logprobs, 1), (0, pad))


def response_logprobs(model, queries, responses, temperature):
    """log pi(y_t | x, y_<t) of each response token and the full log-softmax, with the logits
    divided by the sampling temperature. The logits at position t predict token t + 1, hence the
    shift."""
    logits = model(torch.cat([queries, responses], 1))[:, queries.shape[1] - 1: -1]
    all_logp = F.log_softmax(logits / temperature, -1)
    return all_logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1), all_logp


def response_mask(responses):
    """1.0 on response tokens up to and including the first EOS, 0.0 after it."""
    is_eos = (responses == EOS).int()
    return ((is_eos.cumsum(1) - is_eos) == 0).float()


# ---------------------------------------------------------------- 2. SFT
def lm_loss(model, tokens):
    """Next-token cross-entropy, the negative of log pi(x) per token: SFT's loss and PPO-ptx's
    pretraining term. PAD targets are ignored; the EOS target is kept, so the model learns to
    stop."""
    return F.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:], ignore_index=PAD)


def train_sft(run, corpus_tokens):
    """SFT on the corpus: the initial policy."""
    args = run.args
    model = make_model(args, len(VOCAB)).to(run.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.sft_lr)
    for step in range(args.sft_steps):
        stop_if_signalled("SFT", step)  # a safe point: no step half done
        optimizer.param_groups[0]["lr"] = args.sft_lr * (1 - step / args.sft_steps)
        loss = lm_loss(model, random_rows(corpus_tokens, SFT_BATCH_SIZE))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % max(1, args.sft_steps // 5) == 0:
            run.log({"stage": "sft", "step": step + 1, "sft/loss": loss.item()},
                    f"sft step {step + 1}/{args.sft_steps} | loss {loss.item():.3f}")
    return model


# ---------------------------------------------------------------- 3. preference pairs
@torch.no_grad()
def make_preference_pairs(args, sft, device):
    """Two SFT samples (temperature 1) per prompt, labelled "a over b" with p = sigmoid((r*(a) -
    r*(b)) / tau). Pairs with a sample lacking EOS are dropped: the RM score is defined at EOS
    (missing EOS -> fixed penalty)."""
    queries = random_prompts(args.num_pairs, device).repeat_interleave(2, 0)
    responses = sample(sft, queries, args.max_response_len, 1.0)[0]
    tokens = torch.cat([queries, responses], 1).view(args.num_pairs, 2, -1)
    gold = torch.tensor([judge(decode(row))[0] for row in responses.tolist()]).view(-1, 2)
    keep = (responses == EOS).any(1).view(-1, 2).all(1).cpu()
    tokens = tokens[keep.to(device)]
    gold = gold[keep]
    p_first = torch.sigmoid((gold[:, 0] - gold[:, 1]) / args.label_noise)
    first_wins = torch.rand(len(gold)) < p_first
    chosen = torch.where(first_wins.to(device)[:, None], tokens[:, 0], tokens[:, 1])
    rejected = torch.where(first_wins.to(device)[:, None], tokens[:, 1], tokens[:, 0])
    gold_margin = torch.where(first_wins, 1.0, -1.0) * (gold[:, 0] - gold[:, 1])  # > 0: gold agrees
    return chosen, rejected, gold_margin, torch.maximum(p_first, 1 - p_first)


def split_by_sentence(chosen, rejected, heldout_frac):
    """Held-out pairs: a random heldout_frac of all pairs, a fair sample of the pair distribution.
    Training pairs: the others, except those that share a sentence (prompt + response) with a
    held-out pair, so held-out accuracy is measured on sentences the RM never saw. Returns train,
    held-out and dropped indices."""
    order = torch.randperm(len(chosen), device=chosen.device)
    n_heldout = max(1, int(len(chosen) * heldout_frac))
    heldout = order[:n_heldout]
    heldout_sentences = set(map(tuple, torch.cat([chosen[heldout], rejected[heldout]]).tolist()))
    rest = order[n_heldout:]
    unseen = [tuple(chosen_row) not in heldout_sentences and tuple(rejected_row) not in heldout_sentences
              for chosen_row, rejected_row in zip(chosen[rest].tolist(), rejected[rest].tolist())]
    unseen = torch.tensor(unseen, dtype=torch.bool, device=chosen.device)
    return rest[unseen], heldout, rest[~unseen]


# ---------------------------------------------------------------- 4. the reward model
def score_at_eos(per_token_scores, tokens):
    """The RM score is the scalar at each row's first EOS token (as N+): not the last position (a
    PAD when right-padded), not one step after EOS. Rows without EOS read position 0; callers
    replace them (EOS trick)."""
    first_eos = (tokens == EOS).int().argmax(1, keepdim=True)  # argmax: the first maximum
    return per_token_scores.gather(1, first_eos).squeeze(1)


def bradley_terry_loss(r_chosen, r_rejected):
    """InstructGPT Eq. 1 with K = 2 responses per prompt: -log sigma(r(x, y_w) - r(x, y_l)), the
    negative log-likelihood of the labeller's choice under Bradley-Terry."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def train_reward_model(run, sft, pairs):
    """Bradley-Terry RM: the SFT transformer with a fresh scalar head, read at EOS. Logs the
    held-out loss and accuracy after every epoch. Returns the RM and its numbers."""
    args, device = run.args, run.device
    chosen, rejected, gold_margin, p_label = pairs
    train_idx, heldout_idx, dropped_idx = split_by_sentence(chosen, rejected, HELDOUT_FRAC)
    if len(train_idx) < 1:
        raise SystemExit(f"error: --num-pairs {args.num_pairs} left no training pair for the reward model "
                         f"(pairs with EOS: {len(chosen)}); use more pairs or more --sft-steps")
    config = replace(sft.config, out_dim=1, banned_tokens=())  # the SFT's architecture
    rm = TinyTransformer(config).to(device)
    body = {key: value for key, value in sft.state_dict().items()
            if not key.startswith("head") and key != "banned"}
    rm.load_state_dict(body, strict=False)
    optimizer = torch.optim.Adam(rm.parameters(), lr=args.rm_lr)

    def reward(tokens):
        return score_at_eos(rm(tokens), tokens)

    total_steps = args.rm_epochs * math.ceil(len(train_idx) / RM_BATCH_SIZE)
    step = 0
    for epoch in range(1, args.rm_epochs + 1):
        losses = []
        for batch_idx in train_idx[torch.randperm(len(train_idx), device=device)].split(RM_BATCH_SIZE):
            stop_if_signalled("the reward model", step)
            optimizer.param_groups[0]["lr"] = args.rm_lr * (1 - step / total_steps)
            loss = bradley_terry_loss(reward(chosen[batch_idx]), reward(rejected[batch_idx]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
        with torch.no_grad():
            r_chosen = reward(chosen[heldout_idx])
            r_rejected = reward(rejected[heldout_idx])
            right = (r_chosen > r_rejected).cpu()
            margin = gold_margin[heldout_idx.cpu()]
            informative = margin != 0  # a gold tie has no right order
            heldout = {"rm/loss": float(np.mean(losses)),
                       "rm/heldout_loss": bradley_terry_loss(r_chosen, r_rejected).item(),
                       "rm/heldout_acc": float(right.float().mean()),
                       "rm/heldout_acc_gold": float((right == (margin > 0))[informative].float().mean())}
        run.log({"stage": "rm", "epoch": epoch, **heldout},
                f"rm epoch {epoch}/{args.rm_epochs} | loss {heldout['rm/loss']:.3f} | held-out loss "
                f"{heldout['rm/heldout_loss']:.3f} | held-out accuracy {heldout['rm/heldout_acc']:.3f}")
    with torch.no_grad():
        # Normalise to mean 0 / std 1 on 512 samples of the PPO initial policy (OAI's gain and bias;
        # N+ uses the bias only): beta then means the same whatever scale this RM happened to learn.
        queries = random_prompts(512, device)
        responses = sample(sft, queries, args.max_response_len, args.temperature)[0]
        raw = reward(torch.cat([queries, responses], 1)[(responses == EOS).any(1)])
    info = {"rm/label_ceiling": float(p_label[heldout_idx.cpu()].mean()), "rm/train_pairs": len(train_idx),
            "rm/heldout_pairs": len(heldout_idx), "rm/dropped_pairs": len(dropped_idx),
            "rm/bias": float(raw.mean()), "rm/gain": float(raw.std()), "rm/epochs": args.rm_epochs}
    run.log({"stage": "rm", "epoch": args.rm_epochs, **info})
    return rm, {**heldout, **info}


@torch.no_grad()
def proxy_score(rm, rm_info, missing_eos_penalty, queries, responses):
    """The reward r_theta(x, y) of InstructGPT Eq. 2: the RM's score at EOS, normalised with rm/bias
    and rm/gain; a response without EOS gets the fixed missing_eos_penalty instead (the EOS trick of
    OAI and N+)."""
    tokens = torch.cat([queries, responses], 1)
    score = (score_at_eos(rm(tokens), tokens) - rm_info["rm/bias"]) / rm_info["rm/gain"]
    return torch.where((responses == EOS).any(1), score, torch.full_like(score, missing_eos_penalty))


def critic_from_reward_model(rm, rm_info):
    """The critic starts as the RM (Stiennon et al.; N+ detail 22) with the normalisation folded
    into its head, so its first values are on the reward's scale."""
    critic = copy.deepcopy(rm).requires_grad_(True)
    with torch.no_grad():
        critic.head.bias.sub_(rm_info["rm/bias"]).div_(rm_info["rm/gain"])
        critic.head.weight.div_(rm_info["rm/gain"])
    return critic


# ---------------------------------------------------------------- 5. PPO
def kl_estimate(logp, ref_logp, estimator="k1"):
    """Per-token KL(pi || pi_ref) estimates from tokens sampled from pi (Schulman, "Approximating
    KL"): k1 = log pi - log pi_ref, unbiased but negative for some tokens; k3 = (r - 1) - log r with
    r = pi_ref / pi, unbiased, never negative, lower variance. Unbiased VALUES; as a reward only k1
    also has the right policy GRADIENT: E_pi[k3 grad log pi] = grad KL(pi || pi_ref) - grad
    KL(pi_ref || pi) (see --kl-estimator)."""
    log_r = ref_logp - logp
    return -log_r if estimator == "k1" else log_r.exp() - 1 - log_r


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def masked_var(x, mask):
    """Population variance (as TF) over the unmasked entries."""
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask)


def explained_variance(values, returns, mask):
    """1 - Var[returns - V] / Var[returns] over the unmasked tokens: 1 = the critic predicts the
    returns, 0 = no better than their mean (TRL's val/var_explained, CleanRL's)."""
    returns_var = masked_var(returns, mask)
    return math.nan if returns_var == 0 else float(1 - masked_var(returns - values, mask) / returns_var)


def whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over unmasked entries with the population variance, as TF;
    shift_mean=False adds the mean back (OAI does that for rewards)."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


def per_token_rewards(kl, scores, mask, beta):
    """InstructGPT Eq. 2 (without ptx) spread over tokens, as Ziegler et al.: r_t = -beta * KL_t on
    every response token, plus the score r_theta(x, y) on the last one (the EOS token, or the final
    token when there is none). Summed over tokens: r_theta(x, y) - beta log(pi(y|x) / pi_ref(y|x))
    with k1. This penalty is the leash to pi_ref, the SFT model; PPO's clip (clipped_surrogate_loss)
    is a different leash, to pi_old."""
    rewards = -beta * kl * mask
    rewards[torch.arange(len(scores), device=scores.device), mask.sum(1).long() - 1] += scores
    return rewards


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16) over response tokens: delta_t
    = r_t + gamma V_{t+1} - V_t with V = 0 after the last token; A_t = delta_t + gamma lam A_{t+1};
    returns = A + V."""
    rewards = rewards * mask
    values = values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else 0.0
        running = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        advantages[:, t] = running
    return advantages * mask, (advantages + values) * mask


def group_relative_advantages(scores, group_size, eps=1e-4):
    """GRPO's advantage with outcome supervision (Shao et al. 2024, arXiv 2402.03300, Sec. 4.1.2, in
    its eq. 3): A_i = (r_i - mean(r)) / std(r) over the group of k = group_size responses to one
    prompt, the same for every token of response i. std: the sample std (ddof 1), plus eps = 1e-4,
    as TRL; a group of equal scores gets 0. `scores` (B,): groups are k consecutive rows."""
    groups = split_into_groups(scores, group_size)
    advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)
    return advantages.view(-1)


def leave_one_out_advantages(scores, group_size):
    """RLOO's advantage (Ahmadian et al. 2024, arXiv 2402.14740, after Kool et al. 2019): r_i minus
    the mean score of the OTHER k - 1 responses to the same prompt, b_i = (sum_j r_j - r_i) / (k -
    1). The baseline does not depend on response i, so the gradient estimate stays unbiased; it is
    not divided by any std. `scores` (B,): groups are k consecutive rows."""
    groups = split_into_groups(scores, group_size)
    baselines = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baselines).view(-1)


def split_into_groups(scores, group_size):
    """(B,) -> (B / k, k): row g holds the k responses to prompt g."""
    if group_size < 2 or len(scores) % group_size:
        raise ValueError(f"group_size {group_size}: a group baseline needs k >= 2 responses per prompt and "
                         f"{len(scores)} scores in whole groups of k")
    return scores.view(-1, group_size)


def clipped_surrogate_loss(logp, old_logp, advantages, mask, clip_coef):
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7; GRPO eq. 3 keeps it), negated, a masked
    mean over response tokens. The ratio is pi / pi_old, pi_old being the policy that sampled this
    batch: the clip is a trust region for one iteration, while the KL penalty (--beta) holds pi near
    pi_ref = the SFT model for the whole run. Returns (loss, diagnostics)."""
    log_ratio = (logp - old_logp) * mask
    ratio = log_ratio.exp()
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)
    stats = {"ratio": masked_mean(ratio, mask), "approxkl": 0.5 * masked_mean(log_ratio ** 2, mask),
             "clipfrac": masked_mean((pg_clipped > pg_unclipped).float(), mask)}
    return masked_mean(torch.max(pg_unclipped, pg_clipped), mask), stats


def clipped_value_loss(values, old_values, returns, mask, clip_coef_value):
    """The critic's clipped value loss of OAI / N+, a masked mean over response tokens (PPO only).
    Returns (loss, fraction of tokens where the clipped branch counts)."""
    values_clipped = old_values + (values - old_values).clamp(-clip_coef_value, clip_coef_value)
    vf_unclipped = (values - returns) ** 2
    vf_clipped = (values_clipped - returns) ** 2
    vf_clipfrac = masked_mean((vf_clipped > vf_unclipped).float(), mask)
    return 0.5 * masked_mean(torch.max(vf_unclipped, vf_clipped), mask), vf_clipfrac


def kl_in_loss(args):
    """True when the KL to pi_ref is a loss term (GRPO eq. 3), False when it is a reward penalty."""
    if args.kl_penalty is None:
        return args.advantage == "grpo"  # each estimator's paper
    return args.kl_penalty == "loss"


def responses_per_prompt(args):
    """k: GRPO and RLOO compare k responses to one prompt; PPO's critic needs no group."""
    return 1 if args.advantage == "gae" else args.group_size


def adaptive_kl_beta(beta, kl, target, n_steps, horizon):
    """Ziegler et al.: e = clip(KL/target - 1, -0.2, 0.2); beta *= 1 + e * n_steps / horizon."""
    return beta * (1 + float(np.clip(kl / target - 1, -0.2, 0.2)) * n_steps / horizon)


@dataclass
class RLSetup:
    """What the RL stage trains, and against what. Generic over the models (token ids -> logits or
    values) and the reward, so the tests run it on an enumerable task."""
    policy: nn.Module
    ref_policy: nn.Module  # pi_ref, frozen: the KL's other end
    critic: Optional[nn.Module]  # PPO's value network; None with --advantage grpo or rloo
    score_fn: Callable  # (queries, responses) -> r_theta(x, y)
    sample_prompts: Callable  # count -> prompts
    sample_corpus: Optional[Callable] = None  # count -> corpus rows, for PPO-ptx
    rollout_metrics: Optional[Callable] = None  # (batch, iteration) -> the task's own numbers


@torch.no_grad()
def collect_rollout(rl, queries, beta, args):
    """Sample responses, score them, and turn the scores into per-token rewards and advantages: by
    GAE with the critic (PPO), or by comparing each response with its group (GRPO, RLOO)."""
    responses = sample(rl.policy, queries, args.max_response_len, args.temperature)[0]
    mask = response_mask(responses)
    # log-probs recomputed by a plain forward (as OAI); a test checks they equal the sampling ones
    logp = response_logprobs(rl.policy, queries, responses, args.temperature)[0] * mask
    ref_logp = response_logprobs(rl.ref_policy, queries, responses, args.temperature)[0] * mask
    scores = rl.score_fn(queries, responses)
    kl = kl_estimate(logp, ref_logp, args.kl_estimator) * mask
    # With the KL in the loss (GRPO) the reward is the score alone
    rewards = per_token_rewards(kl, scores, mask, 0.0 if kl_in_loss(args) else beta)
    batch = dict(queries=queries, responses=responses, mask=mask, logp=logp, ref_logp=ref_logp,
                 scores=scores, kl=kl, rewards=rewards)
    if args.advantage == "gae":  # PPO: the critic's V(x, y_<t) and GAE over the per-token rewards
        values = rl.critic(torch.cat([queries, responses], 1))[:, queries.shape[1] - 1: -1] * mask
        if args.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False) * mask
        advantages, returns = gae(rewards, values, mask, args.gamma, args.lam)
        advantages = whiten(advantages, mask) * mask  # advantages are whitened with re-centring (OAI)
        batch.update(rewards=rewards, values=values, returns=returns)
    else:  # GRPO, RLOO: a response's return (gamma = 1), compared with the others to its prompt
        returns = rewards.sum(1)  # with the penalty in the reward: RLOO's R(x, y) = r - beta log(pi / pi_ref)
        if args.advantage == "grpo":
            advantages = group_relative_advantages(returns, args.group_size)
        else:
            advantages = leave_one_out_advantages(returns, args.group_size)
        advantages = advantages[:, None] * mask  # the same advantage for every token of a response
    return {**batch, "advantages": advantages}


def ppo_update(rl, optimizer, batch, args, beta):
    """args.ppo_epochs passes over the batch in args.num_minibatches minibatches; one diagnostics
    dict each. The loss: the clipped surrogate, plus vf_coef * the value loss when there is a critic
    (PPO), plus beta * k3 when the KL is in the loss (GRPO). With args.ptx_coef > 0 each minibatch
    loss adds gamma * lm_loss on rl.sample_corpus(count) corpus sentences: PPO-ptx, the last term
    of InstructGPT Eq. 2 (gamma E_pretrain[log pi(x)], maximised, so minus it as a loss)."""
    n_sequences = len(batch["queries"])
    stats = []
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for _ in range(args.ppo_epochs):
        order = torch.randperm(n_sequences, device=batch["queries"].device)
        for idx in order.split(n_sequences // args.num_minibatches):
            minibatch = {key: value[idx] for key, value in batch.items()}
            queries, responses, mask = minibatch["queries"], minibatch["responses"], minibatch["mask"]
            logp, all_logp = response_logprobs(rl.policy, queries, responses, args.temperature)
            logp = logp * mask
            pg_loss, minibatch_stats = clipped_surrogate_loss(
                logp, minibatch["logp"], minibatch["advantages"], mask, args.clip_coef)
            loss = pg_loss
            if rl.critic is not None:  # PPO's second network; GRPO and RLOO have none
                values = rl.critic(torch.cat([queries, responses], 1))[:, queries.shape[1] - 1: -1]
                vf_loss, vf_clipfrac = clipped_value_loss(values, minibatch["values"], minibatch["returns"],
                                                          mask, args.clip_coef_value)
                loss = loss + args.vf_coef * vf_loss
                minibatch_stats.update(vf_loss=vf_loss, vf_clipfrac=vf_clipfrac)
            if kl_in_loss(args):  # GRPO eq. 3: - beta D_KL(pi || pi_ref), with eq. 4's k3 per token
                kl_loss = masked_mean(kl_estimate(logp, minibatch["ref_logp"], "k3"), mask)
                loss = loss + beta * kl_loss
                minibatch_stats["kl_loss"] = kl_loss
            if args.ptx_coef > 0:
                ptx_loss = lm_loss(rl.policy, rl.sample_corpus(PTX_SENTENCES_PER_EPISODE * len(idx)))
                loss = loss + args.ptx_coef * ptx_loss
                minibatch_stats["ptx_loss"] = ptx_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            entropy = masked_mean(-(all_logp.exp() * all_logp).sum(-1), mask)
            minibatch_stats.update(pg_loss=pg_loss, entropy=entropy)
            stats.append({key: value.item() for key, value in minibatch_stats.items()})
    return stats


def run_ppo(args, rl, beta, log=None):
    """PPO (or GRPO / RLOO) against rl.score_fn with a KL leash to rl.ref_policy, from the prompts
    of rl.sample_prompts, starting at this beta. Returns one metrics dict per iteration (log(record,
    line) gets each); after a first Ctrl-C / SIGTERM, stops after the iteration at hand."""
    # Plain PyTorch Adam, eps 1e-5. TF's Adam (OAI) effectively uses eps / sqrt(1 - beta2^t), far
    # larger in the first steps, so PyTorch's early updates are bigger (~6x approxkl in N+).
    networks = [rl.policy] if rl.critic is None else [rl.policy, rl.critic]  # GRPO, RLOO: no critic
    optimizer = torch.optim.Adam([param for network in networks for param in network.parameters()],
                                 lr=args.ppo_lr, eps=1e-5)
    history = []
    start = time.time()
    kl_coef = beta  # the beta of this iteration: --adaptive-kl moves it
    group_size = responses_per_prompt(args)
    for iteration in range(1, args.ppo_iterations + 1):
        lr = args.ppo_lr * (1 - (iteration - 1) / args.ppo_iterations)  # linear decay to 0 (as OAI)
        optimizer.param_groups[0]["lr"] = lr
        # k responses to each prompt (GRPO, RLOO; k = 1 for PPO): the same --rollout-batch-size responses
        queries = rl.sample_prompts(args.rollout_batch_size // group_size).repeat_interleave(group_size, 0)
        batch = collect_rollout(rl, queries, kl_coef, args)
        stats = ppo_update(rl, optimizer, batch, args, kl_coef)
        episodes = iteration * args.rollout_batch_size
        record = {"stage": "ppo", "episode": episodes, "lr": lr, "eps": episodes / (time.time() - start),
                  **ppo_record(batch, stats, kl_coef)}
        if rl.rollout_metrics is not None:
            record.update(rl.rollout_metrics(batch, iteration))
        if args.adaptive_kl:  # the next iteration's beta, from this one's KL
            kl_coef = adaptive_kl_beta(kl_coef, record["objective/kl"], args.kl_target,
                                       args.rollout_batch_size, args.kl_horizon)
        history.append(record)
        if log is not None:
            log(record, ppo_log_line(record, iteration, args, start))
        stop_if_signalled(f"PPO (beta {beta:g}, iteration {iteration})", iteration)  # every iterate is usable
    return history


# ---------------------------------------------------------------- 6. evaluation
@torch.no_grad()
def evaluate(args, policy, ref_policy, score_fn, device):
    """Fresh samples at the training temperature: proxy and gold scores, gates, the summed k1 KL."""
    queries = random_prompts(args.eval_samples, device)
    responses = sample(policy, queries, args.max_response_len, args.temperature)[0]
    logp = response_logprobs(policy, queries, responses, args.temperature)[0]
    ref_logp = response_logprobs(ref_policy, queries, responses, args.temperature)[0]
    kl = float(((logp - ref_logp) * response_mask(responses)).sum(1).mean())
    samples = [" ".join(decode(row)) for row in torch.cat([queries, responses], 1)[:4].tolist()]
    return {"proxy/score": float(score_fn(queries, responses).mean()), "objective/kl": kl,
            **language_stats(responses), "samples": samples}


def best_of_n_kl_bound(n):
    """KL(best-of-n || base) <= log n - (n - 1)/n: Stiennon et al.'s formula (App. G.3), which
    Beirami et al. 2024 show is an upper bound."""
    return math.log(n) - (n - 1) / n


def best_of_n_weights(pool_size, n):
    """P(the i-th lowest-scored of pool_size samples is the best of a uniformly random n-subset) =
    C(i-1, n-1) / C(pool_size, n): weighting a sorted pool by these gives an unbiased best-of-n
    estimate using every sample."""
    return torch.tensor([math.comb(i - 1, n - 1) / math.comb(pool_size, n) for i in range(1, pool_size + 1)],
                        dtype=torch.float64)


@torch.no_grad()
def best_of_n(args, sft, score_fn, device):
    """Best-of-n from the SFT policy, n = 1, 2, 4, ... <= bon_pool, estimated from a pool of
    bon_pool samples for each of 32 prompts (best_of_n_weights). Its KL to the SFT policy is quoted
    by the upper bound log n - (n-1)/n."""
    pool_size = args.bon_pool
    queries = random_prompts(32, device).repeat_interleave(pool_size, 0)
    responses = sample(sft, queries, args.max_response_len, args.temperature)[0]
    proxy = score_fn(queries, responses).view(-1, pool_size).cpu().double()
    gold = torch.tensor([judge(decode(row))[0] for row in responses.tolist()], dtype=torch.float64)
    order = proxy.argsort(1)
    proxy = proxy.gather(1, order)
    gold = gold.view(-1, pool_size).gather(1, order)
    rows = []
    for n in (2 ** k for k in range(int(math.log2(pool_size)) + 1)):
        weight = best_of_n_weights(pool_size, n)
        rows.append({"stage": "bon", "n": n, "kl_bound": best_of_n_kl_bound(n),
                     "proxy/score": float((proxy @ weight).mean()),
                     "gold/score": float((gold @ weight).mean())})
    return rows


# ---------------------------------------------------------------- the story
def train(args: Args):
    """All stages in order. Returns the summary record plus "histories": each beta's PPO records."""
    run = start_run(args)  # flags checked, runs/{run_name} created, seeded, the log opened
    device = run.device
    # Ctrl-C / SIGTERM (also one since start_run): stop at the next safe point
    with StopOnSignal(args, run.dir, run.log, run.signal_handlers) as stop:
        # 1. The language: a corpus from its grammar (the hidden gold reward is judge()). PPO-ptx
        # samples it too. `random` is seeded.
        corpus = [make_sentence(random, args.max_response_len) for _ in range(args.corpus_size)]
        corpus_tokens = encode_sentences(corpus, PROMPT_LEN + args.max_response_len, device)

        # 2. SFT: the initial policy, which is also the frozen reference policy pi_ref.
        if args.load_sft:
            sft = load_checkpoint(args.load_sft, "--load-sft", device)[0]
        else:
            print("corpus:", *[" ".join(sentence) for sentence in corpus[:3]], sep="\n    ")
            sft = train_sft(run, corpus_tokens)
        stop.save("sft.pt", sft)
        ref_policy = copy.deepcopy(sft).requires_grad_(False)

        # 3. Preference pairs labelled through the hidden gold reward, and 4. the reward model.
        if args.load_rm:
            rm, checkpoint = load_checkpoint(args.load_rm, "--load-rm", device)
            rm_info = checkpoint["rm_info"]
            run.log({"stage": "rm", "epoch": rm_info.get("rm/epochs", 0), **rm_info})
        else:
            pairs = make_preference_pairs(args, sft, device)
            rm, rm_info = train_reward_model(run, sft, pairs)
        stop.save("rm.pt", rm, rm_info=rm_info)
        rm.requires_grad_(False)
        score_fn = functools.partial(proxy_score, rm, rm_info, args.missing_eos_penalty)

        # 5. RL: PPO with its critic and GAE, or GRPO / RLOO with a group baseline and no critic
        # (--advantage), once or once per beta of the sweep (the same SFT policy and RM), each
        # followed by 6. its evaluation on fresh samples, against the hidden gold reward.
        sft_eval = evaluate(args, sft, ref_policy, score_fn, device)
        histories = {}
        finals = {}
        for beta in args.sweep_betas if args.sweep else (args.beta,):
            torch.manual_seed(args.seed)  # each run of a sweep sees the same random stream: only beta differs
            critic = critic_from_reward_model(rm, rm_info) if args.advantage == "gae" else None
            rl = RLSetup(policy=copy.deepcopy(sft).requires_grad_(True), ref_policy=ref_policy, critic=critic,
                         score_fn=score_fn, sample_prompts=functools.partial(random_prompts, device=device),
                         sample_corpus=functools.partial(random_rows, corpus_tokens),
                         rollout_metrics=rollout_stats)
            beta_log = functools.partial(run.log, tensorboard_run=f"beta_{beta:g}" if args.sweep else "")
            name = f"ppo_policy_beta{beta:g}.pt" if args.sweep else "ppo_policy.pt"
            critic_state = None if critic is None else critic.state_dict()
            try:
                histories[beta] = run_ppo(args, rl, beta, beta_log)
            except Stopped as stopped:  # every PPO iterate is a usable policy: keep this one too
                stop.save(name, rl.policy, critic=critic_state, ppo_iterations_done=stopped.done)
                raise
            stop.save(name, rl.policy, critic=critic_state, ppo_iterations_done=len(histories[beta]))
            finals[beta] = evaluate(args, rl.policy, ref_policy, score_fn, device)
            episodes = len(histories[beta]) * args.rollout_batch_size
            beta_log({"stage": "eval", "beta": beta, "episode": episodes, **finals[beta]})
        # Best-of-n from the SFT policy: the baseline to compare PPO with at the same KL.
        bon = best_of_n(args, sft, score_fn, device)
        for row in bon:
            run.log(row)
        summary = log_summary(run, rm_info, sft_eval, finals, bon)
    return {**summary, "histories": histories}


# ---- Appendix: plumbing ----
# ---------------------------------------------------------------- set-up: one record of the run
@dataclass
class Run:
    """What the stages share of the run: its flags, device, directory, log and start time."""
    args: Args
    device: torch.device
    dir: str
    log: "Logger"
    start: float
    signal_handlers: dict  # SIGINT's and SIGTERM's before the run, which StopOnSignal gives back


def start_run(args):
    """Flags checked (before anything is allocated), runs/{run_name} created, random, numpy and
    torch seeded, the device chosen, the log opened."""
    validate_args(args)
    # A signal from here on is recorded as StopOnSignal records it: the run stops at its first safe
    # point, and one that kept nothing leaves no folder.
    handlers = {signum: signal.signal(signum, hold_signal) for signum in SIGNALS}
    try:
        name, run_dir = create_run_dir(args)
        log = Logger(args, run_dir, name)
    except BaseException:  # the handlers of before, and the error
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        raise
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    print(f"run {name} on {device}")
    return Run(args, device, run_dir, log, time.time(), handlers)


def create_run_dir(args):
    """runs/{run_name}, created exclusively: two runs started in the same second with the same name
    (a sweep) never share a directory; the later one takes the next free name, suffixed -2, -3, ...
    Returns (name, path)."""
    base_name = f"rlhf_sentiment__{args.exp_name}__{args.seed}__{int(time.time())}"
    os.makedirs("runs", exist_ok=True)
    for suffix in itertools.count(1):
        name = f"{base_name}-{suffix}" if suffix > 1 else base_name
        try:
            os.mkdir(os.path.join("runs", name))  # atomic: of two racing runs exactly one succeeds
            return name, os.path.join("runs", name)
        except FileExistsError:
            pass


# ---------------------------------------------------------------- signals and checkpoints of a run
SIGNALS = (signal.SIGINT, signal.SIGTERM)
SIGNALS_RECEIVED = []  # a run's first Ctrl-C / SIGTERM (StopOnSignal); read at the safe points


def hold_signal(signum, frame):
    """`start_run`'s handler until StopOnSignal takes over: the first signal is recorded."""
    if not SIGNALS_RECEIVED:
        SIGNALS_RECEIVED.append(signum)


@dataclass
class Stopped(Exception):
    """Raised at a safe point after a first signal: the stage (for the message), its steps done."""
    stage: str
    done: int


def stop_if_signalled(stage, done):
    """A safe point of a stage, where nothing is half updated: after a first signal, stop there."""
    if SIGNALS_RECEIVED:
        raise Stopped(stage, done)


class StopOnSignal:
    """A first Ctrl-C or SIGTERM is only recorded: the stage at hand raises Stopped at its next safe
    point, and leaving this block (also after the last stage) then ends the run with one line on
    what was kept and exit status 128 + the signal. A second signal stops at once, with one line.
    `save` writes the checkpoints (with --save-model) and lists them for that line."""

    def __init__(self, args, run_dir, log, previous_handlers=None):
        self.save_model = args.save_model
        self.run_dir = run_dir
        self.log = log
        self.saved = []
        self.previous_handlers = previous_handlers  # None: those in place now

    def handler(self, signum, frame):
        name = signal.Signals(signum).name
        if SIGNALS_RECEIVED:
            print(f"\n{name} again: stopped at once; {self.kept()}", flush=True)
            raise SystemExit(128 + signum)
        SIGNALS_RECEIVED.append(signum)
        print(f"\n{name}: stopping after the current step (again: stop now)", flush=True)

    def __enter__(self):
        in_place = {signum: signal.signal(signum, self.handler) for signum in SIGNALS}
        self.previous = self.previous_handlers or in_place
        return self

    def __exit__(self, exception_type, exception, traceback):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.log.close()
        received = SIGNALS_RECEIVED[:]  # the first signal only: the second one stops in the handler
        SIGNALS_RECEIVED.clear()
        if received and self.nothing_kept():  # stopped before its first record: only empty logs
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if received and exception_type in (None, Stopped):
            stage = exception.stage if exception else "the final evaluation"
            print(f"{signal.Signals(received[0]).name}: stopped during {stage}; {self.kept()}", flush=True)
            raise SystemExit(128 + received[0])

    def nothing_kept(self):
        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        return not self.saved and (not os.path.exists(metrics) or os.path.getsize(metrics) == 0)

    def kept(self):
        if self.nothing_kept():
            return f"nothing kept (no record yet), {self.run_dir} removed"
        checkpoints = ", ".join(self.saved) or "no checkpoints (--save-model keeps the finished stages)"
        return f"kept in {self.run_dir}: metrics.jsonl, TensorBoard events, {checkpoints}"

    def save(self, name, model, **extra):
        """With --save-model, runs/{run_name}/{name}."""
        if self.save_model:
            save_checkpoint(os.path.join(self.run_dir, name), model, **extra)
            self.saved.append(name)


def save_checkpoint(path, model, **extra):
    """The model's config and weights, plus `extra` (tensors, numbers, strings, lists, dicts only),
    so that load_checkpoint can read it with weights_only=True."""
    data = io.BytesIO()
    torch.save({"config": asdict(model.config), "state_dict": model.state_dict(), **extra}, data)
    write_atomically(path, data.getbuffer())


def write_atomically(path, data):
    """`path` holds all of `data` (bytes) or what it held before, whatever happens: the bytes go to
    `path`.tmp in the same folder, reach the disk (fsync) and are renamed over `path`."""
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


def load_checkpoint(path, flag, device):
    """A checkpoint written by save_checkpoint -> (model, checkpoint dict). weights_only=True refuses
    any pickled Python object other than tensors and plain values, without running it. A refused,
    damaged or foreign file stops the run with one line naming the flag, the file and the fault."""
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error below says it all
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines()
                 if "GLOBAL" in line or "Unsupported" in line]
        what = lines[0] if lines else "a Python object"
        raise SystemExit(f"error: {flag} {path}: refused, it holds more than tensors and plain values "
                         f"({what}); nothing in it was run")
    except Exception as error:  # torch raises RuntimeError, EOFError, KeyError... on damaged files
        raise SystemExit(f"error: {flag} {path}: cannot be read, damaged or not a torch checkpoint "
                         f"({first_line(error)})")
    if not (isinstance(checkpoint, dict) and isinstance(checkpoint.get("config"), dict)
            and isinstance(checkpoint.get("state_dict"), dict)):
        found = list(checkpoint)[:6] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise SystemExit(f"error: {flag} {path}: not a checkpoint of ppo_rlhf_toy.py (expected a dict with "
                         f"'config' and 'state_dict'; found {found})")
    try:
        model = TinyTransformer(ModelConfig(**checkpoint["config"])).to(device)
        model.load_state_dict(checkpoint["state_dict"])
    except (TypeError, RuntimeError, KeyError, ValueError) as error:
        raise SystemExit(f"error: {flag} {path}: its weights do not fit its config ({first_line(error)})")
    return model, checkpoint


def first_line(error):
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"


# ---------------------------------------------------------------- logging: the records and lines of a run
class Logger:
    """One record (a dict with a "stage") per call: a line of runs/{run_name}/metrics.jsonl; its
    numbers as TensorBoard scalars in the same directory, under the same keys except that eval, bon
    and summary records prefix theirs with the stage (eval/gold/score); an optional console line;
    wandb with --track. Steps: sft = step, rm = epoch, ppo and eval = episode, bon = n, else 0. A
    sweep's ppo and eval records go to the subdirectory beta_{beta}, a TensorBoard run of its own."""

    STEP_KEY = {"sft": "step", "rm": "epoch", "ppo": "episode", "eval": "episode", "bon": "n"}

    def __init__(self, args, run_dir, run_name):
        self.run_dir = run_dir
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.writers = {}
        self.wandb = None
        self.writer("").add_text("hyperparameters", "|flag|value|\n|-|-|\n" + "\n".join(
            f"|{key}|{value}|" for key, value in asdict(args).items()))  # as CleanRL
        if args.track:
            import wandb  # slow to import: only when asked
            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity,
                                    mode=args.wandb_mode, name=run_name, config=asdict(args), dir=run_dir)

    def writer(self, subdirectory):
        if subdirectory not in self.writers:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when a run starts
            self.writers[subdirectory] = SummaryWriter(os.path.join(self.run_dir, subdirectory))
        return self.writers[subdirectory]

    def __call__(self, record, line=None, tensorboard_run=""):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        stage = record["stage"]
        prefix = "" if stage in ("sft", "rm", "ppo") else stage + "/"
        step = record.get(self.STEP_KEY.get(stage), 0)
        writer = self.writer(tensorboard_run)
        numbers = {prefix + key: value for key, value in record.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        for tag, value in numbers.items():
            writer.add_scalar(tag, value, step)
        if "samples" in record:
            writer.add_text(prefix + "samples", "\n\n".join(record["samples"]), step)
        if self.wandb is not None:  # wandb's step counts these calls: monotonic across stages and a sweep
            self.wandb.log(numbers)
        if line is not None:
            print(line, flush=True)

    def close(self):
        self.file.close()
        for writer in self.writers.values():
            writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def per_sequence(per_token, mask):
    """Summed over each sequence's response tokens, then averaged over the sequences (as TRL)."""
    return float((per_token * mask).sum(1).mean())


def ppo_record(batch, stats, beta):
    """An RL iteration's metrics under TRL's names (docs/rlhf.md says what each means): the rollout's
    objective (KL, entropy, score, Eq. 2's reward), the update's means over minibatches, and the
    critic's fit (PPO only)."""
    mask = batch["mask"]
    mean = {key: float(np.mean([minibatch[key] for minibatch in stats])) for key in stats[0]}
    score = float(batch["scores"].mean())
    penalty_kl = per_sequence(batch["kl"], mask)  # the estimator of --kl-estimator, as in the rewards
    record = {
        "objective/kl": per_sequence(batch["logp"] - batch["ref_logp"], mask),
        "objective/kl_k3": per_sequence(kl_estimate(batch["logp"], batch["ref_logp"], "k3"), mask),
        "objective/entropy": per_sequence(-batch["logp"], mask), "objective/kl_coef": beta,
        "objective/scores": score, "objective/non_score_reward": -beta * penalty_kl,
        "objective/rlhf_reward": score - beta * penalty_kl, "policy/approxkl_avg": mean["approxkl"],
        "policy/clipfrac_avg": mean["clipfrac"], "policy/entropy_avg": mean["entropy"],
        "loss/policy_avg": mean["pg_loss"]}
    optional = (("vf_loss", "loss/value_avg"), ("kl_loss", "loss/kl_avg"), ("ptx_loss", "loss/ptx_avg"))
    for key, name in optional:
        if key in mean:  # the value loss: PPO only; the KL loss: with --kl-penalty loss; ptx: --ptx-coef
            record[name] = mean[key]
    record.update({"val/ratio": mean["ratio"], "val/ratio_var": float(np.var([m["ratio"] for m in stats])),
                   "val/num_eos_tokens": int((batch["responses"] == EOS).sum())})
    if "values" in batch:  # the critic's fit (PPO)
        record.update({
            "val/clipfrac_avg": mean["vf_clipfrac"],
            "val/var_explained": explained_variance(batch["values"], batch["returns"], mask),
            "ppo/returns/mean": float(masked_mean(batch["returns"], mask)),
            "ppo/returns/var": float(masked_var(batch["returns"], mask))})
    return record


def rollout_stats(batch, iteration):
    """The toy's own metrics of an RL iteration, on its rollout batch: proxy and gold scores, the
    gates, and every SAMPLE_EVERY iterations a few sample texts (printed too)."""
    stats = {"proxy/score": float(batch["scores"].mean()), **language_stats(batch["responses"])}
    if iteration % SAMPLE_EVERY == 0:
        texts = torch.cat([batch["queries"], batch["responses"]], 1)[:3].tolist()
        stats["samples"] = [" ".join(decode(row)) for row in texts]
        print("    " + "\n    ".join(stats["samples"]))
    return stats


RL_NAME = {"gae": "PPO", "grpo": "GRPO", "rloo": "RLOO"}  # the RL stage's name in lines, by --advantage


def ppo_log_line(record, iteration, args, start):
    """The console line of an RL iteration, with the time left at this iteration's pace."""
    eta = (time.time() - start) / iteration * (args.ppo_iterations - iteration)
    return (f"{RL_NAME[args.advantage].lower()} beta={record['objective/kl_coef']:.3g} it {iteration}/"
            f"{args.ppo_iterations} | {record['eps']:.0f} eps | ETA {eta:.0f}s | kl "
            f"{record['objective/kl']:.2f} | proxy {record['objective/scores']:+.2f} | gold "
            f"{record.get('gold/score', math.nan):+.2f} | ent {record['objective/entropy']:.2f} | clipfrac "
            f"{record['policy/clipfrac_avg']:.3f} | ratio {record['val/ratio']:.3f}")


def log_summary(run, rm_info, sft_eval, finals, bon):
    """Prints the final summary (the RM, SFT, each RL run beside the best-of-n of the closest KL
    bound) and logs it as the "summary" record, which it returns."""
    args = run.args
    print(f"\n=== summary ({time.time() - run.start:.0f}s) ===\nreward model: held-out accuracy "
          f"{rm_info['rm/heldout_acc']:.3f} vs noisy labels (label-noise ceiling "
          f"{rm_info['rm/label_ceiling']:.3f}), {rm_info['rm/heldout_acc_gold']:.3f} vs the noise-free gold "
          "order\n              "
          f"({rm_info['rm/heldout_pairs']} held-out pairs, {rm_info['rm/train_pairs']} training pairs)")
    print(summary_line("SFT", sft_eval))
    for beta, evaluation in finals.items():
        gaps = [abs(row["kl_bound"] - evaluation["objective/kl"]) for row in bon]
        match = bon[int(np.argmin(gaps))]  # the best-of-n whose KL bound is closest
        adaptive = " (adaptive)" if args.adaptive_kl else ""
        largest = ", the largest n" if match is bon[-1] else ""
        print(summary_line(f"{RL_NAME[args.advantage]} beta={beta:g}{adaptive}", evaluation))
        print(f"  vs best-of-{match['n']} (KL <= {match['kl_bound']:.2f}{largest}): "
              f"gold {match['gold/score']:+.3f} | proxy {match['proxy/score']:+.3f}")
    summary = {"stage": "summary", "advantage": args.advantage, "rm": rm_info, "sft": sft_eval,
               "ppo": {str(beta): evaluation for beta, evaluation in finals.items()}, "bon": bon,
               "wall_s": time.time() - run.start}
    run.log(summary)
    return summary


def summary_line(name, evaluation):
    """One line of the final summary, and two sample texts."""
    return (f"{name:<18} gold {evaluation['gold/score']:+.3f} | proxy {evaluation['proxy/score']:+.3f} | KL "
            f"{evaluation['objective/kl']:6.2f} | grammar {evaluation['gold/grammar_rate']:.2f} | eos "
            f"{evaluation['gold/eos_rate']:.2f} | repeats {evaluation['gold/repeat_rate']:.2f} | distinct "
            f"{evaluation['gold/distinct_frac']:.2f}\n    " + "\n    ".join(evaluation["samples"][:2]))


# ---------------------------------------------------------------- flag checks
# Each numeric flag's allowed values as (flags, test, what the error says); a test tries a bad value of each.
FLAG_RANGES = [
    (("corpus_size", "d_model", "n_layers", "n_heads", "sft_steps", "rm_epochs", "ppo_iterations",
      "rollout_batch_size", "num_minibatches", "ppo_epochs", "kl_horizon", "eval_samples", "threads"),
     lambda value: value > 0, "> 0"),
    (("label_noise", "temperature", "kl_target", "clip_coef", "clip_coef_value"),
     lambda value: math.isfinite(value) and value > 0, "finite and > 0"),
    (("sft_lr", "rm_lr", "ppo_lr", "beta", "vf_coef", "ptx_coef"),
     lambda value: math.isfinite(value) and value >= 0, "finite and >= 0"),
    (("gamma", "lam"), lambda value: 0 <= value <= 1, "in [0, 1]"),
    (("seed",), lambda value: 0 <= value < 2 ** 32, "in [0, 2**32) (numpy's seed range)"),
    (("max_response_len",), lambda value: value >= 6, ">= 6 (a corpus response needs up to 6 tokens)"),
    (("num_pairs",), lambda value: value >= 2, ">= 2 (some pairs are held out)"),
    (("max_grad_norm",), lambda value: value > 0, "> 0 (inf: no clipping)"),
    (("missing_eos_penalty",), math.isfinite, "finite"),
    (("bon_pool",), lambda value: value >= 2, ">= 2"),
    (("group_size",), lambda value: value >= 2, ">= 2 (k = 1 leaves a response no group to compare with)"),
    (("sweep_betas",), lambda betas: len(betas) > 0 and all(math.isfinite(b) and b >= 0 for b in betas),
     "one or more values, each finite and >= 0"),
]
# The flags of PPO's critic and GAE: refused with --advantage grpo or rloo unless left at their defaults.
GAE_ONLY_FLAGS = ("vf_coef", "clip_coef_value", "gamma", "lam", "whiten_rewards")


def validate_args(args):
    """One-line errors naming the flag, before anything is allocated: every numeric flag's range,
    the flags that constrain each other, and the checkpoints given to --load-sft / --load-rm."""
    for names, allowed, what in FLAG_RANGES:
        for name in names:
            if not allowed(getattr(args, name)):
                raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)} must be {what}")
    if args.rollout_batch_size % args.num_minibatches or args.rollout_batch_size // args.num_minibatches < 8:
        raise SystemExit(f"error: --num-minibatches {args.num_minibatches} must split --rollout-batch-size "
                         f"{args.rollout_batch_size} into equal minibatches of >= 8 sequences (whitening)")
    if args.rollout_batch_size % responses_per_prompt(args):
        raise SystemExit(f"error: --group-size {args.group_size} must divide --rollout-batch-size "
                         f"{args.rollout_batch_size} (whole groups of k responses per prompt)")
    for name in GAE_ONLY_FLAGS if args.advantage != "gae" else ("group_size",):
        if getattr(args, name) != getattr(Args, name):
            uses = "--advantage grpo and rloo"
            if name in GAE_ONLY_FLAGS:
                uses = "--advantage gae (PPO's critic and GAE)"
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)} applies to {uses} "
                             f"only, not to --advantage {args.advantage}")
    if kl_in_loss(args) and args.kl_estimator != "k1":
        raise SystemExit(f"error: --kl-estimator {args.kl_estimator} sets the KL penalty in the reward; with "
                         "the KL in the loss (--kl-penalty loss, GRPO's default) it is k3 (GRPO eq. 4)")
    if args.d_model % args.n_heads:
        raise SystemExit(f"error: --n-heads {args.n_heads} must divide --d-model {args.d_model}")
    if args.load_rm is not None and args.load_sft is None:
        raise SystemExit(f"error: --load-rm {args.load_rm} needs --load-sft: the RM's normalisation and the "
                         "critic refer to that SFT policy")
    # A loaded model keeps its own architecture (--d-model etc. do not apply), but it must know
    # every token and have a position embedding for every position the other flags will feed it.
    for flag, path, out_dim in (("--load-sft", args.load_sft, len(VOCAB)), ("--load-rm", args.load_rm, 1)):
        if path is None:
            continue
        if not os.path.isfile(path):
            raise SystemExit(f"error: {flag} {path}: no such file")
        checkpoint = load_checkpoint(path, flag, "cpu")[1]
        config = checkpoint["config"]
        if (config["vocab_size"], config["out_dim"]) != (len(VOCAB), out_dim):
            kind = "policy" if out_dim > 1 else "reward model"
            raise SystemExit(f"error: {flag} {path} is not a {kind} over the {len(VOCAB)} tokens of this "
                             f"language (vocabulary {config['vocab_size']}, output size {config['out_dim']})")
        if config["max_len"] < PROMPT_LEN + args.max_response_len:
            raise SystemExit(f"error: --max-response-len {args.max_response_len} is longer than {flag} "
                             f"{path} supports; use at most {config['max_len'] - PROMPT_LEN}")
        if out_dim == 1 and not {"rm/bias", "rm/gain"} <= set(checkpoint.get("rm_info", {})):
            raise SystemExit(f"error: {flag} {path} has no rm_info with rm/bias and rm/gain: not a reward "
                             "model saved by this script's --save-model")


if __name__ == "__main__":
    train(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
