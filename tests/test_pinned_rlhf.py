"""Exact tests that pin ppo_rlhf_toy.py's pieces to their definitions, written independently of the script: the
best-of-n baseline by brute force over every subset of its pool, the RL update's whole loss (InstructGPT Eq. 2 with
PPO's clipped surrogate and value loss) by one plain SGD step, what the rollout hands to the update (per-token rewards,
values aligned with the tokens they predict, GAE or the group baselines), the preference labels and the schedules.
A one-line slip in any of them changes a number here far beyond the tolerance."""
import copy
import itertools
import math

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
# Responses of the toy language and their gold scores under its rules (docs/rlhf.md; test_rlhf.py pins judge()).
CATALOGUE = [("was great .", 1.0), ("was not great .", -1.0), ("was great and superb .", 2.0), ("was dull .", -1.0),
             ("is very fun but awful .", 0.0), ("was great and great .", 1.5), ("felt lovely", -1.0),
             ("was great superb .", -2.0)]


def response_row(text, width):
    tokens = [M.TOKEN[word] for word in text.split()]
    return tokens + [M.PAD] * (width - len(tokens))


def test_best_of_n_reports_the_expected_best_of_n_draws_by_brute_force(monkeypatch):
    """best_of_n's rows against the definition: for each prompt's pool of P samples, the mean over every n-subset of
    the pool of the proxy and gold scores of the subset's highest-proxy sample (the one best-of-n returns), averaged
    over the 32 prompts; n = 1, 2, 4, ... up to P, each with the bound log n - (n - 1) / n."""
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
    assert rows[-1]["proxy/score"] > rows[0]["proxy/score"] + 1.0  # the best of 8 is far above one draw
