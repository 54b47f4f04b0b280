"""Tests of ppo_rlhf_toy.py: golden values worked out by hand from the published formulas, checks against float64
naive computations, PPO against the exact KL-regularised optimum of an enumerable task, and small end-to-end runs.

Formulas: Bradley-Terry preference likelihood (Bradley & Terry 1952; the RM loss of Ziegler et al. 2019 and
Stiennon et al. 2020); GAE (Schulman et al. 2016, arXiv 1506.02438, eq. 16); the k1/k3 KL estimators (Schulman,
"Approximating KL divergence", 2020, joschu.net/blog/kl-approx.html); the adaptive KL controller (Ziegler et al.
2019, arXiv 1909.08593, eq. 2); the best-of-n KL bound log n - (n-1)/n (Stiennon et al. 2020, arXiv 2009.01325,
App. G.3); the reward-head init N(0, 1/sqrt(d+1)) of OpenAI's lm-human-preferences code; and the optimum of the
KL-regularised objective E[r] - beta KL(pi || pi_ref), pi* = pi_ref exp(r / beta) / Z with value beta log Z
(e.g. Rafailov et al. 2023, arXiv 2305.18290, eq. 4)."""
import copy
import dataclasses
import itertools
import json
import math
import os

import pytest
import torch
import torch.nn as nn

import ppo_rlhf_toy as M  # the repo root is on sys.path (conftest.py)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest. Restore the session's setting afterwards (train() sets it too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- golden values and hand computations
def test_gae_golden():
    mask = torch.ones(2, 3)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.0, 0.0, 0.0], [0.1, 0.2, 0.3]])
    advantages, returns = M.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.9025, 0.95, 1.0], [0.82675, 0.765, 0.7]]))
    torch.testing.assert_close(returns[1], torch.tensor([0.92675, 0.965, 1.0]))


def test_gae_stops_at_the_mask_and_matches_a_naive_double_sum():
    torch.manual_seed(0)
    rewards, values = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    lengths = [7, 1, 4, 3, 6]
    mask = torch.tensor([[float(t < n) for t in range(7)] for n in lengths], dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    advantages, returns = M.gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):  # A_t = sum_l (gamma lam)^l delta_{t+l}, with V = 0 after the last token
        v = lambda t: values[b, t].item() if t < n else 0.0
        for t in range(7):
            deltas = [rewards[b, l].item() + gamma * v(l + 1) - v(l) for l in range(t, n)]
            expected = sum((gamma * lam) ** i * delta for i, delta in enumerate(deltas))
            assert advantages[b, t].item() == pytest.approx(expected if t < n else 0.0, abs=1e-12)
            assert returns[b, t].item() == pytest.approx(expected + v(t) if t < n else 0.0, abs=1e-12)


def test_whitening_golden_and_masked():
    x, ones = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4)
    torch.testing.assert_close(M.whiten(x, ones), torch.tensor([-1.341641, -0.447214, 0.447214, 1.341641]))
    torch.testing.assert_close(M.whiten(x, ones, shift_mean=False),
                               torch.tensor([1.158359, 2.052786, 2.947214, 3.841641]))
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    w = M.whiten(torch.tensor([1.0, 5.0, 100.0, 3.0, -50.0]), mask)  # masked entries must not matter
    assert M.masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert M.masked_mean(w ** 2, mask).item() == pytest.approx(1.0, abs=1e-6)


def test_kl_estimators_golden_and_k3_nonnegative():
    for p, q, k1, k3 in [(0.5, 0.25, 0.693147, 0.193147), (0.25, 0.5, -0.693147, 0.306853)]:
        logp, ref_logp = torch.tensor([math.log(p)]), torch.tensor([math.log(q)])
        assert M.kl_estimate(logp, ref_logp, "k1").item() == pytest.approx(k1, abs=1e-6)
        assert M.kl_estimate(logp, ref_logp, "k3").item() == pytest.approx(k3, abs=1e-6)
    # k3 >= 0 on every token of real rollouts (while k1 is negative on some of them)
    torch.manual_seed(0)
    args = M.Args(d_model=16, n_heads=2, n_layers=1)
    policy, ref = M.make_model(args, len(M.VOCAB)), M.make_model(args, len(M.VOCAB))
    queries = M.random_prompts(256, "cpu")
    responses = M.sample(policy, queries, args.max_response_len, args.temperature)[0]
    mask = M.response_mask(responses)
    logp, ref_logp = (M.response_logprobs(m, queries, responses, args.temperature)[0] for m in (policy, ref))
    assert (M.kl_estimate(logp, ref_logp, "k3")[mask.bool()] >= 0).all()
    assert (M.kl_estimate(logp, ref_logp, "k1")[mask.bool()] < 0).any()


