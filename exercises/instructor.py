"""The instructor's grader (it stays in the repository; the student bundle gets only the public grader).

  python exercises/instructor.py grade EXERCISE FILE [FILE ...] [--student NAME] [--secret-file F] [--json OUT]
  python exercises/instructor.py batch SUBMISSIONS [--exercises gae,...] [--secret-file F] [--out DIR] [--jobs 2]
  python exercises/instructor.py make-cases            # rewrite exercises/cases/*.json (the public cases)

Each submission's code runs in a sandboxed child process of its own (exercises/sandbox.py: a fresh interpreter in
an empty folder, a uid of its own when run as root, limits on time, CPU, memory, output and processes); this
process draws the cases, computes their answers with the float64 references (exercises/references.py), sends the
child the inputs only and scores what comes back. It trusts nothing it reads: a script is read only when it is a
regular file of the student's folder's owner (no link, FIFO or device, at most 1 MiB), a student's folder only
when it is a folder (not a link), the child's report line by line within its limits; what is graded is every
function of the script of that name in the repository, looked up in the child. Each exercise is worth
EXERCISE_POINTS whatever the failure: the hidden randomized cases (drawn from sha256 of the secret and the
student's name: the same submission always gets the same cases, two students different ones) share half, the public
cases (the bundle's, their inputs disguised by ~1 % so that a lookup of the shipped answers gains nothing) the other
half. `grade` prints a text report (and writes a JSON result); `batch` grades each sub-folder of SUBMISSIONS (one per
student, holding some of the four scripts), --jobs at a time, and once every child has ended writes DIR/NAME.txt,
DIR/NAME.json and one CSV row per student in DIR/grades.csv, each file atomically (a name that is not printable
UTF-8 is escaped). The secret comes from --secret-file (or $GRADER_SECRET), never from a command line. Without root
both commands refuse to run unless --unsafe-same-user is given (docs/assignments.md says what each mode
guarantees). No training: the learning curve is informational (docs/assignments.md) and gives no points."""
import argparse
import concurrent.futures
import csv
import dataclasses
import hashlib
import io
import json
import os
import secrets
import stat
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from exercises import grading, sandbox  # noqa: E402
from exercises import references as ref  # noqa: E402
from exercises.grading import Case  # noqa: E402
from exercises.texts import EXERCISES  # noqa: E402

HIDDEN_PER_FUNCTION = 4
EXERCISE_POINTS = 40  # every exercise, whatever the submission: the hidden cases share half, the public ones half
REPORT_CHARS = 1 << 20  # a student's text report is cut here (each message in it is cut already)
SCRIPTS = ("ppo_procgen.py", "ppg_procgen.py", "vtrace.py", "ppo_rlhf_toy.py")
REFERENCES = {
    "compute_gae": (ref.gae, ref.GAE_MUTANTS),
    "policy_loss": (ref.policy_loss, ref.POLICY_LOSS_MUTANTS),
    "value_loss": (ref.value_loss, ref.VALUE_LOSS_MUTANTS),
    "ppg_aux_loss": (ref.ppg_aux_loss, ref.PPG_AUX_LOSS_MUTANTS),
    "from_importance_weights": (ref.from_importance_weights, ref.VTRACE_MUTANTS),
    "per_token_rewards": (ref.per_token_rewards, ref.PER_TOKEN_REWARD_MUTANTS),
    "bradley_terry_loss": (ref.bradley_terry_loss, ref.BT_MUTANTS),
    "group_relative_advantages": (ref.group_relative_advantages, ref.GRPO_MUTANTS),
    "leave_one_out_advantages": (ref.leave_one_out_advantages, ref.RLOO_MUTANTS),
}


# ---------------------------------------------------------------- a case from its inputs: the references' answers
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


def make_case(function, name, inputs, grad=(), hidden=False):
    """Inputs -> a Case with the reference's outputs and gradients and the answers of every typical mistake that
    differs from the reference here."""
    reference, mutants = REFERENCES[function]
    expected = reference(**inputs)
    mistakes = []
    for mistake, mutant, hint in mutants:
        try:
            with np.errstate(all="ignore"):
                outputs = mutant(**inputs)
        except Exception:  # a mistake that cannot run on these inputs does not explain them
            continue
        if not grading.close(outputs, expected):
            mistakes.append({"name": mistake, "hint": hint, "outputs": [np.asarray(o, dtype=float) for o in outputs]})
    grads = {key: numeric_gradient(reference, inputs, key) for key in grad}
    return Case(function, name, inputs, [np.asarray(e, dtype=float) for e in expected], grads, mistakes,
                hidden=hidden)


# ---------------------------------------------------------------- the public cases (hand-made)
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
        ("one episode, no end in the rollout (T=4, N=1)", dict(base, dones=zeros, next_done=np.array([0.0]))),
        ("an episode ends inside the rollout: dones[2] = 1, step 1 was its last step",
         dict(base, dones=inside, next_done=np.array([0.0]))),
        ("the episode ends at the end of the rollout: next_done = 1",
         dict(base, dones=zeros, next_done=np.array([1.0]))),
        ("an episode ends before the last step: dones[3] = 1", dict(base, dones=at_last, next_done=np.array([0.0]))),
        ("lambda = 0: one-step TD errors", dict(base, dones=inside, next_done=np.array([0.0]), gae_lambda=0.0)),
        ("lambda = 1: discounted returns minus V", dict(base, dones=inside, next_done=np.array([1.0]), gae_lambda=1.0)),
        ("T = 1: one step, bootstrapped from next_value", dict(rewards=np.array([[1.0, 2.0]]),
                                                               values=np.array([[0.5, -1.0]]), dones=np.zeros((1, 2)),
                                                               next_value=np.array([2.0, 3.0]),
                                                               next_done=np.array([0.0, 1.0]), gamma=0.9,
                                                               gae_lambda=0.95)),
    ]
    for seed, (gamma, lam) in enumerate([(0.99, 0.95), (0.9, 0.5)]):
        rng = np.random.default_rng(seed)
        dones = (rng.random((6, 3)) < 0.3).astype(float)
        dones[0] = 0.0
        dones[3, 1] = 1.0
        cases.append((f"random, T=6, N=3, episode ends inside and at the end (gamma {gamma}, lambda {lam})",
                      dict(rewards=rng.normal(size=(6, 3)).round(3), values=rng.normal(size=(6, 3)).round(3),
                           dones=dones, next_value=rng.normal(size=3).round(3), next_done=np.array([0.0, 1.0, 0.0]),
                           gamma=gamma, gae_lambda=lam)))
    return [make_case("compute_gae", name, inputs) for name, inputs in cases]


def policy_loss_cases():
    inside = np.array([0.9, 1.1, 1.0, 1.05])
    far = np.array([0.2, 3.0, 0.5, 1.6])
    kl = np.array([0.01, 0.2, 0.05, 0.1])
    clip = dict(kind="clip", clip_coef=0.2, kl_beta=None)
    rng = np.random.default_rng(0)
    cases = [
        ("ratios inside the clip range", dict(ratio=inside, advantages=np.array([1.0, -1.0, 0.5, -2.0]), kl=kl, **clip),
         ("ratio",)),
        ("ratios far outside the clip range, positive advantages",
         dict(ratio=far, advantages=np.array([1.0, 2.0, 0.5, 1.5]), kl=kl, **clip), ("ratio",)),
        ("ratios far outside the clip range, negative advantages",
         dict(ratio=far, advantages=np.array([-1.0, -2.0, -0.5, -1.5]), kl=kl, **clip), ("ratio",)),
        ("ratios below and above the range, both signs of advantage",
         dict(ratio=np.array([0.3, 2.5, 0.3, 2.5]), advantages=np.array([1.0, 1.0, -1.0, -1.0]), kl=kl,
              kind="clip", clip_coef=0.1, kl_beta=None), ("ratio",)),
        ("random, M=8, eps 0.2", dict(ratio=np.exp(rng.normal(0, 0.5, 8)).round(3),
                                      advantages=(3 * rng.normal(size=8)).round(3), kl=np.abs(rng.normal(0, 0.1, 8)),
                                      **clip), ("ratio",)),
        ("kind 'kl-penalty', beta 0.5", dict(ratio=far, advantages=np.array([1.0, -2.0, 0.5, -1.5]), kl=kl,
                                             kind="kl-penalty", clip_coef=0.2, kl_beta=0.5), ("ratio", "kl")),
        ("kind 'kl-penalty', beta 3, random", dict(ratio=np.exp(rng.normal(0, 0.5, 6)).round(3),
                                                   advantages=rng.normal(size=6).round(3),
                                                   kl=np.abs(rng.normal(0, 0.1, 6)).round(4), kind="kl-penalty",
                                                   clip_coef=0.2, kl_beta=3.0), ("ratio", "kl")),
    ]
    return [make_case("policy_loss", name, inputs, grad) for name, inputs, grad in cases]


