"""Exact tests that pin ppo_rlhf_toy.py's pieces to their definitions, written independently of the
script: the best-of-n baseline by brute force over every subset of its pool, the RL update's whole
loss (InstructGPT Eq. 2 with PPO's clipped surrogate and value loss) by one plain SGD step, what the
rollout hands to the update (per-token rewards with the KL estimate that --kl-estimator names,
values aligned with the tokens they predict, GAE), the learning-rate schedule, and the preference
labels (the labeller's choice first, in the pairs and in the reward model's loss). A one-line slip
in any of them changes a number here far beyond the tolerance."""
import copy
import dataclasses
import itertools
import math
import types

import pytest
import torch

import ppo_rlhf_toy as M  # the repo root is on sys.path (conftest.py)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest. Restore the test run's setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- best-of-n
# Responses of the toy language and their gold scores under its rules (test_rlhf.py pins judge()).
CATALOGUE = [("was great .", 1.0), ("was not great .", -1.0), ("was great and superb .", 2.0),
             ("was dull .", -1.0), ("is very fun but awful .", 0.0), ("was great and great .", 1.5),
             ("felt lovely", -1.0), ("was great superb .", -2.0)]


def response_row(text, width):
    tokens = [M.TOKEN[word] for word in text.split()]
    return tokens + [M.PAD] * (width - len(tokens))


def test_best_of_n_reports_the_expected_best_of_n_draws_by_brute_force(monkeypatch):
    """best_of_n's rows against the definition: for each prompt's pool of P samples, the mean over
    every n-subset of the pool of the proxy and gold scores of the subset's highest-proxy sample
    (the one best-of-n returns), averaged over the 32 prompts; n = 1, 2, 4, ... up to P, each with
    the bound log n - (n - 1) / n."""
    args = M.Args(bon_pool=8)
    pool_size, prompts = args.bon_pool, 32
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(CATALOGUE), (prompts * pool_size,), generator=generator).tolist()
    proxy = torch.randn(prompts * pool_size, generator=generator)  # distinct: no ties for the best

    def stub_sample(policy, queries, max_new_tokens, temperature):
        assert len(queries) == prompts * pool_size and max_new_tokens == args.max_response_len
        responses = torch.tensor([response_row(CATALOGUE[pick][0], max_new_tokens) for pick in picks])
        return responses, torch.zeros(responses.shape)

    monkeypatch.setattr(M, "sample", stub_sample)
    rows = M.best_of_n(args, None, lambda queries, responses: proxy.clone(), "cpu")

    assert [row["n"] for row in rows] == [1, 2, 4, 8]
    for row in rows:
        n = row["n"]
        best_proxy, best_gold = 0.0, 0.0
        for prompt in range(prompts):
            pool = range(prompt * pool_size, (prompt + 1) * pool_size)
            subsets = list(itertools.combinations(pool, n))
            best = [max(subset, key=lambda i: proxy[i].item()) for subset in subsets]
            best_proxy += sum(proxy[i].item() for i in best) / len(subsets) / prompts
            best_gold += sum(CATALOGUE[picks[i]][1] for i in best) / len(subsets) / prompts
        assert row["proxy/score"] == pytest.approx(best_proxy, abs=1e-9)
        assert row["gold/score"] == pytest.approx(best_gold, abs=1e-9)
        assert row["kl_bound"] == pytest.approx(math.log(n) - (n - 1) / n, abs=1e-12)
    assert rows[-1]["proxy/score"] > rows[0]["proxy/score"] + 1.0  # far above one draw


# ---------------------------------------------------------------- the RL stage: rollout and update
def tiny_models(seed=0):
    torch.manual_seed(seed)
    args = M.Args(d_model=16, n_heads=2, n_layers=1, rollout_batch_size=16, num_minibatches=1, ppo_epochs=1,
                  beta=0.2, gamma=0.95, lam=0.9, vf_coef=0.37, clip_coef=0.1, clip_coef_value=0.15,
                  max_grad_norm=math.inf)
    policy = M.make_model(args, len(M.VOCAB))
    ref = M.make_model(args, len(M.VOCAB)).requires_grad_(False)
    critic = M.make_model(args, 1)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(args.rollout_batch_size, generator=generator)
    rl = M.RLSetup(policy=policy, ref_policy=ref, critic=critic, score_fn=lambda queries, responses: scores.clone(),
                   sample_prompts=lambda count: M.random_prompts(count, "cpu"))
    return args, rl, scores


def response_lengths(responses):
    """Tokens up to and including the first EOS (all of them without one)."""
    return [row.index(M.EOS) + 1 if M.EOS in row else len(row) for row in responses.tolist()]