def test_adaptive_kl_golden():
    assert M.adaptive_kl_beta(0.15, 9.0, 6.0, 512, 10000) == pytest.approx(0.151536, abs=1e-6)
    assert M.adaptive_kl_beta(0.15, 3.0, 6.0, 512, 10000) == pytest.approx(0.148464, abs=1e-6)


def test_best_of_n_kl_bound_golden():
    for n, kl in zip([2, 4, 16, 64, 256], [0.193147, 0.636294, 1.835089, 3.174508, 4.549084]):
        assert M.best_of_n_kl_bound(n) == pytest.approx(kl, abs=1e-6)


def test_best_of_n_weights_match_brute_force_over_all_subsets():
    torch.manual_seed(0)
    pool = torch.randn(7, dtype=torch.float64)
    gold = torch.randn(7, dtype=torch.float64)  # a second score, read at the proxy's argmax, as in best_of_n
    order = pool.argsort()
    for n in range(1, 8):
        subsets = list(itertools.combinations(range(7), n))
        best = [max(c, key=lambda i: pool[i].item()) for c in subsets]
        w = M.best_of_n_weights(7, n)
        assert w.sum().item() == pytest.approx(1.0, abs=1e-12)
        assert (pool[order] @ w).item() == pytest.approx(sum(pool[b].item() for b in best) / len(subsets), abs=1e-12)
        assert (gold[order] @ w).item() == pytest.approx(sum(gold[b].item() for b in best) / len(subsets), abs=1e-12)


def test_reward_head_init_std():
    torch.manual_seed(0)
    for d, std in [(48, 0.142857), (64, 0.124035), (768, 0.036061)]:
        head = M.TinyTransformer(10, 1, d, 1, 4, 8).head
        assert head.weight.std().item() == pytest.approx(std, rel=0.3 if d < 100 else 0.08)
        assert head.bias.abs().max().item() == 0.0


def test_bradley_terry_loss_matches_hand_computation():
    r_chosen, r_rejected = torch.tensor([1.0, 0.0, -0.5]), torch.tensor([0.0, 2.0, -0.5])
    # -log sigma(d) = log(1 + e^-d) for d = 1, -2, 0
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2)) + math.log(2)) / 3
    assert M.bradley_terry_loss(r_chosen, r_rejected).item() == pytest.approx(expected, abs=1e-6)


def test_closed_form_optimum_golden():
    rewards = torch.tensor([0.0, 1.0], dtype=torch.float64)
    pi_star, log_z, kl = closed_form_optimum(torch.tensor([0.5, 0.5], dtype=torch.float64), rewards, 0.5)
    torch.testing.assert_close(pi_star, torch.tensor([0.119203, 0.880797], dtype=torch.float64), atol=1e-6, rtol=0)
    assert log_z == pytest.approx(1.433781, abs=1e-6) and kl == pytest.approx(0.327813, abs=1e-6)
    assert (pi_star * rewards).sum().item() - 0.5 * kl == pytest.approx(0.5 * log_z, abs=1e-9)


def test_gold_reward_rules():
    judge = lambda s: M.judge(s.split())[0]
    assert judge("was great .") == 1.0 and judge("was not great .") == -1.0
    assert judge("was great and superb but fun .") == 2.0  # clipped at 2
    assert judge("was not great but awful .") == -2.0  # negation ends at the conjunction
    assert judge("was great and great .") == 1.5  # -0.5 per repeated adjective
    assert judge("was great superb .") == -2.0  # ungrammatical
    assert judge("was great and superb") == -1.0  # no EOS


