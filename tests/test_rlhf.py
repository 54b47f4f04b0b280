"""Tests of ppo_rlhf_toy.py: golden values worked out by hand from the published formulas, checks against float64
naive computations, PPO against the exact KL-regularised optimum of an enumerable task, and small end-to-end runs.

Formulas: Bradley-Terry preference likelihood (Bradley & Terry 1952; the RM loss of Ziegler et al. 2019 and
Stiennon et al. 2020, InstructGPT Eq. 1); GAE (Schulman et al. 2016, arXiv 1506.02438, eq. 16); the k1/k3 KL
estimators (Schulman, "Approximating KL divergence", 2020, joschu.net/blog/kl-approx.html); the adaptive KL
controller (Ziegler et al. 2019, arXiv 1909.08593, eq. 2); the best-of-n KL bound log n - (n-1)/n (Stiennon et al.
2020, arXiv 2009.01325, App. G.3); the reward-head init N(0, 1/sqrt(d+1)) of OpenAI's lm-human-preferences code;
and the optimum of the KL-regularised objective E[r] - beta KL(pi || pi_ref), pi* = pi_ref exp(r / beta) / Z with
value beta log Z (e.g. Rafailov et al. 2023, arXiv 2305.18290, eq. 4)."""
import concurrent.futures
import copy
import dataclasses
import itertools
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import typing

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import RLHF_TINY, ROOT

import ppo_rlhf_toy as M  # the repo root is on sys.path (conftest.py)

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import rlhf_estimators  # noqa: E402
import rlhf_seeds  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest. Restore the test run's setting afterwards (train() sets it too)."""
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
    rewards = torch.randn(5, 7, dtype=torch.float64)
    values = torch.randn(5, 7, dtype=torch.float64)
    lengths = [7, 1, 4, 3, 6]
    mask = torch.tensor([[float(t < n) for t in range(7)] for n in lengths], dtype=torch.float64)
    gamma = 0.9
    lam = 0.8
    advantages, returns = M.gae(rewards, values, mask, gamma, lam)
    for row, n in enumerate(lengths):  # A_t = sum_l (gamma lam)^l delta_{t+l}, with V = 0 after the last token
        value = lambda t: values[row, t].item() if t < n else 0.0
        for t in range(7):
            deltas = [rewards[row, step].item() + gamma * value(step + 1) - value(step) for step in range(t, n)]
            expected = sum((gamma * lam) ** power * delta for power, delta in enumerate(deltas))
            assert advantages[row, t].item() == pytest.approx(expected if t < n else 0.0, abs=1e-12)
            assert returns[row, t].item() == pytest.approx(expected + value(t) if t < n else 0.0, abs=1e-12)


def test_whitening_golden_and_masked():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ones = torch.ones(4)
    torch.testing.assert_close(M.whiten(x, ones), torch.tensor([-1.341641, -0.447214, 0.447214, 1.341641]))
    torch.testing.assert_close(M.whiten(x, ones, shift_mean=False),
                               torch.tensor([1.158359, 2.052786, 2.947214, 3.841641]))
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])
    whitened = M.whiten(torch.tensor([1.0, 5.0, 100.0, 3.0, -50.0]), mask)  # masked entries must not matter
    assert M.masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert M.masked_mean(whitened ** 2, mask).item() == pytest.approx(1.0, abs=1e-6)


def test_explained_variance_matches_numpy_on_the_unmasked_tokens():
    torch.manual_seed(0)
    returns = torch.randn(6, 5, dtype=torch.float64)
    values = returns + 0.5 * torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) < 0.7).double()
    keep = mask.bool().numpy()
    expected = 1 - np.var((returns - values).numpy()[keep]) / np.var(returns.numpy()[keep])
    assert M.explained_variance(values, returns, mask) == pytest.approx(expected, abs=1e-12)
    assert M.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert math.isnan(M.explained_variance(values, torch.ones(6, 5, dtype=torch.float64), mask))  # Var[returns] = 0


def test_kl_estimators_golden_and_k3_nonnegative():
    for p, q, k1, k3 in [(0.5, 0.25, 0.693147, 0.193147), (0.25, 0.5, -0.693147, 0.306853)]:
        logp = torch.tensor([math.log(p)])
        ref_logp = torch.tensor([math.log(q)])
        assert M.kl_estimate(logp, ref_logp, "k1").item() == pytest.approx(k1, abs=1e-6)
        assert M.kl_estimate(logp, ref_logp, "k3").item() == pytest.approx(k3, abs=1e-6)
    # k3 >= 0 on every token of real rollouts (while k1 is negative on some of them)
    torch.manual_seed(0)
    args = M.Args(d_model=16, n_heads=2, n_layers=1)
    policy = M.make_model(args, len(M.VOCAB))
    ref = M.make_model(args, len(M.VOCAB))
    queries = M.random_prompts(256, "cpu")
    responses = M.sample(policy, queries, args.max_response_len, args.temperature)[0]
    mask = M.response_mask(responses).bool()
    logp = M.response_logprobs(policy, queries, responses, args.temperature)[0]
    ref_logp = M.response_logprobs(ref, queries, responses, args.temperature)[0]
    assert (M.kl_estimate(logp, ref_logp, "k3")[mask] >= 0).all()
    assert (M.kl_estimate(logp, ref_logp, "k1")[mask] < 0).any()


def test_k3_as_a_reward_has_the_gradient_of_forward_minus_reverse_kl_and_k1_that_of_kl():
    """In PPO the KL penalty is part of the reward: a fixed number per sample, so its policy gradient is
    E_pi[penalty * grad log pi]. Exact, by enumeration: k1 gives grad KL(pi || pi_ref); k3, whose expectation is
    the same KL, gives grad KL(pi || pi_ref) - grad KL(pi_ref || pi)."""
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref_logp = torch.randn(6, dtype=torch.float64).log_softmax(0)
    logp = theta.log_softmax(0)
    probs = logp.exp()

    def gradient(objective):
        return torch.autograd.grad(objective, theta, retain_graph=True)[0]

    reward_gradient = {estimator: gradient((probs * M.kl_estimate(logp.detach(), ref_logp, estimator)).sum())
                       for estimator in ("k1", "k3")}
    forward_kl = (probs * (logp - ref_logp)).sum()
    reverse_kl = (ref_logp.exp() * (ref_logp - logp)).sum()
    for estimator in ("k1", "k3"):  # the same value...
        expectation = (probs * M.kl_estimate(logp, ref_logp, estimator)).sum()
        assert expectation.item() == pytest.approx(forward_kl.item(), abs=1e-12)
    torch.testing.assert_close(reward_gradient["k1"], gradient(forward_kl))  # ...but not the same gradient
    torch.testing.assert_close(reward_gradient["k3"], gradient(forward_kl) - gradient(reverse_kl))
    assert (reward_gradient["k3"] - gradient(forward_kl)).abs().max() > 0.05


def test_k3_in_the_loss_has_the_gradient_of_the_reverse_kl():
    """GRPO's KL term is a loss, differentiated through log pi at the sampled tokens (no policy-gradient term): exact,
    by enumeration, its expected gradient E_pi[grad k3] is grad KL(pi_ref || pi), not grad KL(pi || pi_ref), the
    gradient that k1 in the reward gives. The same beta is therefore a different leash in the two places."""
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref_logp = torch.randn(6, dtype=torch.float64).log_softmax(0)
    logp = theta.log_softmax(0)
    probs = logp.exp().detach()  # the tokens were sampled by pi_old = pi: fixed weights, as in the loss
    loss_gradient = torch.autograd.grad((probs * M.kl_estimate(logp, ref_logp, "k3")).sum(), theta)[0]
    reverse_kl = (ref_logp.exp() * (ref_logp - theta.log_softmax(0))).sum()
    forward_kl = (theta.log_softmax(0).exp() * (theta.log_softmax(0) - ref_logp)).sum()
    torch.testing.assert_close(loss_gradient, torch.autograd.grad(reverse_kl, theta)[0])
    assert (loss_gradient - torch.autograd.grad(forward_kl, theta)[0]).abs().max() > 0.05