def value_loss_cases():
    returns = np.array([1.0, 1.0, -1.0, 0.0])
    old = np.array([0.0, 0.0, 0.0, 0.0])
    rng = np.random.default_rng(1)
    cases = [
        ("clip_vloss off", dict(new_value=np.array([0.5, 1.5, -2.0, 0.1]), old_value=old, returns=returns,
                                clip_coef=0.2, clip_vloss=False)),
        ("clip_vloss off, errors beyond 1 (up to 4)", dict(new_value=np.array([3.0, -2.5, 1.0, 4.0]), old_value=old,
                                                           returns=returns, clip_coef=0.2, clip_vloss=False)),
        ("clip_vloss on, new values within eps of the old ones",
         dict(new_value=np.array([0.1, -0.15, 0.05, 0.0]), old_value=old, returns=returns, clip_coef=0.2,
              clip_vloss=True)),
        ("clip_vloss on, new values far from the old ones (towards and away from the returns)",
         dict(new_value=np.array([0.9, -0.8, -0.7, 0.6]), old_value=old, returns=returns, clip_coef=0.2,
              clip_vloss=True)),
        ("clip_vloss on, errors beyond 1 in both branches (entries 2 and 4: the clipped one counts)",
         dict(new_value=np.array([3.0, 0.5, 2.5, -0.8]), old_value=np.array([2.0, 3.0, -1.0, -4.0]),
              returns=np.array([-1.0, 0.0, 0.0, 0.0]), clip_coef=0.3, clip_vloss=True)),
        ("clip_vloss on, random", dict(new_value=rng.normal(size=8).round(3), old_value=rng.normal(size=8).round(3),
                                       returns=rng.normal(size=8).round(3), clip_coef=0.3, clip_vloss=True)),
    ]
    return [make_case("value_loss", name, inputs, ("new_value",)) for name, inputs in cases]


def ppg_aux_loss_cases():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 4)).round(3)
    cases = [make_case("ppg_aux_loss", "pi = pi_old (the KL is 0), M=3 states, 4 actions",
                       dict(logits=logits, old_logits=logits.copy(), value=np.array([0.5, -1.0, 2.0]),
                            aux_value=np.array([0.0, 1.0, 1.5]), value_targets=np.array([1.0, 0.0, 2.0]),
                            beta_clone=1.0), ("aux_value", "value"))]
    for beta in (1.0, 0.3):
        cases.append(make_case("ppg_aux_loss", f"random, M=5 states, 4 actions, beta_clone {beta}",
                               dict(logits=rng.normal(size=(5, 4)).round(3),
                                    old_logits=rng.normal(size=(5, 4)).round(3),
                                    value=rng.normal(size=5).round(3), aux_value=rng.normal(size=5).round(3),
                                    value_targets=rng.normal(size=5).round(3), beta_clone=beta),
                               ("logits", "aux_value", "value")))
    cases.append(make_case("ppg_aux_loss", "value errors beyond 1 (up to 3) in both heads",
                           dict(logits=rng.normal(size=(4, 3)).round(3), old_logits=rng.normal(size=(4, 3)).round(3),
                                value=np.array([3.0, -2.0, 0.5, 1.0]), aux_value=np.array([-2.5, 2.0, 1.0, 3.0]),
                                value_targets=np.array([0.0, 0.5, -1.0, 0.0]), beta_clone=1.0),
                           ("aux_value", "value")))
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
                 log_rhos=np.log(np.array([[3.0], [0.5], [1.5], [0.8]])), bootstrap_value=np.array([1.0]))
    rng = np.random.default_rng(3)
    done = rng.random((6, 3)) < 0.2
    trailing = dict(log_rhos=rng.normal(0, 0.5, (4, 2, 1)).round(3), discounts=np.full((4, 2, 1), 0.9),
                    rewards=rng.normal(size=(4, 2, 3)).round(3), values=rng.normal(size=(4, 2, 3)).round(3),
                    bootstrap_value=rng.normal(size=(2, 3)).round(3), clip_rho_threshold=1.2,
                    clip_c_threshold=0.9, clip_pg_rho_threshold=1.1, lambda_=0.9)
    cases = [
        ("on-policy (log_rhos = 0), lambda 1: n-step returns", dict(case4, log_rhos=np.zeros((3, 1)))),
        ("on-policy, lambda 0.95", dict(case4, log_rhos=np.zeros((3, 1)), lambda_=0.95)),
        ("off-policy, rho = [3, 0.5, 1.5], rho_bar = c_bar = rho_bar_pg = 1: truncation active",
         dict(case4, log_rhos=rho)),
        ("rho_bar = rho_bar_pg = 2, c_bar = 1 (c_bar != rho_bar)",
         dict(case4, log_rhos=rho, clip_rho_threshold=2.0, clip_c_threshold=1.0, clip_pg_rho_threshold=2.0)),
        ("scalable_agent's case: rho from 0.08 to 12.2, rho_bar 3.7, c_bar 1, rho_bar_pg 2.2 (T=5, B=5)", golden),
        ("an episode ends inside (discounts[1] = 0), clips 1", split),
        ("lambda 0.5, rho_bar 1.2, c_bar 0.8, rho_bar_pg 1.5",
         dict(split, clip_rho_threshold=1.2, clip_c_threshold=0.8, clip_pg_rho_threshold=1.5, lambda_=0.5)),
        ("no truncation (all thresholds None), lambda 0.9",
         dict(case4, log_rhos=rho, clip_rho_threshold=None, clip_c_threshold=None, clip_pg_rho_threshold=None,
              lambda_=0.9)),
        ("T = 1", dict(log_rhos=np.log(np.array([[2.0]])), discounts=np.array([[0.9]]), rewards=np.array([[2.0]]),
                       values=np.array([[1.0]]), bootstrap_value=np.array([3.0]))),
        ("random, T=6, B=3, episode ends, rho_bar 1.5, c_bar 0.9, rho_bar_pg 1.2, lambda 0.8",
         dict(log_rhos=rng.normal(size=(6, 3)).round(3), discounts=np.where(done, 0.0, 0.95),
              rewards=rng.normal(size=(6, 3)).round(3), values=rng.normal(size=(6, 3)).round(3),
              bootstrap_value=rng.normal(size=3).round(3), clip_rho_threshold=1.5, clip_c_threshold=0.9,
              clip_pg_rho_threshold=1.2, lambda_=0.8)),
        ("lambda_ a per-step [T, B] tensor (Remark 2: lambda_s = 0 cuts the trace at s)",
         dict(split, lambda_=np.array([[0.9], [0.5], [0.0], [1.0]]))),
        ("lambda_ a 0-dim tensor (0.7)", dict(split, lambda_=np.array(0.7))),
        ("trailing dimensions: values [T, B, 3], log_rhos and discounts [T, B, 1] broadcast", trailing),
    ]
    return [make_case("from_importance_weights", name, inputs) for name, inputs in cases]


