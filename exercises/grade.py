"""Grade one exercise: check the function(s) against a naive float64 reference, then train the script with them.

  python exercises/grade.py EXERCISE [PATH] [--no-train]

EXERCISE is one of gae, ppo_loss, ppg_aux, vtrace, rlhf; PATH is the student's copy of the script (made by
exercises/make_starter.py, the blank filled in), by default the repository's own script. Exit status 0 when every
check passes. The references are exercises/references.py; the exercises' texts are exercises/texts.py."""
import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import io
import json
import math
import os
import shutil
import sys
import tempfile
import textwrap
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from exercises import references as ref  # noqa: E402
from exercises.cue_env import patch as patch_cue_env  # noqa: E402
from exercises.texts import EXERCISES  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6  # float64 inputs: a correct answer agrees to ~1e-12; float32 work inside still passes


class Failed(Exception):
    """A check failed; the message is for the student."""


# ---------------------------------------------------------------- loading a script
def load_script(path):
    """Import a script from its file path as a fresh module (nothing in a script runs at import time)."""
    path = os.path.abspath(path)
    name = f"graded_{os.path.splitext(os.path.basename(path))[0]}_{abs(hash((path, time.time_ns())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def exercise_text(error):
    """The stub's message (the exercise's text), indented for the report."""
    return textwrap.indent(textwrap.dedent(str(error)).strip(), "    ")


def default_path(exercise):
    return os.path.join(ROOT, EXERCISES[exercise]["script"])


# ---------------------------------------------------------------- cases and comparison
@dataclasses.dataclass
class Case:
    name: str
    inputs: dict  # keyword -> numpy array (becomes a float64 tensor) or a plain value
    grad: tuple = ()  # inputs whose gradient (of the first output) is checked against the reference's


def as_tensors(inputs, grad=()):
    tensors = {}
    for key, value in inputs.items():
        if isinstance(value, np.ndarray):
            value = torch.tensor(value, dtype=torch.float64, requires_grad=key in grad)
        tensors[key] = value
    return tensors


def outputs_of(function_name, result):
    """The student's result as a list of numpy arrays, in the reference's order."""
    if function_name == "ppg_aux_loss":
        if not (isinstance(result, tuple) and len(result) == 2 and len(result[1]) == 3):
            raise Failed("ppg_aux_loss must return (loss, (aux_value_loss, kl, true_value_loss)); got "
                         f"{type(result).__name__} {result!r:.200}")
        items = [result[0], *result[1]]
    elif function_name == "from_importance_weights":
        if hasattr(result, "vs") and hasattr(result, "pg_advantages"):
            items = [result.vs, result.pg_advantages]
        elif isinstance(result, tuple) and len(result) == 2:
            items = list(result)
        else:
            raise Failed(f"from_importance_weights must return VTraceReturns(vs=..., pg_advantages=...); got "
                         f"{type(result).__name__}")
    else:
        items = [result]
    arrays = []
    for item in items:
        if not torch.is_tensor(item):
            raise Failed(f"{function_name} must return torch tensors (so the gradient can flow); got "
                         f"{type(item).__name__} {item!r:.100}")
        arrays.append(item.detach().double().cpu().numpy())
    return arrays, items


OUTPUT_NAMES = {"ppg_aux_loss": ["loss", "aux_value_loss", "kl", "true_value_loss"],
                "from_importance_weights": ["vs", "pg_advantages"]}


def fmt(value):
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            return f"{float(value):.6g}"
        return np.array2string(value, precision=4, suppress_small=True, max_line_width=100,
                               separator=", ")
    return repr(value)


def field(name, value, width):
    """One line of a report, "    name = value", a multi-line array aligned under its first row."""
    return f"    {name:<{width}} = " + fmt(value).replace("\n", "\n" + " " * (width + 7))


def close(got, expected):
    """Same shapes and values (to RTOL / ATOL); infinities must match exactly."""
    return len(got) == len(expected) and all(
        np.shape(g) == np.shape(e) and np.allclose(g, e, rtol=RTOL, atol=ATOL) for g, e in zip(got, expected))


def find_mistake(mutants, case, got, student_outputs_by_case):
    """The mutant reference that reproduces the student's answer: on this case, and on most of the others."""
    best = None
    for name, mutant, hint in mutants:
        try:
            with np.errstate(all="ignore"):
                if not close(got, mutant(**case.inputs)):
                    continue
                score = sum(close(out, mutant(**c.inputs)) for c, out in student_outputs_by_case)
        except Exception:  # a mutant that cannot run on these inputs does not explain them
            continue
        if best is None or score > best[0]:
            best = (score, name, hint)
    return best


def describe_case(case, reference):
    """The case's inputs in the signature's order, defaults included."""
    parameters = inspect.signature(reference).parameters
    inputs = {name: case.inputs.get(name, p.default) for name, p in parameters.items()
              if name in case.inputs or p.default is not inspect.Parameter.empty}
    width = max(len(name) for name in inputs)
    lines = [f"  case: {case.name}", "  inputs:"]
    for key, value in inputs.items():
        lines.append(field(key, value, width))
    return lines


