"""exercises/: each grader passes on the scripts' own functions and on independent correct solutions, and fails with
the right hint on typical mistakes (the mutants below, as a student would write them); the starter code imports,
runs what is not blank, and its blanks fail their graders with the exercise's text; a full grade, training
included, passes for every exercise."""
import ast
import csv
import dataclasses
import json
import linecache
import math
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from exercises import grade, grading, instructor, silent_bugs
from exercises.texts import EXERCISES, STUB_TEXT

SCRIPT_OF = {name: exercise["script"] for name, exercise in EXERCISES.items()}


def with_functions(exercise, *sources, script=None):
    """A fresh copy of the exercise's script with the given function sources put in place of its own."""
    module = grade.load_script(os.path.join(ROOT, script or SCRIPT_OF[exercise]))
    for source in sources:
        name = f"<solution {abs(hash(source))}>"
        linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)  # tracebacks show lines
        exec(compile(source, name, "exec"), module.__dict__)  # noqa: S102 - the mutants below
    return module


def failure(exercise, module):
    with pytest.raises(grade.Failed) as info:
        grade.check(exercise, module)
    return str(info.value)


# ---------------------------------------------------------------- 1. GAE
GAE = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        keep = 1.0 - (next_done if t == T - 1 else dones[t + 1])
        next_values = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * next_values * keep - values[t]
        running = delta + gamma * gae_lambda * keep * running
        advantages[t] = running
    return advantages
'''
GAE_MUTANTS = {
    "no reset at episode ends": [("* keep - values[t]", "- values[t]"), ("gae_lambda * keep *", "gae_lambda *")],
    "dones[t] used for dones[t + 1]": [("keep = 1.0 - (next_done if t == T - 1 else dones[t + 1])",
                                        "keep = 1.0 - dones[t]")],
    "off-by-one bootstrap: values[T - 1] for V(s_T)": [("next_value if t == T - 1 else values[t + 1]",
                                                         "values[t] if t == T - 1 else values[t + 1]")],
    "no bootstrap at the rollout's end": [("next_value if t == T - 1 else values[t + 1]",
                                           "0.0 if t == T - 1 else values[t + 1]")],
    "next_done ignored": [("(next_done if t == T - 1 else dones[t + 1])", "(0.0 if t == T - 1 else dones[t + 1])")],
    "lambda ignored": [("gamma * gae_lambda * keep", "gamma * keep")],
    "episode end cuts the trace but not the bootstrap": [("* keep - values[t]", "- values[t]")],
    "returns instead of advantages": [("return advantages", "return advantages + values")],
    "gae: float32 output on float64 input": [("advantages = torch.zeros_like(rewards)",
                                              "advantages = torch.zeros(rewards.shape)")],
    "gae: a new tensor on the CPU": [("advantages = torch.zeros_like(rewards)",
                                      "advantages = torch.zeros(rewards.shape, dtype=rewards.dtype)")],
    "gae: an input overwritten": [("        advantages[t] = running", "        advantages[t] = running\n"
                                   "        values[t] = running + values[t]")],
}
GAE_HINT = {"gae: float32 output on float64 input": None, "gae: an input overwritten": None,
            "gae: a new tensor on the CPU": None}


# ---------------------------------------------------------------- 2. PPO's objective
POLICY_LOSS = '''
def policy_loss(ratio, advantages, kl, kind, clip_coef, kl_beta):
    if kind == "kl-penalty":
        return -(ratio * advantages - kl_beta * kl).mean()
    clipped = torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
    return -torch.min(ratio * advantages, clipped * advantages).mean()
'''
VALUE_LOSS = '''
def value_loss(new_value, old_value, returns, clip_coef, clip_vloss):
    error = (new_value - returns) ** 2
    if clip_vloss:
        clipped = old_value + torch.clamp(new_value - old_value, -clip_coef, clip_coef)
        error = torch.max(error, (clipped - returns) ** 2)
    return 0.5 * error.mean()
'''
PPO_LOSS_MUTANTS = {
    "max instead of min": [("-torch.min(ratio", "-torch.max(ratio")],
    "only the upper side clipped": [("torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)",
                                     "torch.clamp(ratio, max=1 + clip_coef)")],
    "only the lower side clipped": [("torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)",
                                     "torch.clamp(ratio, min=1 - clip_coef)")],
    "the unclipped term missing": [("-torch.min(ratio * advantages, clipped * advantages).mean()",
                                    "-(clipped * advantages).mean()")],
    "the objective, not negated": [("return -torch.min", "return torch.min"),
                                   ("return -(ratio * advantages", "return (ratio * advantages")],
    "KL penalty with the wrong sign": [("- kl_beta * kl", "+ kl_beta * kl")],
    "the ratio detached": [("-torch.min(ratio * advantages, clipped * advantages)",
                            "-torch.min(ratio.detach() * advantages, clipped.detach() * advantages)")],
    "value: min instead of max": [("torch.max(error", "torch.min(error")],
    "value: clipped around the returns": [("old_value + torch.clamp(new_value - old_value",
                                           "returns + torch.clamp(new_value - returns")],
    "value: the factor 0.5 missing": [("return 0.5 * error.mean()", "return error.mean()")],
    # value errors beyond 1 in every branch, the dtype contract, Python's min on tensors
    "value: a Huber (smooth L1) error, unclipped branch": [("error = (new_value - returns) ** 2",
                                                            "error = 2 * F.smooth_l1_loss(new_value, returns, "
                                                            "reduction='none')")],
    "value: a Huber (smooth L1) error, clipped branch": [("(clipped - returns) ** 2",
                                                          "2 * F.smooth_l1_loss(clipped, returns, reduction='none')")],
    "value: an absolute error": [("error = (new_value - returns) ** 2", "error = (new_value - returns).abs()"),
                                 ("(clipped - returns) ** 2", "(clipped - returns).abs()")],
    "policy: float64 input, float32 output": [("return -torch.min(ratio * advantages, clipped * advantages).mean()",
                                               "return -torch.min(ratio * advantages, clipped * advantages).mean()"
                                               ".float()")],
    "python min on tensors": [("-torch.min(ratio * advantages, clipped * advantages).mean()",
                               "-min(ratio * advantages, clipped * advantages).mean()")],
}
PPO_HINT = {"value: min instead of max": "min instead of max", "value: clipped around the returns":
            "clipped around the returns", "value: the factor 0.5 missing": "the factor 0.5 missing",
            "value: a Huber (smooth L1) error, unclipped branch": "a Huber (smooth L1) error",
            "value: a Huber (smooth L1) error, clipped branch": "a Huber (smooth L1) error in the clipped branch",
            "value: an absolute error": "an absolute error"}


# ---------------------------------------------------------------- 3. PPG's auxiliary phase
AUX_LOSS = '''
def ppg_aux_loss(logits, old_logits, value, aux_value, value_targets, beta_clone):
    old_log_probs = torch.log_softmax(old_logits, -1)
    kl = (old_log_probs.exp() * (old_log_probs - torch.log_softmax(logits, -1))).sum(-1).mean()
    aux_value_loss = 0.5 * ((aux_value - value_targets) ** 2).mean()
    true_value_loss = 0.5 * ((value - value_targets) ** 2).mean()
    return aux_value_loss + beta_clone * kl + true_value_loss, (aux_value_loss, kl, true_value_loss)
