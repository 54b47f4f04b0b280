"""Independent references for the graders: each definition written out as a naive float64 loop over numpy arrays
(never the scripts' own code), and, beside each, the typical mistakes as "mutant references" with the hint a grader
prints when a student's answer matches one of them.

Every reference takes the same keyword arguments as the script's function (numpy arrays in place of tensors) and
returns a list of numpy arrays: the outputs in a fixed order (see OUTPUTS in grade.py)."""
import math

import numpy as np


# ---------------------------------------------------------------- 1. GAE
def gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """The definition: A_t = sum_{k >= t} (gamma lambda)^(k - t) delta_k, summed until the episode ends, with
    delta_k = r_k + gamma V(s_{k+1}) (1 - done_{k+1}) - V(s_k)."""
    T, N = rewards.shape
    values_ext = np.concatenate([values, next_value[None]])  # V(s_0) .. V(s_T)
    starts = np.concatenate([dones, next_done[None]])  # starts[t] = 1: obs t begins a new episode
    advantages = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                nonterminal = 1.0 - starts[k + 1, n]
                delta = rewards[k, n] + gamma * values_ext[k + 1, n] * nonterminal - values_ext[k, n]
                total += weight * delta
                if not nonterminal:
                    break
                weight *= gamma * gae_lambda
            advantages[t, n] = total
    return [advantages]


def _gae_variant(rewards, values, dones, next_value, next_done, gamma, gae_lambda, done_at="next", cut_delta=True,
                 cut_trace=True, last_value="next_value", use_next_done=True, trace_gamma=True, lam=None,
                 add_values=False):
    T, N = rewards.shape
    lam = gae_lambda if lam is None else lam
    advantages = np.zeros((T, N))
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            if done_at == "next":
                done = (next_done[n] if use_next_done else 0.0) if t == T - 1 else dones[t + 1, n]
            else:  # dones[t] used for dones[t + 1]
                done = dones[t, n]
            if t < T - 1:
                next_v = values[t + 1, n]
            else:
                next_v = {"next_value": next_value[n], "zero": 0.0, "values_last": values[T - 1, n]}[last_value]
            keep = 1.0 - done
            delta = rewards[t, n] + gamma * next_v * (keep if cut_delta else 1.0) - values[t, n]
            running = delta + (gamma if trace_gamma else 1.0) * lam * (keep if cut_trace else 1.0) * running
            advantages[t, n] = running + (values[t, n] if add_values else 0.0)
    return [advantages]


def _variant(function, **fixed):
    return lambda **kwargs: function(**kwargs, **fixed)


GAE_MUTANTS = [
    ("no reset at episode ends", _variant(_gae_variant, cut_delta=False, cut_trace=False),
     "episode ends are ignored. dones[t + 1] = 1 means step t was the last of its episode: V(s_{t+1}) belongs to "
     "the next episode, so multiply both the bootstrap gamma * V(s_{t+1}) and the carried gamma * lambda * A_{t+1} "
     "by (1 - dones[t + 1])."),
    ("dones[t] used for dones[t + 1]", _variant(_gae_variant, done_at="current"),
     "dones[t] is used where dones[t + 1] belongs. dones[t] = 1 says obs t STARTS a new episode (the episode ended "
     "at step t - 1); step t's own TD target is cut by dones[t + 1], and at the last step by next_done."),
    ("episode end cuts the trace but not the bootstrap", _variant(_gae_variant, cut_delta=False),
     "the sum stops at episode ends, but delta_t still bootstraps V(s_{t+1}) across the boundary: "
     "delta_t = r_t + gamma * V(s_{t+1}) * (1 - dones[t + 1]) - V(s_t)."),
    ("episode end cuts the bootstrap but not the trace", _variant(_gae_variant, cut_trace=False),
     "delta_t is cut at episode ends, but A_{t+1} still flows back across the boundary: "
     "A_t = delta_t + gamma * lambda * (1 - dones[t + 1]) * A_{t+1}."),
    ("no bootstrap at the rollout's end", _variant(_gae_variant, last_value="zero"),
     "the last step t = T - 1 must bootstrap from next_value = V(s_T), times (1 - next_done), not from 0: the "
     "rollout is cut, the episode goes on."),
    ("off-by-one bootstrap: values[T - 1] for V(s_T)", _variant(_gae_variant, last_value="values_last"),
     "off by one at the rollout's end: V(s_T) is next_value (the value of the observation after the rollout), "
     "not values[T - 1]."),
    ("next_done ignored", _variant(_gae_variant, use_next_done=False),
     "next_done is ignored: when the observation after the rollout starts a new episode, the last step's "
     "bootstrap must be cut by (1 - next_done), as dones[t + 1] cuts the other steps."),
    ("lambda ignored", _variant(_gae_variant, lam=1.0),
     "this is GAE with lambda = 1 whatever gae_lambda is: the trace decays by gamma * lambda per step."),
    ("trace decays by lambda only", _variant(_gae_variant, trace_gamma=False),
     "the carried advantage is multiplied by lambda only; it decays by gamma * lambda per step."),
    ("returns instead of advantages", _variant(_gae_variant, add_values=True),
     "this returns A_t + V(s_t), the value targets; compute_gae returns the advantages A_t (train adds the values)."),
]