# ---------------------------------------------------------------- the critic-free estimators: GRPO and RLOO
def naive_group_relative(scores, k, eps=1e-4):
    """GRPO's advantage by hand in float64: each group's mean and sample std (ddof 1) in plain loops."""
    advantages = []
    for start in range(0, len(scores), k):
        group = [float(score) for score in scores[start:start + k]]
        mean = sum(group) / k
        std = math.sqrt(sum((score - mean) ** 2 for score in group) / (k - 1))
        advantages += [(score - mean) / (std + eps) for score in group]
    return advantages


def naive_leave_one_out(scores, k):
    """RLOO's advantage by a double loop: r_i minus the mean of the other k - 1 scores of its group."""
    advantages = []
    for start in range(0, len(scores), k):
        group = [float(score) for score in scores[start:start + k]]
        for i in range(k):
            others = [group[j] for j in range(k) if j != i]
            advantages.append(group[i] - sum(others) / len(others))
    return advantages


@pytest.mark.parametrize("k", [2, 3, 5])
def test_group_advantages_match_naive_float64_references(k):
    torch.manual_seed(k)
    scores = torch.randn(4 * k, dtype=torch.float64) * 3
    grpo = M.group_relative_advantages(scores, k)
    rloo = M.leave_one_out_advantages(scores, k)
    assert grpo.tolist() == pytest.approx(naive_group_relative(scores.tolist(), k), abs=1e-12)
    assert rloo.tolist() == pytest.approx(naive_leave_one_out(scores.tolist(), k), abs=1e-12)
    for group in grpo.view(-1, k):  # each group standardised (up to eps): mean 0, sample std 1
        assert group.mean().item() == pytest.approx(0.0, abs=1e-12)
        assert group.std().item() == pytest.approx(1.0, abs=0.01)


def test_group_advantages_of_equal_scores_are_zero_and_k_1_is_refused():
    scores = torch.tensor([0.7, 0.7, 0.7, 0.7, -1.0, 2.0, 0.5, 0.5])  # a group of equal scores, then another
    for advantages in (M.group_relative_advantages(scores, 4), M.leave_one_out_advantages(scores, 4)):
        assert torch.isfinite(advantages).all() and advantages[:4].tolist() == [0.0] * 4
        assert advantages[4:].abs().max() > 0.5
    for estimator in (M.group_relative_advantages, M.leave_one_out_advantages):
        for k, count in ((1, 8), (3, 8)):  # k = 1: no group; 8 scores do not split into groups of 3
            with pytest.raises(ValueError, match=f"group_size {k}: a group baseline needs k >= 2"):
                estimator(scores[:count], k)


def test_the_kl_in_the_loss_is_grpos_k3_and_leaves_the_reward_alone():
    """--kl-penalty loss: the rewards hold the score only, and the update adds beta times the mean k3 per token (GRPO
    eq. 4). Equal scores make every advantage 0, so one plain SGD step is exactly -lr * beta * grad mean k3."""
    args, policy, _, _, _ = small_setup(advantage="grpo", num_minibatches=1, ppo_epochs=1, beta=0.3,
                                        max_grad_norm=math.inf)
    ref = M.make_model(args, len(M.VOCAB)).requires_grad_(False)  # a reference the policy differs from
    queries = M.random_prompts(16, "cpu").repeat_interleave(4, 0)
    equal_scores = lambda queries, responses: torch.full((len(responses),), 0.5)
    batch = M.collect_rollout(rl_setup(policy, ref, None, equal_scores), queries, args.beta, args)
    mask = batch["mask"]
    torch.testing.assert_close(batch["rewards"].sum(1), batch["scores"])  # no KL penalty in the reward
    assert batch["advantages"].abs().max() == 0
    before = copy.deepcopy(policy)
    logp = M.response_logprobs(before, queries, batch["responses"], args.temperature)[0]
    log_r = batch["ref_logp"] - logp * mask  # log(pi_ref / pi) per token
    k3 = ((log_r.exp() - 1 - log_r) * mask).sum() / mask.sum()
    k3.backward()
    (stats,) = M.ppo_update(rl_setup(policy, ref, None, equal_scores), torch.optim.SGD(policy.parameters(), lr=0.1),
                            batch, args, args.beta)
    assert stats["kl_loss"] == pytest.approx(k3.item(), rel=1e-5) and k3 > 0.1
    for moved, start in zip(policy.parameters(), before.parameters()):
        torch.testing.assert_close(moved - start.detach(), -0.1 * args.beta * start.grad, atol=1e-6, rtol=1e-4)


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
        best = [max(subset, key=lambda i: pool[i].item()) for subset in subsets]
        weights = M.best_of_n_weights(7, n)
        assert weights.sum().item() == pytest.approx(1.0, abs=1e-12)
        expected_pool = sum(pool[i].item() for i in best) / len(subsets)
        expected_gold = sum(gold[i].item() for i in best) / len(subsets)
        assert (pool[order] @ weights).item() == pytest.approx(expected_pool, abs=1e-12)
        assert (gold[order] @ weights).item() == pytest.approx(expected_gold, abs=1e-12)


def test_reward_head_init_std():
    torch.manual_seed(0)
    for d_model, std in [(48, 0.142857), (64, 0.124035), (768, 0.036061)]:
        head = M.TinyTransformer(M.ModelConfig(10, 1, d_model, 1, 4, 8)).head
        assert head.weight.std().item() == pytest.approx(std, rel=0.3 if d_model < 100 else 0.08)
        assert head.bias.abs().max().item() == 0.0


def test_bradley_terry_loss_matches_hand_computation():
    r_chosen = torch.tensor([1.0, 0.0, -0.5])
    r_rejected = torch.tensor([0.0, 2.0, -0.5])
    # -log sigma(d) = log(1 + e^-d) for d = 1, -2, 0
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2)) + math.log(2)) / 3
    assert M.bradley_terry_loss(r_chosen, r_rejected).item() == pytest.approx(expected, abs=1e-6)


def test_closed_form_optimum_golden():
    rewards = torch.tensor([0.0, 1.0], dtype=torch.float64)
    pi_star, log_z, kl_star = closed_form_optimum(torch.tensor([0.5, 0.5], dtype=torch.float64), rewards, 0.5)
    torch.testing.assert_close(pi_star, torch.tensor([0.119203, 0.880797], dtype=torch.float64), atol=1e-6, rtol=0)
    assert log_z == pytest.approx(1.433781, abs=1e-6) and kl_star == pytest.approx(0.327813, abs=1e-6)
    assert (pi_star * rewards).sum().item() - 0.5 * kl_star == pytest.approx(0.5 * log_z, abs=1e-9)


def test_gold_reward_rules():
    judge = lambda text: M.judge(text.split())[0]
    assert judge("was great .") == 1.0 and judge("was not great .") == -1.0
    assert judge("was great and superb but fun .") == 2.0  # clipped at 2
    assert judge("was not great but awful .") == -2.0  # negation ends at the conjunction
    assert judge("was great and great .") == 1.5  # -0.5 per repeated adjective
    assert judge("was great superb .") == -2.0  # ungrammatical
    assert judge("was great and superb") == -1.0  # no EOS


def parabola_history(offset=0.0, spike_at=None):
    """60 PPO iterations whose gold score peaks at iteration 30, (j - 30)^2 / 100 below it, plus `offset` (and 5.0
    at `spike_at`: one noisy batch); KL = iteration / 10."""
    return [{"gold/score": 5.0 if i == spike_at else -((i - 30) ** 2) / 100 + offset, "proxy/score": i / 60,
             "objective/kl": i / 10, "episode": 16 * i} for i in range(1, 61)]


def test_smoothed_peak_of_one_run_on_a_closed_form():
    # a 5-wide centred average of -(j - 30)^2 / 100 over j = 28..32 is -10 / 5 / 100 at the centre; of j / 10, 3.0
    peak = rlhf_seeds.smoothed_peak([parabola_history()])
    assert peak["iteration"] == 30 and peak["gold/score"] == pytest.approx(-0.02)
    assert peak["objective/kl"] == pytest.approx(3.0)
    assert rlhf_seeds.smoothed_peak([parabola_history(spike_at=50)])["iteration"] == 30  # one noisy batch is not the peak