'''
# An independent phase, as a student might write it (no `agent` parameter, no distributed helpers).
PHASE = '''
def auxiliary_phase(forward_aux, optimizer, aux_obs, aux_value_targets, args, device, autocast):
    num_rollouts = aux_obs.shape[0]
    size = aux_rollouts_per_rank(args)
    with torch.no_grad():
        old_logits = forward_aux(aux_obs.flatten(0, 1))[0].view(num_rollouts, aux_obs.shape[1], -1)
    totals = torch.zeros(3)
    steps = 0
    for epoch in range(args.e_aux):
        order = torch.randperm(num_rollouts)
        for start in range(0, num_rollouts, size):
            rollouts = order[start : start + size]
            optimizer.zero_grad()
            for chunk in rollouts.chunk(args.n_aux_grad_accum):
                logits, value, aux_value = forward_aux(aux_obs[chunk].flatten(0, 1))
                loss, parts = ppg_aux_loss(logits, old_logits[chunk].flatten(0, 1), value, aux_value,
                                           aux_value_targets[chunk].flatten(), args.beta_clone)
                (loss * len(chunk) / len(rollouts)).backward()
                totals += torch.stack(parts).detach() * len(chunk) / len(rollouts)
            norms = torch.stack([torch.nn.utils.clip_grad_norm_(group["params"], args.max_grad_norm)
                                 for group in optimizer.param_groups])
            if not torch.isfinite(norms).all():
                raise FloatingPointError("non-finite auxiliary gradient")
            optimizer.step()
            steps += 1
    means = (totals / steps).tolist()
    return {"aux/aux_value_loss": means[0], "aux/kl": means[1], "aux/value_loss": means[2]}
'''
PPG_MUTANTS = {
    "KL in the wrong direction": ("loss", [("old_log_probs = torch.log_softmax(old_logits, -1)",
                                            "old_log_probs = torch.log_softmax(logits, -1)"),
                                           ("torch.log_softmax(logits, -1))).sum",
                                            "torch.log_softmax(old_logits, -1))).sum")]),
    "cross-entropy instead of KL": ("loss", [("(old_log_probs - torch.log_softmax(logits, -1))",
                                              "(-torch.log_softmax(logits, -1))")]),
    "L_value left out of the loss": ("loss", [("beta_clone * kl + true_value_loss, (", "beta_clone * kl, (")]),
    "beta_clone on the wrong term": ("loss", [("aux_value_loss + beta_clone * kl + true",
                                               "beta_clone * aux_value_loss + kl + true")]),
    "KL averaged over the actions": ("loss", [(".sum(-1).mean()", ".mean()")]),
    "pi_old each epoch": ("phase", [("        order = torch.randperm(num_rollouts)",
                                     "        with torch.no_grad():\n"
                                     "            old_logits = forward_aux(aux_obs.flatten(0, 1))[0]"
                                     ".view(num_rollouts, aux_obs.shape[1], -1)\n"
                                     "        order = torch.randperm(num_rollouts)")]),
    "no zero_grad": ("phase", [("            optimizer.zero_grad()\n", "")]),
    "pi_old not aligned with the shuffled rollouts": ("phase", [("old_logits[chunk]",
                                                                 "old_logits[start : start + size]")]),
    "no clipping": ("phase", [('torch.stack([torch.nn.utils.clip_grad_norm_(group["params"], args.max_grad_norm)\n'
                               '                                 for group in optimizer.param_groups])',
                               "torch.zeros(1)")]),
    "one epoch": ("phase", [("range(args.e_aux)", "range(1)")]),
    "chunks not weighted": ("phase", [("(loss * len(chunk) / len(rollouts)).backward()", "loss.backward()")]),
    # the procedure's classes of mistakes
    "zero_grad after the step": ("phase", [("            optimizer.zero_grad()\n", ""),
                                           ("            steps += 1", "            optimizer.zero_grad()\n"
                                                                     "            steps += 1")]),
    "never shuffled": ("phase", [("order = torch.randperm(num_rollouts)", "order = torch.arange(num_rollouts)")]),
    "shuffled once, not per epoch": ("phase", [("    for epoch in range(args.e_aux):\n        order = "
                                                "torch.randperm(num_rollouts)\n",
                                                "    order = torch.randperm(num_rollouts)\n"
                                                "    for epoch in range(args.e_aux):\n")]),
    "no error on a non-finite gradient": ("phase", [('raise FloatingPointError("non-finite auxiliary gradient")',
                                                     "pass")]),
    "statistics of the last epoch only": ("phase", [("        order = torch.randperm(num_rollouts)",
                                                     "        order = torch.randperm(num_rollouts)\n"
                                                     "        totals = torch.zeros(3)\n        steps = 0")]),
    "equal chunk weights": ("phase", [("(loss * len(chunk) / len(rollouts)).backward()",
                                       "(loss / args.n_aux_grad_accum).backward()"),
                                      ("* len(chunk) / len(rollouts)\n", "/ args.n_aux_grad_accum\n")]),
    "num_aux_rollouts used as given": ("phase", [("size = aux_rollouts_per_rank(args)",
                                                  "size = args.num_aux_rollouts")]),
    "pi_old computed with gradients": ("phase", [("    with torch.no_grad():\n        old_logits = forward_aux",
                                                  "    if True:\n        old_logits = forward_aux")]),
    "the buffer's targets overwritten": ("phase", [("    totals = torch.zeros(3)\n",
                                                    "    totals = torch.zeros(3)\n"
                                                    "    aux_value_targets -= aux_value_targets.mean()\n")]),
    "a Huber (smooth L1) error in L_aux": ("loss", [("0.5 * ((aux_value - value_targets) ** 2).mean()",
                                                  "F.smooth_l1_loss(aux_value, value_targets)")]),
    "float32 output on float64 input": ("loss", [("return aux_value_loss + beta_clone * kl + true_value_loss, (",
                                                  "return (aux_value_loss + beta_clone * kl + true_value_loss)"
                                                  ".float(), (")]),
}
MESSAGE = {  # mistakes told by the message, not by a hint
    "pi_old not aligned with the shuffled rollouts": "aux/kl should be 0",
    "the ratio detached": "no gradient reaches ratio",
    "never shuffled": "the rollouts are never shuffled",
    "shuffled once, not per epoch": "shuffled once, not in each epoch",
    "no error on a non-finite gradient": "did not raise FloatingPointError",
    "statistics of the last epoch only": "averaged over the minibatches of ALL 3 epochs",
    "equal chunk weights": "not by 1 / n_aux_grad_accum",
    "chunks not weighted": "not by 1 / n_aux_grad_accum",
    "num_aux_rollouts used as given": "aux_rollouts_per_rank(args)",
    "pi_old computed with gradients": "pi_old (or another stored tensor) was computed WITH gradients",
    "the buffer's targets overwritten": "modified the buffer",
    "float32 output on float64 input": "float64 inputs gave loss in torch.float32",
    "gae: float32 output on float64 input": "float64 inputs gave output in torch.float32",
    "gae: an input overwritten": "the input(s) values were modified in place",
    "gae: a new tensor on the CPU": "create new tensors on the inputs' device",
    "python min on tensors": "use the elementwise torch.minimum",
    "the score index a float": "use mask.sum(1).long() - 1",
    "the KL overwritten in place": "the input(s) kl were modified in place",
    "lambda_ only a float": "lambda_ may be a per-step tensor",
    "no trailing dimensions": "the inputs may have trailing dims",
    "policy: float64 input, float32 output": "float64 inputs gave output in torch.float32",
    "the scores overwritten in place": "the input(s) scores were modified in place",
}


# ---------------------------------------------------------------- 4. V-trace
VTRACE = '''
def from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold=1.0,
                            clip_c_threshold=1.0, clip_pg_rho_threshold=1.0, lambda_=1.0):
    def clip(x, threshold):
        return x if threshold is None else torch.clamp(x, max=threshold)
    rhos = torch.exp(log_rhos)
    cs = lambda_ * clip(rhos, clip_c_threshold)
    next_values = torch.cat([values[1:], bootstrap_value[None]])
    deltas = clip(rhos, clip_rho_threshold) * (rewards + discounts * next_values - values)
    running = torch.zeros_like(bootstrap_value)
    corrections = []
    for s in reversed(range(values.shape[0])):
        running = deltas[s] + discounts[s] * cs[s] * running
        corrections.append(running)
    vs = values + torch.stack(corrections[::-1])
    next_vs = torch.cat([vs[1:], bootstrap_value[None]])
    pg_advantages = clip(rhos, clip_pg_rho_threshold) * (rewards + discounts * next_vs - values)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)