def per_token_rewards_cases():
    mask = np.array([[1.0, 1.0, 1.0, 0.0, 0.0]])
    kl = np.array([[0.1, -0.2, 0.3, 0.0, 0.0]])
    rng = np.random.default_rng(4)
    lengths = [1, 5, 3, 2]
    random_mask = np.array([[1.0 if t < n else 0.0 for t in range(5)] for n in lengths])
    cases = [
        ("one response of 3 tokens (EOS at index 2), per-token KL, beta 0.1",
         dict(kl=kl, scores=np.array([2.0]), mask=mask, beta=0.1)),
        ("a response that ends at its first token", dict(kl=np.array([[0.4, 0.0, 0.0, 0.0]]), scores=np.array([1.5]),
                                                         mask=np.array([[1.0, 0.0, 0.0, 0.0]]), beta=0.5)),
        ("a response without EOS (all 4 tokens are the response)",
         dict(kl=np.array([[0.1, 0.2, -0.1, 0.3]]), scores=np.array([-1.0]), mask=np.ones((1, 4)), beta=0.2)),
        ("random batch of 4 (lengths 1, 5, 3, 2), KL nonzero past the ends",
         dict(kl=rng.normal(0, 0.3, (4, 5)).round(3), scores=rng.normal(size=4).round(3), mask=random_mask,
              beta=0.05)),
    ]
    return [make_case("per_token_rewards", name, inputs) for name, inputs in cases]


def bradley_terry_cases():
    rng = np.random.default_rng(5)
    return [
        make_case("bradley_terry_loss", "three pairs, margins 1, -2 and 0",
                  dict(r_chosen=np.array([1.0, 0.0, -0.5]), r_rejected=np.array([0.0, 2.0, -0.5])), ("r_chosen",)),
        make_case("bradley_terry_loss", "random, 6 pairs",
                  dict(r_chosen=rng.normal(size=6).round(3), r_rejected=rng.normal(size=6).round(3)),
                  ("r_chosen", "r_rejected")),
        make_case("bradley_terry_loss", "large margins: +500 and -1000",
                  dict(r_chosen=np.array([500.0, 0.0]), r_rejected=np.array([0.0, 1000.0]))),
    ]


def group_baseline_cases(function):
    """The public cases of GRPO's and RLOO's advantages: the same scores for both (GRPO's take eps too)."""
    rng = np.random.default_rng(7)
    cases = [
        ("two groups of k = 4", np.array([1.0, 0.0, 2.0, -1.0, 0.5, 0.5, 3.0, -2.0]), 4),
        ("k = 2: each pair", np.array([1.0, 3.0, -2.0, -2.5, 0.0, 4.0]), 2),
        ("a group of equal scores (every response scored the same): advantages 0",
         np.array([0.7, 0.7, 0.7, 1.0, -1.0, 2.0]), 3),
        ("one group of k = 8, scores with a common offset of 100", (100 + rng.normal(size=8)).round(3), 8),
        ("random, 6 groups of k = 5", (2 * rng.normal(size=30)).round(3), 5),
    ]
    extra = {"eps": 1e-4} if function == "group_relative_advantages" else {}
    built = [make_case(function, name, dict(scores=scores, group_size=k, **extra)) for name, scores, k in cases]
    if extra:  # an eps other than the default: it must be the argument that counts
        built.append(make_case(function, "eps = 0.5 (an argument, not a constant)",
                               dict(scores=np.array([0.0, 0.2, 1.0, 3.0]), group_size=2, eps=0.5)))
    return built


# ---------------------------------------------------------------- hidden cases: random, from a seed
def hidden_gae(rng, number):
    T, N = int(rng.integers(1, 8)), int(rng.integers(1, 4))
    scale = float(rng.choice([0.5, 1.0, 3.0]))
    dones = (rng.random((T, N)) < 0.3).astype(float)
    lam = float(rng.choice([0.0, 1.0, round(float(rng.uniform(0.3, 0.99)), 3)]))
    return make_case("compute_gae", f"hidden {number}", dict(
        rewards=(scale * rng.normal(size=(T, N))).round(3), values=(scale * rng.normal(size=(T, N))).round(3),
        dones=dones, next_value=(scale * rng.normal(size=N)).round(3),
        next_done=(rng.random(N) < 0.4).astype(float), gamma=round(float(rng.uniform(0.8, 0.999)), 3),
        gae_lambda=lam), hidden=True)


def hidden_policy_loss(rng, number):
    M = int(rng.integers(3, 10))
    kind = str(rng.choice(["clip", "kl-penalty"]))
    beta = round(float(rng.uniform(0.1, 3.0)), 3) if kind == "kl-penalty" else None
    return make_case("policy_loss", f"hidden {number}", dict(
        ratio=np.exp(rng.normal(0, 0.7, M)).round(3),
        advantages=(float(rng.choice([1, 3])) * rng.normal(size=M)).round(3),
        kl=np.abs(rng.normal(0, 0.2, M)).round(4), kind=kind, clip_coef=round(float(rng.uniform(0.05, 0.3)), 3),
        kl_beta=beta), ("ratio", "kl") if kind == "kl-penalty" else ("ratio",), hidden=True)


def hidden_value_loss(rng, number):
    M = int(rng.integers(3, 10))
    scale = float(rng.choice([0.5, 3.0]))
    return make_case("value_loss", f"hidden {number}", dict(
        new_value=(scale * rng.normal(size=M)).round(3), old_value=(scale * rng.normal(size=M)).round(3),
        returns=(scale * rng.normal(size=M)).round(3), clip_coef=round(float(rng.uniform(0.1, 0.5)), 3),
        clip_vloss=bool(number % 2)), ("new_value",), hidden=True)


def hidden_ppg_aux_loss(rng, number):
    M, A = int(rng.integers(2, 6)), int(rng.integers(2, 6))
    scale = float(rng.choice([0.5, 3.0]))
    return make_case("ppg_aux_loss", f"hidden {number}", dict(
        logits=(2 * rng.normal(size=(M, A))).round(3), old_logits=(2 * rng.normal(size=(M, A))).round(3),
        value=(scale * rng.normal(size=M)).round(3), aux_value=(scale * rng.normal(size=M)).round(3),
        value_targets=(scale * rng.normal(size=M)).round(3), beta_clone=round(float(rng.uniform(0.2, 2.0)), 3)),
        ("logits", "aux_value", "value"), hidden=True)


def hidden_vtrace(rng, number):
    T, B = int(rng.integers(1, 7)), int(rng.integers(1, 4))
    trailing = (2,) if number == 3 else ()

    def threshold():
        return None if rng.random() < 0.2 else round(float(rng.uniform(0.5, 2.5)), 3)

    lam = rng.uniform(0, 1, (T, B, *trailing)).round(3) if number % 2 else round(float(rng.uniform(0.3, 1.0)), 3)
    return make_case("from_importance_weights", f"hidden {number}", dict(
        log_rhos=rng.normal(0, 0.8, (T, B, *trailing)).round(3),
        discounts=np.where(rng.random((T, B, *trailing)) < 0.2, 0.0, 0.95),
        rewards=rng.normal(size=(T, B, *trailing)).round(3), values=rng.normal(size=(T, B, *trailing)).round(3),
        bootstrap_value=rng.normal(size=(B, *trailing)).round(3), clip_rho_threshold=threshold(),
        clip_c_threshold=threshold(), clip_pg_rho_threshold=threshold(), lambda_=lam), hidden=True)