def test_rollout_hands_the_update_instructgpts_rewards_and_gae_on_aligned_tokens():
    """collect_rollout against the definitions, token by token in float64: log pi(y_t | x, y_<t) and
    V(x, y_<t) each from a forward pass on the prefix alone; the reward -beta (log pi - log pi_ref)
    on every response token, plus the score on the last (InstructGPT Eq. 2); GAE summed over the
    response (V = 0 after it); the advantages whitened over the response tokens (population
    variance), the returns A + V."""
    args, rl, scores = tiny_models()
    queries = M.random_prompts(args.rollout_batch_size, "cpu")
    batch = M.collect_rollout(rl, queries, args.beta, args)
    lengths = response_lengths(batch["responses"])
    assert min(lengths) < args.max_response_len  # some responses end early: the mask matters
    advantages, returns, values = {}, {}, {}
    with torch.no_grad():
        for row, length in enumerate(lengths):
            rewards = []
            for t in range(length):
                prefix = torch.cat([queries[row], batch["responses"][row, :t]])[None]
                token = batch["responses"][row, t]
                log_pi = torch.log_softmax(rl.policy(prefix)[0, -1].double() / args.temperature, -1)[token]
                log_ref = torch.log_softmax(rl.ref_policy(prefix)[0, -1].double() / args.temperature, -1)[token]
                values[row, t] = rl.critic(prefix)[0, -1].item()
                assert batch["logp"][row, t].item() == pytest.approx(log_pi.item(), abs=1e-5)
                rewards.append(-args.beta * (log_pi - log_ref).item() + (scores[row].item() if t == length - 1 else 0))
            for t in range(length):
                advantage = sum((args.gamma * args.lam) ** (k - t) * (
                    rewards[k] + args.gamma * (values[row, k + 1] if k + 1 < length else 0.0) - values[row, k])
                    for k in range(t, length))
                advantages[row, t], returns[row, t] = advantage, advantage + values[row, t]
    mean = sum(advantages.values()) / len(advantages)
    std = math.sqrt(sum((a - mean) ** 2 for a in advantages.values()) / len(advantages))
    mask = batch["mask"]
    assert mask.sum().item() == len(advantages) and (batch["rewards"] * (1 - mask)).abs().max() == 0
    for (row, t), advantage in advantages.items():
        assert batch["values"][row, t].item() == pytest.approx(values[row, t], abs=1e-5)
        assert batch["returns"][row, t].item() == pytest.approx(returns[row, t], abs=1e-4)
        assert batch["advantages"][row, t].item() == pytest.approx((advantage - mean) / std, abs=1e-4)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_rollout_rewards_penalise_the_kl_estimate_that_the_flag_names(estimator):
    """--kl-estimator picks the per-token KL(pi || pi_ref) that the reward penalises (Schulman,
    "Approximating KL"), token by token in float64 from passes on each prefix alone: k1 = log p -
    log q, k3 = q / p - 1 - log(q / p), p = pi(y_t | x, y_<t), q = pi_ref(y_t | x, y_<t); the
    reward -beta KL_t on every response token, plus the score on the last. On these untrained
    models the two estimates differ by far more than the tolerance."""
    args, rl, scores = tiny_models(seed=3)
    args = dataclasses.replace(args, kl_estimator=estimator)
    queries = M.random_prompts(args.rollout_batch_size, "cpu")
    batch = M.collect_rollout(rl, queries, args.beta, args)
    gaps = []
    with torch.no_grad():
        for row, length in enumerate(response_lengths(batch["responses"])):
            for t in range(length):
                prefix = torch.cat([queries[row], batch["responses"][row, :t]])[None]
                token = batch["responses"][row, t]
                p = torch.softmax(rl.policy(prefix)[0, -1].double() / args.temperature, -1)[token].item()
                q = torch.softmax(rl.ref_policy(prefix)[0, -1].double() / args.temperature, -1)[token].item()
                k1, k3 = math.log(p) - math.log(q), q / p - 1 - math.log(q / p)
                kl = k1 if estimator == "k1" else k3
                reward = -args.beta * kl + (scores[row].item() if t == length - 1 else 0.0)
                assert batch["kl"][row, t].item() == pytest.approx(kl, abs=1e-5)
                assert batch["rewards"][row, t].item() == pytest.approx(reward, abs=1e-5)
                gaps.append(abs(k1 - k3))
    assert max(gaps) > 0.1  # the other estimator would be seen at once