'''
VTRACE_MUTANTS = {
    "c_bar truncated with rho_bar": [("lambda_ * clip(rhos, clip_c_threshold)",
                                      "lambda_ * clip(rhos, clip_rho_threshold)")],
    "lambda ignored": [("lambda_ * clip(rhos, clip_c_threshold)", "clip(rhos, clip_c_threshold)")],
    "pg target with V(x_{s+1})": [("(rewards + discounts * next_vs - values)",
                                   "(rewards + discounts * next_values - values)")],
    "pg weight truncated with rho_bar": [("clip(rhos, clip_pg_rho_threshold)", "clip(rhos, clip_rho_threshold)")],
    "no discount in the trace": [("deltas[s] + discounts[s] * cs[s] * running", "deltas[s] + cs[s] * running")],
    "log_rhos used as ratios": [("rhos = torch.exp(log_rhos)", "rhos = log_rhos")],
    "off-by-one bootstrap": [("next_values = torch.cat([values[1:], bootstrap_value[None]])",
                              "next_values = torch.cat([values[1:], values[-1:]])"),
                             ("next_vs = torch.cat([vs[1:], bootstrap_value[None]])",
                              "next_vs = torch.cat([vs[1:], values[-1:]])")],
    # every documented input form
    "lambda_ only a float": [("cs = lambda_ * clip(rhos, clip_c_threshold)",
                              "cs = float(lambda_) * clip(rhos, clip_c_threshold)")],
    "no trailing dimensions": [("    running = torch.zeros_like(bootstrap_value)",
                                "    T, B = values.shape\n    running = torch.zeros_like(bootstrap_value)")],
}


# ---------------------------------------------------------------- 5. RLHF
REWARDS = '''
def per_token_rewards(kl, scores, mask, beta):
    rewards = -beta * kl * mask
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(scores)), last] += scores
    return rewards
'''
BT = '''
def bradley_terry_loss(r_chosen, r_rejected):
    return -F.logsigmoid(r_chosen - r_rejected).mean()