def hidden_per_token_rewards(rng, number):
    B, L = int(rng.integers(1, 5)), int(rng.integers(2, 7))
    lengths = rng.integers(1, L + 1, B)
    mask = (np.arange(L)[None, :] < lengths[:, None]).astype(float)
    return make_case("per_token_rewards", f"hidden {number}", dict(
        kl=rng.normal(0, 0.5, (B, L)).round(3), scores=(2 * rng.normal(size=B)).round(3), mask=mask,
        beta=round(float(rng.uniform(0.01, 0.5)), 3)), hidden=True)


def hidden_bradley_terry(rng, number):
    P = int(rng.integers(2, 8))
    scale = float(rng.choice([1.0, 5.0, 300.0])) if number else 1.0
    return make_case("bradley_terry_loss", f"hidden {number}", dict(
        r_chosen=(scale * rng.normal(size=P)).round(3), r_rejected=(scale * rng.normal(size=P)).round(3)),
        ("r_chosen", "r_rejected") if scale < 100 else (), hidden=True)


def hidden_group_baseline(function, rng, number):
    k = int(rng.choice([2, 3, 4, 6]))
    groups = int(rng.integers(1, 5))
    scores = (float(rng.choice([0.3, 1.0, 5.0])) * rng.normal(size=groups * k)).round(3)
    if number == 0:
        scores[:k] = scores[0]  # a group of equal scores
    extra = {"eps": float(rng.choice([1e-4, 1e-3, 0.1]))} if function == "group_relative_advantages" else {}
    return make_case(function, f"hidden {number}", dict(scores=scores, group_size=k, **extra), hidden=True)


# ---------------------------------------------------------------- PPG's auxiliary phase: a procedure
def tiny_agent_weights(rng, actions=4, hidden=3):
    return {"trunk": rng.normal(0, 1, (3, hidden)).round(3),
            "policy_weight": rng.normal(0, 1, (hidden, actions)).round(3),
            "policy_bias": rng.normal(0, 0.5, actions).round(3),
            "aux_weight": rng.normal(0, 1, hidden).round(3), "aux_bias": np.array(0.1),
            "value_hidden": rng.normal(0, 1, (3, hidden)).round(3), "value_weight": rng.normal(0, 1, hidden).round(3),
            "value_bias": np.array(-0.2)}


def reference_phase(inputs, variant=None):
    """Algorithm 1's auxiliary phase on the tiny agent, the whole buffer as ONE minibatch (so the shuffle and the
    chunks' composition cannot matter), plain SGD: pi_old once, then E_aux steps on L_joint + L_value, each network's
    gradient clipped on its own, from zeroed gradients. Returns (final weights, the means of the three parts).
    `variant` replays a typical mistake."""
    agent = grading.TinyAgent(inputs["init"])
    args = inputs["args"]
    optimizer = torch.optim.SGD(agent.networks(), lr=inputs["lr"])
    if inputs.get("leftover") is not None:
        for name, array in inputs["leftover"].items():
            getattr(agent, name).grad = torch.tensor(array, dtype=torch.float64)
    aux_obs, targets = grading.phase_buffer(inputs["features"], inputs["targets"])
    obs, v_targ = aux_obs.flatten(0, 1), targets.flatten()

    def policy_old():
        with torch.no_grad():
            return agent.forward_aux(obs)[0]

    old_logits = policy_old()
    totals = np.zeros(3)
    epochs = 1 if variant == "one epoch" else args["e_aux"]
    for _ in range(epochs):
        if variant == "pi_old each epoch":
            old_logits = policy_old()
        if variant not in ("no zero_grad", "zero_grad after the step"):
            optimizer.zero_grad(set_to_none=True)
        logits, value, aux_value = agent.forward_aux(obs)
        old_log_probs = torch.log_softmax(old_logits, -1)
        kl = (old_log_probs.exp() * (old_log_probs - torch.log_softmax(logits, -1))).sum(-1).mean()
        aux_loss = 0.5 * ((aux_value - v_targ) ** 2).mean()
        value_loss = 0.5 * ((value - v_targ) ** 2).mean()
        (aux_loss + args["beta_clone"] * kl + value_loss).backward()
        totals += np.array([aux_loss.item(), kl.item(), value_loss.item()])
        if variant == "clipped over all parameters together":
            torch.nn.utils.clip_grad_norm_(list(agent.parameters()), args["max_grad_norm"])
        elif variant != "no clipping":
            for group in optimizer.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], args["max_grad_norm"])
        optimizer.step()
        if variant == "zero_grad after the step":
            optimizer.zero_grad(set_to_none=True)
    means = totals / epochs
    return agent.flat(), dict(zip(["aux/aux_value_loss", "aux/kl", "aux/value_loss"], means.tolist()))


PHASE_HINTS = {
    "pi_old each epoch": "pi_old is recomputed during the phase: Algorithm 1 computes and stores pi_old(.|s) for all "
                         "states in B once, BEFORE the first auxiliary step, and keeps it for all E_aux epochs.",
    "no zero_grad": "the gradients are not zeroed before each minibatch, so each step also carries the previous "
                    "steps' gradients: optimizer.zero_grad() first.",
    "zero_grad after the step": "the first step carries the policy phase's leftover gradient (it is still in .grad "
                                "when the phase starts): call optimizer.zero_grad() BEFORE each minibatch's "
                                "backward, the first one included, not after the step.",
    "one epoch": "only one epoch ran: the phase makes E_aux (args.e_aux) passes over the buffer.",
    "no clipping": "the gradient is not clipped: clip_grad_norms(optimizer, args.max_grad_norm) before each step "
                   "(it clips each network's gradient on its own).",
    "clipped over all parameters together": "the gradient is clipped over all parameters at once; clip each network "
                                            "(each optimizer param group) on its own, with "
                                            "clip_grad_norms(optimizer, args.max_grad_norm).",
}


def phase_case(name, inputs, checks, hint, variants=(), hidden=False):
    """A phase case: `checks` what to compare (the expectations are computed here), `variants` the mistakes whose
    final weights the report recognises."""
    expected = dict(checks, hint=hint)
    if "weights" in checks or "stats" in checks:
        weights, stats = reference_phase(inputs)
        if "weights" in checks:
            expected["weights"] = weights
        if "stats" in checks:
            expected["stats"] = stats
    mistakes = []
    for variant in variants:
        weights = reference_phase(inputs, variant)[0]
        if not np.allclose(weights, expected.get("weights", weights + 1), rtol=1e-4, atol=1e-6):
            mistakes.append({"name": variant, "hint": PHASE_HINTS[variant], "outputs": weights})
    return Case("auxiliary_phase", name, inputs, expected, mistakes=mistakes, hidden=hidden, kind="phase")