def first_difference(got, expected, names):
    for name, g, e in zip(names, got, expected):
        if np.shape(g) != np.shape(e):
            return f"  {name}: expected shape {np.shape(e)}, got shape {np.shape(g)}"
        if not np.allclose(g, e, rtol=RTOL, atol=ATOL):
            if np.ndim(e) == 0:
                return f"  {name}: expected {float(e):.6g}, got {float(g):.6g}"
            bad = np.argwhere(~np.isclose(g, e, rtol=RTOL, atol=ATOL))[0]
            where = ", ".join(str(i) for i in bad)
            return (f"  {name}, first difference at [{where}]: expected {e[tuple(bad)]:.6g}, "
                    f"got {g[tuple(bad)]:.6g}")
    return ""


def numeric_gradient(reference, inputs, key, eps=1e-6):
    """Central differences of the reference's first output with respect to inputs[key]."""
    base = inputs[key]
    grad = np.zeros_like(base)
    for index in np.ndindex(base.shape):
        values = []
        for sign in (1, -1):
            changed = base.copy()
            changed[index] += sign * eps
            values.append(float(reference(**{**inputs, key: changed})[0]))
        grad[index] = (values[0] - values[1]) / (2 * eps)
    return grad


def student_outputs(function_name, function, cases):
    """The student's outputs on every case it runs on, to tell apart mutants that agree on one case."""
    results = []
    for case in cases:
        try:
            results.append((case, outputs_of(function_name, function(**as_tensors(case.inputs)))[0]))
        except Exception:
            pass
    return results


def check_function(function_name, function, reference, mutants, cases, report):
    """Run the cases; raise Failed with the first difference, the inputs, and a hint."""
    names = OUTPUT_NAMES.get(function_name, ["output"])
    for number, case in enumerate(cases, 1):
        expected = reference(**case.inputs)
        tensors = as_tensors(case.inputs, case.grad)
        try:
            got, items = outputs_of(function_name, function(**tensors))
        except NotImplementedError as error:
            raise Failed(f"{function_name} is still a blank (it raises NotImplementedError). The exercise:\n\n"
                         + exercise_text(error))
        except Failed:
            raise
        except Exception:
            lines = [f"{function_name} raised an error on case {number}/{len(cases)}:",
                     *describe_case(case, reference), "",
                     *["  " + line for line in traceback.format_exc(limit=-3).rstrip().splitlines()]]
            raise Failed("\n".join(lines))
        if not close(got, expected):
            lines = [f"{function_name} differs from the definition on case {number}/{len(cases)}:",
                     *describe_case(case, reference), "  expected:"]
            width = max(len(name) for name in names)
            lines += [field(name, e, width) for name, e in zip(names, expected)]
            lines += ["  got:"] + [field(name, g, width) for name, g in zip(names, got)]
            lines.append(first_difference(got, expected, names))
            mistake = find_mistake(mutants, case, got, student_outputs(function_name, function, cases))
            if mistake is not None:
                lines += ["", f"  hint ({mistake[1]}): {mistake[2]}"]
            else:
                lines += ["", "  hint: no common mistake gives this answer; compare your code line by line with the "
                              "equation in the docstring, starting at the first difference."]
            raise Failed("\n".join(lines))
        for key in case.grad:
            loss = items[0]
            if not loss.requires_grad:
                raise Failed(f"{function_name}: the value is right on case {number} ({case.name}), but no gradient "
                             f"reaches {key}: do not .detach(), .item(), .numpy() or re-wrap the inputs with "
                             "torch.tensor(...); build the result from them with torch operations.")
            (grad,) = torch.autograd.grad(loss, tensors[key], allow_unused=True, retain_graph=True)
            expected_grad = numeric_gradient(reference, case.inputs, key)
            got_grad = np.zeros_like(expected_grad) if grad is None else grad.double().numpy()
            if not np.allclose(got_grad, expected_grad, rtol=1e-4, atol=1e-6):
                raise Failed(f"{function_name}: the value is right on case {number} ({case.name}) but its gradient "
                             f"with respect to {key} is not:\n{field('expected', expected_grad, 8)}\n"
                             f"{field('got', got_grad, 8)}\n  hint: a term computed from detached values, or a "
                             "clamp/max that passes no gradient where it should.")
        report(f"  ok  {function_name}: {case.name}")
    return len(cases)