def test_seeds_tool_statistics_and_plots_on_fake_histories(in_tmp):
    mean, error = rlhf_seeds.mean_and_standard_error([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and error == pytest.approx(math.sqrt(5 / 3) / 2)  # std (ddof 1) / sqrt(4)
    assert rlhf_seeds.mean_and_standard_error([[1.0, 2.0]])[1].tolist() == [0.0, 0.0]  # one seed: no error bar
    # Two seeds offset by -+0.1: the seed mean peaks where each does, its standard error is 0.1
    histories = [parabola_history(offset) for offset in (-0.1, 0.1)]
    peak = rlhf_seeds.smoothed_peak(histories)
    assert peak["iteration"] == 30 and peak["objective/kl"] == pytest.approx(3.0)
    assert peak["gold/score"] == pytest.approx(-0.02) and peak["gold/score se"] == pytest.approx(0.1)
    assert peak["objective/kl se"] == pytest.approx(0.0, abs=1e-12)
    # one seed: that run's own peak, with standard errors 0
    one_seed = rlhf_seeds.smoothed_peak([parabola_history(spike_at=50)])
    assert one_seed == {"iteration": 30, "gold/score": pytest.approx(-0.02), "objective/kl": pytest.approx(3.0),
                        "gold/score se": 0.0, "objective/kl se": 0.0}
    bon = [{"n": n, "kl_bound": M.best_of_n_kl_bound(n), "gold/score": 0.1 * n, "proxy/score": 0.2 * n} for n in (1, 2)]
    rlhf_seeds.plot_sweep([({0.0: history, 0.05: history}, bon) for history in histories], "seeds.png")
    rlhf_seeds.plot_sweep([({0.0: histories[0], 0.05: histories[1]}, bon)], "one_run.png")  # one seed's sweep
    assert (in_tmp / "seeds.png").stat().st_size > 10000 and (in_tmp / "one_run.png").stat().st_size > 10000


def test_estimators_tool_intervals_and_paired_differences_on_fake_runs():
    mean, half = rlhf_estimators.mean_and_interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(3.182 * math.sqrt(5 / 3) / 2)  # t(0.975, 3 dof) * std / sqrt(4)

    def run(seed, estimator, gold):
        final = {key: 0.0 for key in rlhf_estimators.FINAL_KEYS}
        return {"seed": seed, "estimator": estimator, "beta": 0.05, "final": {**final, "gold/score": gold},
                "compute": {"wall_s": 1.0, "cpu_s": 1.0, "tokens": {"policy forward": 10}}}

    # PPO's gold is 1 and 2 in seeds 1 and 2; GRPO's 1.5 and 2.1: paired differences 0.5 and 0.1
    runs = [run(1, "gae", 1.0), run(2, "gae", 2.0), run(2, "grpo", 2.1), run(1, "grpo", 1.5)]
    table = rlhf_estimators.aggregate({"runs": runs})
    difference = table["grpo 0.05"]["minus_ppo"]["gold/score"]
    assert difference["mean"] == pytest.approx(0.3) and difference["ci95"] == pytest.approx(12.706 * 0.2)  # std 0.2 * sqrt(2)
    assert table["gae 0.05"]["gold/score"]["mean"] == pytest.approx(1.5) and "minus_ppo" not in table["gae 0.05"]


# ---------------------------------------------------------------- masks, EOS, the reward model and its data
def test_response_mask_and_per_token_rewards_put_the_score_on_eos():
    eos = M.EOS
    pad = M.PAD
    responses = torch.tensor([[5, eos, pad, pad], [5, 6, 7, 8], [eos, pad, pad, pad]])
    mask = M.response_mask(responses)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    kl = torch.full((3, 4), 0.5)
    rewards = M.per_token_rewards(kl, torch.tensor([10.0, 20.0, 30.0]), mask, beta=0.1)
    expected = torch.tensor([[-0.05, 9.95, 0, 0], [-0.05, -0.05, -0.05, 19.95], [29.95, 0, 0, 0]])
    torch.testing.assert_close(rewards, expected)


def encode(text):
    return [M.BOS] + [M.TOKEN[word] for word in text.split()]


def test_rm_score_is_read_at_eos_whatever_the_padding():
    torch.manual_seed(0)
    rm = M.make_model(M.Args(d_model=32, n_heads=4), 1)
    rows = [encode("the movie was great ."), encode("a cast felt not very dull and fun ."),
            encode("the plot is bland .")]
    alone = [M.score_at_eos(rm(torch.tensor([row])), torch.tensor([row])).item() for row in rows]
    for left, right in [(0, 0), (0, 3), (2, 1), (5, 0)]:  # right padding, left padding and both, in one batch
        width = max(map(len, rows)) + left + right
        batch = torch.tensor([[M.PAD] * left + row + [M.PAD] * (width - left - len(row)) for row in rows])
        per_token = rm(batch)
        scores = M.score_at_eos(per_token, batch)
        torch.testing.assert_close(scores, torch.tensor(alone), atol=1e-5, rtol=0)
        eos_position = [left + len(row) - 1 for row in rows]
        torch.testing.assert_close(scores, per_token[torch.arange(3), eos_position])
        assert not torch.allclose(scores, per_token[:, -1])  # the last position would be wrong here


def test_proxy_score_normalises_and_penalises_a_missing_eos():
    torch.manual_seed(0)
    rm = M.TinyTransformer(M.ModelConfig(len(M.VOCAB), 1, 16, 1, 2, 15))
    rm_info = {"rm/bias": 0.3, "rm/gain": 2.0}
    queries = torch.tensor([encode("the movie"), encode("a plot")])
    responses = torch.tensor([[M.TOKEN[word] for word in "was great .".split()] + [M.PAD] * 3,
                              [M.TOKEN[word] for word in "was great and very fun".split()] + [M.PAD]])
    tokens = torch.cat([queries, responses], 1)
    raw = M.score_at_eos(rm(tokens), tokens)
    scores = M.proxy_score(rm, rm_info, -1.5, queries, responses)
    assert scores[0].item() == pytest.approx((raw[0].item() - 0.3) / 2.0, abs=1e-6)
    assert scores[1].item() == -1.5  # no EOS: the fixed penalty, whatever the RM says


def test_held_out_pairs_share_no_sentence_with_training_pairs():
    pool = [encode(text) for text in ["the movie was great .", "the movie was dull .", "a plot is fun .",
                                      "a cast felt not silly .", "the music is very lovely .", "a movie was bland .",
                                      "the ending felt clever .", "a plot is awful ."]]
    width = max(map(len, pool))
    pool = torch.tensor([row + [M.PAD] * (width - len(row)) for row in pool])
    generator = torch.Generator().manual_seed(0)
    chosen = pool[torch.randint(0, len(pool), (60,), generator=generator)]  # 60 pairs of 8 sentences: repeats
    rejected = pool[torch.randint(0, len(pool), (60,), generator=generator)]
    torch.manual_seed(0)
    train, heldout, dropped = M.split_by_sentence(chosen, rejected, 0.1)
    assert sorted(torch.cat([train, heldout, dropped]).tolist()) == list(range(60))  # a partition of the pairs
    assert len(heldout) == 6 and len(train) > 0 and len(dropped) > 0
    sentences = lambda idx: set(map(tuple, torch.cat([chosen[idx], rejected[idx]]).tolist()))
    assert not sentences(train) & sentences(heldout)
    for index in dropped.tolist():  # a pair is dropped only because it shares a sentence with a held-out pair
        assert sentences(torch.tensor([index])) & sentences(heldout)


# ---------------------------------------------------------------- PPO invariants on the toy transformer
def small_setup(seed=0, **overrides):
    torch.manual_seed(seed)
    args = M.Args(**{"d_model": 32, "n_heads": 4, "rollout_batch_size": 64, "num_minibatches": 4, **overrides})
    policy = M.make_model(args, len(M.VOCAB))
    ref = copy.deepcopy(policy).requires_grad_(False)
    critic = M.make_model(args, 1)
    rm = M.make_model(args, 1)
    score_fn = lambda queries, responses: M.score_at_eos(rm(torch.cat([queries, responses], 1)),
                                                         torch.cat([queries, responses], 1)).detach()
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
    for _ in range(3):  # the first minibatch of EVERY update starts from the rollout policy
        rl = rl_setup(policy, ref, critic, score_fn)
        batch = M.collect_rollout(rl, M.random_prompts(64, "cpu"), args.beta, args)
        stats = M.ppo_update(rl, optimizer, batch, args, args.beta)
        # exactly 1.0 and 0.0 on our CPU; the tolerance only guards against BLAS kernels that depend on the batch shape
        assert stats[0]["ratio"] == pytest.approx(1.0, abs=1e-6) and stats[0]["approxkl"] < 1e-12
        assert stats[0]["clipfrac"] == 0.0 and stats[0]["vf_clipfrac"] == 0.0
        assert max(minibatch["approxkl"] for minibatch in stats) > 1e-8  # ...and the later ones have moved
    assert M.response_logprobs(policy, queries, responses, args.temperature)[0].sub(recomputed).abs().max() > 1e-4


def test_temperature_is_applied_in_every_pass():
    """Logits are divided by the temperature in every pass; if rollout and update disagreed, the first ratio would
    not be 1 (Huang et al. 2024, the N+ implementation details of RLHF with PPO)."""
    args, policy, ref, critic, score_fn = small_setup(temperature=0.5)
    rl = rl_setup(policy, ref, critic, score_fn)
    batch = M.collect_rollout(rl, M.random_prompts(64, "cpu"), args.beta, args)
    wrong = M.response_logprobs(policy, batch["queries"], batch["responses"], 1.0)[0] * batch["mask"]
    assert (wrong - batch["logp"]).abs().max() > 1e-2
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    assert M.ppo_update(rl, optimizer, batch, args, args.beta)[0]["approxkl"] < 1e-12


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_reward_whitening_keeps_the_mean_and_feeds_gae(whiten_rewards):
    """--whiten-rewards: per-token rewards scaled to unit variance without re-centring (OAI's shift_mean=False),
    and those are the rewards GAE sees."""
    args, policy, ref, critic, score_fn = small_setup(whiten_rewards=whiten_rewards, beta=0.3)
    batch = M.collect_rollout(rl_setup(policy, ref, critic, score_fn), M.random_prompts(64, "cpu"), args.beta, args)
    mask = batch["mask"]
    raw = M.per_token_rewards(batch["kl"], batch["scores"], mask, args.beta)
    if whiten_rewards:
        assert M.masked_mean(batch["rewards"], mask).item() == pytest.approx(M.masked_mean(raw, mask).item(), abs=1e-5)
        assert M.masked_var(batch["rewards"], mask).item() == pytest.approx(1.0, abs=1e-4)
        assert abs(M.masked_var(raw, mask).item() - 1.0) > 0.5  # so the scaling did something
    else:
        torch.testing.assert_close(batch["rewards"], raw)
    advantages, returns = M.gae(batch["rewards"], batch["values"], mask, args.gamma, args.lam)
    torch.testing.assert_close(batch["returns"], returns)
    torch.testing.assert_close(batch["advantages"], M.whiten(advantages, mask) * mask)


# ---------------------------------------------------------------- an enumerable task: exact optimum
A_TOKENS = [2, 3, 4]  # vocab: 0 pad, 1 bos, 2-4 words, 5 eos
ENUM_EOS = 5
ENUM_LEN = 3
N_CODES = 7 ** 4


@pytest.fixture
def enumerable_eos(monkeypatch):
    """The enumerable task's responses end with token 5; the script reads its EOS (and PAD = 0, BOS = 1, the same
    in both vocabularies) when its functions run."""
    monkeypatch.setattr(M, "EOS", ENUM_EOS)


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
    return (logp * M.response_mask(responses)).sum(1).exp()


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
    score_fn = lambda queries, batch_responses: reward_by_code[response_code(batch_responses)].float()
    ref = TablePolicy(6, 1.0).requires_grad_(False)
    return responses, rewards, score_fn, ref


def enumerable_prompts(n):
    return torch.full((n, 1), M.BOS)


def rl_setup(policy, ref, critic, score_fn, **overrides):
    """The RL stage's record with the enumerable task's prompts unless overridden."""
    return M.RLSetup(**{"policy": policy, "ref_policy": ref, "critic": critic, "score_fn": score_fn,
                        "sample_prompts": enumerable_prompts, **overrides})


def run_enumerable_ppo(beta, iterations, lr, seed=0, **overrides):
    """PPO (or GRPO, RLOO with advantage=...) on the enumerable task -> the exact learned and reference
    distributions, the gold table and the critic's V(prompt) (None without a critic)."""
    responses, rewards, score_fn, ref = enumerable_task(seed)
    args = M.Args(max_response_len=ENUM_LEN, temperature=0.7, beta=beta, ppo_iterations=iterations,
                  rollout_batch_size=256, num_minibatches=4, ppo_lr=lr, **overrides)
    policy = copy.deepcopy(ref).requires_grad_(True)
    critic = TablePolicy(1, 0.0) if args.advantage == "gae" else None
    M.run_ppo(args, rl_setup(policy, ref, critic, score_fn), beta)
    pi = exact_distribution(policy, responses, args.temperature)
    pi_ref = exact_distribution(ref, responses, args.temperature)
    return pi, pi_ref, rewards, None if critic is None else critic(torch.full((1, 1), M.BOS))[0, 0].item()


def test_enumeration_is_a_distribution(enumerable_eos):
    responses, _, _, ref = enumerable_task()
    assert exact_distribution(ref, responses, 0.7).sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("beta", [0.25, 1.0])
def test_ppo_reaches_the_kl_regularised_optimum(beta, enumerable_eos):
    pi, pi_ref, rewards, root_value = run_enumerable_ppo(beta, iterations=120, lr=0.05)
    pi_star, log_z, kl_star = closed_form_optimum(pi_ref, rewards, beta)
    assert kl(pi_star, pi_ref) == pytest.approx(kl_star, abs=1e-9)
    start = kl(pi_ref, pi_star)
    end = kl(pi, pi_star)
    print(f"KL(ref || opt) {start:.4f} -> KL(learned || opt) {end:.4f}")
    assert start > 0.05 and end < 0.01 and end < start / 20
    objective = (pi * rewards).sum().item() - beta * kl(pi, pi_ref)  # E[r] - beta KL, at most beta log Z
    assert objective == pytest.approx(beta * log_z, abs=0.02) and objective <= beta * log_z + 1e-9
    assert root_value == pytest.approx(objective, abs=0.1)  # the critic learned V(prompt) = E[sum of rewards]


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_critic_free_estimators_reach_the_kl_regularised_optimum(advantage, enumerable_eos):
    """With the k1 penalty in the reward, a response's return is r - beta log(pi / pi_ref), which is beta log Z for
    every response at pi*: pi* is where every group's returns are equal and both estimators stop. No critic."""
    beta = 0.25
    pi, pi_ref, rewards, root_value = run_enumerable_ppo(beta, iterations=40, lr=0.05, advantage=advantage,
                                                         kl_penalty="reward")
    pi_star, log_z, _ = closed_form_optimum(pi_ref, rewards, beta)
    start = kl(pi_ref, pi_star)
    end = kl(pi, pi_star)
    print(f"{advantage}: KL(ref || opt) {start:.4f} -> KL(learned || opt) {end:.4f}")
    assert root_value is None and start > 0.05 and end < 0.02 and end < start / 10
    objective = (pi * rewards).sum().item() - beta * kl(pi, pi_ref)
    assert objective == pytest.approx(beta * log_z, abs=0.02) and objective <= beta * log_z + 1e-9


@pytest.mark.parametrize("advantage, group_size", [("gae", 1), ("grpo", 4), ("rloo", 8)])
def test_each_estimator_samples_the_same_number_of_responses_k_per_prompt(advantage, group_size, enumerable_eos):
    """The same budget for every estimator: --rollout-batch-size responses per iteration, from batch / k prompt
    draws, each prompt's k responses in consecutive rows (the rows a group baseline compares)."""
    _, _, score_fn, ref = enumerable_task()
    draws, scored = [], []

    def distinct_prompts(count):  # one-token prompts 1..4, so that groups can be told apart
        draws.append(count)
        return torch.randint(1, 5, (count, 1))

    def spy(queries, responses):
        scored.append(queries)
        return score_fn(queries, responses)

    args = M.Args(max_response_len=ENUM_LEN, ppo_iterations=2, rollout_batch_size=32, num_minibatches=2, ppo_epochs=1,
                  advantage=advantage, **({} if advantage == "gae" else {"group_size": group_size}))
    policy = copy.deepcopy(ref).requires_grad_(True)
    critic = TablePolicy(1, 0.0) if advantage == "gae" else None
    M.run_ppo(args, rl_setup(policy, ref, critic, spy, sample_prompts=distinct_prompts), 0.1)
    assert draws == [32 // group_size] * 2 and [len(queries) for queries in scored] == [32, 32]
    for queries in scored:
        groups = queries.view(-1, group_size)
        assert (groups == groups[:, :1]).all()


def test_ppo_with_k3_in_the_reward_misses_the_optimum_and_collapses(enumerable_eos):
    """What test_k3_as_a_reward_has_the_gradient... predicts: with k3 the penalty does not hold pi near pi_ref, so
    PPO ends far from pi* (which k1 reaches, above) on a single response, at a beta where pi* keeps entropy."""
    beta = 1.0
    pi, pi_ref, rewards, _ = run_enumerable_ppo(beta, iterations=60, lr=0.05, kl_estimator="k3")
    pi_star, _, kl_star = closed_form_optimum(pi_ref, rewards, beta)
    print(f"k3: KL(pi || pi_ref) {kl(pi, pi_ref):.3f} vs KL(pi* || pi_ref) {kl_star:.3f}; max pi {pi.max():.3f}")
    assert kl(pi, pi_star) > 0.2 and kl(pi, pi_ref) > 5 * kl_star
    assert pi.max() > 0.95 and pi_star.max() < 0.7


def test_ppo_losses_match_a_naive_per_token_computation():
    torch.manual_seed(0)
    shape = (4, 5)
    logp = torch.randn(shape, dtype=torch.float64) * 0.3
    old_logp = torch.randn(shape, dtype=torch.float64) * 0.3
    advantages = torch.randn(shape, dtype=torch.float64)
    returns = torch.randn(shape, dtype=torch.float64)
    values = torch.randn(shape, dtype=torch.float64)
    old_values = torch.randn(shape, dtype=torch.float64)
    mask = (torch.rand(shape) < 0.7).double()
    pg, stats = M.clipped_surrogate_loss(logp, old_logp, advantages, mask, 0.2)
    vf, vf_clipfrac = M.clipped_value_loss(values, old_values, returns, mask, 0.3)
    pg_terms = []
    vf_terms = []
    clipped = []
    for i, j in itertools.product(range(4), range(5)):
        if mask[i, j]:
            ratio = math.exp(logp[i, j] - old_logp[i, j])
            advantage = advantages[i, j].item()
            pg_terms.append(max(-advantage * ratio, -advantage * min(max(ratio, 0.8), 1.2)))
            clipped.append(-advantage * min(max(ratio, 0.8), 1.2) > -advantage * ratio)
            v_clip = old_values[i, j] + min(max(values[i, j] - old_values[i, j], -0.3), 0.3)
            vf_terms.append(0.5 * max((values[i, j] - returns[i, j]) ** 2, (v_clip - returns[i, j]) ** 2).item())
    assert pg.item() == pytest.approx(sum(pg_terms) / len(pg_terms), abs=1e-12)
    assert vf.item() == pytest.approx(sum(vf_terms) / len(vf_terms), abs=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped), abs=1e-12)
    assert 0 < stats["clipfrac"] < 1


def test_huge_beta_keeps_the_policy_at_the_reference(enumerable_eos):
    pi, pi_ref, _, _ = run_enumerable_ppo(1e4, iterations=30, lr=0.05)
    pi_free = run_enumerable_ppo(0.0, iterations=30, lr=0.05)[0]
    print(f"KL to reference: beta=1e4 {kl(pi, pi_ref):.5f}, beta=0 {kl(pi_free, pi_ref):.3f}")
    assert kl(pi, pi_ref) < 5e-3 and kl(pi_free, pi_ref) > 0.5
    pi_frozen, pi_ref, _, _ = run_enumerable_ppo(0.0, iterations=3, lr=0.0)  # lr = 0: nothing moves
    assert kl(pi_frozen, pi_ref) == pytest.approx(0.0, abs=1e-12)


def test_adaptive_kl_controller_sets_the_beta_of_each_next_iteration_in_run_ppo(enumerable_eos):
    _, _, score_fn, ref = enumerable_task()
    args = M.Args(max_response_len=ENUM_LEN, temperature=0.7, ppo_iterations=8, rollout_batch_size=64,
                  num_minibatches=4, ppo_lr=0.05, adaptive_kl=True, kl_target=0.05, kl_horizon=200)
    policy = copy.deepcopy(ref).requires_grad_(True)
    history = M.run_ppo(args, rl_setup(policy, ref, TablePolicy(1, 0.0), score_fn), 0.5)
    assert history[0]["objective/kl_coef"] == 0.5
    for before, after in zip(history, history[1:]):
        expected = M.adaptive_kl_beta(before["objective/kl_coef"], before["objective/kl"], 0.05, 64, 200)
        assert after["objective/kl_coef"] == expected
    for record in history:  # the beta of each record is the one its rewards were computed with
        penalty = -record["objective/kl_coef"] * record["objective/kl"]
        assert record["objective/non_score_reward"] == pytest.approx(penalty, abs=1e-6)
    assert len({record["objective/kl_coef"] for record in history}) == len(history)  # beta moved every iteration


def test_ppo_ptx_mixes_the_pretraining_loss_into_the_update(enumerable_eos):
    """InstructGPT's PPO-ptx term gamma E_pretrain[log pi(x)]. With a zero reward and beta = 0 every advantage is
    0, so plain PPO leaves the policy exactly where it is, and only the ptx term can move it: towards the corpus."""
    responses, _, _, ref = enumerable_task()
    corpus_row = torch.tensor([[M.BOS, 2, 3, ENUM_EOS]])
    target = [2, 3, ENUM_EOS]
    target_index = responses.tolist().index(target)
    zero_score = lambda queries, batch_responses: torch.zeros(len(batch_responses))
    probability = {}
    for ptx_coef in (0.0, 1.0):
        calls = []

        def corpus_batch(n):
            calls.append(n)
            return corpus_row.expand(n, -1)

        args = M.Args(max_response_len=ENUM_LEN, temperature=0.7, beta=0.0, ppo_iterations=4, rollout_batch_size=64,
                      num_minibatches=4, ppo_lr=0.05, ptx_coef=ptx_coef)
        policy = copy.deepcopy(ref).requires_grad_(True)
        rl = rl_setup(policy, ref, TablePolicy(1, 0.0), zero_score, sample_corpus=corpus_batch)
        history = M.run_ppo(args, rl, 0.0)
        probability[ptx_coef] = exact_distribution(policy, responses, 1.0)[target_index].item()
        if ptx_coef == 0:
            assert calls == [] and "loss/ptx_avg" not in history[0]
        else:  # 8 corpus sentences per episode of each minibatch, as InstructGPT
            assert calls == [M.PTX_SENTENCES_PER_EPISODE * 16] * (4 * 4 * 4)  # iterations x epochs x minibatches
            assert history[-1]["loss/ptx_avg"] < history[0]["loss/ptx_avg"]
    reference = exact_distribution(ref, responses, 1.0)[target_index].item()
    assert probability[0.0] == pytest.approx(reference, abs=1e-12)
    assert probability[1.0] > 0.5 > 2 * reference


# ---------------------------------------------------------------- flags and checkpoints
BAD_VALUES = {  # one bad value for every numeric flag of Args
    "seed": -1, "corpus_size": 0, "max_response_len": 5, "num_pairs": 1, "label_noise": 0.0, "d_model": 0,
    "n_layers": 0, "n_heads": 0, "sft_steps": 0, "sft_lr": math.nan, "rm_epochs": 0, "rm_lr": math.inf,
    "ppo_iterations": 0, "rollout_batch_size": 0, "num_minibatches": 0, "ppo_epochs": -1, "ppo_lr": -1e-3,
    "max_grad_norm": 0.0, "temperature": math.inf, "beta": -0.1, "kl_target": 0.0, "kl_horizon": 0,
    "clip_coef": 0.0, "clip_coef_value": math.nan, "vf_coef": -1.0, "gamma": 1.5, "lam": -0.1,
    "missing_eos_penalty": -math.inf, "ptx_coef": math.nan, "eval_samples": 0, "bon_pool": 1,
    "sweep_betas": (0.1, math.inf), "threads": 0, "group_size": 1}


def test_every_numeric_flag_has_a_range_and_a_bad_value_here():
    numeric = {field.name for field in dataclasses.fields(M.Args)
               if field.type in (int, float) or typing.get_args(field.type)[:1] == (float,)}
    ranged = [name for names, _, _ in M.FLAG_RANGES for name in names]
    assert numeric == set(BAD_VALUES) == set(ranged) and len(ranged) == len(set(ranged))


@pytest.mark.parametrize("name, value", BAD_VALUES.items())
def test_a_bad_numeric_flag_fails_with_one_line_naming_it(name, value):
    with pytest.raises(SystemExit) as error:
        M.validate_args(dataclasses.replace(M.Args(), **{name: value}))
    message = str(error.value)
    assert message.startswith(f"error: --{name.replace('_', '-')} ") and "\n" not in message, message


@pytest.mark.parametrize("overrides, flag", [
    (dict(num_minibatches=3), "--num-minibatches"), (dict(rollout_batch_size=40, num_minibatches=8),
                                                     "--num-minibatches"),
    (dict(load_rm="x.pt", load_sft=None), "--load-rm"), (dict(n_heads=5), "--n-heads"),
    (dict(load_sft="missing.pt"), "--load-sft"), (dict(group_size=8), "--group-size"),
    (dict(advantage="rloo", group_size=5), "--group-size"), (dict(advantage="grpo", lam=0.9), "--lam"),
    (dict(advantage="rloo", vf_coef=0.5), "--vf-coef"), (dict(advantage="grpo", whiten_rewards=True), "--whiten-rewards"),
    (dict(advantage="grpo", kl_estimator="k3"), "--kl-estimator"),
    (dict(kl_penalty="loss", kl_estimator="k3"), "--kl-estimator")])
def test_flags_that_constrain_each_other_fail_with_one_line(overrides, flag):
    with pytest.raises(SystemExit) as error:
        M.validate_args(dataclasses.replace(M.Args(), **overrides))
    message = str(error.value)
    assert message.startswith("error: ") and flag in message and "\n" not in message


def test_limits_that_are_allowed():
    M.validate_args(M.Args(max_grad_norm=math.inf, beta=0.0, ptx_coef=0.0, gamma=0.0, lam=1.0, ppo_lr=0.0,
                           sweep_betas=(0.0,), seed=0))


def tiny_checkpoint(path, out_dim=len(M.VOCAB), **extra):
    banned_tokens = (M.PAD, M.BOS) if out_dim > 1 else ()
    model = M.TinyTransformer(M.ModelConfig(len(M.VOCAB), out_dim, 16, 1, 2, 15, banned_tokens))
    M.save_checkpoint(path, model, **extra)
    return model


def test_a_checkpoint_that_cannot_serve_the_flags_fails_at_once_with_one_line(in_tmp):
    policy = lambda vocab, max_len: M.TinyTransformer(M.ModelConfig(vocab, vocab, 16, 1, 2, max_len, (M.PAD, M.BOS)))
    M.save_checkpoint("short.pt", policy(len(M.VOCAB), M.PROMPT_LEN + 8))  # room for 8 response tokens
    M.save_checkpoint("other_vocab.pt", policy(20, 16))
    M.save_checkpoint("reward_model.pt", M.TinyTransformer(M.ModelConfig(len(M.VOCAB), 1, 16, 1, 2, 16)))
    tiny_checkpoint("rm_without_info.pt", out_dim=1)
    for overrides, flag in [(dict(load_sft="short.pt"), "--max-response-len"),  # 12 > 8
                            (dict(load_sft="other_vocab.pt"), "--load-sft"),
                            (dict(load_sft="reward_model.pt"), "--load-sft"),  # not a policy
                            (dict(load_sft="short.pt", load_rm="short.pt", max_response_len=8), "--load-rm"),
                            (dict(load_sft="short.pt", load_rm="rm_without_info.pt", max_response_len=8),
                             "--load-rm")]:
        with pytest.raises(SystemExit) as error:
            M.train(M.Args(**overrides))
        message = str(error.value)
        assert message.startswith("error: ") and flag in message and "\n" not in message, message
    assert not os.path.exists("runs")  # it failed before the run created anything
    M.validate_args(M.Args(load_sft="short.pt", max_response_len=8))  # what the checkpoint supports is fine


class Malicious:
    """Unpickling this runs a shell command: what a checkpoint from a stranger could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_damaged_and_foreign_checkpoints_are_refused_with_one_line(in_tmp):
    marker = in_tmp / "pwned"
    torch.save({"config": Malicious(marker), "state_dict": {}}, "malicious.pt")
    with open("malicious_pickle.pt", "wb") as file:  # a plain pickle, not torch's zip format
        pickle.dump(Malicious(marker), file)
    tiny_checkpoint("good_sft.pt")
    tiny_checkpoint("good_rm.pt", out_dim=1, rm_info={"rm/bias": 0.0, "rm/gain": 1.0})
    with open("good_sft.pt", "rb") as file:
        data = file.read()
    with open("truncated.pt", "wb") as file:
        file.write(data[: len(data) // 2])
    torch.save(torch.zeros(3), "tensor.pt")
    torch.save({"agent": {}, "args": {"env_id": "starpilot"}}, "procgen.pt")  # another script's checkpoint
    torch.save({"config": {"vocab_size": len(M.VOCAB)}, "state_dict": {}}, "bad_config.pt")
    cases = [("malicious.pt", "refused"), ("malicious_pickle.pt", "refused"), ("truncated.pt", "cannot be read"),
             ("tensor.pt", "not a checkpoint of ppo_rlhf_toy.py"), ("procgen.pt", "not a checkpoint"),
             ("bad_config.pt", "do not fit its config")]
    for path, what in cases:
        for overrides in (dict(load_sft=path), dict(load_sft="good_sft.pt", load_rm=path)):
            flag = "--load-rm" if "load_rm" in overrides else "--load-sft"
            with pytest.raises(SystemExit) as error:
                M.train(M.Args(**overrides))
            message = str(error.value)
            assert message.startswith(f"error: {flag} {path}: ") and what in message, message
            assert "\n" not in message and len(message) < 300, message
    assert not marker.exists()  # nothing in the malicious files ran
    assert not os.path.exists("runs")
    M.validate_args(M.Args(load_sft="good_sft.pt", load_rm="good_rm.pt", max_response_len=12))


def test_a_checkpoint_written_before_weights_only_loading_still_loads(in_tmp):
    """The layout save_checkpoint wrote before this change: config with a tuple of banned tokens, the state dict,
    and for the RM an rm_info of plain numbers without the newer keys (rm/heldout_loss, rm/epochs...)."""
    torch.manual_seed(0)
    rm = M.TinyTransformer(M.ModelConfig(len(M.VOCAB), 1, 16, 1, 2, 15))
    old_info = {"rm/heldout_acc": 0.75, "rm/heldout_acc_gold": 0.81, "rm/label_ceiling": 0.85, "rm/train_pairs": 3600,
                "rm/heldout_pairs": 400, "rm/bias": 0.1, "rm/gain": 1.3}
    torch.save({"config": dataclasses.asdict(rm.config), "state_dict": rm.state_dict(), "rm_info": old_info}, "old_rm.pt")
    loaded, checkpoint = M.load_checkpoint("old_rm.pt", "--load-rm", "cpu")
    assert checkpoint["rm_info"] == old_info and checkpoint["config"]["banned_tokens"] == ()
    queries = M.random_prompts(4, "cpu")
    responses = torch.tensor([[M.TOKEN["was"], M.TOKEN["great"], M.EOS]] * 4)
    torch.testing.assert_close(M.proxy_score(loaded, old_info, -1.0, queries, responses),
                               M.proxy_score(rm, old_info, -1.0, queries, responses))


# ---------------------------------------------------------------- end to end
MICRO = dict(corpus_size=300, sft_steps=10, num_pairs=100, rm_epochs=1, ppo_iterations=3, rollout_batch_size=16,
             num_minibatches=2, eval_samples=32, bon_pool=4)


def read_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_end_to_end_small(rlhf_tiny_run, in_tmp):
    """The test run's shared run at RLHF_TINY (conftest.py), then its stages re-run from its checkpoints."""
    summary, run_dir = rlhf_tiny_run.summary, rlhf_tiny_run.run_dir
    rm_info = summary["rm"]
    print(json.dumps(rm_info), summary["sft"]["gold/score"], summary["ppo"]["0.05"]["gold/score"])
    assert rm_info["rm/heldout_acc"] > 0.6 and rm_info["rm/heldout_acc_gold"] > 0.65
    sft = summary["sft"]
    ppo = summary["ppo"]["0.05"]
    assert ppo["gold/score"] > sft["gold/score"] + 0.5 and ppo["proxy/score"] > sft["proxy/score"] + 0.5
    records = read_records(run_dir)
    ppo_records = [record for record in records if record["stage"] == "ppo"]
    assert len(ppo_records) == RLHF_TINY["ppo_iterations"]
    for key in ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/scores",
                "objective/rlhf_reward", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
                "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var",
                "val/num_eos_tokens", "val/var_explained", "ppo/returns/mean", "ppo/returns/var", "lr", "episode",
                "eps", "gold/score", "proxy/score", "gold/grammar_rate", "gold/eos_rate"]:
        assert key in ppo_records[0], key
    assert ppo_records[-1]["val/var_explained"] > 0.3  # the critic, initialised from the RM, predicts returns
    epochs = [record for record in records if record["stage"] == "rm" and "rm/heldout_loss" in record]
    assert [record["epoch"] for record in epochs] == [1, 2, 3]  # the held-out loss after every epoch
    assert epochs[-1]["rm/heldout_loss"] < epochs[0]["rm/heldout_loss"]
    pairs_with_eos = rm_info["rm/train_pairs"] + rm_info["rm/heldout_pairs"] + rm_info["rm/dropped_pairs"]
    assert pairs_with_eos <= RLHF_TINY["num_pairs"] and rm_info["rm/heldout_pairs"] == int(0.1 * pairs_with_eos)
    assert rm_info["rm/dropped_pairs"] > 0  # split by sentence
    files = sorted(name for name in os.listdir(run_dir) if not name.startswith("events.out.tfevents"))
    assert files == ["metrics.jsonl", "ppo_policy.pt", "rm.pt", "sft.pt"]  # no .tmp left behind
    # stages re-run separately: load both checkpoints, run PPO only
    sft_path = str(run_dir / "sft.pt")
    rm_path = str(run_dir / "rm.pt")
    again = M.train(M.Args(**{**RLHF_TINY, "ppo_iterations": 2}, load_sft=sft_path, load_rm=rm_path))
    assert again["rm"] == rm_info
    assert again["sft"]["gold/grammar_rate"] > 0.9  # the loaded SFT policy is the trained one, not a fresh model
    # same model, new samples
    assert again["sft"]["gold/score"] == pytest.approx(summary["sft"]["gold/score"], abs=0.35)
    # --load-sft alone, with architecture flags that differ from the checkpoint's and a shorter response length:
    # the RM is built from the loaded SFT model's own config, so this trains an RM instead of failing
    quick = dict(RLHF_TINY, num_pairs=200, rm_epochs=1, ppo_iterations=1, eval_samples=64, bon_pool=4)
    third = M.train(M.Args(**quick, d_model=32, n_layers=1, n_heads=2, max_response_len=10, load_sft=sft_path))
    assert third["sft"]["gold/grammar_rate"] > 0.9 and third["rm"]["rm/train_pairs"] > 100


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_critic_free_estimators_train_on_the_toy_without_a_critic(advantage, rlhf_tiny_run, in_tmp):
    """GRPO and RLOO from the shared run's SFT policy and RM, at its flags: gold and proxy go up as PPO's do; no
    critic is trained, logged or saved; GRPO's KL is a loss term, RLOO's a reward penalty (their papers)."""
    sft_path, rm_path = (str(rlhf_tiny_run.run_dir / name) for name in ("sft.pt", "rm.pt"))
    quick = dict(RLHF_TINY, ppo_iterations=10, eval_samples=128, bon_pool=2)
    summary = M.train(M.Args(**quick, advantage=advantage, load_sft=sft_path, load_rm=rm_path, save_model=True))
    sft, final = summary["sft"], summary["ppo"]["0.05"]
    print(advantage, sft["gold/score"], final["gold/score"], final["objective/kl"])
    assert summary["advantage"] == advantage
    assert final["gold/score"] > sft["gold/score"] + 0.5 and final["proxy/score"] > sft["proxy/score"] + 0.5
    (run_dir,) = list((in_tmp / "runs").iterdir())
    ppo_records = [record for record in read_records(run_dir) if record["stage"] == "ppo"]
    assert len(ppo_records) == quick["ppo_iterations"]
    assert not {"loss/value_avg", "val/var_explained", "val/clipfrac_avg"} & set(ppo_records[0])
    assert ("loss/kl_avg" in ppo_records[0]) == (advantage == "grpo")
    assert M.load_checkpoint(str(run_dir / "ppo_policy.pt"), "--load-sft", "cpu")[1]["critic"] is None


def test_two_runs_with_the_same_name_get_two_run_directories(in_tmp, monkeypatch):
    """A sweep that starts two runs in the same second with the same seed and --exp-name: each run creates
    its own directory (the second one suffixed -2), with its own rows and flags."""
    ticks = itertools.count()

    class SameSecond:  # every call in one second, so both runs get one name; still moving: timings stay finite
        @staticmethod
        def time():
            return 1e9 + next(ticks) * 1e-6

    monkeypatch.setattr(M, "time", SameSecond)
    for ppo_lr in (3e-4, 1e-4):
        M.train(M.Args(**MICRO, ppo_lr=ppo_lr))
    names = sorted(os.listdir(in_tmp / "runs"))
    assert names == ["rlhf_sentiment__ppo_rlhf_toy__1__1000000000", "rlhf_sentiment__ppo_rlhf_toy__1__1000000000-2"]
    for name, ppo_lr in zip(names, (3e-4, 1e-4)):
        records = read_records(in_tmp / "runs" / name)
        assert [record["stage"] for record in records].count("summary") == 1
        ppo_records = [record for record in records if record["stage"] == "ppo"]
        assert len(ppo_records) == MICRO["ppo_iterations"] and ppo_records[0]["lr"] == ppo_lr


def test_run_directories_created_at_once_are_all_distinct(in_tmp, monkeypatch):
    """Eight runs creating their directory at the same moment, under the same name: eight directories."""
    monkeypatch.setattr(M.time, "time", lambda: 1e9)
    args = M.Args()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        created = list(pool.map(M.create_run_dir, [args] * 8))
    assert len({run_dir for _, run_dir in created}) == 8 and len(os.listdir(in_tmp / "runs")) == 8


def test_same_seed_same_run(in_tmp):
    def run(**overrides):  # everything the run reports except the timings
        summary = M.train(M.Args(**MICRO, **overrides))
        summary["histories"] = {beta: [{key: value for key, value in record.items() if key != "eps"}
                                       for record in history] for beta, history in summary["histories"].items()}
        return json.dumps({key: value for key, value in summary.items() if key != "wall_s"}, sort_keys=True)

    first = run()
    assert run() == first
    assert run(seed=2) != first


def check_tensorboard_events(run_dir, betas):
    """Every number of every metrics.jsonl record is a TensorBoard scalar with the documented tag and step, in the
    run directory or, for a sweep's PPO and eval records, in its beta_{beta} subdirectory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = {}
    for subdirectory in [""] + [f"beta_{beta:g}" for beta in betas]:
        accumulator = EventAccumulator(str(run_dir / subdirectory))
        accumulator.Reload()
        events[subdirectory] = {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
                                for tag in accumulator.Tags()["scalars"]}
    step_key = {"sft": "step", "rm": "epoch", "ppo": "episode", "eval": "episode", "bon": "n"}
    records = read_records(run_dir)
    for record in records:
        stage = record["stage"]
        if stage in ("ppo", "eval"):
            scalars = events[f"beta_{record.get('beta', record.get('objective/kl_coef')):g}"]
        else:
            scalars = events[""]
        prefix = "" if stage in ("sft", "rm", "ppo") else stage + "/"
        step = record.get(step_key.get(stage), 0)
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert scalars[prefix + key][step] == pytest.approx(value, rel=1e-6, abs=1e-6), (stage, key)
    for tag in ("sft/loss", "rm/heldout_loss", "rm/heldout_acc", "rm/bias", "bon/gold/score", "summary/wall_s"):
        assert tag in events[""], tag
    for tag in ("objective/kl", "val/var_explained", "ppo/returns/var", "eval/gold/score"):
        assert tag in events[f"beta_{betas[-1]:g}"] and tag not in events[""], tag
    return records


def test_seeds_tool_mean_and_standard_error_and_tensorboard_events_of_each_run(in_tmp, capsys):
    args = rlhf_seeds.SeedsArgs(**MICRO, seeds=(3, 4), sweep=True, sweep_betas=(0.0, 0.05), out="seeds.json",
                                sweep_plot="sweep.png")
    rlhf_seeds.main(args)
    results = json.loads((in_tmp / "seeds.json").read_text())
    golds = [seed["ppo"]["0.05"]["gold/score"] for seed in results["per_seed"]]
    assert len(golds) == 2 and golds[0] != golds[1]
    gold = results["aggregate"]["ppo"]["0.05"]["gold/score"]
    assert gold["mean"] == pytest.approx(sum(golds) / 2) and gold["se"] == pytest.approx(abs(golds[0] - golds[1]) / 2)
    differences = [seed["ppo"]["0.05"]["gold/score"] - seed["bon"][-1]["gold/score"] for seed in results["per_seed"]]
    paired = results["aggregate"]["ppo_minus_best_of_4"]["0.05"]["gold/score"]
    assert paired["mean"] == pytest.approx(sum(differences) / 2)
    assert (in_tmp / "sweep.png").stat().st_size > 10000
    history = [{"objective/kl": 0.5, "gold/score": 1.0}, {"objective/kl": 1.5, "gold/score": 2.0},
               {"objective/kl": 1.2, "gold/score": 3.0}]
    assert rlhf_seeds.gold_at_kl(history, 1.0) == 2.0 and rlhf_seeds.gold_at_kl(history, 2.0) is None
    output = capsys.readouterr().out
    assert "mean ± standard error over 2 seeds" in output and "| PPO, β = 0.05 |" in output
    # each run's TensorBoard events, and the table of docs/rlhf.md documents every metrics.jsonl key
    run_dirs = sorted((in_tmp / "runs").glob("rlhf_sentiment__*"))
    assert len(run_dirs) == 2
    records = check_tensorboard_events(run_dirs[0], (0.0, 0.05))
    assert [record["objective/kl_coef"] for record in records if record["stage"] == "ppo"] == [0.0] * 3 + [0.05] * 3
    documented = set()
    with open(os.path.join(ROOT, "docs", "rlhf.md")) as docs:
        table = docs.read()
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| key"):
            documented.update(name.strip() for name in line.split("|")[1].split(","))
    logged = {key for record in records for key in record}
    assert logged <= documented, logged - documented


def test_sigterm_stops_after_the_current_step_keeps_finished_stages_and_exits_143(tmp_path):
    """A real SIGTERM to a real run: the PPO iteration at hand finishes, the finished stages' checkpoints and the
    PPO policy so far are on disk (no .tmp), the logs are complete, one line says so, and the status is 128 + 15."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in MICRO.items() if key != "ppo_iterations"]
    command = [sys.executable, "-u", os.path.join(ROOT, "ppo_rlhf_toy.py"), *flags, "--ppo-iterations=100000",
               "--save-model"]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if line.startswith("ppo beta=0.05 it 2/"):
                break
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("SIGTERM: stopped during PPO (beta 0.05, iteration ")
    assert "sft.pt, rm.pt, ppo_policy.pt" in last
    (run_dir,) = list((tmp_path / "runs").iterdir())
    files = sorted(os.listdir(run_dir))
    assert [name for name in files if not name.startswith("events.out.tfevents")] == [
        "metrics.jsonl", "ppo_policy.pt", "rm.pt", "sft.pt"]
    assert any(name.startswith("events.out.tfevents") for name in files)
    ppo_records = [record for record in read_records(run_dir) if record["stage"] == "ppo"]
    checkpoint = M.load_checkpoint(str(run_dir / "ppo_policy.pt"), "--load-sft", "cpu")[1]
    assert checkpoint["ppo_iterations_done"] == len(ppo_records) >= 2
    assert M.load_checkpoint(str(run_dir / "rm.pt"), "--load-rm", "cpu")[1]["rm_info"]["rm/epochs"] == 1


def test_a_signal_stops_at_the_next_safe_point_and_a_second_one_at_once_with_one_line(in_tmp, capsys):
    """In one process: a first SIGTERM is only recorded; the next safe point raises Stopped, and leaving the block
    prints one line on what was kept and exits 143 (also after the last stage); a second signal exits at once with
    one line and 128 + its number; the handlers come back and the next run starts with no signal recorded."""
    previous = signal.getsignal(signal.SIGTERM)
    os.mkdir("run")

    def stopped_run(*signals, stage="SFT"):
        with pytest.raises(SystemExit) as stop:
            with M.StopOnSignal(M.Args(save_model=True), "run", M.Logger(M.Args(), "run", "run")) as run:
                M.stop_if_signalled("SFT", 0)  # no signal yet: goes on
                run.save("sft.pt", tiny_checkpoint("unused.pt"))
                for signum in signals:
                    signal.raise_signal(signum)
                if stage is not None:
                    M.stop_if_signalled(stage, 7)
                    raise AssertionError("the safe point did not stop the run")
        assert signal.getsignal(signal.SIGTERM) is previous and not M.SIGNALS_RECEIVED
        return stop.value.code, capsys.readouterr().out.strip().splitlines()[-1]

    assert stopped_run(signal.SIGTERM, stage="the reward model") == (
        143, "SIGTERM: stopped during the reward model; kept in run: metrics.jsonl, TensorBoard events, sft.pt")
    assert stopped_run(signal.SIGINT, stage=None) == (
        130, "SIGINT: stopped during the final evaluation; kept in run: metrics.jsonl, TensorBoard events, sft.pt")
    assert stopped_run(signal.SIGTERM, signal.SIGINT) == (
        130, "SIGINT again: stopped at once; kept in run: metrics.jsonl, TensorBoard events, sft.pt")
    assert os.listdir("run").count("sft.pt") == 1