def phase_cases(seed=None, disguise_rng=None):
    """The phase's cases: public with seed None, else hidden ones drawn from the seed. With `disguise_rng`, the
    public cases' value targets, initial weights and leftover gradients are disguised (disguise) and their
    expectations recomputed: the frames' pixels stay, they index the rollouts."""
    rng = np.random.default_rng(6 if seed is None else seed)
    hidden = seed is not None
    prefix = "hidden: " if hidden else ""
    suffix = " (inputs rescaled by ~1 %)" if disguise_rng is not None else ""

    def made(name, inputs, checks, hint, variants=()):
        if disguise_rng is not None:
            inputs = dict(inputs)
            for key in ("targets", "init", "leftover"):
                if isinstance(inputs.get(key), dict):
                    inputs[key] = {part: disguise(array, disguise_rng) for part, array in inputs[key].items()}
                elif key in inputs:
                    inputs[key] = disguise(inputs[key], disguise_rng)
        return phase_case(prefix + name + suffix, inputs, checks, hint, variants, hidden=hidden)

    def buffer(rollouts, steps=2):
        return dict(features=rng.integers(0, 256, (rollouts, steps, 3)).astype(float),
                    targets=(2 * rng.normal(size=(rollouts, steps))).round(3), init=tiny_agent_weights(rng))

    def settings(**overrides):
        return {"num_envs": 64, "e_aux": 1, "num_aux_rollouts": 4, "n_aux_grad_accum": 1, "max_grad_norm": 1e9,
                "beta_clone": round(float(rng.uniform(0.5, 2.0)), 3), **overrides}

    leftover = {name: rng.normal(0, 5, np.shape(array)).round(3) for name, array in tiny_agent_weights(rng).items()}
    four = buffer(4)
    moving = dict(four, args=settings(e_aux=3), lr=0.5, leftover=leftover)
    with_nan = buffer(4)
    with_nan["targets"][1, 0] = np.nan
    cases = [
        made("lr 0: E_aux = 2 epochs of 2 minibatches of 2 rollouts: 4 steps, KL 0, the buffer's "
                   "losses", dict(four, args=settings(e_aux=2, num_aux_rollouts=2), lr=0.0),
                   {"steps": 4, "why_steps": "2 epochs x 2 minibatches", "minibatch": 2, "stats": True},
                   "with a learning rate of 0 nothing moves, so every minibatch's KL(pi_old || pi) is exactly 0 when "
                   "pi_old is computed once, before the first step, and each minibatch gets the stored pi_old of ITS "
                   "rollouts (the same shuffled indices as its frames); the returned means are the means of "
                   "ppg_aux_loss's parts over the minibatches; one optimizer step per minibatch of "
                   "aux_rollouts_per_rank(args) rollouts."),
        made("the default minibatch size: num_aux_rollouts None and 32 games give 2 rollouts",
                   dict(four, args=settings(num_envs=32, num_aux_rollouts=None), lr=0.0),
                   {"steps": 2, "why_steps": "1 epoch x 2 minibatches of 2 rollouts", "minibatch": 2},
                   "num_aux_rollouts is None by default (the PPG code's 4 per 64 games): the minibatch size in "
                   "rollouts is aux_rollouts_per_rank(args), never args.num_aux_rollouts itself."),
        made("a new shuffle in each epoch: 8 rollouts, minibatches of 2, 3 epochs",
                   dict(buffer(8), args=settings(e_aux=3, num_aux_rollouts=2), lr=0.0),
                   {"steps": 12, "why_steps": "3 epochs x 4 minibatches", "shuffle": [8, 4], "epochs": 3},
                   "each epoch draws a new random order of the R rollouts (torch.randperm(R) per epoch) and splits "
                   "it into minibatches of whole rollouts."),
        made("E_aux = 3 on one minibatch of all 4 rollouts, SGD lr 0.5, starting with the policy "
                   "phase's leftover gradients in .grad", moving, {"weights": True},
                   "Algorithm 1 with zeroed gradients before each minibatch (the first included), pi_old stored "
                   "once, E_aux epochs, each network's gradient clipped on its own.",
                   ("zero_grad after the step", "no zero_grad", "pi_old each epoch", "one epoch")),
        made("its statistics: each part averaged over the minibatches of ALL 3 epochs", moving,
                   {"stats": True}, "accumulate ppg_aux_loss's three parts (detached) over every minibatch of every "
                   "epoch and divide by the number of steps; not the last epoch's, not the last minibatch's."),
        made("max_grad_norm 0.01: each network's gradient clipped on its own",
                   dict(four, args=settings(max_grad_norm=0.01), lr=0.5), {"weights": True},
                   "clip_grad_norms(optimizer, args.max_grad_norm) before each step: it clips theta_pi's and "
                   "theta_V's gradients each on its own.", ("no clipping", "clipped over all parameters together")),
        made("n_aux_grad_accum = 2 on a minibatch of 3 rollouts: chunks of 2 and 1, one step",
                   dict(buffer(3), args=settings(num_aux_rollouts=3, n_aux_grad_accum=2, e_aux=2), lr=0.5),
                   {"weights": True, "stats": True, "steps": 2, "why_steps": "2 epochs x 1 minibatch"},
                   "with n_aux_grad_accum chunks of UNEQUAL size, weigh each chunk's loss (and its statistics) by "
                   "len(chunk) / len(minibatch), not by 1 / n_aux_grad_accum: the accumulated gradient must be the "
                   "minibatch's mean gradient; one optimizer step per minibatch."),
        made("a NaN value target: FloatingPointError before any step changes the weights",
                   dict(with_nan, args=settings(), lr=0.5), {"raises": True},
                   "check the gradient norms that clip_grad_norms returns and raise FloatingPointError when they are "
                   "not finite, before optimizer.step() (as ppo_update does)."),
    ]
    return cases


# ---------------------------------------------------------------- all cases of an exercise
PUBLIC = {"compute_gae": gae_cases, "policy_loss": policy_loss_cases, "value_loss": value_loss_cases,
          "ppg_aux_loss": ppg_aux_loss_cases, "auxiliary_phase": phase_cases,
          "from_importance_weights": vtrace_cases, "per_token_rewards": per_token_rewards_cases,
          "bradley_terry_loss": bradley_terry_cases,
          "group_relative_advantages": lambda: group_baseline_cases("group_relative_advantages"),
          "leave_one_out_advantages": lambda: group_baseline_cases("leave_one_out_advantages")}
HIDDEN = {"compute_gae": hidden_gae, "policy_loss": hidden_policy_loss, "value_loss": hidden_value_loss,
          "ppg_aux_loss": hidden_ppg_aux_loss, "from_importance_weights": hidden_vtrace,
          "per_token_rewards": hidden_per_token_rewards, "bradley_terry_loss": hidden_bradley_terry,
          "group_relative_advantages": lambda rng, number: hidden_group_baseline("group_relative_advantages", rng,
                                                                                 number),
          "leave_one_out_advantages": lambda rng, number: hidden_group_baseline("leave_one_out_advantages", rng,
                                                                                number)}


def hidden_cases(function, seed):
    """Random cases of `function` from a seed of the submission (and the function's name)."""
    digest = hashlib.sha256(f"{seed}:{function}".encode()).digest()
    if function == "auxiliary_phase":
        return phase_cases(int.from_bytes(digest[:4], "little"))
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return [HIDDEN[function](rng, number) for number in range(HIDDEN_PER_FUNCTION)]


def submission_seed(secret, student):
    """The hidden cases' seed: sha256 of the secret and the student's name, its bytes as the folder's name has them
    (a name that is not UTF-8 included)."""
    text = secret.encode("utf-8", "surrogateescape") + b"\0" + os.fsencode(student)
    return int(hashlib.sha256(text).hexdigest()[:12], 16)


def make_public_cases(directory=grading.CASES_DIR):
    os.makedirs(directory, exist_ok=True)
    for function, build in PUBLIC.items():
        grading.save_cases(os.path.join(directory, f"{function}.json"), build())


# ---------------------------------------------------------------- the instructor's cases of a submission
def disguise(value, rng):
    """An input array with each entry times exp(N(0, 0.01^2)): signs, zeros and 0/1 masks (dones, a response's
    mask) kept, so the case means what it meant; anything else is returned as it is."""
    if not isinstance(value, np.ndarray) or np.isin(value, (0.0, 1.0)).all():
        return value
    return value * np.exp(rng.normal(0.0, 0.01, value.shape))