# ---------------------------------------------------------------- the cases of each function
def gae_cases():
    r = np.array([[1.0], [0.0], [2.0], [1.0]])
    v = np.array([[0.5], [0.2], [0.1], [0.3]])
    zeros = np.zeros((4, 1))
    inside = zeros.copy()
    inside[2] = 1.0
    at_last = zeros.copy()
    at_last[3] = 1.0
    base = dict(rewards=r, values=v, next_value=np.array([1.0]), gamma=0.9, gae_lambda=0.95)
    cases = [
        Case("one episode, no end in the rollout (T=4, N=1)", dict(base, dones=zeros, next_done=np.array([0.0]))),
        Case("an episode ends inside the rollout: dones[2] = 1, step 1 was its last step",
             dict(base, dones=inside, next_done=np.array([0.0]))),
        Case("the episode ends at the end of the rollout: next_done = 1",
             dict(base, dones=zeros, next_done=np.array([1.0]))),
        Case("an episode ends before the last step: dones[3] = 1",
             dict(base, dones=at_last, next_done=np.array([0.0]))),
        Case("lambda = 0: one-step TD errors", dict(base, dones=inside, next_done=np.array([0.0]), gae_lambda=0.0)),
        Case("lambda = 1: discounted returns minus V", dict(base, dones=inside, next_done=np.array([1.0]),
                                                             gae_lambda=1.0)),
    ]
    for seed, (gamma, lam) in enumerate([(0.99, 0.95), (0.9, 0.5)]):
        rng = np.random.default_rng(seed)
        dones = (rng.random((6, 3)) < 0.3).astype(float)
        dones[0] = 0.0
        dones[3, 1] = 1.0
        cases.append(Case(f"random, T=6, N=3, episode ends inside and at the end (gamma {gamma}, lambda {lam})",
                          dict(rewards=rng.normal(size=(6, 3)).round(3), values=rng.normal(size=(6, 3)).round(3),
                               dones=dones, next_value=rng.normal(size=3).round(3), next_done=np.array([0.0, 1.0, 0.0]),
                               gamma=gamma, gae_lambda=lam)))
    return cases


def policy_loss_cases():
    inside = np.array([0.9, 1.1, 1.0, 1.05])
    far = np.array([0.2, 3.0, 0.5, 1.6])
    kl = np.array([0.01, 0.2, 0.05, 0.1])
    clip = dict(kind="clip", clip_coef=0.2, kl_beta=None)
    rng = np.random.default_rng(0)
    cases = [
        Case("ratios inside the clip range", dict(ratio=inside, advantages=np.array([1.0, -1.0, 0.5, -2.0]), kl=kl,
                                                  **clip), grad=("ratio",)),
        Case("ratios far outside the clip range, positive advantages",
             dict(ratio=far, advantages=np.array([1.0, 2.0, 0.5, 1.5]), kl=kl, **clip), grad=("ratio",)),
        Case("ratios far outside the clip range, negative advantages",
             dict(ratio=far, advantages=np.array([-1.0, -2.0, -0.5, -1.5]), kl=kl, **clip), grad=("ratio",)),
        Case("ratios below and above the range, both signs of advantage",
             dict(ratio=np.array([0.3, 2.5, 0.3, 2.5]), advantages=np.array([1.0, 1.0, -1.0, -1.0]), kl=kl,
                  kind="clip", clip_coef=0.1, kl_beta=None), grad=("ratio",)),
        Case("random, M=8, eps 0.2", dict(ratio=np.exp(rng.normal(0, 0.5, 8)).round(3),
                                          advantages=rng.normal(size=8).round(3), kl=np.abs(rng.normal(0, 0.1, 8)),
                                          **clip), grad=("ratio",)),
        Case("kind 'kl-penalty', beta 0.5", dict(ratio=far, advantages=np.array([1.0, -2.0, 0.5, -1.5]), kl=kl,
                                                 kind="kl-penalty", clip_coef=0.2, kl_beta=0.5),
             grad=("ratio", "kl")),
        Case("kind 'kl-penalty', beta 3, random", dict(ratio=np.exp(rng.normal(0, 0.5, 6)).round(3),
                                                       advantages=rng.normal(size=6).round(3),
                                                       kl=np.abs(rng.normal(0, 0.1, 6)).round(4),
                                                       kind="kl-penalty", clip_coef=0.2, kl_beta=3.0),
             grad=("ratio", "kl")),
    ]
    return cases


def value_loss_cases():
    returns = np.array([1.0, 1.0, -1.0, 0.0])
    old = np.array([0.0, 0.0, 0.0, 0.0])
    rng = np.random.default_rng(1)
    return [
        Case("clip_vloss off", dict(new_value=np.array([0.5, 1.5, -2.0, 0.1]), old_value=old, returns=returns,
                                    clip_coef=0.2, clip_vloss=False), grad=("new_value",)),
        Case("clip_vloss on, new values within eps of the old ones",
             dict(new_value=np.array([0.1, -0.15, 0.05, 0.0]), old_value=old, returns=returns, clip_coef=0.2,
                  clip_vloss=True), grad=("new_value",)),
        Case("clip_vloss on, new values far from the old ones (towards and away from the returns)",
             dict(new_value=np.array([0.9, -0.8, -0.7, 0.6]), old_value=old, returns=returns, clip_coef=0.2,
                  clip_vloss=True), grad=("new_value",)),
        Case("clip_vloss on, random", dict(new_value=rng.normal(size=8).round(3), old_value=rng.normal(size=8).round(3),
                                           returns=rng.normal(size=8).round(3), clip_coef=0.3, clip_vloss=True),
             grad=("new_value",)),
    ]


