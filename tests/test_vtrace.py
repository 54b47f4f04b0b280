"""Numerical tests of the V-trace function in vtrace.py.

Ground truth is written here, independently of vtrace.py, from the definitions (IMPALA paper Eq. 1 as a naive
float64 double sum, the n-step return, GAE), plus golden numbers: the test cases of deepmind/scalable_agent's and
google-deepmind/rlax's V-trace tests and hand-derived values, each recomputed from the definitions in float64.
"""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vtrace  # noqa: E402

torch.set_num_threads(1)

F64_TOL = dict(rtol=1e-10, atol=1e-10)
F32_TOL = dict(rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Independent references (numpy, float64)
# ---------------------------------------------------------------------------------------------------------------
def naive_vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar=1.0, c_bar=1.0, pg_bar=1.0, lam=1.0):
    """v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) delta_t, straight from the definition (Eq. 1);
    pg_s = min(pg_bar, rho_s) (r_s + gamma_s v_{s+1} - V(x_s)) with v_T := bootstrap. A threshold None = no clip."""
    values = np.asarray(values, np.float64)
    shape = values.shape
    log_rhos, discounts, rewards, lam = (np.broadcast_to(np.asarray(x, np.float64), shape)
                                         for x in (log_rhos, discounts, rewards, lam))
    bootstrap = np.asarray(bootstrap, np.float64)
    rho = np.exp(log_rhos)
    rho_clipped = rho if rho_bar is None else np.minimum(rho_bar, rho)
    c = lam * (rho if c_bar is None else np.minimum(c_bar, rho))
    rho_pg = rho if pg_bar is None else np.minimum(pg_bar, rho)
    T = shape[0]
    next_values = [values[t + 1] if t + 1 < T else bootstrap for t in range(T)]
    vs = np.zeros(shape)
    for s in range(T):
        vs[s] = values[s]
        for t in range(s, T):
            weight = np.ones(shape[1:])
            for i in range(s, t):
                weight = weight * discounts[i] * c[i]
            delta_t = rho_clipped[t] * (rewards[t] + discounts[t] * next_values[t] - values[t])
            vs[s] = vs[s] + weight * delta_t
    next_vs = np.concatenate([vs[1:], bootstrap[None]], axis=0)
    pg = rho_pg * (rewards + discounts * next_vs - values)
    return vs, pg


def gae(rewards, values, bootstrap, discounts, lam):
    """Generalized advantage estimation (Schulman et al. 2016), its usual backward loop."""
    T = len(rewards)
    adv, last = np.zeros_like(values, dtype=np.float64), 0.0
    for t in reversed(range(T)):
        next_value = bootstrap if t == T - 1 else values[t + 1]
        delta = rewards[t] + discounts[t] * next_value - values[t]
        last = delta + discounts[t] * lam * last
        adv[t] = last
    return adv


def n_step_return(rewards, bootstrap, discounts):
    ret, out = np.asarray(bootstrap, np.float64), np.zeros(np.shape(rewards))
    for t in reversed(range(len(rewards))):
        ret = rewards[t] + discounts[t] * ret
        out[t] = ret
    return out


def log_softmax_np(logits):
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def three_action_p_with_entropy(h):
    """p in [1/3, 1) such that the distribution [p, (1-p)/2, (1-p)/2] has entropy h (< log 3), by bisection;
    the entropy decreases in p on that interval."""
    lo, hi = 1 / 3, 1 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        if -mid * np.log(mid) - (1 - mid) * np.log((1 - mid) / 2) > h:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def run_vtrace(log_rhos, discounts, rewards, values, bootstrap, dtype=torch.float64, **kw):
    """Call vtrace.from_importance_weights on numpy inputs; returns numpy (vs, pg)."""
    t = lambda x: torch.as_tensor(np.asarray(x, np.float64), dtype=dtype)  # noqa: E731
    if torch.is_tensor(kw.get("lambda_")) or isinstance(kw.get("lambda_"), np.ndarray):
        kw["lambda_"] = t(kw["lambda_"])
    out = vtrace.from_importance_weights(t(log_rhos), t(discounts), t(rewards), t(values), t(bootstrap), **kw)
    assert isinstance(out, vtrace.VTraceReturns)
    assert out.vs.dtype == dtype and out.pg_advantages.dtype == dtype
    return out.vs.double().numpy(), out.pg_advantages.double().numpy()


def case1_inputs(B, T=5):
    """scalable_agent test_vtrace inputs (reference case 1)."""
    n = T * B
    return dict(log_rhos=(5 * (np.arange(n) / n - 0.5)).reshape(T, B),
                discounts=np.array([[0.9 / (b + 1) for b in range(B)] for _ in range(T)]),
                rewards=np.arange(n, dtype=np.float64).reshape(T, B),
                values=(np.arange(n) / B).reshape(T, B),
                bootstrap=np.arange(B, dtype=np.float64) + 1)


def random_inputs(rng, T, B, extra=(), log_rho_scale=1.5):
    shape = (T, B) + tuple(extra)
    discounts = rng.uniform(0.5, 1.0, shape) * (rng.uniform(size=shape) > 0.2)  # some episode ends
    return dict(log_rhos=rng.normal(0, log_rho_scale, shape), discounts=discounts,
                rewards=rng.normal(0, 1, shape), values=rng.normal(0, 1, shape),
                bootstrap=rng.normal(0, 1, shape[1:]))