# ---------------------------------------------------------------- 2. PPO's objective
def policy_loss(ratio, advantages, kl, kind, clip_coef, kl_beta):
    """-(1/M) sum_i min(r_i A_i, clip(r_i, 1 - eps, 1 + eps) A_i), or -(1/M) sum_i (r_i A_i - beta kl_i)."""
    total = 0.0
    for i in range(len(ratio)):
        if kind == "kl-penalty":
            total += ratio[i] * advantages[i] - kl_beta * kl[i]
        else:
            clipped = min(max(ratio[i], 1.0 - clip_coef), 1.0 + clip_coef)
            total += min(ratio[i] * advantages[i], clipped * advantages[i])
    return [np.array(-total / len(ratio))]


def _policy_variant(ratio, advantages, kl, kind, clip_coef, kl_beta, negate=True, pick=min, low=True, high=True,
                    unclipped=True, mean=True, kl_sign=-1.0, use_kl=True, ignore_kind=False):
    total = 0.0
    for i in range(len(ratio)):
        if kind == "kl-penalty" and not ignore_kind:
            total += ratio[i] * advantages[i] + (kl_sign * kl_beta * kl[i] if use_kl else 0.0)
        else:
            clipped = ratio[i]
            if low:
                clipped = max(clipped, 1.0 - clip_coef)
            if high:
                clipped = min(clipped, 1.0 + clip_coef)
            total += pick(ratio[i] * advantages[i], clipped * advantages[i]) if unclipped else clipped * advantages[i]
    total = total / len(ratio) if mean else total
    return [np.array(-total if negate else total)]


POLICY_LOSS_MUTANTS = [
    ("the objective, not negated", _variant(_policy_variant, negate=False),
     "policy_loss returns the NEGATED objective: train minimizes it by gradient descent, so return -L."),
    ("max instead of min", _variant(_policy_variant, pick=max),
     "max instead of min: the clipped objective is E[min(r A, clip(r, 1 - eps, 1 + eps) A)], a pessimistic bound; "
     "negated for minimizing, that is the max of the negated terms (not the min)."),
    ("only the upper side clipped", _variant(_policy_variant, low=False),
     "only the upper side 1 + eps is clipped: clip(r, 1 - eps, 1 + eps) has a lower side too, and with negative "
     "advantages it is the side that binds."),
    ("only the lower side clipped", _variant(_policy_variant, high=False),
     "only the lower side 1 - eps is clipped: clip(r, 1 - eps, 1 + eps) has an upper side too, and with positive "
     "advantages it is the side that binds."),
    ("the unclipped term missing", _variant(_policy_variant, unclipped=False),
     "the unclipped term is missing: take min(r A, clip(r) A), not clip(r) A alone. The min removes the incentive to "
     "move r beyond 1 +- eps but still lets a bad move be undone (and keeps its gradient)."),
    ("sum instead of mean", _variant(_policy_variant, mean=False),
     "the loss is a mean over the minibatch (the E[...] of Eq. 7), not a sum."),
    ("KL penalty with the wrong sign", _variant(_policy_variant, kl_sign=1.0),
     "the KL penalty has the wrong sign: L = E[r A - beta KL] (a penalty), and the loss is -L = E[-r A + beta KL]."),
    ("KL penalty missing", _variant(_policy_variant, use_kl=False),
     "kind 'kl-penalty' must subtract beta * KL(pi_old || pi) from the objective (PPO Eq. 8)."),
    ("kind ignored: clipped surrogate for kl-penalty", _variant(_policy_variant, ignore_kind=True),
     "kind 'kl-penalty' is Eq. 8, E[r A - beta KL], without clipping; only kind 'clip' uses Eq. 7."),
]