def ppg_aux_loss_cases():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 4)).round(3)
    cases = [Case("pi = pi_old (the KL is 0), M=3 states, 4 actions",
                  dict(logits=logits, old_logits=logits.copy(), value=np.array([0.5, -1.0, 2.0]),
                       aux_value=np.array([0.0, 1.0, 1.5]), value_targets=np.array([1.0, 0.0, 2.0]), beta_clone=1.0),
                  grad=("aux_value", "value"))]
    for beta in (1.0, 0.3):
        cases.append(Case(f"random, M=5 states, 4 actions, beta_clone {beta}",
                          dict(logits=rng.normal(size=(5, 4)).round(3), old_logits=rng.normal(size=(5, 4)).round(3),
                               value=rng.normal(size=5).round(3), aux_value=rng.normal(size=5).round(3),
                               value_targets=rng.normal(size=5).round(3), beta_clone=beta),
                          grad=("logits", "aux_value", "value")))
    return cases


def vtrace_cases():
    case4 = dict(rewards=np.array([[1.0], [0.0], [2.0]]), values=np.array([[0.5], [0.2], [0.1]]),
                 discounts=np.full((3, 1), 0.9), bootstrap_value=np.array([1.0]))
    rho = np.log(np.array([[3.0], [0.5], [1.5]]))
    T, B = 5, 5
    golden = dict(log_rhos=5 * (np.arange(T * B).reshape(T, B) / (T * B) - 0.5),
                  discounts=np.tile(0.9 / (np.arange(B) + 1), (T, 1)),
                  rewards=np.arange(T * B, dtype=float).reshape(T, B),
                  values=np.arange(T * B).reshape(T, B) / B, bootstrap_value=np.arange(B) + 1.0,
                  clip_rho_threshold=3.7, clip_c_threshold=1.0, clip_pg_rho_threshold=2.2, lambda_=1.0)
    split = dict(rewards=np.array([[1.0], [0.0], [2.0], [1.0]]), values=np.array([[0.5], [0.2], [0.1], [0.3]]),
                 discounts=np.array([[0.9], [0.0], [0.9], [0.9]]),
                 log_rhos=np.log(np.array([[3.0], [0.5], [1.5], [0.8]])),
                 bootstrap_value=np.array([1.0]))
    rng = np.random.default_rng(3)
    done = rng.random((6, 3)) < 0.2
    cases = [
        Case("on-policy (log_rhos = 0), lambda 1: n-step returns", dict(case4, log_rhos=np.zeros((3, 1)))),
        Case("on-policy, lambda 0.95", dict(case4, log_rhos=np.zeros((3, 1)), lambda_=0.95)),
        Case("off-policy, rho = [3, 0.5, 1.5], rho_bar = c_bar = rho_bar_pg = 1: truncation active",
             dict(case4, log_rhos=rho)),
        Case("rho_bar = rho_bar_pg = 2, c_bar = 1 (c_bar != rho_bar)",
             dict(case4, log_rhos=rho, clip_rho_threshold=2.0, clip_c_threshold=1.0, clip_pg_rho_threshold=2.0)),
        Case("scalable_agent's case: rho from 0.08 to 12.2, rho_bar 3.7, c_bar 1, rho_bar_pg 2.2 (T=5, B=5)", golden),
        Case("an episode ends inside (discounts[1] = 0), clips 1", split),
        Case("lambda 0.5, rho_bar 1.2, c_bar 0.8, rho_bar_pg 1.5",
             dict(split, clip_rho_threshold=1.2, clip_c_threshold=0.8, clip_pg_rho_threshold=1.5, lambda_=0.5)),
        Case("no truncation (all thresholds None), lambda 0.9",
             dict(case4, log_rhos=rho, clip_rho_threshold=None, clip_c_threshold=None, clip_pg_rho_threshold=None,
                  lambda_=0.9)),
        Case("T = 1", dict(log_rhos=np.log(np.array([[2.0]])), discounts=np.array([[0.9]]), rewards=np.array([[2.0]]),
                           values=np.array([[1.0]]), bootstrap_value=np.array([3.0]))),
        Case("random, T=6, B=3, episode ends, rho_bar 1.5, c_bar 0.9, rho_bar_pg 1.2, lambda 0.8",
             dict(log_rhos=rng.normal(size=(6, 3)).round(3), discounts=np.where(done, 0.0, 0.95),
                  rewards=rng.normal(size=(6, 3)).round(3), values=rng.normal(size=(6, 3)).round(3),
                  bootstrap_value=rng.normal(size=3).round(3), clip_rho_threshold=1.5, clip_c_threshold=0.9,
                  clip_pg_rho_threshold=1.2, lambda_=0.8)),
    ]
    return cases