'''
RLHF_MUTANTS = {
    "the KL penalty on the last token only": [
        ("rewards = -beta * kl * mask", "rewards = torch.zeros_like(kl)"),
        ("] += scores", "] += scores - beta * (kl * mask).sum(1)")],
    "the score at the tensor's final position": [("rewards[torch.arange(len(scores)), last]", "rewards[:, -1]")],
    "the score one token past the end": [("last = mask.sum(1).long() - 1",
                                          "last = mask.sum(1).long().clamp(max=mask.shape[1] - 1)")],
    "the score on every token": [("rewards[torch.arange(len(scores)), last] += scores",
                                  "rewards = rewards + scores[:, None] * mask")],
    "the KL penalty with the wrong sign": [("rewards = -beta * kl * mask", "rewards = beta * kl * mask")],
    "the KL penalty past the response's end": [("rewards = -beta * kl * mask", "rewards = -beta * kl")],
    "the sign flipped": [("F.logsigmoid(r_chosen - r_rejected)", "F.logsigmoid(r_rejected - r_chosen)")],
    "log(sigmoid(x)) overflows": [("F.logsigmoid(r_chosen - r_rejected)",
                                   "torch.log(torch.sigmoid(r_chosen - r_rejected))")],
    "sum instead of mean": [(").mean()", ").sum()")],
    "sigma without the log": [("-F.logsigmoid(r_chosen - r_rejected)", "-torch.sigmoid(r_chosen - r_rejected)")],
    # inputs never modified in place; an index must be an integer tensor
    "the KL overwritten in place": [("rewards = -beta * kl * mask", "rewards = kl.mul_(mask).mul_(-beta)")],
    "the score index a float": [("last = mask.sum(1).long() - 1", "last = mask.sum(1) - 1")],
}


# ---------------------------------------------------------------- 6. GRPO and RLOO
GRPO = '''
def group_relative_advantages(scores, group_size, eps=1e-4):
    groups = scores.view(-1, group_size)
    mean = groups.mean(1, keepdim=True)
    std = groups.std(1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)
'''
RLOO = '''
def leave_one_out_advantages(scores, group_size):
    groups = scores.view(-1, group_size)
    baseline = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).view(-1)
'''
STRIDED = [("groups = scores.view(-1, group_size)", "groups = scores.view(group_size, -1).T"),
           (").view(-1)", ").T.reshape(-1)")]
GROUP_MUTANTS = {  # (which source, replacements)
    "the population std (ddof 0)": ("grpo", [("groups.std(1, keepdim=True)", "groups.std(1, keepdim=True, unbiased=False)")]),
    "no eps in the denominator": ("grpo", [("(std + eps)", "std")]),
    "eps inside the square root": ("grpo", [("(std + eps)", "(groups.var(1, keepdim=True) + eps).sqrt()")]),
    "not divided by the std": ("grpo", [("((groups - mean) / (std + eps))", "(groups - mean)")]),
    "grpo: groups strided, not consecutive": ("grpo", STRIDED),
    "mean and std over the whole batch": ("grpo", [("groups = scores.view(-1, group_size)", "groups = scores.view(1, -1)")]),
    "the baseline includes the response itself": ("rloo", [("(groups.sum(1, keepdim=True) - groups) / (group_size - 1)",
                                                             "groups.mean(1, keepdim=True)")]),
    "divided by k, not k - 1": ("rloo", [("/ (group_size - 1)", "/ group_size")]),
    "rloo: groups strided, not consecutive": ("rloo", STRIDED),
    "the baseline over the whole batch": ("rloo", [("groups = scores.view(-1, group_size)", "groups = scores.view(1, -1)"),
                                                   ("/ (group_size - 1)", "/ (scores.numel() - 1)")]),
    "the sign flipped": ("rloo", [("(groups - baseline)", "(baseline - groups)")]),
    "the scores overwritten in place": ("rloo", [("    return (groups - baseline).view(-1)",
                                                  "    groups -= baseline\n    return groups.view(-1)")]),
}
HARMLESS_GROUPS = ['''
def group_relative_advantages(scores, group_size, eps=1e-4):
    out = torch.empty_like(scores)
    for start in range(0, len(scores), group_size):
        group = scores[start:start + group_size]
        out[start:start + group_size] = (group - group.mean()) / (group.var(unbiased=True).sqrt() + eps)
    return out
''', '''
def leave_one_out_advantages(scores, group_size):
    groups = scores.reshape(-1, group_size)
    return (group_size / (group_size - 1) * (groups - groups.mean(-1, keepdim=True))).flatten()
''']


def mutate(source, replacements):
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


CORRECT = {"gae": [GAE], "ppo_loss": [POLICY_LOSS, VALUE_LOSS], "ppg_aux": [AUX_LOSS, PHASE], "vtrace": [VTRACE],
           "rlhf": [REWARDS, BT], "grpo_rloo": [GRPO, RLOO]}

# Harmless variants: other correct ways to write each piece. Correct code must never fail.
HARMLESS_GAE = '''
def compute_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    next_values = torch.cat([values[1:], next_value[None]])
    nonterminal = 1.0 - torch.cat([dones[1:], next_done[None]])
    deltas = rewards + gamma * next_values * nonterminal - values
    pieces = []
    running = torch.zeros_like(next_value)
    for t in range(rewards.shape[0] - 1, -1, -1):
        running = deltas[t] + gamma * gae_lambda * nonterminal[t] * running
        pieces.append(running)
    return torch.stack(pieces[::-1])
'''
HARMLESS_PPO = ['''
def policy_loss(ratio, advantages, kl, kind, clip_coef, kl_beta):
    if kind == "kl-penalty":
        return (kl_beta * kl - ratio * advantages).mean()
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef) * advantages)
    return -surrogate.sum() / ratio.numel()
''', '''
def value_loss(new_value, old_value, returns, clip_coef, clip_vloss):
    if not clip_vloss:
        return 0.5 * F.mse_loss(new_value, returns)
    clipped = torch.clamp(new_value, old_value - clip_coef, old_value + clip_coef)
    return 0.5 * torch.maximum((new_value - returns).pow(2), (clipped - returns).pow(2)).mean()
''']
HARMLESS_PPG = ['''
def ppg_aux_loss(logits, old_logits, value, aux_value, value_targets, beta_clone):
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(old_logits, -1), log_target=True, reduction="batchmean")
    aux_value_loss = 0.5 * F.mse_loss(aux_value, value_targets)
    true_value_loss = 0.5 * F.mse_loss(value, value_targets)
    return aux_value_loss + beta_clone * kl + true_value_loss, (aux_value_loss, kl, true_value_loss)