def value_loss(new_value, old_value, returns, clip_coef, clip_vloss):
    total = 0.0
    for i in range(len(new_value)):
        error = (new_value[i] - returns[i]) ** 2
        if clip_vloss:
            clipped = old_value[i] + min(max(new_value[i] - old_value[i], -clip_coef), clip_coef)
            error = max(error, (clipped - returns[i]) ** 2)
        total += error
    return [np.array(0.5 * total / len(new_value))]


def _square(x):
    return x * x


def _huber(x):
    """2 * smooth_l1(x): x^2 for |x| <= 1, 2 |x| - 1 beyond (so that 0.5 * _huber is F.smooth_l1_loss)."""
    return x * x if abs(x) <= 1.0 else 2.0 * abs(x) - 1.0


def _value_variant(new_value, old_value, returns, clip_coef, clip_vloss, half=0.5, pick=max, around="old",
                   unclipped=True, clip=None, square=None, square_clipped=None):
    clip_vloss = clip_vloss if clip is None else clip
    square = square or _square
    square_clipped = square_clipped or square
    total = 0.0
    for i in range(len(new_value)):
        error = square(new_value[i] - returns[i])
        if clip_vloss:
            center = old_value[i] if around == "old" else returns[i]
            clipped = center + min(max(new_value[i] - center, -clip_coef), clip_coef)
            clipped_error = square_clipped(clipped - returns[i])
            error = pick(error, clipped_error) if unclipped else clipped_error
        total += error
    return [np.array(half * total / len(new_value))]


VALUE_LOSS_MUTANTS = [
    ("the factor 0.5 missing", _variant(_value_variant, half=1.0),
     "the value loss is 0.5 * E[(V - V_targ)^2]: the factor 0.5 is missing (vf_coef is tuned with it)."),
    ("min instead of max", _variant(_value_variant, pick=min),
     "the larger of the unclipped and the clipped squared errors counts (max), as in baselines PPO; the min lets "
     "the clipping lower the loss."),
    ("clipped around the returns", _variant(_value_variant, around="returns"),
     "the value is clipped around its rollout value: V_clip = old_value + clip(V - old_value, -eps, eps), not "
     "around the returns."),
    ("the unclipped error missing", _variant(_value_variant, unclipped=False),
     "with clip_vloss the unclipped squared error counts too: 0.5 * E[max((V - V_targ)^2, (V_clip - V_targ)^2)]."),
    ("clip_vloss ignored (never clipped)", _variant(_value_variant, clip=False),
     "clip_vloss=True asks for the clipped value loss: V_clip = old_value + clip(V - old_value, -eps, eps) and "
     "the max of the two squared errors."),
    ("clip_vloss ignored (always clipped)", _variant(_value_variant, clip=True),
     "clip_vloss=False asks for the plain 0.5 * E[(V - V_targ)^2], without clipping."),
    ("a Huber (smooth L1) error", _variant(_value_variant, square=_huber),
     "the error is not squared beyond |V - V_targ| = 1 (a Huber / smooth-L1 loss): the value loss is "
     "0.5 * (V - V_targ)^2 for errors of every size."),
    ("a Huber (smooth L1) error in the clipped branch", _variant(_value_variant, square_clipped=_huber),
     "the clipped branch's error is not squared beyond |V_clip - V_targ| = 1 (a Huber / smooth-L1 loss): "
     "both branches are squared errors, 0.5 * E[max((V - V_targ)^2, (V_clip - V_targ)^2)]."),
    ("an absolute error", _variant(_value_variant, square=abs),
     "the error is |V - V_targ|, not (V - V_targ)^2: the value loss is 0.5 * E[(V - V_targ)^2]."),
]


# ---------------------------------------------------------------- 3. PPG's auxiliary phase
def _log_softmax(row):
    top = max(row)
    log_z = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_z for x in row]


def ppg_aux_loss(logits, old_logits, value, aux_value, value_targets, beta_clone):
    M = len(value_targets)
    kl = 0.0
    for s in range(M):
        log_p_old, log_p = _log_softmax(old_logits[s]), _log_softmax(logits[s])
        kl += sum(math.exp(lo) * (lo - lp) for lo, lp in zip(log_p_old, log_p))
    kl /= M
    aux = 0.5 * sum((aux_value[s] - value_targets[s]) ** 2 for s in range(M)) / M
    true = 0.5 * sum((value[s] - value_targets[s]) ** 2 for s in range(M)) / M
    return [np.array(aux + beta_clone * kl + true), np.array(aux), np.array(kl), np.array(true)]