def per_token_rewards_cases():
    mask = np.array([[1.0, 1.0, 1.0, 0.0, 0.0]])
    kl = np.array([[0.1, -0.2, 0.3, 0.0, 0.0]])
    rng = np.random.default_rng(4)
    lengths = [1, 5, 3, 2]
    random_mask = np.array([[1.0 if t < n else 0.0 for t in range(5)] for n in lengths])
    return [
        Case("one response of 3 tokens (EOS at index 2), per-token KL, beta 0.1",
             dict(kl=kl, scores=np.array([2.0]), mask=mask, beta=0.1)),
        Case("a response that ends at its first token",
             dict(kl=np.array([[0.4, 0.0, 0.0, 0.0]]), scores=np.array([1.5]),
                  mask=np.array([[1.0, 0.0, 0.0, 0.0]]), beta=0.5)),
        Case("a response without EOS (all 4 tokens are the response)",
             dict(kl=np.array([[0.1, 0.2, -0.1, 0.3]]), scores=np.array([-1.0]), mask=np.ones((1, 4)), beta=0.2)),
        Case("random batch of 4 (lengths 1, 5, 3, 2), KL nonzero past the ends",
             dict(kl=rng.normal(0, 0.3, (4, 5)).round(3), scores=rng.normal(size=4).round(3), mask=random_mask,
                  beta=0.05)),
    ]


def bradley_terry_cases():
    rng = np.random.default_rng(5)
    return [
        Case("three pairs, margins 1, -2 and 0", dict(r_chosen=np.array([1.0, 0.0, -0.5]),
                                                     r_rejected=np.array([0.0, 2.0, -0.5])), grad=("r_chosen",)),
        Case("random, 6 pairs", dict(r_chosen=rng.normal(size=6).round(3), r_rejected=rng.normal(size=6).round(3)),
             grad=("r_chosen", "r_rejected")),
        Case("large margins: +500 and -1000", dict(r_chosen=np.array([500.0, 0.0]),
                                                   r_rejected=np.array([0.0, 1000.0]))),
    ]


FUNCTION_CHECKS = {
    "compute_gae": (ref.gae, ref.GAE_MUTANTS, gae_cases),
    "policy_loss": (ref.policy_loss, ref.POLICY_LOSS_MUTANTS, policy_loss_cases),
    "value_loss": (ref.value_loss, ref.VALUE_LOSS_MUTANTS, value_loss_cases),
    "ppg_aux_loss": (ref.ppg_aux_loss, ref.PPG_AUX_LOSS_MUTANTS, ppg_aux_loss_cases),
    "from_importance_weights": (ref.from_importance_weights, ref.VTRACE_MUTANTS, vtrace_cases),
    "per_token_rewards": (ref.per_token_rewards, ref.PER_TOKEN_REWARD_MUTANTS, per_token_rewards_cases),
    "bradley_terry_loss": (ref.bradley_terry_loss, ref.BT_MUTANTS, bradley_terry_cases),
}


# ---------------------------------------------------------------- PPG's auxiliary phase: a procedure, not a formula
def reference_phase(agent, aux_obs, targets, args, lr, variant=None):
    """Algorithm 1's auxiliary phase written out on the whole buffer as ONE minibatch (so the shuffle cannot
    matter), with plain SGD: pi_old once, then E_aux steps on L_joint + L_value, each network's gradient clipped on
    its own. `variant` replays a typical mistake. Returns the final parameters as one vector."""
    agent = copy.deepcopy(agent)
    optimizer = torch.optim.SGD(agent.networks(), lr=lr)
    obs, v_targ = aux_obs.flatten(0, 1), targets.flatten()

    def policy_old():
        with torch.no_grad():
            return agent.forward_aux(obs)[0]

    old_logits = policy_old()
    for _ in range(1 if variant == "one epoch" else args.e_aux):
        if variant == "pi_old each epoch":
            old_logits = policy_old()
        if variant != "no zero_grad":
            optimizer.zero_grad(set_to_none=True)
        logits, value, aux_value = agent.forward_aux(obs)
        old_log_probs = torch.log_softmax(old_logits, -1)
        kl = (old_log_probs.exp() * (old_log_probs - torch.log_softmax(logits, -1))).sum(-1).mean()
        loss = 0.5 * ((aux_value - v_targ) ** 2).mean() + args.beta_clone * kl + 0.5 * ((value - v_targ) ** 2).mean()
        (loss * (2 if variant == "chunks not weighted" else 1)).backward()
        if variant == "clipped over all parameters together":
            torch.nn.utils.clip_grad_norm_(list(agent.parameters()), args.max_grad_norm)
        elif variant != "no clipping":
            for group in optimizer.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], args.max_grad_norm)
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in agent.parameters()])


PHASE_HINTS = {
    "pi_old each epoch": "pi_old is recomputed during the phase: Algorithm 1 computes and stores pi_old(.|s) for all "
                         "states in B once, BEFORE the first auxiliary step, and keeps it for all E_aux epochs.",
    "no zero_grad": "the gradients are not zeroed before each minibatch, so each step also carries the previous "
                    "steps' gradients: optimizer.zero_grad() first.",
    "one epoch": "only one epoch ran: the phase makes E_aux (args.e_aux) passes over the buffer.",
    "no clipping": "the gradient is not clipped: clip_grad_norms(optimizer, args.max_grad_norm) before each step "
                   "(it clips each network's gradient on its own).",
    "clipped over all parameters together": "the gradient is clipped over all parameters at once; clip each "
                                            "network (each optimizer param group) on its own, with "
                                            "clip_grad_norms(optimizer, args.max_grad_norm).",
    "chunks not weighted": "with n_aux_grad_accum chunks, weigh each chunk's loss by len(chunk) / len(minibatch) "
                           "so that the accumulated gradient is the minibatch's mean gradient.",
}


