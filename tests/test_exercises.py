"""exercises/: each grader passes on the scripts' own functions and on independent correct solutions, and fails with
the right hint on typical mistakes (the mutants below, as a student would write them); the starter code imports,
runs what is not blank, and its blanks fail their graders with the exercise's text; a full grade, training
included, passes for every exercise."""
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT

from exercises import grade, make_starter
from exercises.texts import EXERCISES, STUB_TEXT

SCRIPT_OF = {name: exercise["script"] for name, exercise in EXERCISES.items()}


def with_functions(exercise, *sources, script=None):
    """A fresh copy of the exercise's script with the given function sources put in place of its own."""
    module = grade.load_script(os.path.join(ROOT, script or SCRIPT_OF[exercise]))
    for source in sources:
        exec(source, module.__dict__)  # noqa: S102 - the mutants below
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
}


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
}
PPO_HINT = {"value: min instead of max": "min instead of max", "value: clipped around the returns":
            "clipped around the returns", "value: the factor 0.5 missing": "the factor 0.5 missing"}


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
    size = args.num_aux_rollouts
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
            for group in optimizer.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], args.max_grad_norm)
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
    "no clipping": ("phase", [('torch.nn.utils.clip_grad_norm_(group["params"], args.max_grad_norm)', "pass")]),
    "one epoch": ("phase", [("range(args.e_aux)", "range(1)")]),
    "chunks not weighted": ("phase", [("(loss * len(chunk) / len(rollouts)).backward()", "loss.backward()")]),
}
MESSAGE = {"pi_old not aligned with the shuffled rollouts": "KL(pi_old || pi) must be exactly 0",
           "the ratio detached": "no gradient reaches ratio"}  # mistakes told by the message, not by a hint


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
}


def mutate(source, replacements):
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


CORRECT = {"gae": [GAE], "ppo_loss": [POLICY_LOSS, VALUE_LOSS], "ppg_aux": [AUX_LOSS, PHASE], "vtrace": [VTRACE],
           "rlhf": [REWARDS, BT]}


def mutant_cases():
    cases = []
    for name, replacements in GAE_MUTANTS.items():
        cases.append(("gae", name, [mutate(GAE, replacements)], name))
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


@pytest.mark.parametrize("exercise,mistake,sources,hint", mutant_cases(), ids=lambda x: x if isinstance(x, str) and
                         len(x) < 60 else None)
def test_graders_catch_the_mistake_and_name_it(exercise, mistake, sources, hint):
    message = failure(exercise, with_functions(exercise, *sources))
    expected = MESSAGE.get(mistake, f"hint ({hint})")
    assert expected in message, message
    assert "expected" in message or "hint" in message or "gradient" in message  # in the reader's terms


def test_a_failure_shows_the_case_its_inputs_and_expected_vs_got():
    message = failure("gae", with_functions("gae", mutate(GAE, GAE_MUTANTS["dones[t] used for dones[t + 1]"])))
    assert "differs from the definition on case 2/" in message  # case 1 has no episode end: it passes
    for part in ("an episode ends inside the rollout", "next_done  = [0.]", "expected:", "got:",
                 "first difference at [",
                 "dones[t] is used where dones[t + 1] belongs"):
        assert part in message, (part, message)


# ---------------------------------------------------------------- starter code
@pytest.fixture(scope="module")
def starter(tmp_path_factory):
    out = tmp_path_factory.mktemp("starter")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "exercises", "make_starter.py"), "--exercises",
                             ",".join(EXERCISES), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return out


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


def test_the_pytest_route_grades_a_given_script(starter):
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(ROOT, "exercises"),
               "-m", "vtrace", "--no-train"]
    own = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert own.returncode == 0 and "1 passed" in own.stdout, own.stdout + own.stderr
    blank = subprocess.run(command + ["--script", str(starter / "vtrace.py")], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert blank.returncode == 1 and "from_importance_weights is still a blank" in blank.stdout, blank.stdout


def test_a_starter_copy_with_its_blank_filled_in_passes_its_grader(starter, tmp_path):
    """What a student does: replace the stub's raise by a body, then run the grader copied next to the starter."""
    source = (starter / "ppo_procgen.py").read_text()
    head, rest = source.split("def compute_gae(", 1)
    signature_and_doc, stub_and_after = rest.split("    # Exercise gae: your code here", 1)
    after = stub_and_after.split('""")\n', 1)[1]
    body = GAE.split('"""', 1)[0].split("gae_lambda):\n", 1)[1]  # the solution's body, indented as a body
    (tmp_path / "ppo_procgen.py").write_text(head + "def compute_gae(" + signature_and_doc + body + after)
    result = subprocess.run([sys.executable, str(starter / "exercises" / "grade.py"), "gae",
                             str(tmp_path / "ppo_procgen.py"), "--no-train"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "PASS" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------- the whole grade, training included
@pytest.mark.exercise_training
@pytest.mark.parametrize("exercise", EXERCISES)
def test_full_grade_with_training_passes_within_two_minutes(exercise, capsys):
    lines = []
    start = time.time()
    passed = grade.grade(exercise, out=lines.append)
    seconds = time.time() - start
    print(f"{exercise}: {seconds:.0f} s\n" + "\n".join(lines))
    assert passed, "\n".join(lines)
    assert "start" in "\n".join(lines) and "->" in "\n".join(lines)  # the learning curve's start and end
    assert seconds < 120


def test_the_learning_check_fails_when_nothing_is_learned():
    flat = [{"charts/episodic_return": 0.5, "iteration": i} for i in range(1, 13)] + [{"eval/episodic_return": 0.6}]
    with pytest.raises(grade.Failed, match="did not learn the cue task"):
        grade.judge_cue(flat, 10.0, lambda line: None)
    score = {"gold/score": 0.0, "proxy/score": 0.0, "objective/kl": 0.0}
    summary = {"rm": {"rm/heldout_acc": 0.45, "rm/heldout_acc_gold": 0.4}, "sft": score, "ppo": {"0.05": score},
               "histories": {0.05: [score, score]}}
    with pytest.raises(grade.Failed, match="look at bradley_terry_loss.*look at per_token_rewards"):
        grade.judge_rlhf(summary, 10.0, lambda line: None)


def test_training_that_reaches_another_blank_says_which(starter):
    module = grade.load_script(str(starter / "ppo_procgen.py"))  # every exercise blanked
    for source in (POLICY_LOSS, VALUE_LOSS):
        exec(source, module.__dict__)  # noqa: S102 - ppo_loss filled in, compute_gae still blank
    grade.check("ppo_loss", module)
    with pytest.raises(grade.Failed, match="another blank of this script") as info:
        grade.train_and_judge(module, lambda line: None)
    assert "Exercise gae" in str(info.value)