def _aux_variant(logits, old_logits, value, aux_value, value_targets, beta_clone, kl_form="kl", kl_mean_actions=False,
                 with_value=True, beta_on="kl", half=0.5, aux_from="aux", square=None, square_value=None):
    M, A = logits.shape
    square = square or _square
    square_value = square_value or square
    kl = 0.0
    for s in range(M):
        log_p_old, log_p = _log_softmax(old_logits[s]), _log_softmax(logits[s])
        if kl_form == "reversed":
            terms = [math.exp(lp) * (lp - lo) for lo, lp in zip(log_p_old, log_p)]
        elif kl_form == "raw logits":
            terms = [math.exp(lo) * (lo - lp) for lo, lp in zip(old_logits[s], logits[s])]
        elif kl_form == "cross-entropy":
            terms = [-math.exp(lo) * lp for lo, lp in zip(log_p_old, log_p)]
        else:
            terms = [math.exp(lo) * (lo - lp) for lo, lp in zip(log_p_old, log_p)]
        kl += sum(terms) / (A if kl_mean_actions else 1)
    kl /= M
    heads = aux_value if aux_from == "aux" else value
    aux = half * sum(square(heads[s] - value_targets[s]) for s in range(M)) / M
    true = half * sum(square_value(value[s] - value_targets[s]) for s in range(M)) / M
    joint = aux + beta_clone * kl if beta_on == "kl" else beta_clone * aux + kl
    return [np.array(joint + (true if with_value else 0.0)), np.array(aux), np.array(kl), np.array(true)]


PPG_AUX_LOSS_MUTANTS = [
    ("KL in the wrong direction", _variant(_aux_variant, kl_form="reversed"),
     "the KL is in the wrong direction: behaviour cloning keeps pi near pi_old with KL(pi_old || pi) = "
     "sum_a pi_old(a) (log pi_old(a) - log pi(a)), weighted by pi_old's probabilities (PPG Eq. 3)."),
    ("KL of raw logits", _variant(_aux_variant, kl_form="raw logits"),
     "the KL needs log-probabilities: take log_softmax of both logits first (raw logits are not normalized)."),
    ("cross-entropy instead of KL", _variant(_aux_variant, kl_form="cross-entropy"),
     "this is the cross-entropy H(pi_old, pi) = -sum_a pi_old(a) log pi(a), not the KL: add sum_a pi_old(a) "
     "log pi_old(a) (minus pi_old's entropy), so that the KL is 0 when pi = pi_old."),
    ("KL averaged over the actions", _variant(_aux_variant, kl_mean_actions=True),
     "sum the KL over the actions (sum_a pi_old(a) ...), then average over the states; a mean over the actions "
     "divides it by the number of actions."),
    ("L_value left out of the loss", _variant(_aux_variant, with_value=False),
     "the returned loss must include L_value = 0.5 * E[(value - V_targ)^2]: Algorithm 1 trains the value network "
     "on the same data in the auxiliary phase (the parameters are disjoint, so one sum serves both)."),
    ("beta_clone on the wrong term", _variant(_aux_variant, beta_on="aux"),
     "beta_clone weighs the KL (L_joint = L_aux + beta_clone * KL), not the auxiliary value loss."),
    ("the factors 0.5 missing", _variant(_aux_variant, half=1.0),
     "both value losses are 0.5 * E[(V - V_targ)^2]: the factor 0.5 is missing."),
    ("L_aux of the value head", _variant(_aux_variant, aux_from="value"),
     "L_aux trains the auxiliary value head (aux_value, on the policy network); value is the value network's head, "
     "trained by L_value."),
    ("a Huber (smooth L1) value error", _variant(_aux_variant, square=_huber),
     "the value errors are not squared beyond 1 (a Huber / smooth-L1 loss): both value losses are "
     "0.5 * E[(V - V_targ)^2] for errors of every size."),
    ("a Huber (smooth L1) error in L_aux", _variant(_aux_variant, square=_huber, square_value=_square),
     "L_aux's error is not squared beyond 1 (a Huber / smooth-L1 loss): L_aux = 0.5 * E[(V_aux - V_targ)^2] for "
     "errors of every size."),
    ("a Huber (smooth L1) error in L_value", _variant(_aux_variant, square_value=_huber),
     "L_value's error is not squared beyond 1 (a Huber / smooth-L1 loss): L_value = 0.5 * E[(V - V_targ)^2] for "
     "errors of every size."),
]