def disguised_public(function, seed):
    """The public cases with their inputs disguised from the seed and their answers recomputed: a submission that
    looks up the shipped answers (exercises/cases/*.json) gains nothing, an honest one passes as on the shipped
    cases. The phase's cases are procedures on a tiny agent whose pixels index its rollouts: their value targets,
    initial weights and leftover gradients are disguised (phase_cases)."""
    digest = hashlib.sha256(f"{seed}:public:{function}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    if function == "auxiliary_phase":
        return phase_cases(disguise_rng=rng)
    public = PUBLIC[function]()
    return [make_case(function, f"{case.name} (inputs rescaled by ~1 %)",
                      {key: disguise(value, rng) for key, value in case.inputs.items()}, tuple(case.grads))
            for case in public]


def cases_for(seed):
    """`cases(function)`: a function's cases for the submission of `seed`, the public ones disguised and the hidden
    ones drawn from it; made once per function, so every exercise grades a function on the same cases."""
    made = {}

    def cases(function):
        if function not in made:
            made[function] = disguised_public(function, seed) + hidden_cases(function, seed)
        return made[function]
    return cases


# ---------------------------------------------------------------- grading a submission (in its own process)
def grade_submission(scripts, refused, exercises, student, secret, limits=None, number=0, zygote=None):
    """The whole grade of one student: {exercise: [Result]} and the text report. `scripts`: {script: the bytes this
    process read}; `refused`: {script: why it was not read} (its cases score 0 with that reason). The student's
    code runs in a child process that `zygote` forks (exercises/sandbox.py; without one, a zygote for this
    submission alone); the cases, their answers and every point are made here."""
    seed = submission_seed(secret, student)
    start = time.time()
    graded, ended = sandbox.grade(scripts, refused, exercises, cases_for(seed), limits or sandbox.Limits(),
                                  sandbox.uid_for(number), zygote)
    graded = {exercise: sandbox.weighted(results, EXERCISE_POINTS) for exercise, results in graded.items()}
    seconds = time.time() - start
    names = sorted([*scripts, *refused])
    lines = [f"student {sandbox.display(student)}: {', '.join(names)} (hidden cases from seed {seed})"]
    lines += [f"not read: {why}" for why in refused.values()]
    if ended != "ok":
        lines.append(f"the submission's process: {ended}")
    for exercise, results in graded.items():
        points, total = grading.score(results)
        lines.append(f"exercise {exercise}: {points:.2f} / {total:.0f} points")
        lines += grading.report_lines(results)
    total_points = round(sum(grading.score(r)[0] for r in graded.values()), 2)
    total_max = round(sum(grading.score(r)[1] for r in graded.values()), 2)
    lines.append(f"total: {total_points:g} / {total_max:g} points ({seconds:.1f} s; the learning curve is "
                 "informational and gives no points)")
    result = {"student": sandbox.display(student), "seed": seed, "files": names, "not_read": list(refused.values()),
              "seconds": round(seconds, 2), "process": ended, "points": total_points, "max_points": total_max,
              "exercises": {exercise: {"points": round(grading.score(results)[0], 2),
                                       "max_points": round(grading.score(results)[1], 2),
                                       "cases": [dict(dataclasses.asdict(r), passed=r.passed) for r in results]}
                            for exercise, results in graded.items()}}
    return result, "\n".join(lines)


def exercises_of(names, chosen=None):
    """The exercises whose script the submission holds (or `chosen`)."""
    if chosen:
        return chosen
    return [exercise for exercise, info in EXERCISES.items() if info["script"] in names]


def failed_result(student, names, exercises, reason):
    """0 points of the same maximum for every exercise, with the reason (the grader could not grade this one)."""
    parts = {exercise: {"points": 0.0, "max_points": EXERCISE_POINTS, "cases": [
        {"item": exercise, "points": 0.0, "max_points": EXERCISE_POINTS, "message": reason, "hidden": False,
         "passed": False}]} for exercise in exercises}
    result = {"student": sandbox.display(student), "seed": None, "files": sorted(names), "not_read": [],
              "seconds": 0.0, "process": reason, "points": 0.0,
              "max_points": float(EXERCISE_POINTS * len(exercises)), "exercises": parts}
    return result, f"student {sandbox.display(student)}: {reason}"


def grade_folder(number, folder_descriptor, student, exercises, secret, limits, zygote):
    """One sub-folder of the batch (`student`, in the folder open as `folder_descriptor`): (result, report). A
    folder that is a symbolic link is not read; should the grader itself fail on a submission, that submission
    gets 0 of the same maximum and the reason; the others are graded all the same."""
    scripts, refused, chosen = {}, {}, list(exercises or [])
    try:
        directory = sandbox.open_entry(student, folder_descriptor, directory=True)
        if directory is None:
            raise sandbox.Refused(f"{sandbox.display(student)} is gone")
        try:
            scripts, refused = sandbox.read_submission(directory, SCRIPTS)
        finally:
            os.close(directory)
        chosen = exercises_of([*scripts, *refused], exercises)
        return grade_submission(scripts, refused, chosen, student, secret, limits, number, zygote)
    except sandbox.Refused as why:
        return failed_result(student, [], chosen, f"not read: {why}")
    except Exception as error:  # a grader bug or a report it cannot read: never the whole class's batch
        reason = (f"the grader failed on this submission ({type(error).__name__}: {str(error)[:500]}); grade it "
                  "again alone")
        return failed_result(student, [*scripts, *refused], chosen, reason)


def report_names(students):
    """{student: the stem of its report files}: the name made printable (sandbox.display); a long one, or one that
    two folders share once escaped, gets a digest of its bytes so that no report overwrites another."""
    stems, taken = {}, set()
    for student in students:
        stem = sandbox.display(student)
        if len(stem) > 100 or stem in taken or stem.startswith("."):
            stem = f"{stem[:80].lstrip('.')}-{hashlib.sha256(os.fsencode(student)).hexdigest()[:12]}"
        taken.add(stem)
        stems[student] = stem
    return stems


def spreadsheet_cell(text):
    """A CSV cell that no spreadsheet reads as a formula: one that starts with = + - @ (or a tab or carriage
    return) gets a leading apostrophe."""
    return f"'{text}" if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def batch(folder, exercises, secret, out, limits=None, jobs=2, secret_file=None):
    """One student per sub-folder of `folder`, `jobs` children at a time; after every child has ended, a report
    and a JSON per student and one CSV row each, each file written atomically. Returns the CSV's rows."""
    os.makedirs(out, exist_ok=True)
    warn_if_open(folder, out, repository=ROOT, secret_file=secret_file)
    folder_descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.scandir(folder) as entries:  # a link to a folder is listed, then refused (grade_folder)
            students = sorted((entry.name for entry in entries if entry.is_dir()), key=os.fsencode)
        # One zygote for the whole batch: each child is a fork of it, so the interpreter and its imports start once.
        with sandbox.Zygote() as zygote, concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            graded = list(pool.map(grade_folder, range(len(students)), [folder_descriptor] * len(students),
                                   students, [exercises] * len(students), [secret] * len(students),
                                   [limits] * len(students), [zygote] * len(students)))
    finally:
        os.close(folder_descriptor)
    rows = []
    columns = list(EXERCISES)
    stems = report_names(students)
    for student, (result, text) in zip(students, graded):
        grading.write_atomic(os.path.join(out, f"{stems[student]}.txt"),
                            sandbox.printable_text(text[:REPORT_CHARS]) + "\n")
        grading.write_atomic(os.path.join(out, f"{stems[student]}.json"), json.dumps(result, indent=1))
        row = {"student": spreadsheet_cell(sandbox.display(student)), "points": result["points"],
               "max_points": result["max_points"], "seconds": result["seconds"]}
        for exercise in columns:
            part = result["exercises"].get(exercise)
            row[exercise] = "" if part is None else f"{part['points']:g}/{part['max_points']:g}"
        rows.append(row)
        print(f"{sandbox.display(student)}: {result['points']:g} / {result['max_points']:g} "
              f"({result['seconds']:.1f} s)")
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=["student", "points", "max_points", *columns, "seconds"])
    writer.writeheader()
    writer.writerows(rows)
    grading.write_atomic(os.path.join(out, "grades.csv"), table.getvalue())
    return rows