# Case 4/5/6/8 example: T=3, B=1.
R3, V3, BOOT3 = np.array([[1.0], [0.0], [2.0]]), np.array([[0.5], [0.2], [0.1]]), np.array([1.0])
G3 = np.full((3, 1), 0.9)
LOG_RHO3 = np.log(np.array([[3.0], [0.5], [1.5]]))


# ---------------------------------------------------------------------------------------------------------------
# 1. Naive-definition equivalence
# ---------------------------------------------------------------------------------------------------------------
CASE1_GOLDEN = {
    1: (np.array([[0.200182], [2.709682], [8.513628], [11.932397], [7.33]]),
        np.array([[0.200182], [1.709682], [6.513628], [10.876614], [1.98]])),
    5: (np.array([[0.929816, 0.556437, 0.816895, 1.189767, 1.654995],
                  [12.58608, 6.122604, 6.014773, 6.858315, 8.223335],
                  [53.250231, 29.472213, 27.545145, 29.03719, 31.861155],
                  [84.997052, 62.252527, 60.632278, 66.036553, 76.130182],
                  [66.53, 69.69, 72.85, 76.01, 79.17]]),
        np.array([[0.929816, 0.356437, 0.416895, 0.589767, 0.854995],
                  [11.58608, 4.922604, 4.614773, 5.258315, 6.423335],
                  [51.250231, 27.272213, 25.145145, 27.914655, 33.616118],
                  [118.505139, 88.928326, 78.001, 69.30495, 64.79132],
                  [37.18, 38.94, 40.7, 42.46, 44.22]])),
}


@pytest.mark.parametrize("B", [1, 5])
def test_case1_golden_and_naive(B):
    inp = case1_inputs(B)
    clips = dict(clip_rho_threshold=3.7, clip_pg_rho_threshold=2.2)  # c_bar = 1 (default)
    ref_vs, ref_pg = naive_vtrace(**inp, rho_bar=3.7, c_bar=1.0, pg_bar=2.2)
    gold_vs, gold_pg = CASE1_GOLDEN[B]
    # the ground truth itself reproduces the golden numbers (printed to 6 decimals)
    np.testing.assert_allclose(ref_vs, gold_vs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ref_pg, gold_pg, rtol=1e-6, atol=1e-6)
    vs, pg = run_vtrace(**inp, **clips)
    np.testing.assert_allclose(vs, ref_vs, **F64_TOL)
    np.testing.assert_allclose(pg, ref_pg, **F64_TOL)
    vs32, pg32 = run_vtrace(**inp, dtype=torch.float32, **clips)
    np.testing.assert_allclose(vs32, ref_vs, **F32_TOL)
    np.testing.assert_allclose(pg32, ref_pg, **F32_TOL)


CLIP_CHOICES = [None, 0.5, 1.0, 2.2, 3.7]