# ---------------------------------------------------------------- 4. V-trace
def _clip(x, threshold):
    return x if threshold is None else min(threshold, x)


def trailing(function):
    """`function` on [T, B, ...] inputs whose trailing dims broadcast (size 1 or values'), with a float, 0-dim or
    per-step lambda_: broadcast everything to one [T, B, ...] shape, flatten it to [T, B'], reshape the outputs."""
    def wrapped(log_rhos, discounts, rewards, values, bootstrap_value, lambda_=1.0, **thresholds):
        lam = np.asarray(lambda_, dtype=np.float64)
        shape = np.broadcast_shapes(log_rhos.shape, discounts.shape, rewards.shape, values.shape,
                                    lam.shape if lam.ndim else ())
        flat = [np.broadcast_to(x, shape).reshape(shape[0], -1) for x in (log_rhos, discounts, rewards, values)]
        lam = np.broadcast_to(lam, shape).reshape(shape[0], -1)
        boot = np.broadcast_to(bootstrap_value, shape[1:]).reshape(-1)
        outputs = function(*flat, boot, lambda_=lam, **thresholds)
        return [output.reshape(shape) for output in outputs]
    return wrapped


def from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold=1.0,
                            clip_c_threshold=1.0, clip_pg_rho_threshold=1.0, lambda_=1.0):
    """The naive double sum of IMPALA Eq. 1: v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) delta_t,
    c_i = lambda min(c_bar, rho_i), and A_s = min(rho_bar_pg, rho_s) (r_s + gamma_s v_{s+1} - V(x_s))."""
    T, B = values.shape
    lam = np.broadcast_to(np.asarray(lambda_, dtype=np.float64), (T, B))
    vs = np.zeros((T, B))
    pg = np.zeros((T, B))
    for b in range(B):
        V = [values[t, b] for t in range(T)] + [bootstrap_value[b]]
        rho = [math.exp(log_rhos[t, b]) for t in range(T)]
        delta = [_clip(rho[t], clip_rho_threshold) * (rewards[t, b] + discounts[t, b] * V[t + 1] - V[t])
                 for t in range(T)]
        for s in range(T):
            total = 0.0
            for t in range(s, T):
                weight = 1.0
                for i in range(s, t):
                    weight *= discounts[i, b] * lam[i, b] * _clip(rho[i], clip_c_threshold)
                total += weight * delta[t]
            vs[s, b] = V[s] + total
        for s in range(T):
            v_next = vs[s + 1, b] if s + 1 < T else bootstrap_value[b]
            pg[s, b] = _clip(rho[s], clip_pg_rho_threshold) * (rewards[s, b] + discounts[s, b] * v_next - V[s])
    return [vs, pg]


from_importance_weights = trailing(from_importance_weights)


def _vtrace_variant(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold=1.0,
                    clip_c_threshold=1.0, clip_pg_rho_threshold=1.0, lambda_=1.0, c_with="c_bar", lam=None,
                    pg_target="vs", pg_with="pg_bar", delta_with="rho_bar", trace_discount=True, exp=True,
                    pg_form="td", last_value="bootstrap", lambda_pg_mix=False):
    T, B = values.shape
    lam = np.broadcast_to(np.asarray(lambda_ if lam is None else lam, dtype=np.float64), (T, B))
    thresholds = {"c_bar": clip_c_threshold, "rho_bar": clip_rho_threshold, "pg_bar": clip_pg_rho_threshold,
                  "none": None}
    vs = np.zeros((T, B))
    pg = np.zeros((T, B))
    for b in range(B):
        boot = bootstrap_value[b] if last_value == "bootstrap" else values[T - 1, b]
        V = [values[t, b] for t in range(T)] + [boot]
        rho = [math.exp(log_rhos[t, b]) if exp else log_rhos[t, b] for t in range(T)]
        acc = 0.0
        for s in reversed(range(T)):
            delta = _clip(rho[s], thresholds[delta_with]) * (rewards[s, b] + discounts[s, b] * V[s + 1] - V[s])
            c = lam[s, b] * _clip(rho[s], thresholds[c_with])
            acc = delta + (discounts[s, b] if trace_discount else 1.0) * c * acc
            vs[s, b] = V[s] + acc
        for s in range(T):
            v_next = vs[s + 1, b] if s + 1 < T else boot
            if pg_target == "values":
                v_next = V[s + 1]
            if lambda_pg_mix:
                v_next = lam[s, b] * v_next + (1 - lam[s, b]) * V[s + 1]
            weight = _clip(rho[s], thresholds[pg_with])
            pg[s, b] = weight * ((vs[s, b] - V[s]) if pg_form == "vs" else
                                 (rewards[s, b] + discounts[s, b] * v_next - V[s]))
    return [vs, pg]