def test_update_takes_the_sgd_step_of_the_clipped_surrogate_plus_the_value_loss():
    """One minibatch, one epoch, plain SGD on policy and critic together: the weights move exactly
    as on the loss written per token in float64, -min(r A, clip(r, 1 - eps, 1 + eps) A) + c_V 1/2
    max((V - R)^2, (V_clip - R)^2) as masked means over the response tokens. pi_old and the
    rollout's values are moved away from the current ones, so that both clips bite; c_V is away from
    its default."""
    args, rl, _ = tiny_models(seed=1)
    batch = M.collect_rollout(rl, M.random_prompts(args.rollout_batch_size, "cpu"), args.beta, args)
    generator = torch.Generator().manual_seed(2)
    mask = batch["mask"]
    batch["logp"] = (batch["logp"] + 0.2 * torch.randn(mask.shape, generator=generator)) * mask
    batch["values"] = (batch["values"] + 0.3 * torch.randn(mask.shape, generator=generator)) * mask
    reference = copy.deepcopy(rl)
    lr = 0.05
    M.ppo_update(rl, torch.optim.SGD([*rl.policy.parameters(), *rl.critic.parameters()], lr=lr), batch, args,
                 args.beta)

    queries, responses = batch["queries"], batch["responses"]
    tokens = torch.cat([queries, responses], 1)
    logits = reference.policy(tokens)
    values = reference.critic(tokens)
    policy_terms, value_terms = [], []
    for row, length in enumerate(response_lengths(responses)):
        for t in range(length):
            position = queries.shape[1] - 1 + t  # its output predicts response token t
            log_pi = torch.log_softmax(logits[row, position].double() / args.temperature, -1)[responses[row, t]]
            ratio = torch.exp(log_pi - batch["logp"][row, t].double())
            advantage = batch["advantages"][row, t].double()
            clipped = torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            policy_terms.append(-torch.minimum(ratio * advantage, clipped * advantage))
            value, old_value = values[row, position].double(), batch["values"][row, t].double()
            target = batch["returns"][row, t].double()
            clipped_value = old_value + torch.clamp(value - old_value, -args.clip_coef_value, args.clip_coef_value)
            value_terms.append(0.5 * torch.maximum((value - target) ** 2, (clipped_value - target) ** 2))
    loss = sum(policy_terms) / len(policy_terms) + args.vf_coef * sum(value_terms) / len(value_terms)
    params = [*reference.policy.parameters(), *reference.critic.parameters()]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    moved = [*rl.policy.parameters(), *rl.critic.parameters()]
    largest = max(grad.abs().max().item() for grad in grads if grad is not None) * lr
    assert largest > 1e-4
    for param, grad, after in zip(params, grads, moved):
        step = torch.zeros_like(param) if grad is None else -lr * grad
        torch.testing.assert_close(after.detach() - param.detach(), step, rtol=1e-3, atol=1e-3 * largest)


def test_rl_learning_rate_falls_linearly_to_zero_over_the_iterations():
    """As OAI: iteration i of N steps at ppo_lr (1 - (i - 1) / N), in the optimizer the update steps
    with."""
    args, rl, _ = tiny_models()
    args = dataclasses.replace(args, ppo_iterations=4, ppo_lr=2e-3)
    used = []
    update = M.ppo_update

    def recording(rl, optimizer, batch, args, beta):
        used.append(optimizer.param_groups[0]["lr"])
        return update(rl, optimizer, batch, args, beta)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(M, "ppo_update", recording)
        history = M.run_ppo(args, rl, args.beta)
    expected = [2e-3, 1.5e-3, 1e-3, 0.5e-3]
    assert used == pytest.approx(expected, rel=1e-12) and [r["lr"] for r in history] == pytest.approx(expected)


# ---------------------------------------------------------------- preferences and the reward model
def catalogue_pairs(count, seed):
    """`count` pairs of indices of catalogue responses that end with EOS, of distinct gold scores."""
    generator = torch.Generator().manual_seed(seed)
    picks = []
    while len(picks) < count:
        first, second = torch.randint(0, len(CATALOGUE), (2,), generator=generator).tolist()
        ends = "." in CATALOGUE[first][0] and "." in CATALOGUE[second][0]
        if ends and CATALOGUE[first][1] != CATALOGUE[second][1]:
            picks.append((first, second))
    return picks