# ---------------------------------------------------------------- masks, EOS and the reward-model readout
def test_response_mask_and_per_token_rewards_put_the_score_on_eos():
    E, P = M.EOS, M.PAD
    responses = torch.tensor([[5, E, P, P], [5, 6, 7, 8], [E, P, P, P]])
    mask = M.response_mask(responses)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    kl = torch.full((3, 4), 0.5)
    rewards = M.per_token_rewards(kl, torch.tensor([10.0, 20.0, 30.0]), mask, beta=0.1)
    expected = torch.tensor([[-0.05, 9.95, 0, 0], [-0.05, -0.05, -0.05, 19.95], [29.95, 0, 0, 0]])
    torch.testing.assert_close(rewards, expected)


def test_rm_score_is_read_at_eos_whatever_the_padding():
    torch.manual_seed(0)
    args = M.Args(d_model=32, n_heads=4)
    rm = M.make_model(args, 1)
    words = [["the", "movie", "was", "great", "."], ["a", "cast", "felt", "not", "very", "dull", "and", "fun", "."],
             ["the", "plot", "is", "bland", "."]]
    rows = [[M.BOS] + [M.TOKEN[w] for w in s] for s in words]
    alone = [M.score_at_eos(rm(torch.tensor([r])), torch.tensor([r])).item() for r in rows]
    for left, right in [(0, 0), (0, 3), (2, 1), (5, 0)]:  # right padding, left padding and both, in one batch
        width = max(map(len, rows)) + left + right
        batch = torch.tensor([[M.PAD] * left + r + [M.PAD] * (width - left - len(r)) for r in rows])
        per_token = rm(batch)
        scores = M.score_at_eos(per_token, batch)
        torch.testing.assert_close(scores, torch.tensor(alone), atol=1e-5, rtol=0)
        eos_position = [left + len(r) - 1 for r in rows]
        torch.testing.assert_close(scores, per_token[torch.arange(3), eos_position])
        assert not torch.allclose(scores, per_token[:, -1])  # the last position would be wrong here


# ---------------------------------------------------------------- PPO invariants on the toy transformer
def small_setup(seed=0, **overrides):
    torch.manual_seed(seed)
    args = M.Args(d_model=32, n_heads=4, rollout_batch_size=64, num_minibatches=4, **overrides)
    policy = M.make_model(args, len(M.VOCAB))
    ref, critic, rm = copy.deepcopy(policy).requires_grad_(False), M.make_model(args, 1), M.make_model(args, 1)
    score_fn = lambda q, r: M.score_at_eos(rm(torch.cat([q, r], 1)), torch.cat([q, r], 1)).detach()
    return args, policy, ref, critic, score_fn


def test_rollout_logprobs_equal_recomputed_and_first_minibatch_ratio_is_one():
    args, policy, ref, critic, score_fn = small_setup()
    queries = M.random_prompts(64, "cpu")
    responses, sampled_logp = M.sample(policy, queries, args.max_response_len, args.temperature)
    mask = M.response_mask(responses)
    recomputed = M.response_logprobs(policy, queries, responses, args.temperature)[0] * mask
    assert (sampled_logp * mask - recomputed).abs().max().item() < 1e-5
    assert (sampled_logp[mask == 0] == 0).all()
    optimizer = torch.optim.Adam([*policy.parameters(), *critic.parameters()], lr=1e-3, eps=1e-5)
    for update in range(3):  # the first minibatch of EVERY update starts from the rollout policy
        batch = M.collect_rollout(policy, ref, critic, M.random_prompts(64, "cpu"), score_fn, args.beta, args)
        stats = M.ppo_update(policy, critic, optimizer, batch, args)
        # exactly 1.0 and 0.0 on our CPU; the tolerance only guards against BLAS kernels that depend on the batch shape
        assert stats[0]["ratio"] == pytest.approx(1.0, abs=1e-6) and stats[0]["approxkl"] < 1e-12
        assert stats[0]["clipfrac"] == 0.0 and stats[0]["vf_clipfrac"] == 0.0
        assert max(s["approxkl"] for s in stats) > 1e-8  # ...and the later ones have moved
    assert M.response_logprobs(policy, queries, responses, args.temperature)[0].sub(recomputed).abs().max() > 1e-4


def test_temperature_is_applied_in_every_pass():
    """Logits are divided by the temperature in every pass; if rollout and update disagreed, the first ratio would
    not be 1 (Huang et al. 2024, the N+ implementation details of RLHF with PPO)."""
    args, policy, ref, critic, score_fn = small_setup(temperature=0.5)
    batch = M.collect_rollout(policy, ref, critic, M.random_prompts(64, "cpu"), score_fn, args.beta, args)
    wrong = M.response_logprobs(policy, batch["queries"], batch["responses"], 1.0)[0] * batch["mask"]
    assert (wrong - batch["logp"]).abs().max() > 1e-2
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    assert M.ppo_update(policy, critic, optimizer, batch, args)[0]["approxkl"] < 1e-12