def run_student_phase(module, agent, aux_obs, targets, args, optimizer):
    function = module.auxiliary_phase
    available = dict(agent=agent, forward_aux=agent.forward_aux, optimizer=optimizer, aux_obs=aux_obs,
                     aux_value_targets=targets, args=args, device=torch.device("cpu"), autocast=contextlib.nullcontext)
    parameters = inspect.signature(function).parameters
    unknown = [name for name, p in parameters.items() if name not in available and p.default is inspect.Parameter.empty]
    if unknown:
        raise Failed(f"auxiliary_phase has parameters the grader does not know: {unknown} (it passes "
                     f"{sorted(available)})")
    try:
        return function(**{name: value for name, value in available.items() if name in parameters})
    except NotImplementedError as error:
        raise Failed("auxiliary_phase is still a blank (it raises NotImplementedError). The exercise:\n\n"
                     + exercise_text(error))
    except Failed:
        raise
    except Exception:
        raise Failed("auxiliary_phase raised an error:\n" + "\n".join(
            "  " + line for line in traceback.format_exc(limit=-3).rstrip().splitlines()))


def check_auxiliary_phase(module, report):
    """Four runs on a buffer of 4 rollouts of 2 random frames, with a tiny PPG agent of the student's script."""
    torch.manual_seed(0)
    fields = {f.name for f in dataclasses.fields(module.Args)}
    tiny = dict(channels=(4,), hidden_size=16, arch="detach", beta_clone=1.0, n_aux_grad_accum=1, max_grad_norm=1e9)
    base = {key: value for key, value in tiny.items() if key in fields}
    agent = module.Agent(module.Args(**base), num_actions=15)
    aux_obs = torch.randint(0, 256, (4, 2, 64, 64, 3), dtype=torch.uint8)
    targets = torch.randn(4, 2)
    obs = aux_obs.flatten(0, 1)
    with torch.no_grad():
        logits, value, aux_value = agent.forward_aux(obs)
        start = {"aux/aux_value_loss": 0.5 * ((aux_value - targets.flatten()) ** 2).mean().item(), "aux/kl": 0.0,
                 "aux/value_loss": 0.5 * ((value - targets.flatten()) ** 2).mean().item()}

    # 1. lr 0: nothing moves, so every minibatch's KL(pi_old || pi) is 0 if pi_old is stored before the phase and
    # indexed with the same shuffled rollouts; the returned means are the buffer's losses; count the steps.
    args = module.Args(**base, e_aux=2, num_aux_rollouts=2)
    student_agent = copy.deepcopy(agent)
    optimizer = torch.optim.SGD(student_agent.networks(), lr=0.0)
    steps = []
    step = optimizer.step
    optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    stats = run_student_phase(module, student_agent, aux_obs, targets, args, optimizer)
    name = "auxiliary_phase, lr 0: E_aux = 2 epochs of 2 minibatches of 2 rollouts"
    if not isinstance(stats, dict) or set(stats) != set(start):
        raise Failed(f"{name}: auxiliary_phase must return a dict with the keys {sorted(start)}; got {stats!r:.200}")
    if len(steps) != 4:
        hint = ("  hint: one optimizer step per minibatch of args.num_aux_rollouts rollouts (aux_rollouts_per_rank), "
                "for E_aux epochs" + (" (with n_aux_grad_accum chunks, still one step per minibatch)."
                                      if len(steps) > 4 else "."))
        if len(steps) == 2:
            hint = f"  hint (one epoch): {PHASE_HINTS['one epoch']}"
        raise Failed(f"{name}: expected 4 optimizer steps (2 epochs x 2 minibatches), got {len(steps)}.\n{hint}")
    if abs(stats["aux/kl"]) > 1e-6:
        raise Failed(f"{name}: with a learning rate of 0 nothing moves, so KL(pi_old || pi) must be exactly 0 in "
                     f"every minibatch; got a mean KL of {stats['aux/kl']:.3g}.\n  hint: compute pi_old for all "
                     "states in B once, before the first step, and give each minibatch the stored pi_old of ITS "
                     "rollouts (index the stored logits with the same shuffled rollout indices as the frames).")
    for key in ("aux/aux_value_loss", "aux/value_loss"):
        if not math.isclose(stats[key], start[key], rel_tol=1e-4, abs_tol=1e-6):
            raise Failed(f"{name}: {key} should be {start[key]:.6g} (the mean over the minibatches of "
                         f"ppg_aux_loss's part, here the buffer's loss since nothing moves), got {stats[key]:.6g}.\n  "
                         "hint: return the parts of ppg_aux_loss averaged over the phase's minibatches, each value "
                         "target paired with its own frame.")
    report(f"  ok  {name}: KL 0, {len(steps)} steps, the buffer's losses")

    # 2.-4. One minibatch of all rollouts (the shuffle cannot matter): the result must equal the reference's.
    runs = [("E_aux = 3 epochs, one minibatch of all 4 rollouts, SGD lr 0.5", dict(e_aux=3), 0.5,
             ["pi_old each epoch", "no zero_grad", "one epoch"]),
            ("max_grad_norm 0.01: each network's gradient clipped on its own", dict(e_aux=1, max_grad_norm=0.01), 0.5,
             ["no clipping", "clipped over all parameters together"]),
            ("n_aux_grad_accum = 2: two chunks, one step", dict(e_aux=1, n_aux_grad_accum=2), 0.5,
             ["chunks not weighted"])]
    for name, overrides, lr, variants in runs:
        args = module.Args(**{**base, "num_aux_rollouts": 4, **overrides})
        expected = reference_phase(agent, aux_obs, targets, args, lr)
        student_agent = copy.deepcopy(agent)
        optimizer = torch.optim.SGD(student_agent.networks(), lr=lr)
        run_student_phase(module, student_agent, aux_obs, targets, args, optimizer)
        got = torch.cat([p.detach().flatten() for p in student_agent.parameters()])
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            moved = (got - expected).abs().max().item()
            lines = [f"auxiliary_phase, {name}: the weights after the phase differ from the reference's (Algorithm 1 "
                     f"with plain SGD) by up to {moved:.3g}."]
            initial = torch.cat([p.detach().flatten() for p in agent.parameters()])
            if torch.equal(got, initial):
                lines.append("  hint: the weights did not move at all: call optimizer.step() after each minibatch's "
                             "backward.")
            for variant in variants + [v for v in PHASE_HINTS if v not in variants]:
                if torch.allclose(got, reference_phase(agent, aux_obs, targets, args, lr, variant), rtol=1e-4,
                                  atol=1e-5):
                    lines.append(f"  hint ({variant}): {PHASE_HINTS[variant]}")
                    break
            else:
                if len(lines) == 1:
                    lines.append("  hint: no common mistake gives these weights; compare your phase step by step "
                                 "with Algorithm 1 in the docstring.")
            raise Failed("\n".join(lines))
        report(f"  ok  auxiliary_phase, {name}")