_vtrace_variant = trailing(_vtrace_variant)

VTRACE_MUTANTS = [
    ("c_bar truncated with rho_bar", _variant(_vtrace_variant, c_with="rho_bar"),
     "the trace is truncated with rho_bar: c_s = lambda * min(c_bar, rho_s) uses clip_c_threshold. rho_bar "
     "(clip_rho_threshold) weighs the TD error delta_s and sets the fixed point; c_bar only sets the speed."),
    ("lambda ignored", _variant(_vtrace_variant, lam=1.0),
     "lambda is ignored: it multiplies the trace, c_s = lambda * min(c_bar, rho_s) (IMPALA Remark 2)."),
    ("lambda in the pg target too (rlax's convention)", _variant(_vtrace_variant, lambda_pg_mix=True),
     "this is rlax's lambda convention: here (as in SEED RL) lambda scales only the trace, and the pg target keeps "
     "r_s + gamma_s v_{s+1}."),
    ("pg target with V(x_{s+1})", _variant(_vtrace_variant, pg_target="values"),
     "the policy-gradient target uses the V-trace target of the next state: A_s = min(rho_bar_pg, rho_s) "
     "(r_s + gamma_s v_{s+1} - V(x_s)), with v_T = bootstrap_value, not V(x_{s+1}) (IMPALA section 4.2)."),
    ("pg weight truncated with rho_bar", _variant(_vtrace_variant, pg_with="rho_bar"),
     "the pg weight is min(rho_bar_pg, rho_s), with clip_pg_rho_threshold, not clip_rho_threshold."),
    ("pg weight not truncated", _variant(_vtrace_variant, pg_with="none"),
     "the pg weight is truncated: min(rho_bar_pg, rho_s) with clip_pg_rho_threshold."),
    ("delta not truncated", _variant(_vtrace_variant, delta_with="none"),
     "delta_s V is weighted by min(rho_bar, rho_s), truncated with clip_rho_threshold."),
    ("delta truncated with c_bar", _variant(_vtrace_variant, delta_with="c_bar"),
     "delta_s V is weighted by min(rho_bar, rho_s) with clip_rho_threshold, not c_bar."),
    ("no discount in the trace", _variant(_vtrace_variant, trace_discount=False),
     "the trace carries gamma_s * c_s (discounts[s] * c_s): without gamma_s, the correction also flows across "
     "episode ends (discount 0)."),
    ("log_rhos used as ratios", _variant(_vtrace_variant, exp=False),
     "log_rhos are log-ratios: rho_s = exp(log_rhos[s])."),
    ("pg advantage = v_s - V(x_s)", _variant(_vtrace_variant, pg_form="vs"),
     "A_s = min(rho_bar_pg, rho_s) (r_s + gamma_s v_{s+1} - V(x_s)): it equals v_s - V(x_s) only when "
     "rho_bar = c_bar = rho_bar_pg = 1 and lambda = 1."),
    ("off-by-one bootstrap", _variant(_vtrace_variant, last_value="values_last"),
     "V(x_T) is bootstrap_value (the value of the state after the last step), not values[T - 1]."),
]


# ---------------------------------------------------------------- 5. RLHF
def per_token_rewards(kl, scores, mask, beta):
    B, L = mask.shape
    rewards = np.zeros((B, L))
    for b in range(B):
        last = max(t for t in range(L) if mask[b, t] > 0)
        for t in range(L):
            if mask[b, t] > 0:
                rewards[b, t] = -beta * kl[b, t]
        rewards[b, last] += scores[b]
    return [rewards]