@pytest.mark.parametrize("T", [1, 2, 20])
@pytest.mark.parametrize("B", [1, 7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_against_naive_double_sum(T, B, seed):
    rng = np.random.default_rng(1000 * seed + 10 * T + B)
    inp = random_inputs(rng, T, B)
    rho_bar, c_bar, pg_bar = (CLIP_CHOICES[i] for i in rng.integers(len(CLIP_CHOICES), size=3))
    # scalar lambda, or a per-step lambda tensor (seed 2) including exact zeros
    lam = rng.uniform(0, 1, (T, B)) * (rng.uniform(size=(T, B)) > 0.2) if seed == 2 else float(rng.uniform(0.3, 1))
    ref_vs, ref_pg = naive_vtrace(**inp, rho_bar=rho_bar, c_bar=c_bar, pg_bar=pg_bar, lam=lam)
    kw = dict(clip_rho_threshold=rho_bar, clip_c_threshold=c_bar, clip_pg_rho_threshold=pg_bar, lambda_=lam)
    vs, pg = run_vtrace(**inp, **kw)
    scale = max(1.0, np.abs(ref_vs).max(), np.abs(ref_pg).max())
    np.testing.assert_allclose(vs, ref_vs, rtol=1e-10, atol=1e-10 * scale)
    np.testing.assert_allclose(pg, ref_pg, rtol=1e-10, atol=1e-10 * scale)
    vs32, pg32 = run_vtrace(**inp, dtype=torch.float32, **kw)
    np.testing.assert_allclose(vs32, ref_vs, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(pg32, ref_pg, rtol=1e-5, atol=1e-5 * scale)


# ---------------------------------------------------------------------------------------------------------------
# 2. from_logits consistency
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B", [1, 2])
def test_action_log_probs_golden(B):
    T, A = 7, 3
    logits = np.arange(T * B * A, dtype=np.float64).reshape(T, B, A) + 10
    actions = np.random.default_rng(B).integers(0, A, size=(T, B))
    out = vtrace.action_log_probs(torch.tensor(logits), torch.tensor(actions))
    assert out.shape == (T, B)
    golden = np.array([-2.407606, -1.407606, -0.407606])[actions]  # every row is [x, x+1, x+2]
    np.testing.assert_allclose(out.numpy(), golden, rtol=1e-6)
    np.testing.assert_allclose(out.numpy(), np.log(np.exp(logits) / np.exp(logits).sum(-1, keepdims=True))
                               [np.arange(T)[:, None], np.arange(B)[None], actions], **F64_TOL)


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("clips", [(None, None, None), (1.0, 1.0, 1.0), (3.7, 1.0, 2.2)])
def test_from_logits_consistency(B, clips):
    T, A = 5, 3
    rng = np.random.default_rng(B)
    mu_logits, pi_logits = rng.normal(0, 2, (T, B, A)), rng.normal(0, 2, (T, B, A))  # different policies
    actions = rng.integers(0, A, (T, B))
    inp = random_inputs(rng, T, B)
    kw = dict(clip_rho_threshold=clips[0], clip_c_threshold=clips[1], clip_pg_rho_threshold=clips[2], lambda_=0.9)
    t = torch.tensor
    out = vtrace.from_logits(t(mu_logits), t(pi_logits), t(actions), t(inp["discounts"]), t(inp["rewards"]),
                             t(inp["values"]), t(inp["bootstrap"]), **kw)
    assert isinstance(out, vtrace.VTraceFromLogitsReturns)
    idx = (np.arange(T)[:, None], np.arange(B)[None], actions)
    log_mu, log_pi = log_softmax_np(mu_logits)[idx], log_softmax_np(pi_logits)[idx]
    np.testing.assert_allclose(out.behaviour_action_log_probs.numpy(), log_mu, **F64_TOL)
    np.testing.assert_allclose(out.target_action_log_probs.numpy(), log_pi, **F64_TOL)
    np.testing.assert_allclose(out.log_rhos.numpy(), log_pi - log_mu, **F64_TOL)
    assert np.abs(log_pi - log_mu).max() > 0.5  # really off-policy
    # == from_importance_weights(log pi - log mu) == the naive sum with rho = pi(a)/mu(a) from plain softmax
    vs, pg = run_vtrace(log_pi - log_mu, inp["discounts"], inp["rewards"], inp["values"], inp["bootstrap"], **kw)
    np.testing.assert_allclose(out.vs.numpy(), vs, **F64_TOL)
    np.testing.assert_allclose(out.pg_advantages.numpy(), pg, **F64_TOL)
    softmax = lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)  # noqa: E731
    ratio = softmax(pi_logits)[idx] / softmax(mu_logits)[idx]
    ref_vs, ref_pg = naive_vtrace(np.log(ratio), inp["discounts"], inp["rewards"], inp["values"], inp["bootstrap"],
                                  *clips, lam=0.9)
    np.testing.assert_allclose(out.vs.numpy(), ref_vs, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.pg_advantages.numpy(), ref_pg, rtol=1e-9, atol=1e-9)


def test_from_logits_on_policy_has_zero_log_rhos():
    T, B, A = 5, 2, 3
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.normal(0, 2, (T, B, A)))
    actions = torch.tensor(rng.integers(0, 2, (T, B)))  # scalable_agent: actions in {0, 1}
    inp = {k: torch.tensor(v) for k, v in random_inputs(rng, T, B).items()}
    out = vtrace.from_logits(logits, logits.clone(), actions, inp["discounts"], inp["rewards"], inp["values"],
                             inp["bootstrap"], clip_rho_threshold=None, clip_c_threshold=None,
                             clip_pg_rho_threshold=None)
    assert torch.equal(out.log_rhos, torch.zeros(T, B, dtype=torch.float64))
    ref_vs, ref_pg = naive_vtrace(np.zeros((T, B)), *(inp[k].numpy() for k in
                                  ("discounts", "rewards", "values", "bootstrap")), None, None, None)
    np.testing.assert_allclose(out.vs.numpy(), ref_vs, **F64_TOL)
    np.testing.assert_allclose(out.pg_advantages.numpy(), ref_pg, **F64_TOL)


# ---------------------------------------------------------------------------------------------------------------
# 3. rlax golden case (batch-major [B=2, T=4] in rlax, transposed to time-major here)
# ---------------------------------------------------------------------------------------------------------------
def test_rlax_golden():
    mu = np.array([[[8.9, 0.7], [5.0, 1.0], [0.6, 0.1], [-0.9, -0.1]],
                   [[0.3, -5.0], [1.0, -8.0], [0.3, 1.7], [4.7, 3.3]]])
    pi = np.array([[[0.4, 0.5], [9.2, 8.8], [0.7, 4.4], [7.9, 1.4]],
                   [[1.0, 0.9], [1.0, -1.0], [-4.3, 8.7], [0.8, 0.3]]])
    actions = np.array([[0, 1, 0, 0], [1, 0, 0, 1]])
    rewards = np.array([[-1.3, -1.3, 2.3, 42.0], [1.3, 5.3, -3.3, -5.0]])
    discounts = np.array([[0, 0.89, 0.85, 0.99], [0.88, 1, 0.83, 0.95]])
    values = np.array([[2.1, 1.1, -3.1, 0], [3.1, 0.1, -1.1, 7.4]])
    bootstrap = np.array([8.4, -1.2])
    t = lambda x: torch.tensor(x).transpose(0, 1).contiguous()  # noqa: E731  [B, T, ...] -> [T, B, ...]
    out = vtrace.from_logits(t(mu), t(pi), t(actions), t(discounts), t(rewards), t(values), torch.tensor(bootstrap))
    ratios = np.array([[0.475151, 22.312224, 0.038761, 3.220699], [95.639175, 0.880906, 0.000011, 1.908544]])
    np.testing.assert_allclose(out.log_rhos.exp().numpy().T, ratios, rtol=1e-5, atol=1e-6)
    expected = np.array([[-1.61551, -3.49732, 1.86705, 50.316], [1.46624, 3.61164, -8.33e-5, -13.54]])
    td = (out.vs.numpy() - t(values).numpy()).T
    np.testing.assert_allclose(td, expected, rtol=1e-3)
    np.testing.assert_allclose(out.pg_advantages.numpy().T, expected, rtol=1e-3)
    np.testing.assert_allclose(td[1, 2], -8.33692e-5, rtol=1e-5)  # float64 value of rlax's float32 entry
    ref_vs, ref_pg = naive_vtrace(out.log_rhos.numpy(), t(discounts).numpy(), t(rewards).numpy(),
                                  t(values).numpy(), bootstrap)
    np.testing.assert_allclose(out.vs.numpy(), ref_vs, **F64_TOL)
    np.testing.assert_allclose(out.pg_advantages.numpy(), ref_pg, **F64_TOL)


# ---------------------------------------------------------------------------------------------------------------
# 4. On-policy reductions (log rho = 0)
# ---------------------------------------------------------------------------------------------------------------
def test_on_policy_lambda1_is_n_step_return():
    vs, pg = run_vtrace(np.zeros((3, 1)), G3, R3, V3, BOOT3)
    np.testing.assert_allclose(vs[:, 0], [3.349, 2.61, 2.9], rtol=1e-12)
    np.testing.assert_allclose(pg[:, 0], [2.849, 2.41, 2.8], rtol=1e-12)
    np.testing.assert_allclose(vs, n_step_return(R3, BOOT3, G3), rtol=1e-14)


def test_on_policy_lambda_is_gae_and_seed_pg():
    vs, pg = run_vtrace(np.zeros((3, 1)), G3, R3, V3, BOOT3, lambda_=0.95)
    gae_ref = gae(R3, V3, BOOT3, G3, 0.95)
    np.testing.assert_allclose(gae_ref[:, 0], [2.63282, 2.284, 2.8], rtol=1e-12)
    np.testing.assert_allclose(vs - V3, gae_ref, rtol=1e-13, atol=1e-14)
    # SEED convention: the pg target keeps v_{s+1}, so pg != GAE(lambda) when lambda < 1
    np.testing.assert_allclose(pg[:, 0], [2.7356, 2.41, 2.8], rtol=1e-12)
    assert abs(pg[0, 0] - gae_ref[0, 0]) > 0.1


@pytest.mark.parametrize("lam", [1.0, 0.95, 0.5, 0.0])
def test_on_policy_random_with_episode_ends_is_gae(lam):
    rng = np.random.default_rng(7)
    inp = random_inputs(rng, 20, 7)
    vs, pg = run_vtrace(np.zeros((20, 7)), inp["discounts"], inp["rewards"], inp["values"], inp["bootstrap"],
                        lambda_=lam)
    gae_ref = gae(inp["rewards"], inp["values"], inp["bootstrap"], inp["discounts"], lam)
    np.testing.assert_allclose(vs - inp["values"], gae_ref, rtol=1e-12, atol=1e-12)
    if lam == 1.0:
        np.testing.assert_allclose(pg, gae_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(vs, n_step_return(inp["rewards"], inp["bootstrap"], inp["discounts"]),
                                   rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# 5. Identity pg == vs - V at clips 1, lambda 1 (even off-policy), and its failure at rho_bar = 2
# ---------------------------------------------------------------------------------------------------------------
def test_identity_pg_equals_vs_minus_v_at_clips_one():
    vs, pg = run_vtrace(LOG_RHO3, G3, R3, V3, BOOT3)
    np.testing.assert_allclose((vs - V3)[:, 0], [1.7645, 1.205, 2.8], rtol=1e-12)
    np.testing.assert_allclose(pg, vs - V3, rtol=1e-14, atol=1e-14)
    rng = np.random.default_rng(3)
    inp = random_inputs(rng, 20, 7)
    vs, pg = run_vtrace(**inp)
    np.testing.assert_allclose(pg, vs - inp["values"], rtol=1e-12, atol=1e-12)


def test_identity_fails_at_rho_bar_two():
    vs, pg = run_vtrace(LOG_RHO3, G3, R3, V3, BOOT3, clip_rho_threshold=2.0, clip_pg_rho_threshold=2.0)
    np.testing.assert_allclose((vs - V3)[:, 0], [3.0115, 1.835, 4.2], rtol=1e-12)
    np.testing.assert_allclose(pg[:, 0], [4.663, 1.835, 4.2], rtol=1e-12)
    assert abs(pg[0, 0] - (vs - V3)[0, 0]) > 1.0


# ---------------------------------------------------------------------------------------------------------------
# 6. lambda-q identity (rlax test_lambda_q_estimate): vs = V + min(rho_bar, rho) (q - V) iff rho_bar == c_bar
# ---------------------------------------------------------------------------------------------------------------
def rlax_q(vs, rewards, discounts, values, bootstrap, lam):
    next_vs = np.concatenate([vs[1:], bootstrap[None]])
    next_values = np.concatenate([values[1:], bootstrap[None]])
    return rewards + discounts * (lam * next_vs + (1 - lam) * next_values)


def test_lambda_q_identity_golden():
    vs, pg = run_vtrace(LOG_RHO3, G3, R3, V3, BOOT3, lambda_=0.8)
    q = rlax_q(vs, R3, G3, V3, BOOT3, 0.8)
    np.testing.assert_allclose(vs[:, 0], [1.86616, 1.153, 2.9], rtol=1e-12)
    np.testing.assert_allclose(q[:, 0], [1.86616, 2.106, 2.9], rtol=1e-12)
    rho = np.exp(LOG_RHO3)
    np.testing.assert_allclose(vs, V3 + np.minimum(1.0, rho) * (q - V3), rtol=1e-13)
    np.testing.assert_allclose((np.minimum(1.0, rho) * (q - V3))[:, 0], [1.36616, 0.953, 2.8], rtol=1e-12)  # rlax pg
    assert abs(pg[1, 0] - 0.953) > 0.1  # SEED pg uses v_{s+1}, not rlax's q


@pytest.mark.parametrize("rho_bar,c_bar,holds", [(1.0, 1.0, True), (1.5, 1.5, True), (2.0, 1.0, False)])
def test_lambda_q_identity_random(rho_bar, c_bar, holds):
    inp = random_inputs(np.random.default_rng(5), 20, 7)
    vs, _ = run_vtrace(**inp, clip_rho_threshold=rho_bar, clip_c_threshold=c_bar, lambda_=0.8)
    q = rlax_q(vs, inp["rewards"], inp["discounts"], inp["values"], inp["bootstrap"], 0.8)
    rhs = inp["values"] + np.minimum(rho_bar, np.exp(inp["log_rhos"])) * (q - inp["values"])
    assert np.allclose(vs, rhs, rtol=1e-12, atol=1e-12) == holds


# ---------------------------------------------------------------------------------------------------------------
# 7. Episode split
# ---------------------------------------------------------------------------------------------------------------
def split_run(inp, k, boot_first, **kw):
    """V-trace run separately on steps [0:k] (bootstrap boot_first) and [k:T]."""
    first = {n: v[:k] for n, v in inp.items() if n != "bootstrap"}
    second = {n: v[k:] for n, v in inp.items() if n != "bootstrap"}
    lam = kw.pop("lambda_", 1.0)
    lam1, lam2 = (lam[:k], lam[k:]) if isinstance(lam, np.ndarray) else (lam, lam)
    vs1, pg1 = run_vtrace(**first, bootstrap=boot_first, lambda_=lam1, **kw)
    vs2, pg2 = run_vtrace(**second, bootstrap=inp["bootstrap"], lambda_=lam2, **kw)
    return np.concatenate([vs1, vs2]), np.concatenate([pg1, pg2])


def test_episode_split_golden():
    inp = dict(log_rhos=np.log([[3.0], [0.5], [1.5], [0.8]]), discounts=np.array([[0.9], [0.0], [0.9], [0.9]]),
               rewards=np.array([[1.0], [0.0], [2.0], [1.0]]), values=np.array([[0.5], [0.2], [0.1], [0.3]]),
               bootstrap=np.array([1.0]))
    vs, pg = run_vtrace(**inp)
    np.testing.assert_allclose(vs[:, 0], [1.09, 0.1, 3.422, 1.58], rtol=1e-12)
    np.testing.assert_allclose(pg[:, 0], [0.59, -0.1, 3.322, 1.28], rtol=1e-12, atol=1e-14)
    split_vs, split_pg = split_run(inp, 2, np.array([123.0]))  # gamma_1 = 0: the bootstrap is irrelevant
    np.testing.assert_allclose(vs, split_vs, rtol=1e-14)
    np.testing.assert_allclose(pg, split_pg, rtol=1e-14, atol=1e-15)


def rlax_split_inputs(discounts):
    rng = np.random.default_rng(11)
    return dict(log_rhos=rng.normal(0, 1, (8, 1)), discounts=np.array(discounts, np.float64)[:, None],
                rewards=rng.normal(0, 1, (8, 1)), values=rng.normal(0, 1, (8, 1)), bootstrap=np.array([10.0]))


@pytest.mark.parametrize("lam", [1.0, 0.7])
def test_episode_split_discount_zero(lam):
    inp = rlax_split_inputs([0, 1, 1, 0, 0, 1, 1, 1])  # discount_3 = 0 ends an episode after step 3
    vs, pg = run_vtrace(**inp, lambda_=lam, clip_rho_threshold=2.0)
    split_vs, split_pg = split_run(inp, 4, np.array([-55.0]), lambda_=lam, clip_rho_threshold=2.0)
    np.testing.assert_allclose(vs, split_vs, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(pg, split_pg, rtol=1e-13, atol=1e-13)


def test_scalar_tensor_lambda_equals_the_float():
    """A 0-dim tensor lambda broadcasts like the float (it is not range-checked: reading it would sync a GPU)."""
    inp = random_inputs(np.random.default_rng(19), 6, 3, log_rho_scale=1.0)
    for lam in (0.0, 0.7, 1.0):
        as_float = run_vtrace(**inp, lambda_=lam)
        as_tensor = run_vtrace(**inp, lambda_=torch.tensor(lam, dtype=torch.float64))
        np.testing.assert_array_equal(as_tensor[0], as_float[0])
        np.testing.assert_array_equal(as_tensor[1], as_float[1])
    np.testing.assert_allclose(run_vtrace(**inp, lambda_=torch.tensor(0.7, dtype=torch.float64))[0],
                               naive_vtrace(**inp, lam=0.7)[0], **F64_TOL)

def test_episode_split_lambda_zero_cuts_vs_but_not_pg():
    """lambda_3 = 0 cuts the trace (vs splits, bootstrapping from V(x_4)); under the SEED convention the pg
    target at step 3 still uses v_4 (rlax's would use V(x_4))."""
    inp = rlax_split_inputs([0, 1, 1, 1, 0, 1, 1, 1])
    lam = np.ones((8, 1))
    lam[3] = 0.0
    vs, pg = run_vtrace(**inp, lambda_=lam)
    split_vs, split_pg = split_run(inp, 4, inp["values"][4], lambda_=lam)
    np.testing.assert_allclose(vs, split_vs, rtol=1e-13, atol=1e-13)
    keep = np.arange(8) != 3
    np.testing.assert_allclose(pg[keep], split_pg[keep], rtol=1e-13, atol=1e-13)
    rho3 = min(1.0, np.exp(inp["log_rhos"][3, 0]))
    np.testing.assert_allclose(pg[3, 0], rho3 * (inp["rewards"][3, 0] + vs[4, 0] - inp["values"][3, 0]), rtol=1e-13)
    assert abs(pg[3, 0] - split_pg[3, 0]) > 1e-3


def test_truncation_with_final_observation_value():
    """Truncation after step k (torchrl #4209/#4210): x_{k+1} in the trace is the next episode's first frame, so
    fold gamma * V(final obs) into r_k and set discount_k = 0; vs AND pg must equal the split run that bootstraps
    from V(final obs). Using the naive discount (no cut) would leak the next episode's v_{k+1} into pg_k."""
    rng = np.random.default_rng(13)
    inp = random_inputs(rng, 8, 3)
    inp["discounts"] = np.full((8, 3), 0.9)
    k, v_final = 4, rng.normal(0, 1, 3)
    folded = dict(inp, rewards=inp["rewards"].copy(), discounts=inp["discounts"].copy())
    folded["rewards"][k] += 0.9 * v_final
    folded["discounts"][k] = 0.0
    kw = dict(clip_rho_threshold=2.0, clip_pg_rho_threshold=1.5, lambda_=0.9)
    vs, pg = run_vtrace(**folded, **kw)
    split_vs, split_pg = split_run(inp, k + 1, v_final, **kw)
    np.testing.assert_allclose(vs, split_vs, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(pg, split_pg, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------------------------
# 8. Degenerate discounts
# ---------------------------------------------------------------------------------------------------------------
def test_all_discounts_zero():
    rho = np.array([[0.5], [2.0], [1.0]])
    vs, pg = run_vtrace(np.log(rho), np.zeros((3, 1)), R3, V3, BOOT3)
    np.testing.assert_allclose(vs[:, 0], [0.75, 0.0, 2.0], rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(pg[:, 0], [0.25, -0.2, 1.9], rtol=1e-14)
    np.testing.assert_allclose(vs, V3 + np.minimum(1, rho) * (R3 - V3), rtol=1e-14, atol=1e-15)


def test_single_step():
    vs, pg = run_vtrace(np.log([[2.0]]), [[0.9]], [[2.0]], [[1.0]], [3.0])
    np.testing.assert_allclose(vs, [[4.7]], rtol=1e-14)
    np.testing.assert_allclose(pg, [[3.7]], rtol=1e-14)


# ---------------------------------------------------------------------------------------------------------------
# 9. Clipping saturation and None thresholds
# ---------------------------------------------------------------------------------------------------------------
def test_clipping_saturation():
    gold_vs = [29.310993, 31.21777, 29.3753, 23.367, 12.73]
    gold_pg = [61.811185, 59.263094, 48.46666, 28.5054, 6.38]
    args = (np.full((5, 1), 0.9), np.arange(5.0)[:, None], (np.arange(5.0) / 2)[:, None], [1.0])
    kw = dict(clip_rho_threshold=3.7, clip_c_threshold=1.0, clip_pg_rho_threshold=2.2)
    out = [run_vtrace(np.full((5, 1), np.log(rho)), *args, **kw) for rho in (5.0, 50.0)]
    for vs, pg in out:
        np.testing.assert_allclose(vs[:, 0], gold_vs, rtol=1e-7)
        np.testing.assert_allclose(pg[:, 0], gold_pg, rtol=1e-7)
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])


def test_none_thresholds_equal_unclipped_formula():
    inp = random_inputs(np.random.default_rng(17), 20, 7, log_rho_scale=1.0)
    kw_none = dict(clip_rho_threshold=None, clip_c_threshold=None, clip_pg_rho_threshold=None, lambda_=0.9)
    vs, pg = run_vtrace(**inp, **kw_none)
    ref_vs, ref_pg = naive_vtrace(**inp, rho_bar=None, c_bar=None, pg_bar=None, lam=0.9)
    np.testing.assert_allclose(vs, ref_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(pg, ref_pg, rtol=1e-10, atol=1e-10)
    inf = float("inf")
    vs_inf, pg_inf = run_vtrace(**inp, clip_rho_threshold=inf, clip_c_threshold=inf, clip_pg_rho_threshold=inf,
                                lambda_=0.9)
    np.testing.assert_allclose(vs, vs_inf, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(pg, pg_inf, rtol=1e-14, atol=1e-14)
    assert np.exp(inp["log_rhos"]).max() > 3 and not np.allclose(vs, run_vtrace(**inp, lambda_=0.9)[0])


# ---------------------------------------------------------------------------------------------------------------
# 10. Shapes, broadcasting, permutation of B, shape errors
# ---------------------------------------------------------------------------------------------------------------
def test_trailing_dims_broadcast_per_channel():
    T, B, C = 5, 3, 42
    rng = np.random.default_rng(19)
    log_rhos, discounts = rng.normal(0, 1, (T, B, 1)), rng.uniform(0.5, 1, (T, B, 1))
    rewards, values, bootstrap = rng.normal(0, 1, (T, B, C)), rng.normal(0, 1, (T, B, C)), rng.normal(0, 1, (B, C))
    vs, pg = run_vtrace(log_rhos, discounts, rewards, values, bootstrap, clip_rho_threshold=2.0)
    assert vs.shape == (T, B, C) and pg.shape == (T, B, C)
    for c in (0, 17, 41):  # every channel is an independent [T, B] problem sharing rho and gamma
        ref_vs, ref_pg = naive_vtrace(log_rhos[..., 0], discounts[..., 0], rewards[..., c], values[..., c],
                                      bootstrap[:, c], rho_bar=2.0)
        np.testing.assert_allclose(vs[..., c], ref_vs, **F64_TOL)
        np.testing.assert_allclose(pg[..., c], ref_pg, **F64_TOL)


def test_batch_permutation_equivariance():
    inp = random_inputs(np.random.default_rng(23), 20, 7)
    perm = np.random.default_rng(0).permutation(7)
    vs, pg = run_vtrace(**inp, clip_rho_threshold=2.0, lambda_=0.9)
    permuted = {k: (v[perm] if k == "bootstrap" else v[:, perm]) for k, v in inp.items()}
    vs_p, pg_p = run_vtrace(**permuted, clip_rho_threshold=2.0, lambda_=0.9)
    np.testing.assert_array_equal(vs_p, vs[:, perm])
    np.testing.assert_array_equal(pg_p, pg[:, perm])


def _args(T=5, B=3, C=None):
    shape = (T, B) if C is None else (T, B, C)
    return dict(log_rhos=torch.zeros(shape), discounts=torch.ones(shape), rewards=torch.zeros(shape),
                values=torch.zeros(shape), bootstrap_value=torch.zeros(shape[1:]))


@pytest.mark.parametrize("change,match", [
    (dict(bootstrap_value=torch.zeros(3)), "bootstrap_value.*\\(3, 4\\)"),  # [B] bootstrap with [T, B, C] values
    (dict(values=torch.zeros(5, 3, 4), bootstrap_value=torch.zeros(3, 4)), "log_rhos.*same rank"),
    (dict(rewards=torch.zeros(6, 3, 4)), "rewards.*\\(5, 3, 4\\)"),
    (dict(discounts=torch.zeros(5, 2, 4)), "discounts"),
    (dict(log_rhos=torch.zeros(5, 3, 2)), "log_rhos"),  # trailing dim neither 1 nor C
    (dict(log_rhos=torch.zeros(5, 3)), "log_rhos"),  # rank 2 vs rank 3 values
    (dict(values=torch.zeros(5), bootstrap_value=torch.zeros(())), "values.*rank >= 2"),
    (dict(lambda_=1.5), "lambda_"),
    (dict(lambda_=torch.ones(5, 4, 1)), "lambda_"),
])
def test_shape_errors(change, match):
    args = dict(_args(C=4), **change)
    if "values" in change and change["values"].dim() == 3 and "log_rhos" not in change:
        args["log_rhos"] = torch.zeros(5, 3)
    with pytest.raises(ValueError, match=match):
        vtrace.from_importance_weights(**args)


def test_bootstrap_rank_mismatch_other_way():
    with pytest.raises(ValueError, match="bootstrap_value.*\\(3,\\)"):
        vtrace.from_importance_weights(**dict(_args(), bootstrap_value=torch.zeros(3, 1)))


def test_from_logits_shape_errors():
    a = _args()
    rest = (a["discounts"], a["rewards"], a["values"], a["bootstrap_value"])
    logits, actions = torch.zeros(5, 3, 4), torch.zeros(5, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="target_policy_logits"):
        vtrace.from_logits(logits, torch.zeros(5, 3, 5), actions, *rest)
    with pytest.raises(ValueError, match="actions.*\\(5, 3\\)"):
        vtrace.from_logits(logits, logits, torch.zeros(5, 2, dtype=torch.long), *rest)
    with pytest.raises(ValueError, match="policy_logits"):
        vtrace.from_logits(torch.zeros(5, 3), torch.zeros(5, 3), actions, *rest)


# ---------------------------------------------------------------------------------------------------------------
# 11. No gradients; the loss reaches values only through the baseline term
# ---------------------------------------------------------------------------------------------------------------
def test_outputs_carry_no_gradient():
    T, B, A = 5, 3, 4
    rng = np.random.default_rng(29)
    inp = {k: torch.tensor(v, requires_grad=True) for k, v in random_inputs(rng, T, B).items()}
    out = vtrace.from_importance_weights(inp["log_rhos"], inp["discounts"], inp["rewards"], inp["values"],
                                         inp["bootstrap"])
    mu, pi = (torch.tensor(rng.normal(0, 1, (T, B, A)), requires_grad=True) for _ in range(2))
    out2 = vtrace.from_logits(mu, pi, torch.tensor(rng.integers(0, A, (T, B))), inp["discounts"], inp["rewards"],
                              inp["values"], inp["bootstrap"])
    for x in (*out, *out2):
        assert not x.requires_grad and x.grad_fn is None


def test_loss_gradient_wrt_values_only_via_baseline():
    T, B, A = 5, 3, 4
    rng = np.random.default_rng(31)
    inp = {k: torch.tensor(v) for k, v in random_inputs(rng, T, B).items()}
    values = inp["values"].clone().requires_grad_()
    logits = torch.tensor(rng.normal(0, 1, (T, B, A)), requires_grad=True)
    actions = torch.tensor(rng.integers(0, A, (T, B)))
    out = vtrace.from_logits(torch.tensor(rng.normal(0, 1, (T, B, A))), logits, actions, inp["discounts"],
                             inp["rewards"], values, inp["bootstrap"])
    # even if a caller hands in targets that still require grad, the loss must treat them as constants
    vs, adv = out.vs.clone().requires_grad_(), out.pg_advantages.clone().requires_grad_()
    total, pg_loss, baseline_loss, entropy = vtrace.vtrace_loss(logits, values, actions, vs, adv, 0.5, 0.01, "sum")
    total.backward()
    assert vs.grad is None and adv.grad is None
    # d/dV [b * 0.5 * sum (vs - V)^2] = -b (vs - V)
    np.testing.assert_allclose(values.grad.numpy(), -0.5 * (out.vs - values).detach().numpy(), **F64_TOL)
    assert torch.autograd.grad(pg_loss - 0.01 * entropy, values, allow_unused=True)[0] is None
    assert torch.autograd.grad(baseline_loss, logits, allow_unused=True)[0] is None


# ---------------------------------------------------------------------------------------------------------------
# 12. Loss plumbing golden case
# ---------------------------------------------------------------------------------------------------------------
def three_action_logits(p):
    """Logits [0, log((1-p)/2p), log((1-p)/2p)]: action 0 has probability p, the others (1-p)/2 each."""
    p = np.asarray(p, np.float64)
    other = np.log((1 - p) / (2 * p))
    return np.stack([np.zeros_like(p), other, other], -1)


def test_loss_plumbing_golden():
    """Reference: log pi(a) = [-0.5, -1.0], A = [2, 1], vs - V = [1, 2], entropies [0.6, 0.7], b = 0.5, e = 0.01
    -> pg 2.0, baseline 1.25, entropy term -0.013, total 3.237. log pi(a) = -0.5 forces entropy >= 0.670, so the
    two halves are realised by separate logits: entropies [0.6, 0.7] with A scaled so that each -log pi(a) A term
    is the reference's (1.0, 1.0), and exact log pi(a) = [-0.5, -1.0] with A = [2, 1]."""
    values, vs = torch.tensor([[0.5], [0.25]]), torch.tensor([[1.5], [2.25]])  # [T=2, B=1], vs - V = [1, 2]
    actions = torch.zeros(2, 1, dtype=torch.long)
    p = np.array([three_action_p_with_entropy(0.6), three_action_p_with_entropy(0.7)])
    logits = torch.tensor(three_action_logits(p))[:, None]
    adv = torch.tensor(1.0 / -np.log(p))[:, None]
    total, pg_loss, baseline_loss, entropy = vtrace.vtrace_loss(logits, values, actions, vs, adv, 0.5, 0.01, "sum")
    for got, want in ((pg_loss, 2.0), (baseline_loss, 1.25), (entropy, 1.3), (-0.01 * entropy, -0.013),
                      (total, 3.237)):
        assert abs(got.item() - want) < 1e-9, (got, want)
    total_m, pg_m, baseline_m, entropy_m = vtrace.vtrace_loss(logits, values, actions, vs, adv, 0.5, 0.01, "mean")
    for got, want in ((pg_m, 1.0), (baseline_m, 0.625), (entropy_m, 0.65), (total_m, 1.6185)):
        assert abs(got.item() - want) < 1e-9, (got, want)

    logits = torch.tensor(three_action_logits(np.exp([-0.5, -1.0])))[None]  # [T=1, B=2]: sums run over B too
    total, pg_loss, baseline_loss, entropy = vtrace.vtrace_loss(
        logits, values.T, actions.T, vs.T, torch.tensor([[2.0, 1.0]]), 0.5, 0.01, "sum")
    q = np.exp([-0.5, -1.0])
    h = float(np.sum(-q * np.log(q) - (1 - q) * np.log((1 - q) / 2)))
    assert abs(pg_loss.item() - 2.0) < 1e-12 and abs(baseline_loss.item() - 1.25) < 1e-12
    assert abs(entropy.item() - h) < 1e-12 and abs(total.item() - (3.25 - 0.01 * h)) < 1e-12
    with pytest.raises(ValueError, match="reduction"):
        vtrace.vtrace_loss(logits, values.T, actions.T, vs.T, vs.T, 0.5, 0.01, "avg")


# ---------------------------------------------------------------------------------------------------------------
# Devices: no host syncs (meta tensors have no data, so any .item()/bool() would raise), and CUDA when present
# ---------------------------------------------------------------------------------------------------------------
def test_no_host_sync_on_meta_device():
    T, B, A, C = 6, 4, 5, 2
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    out = vtrace.from_importance_weights(meta(T, B, 1), meta(T, B, 1), meta(T, B, C), meta(T, B, C), meta(B, C),
                                         lambda_=meta(T, B, 1))
    assert out.vs.device.type == "meta" and out.vs.shape == (T, B, C) and out.pg_advantages.shape == (T, B, C)
    out = vtrace.from_logits(meta(T, B, A), meta(T, B, A), torch.empty(T, B, dtype=torch.long, device="meta"),
                             meta(T, B), meta(T, B), meta(T, B), meta(B))
    assert all(x.device.type == "meta" and x.shape == (T, B) for x in out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_naive():
    inp = case1_inputs(5)
    t = lambda x: torch.tensor(x, device="cuda")  # noqa: E731
    out = vtrace.from_importance_weights(*(t(inp[k]) for k in ("log_rhos", "discounts", "rewards", "values",
                                                                "bootstrap")), clip_rho_threshold=3.7,
                                         clip_pg_rho_threshold=2.2)
    assert out.vs.device.type == "cuda"
    ref_vs, ref_pg = naive_vtrace(**inp, rho_bar=3.7, pg_bar=2.2)
    np.testing.assert_allclose(out.vs.cpu().numpy(), ref_vs, **F64_TOL)
    np.testing.assert_allclose(out.pg_advantages.cpu().numpy(), ref_pg, **F64_TOL)