# ---------------------------------------------------------------- the learning check on the real script
CUE = dict(env_id="coinrun", num_envs=16, channels=(8,), hidden_size=32, learning_rate=2e-3, eval_every=0,
           eval_episodes=16, torch_threads=1)
TRAINING = {  # which script a module is, told by what it defines, and its tiny flags
    "ppg": dict(CUE, total_timesteps=6144, num_steps=32, num_minibatches=4, n_pi=4, e_aux=2, save_every=4,
                arch="detach"),
    "vtrace": dict(CUE, total_timesteps=10240, unroll_length=8, updates_per_iteration=10, max_policy_lag=1,
                   deterministic_lag=True, gamma=0.9),
    "ppo": dict(CUE, total_timesteps=6144, num_steps=32, num_minibatches=4),
    "rlhf": dict(corpus_size=3000, sft_steps=200, num_pairs=2500, rm_epochs=3, rm_lr=3e-3, ppo_iterations=20,
                 rollout_batch_size=64, eval_samples=256, bon_pool=16),
}


def kind_of(module):
    for kind, marker in (("rlhf", "per_token_rewards"), ("ppg", "ppg_aux_loss"), ("vtrace", "from_importance_weights"),
                         ("ppo", "compute_gae")):
        if hasattr(module, marker):
            return kind
    raise Failed("this file is none of the four scripts (it defines no compute_gae, ppg_aux_loss, "
                 "from_importance_weights or per_token_rewards)")


def make_args(module, overrides):
    fields = {f.name for f in dataclasses.fields(module.Args)}
    return module.Args(**{key: value for key, value in overrides.items() if key in fields})


def train_and_judge(module, report):
    """Train the student's script on the cue task (or the RLHF toy at tiny flags); raise Failed unless it learns."""
    kind = kind_of(module)
    args = make_args(module, TRAINING[kind])
    if kind != "rlhf":
        patch_cue_env(module)
    workdir = tempfile.mkdtemp(prefix="grade_")
    output = io.StringIO()
    previous = os.getcwd()
    threads = torch.get_num_threads()
    start = time.time()
    try:
        os.chdir(workdir)
        with contextlib.redirect_stdout(output):
            result = module.train(args)
        if kind != "rlhf":
            with open(os.path.join(result, "metrics.jsonl")) as f:
                result = [json.loads(line) for line in f]
    except NotImplementedError as error:
        raise Failed("training stopped at another blank of this script (NotImplementedError):\n\n"
                     + exercise_text(error))
    except (Exception, SystemExit) as error:
        tail = "\n".join("    " + line for line in output.getvalue().rstrip().splitlines()[-8:])
        raise Failed(f"training raised {type(error).__name__}: {error}\n  last lines of the run:\n{tail}\n"
                     + "\n".join("  " + line for line in traceback.format_exc(limit=-3).rstrip().splitlines()))
    finally:
        os.chdir(previous)
        torch.set_num_threads(threads)
        shutil.rmtree(workdir, ignore_errors=True)
    judge = judge_rlhf if kind == "rlhf" else judge_cue
    return judge(result, time.time() - start, report)