def _reward_variant(kl, scores, mask, beta, penalty="every", score_at="last", kl_sign=-1.0, masked=True):
    B, L = mask.shape
    rewards = np.zeros((B, L))
    for b in range(B):
        last = max(t for t in range(L) if mask[b, t] > 0)
        for t in range(L):
            if penalty == "every" and (mask[b, t] > 0 or not masked):
                rewards[b, t] = kl_sign * beta * kl[b, t]
        if penalty == "last":
            rewards[b, last] += kl_sign * beta * sum(kl[b, t] for t in range(L) if mask[b, t] > 0)
        if score_at == "every":
            for t in range(last + 1):
                rewards[b, t] += scores[b]
        else:
            index = {"last": last, "final position": L - 1, "first": 0, "one past": min(last + 1, L - 1)}[score_at]
            rewards[b, index] += scores[b]
    return [rewards]


PER_TOKEN_REWARD_MUTANTS = [
    ("the KL penalty on the last token only", _variant(_reward_variant, penalty="last"),
     "the KL penalty goes on EVERY response token, r_t = -beta * KL_t; only the score goes on the last one. "
     "Summing the penalty onto the last token gives the same return but other per-token rewards, so other "
     "advantages."),
    ("the score at the tensor's final position", _variant(_reward_variant, score_at="final position"),
     "the score goes on the response's last token (index mask.sum(1) - 1: the EOS), not on the last position of "
     "the padded tensor."),
    ("the score at the first token", _variant(_reward_variant, score_at="first"),
     "the score goes on the response's last token (index mask.sum(1) - 1), not its first: the reward model scores "
     "the whole response."),
    ("the score one token past the end", _variant(_reward_variant, score_at="one past"),
     "off by one: the last response token is at index mask.sum(1) - 1."),
    ("the score on every token", _variant(_reward_variant, score_at="every"),
     "the score is added once, on the response's last token, not on every token."),
    ("the KL penalty with the wrong sign", _variant(_reward_variant, kl_sign=1.0),
     "the KL term is a penalty: r_t = -beta * KL_t."),
    ("the KL penalty past the response's end", _variant(_reward_variant, masked=False),
     "tokens after the response's end (mask 0) get no reward: multiply the penalty by the mask."),
]


def _log1p_exp(x):
    """log(1 + e^x), stable for large |x|."""
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def bradley_terry_loss(r_chosen, r_rejected):
    return [np.array(sum(_log1p_exp(-(c - r)) for c, r in zip(r_chosen, r_rejected)) / len(r_chosen))]


def _bt_variant(r_chosen, r_rejected, form="nll", mean=True):
    terms = []
    for c, r in zip(r_chosen, r_rejected):
        margin = c - r
        with np.errstate(all="ignore"):
            sigmoid = 1.0 / (1.0 + np.exp(np.float64(-margin)))
            terms.append({"flipped": _log1p_exp(margin), "no log": -sigmoid, "no minus": -_log1p_exp(-margin),
                          "unstable": -np.log(sigmoid), "nll": _log1p_exp(-margin)}[form])
    total = sum(terms)
    return [np.array(total / len(terms) if mean else total)]


BT_MUTANTS = [
    ("the sign flipped", _variant(_bt_variant, form="flipped"),
     "the sign is flipped: the loss is -log sigma(r_chosen - r_rejected), the negative log-likelihood that the "
     "chosen response wins; this one trains the reward model to prefer the rejected responses."),
    ("sigma without the log", _variant(_bt_variant, form="no log"),
     "the loss is -log sigma(r_chosen - r_rejected), the log-likelihood of Bradley-Terry, not -sigma(...)."),
    ("the log-likelihood, not its negative", _variant(_bt_variant, form="no minus"),
     "a loss to minimize is the NEGATIVE log-likelihood: -log sigma(r_chosen - r_rejected)."),
    ("sum instead of mean", _variant(_bt_variant, mean=False),
     "the loss is a mean over the pairs, not a sum."),
    ("log(sigmoid(x)) overflows", _variant(_bt_variant, form="unstable"),
     "log(sigmoid(d)) underflows to log(0) = -inf for large negative margins: use F.logsigmoid(d) "
     "(or -F.softplus(-d))."),
]


# ---------------------------------------------------------------- 6. GRPO's and RLOO's group baselines
def _groups(scores, group_size, layout="consecutive"):
    """The groups as lists of indices into scores: k consecutive rows each (the script's layout), or, for the
    mistake, every (B / k)-th row."""
    count = len(scores) // group_size
    if layout == "consecutive":
        return [list(range(g * group_size, (g + 1) * group_size)) for g in range(count)]
    return [list(range(g, len(scores), count)) for g in range(count)]