# ---------------------------------------------------------------- an enumerable task: exact optimum
A_TOKENS, ENUM_EOS, ENUM_LEN, N_CODES = [2, 3, 4], 5, 3, 7 ** 4  # vocab: 0 pad, 1 bos, 2-4 words, 5 eos


class TablePolicy(nn.Module):
    """A tabular model: one logit vector (or value) per prefix, so PPO is tested apart from function approximation."""

    def __init__(self, out_dim, init_std):
        super().__init__()
        self.table = nn.Parameter(torch.randn(N_CODES, out_dim) * init_std)

    def forward(self, tokens):  # prefix code: base-7 digits (token + 1), cumulative over positions
        codes = ((tokens + 1) * 7 ** torch.arange(tokens.shape[1])).cumsum(1)
        out = self.table[codes]
        return out.squeeze(-1) if out.shape[-1] == 1 else out.masked_fill(torch.arange(6) < 2, -1e9)  # never pad / bos


def all_responses():
    seqs = set()
    for toks in itertools.product(A_TOKENS + [ENUM_EOS], repeat=ENUM_LEN):
        toks = list(toks)
        if ENUM_EOS in toks:
            toks = toks[: toks.index(ENUM_EOS) + 1]
        seqs.add(tuple(toks + [M.PAD] * (ENUM_LEN - len(toks))))
    return torch.tensor(sorted(seqs))


def response_code(responses):
    return (responses * 6 ** torch.arange(ENUM_LEN)).sum(1)


def exact_distribution(policy, responses, temperature):
    queries = torch.full((len(responses), 1), M.BOS)
    logp = M.response_logprobs(policy, queries, responses, temperature)[0].double()
    return (logp * M.response_mask(responses, ENUM_EOS)).sum(1).exp()


def closed_form_optimum(ref_probs, rewards, beta):
    """pi* = pi_ref exp(r / beta) / Z in float64; returns pi*, log Z, KL(pi* || pi_ref)."""
    logits = ref_probs.log() + rewards / beta
    log_z = torch.logsumexp(logits, 0)
    pi_star = (logits - log_z).exp()
    return pi_star, log_z.item(), (pi_star * (pi_star / ref_probs).log()).sum().item()


def kl(p, q):
    return (p * (p / q).log()).sum().item()


def enumerable_task(seed=0):
    torch.manual_seed(seed)
    responses = all_responses()
    assert len(responses) == 1 + 3 + 9 + 27
    rewards = torch.rand(len(responses), dtype=torch.float64) * 2  # random gold table in [0, 2)
    reward_by_code = torch.zeros(6 ** ENUM_LEN, dtype=torch.float64)
    reward_by_code[response_code(responses)] = rewards
    score_fn = lambda queries, r: reward_by_code[response_code(r)].float()
    ref = TablePolicy(6, 1.0).requires_grad_(False)
    return responses, rewards, score_fn, ref


def run_enumerable_ppo(beta, iterations, lr, seed=0):
    responses, rewards, score_fn, ref = enumerable_task(seed)
    args = M.Args(max_response_len=ENUM_LEN, temperature=0.7, beta=beta, ppo_iterations=iterations,
                  rollout_batch_size=256, num_minibatches=4, ppo_lr=lr)
    policy, critic = copy.deepcopy(ref).requires_grad_(True), TablePolicy(1, 0.0)
    prompt_fn = lambda n: torch.full((n, 1), M.BOS)
    M.run_ppo(args, beta, policy, ref, critic, score_fn, prompt_fn, eos_id=ENUM_EOS)
    pi, pi_ref = (exact_distribution(m, responses, args.temperature) for m in (policy, ref))
    return pi, pi_ref, rewards, critic(torch.full((1, 1), M.BOS))[0, 0].item()


def test_enumeration_is_a_distribution():
    responses, _, _, ref = enumerable_task()
    assert exact_distribution(ref, responses, 0.7).sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("beta", [0.25, 1.0])