def judge_cue(rows, seconds, report):
    returns = [r["charts/episodic_return"] for r in rows if r.get("charts/episodic_return") is not None]
    final = [r["eval/episodic_return"] for r in rows if "eval/episodic_return" in r][-1]
    begin, end = float(np.mean(returns[:2])), float(np.mean(returns[-2:]))
    report(f"  learning curve (cue task: random play earns 0.53 per episode, a solved task 8.00), {seconds:.0f} s:")
    report(f"    episodic return per iteration: {' '.join(f'{x:.2f}' for x in returns)}")
    report(f"    start {begin:.2f} -> end {end:.2f}; evaluation after training {final:.2f}")
    if not (final > 4.0 and end > begin + 1.5):
        raise Failed("the function passes the checks, but the script did not learn the cue task (it needs an "
                     "evaluation return above 4.0 and the training return up by 1.5): look for a difference the "
                     "checks do not see, such as the dtype or device of the result, or in-place changes to the "
                     "inputs.")
    return final


def judge_rlhf(summary, seconds, report):
    rm, sft, (ppo,) = summary["rm"], summary["sft"], summary["ppo"].values()
    history = [row["gold/score"] for row in next(iter(summary["histories"].values())) if "gold/score" in row]
    report(f"  the RLHF toy at tiny flags, {seconds:.0f} s:")
    report(f"    reward model (Bradley-Terry): held-out accuracy {rm['rm/heldout_acc']:.3f} against the labels, "
           f"{rm['rm/heldout_acc_gold']:.3f} against the gold order (chance 0.5)")
    if history:
        report(f"    PPO's gold score per iteration: start {np.mean(history[:2]):+.3f} -> "
               f"end {np.mean(history[-2:]):+.3f}")
    report(f"    gold score SFT {sft['gold/score']:+.3f} -> PPO {ppo['gold/score']:+.3f}; proxy (RM) score SFT "
           f"{sft['proxy/score']:+.3f} -> PPO {ppo['proxy/score']:+.3f}; KL to SFT {ppo['objective/kl']:.2f}")
    problems = []
    if rm["rm/heldout_acc"] <= 0.6:
        problems.append("the reward model did not learn the preferences (held-out accuracy <= 0.6): look at "
                        "bradley_terry_loss")
    if not (ppo["gold/score"] > sft["gold/score"] + 0.5 and ppo["proxy/score"] > sft["proxy/score"] + 0.5):
        problems.append("PPO did not raise the gold and proxy scores by 0.5 over SFT: look at per_token_rewards")
    if problems:
        raise Failed("the functions pass the checks, but " + "; ".join(problems) + ".")
    return ppo["gold/score"]


# ---------------------------------------------------------------- grading
@contextlib.contextmanager
def one_thread():
    """Tiny tensors: one thread is fastest, and a busy machine's other threads cannot stall it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check(exercise, module, report=lambda line: None):
    """Part (a): every function of the exercise against its reference. Raises Failed; returns the case count."""
    with one_thread():
        return check_functions(exercise, module, report)


def check_functions(exercise, module, report):
    count = 0
    for function_name in EXERCISES[exercise]["functions"]:
        if not hasattr(module, function_name):
            raise Failed(f"{function_name} is not defined in this file")
        if function_name == "auxiliary_phase":
            check_auxiliary_phase(module, report)
            count += 4
            continue
        reference, mutants, cases = FUNCTION_CHECKS[function_name]
        count += check_function(function_name, getattr(module, function_name), reference, mutants, cases(), report)
    return count


def grade(exercise, path=None, train=True, out=print, verbose=False):
    """The whole grade, printed through `out`; True when it passes."""
    path = os.path.abspath(path or default_path(exercise))
    info = EXERCISES[exercise]
    out(f"exercise {exercise}: {info['title']}\n  {', '.join(info['functions'])} in {path}\n  ({info['equation']})")
    start = time.time()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            module = load_script(path)
    except Exception:
        out("FAIL: the script does not import:\n" + traceback.format_exc(limit=-3))
        return False
    try:
        out("(a) the functions against a naive float64 reference")
        count = check(exercise, module, out if verbose else (lambda line: None))
        out(f"  ok: {count} cases ({time.time() - start:.1f} s)")
        if train:
            out(f"(b) training {os.path.basename(path)} with them")
            train_and_judge(module, out)
            out("  ok: it learns")
    except Failed as failure:
        out("FAIL: " + str(failure))
        return False
    out(f"PASS ({time.time() - start:.0f} s)")
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercise", choices=sorted(EXERCISES))
    parser.add_argument("path", nargs="?", help="the student's script (default: the repository's own)")
    parser.add_argument("--no-train", action="store_true", help="only the checks against the reference")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case that passes")
    options = parser.parse_args(argv)
    return 0 if grade(options.exercise, options.path, train=not options.no_train, verbose=options.verbose) else 1


if __name__ == "__main__":
    sys.exit(main())