''', '''
def auxiliary_phase(forward_aux, optimizer, aux_obs, aux_value_targets, args, device, autocast):
    rollouts, steps = aux_obs.shape[:2]
    with torch.no_grad():
        old_logits = torch.stack([forward_aux(obs)[0] for obs in aux_obs])
    sums = [0.0, 0.0, 0.0]
    count = 0
    for epoch in range(args.e_aux):
        for minibatch in torch.randperm(rollouts).split(aux_rollouts_per_rank(args)):
            optimizer.zero_grad(set_to_none=True)
            for chunk in minibatch.tensor_split(min(args.n_aux_grad_accum, len(minibatch))):
                with autocast():
                    logits, value, aux_value = forward_aux(aux_obs[chunk].reshape(-1, *aux_obs.shape[2:]))
                weight = len(chunk) / len(minibatch)
                loss, parts = ppg_aux_loss(logits, old_logits[chunk].reshape(len(chunk) * steps, -1), value,
                                           aux_value, aux_value_targets[chunk].reshape(-1), args.beta_clone)
                (weight * loss).backward()
                sums = [total + weight * part.item() for total, part in zip(sums, parts)]
            average_gradients(optimizer)
            if not torch.isfinite(clip_grad_norms(optimizer, args.max_grad_norm)).all():
                raise FloatingPointError("the auxiliary gradient is not finite")
            optimizer.step()
            count += 1
    return {"aux/aux_value_loss": sums[0] / count, "aux/kl": sums[1] / count, "aux/value_loss": sums[2] / count}
''']
HARMLESS_VTRACE = '''
def from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold=1.0,
                            clip_c_threshold=1.0, clip_pg_rho_threshold=1.0, lambda_=1.0):
    rhos = log_rhos.exp()
    inf = float("inf")
    rho_bar = rhos.clamp(max=inf if clip_rho_threshold is None else clip_rho_threshold)
    c = lambda_ * rhos.clamp(max=inf if clip_c_threshold is None else clip_c_threshold)
    pg_rho = rhos.clamp(max=inf if clip_pg_rho_threshold is None else clip_pg_rho_threshold)
    shape = torch.broadcast_shapes(log_rhos.shape, discounts.shape, rewards.shape, values.shape)
    vs = torch.zeros(shape, dtype=values.dtype, device=values.device)
    next_v = bootstrap_value
    correction = torch.zeros_like(bootstrap_value)
    for s in reversed(range(shape[0])):
        delta = rho_bar[s] * (rewards[s] + discounts[s] * next_v - values[s])
        correction = delta + discounts[s] * c[s] * correction
        vs[s] = values[s] + correction
        next_v = values[s]
    pg = torch.zeros_like(vs)
    for s in range(shape[0]):
        next_vs = vs[s + 1] if s + 1 < shape[0] else bootstrap_value
        pg[s] = pg_rho[s] * (rewards[s] + discounts[s] * next_vs - values[s])
    return VTraceReturns(vs=vs, pg_advantages=pg)
'''
HARMLESS_RLHF = ['''
def per_token_rewards(kl, scores, mask, beta):
    last = (mask.sum(1) - 1).long()
    return -beta * kl * mask + scores[:, None] * F.one_hot(last, mask.shape[1]).to(kl.dtype)
''', '''
def bradley_terry_loss(r_chosen, r_rejected):
    return F.softplus(r_rejected - r_chosen).mean()
''']
HARMLESS_TOLIST = '''
def per_token_rewards(kl, scores, mask, beta):
    rewards = -beta * kl * mask
    for row, length in enumerate(mask.sum(1).long().tolist()):
        rewards[row, length - 1] = rewards[row, length - 1] + scores[row]
    return rewards