def test_ppo_reaches_the_kl_regularised_optimum(beta):
    pi, pi_ref, rewards, root_value = run_enumerable_ppo(beta, iterations=120, lr=0.05)
    pi_star, log_z, kl_star = closed_form_optimum(pi_ref, rewards, beta)
    assert kl(pi_star, pi_ref) == pytest.approx(kl_star, abs=1e-9)
    start, end = kl(pi_ref, pi_star), kl(pi, pi_star)
    print(f"KL(ref || opt) {start:.4f} -> KL(learned || opt) {end:.4f}")
    assert start > 0.05 and end < 0.01 and end < start / 20
    objective = (pi * rewards).sum().item() - beta * kl(pi, pi_ref)  # E[r] - beta KL, at most beta log Z
    assert objective == pytest.approx(beta * log_z, abs=0.02) and objective <= beta * log_z + 1e-9
    assert root_value == pytest.approx(objective, abs=0.1)  # the critic learned V(prompt) = E[sum of rewards]


def test_ppo_losses_match_a_naive_per_token_computation():
    torch.manual_seed(0)
    shape = (4, 5)
    logp, old_logp = torch.randn(shape, dtype=torch.float64) * 0.3, torch.randn(shape, dtype=torch.float64) * 0.3
    advantages, returns = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    values, old_values = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    mask = (torch.rand(shape) < 0.7).double()
    pg, vf, stats = M.ppo_losses(logp, old_logp, advantages, values, old_values, returns, mask, 0.2, 0.3)
    pg_terms, vf_terms, clipped = [], [], []
    for i, j in itertools.product(range(4), range(5)):
        if mask[i, j]:
            ratio, a = math.exp(logp[i, j] - old_logp[i, j]), advantages[i, j].item()
            pg_terms.append(max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)))
            clipped.append(-a * min(max(ratio, 0.8), 1.2) > -a * ratio)
            v_clip = old_values[i, j] + min(max(values[i, j] - old_values[i, j], -0.3), 0.3)
            vf_terms.append(0.5 * max((values[i, j] - returns[i, j]) ** 2, (v_clip - returns[i, j]) ** 2).item())
    assert pg.item() == pytest.approx(sum(pg_terms) / len(pg_terms), abs=1e-12)
    assert vf.item() == pytest.approx(sum(vf_terms) / len(vf_terms), abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped), abs=1e-12)
    assert 0 < stats["clipfrac"] < 1


def test_huge_beta_keeps_the_policy_at_the_reference():
    pi, pi_ref, _, _ = run_enumerable_ppo(1e4, iterations=30, lr=0.05)
    pi_free, _, _, _ = run_enumerable_ppo(0.0, iterations=30, lr=0.05)
    print(f"KL to reference: beta=1e4 {kl(pi, pi_ref):.5f}, beta=0 {kl(pi_free, pi_ref):.3f}")
    assert kl(pi, pi_ref) < 5e-3 and kl(pi_free, pi_ref) > 0.5
    pi_frozen, pi_ref, _, _ = run_enumerable_ppo(0.0, iterations=3, lr=0.0)  # lr = 0: nothing moves
    assert kl(pi_frozen, pi_ref) == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------- end to end
TINY = dict(corpus_size=3000, sft_steps=250, num_pairs=3000, rm_epochs=3, rm_lr=3e-3, ppo_iterations=25,
            rollout_batch_size=64, eval_samples=256, bon_pool=16)