def group_relative_advantages(scores, group_size, eps):
    """GRPO: A_i = (r_i - mean of its group) / (sample std of its group + eps), groups of k consecutive scores."""
    return _grpo_variant(scores, group_size, eps)


def _grpo_variant(scores, group_size, eps, ddof=1, use_eps=True, eps_inside=False, scale=True, layout="consecutive",
                  whole_batch=False):
    advantages = np.zeros(len(scores))
    groups = [list(range(len(scores)))] if whole_batch else _groups(scores, group_size, layout)
    for group in groups:
        values = [float(scores[i]) for i in group]
        mean = sum(values) / len(values)
        variance = sum((v - mean) ** 2 for v in values) / (len(values) - ddof)
        if eps_inside:
            denominator = math.sqrt(variance + eps)
        else:
            denominator = math.sqrt(variance) + (eps if use_eps else 0.0)
        for i, value in zip(group, values):
            with np.errstate(all="ignore"):
                advantages[i] = (value - mean) / np.float64(denominator) if scale else value - mean
    return [advantages]


def leave_one_out_advantages(scores, group_size):
    """RLOO: A_i = r_i - (the mean of the other k - 1 scores of its group), by a double loop."""
    return _rloo_variant(scores, group_size)


def _rloo_variant(scores, group_size, include_self=False, divide_by_k=False, layout="consecutive",
                  whole_batch=False, sign=1.0):
    advantages = np.zeros(len(scores))
    groups = [list(range(len(scores)))] if whole_batch else _groups(scores, group_size, layout)
    for group in groups:
        for i in group:
            others = [float(scores[j]) for j in group if include_self or j != i]
            count = len(group) if divide_by_k else len(others)
            advantages[i] = sign * (float(scores[i]) - sum(others) / count)
    return [advantages]


GRPO_MUTANTS = [
    ("the population std (ddof 0)", _variant(_grpo_variant, ddof=0),
     "the std here is the sample std of the group, sqrt(sum (r_j - mean)^2 / (k - 1)) (torch's default .std(), as "
     "TRL), not the population std that divides by k."),
    ("no eps in the denominator", _variant(_grpo_variant, use_eps=False),
     "divide by std + eps: a group whose k scores are equal has std 0, and its advantages must be 0, not NaN."),
    ("eps inside the square root", _variant(_grpo_variant, eps_inside=True),
     "eps is added to the std, (r_i - mean) / (std + eps), not to the variance under the square root."),
    ("not divided by the std", _variant(_grpo_variant, scale=False),
     "GRPO divides by the group's std too: (r_i - mean) / (std + eps). Subtracting the mean alone is another "
     "estimator."),
    ("groups strided, not consecutive", _variant(_grpo_variant, layout="strided"),
     "a group is k CONSECUTIVE scores (the k responses to one prompt follow each other: repeat_interleave), so "
     "scores.view(-1, k) holds one group per row; not every (B / k)-th score."),
    ("mean and std over the whole batch", _variant(_grpo_variant, whole_batch=True),
     "the mean and std are those of each GROUP of k responses to one prompt, not of the whole batch."),
]
RLOO_MUTANTS = [
    ("the baseline includes the response itself", _variant(_rloo_variant, include_self=True),
     "leave one out: the baseline of response i is the mean of the OTHER k - 1 scores of its group; the group mean "
     "includes r_i (and is a biased baseline)."),
    ("divided by k, not k - 1", _variant(_rloo_variant, divide_by_k=True),
     "the other responses are k - 1: b_i = (sum_j r_j - r_i) / (k - 1)."),
    ("groups strided, not consecutive", _variant(_rloo_variant, layout="strided"),
     "a group is k CONSECUTIVE scores (the k responses to one prompt follow each other: repeat_interleave), so "
     "scores.view(-1, k) holds one group per row; not every (B / k)-th score."),
    ("the baseline over the whole batch", _variant(_rloo_variant, whole_batch=True),
     "the baseline is the mean of the other responses to the SAME prompt (its group of k), not of the whole "
     "batch."),
    ("the sign flipped", _variant(_rloo_variant, sign=-1.0),
     "the advantage is r_i - b_i: above the others' mean is good."),
]