'''
HARMLESS = {"gae, vectorised deltas and a stacked list": ("gae", [HARMLESS_GAE]),
            "ppo losses with torch.minimum, F.mse_loss and tensor clamp bounds": ("ppo_loss", HARMLESS_PPO),
            "ppg with F.kl_div and a phase over index splits": ("ppg_aux", HARMLESS_PPG),
            "v-trace written into a zeros_like buffer": ("vtrace", [HARMLESS_VTRACE]),
            "rlhf with one_hot and softplus": ("rlhf", HARMLESS_RLHF),
            "ppg's phase with the repository's loss": ("ppg_aux", [HARMLESS_PPG[1]]),
            "rlhf with lengths as a Python list (.tolist())": ("rlhf", [HARMLESS_TOLIST, BT]),
            "grpo by a loop over groups, rloo as k / (k - 1) times the centred score": ("grpo_rloo", HARMLESS_GROUPS)}


def mutant_cases():
    cases = []
    for name, replacements in GAE_MUTANTS.items():
        cases.append(("gae", name, [mutate(GAE, replacements)], GAE_HINT.get(name, name)))
    for name, replacements in PPO_LOSS_MUTANTS.items():
        sources = [POLICY_LOSS, VALUE_LOSS]
        index = 1 if name.startswith("value:") else 0
        sources[index] = mutate(sources[index], replacements)
        cases.append(("ppo_loss", name, sources, PPO_HINT.get(name, name)))
    for name, (part, replacements) in PPG_MUTANTS.items():
        sources = [mutate(AUX_LOSS, replacements), PHASE] if part == "loss" else [AUX_LOSS, mutate(PHASE, replacements)]
        cases.append(("ppg_aux", name, sources, name))
    for name, replacements in VTRACE_MUTANTS.items():
        cases.append(("vtrace", name, [mutate(VTRACE, replacements)], name))
    for name, replacements in RLHF_MUTANTS.items():
        sources = [REWARDS, BT]
        index = 1 if "F.logsigmoid" in replacements[0][0] or replacements[0][0] == ").mean()" else 0
        sources[index] = mutate(sources[index], replacements)
        cases.append(("rlhf", name, sources, name))
    for name, (which, replacements) in GROUP_MUTANTS.items():
        sources = [mutate(GRPO, replacements), RLOO] if which == "grpo" else [GRPO, mutate(RLOO, replacements)]
        cases.append(("grpo_rloo", name, sources, name.split(": ", 1)[-1]))
    return cases


def test_every_exercise_has_at_least_five_planted_mistakes():
    counts = {}
    for exercise, *_ in mutant_cases():
        counts[exercise] = counts.get(exercise, 0) + 1
    assert set(counts) == set(EXERCISES) and min(counts.values()) >= 5, counts


@pytest.mark.parametrize("exercise", EXERCISES)
def test_graders_pass_on_the_scripts_own_functions(exercise):
    module = grade.load_script(os.path.join(ROOT, SCRIPT_OF[exercise]))
    assert grade.check(exercise, module) >= 3


@pytest.mark.parametrize("exercise", EXERCISES)
def test_graders_pass_on_independent_correct_solutions(exercise):
    grade.check(exercise, with_functions(exercise, *CORRECT[exercise]))


@pytest.mark.parametrize("name", HARMLESS)
def test_graders_pass_on_harmless_variants(name):
    exercise, sources = HARMLESS[name]
    grade.check(exercise, with_functions(exercise, *sources))


@pytest.mark.parametrize("exercise,mistake,sources,hint", mutant_cases(), ids=lambda x: x if isinstance(x, str) and
                         len(x) < 60 else None)
def test_graders_catch_the_mistake_and_name_it(exercise, mistake, sources, hint):
    message = failure(exercise, with_functions(exercise, *sources))
    expected = MESSAGE.get(mistake, f"hint ({hint})")
    assert expected in message, message
    assert "expected" in message or "hint" in message or "gradient" in message  # in the reader's terms


def test_a_failure_shows_the_case_its_inputs_and_expected_vs_got():
    message = failure("gae", with_functions("gae", mutate(GAE, GAE_MUTANTS["dones[t] used for dones[t + 1]"])))
    assert "FAIL 0/1  compute_gae [ppo_procgen.py]: an episode ends inside the rollout" in message
    assert "no end in the rollout" not in message  # case 1 has no episode end: it passes
    for part in ("differs from the definition", "next_done  = [0.]", "expected:", "got:",
                 "first difference at [",
                 "dones[t] is used where dones[t + 1] belongs"):
        assert part in message, (part, message)


def test_every_case_runs_and_scores_on_its_own():
    """A failure does not stop the rest: a wrong compute_gae still gets the cases without an episode end."""
    module = with_functions("gae", mutate(GAE, GAE_MUTANTS["dones[t] used for dones[t + 1]"]))
    results = grade.check_modules("gae", {"ppo_procgen.py": module})
    gae = [r for r in results if r.item.startswith("compute_gae")]
    points, total = grading.score(gae)
    assert total == len(gae) and 0 < points < total
    assert [r.passed for r in gae if "no end in the rollout" in r.item] == [True]


def test_the_copies_of_a_blank_in_the_file_it_trains_with_are_graded_and_must_agree():
    wrong = mutate(GAE, GAE_MUTANTS["no reset at episode ends"])
    ppg = with_functions("ppg_aux", AUX_LOSS, PHASE, wrong)  # ppg_aux passes, its compute_gae does not
    message = failure("ppg_aux", ppg)
    assert "compute_gae [ppg_procgen.py]" in message and "hint (no reset at episode ends)" in message
    ppo = with_functions("gae", GAE)
    results = grade.check_modules("gae", {"ppo_procgen.py": ppo, "ppg_procgen.py": ppg})
    agree = [r for r in results if "the copies in ppo_procgen.py and ppg_procgen.py agree" in r.item]
    assert [r.passed for r in agree] == [False]
    assert "the copies give different answers" in agree[0].message


def test_the_public_cases_are_the_references_answers(tmp_path):
    """exercises/cases/*.json (what the bundle ships) are what `instructor.py make-cases` writes today."""
    instructor.make_public_cases(str(tmp_path))
    for function in instructor.PUBLIC:
        shipped = json.loads(open(os.path.join(grading.CASES_DIR, f"{function}.json")).read())
        fresh = json.loads((tmp_path / f"{function}.json").read_text())
        # Equal up to rounding: numpy's and torch's log, exp and reductions round differently on different CPUs
        # and builds (SIMD code paths; a float32 case's gradients differ by ~1e-9 between torch's CPU and CUDA
        # builds), and cases written on one machine must not fail on another. A changed reference moves far more.
        assert same_up_to_rounding(shipped, fresh), f"{function}: run python exercises/instructor.py make-cases"


def same_up_to_rounding(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-7, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_up_to_rounding(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_up_to_rounding(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_instructor_batch_scores_every_case_with_hidden_cases_per_student(tmp_path):
    submissions = tmp_path / "submissions"
    source = open(os.path.join(ROOT, "vtrace.py")).read()
    wrong = mutate(VTRACE, VTRACE_MUTANTS["c_bar truncated with rho_bar"])
    for student, extra in (("alice", ""), ("bob", wrong)):
        (submissions / student).mkdir(parents=True)
        (submissions / student / "vtrace.py").write_text(source + "\n" + extra)  # a later def replaces the first
    out = tmp_path / "grades"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "exercises", "instructor.py"), "batch",
                             str(submissions), "--out", str(out), *([] if os.geteuid() == 0 else ["--unsafe-same-user"])],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, GRADER_SECRET="s3"))
    assert result.returncode == 0, result.stderr
    with open(out / "grades.csv") as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"alice", "bob"} and rows["alice"]["points"] == rows["alice"]["max_points"]
    assert float(rows["bob"]["points"]) < float(rows["bob"]["max_points"]) == float(rows["alice"]["max_points"])
    alice, bob = (json.loads((out / f"{name}.json").read_text()) for name in ("alice", "bob"))
    assert alice["seed"] != bob["seed"]
    cases = bob["exercises"]["vtrace"]["cases"]
    assert any(c["hidden"] for c in cases) and any(c["passed"] for c in cases) and not all(c["passed"] for c in cases)
    assert "hint (c_bar truncated with rho_bar)" in (out / "bob.txt").read_text()
    again = instructor.hidden_cases("from_importance_weights", alice["seed"])
    assert [c.name for c in again] == [c["item"].split(": ", 1)[1] for c in alice["exercises"]["vtrace"]["cases"]
                                        if c["hidden"]]


# ---------------------------------------------------------------- starter code: the student bundle
@pytest.fixture(scope="module")
def starter(tmp_path_factory):
    out = tmp_path_factory.mktemp("starter")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "exercises", "make_starter.py"), "--exercises",
                             ",".join(EXERCISES), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return out


def bodies(source, names):
    """{name: (the body's text, its stripped lines of 30 characters or more)} of the named functions, docstrings
    left out."""
    lines = source.splitlines(keepends=True)
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) and len(node.body) > 1 else node.body
            text = "".join(lines[body[0].lineno - 1:node.end_lineno])
            found[node.name] = (text, [line.strip() for line in text.splitlines() if len(line.strip()) >= 30])
    return found


def test_the_bundle_ships_no_solution(starter):
    bundle = sorted(p.relative_to(starter).as_posix() for p in starter.rglob("*") if p.is_file())
    graders = [name for name in bundle if name.startswith("exercises/")]
    assert not [name for name in graders if name.split("/")[-1] in ("references.py", "instructor.py",
                                                                     "make_starter.py", "silent_bugs.py")]
    texts = {name: (starter / name).read_text() for name in bundle}
    solutions = {}
    for script in ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py"):
        real = open(os.path.join(ROOT, script)).read()
        for name, (text, lines) in bodies(real, STUB_TEXT).items():
            solutions[f"{script}:{name}"] = lines
            assert text not in texts[script], (script, name)
            outside = real.replace(text, "")
            for line in lines:  # a blanked body's line is in the starter script only where it is elsewhere too
                assert texts[script].count(line) <= outside.count(line), (script, name, line)
    source = open(os.path.join(ROOT, "exercises", "references.py")).read()
    functions = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    for name, (text, lines) in bodies(source, functions).items():
        solutions[f"references.py:{name}"] = lines
    source = open(os.path.join(ROOT, "exercises", "instructor.py")).read()
    phase = bodies(source, {"reference_phase"})["reference_phase"][1]  # its set-up is the grader's own
    start = [line.startswith("epochs = ") for line in phase].index(True)
    solutions["instructor.py:reference_phase"] = phase[start:]
    for name in graders:
        leaked = [(where, line) for where, lines in solutions.items() for line in lines if line in texts[name]]
        assert not leaked, (name, leaked[:3])


def test_a_bundle_outside_the_repository_grades_without_it(tmp_path):
    """What a student does: fill in the stub, run the bundle's grader; nothing is imported from the repository."""
    starter = tmp_path / "starter"
    subprocess.run([sys.executable, os.path.join(ROOT, "exercises", "make_starter.py"), "--exercises", "gae",
                    "--out", str(starter)], check=True, capture_output=True, timeout=120)
    source = (starter / "ppo_procgen.py").read_text()
    head, rest = source.split("def compute_gae(", 1)
    signature_and_doc, stub_and_after = rest.split("    # Exercise gae: your code here", 1)
    after = stub_and_after.split('""")\n', 1)[1]
    body = GAE.split("gae_lambda):\n", 1)[1]  # the solution's body, indented as a body
    (tmp_path / "ppo_procgen.py").write_text(head + "def compute_gae(" + signature_and_doc + body + after)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from exercises import grade; "
             "ok = grade.grade('gae', sys.argv[2], train=False, out=print); "
             "root = sys.argv[3] + '/'; venv = sys.prefix + '/'; "  # a virtual environment may live in the clone
             "mine = [m.__file__ for m in list(sys.modules.values()) if (getattr(m, '__file__', None) or '')"
             ".startswith(root) and not m.__file__.startswith(venv)]; print('FROM REPO', mine); "
             "sys.exit(0 if ok and not mine else 1)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", probe, str(starter), str(tmp_path / "ppo_procgen.py"), ROOT],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0 and "PASS" in result.stdout and "FROM REPO []" in result.stdout, \
        result.stdout + result.stderr


def test_starter_blanks_every_copy_of_each_function_with_the_same_stub(starter):
    blanked = {script: [name for name in STUB_TEXT if f"def {name}(" in (starter / script).read_text()]
               for script in ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py")}
    stubs = {}
    for script, names in blanked.items():
        source = (starter / script).read_text()
        for name in names:
            block = source.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0].split("\nclass ", 1)[0]
            body = block.split('raise NotImplementedError("""', 1)[1]  # every chosen function is a stub
            stubs.setdefault(name, set()).add(body.split('""")', 1)[0])
    assert set(stubs) == set(STUB_TEXT)
    assert all(len(versions) == 1 for versions in stubs.values())  # compute_gae etc.: one stub in both scripts
    assert set(blanked["ppg_procgen.py"]) >= {"compute_gae", "policy_loss", "value_loss", "ppg_aux_loss",
                                               "auxiliary_phase"}
    assert (starter / "exercises" / "grade.py").exists()


def test_starter_scripts_import_run_their_untouched_parts_and_their_blanks_fail_with_the_text(starter):
    import torch

    modules = {script: grade.load_script(str(starter / script))
               for script in ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py")}
    logits = torch.randn(4, 15)
    ppo = modules["ppo_procgen.py"]
    assert ppo.categorical_kl(logits, logits).abs().max() < 1e-6  # untouched
    agent = ppo.Agent(ppo.Args(channels=(4,), hidden_size=16), num_actions=15)
    assert agent(torch.zeros(2, 64, 64, 3, dtype=torch.uint8))[0].shape == (2, 15)
    ppg = modules["ppg_procgen.py"]
    assert ppg.aux_rollouts_per_rank(ppg.Args(num_envs=64), 1) == 4
    vtrace = modules["vtrace.py"]
    assert vtrace.action_log_probs(logits[None], torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4)
    rlhf = modules["ppo_rlhf_toy.py"]
    assert rlhf.response_mask(torch.tensor([[5, rlhf.EOS, rlhf.PAD]])).tolist() == [[1.0, 1.0, 0.0]]
    with pytest.raises(NotImplementedError, match="Exercise gae"):
        ppo.compute_gae(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(1), torch.zeros(1),
                        0.9, 0.9)
    for exercise, info in EXERCISES.items():
        message = failure(exercise, modules[info["script"]])
        first = info["functions"][0]
        assert f"{first} is still a blank" in message
        assert STUB_TEXT[first].splitlines()[0] in message  # the exercise's text


def test_grader_command_on_a_starter_copy_exits_1_with_the_text(starter):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "exercises", "grade.py"), "rlhf",
                             str(starter / "ppo_rlhf_toy.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "per_token_rewards is still a blank" in result.stdout and "index mask.sum(1) - 1" in result.stdout
    assert "score: 0 / " in result.stdout and "training skipped" in result.stdout


def test_the_pytest_route_grades_only_what_a_script_holds_without_marker_warnings(starter):
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "exercises", "--no-train"]
    own = subprocess.run(command + ["-m", "vtrace"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert own.returncode == 0 and "1 passed" in own.stdout, own.stdout + own.stderr
    blank = subprocess.run(command + ["--script", str(starter / "vtrace.py")], capture_output=True, text=True,
                           timeout=120, cwd=starter)  # the starter folder: outside the repository, no pytest.ini
    skipped = len(EXERCISES) - 1
    assert blank.returncode == 1 and f"1 failed, {skipped} skipped" in blank.stdout, blank.stdout
    assert "from_importance_weights is still a blank" in blank.stdout
    assert "does not hold exercise gae (compute_gae is in ppo_procgen.py)" in blank.stdout
    assert "PytestUnknownMarkWarning" not in blank.stdout + blank.stderr


# ---------------------------------------------------------------- the whole grade, training included
def reuse_the_run_for_its_flags(monkeypatch, run_args, returned):
    """The scripts the grade loads train by returning what the shared run at `run_args` returned when asked for
    its flags (other flags train), so that a run other tests read is trained once (conftest.py)."""
    load_script = grade.load_script

    def load_and_reuse(path):
        module = load_script(path)
        train = module.train

        def train_or_reuse(args):
            asked = dict(dataclasses.asdict(args), save_model=run_args.save_model)  # saving changes no number
            return returned if asked == dataclasses.asdict(run_args) else train(args)
        module.train = train_or_reuse
        return module
    monkeypatch.setattr(grade, "load_script", load_and_reuse)


@pytest.mark.exercise_training
@pytest.mark.parametrize("exercise", ["ppg_aux", "rlhf"])  # PPG trains with the student's phase; RLHF reads its own
def test_full_grade_with_training_passes_and_prints_the_curve(exercise, request, monkeypatch):
    """The grades' flags are those of the test run's shared runs: test_rlhf.py's end-to-end run, PPG's learning run."""
    if exercise == "rlhf":
        run = request.getfixturevalue("rlhf_tiny_run")
        reuse_the_run_for_its_flags(monkeypatch, run.args, run.summary)
    else:
        run = request.getfixturevalue("ppg_cue_run")
        reuse_the_run_for_its_flags(monkeypatch, run.args, run.run_dir)
    lines = []
    start = time.time()
    passed = grade.grade(exercise, out=lines.append)
    print(f"{exercise}: {time.time() - start:.0f} s\n" + "\n".join(lines))
    assert passed, "\n".join(lines)
    text = "\n".join(lines)
    assert "start" in text and "->" in text and "Informational only" in text  # the curve, and what it is worth


def test_the_learning_curve_is_informational():
    flat = [{"charts/episodic_return": 0.5, "iteration": i} for i in range(1, 13)] + [{"eval/episodic_return": 0.6}]
    lines = []
    assert grade.judge_cue(flat, 10.0, lines.append) is False
    assert "did not learn" in lines[-1] and "Informational only" in lines[-1]
    score = {"gold/score": 0.0, "proxy/score": 0.0, "objective/kl": 0.0}
    summary = {"rm": {"rm/heldout_acc": 0.45, "rm/heldout_acc_gold": 0.4}, "sft": score, "ppo": {"0.05": score},
               "histories": {0.05: [score, score]}}
    assert grade.judge_rlhf(summary, 10.0, lines.append) is False


def test_training_that_reaches_another_blank_says_which(starter):
    module = grade.load_script(str(starter / "ppo_procgen.py"))  # every exercise blanked
    for source in (POLICY_LOSS, VALUE_LOSS):
        exec(source, module.__dict__)  # noqa: S102 - ppo_loss filled in, compute_gae still blank
    results = grade.check_modules("ppo_loss", {"ppo_procgen.py": module})
    assert all(r.passed for r in results if not r.item.startswith("compute_gae"))
    assert all("compute_gae is still a blank" in r.message for r in results if r.item.startswith("compute_gae"))
    with pytest.raises(grade.Failed, match="another blank of this script") as info:
        grade.train_and_judge(module, lambda line: None)
    assert "Exercise gae" in str(info.value)


# ---------------------------------------------------------------- silent-bug exercises
def test_every_silent_bug_is_one_exact_line_and_a_changed_script_fails_loudly(tmp_path):
    written = silent_bugs.make(str(tmp_path))
    for name, path in zip(silent_bugs.BUGS, written):
        bug = silent_bugs.BUGS[name]
        original = open(os.path.join(ROOT, bug["script"])).read().splitlines()
        planted = open(path).read().splitlines()
        changed = [(old, new) for old, new in zip(original, planted) if old != new]
        assert len(original) == len(planted) and len(changed) == 1, name
        assert changed[0][0].strip() == bug["line"] and changed[0][1].strip() == bug["bug"]
        readme = open(os.path.join(os.path.dirname(path), "README.txt")).read()
        assert bug["symptom"] in readme and bug["bug"] not in readme  # the symptom, not the bug
    source = open(os.path.join(ROOT, "ppo_procgen.py")).read()
    bug = silent_bugs.BUGS["advantage-normalization"]
    with pytest.raises(silent_bugs.BugNotFound, match="found it 0 times .the script changed: update BUGS.") as info:
        silent_bugs.plant(source.replace(bug["line"], "mean, std = advantages_moments(mb_advantages)"),
                          "advantage-normalization")
    assert len(str(info.value).splitlines()) == 1


@pytest.mark.exercise_training
def test_the_silent_bug_check_fails_on_the_bug_and_passes_on_the_fix(tmp_path):
    (path,) = silent_bugs.make(str(tmp_path), ["entropy-sign"])
    lines = []
    assert not silent_bugs.check("entropy-sign", path, lines.append)
    assert "does not train as the reference does" in lines[-1] and "losses/" in lines[-1]
    assert silent_bugs.check("entropy-sign", os.path.join(ROOT, "vtrace.py"), lines.append)


def test_a_function_that_never_returns_costs_its_cases_not_the_grade(monkeypatch):
    monkeypatch.setattr(grading, "CASE_SECONDS", 0.5)
    endless = GAE.replace("    T = rewards.shape[0]\n", "    T = rewards.shape[0]\n    while T:\n        pass\n")
    results = grade.check_modules("gae", {"ppo_procgen.py": with_functions("gae", endless)})
    gae = [r for r in results if r.item.startswith("compute_gae")]
    assert not any(r.passed for r in gae) and "ran past 0.5 s" in gae[0].message
    assert all("not run" in r.message for r in gae[1:])
    assert all(r.passed for r in results if not r.item.startswith("compute_gae"))  # the other functions still run