def test_end_to_end_small(in_tmp):
    tmp_path = in_tmp
    summary = M.train(M.Args(**TINY, save_model=True))
    print(json.dumps({k: v for k, v in summary.items() if k.startswith("rm/")}),
          summary["sft"]["gold/score"], summary["ppo"]["0.05"]["gold/score"])
    assert summary["rm/heldout_acc"] > 0.6 and summary["rm/heldout_acc_gold"] > 0.65
    sft, ppo = summary["sft"], summary["ppo"]["0.05"]
    assert ppo["gold/score"] > sft["gold/score"] + 0.5 and ppo["proxy/score"] > sft["proxy/score"] + 0.5
    (run_dir,) = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ppo_records = [r for r in records if r["stage"] == "ppo"]
    assert len(ppo_records) == TINY["ppo_iterations"]
    for key in ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/scores",
                "objective/rlhf_reward", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
                "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var",
                "val/num_eos_tokens", "lr", "episode", "eps", "gold/score", "proxy/score", "gold/grammar_rate",
                "gold/eos_rate"]:
        assert key in ppo_records[0], key
    assert any("rm/heldout_acc" in r for r in records)
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", "ppo_policy.pt", "rm.pt", "sft.pt"]  # no .tmp left behind
    # stages re-run separately: load both checkpoints, run PPO only
    sft_path, rm_path = str(run_dir / "sft.pt"), str(run_dir / "rm.pt")
    again = M.train(M.Args(**{**TINY, "ppo_iterations": 2}, load_sft=sft_path, load_rm=rm_path))
    assert again["rm/heldout_acc"] == summary["rm/heldout_acc"] and again["rm/bias"] == summary["rm/bias"]
    assert again["sft"]["gold/grammar_rate"] > 0.9  # the loaded SFT policy is the trained one, not a fresh model
    # same model, new samples
    assert again["sft"]["gold/score"] == pytest.approx(summary["sft"]["gold/score"], abs=0.35)
    # --load-sft alone, with architecture flags that differ from the checkpoint's and a shorter response length:
    # the RM is built from the loaded SFT model's own config, so this trains an RM instead of failing
    quick = dict(TINY, num_pairs=200, rm_epochs=1, ppo_iterations=1, eval_samples=64, bon_pool=4)
    third = M.train(M.Args(**quick, d_model=32, n_layers=1, n_heads=2, max_response_len=10, load_sft=sft_path))
    assert third["sft"]["gold/grammar_rate"] > 0.9 and third["rm/train_pairs"] > 100


def test_a_checkpoint_that_cannot_serve_the_flags_fails_at_once_with_one_line(in_tmp):
    policy = lambda vocab, max_len: M.TinyTransformer(vocab, vocab, 16, 1, 2, max_len, banned_tokens=(M.PAD, M.BOS))
    M.save_checkpoint("short.pt", policy(len(M.VOCAB), M.PROMPT_LEN + 8))  # room for 8 response tokens
    M.save_checkpoint("other_vocab.pt", policy(20, 16))
    M.save_checkpoint("reward_model.pt", M.TinyTransformer(len(M.VOCAB), 1, 16, 1, 2, 16))
    for overrides, flag in [(dict(load_sft="short.pt"), "--max-response-len"),  # 12 > 8
                            (dict(load_sft="other_vocab.pt"), "--load-sft"),
                            (dict(load_sft="reward_model.pt"), "--load-sft"),  # not a policy
                            (dict(load_sft="short.pt", load_rm="short.pt", max_response_len=8), "--load-rm")]:
        with pytest.raises(SystemExit) as error:
            M.train(M.Args(**overrides))
        message = str(error.value)
        assert message.startswith("error: ") and flag in message and "\n" not in message, message
    assert not os.path.exists("runs")  # it failed before the run created anything
    M.validate_args(M.Args(load_sft="short.pt", max_response_len=8))  # what the checkpoint supports is fine


def test_same_seed_same_run(in_tmp):
    tiny = dict(corpus_size=500, sft_steps=20, num_pairs=200, rm_epochs=1, ppo_iterations=3, rollout_batch_size=32,
                eval_samples=64, bon_pool=4)

    def run(**overrides):  # everything the run reports except the timings
        summary = M.train(M.Args(**tiny, **overrides))
        summary["histories"] = {b: [{k: v for k, v in h.items() if k != "eps"} for h in hs]
                                for b, hs in summary["histories"].items()}
        return json.dumps({k: v for k, v in summary.items() if k != "wall_s"}, sort_keys=True)

    first = run()
    assert run() == first
    assert run(seed=2) != first


@pytest.mark.parametrize("overrides, flag", [
    (dict(num_minibatches=3), "--num-minibatches"), (dict(temperature=0.0), "--temperature"),
    (dict(load_rm="x.pt", load_sft=None), "--load-rm"), (dict(sweep_betas=(0.1, -1.0)), "--sweep-betas"),
    (dict(n_heads=5), "--n-heads")])
def test_bad_arguments_fail_fast_with_one_line(overrides, flag):
    with pytest.raises(SystemExit) as error:
        M.validate_args(dataclasses.replace(M.Args(), **overrides))
    message = str(error.value)
    assert message.startswith("error: ") and flag in message and "\n" not in message