def open_to_others(path):
    """True when a user other than the owner (a submission's uid) may read `path`: every folder above it lets
    others through (o+x) and it lets them read (o+r)."""
    path = os.path.abspath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def warn_if_open(*folders, repository=None, secret_file=None):
    """As root the children run under uids of their own: what other users may read is open to them. Warn about
    the submissions and output folders, the repository (its references answer every case) and the secret's file."""
    if os.geteuid() != 0:
        return
    things = [(folder, folder) for folder in folders]
    if repository is not None:
        things.append((os.path.join(repository, "exercises", "references.py"), repository))
    if secret_file not in (None, "-"):
        things.append((secret_file, secret_file))
    for path, fix in things:
        if open_to_others(path):
            print(f"warning: {path} is readable by other users, so by the submissions' processes too: "
                  f"chmod -R o-rwx {fix}", file=sys.stderr)


# ---------------------------------------------------------------- Gradescope: the bundle and its run
GRADESCOPE_ROOT = "/autograder"  # Gradescope's folder; $AUTOGRADER_ROOT overrides it (a test lays one out)
GRADESCOPE_PYTHON = "/opt/course_grader/venv/bin/python"  # setup.sh's virtual environment; $AUTOGRADER_PYTHON
SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image: a virtual environment with the pinned
# CPU build of torch and the repository's requirements, then the bundle made readable by root only. Choose the
# Ubuntu 24.04 base image (Python 3.12): requirements.txt installs on CPython 3.11 to 3.14, not 22.04's 3.10.
set -euo pipefail
apt-get update
apt-get install -y python3 python3-venv python3-pip
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11) and "setup.sh: Python >= 3.11 (Ubuntu 24.04) needed")'
python3 -m venv /opt/course_grader/venv
/opt/course_grader/venv/bin/pip install --no-cache-dir torch=={torch} --index-url https://download.pytorch.org/whl/cpu
/opt/course_grader/venv/bin/pip install --no-cache-dir -r /autograder/source/requirements.txt
chmod -R go-rwx /autograder/source
"""
RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this as root for each submission: the grader (in source/, readable by root only) grades
# submission/ as an unprivileged user of its own per submission and writes results/results.json.
ROOT="${{AUTOGRADER_ROOT:-/autograder}}"
chmod -R go-rwx "$ROOT/source"
exec "${{AUTOGRADER_PYTHON:-{python}}}" -I "$ROOT/source/exercises/instructor.py" gradescope-run {exercise} \\
    --secret-file "$ROOT/source/secret"
"""