@pytest.mark.parametrize("label_noise", [1e-4, 0.7], ids=["noiseless", "noisy"])
def test_preference_pairs_put_the_labellers_choice_first(label_noise, monkeypatch):
    """make_preference_pairs against its definition: each pair is its prompt's two SFT samples, the
    first chosen with p = sigmoid((r*(a) - r*(b)) / tau) (tau = --label-noise). Whatever the draw,
    the chosen and rejected sentences are the pair's two, gold_margin = r*(chosen) - r*(rejected)
    and the label's probability of being right is sigmoid(|r*(a) - r*(b)| / tau); with tau near 0
    the gold-better response is always chosen. A pair with a response lacking EOS is dropped."""
    torch.manual_seed(0)  # the prompts and the labeller's draws
    args = M.Args(num_pairs=24, label_noise=label_noise)
    picks = catalogue_pairs(args.num_pairs, seed=3)
    width = args.max_response_len
    rows = [response_row(CATALOGUE[pick][0], width) for pair in picks for pick in pair]
    rows[5] = [M.TOKEN["was"]] + [M.TOKEN["great"]] * (width - 1)  # pair 2's second: no EOS
    seen = {}

    def stub_sample(policy, queries, max_new_tokens, temperature):
        assert temperature == 1.0 and len(queries) == 2 * args.num_pairs
        seen["queries"] = queries
        return torch.tensor(rows), torch.zeros(len(rows), width)

    monkeypatch.setattr(M, "sample", stub_sample)
    chosen, rejected, gold_margin, p_label = M.make_preference_pairs(args, None, "cpu")

    kept = [pair for pair in range(args.num_pairs) if pair != 2]
    assert len(chosen) == len(rejected) == len(gold_margin) == len(p_label) == len(kept)
    queries = seen["queries"].tolist()
    for i, pair in enumerate(kept):
        first, second = (queries[2 * pair + k] + rows[2 * pair + k] for k in (0, 1))
        gold_first, gold_second = (CATALOGUE[pick][1] for pick in picks[pair])
        chosen_row, rejected_row = chosen[i].tolist(), rejected[i].tolist()
        assert (chosen_row, rejected_row) in ((first, second), (second, first))
        gold_chosen, gold_rejected = gold_first, gold_second
        if chosen_row == second:
            gold_chosen, gold_rejected = gold_second, gold_first
        assert gold_margin[i].item() == pytest.approx(gold_chosen - gold_rejected, abs=1e-6)
        right = 1 / (1 + math.exp(-abs(gold_first - gold_second) / label_noise))
        assert p_label[i].item() == pytest.approx(right, rel=1e-5)
        if label_noise < 0.01:
            assert gold_chosen > gold_rejected
    if label_noise > 0.01:  # both orders occur, the labeller errs sometimes
        assert 0 < (gold_margin < 0).sum() < len(kept) / 2


def test_reward_model_trains_on_the_chosen_response_first_pair_by_pair(monkeypatch):
    """train_reward_model's loss is InstructGPT Eq. 1's -log sigma(r(x, y_w) - r(x, y_l)): every
    Bradley-Terry call, training and held-out, takes the RM's score of chosen responses first and of
    the rejected responses of the same pairs second, row by row."""
    torch.manual_seed(0)  # the prompts, the RM's head and its shuffles
    args = M.Args(d_model=16, n_heads=2, n_layers=1, num_pairs=30, rm_epochs=2, rm_lr=1e-3)
    picks = catalogue_pairs(args.num_pairs, seed=4)
    width = args.max_response_len
    queries = M.random_prompts(args.num_pairs, "cpu")
    chosen, rejected = (torch.cat([queries, torch.tensor([response_row(CATALOGUE[pair[k]][0], width)
                                                          for pair in picks])], 1) for k in (0, 1))
    pairs = (chosen, rejected, torch.ones(args.num_pairs), torch.full((args.num_pairs,), 0.9))
    scores, calls = [], []
    score_at_eos, bradley_terry_loss = M.score_at_eos, M.bradley_terry_loss

    def recorded_score(per_token_scores, tokens):
        scores.append((score_at_eos(per_token_scores, tokens), tokens))
        return scores[-1][0]

    def recorded_loss(r_chosen, r_rejected):
        calls.append((r_chosen, r_rejected))
        return bradley_terry_loss(r_chosen, r_rejected)

    def stub_sample(policy, queries, max_new_tokens, temperature):  # the RM's normalization samples
        return torch.tensor([response_row(CATALOGUE[0][0], max_new_tokens)] * len(queries)), None

    monkeypatch.setattr(M, "score_at_eos", recorded_score)
    monkeypatch.setattr(M, "bradley_terry_loss", recorded_loss)
    monkeypatch.setattr(M, "sample", stub_sample)
    run = types.SimpleNamespace(args=args, device=torch.device("cpu"), log=lambda *arguments: None)
    M.train_reward_model(run, M.make_model(args, len(M.VOCAB)), pairs)

    def tokens_of(reward):
        (tokens,) = [tokens for score, tokens in scores if score is reward]
        return tokens.tolist()

    labelled = set(zip(map(tuple, chosen.tolist()), map(tuple, rejected.tolist())))
    assert len(calls) >= 2 * args.rm_epochs  # each epoch: training steps and the held-out loss
    for r_chosen, r_rejected in calls:
        for chosen_row, rejected_row in zip(tokens_of(r_chosen), tokens_of(r_rejected)):
            assert (tuple(chosen_row), tuple(rejected_row)) in labelled