def pinned_torch():
    """torch's version as requirements.txt pins it."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            if line.startswith("torch=="):
                return line.split("==", 1)[1].split(";")[0].strip()
    raise RuntimeError("requirements.txt pins no torch")


def gradescope_bundle(exercise, out, secret):
    """autograder.zip for Gradescope: setup.sh and run_autograder at its root, source/'s files beside them
    (Gradescope unpacks the zip into /autograder/source): the repository's four scripts, requirements.txt,
    exercises/ (the grader, the references, the public cases) and the secret, each readable by root only."""
    import zipfile
    members = [name for name in SCRIPTS] + ["requirements.txt"]
    for directory, folders, names in os.walk(HERE):
        folders[:] = [folder for folder in folders if folder != "__pycache__"]
        for name in names:
            if name.endswith((".py", ".json")):
                members.append(os.path.relpath(os.path.join(directory, name), ROOT))
    with zipfile.ZipFile(out + ".part", "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, text, mode in (("setup.sh", SETUP_SH.format(torch=pinned_torch()), 0o700),
                                 ("run_autograder", RUN_AUTOGRADER.format(python=GRADESCOPE_PYTHON,
                                                                          exercise=exercise), 0o700),
                                 ("secret", secret + "\n", 0o600)):
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | mode) << 16
            bundle.writestr(info, text)
        for member in sorted(members):
            info = zipfile.ZipInfo.from_file(os.path.join(ROOT, member), member)
            info.external_attr = (stat.S_IFREG | 0o600) << 16
            with open(os.path.join(ROOT, member), "rb") as f:
                bundle.writestr(info, f.read(), zipfile.ZIP_DEFLATED)
    os.chmod(out + ".part", 0o600)
    os.replace(out + ".part", out)


def visible_report(result):
    """The report a student sees before grades are published: the visible cases only, each exercise's points on
    them, and how many hidden cases wait; no hidden case's input, verdict or hint, no total and no seed (which,
    with the published grader, would let one recompute the hidden cases), no name or email."""
    lines = [f"graded: {', '.join(result['files']) or 'no file'}"]
    lines += [f"not read: {why}" for why in result["not_read"]]
    if result["process"] != "ok":
        lines.append(f"the submission's process: {result['process']}")
    for exercise, part in result["exercises"].items():
        cases = [grading.Result(**{key: value for key, value in case.items() if key != "passed"})
                 for case in part["cases"]]
        shown = [case for case in cases if not case.hidden]
        points, total = grading.score(shown)
        lines.append(f"exercise {exercise}: {points:.2f} / {total:.0f} points on the visible cases")
        lines += grading.report_lines(shown)
        hidden = len(cases) - len(shown)
        if hidden:
            worth = round(grading.score(cases)[1] - total, 2)
            lines.append(f"  {hidden} hidden cases ({worth:g} points): their results and the total are shown once "
                         "grades are published")
    return "\n".join(lines)


def gradescope_results(result):
    """Gradescope's results.json (gradescope-autograders.readthedocs.io, "Autograder Specifications"): the score,
    the visible cases' report as the submission's output (visible at once), one test per case (hidden cases shown
    once grades are published)."""
    tests = []
    for exercise, part in result["exercises"].items():
        for case in part["cases"]:
            tests.append({"name": sandbox.printable_text(f"{exercise}: {case['item']}"),
                          "score": round(case["points"], 4), "max_score": round(case["max_points"], 4),
                          "output": sandbox.printable_text(case["message"][:20000]),
                          "visibility": "after_published" if case["hidden"] else "visible"})
    return {"score": result["points"], "output": sandbox.printable_text(visible_report(result)[:REPORT_CHARS]),
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


def gradescope_student(root):
    """The seed's name: the first submitter's email in submission_metadata.json (Gradescope writes it; the
    student cannot), or "submission" without one. As root the file is made root's and closed to others first:
    it holds the submitters' names and emails and their earlier submissions' results, hidden tests included,
    which the submission's code must not read."""
    try:
        descriptor = os.open(os.path.join(root, "submission_metadata.json"), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return "submission"
    with os.fdopen(descriptor) as f:
        if os.geteuid() == 0:
            os.fchown(descriptor, 0, 0)
            os.fchmod(descriptor, 0o600)
        try:
            users = json.load(f).get("users") or []
            email = users[0].get("email")
        except (OSError, ValueError, AttributeError, IndexError, TypeError):
            return "submission"
    return email if isinstance(email, str) and email else "submission"


def gradescope_run(exercise, secret, limits):
    """What run_autograder runs: grade the submission, write results.json; any failure is a 0 with its reason.
    The results folder is made root's and closed to others first: a submission cannot write results.json."""
    root = os.environ.get("AUTOGRADER_ROOT", GRADESCOPE_ROOT)
    results = os.path.join(root, "results")
    os.makedirs(results, exist_ok=True)
    os.chown(results, 0, 0)
    os.chmod(results, 0o755)
    student = gradescope_student(root)
    try:
        descriptor = os.open(os.path.join(root, "submission"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            scripts, refused = sandbox.read_submission(descriptor, SCRIPTS)
        finally:
            os.close(descriptor)
        if not scripts and not refused:
            raise sandbox.Refused(f"the submission holds none of {', '.join(SCRIPTS)}")
        result, text = grade_submission(scripts, refused, [exercise], student, secret, limits)
    except Exception as error:  # a crash of the grader's: a 0 with its reason, never a missing results.json
        reason = f"not graded: {type(error).__name__}: {str(error)[:2000]}"
        result, text = failed_result(student, [], [exercise], reason)
    grading.write_atomic(os.path.join(results, "results.json"), json.dumps(gradescope_results(result), indent=1))
    print(sandbox.printable_text(text[:REPORT_CHARS]))
    return 0


# ---------------------------------------------------------------- the secret: never on a command line
SECRET_HELP = ("a file holding the secret mixed into each submission's seed (its first line; - for standard "
               "input), so that students cannot reproduce the hidden cases; default: $GRADER_SECRET. Never on a "
               "command line: every process on the machine reads any process's command line (/proc/PID/cmdline), "
               "a wrapper's too (timeout, /usr/bin/time), the submissions' processes among them")
SAME_USER = ("as a normal user every submission runs as you: it can read and change your files (the references, "
             "the secret, the other submissions, grades.csv), read the grader's memory, signal it and outlive "
             "the batch")


def read_secret(path):
    """The secret from a file or standard input ("-"): its first line, without the line's end."""
    if path == "-":
        return sys.stdin.readline().rstrip("\r\n")
    with open(path, errors="surrogateescape") as f:
        return f.readline().rstrip("\r\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("grade", help="grade one submission")
    one.add_argument("exercise", choices=sorted(EXERCISES))
    one.add_argument("files", nargs="+", help=f"the student's scripts, each named as the one it fills in "
                     f"({', '.join(SCRIPTS)})")
    one.add_argument("--student", default=None, help="the student's name (seeds the hidden cases; default: the "
                     "folder of the first file)")
    one.add_argument("--json", default=None, help="write the JSON result here")
    many = commands.add_parser("batch", help="grade every sub-folder of a folder of submissions")
    many.add_argument("submissions")
    many.add_argument("--exercises", default=None, help="comma-separated (default: each exercise whose script a "
                      "submission holds)")
    many.add_argument("--out", default="grades", help="folder for the reports, JSON results and grades.csv")
    many.add_argument("--jobs", type=int, default=2, help="submissions graded at once (one child process each)")
    commands.add_parser("make-cases", help="rewrite the public cases (exercises/cases/*.json) from the references")
    bundle = commands.add_parser("gradescope", help="build Gradescope's autograder.zip for one exercise")
    bundle.add_argument("exercise", choices=sorted(EXERCISES))
    bundle.add_argument("--out", default="autograder.zip", help="the zip to write")
    run = commands.add_parser("gradescope-run", help="what the bundle's run_autograder runs (as root, on "
                              "$AUTOGRADER_ROOT, default /autograder)")
    run.add_argument("exercise", choices=sorted(EXERCISES))
    defaults = sandbox.Limits()
    bundle.add_argument("--secret-file", default=None, help="the secret baked into the bundle (its first line); "
                        "default: a new random one, printed once")
    for command in (one, many, run):
        command.add_argument("--secret-file", default=None, help=SECRET_HELP)
        command.add_argument("--secret", default=None, help=argparse.SUPPRESS)  # refused below, with the reason
        command.add_argument("--unsafe-same-user", action="store_true",
                             help="grade without root all the same (refused otherwise): " + SAME_USER)
        command.add_argument("--seconds", type=float, default=defaults.seconds,
                             help="wall-clock limit of one submission's process")
        command.add_argument("--cpu-seconds", type=int, default=defaults.cpu_seconds,
                             help="CPU-time limit of one submission's process")
        command.add_argument("--memory-gib", type=float, default=defaults.memory_bytes / 2**30,
                             help="address-space limit of one submission's process, GiB")
        command.add_argument("--case-seconds", type=float, default=defaults.case_seconds,
                             help="a function that runs past this on one case is not run on its later cases")
    options = parser.parse_args(argv)
    if options.command == "make-cases":
        make_public_cases()
        print(f"wrote {grading.CASES_DIR}")
        return 0
    if options.command == "gradescope":
        secret = read_secret(options.secret_file) if options.secret_file else secrets.token_hex(16)
        if not options.secret_file:
            print(f"the bundle's secret (keep it to grade again outside Gradescope): {secret}")
        gradescope_bundle(options.exercise, options.out, secret)
        print(f"wrote {options.out}: upload it as the assignment's autograder (docs/assignments.md)")
        return 0
    if options.secret is not None:
        parser.error("--secret: a secret on the command line is readable by every process on the machine "
                     "(/proc/PID/cmdline), the submissions' included; use --secret-file FILE (- for standard input)")
    if os.geteuid() != 0 and not options.unsafe_same_user:
        parser.error(f"refusing to grade without root: {SAME_USER}; run it as root (each submission then gets a "
                     "uid of its own), or pass --unsafe-same-user to accept that")
    if os.geteuid() != 0:
        print(f"warning: --unsafe-same-user: {SAME_USER}", file=sys.stderr)
    limits = limits_of(parser, options)
    if options.command == "gradescope-run":
        if os.geteuid() != 0:
            parser.error("gradescope-run: run it as root (Gradescope runs run_autograder as root)")
        return gradescope_run(options.exercise, read_secret(options.secret_file), limits)
    if options.command == "batch":
        unknown = [e for e in (options.exercises or "").split(",") if e and e not in EXERCISES]
        if unknown:
            parser.error(f"--exercises: unknown {', '.join(unknown)}; choose from {', '.join(EXERCISES)}")
        if options.jobs < 1:
            parser.error(f"--jobs: {options.jobs}; must be 1 or more")
    names = [os.path.basename(path) for path in options.files] if options.command == "grade" else []
    if [name for name in names if name not in SCRIPTS] or len(set(names)) != len(names):
        parser.error(f"files: {', '.join(names)}; each must be named as the script it fills in, once "
                     f"({', '.join(SCRIPTS)}): the grader grades the functions of that script")
    secret = os.environ.get("GRADER_SECRET", "") if options.secret_file is None else read_secret(options.secret_file)
    if not secret:
        print("warning: no secret (--secret-file or $GRADER_SECRET): anyone can draw a student's hidden cases",
              file=sys.stderr)
    if options.command == "batch":
        chosen = [e for e in (options.exercises or "").split(",") if e]
        batch(options.submissions, chosen, secret, options.out, limits, options.jobs, options.secret_file)
        return 0
    warn_if_open(repository=ROOT, secret_file=options.secret_file)
    scripts, refused = {}, {}
    for path in options.files:
        try:
            folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        except OSError as error:
            parser.error(f"files: {path}: its folder cannot be opened ({error.strerror})")
        try:
            found, why = sandbox.read_submission(folder, [os.path.basename(path)])
        finally:
            os.close(folder)
        scripts.update(found)
        refused.update(why)
        if not found and not why:
            parser.error(f"files: {path} does not exist")
    student = options.student or os.path.basename(os.path.dirname(os.path.abspath(options.files[0])))
    result, text = grade_submission(scripts, refused, [options.exercise], student, secret, limits)
    print(sandbox.printable_text(text[:REPORT_CHARS]))
    if options.json:
        grading.write_atomic(options.json, json.dumps(result, indent=1))
    return 0 if result["points"] == result["max_points"] else 1


def limits_of(parser, options):
    """The limits from the flags; each must be positive."""
    for flag in ("seconds", "cpu_seconds", "memory_gib", "case_seconds"):
        if getattr(options, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')}: {getattr(options, flag)}; must be > 0")
    return dataclasses.replace(sandbox.Limits(), seconds=options.seconds, cpu_seconds=options.cpu_seconds,
                               memory_bytes=int(options.memory_gib * 2**30), case_seconds=options.case_seconds)


if __name__ == "__main__":
    sys.exit(main())
