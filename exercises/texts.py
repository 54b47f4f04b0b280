"""The six exercises: which functions of which script each one blanks, and the text a student reads in the stub
(the same text the grader prints when it meets the stub). The solutions are the scripts themselves."""

EXERCISES = {
    "gae": dict(
        title="GAE: generalized advantage estimation with episode ends",
        script="ppo_procgen.py", functions=("compute_gae",),
        equation="GAE paper (Schulman et al. 2016, arXiv 1506.02438) Eq. 16"),
    "ppo_loss": dict(
        title="PPO's objective: the clipped surrogate, the KL-penalty surrogate and the value loss",
        script="ppo_procgen.py", functions=("policy_loss", "value_loss"),
        equation="PPO paper (Schulman et al. 2017, arXiv 1707.06347) Eqs. 7-9"),
    "ppg_aux": dict(
        title="PPG's auxiliary phase: the joint loss and the phase around it",
        script="ppg_procgen.py", functions=("ppg_aux_loss", "auxiliary_phase"),
        equation="PPG paper (Cobbe et al. 2021, arXiv 2009.04416) Eqs. 2-3 and Algorithm 1"),
    "vtrace": dict(
        title="V-trace: the targets v_s and the policy-gradient advantages",
        script="vtrace.py", functions=("from_importance_weights",),
        equation="IMPALA paper (Espeholt et al. 2018, arXiv 1802.01561) Eq. 1, Remark 1 and section 4.2"),
    "rlhf": dict(
        title="RLHF: the per-token reward and the Bradley-Terry loss",
        script="ppo_rlhf_toy.py", functions=("per_token_rewards", "bradley_terry_loss"),
        equation="InstructGPT (Ouyang et al. 2022, arXiv 2203.02155) Eqs. 1-2, spread over tokens as Ziegler et al. "
                 "2019 (arXiv 1909.08593)"),
    "grpo_rloo": dict(
        title="GRPO and RLOO: the critic-free group baselines",
        script="ppo_rlhf_toy.py", functions=("group_relative_advantages", "leave_one_out_advantages"),
        equation="GRPO (Shao et al. 2024, arXiv 2402.03300) Sec. 4.1.2 and Eq. 3; RLOO (Ahmadian et al. 2024, "
                 "arXiv 2402.14740)"),
}

# Which exercise a function belongs to (the stubs and the graders use it).
EXERCISE_OF = {function: name for name, exercise in EXERCISES.items() for function in exercise["functions"]}

STUB_TEXT = {  # each line at most 92 characters: the stubs indent them by 4 in the scripts
    "compute_gae": """Exercise gae: generalized advantage estimation (GAE paper Eq. 16), with episode ends.

Inputs, time-major torch tensors (float32 in the script):
  rewards, values  [T, N]  r_t and V(s_t)
  dones            [T, N]  dones[t] = 1 when obs t is the FIRST frame of a new episode
                           (so step t-1 was the last step of an episode)
  next_value       [N]     V(s_T), the value of the observation after the rollout
  next_done        [N]     its done flag
  gamma, gae_lambda        floats
Output: advantages [T, N], same dtype and device as rewards.

  delta_t = r_t + gamma * V(s_{t+1}) * (1 - done_{t+1}) - V(s_t)
  A_t     = delta_t + gamma * lambda * (1 - done_{t+1}) * A_{t+1}
where done_{t+1} = dones[t + 1], and at the last step t = T - 1: V(s_T) = next_value and
done_T = next_done. Equivalently A_t = sum_{k >= t} (gamma lambda)^(k - t) delta_k, summed
until the episode ends. Loop backwards over t. Return the advantages only: train adds the
values to get the value targets.

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py gae <this script>""",

    "policy_loss": """Exercise ppo_loss (1 of 2): PPO's surrogate objective (PPO Eqs. 7 and 8), negated.

Inputs, torch tensors [M] over a minibatch of M states:
  ratio       r = pi(a|s) / pi_old(a|s), with gradient
  advantages  A (already normalized), constants
  kl          KL(pi_old(.|s) || pi(.|s)) per state, with gradient
  kind        "clip" or "kl-penalty"
  clip_coef   epsilon;  kl_beta: beta (a float; None with "clip")
Output: a scalar to MINIMIZE (the negated objective), a mean over the minibatch:
  "clip"       (Eq. 7): L = E[min(r A, clip(r, 1 - eps, 1 + eps) A)]     return -L
  "kl-penalty" (Eq. 8): L = E[r A - beta KL(pi_old(.|s) || pi(.|s))]     return -L

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py ppo_loss <this script>""",

    "value_loss": """Exercise ppo_loss (2 of 2): the value loss (L^VF of PPO Eq. 9, clipped as in baselines).

Inputs, torch tensors [M]: new_value V(s) (with gradient), old_value (V at rollout time),
returns V_targ; clip_coef = epsilon; clip_vloss: bool.
Output: a scalar, 0.5 * E[squared error]:
  clip_vloss False:  0.5 * E[(V(s) - V_targ)^2]
  clip_vloss True:   V_clip = old_value + clip(V(s) - old_value, -eps, eps)
                     0.5 * E[max((V(s) - V_targ)^2, (V_clip - V_targ)^2)]

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py ppo_loss <this script>""",

    "ppg_aux_loss": """Exercise ppg_aux (1 of 2): PPG's auxiliary-phase objective (PPG Eqs. 2 and 3).

Inputs, torch tensors over M states:
  logits [M, A]      pi's logits (with gradient)
  old_logits [M, A]  pi_old's logits (constants)
  value [M]          the value network's V
  aux_value [M]      the policy network's auxiliary value head
  value_targets [M]  V_targ;  beta_clone: float
Output: (loss, (aux_value_loss, kl, true_value_loss)), four scalars:
  aux_value_loss  = L_aux   = 0.5 * E[(aux_value - V_targ)^2]
  kl              = E_s[sum_a pi_old(a|s) (log pi_old(a|s) - log pi(a|s))]
                  = E[KL(pi_old || pi)]
  true_value_loss = L_value = 0.5 * E[(value - V_targ)^2]
  loss            = L_joint + L_value = aux_value_loss + beta_clone * kl + true_value_loss
(L_joint trains theta_pi, L_value trains theta_V: the parameters are disjoint, so one sum
serves both.) Take log-probabilities with log_softmax.

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py ppg_aux <this script>""",

    "auxiliary_phase": """Exercise ppg_aux (2 of 2): the auxiliary phase of PPG Algorithm 1.

Inputs:
  forward_aux        forward_aux(obs) -> (logits [M, A], value [M], aux_value [M]),
                     obs: uint8 frames [M, 64, 64, 3]
  optimizer          its param_groups are theta_pi and theta_V
  aux_obs            the buffer B: [R, T, 64, 64, 3], R whole rollouts of T steps
  aux_value_targets  [R, T]
  args               e_aux, beta_clone, max_grad_norm, n_aux_grad_accum; the minibatch
                     size in whole rollouts is aux_rollouts_per_rank(args)
  check_stop         None, or a function to call before each minibatch (it raises to stop
                     the run on a signal); the grader leaves it out
Output: {"aux/aux_value_loss": .., "aux/kl": .., "aux/value_loss": ..}, each part of
ppg_aux_loss averaged over the phase's minibatches (then all_reduce_mean over the ranks).

Algorithm 1, auxiliary phase:
  1. Compute and store pi_old(.|s) for all states in B, ONCE, before any step (no gradient).
  2. For E_aux epochs: shuffle the R rollouts; for each minibatch of rollouts:
     zero the gradients; ppg_aux_loss on its states, with the stored pi_old of THOSE states
     and their value targets; backward; average_gradients(optimizer);
     clip_grad_norms(optimizer, args.max_grad_norm); optimizer.step().
     With n_aux_grad_accum > 1, split each minibatch into that many chunks and accumulate
     the gradients of loss * len(chunk) / len(minibatch) before the one step.
  Raise FloatingPointError if the gradient norms are not finite (as ppo_update does).
  The policy phase's gradients may still be in .grad when the phase starts. Average the
  statistics over every minibatch of every epoch. Never write into the buffer.

Grade it:  python exercises/grade.py ppg_aux <this script>""",

    "from_importance_weights": """Exercise vtrace: V-trace targets and policy-gradient advantages
(IMPALA Eq. 1, Remark 1 and section 4.2).

Inputs, time-major torch tensors ([T, B] here; [T, B, ...] in general, where the trailing
dims of log_rhos, discounts, rewards may be 1 and broadcast against values):
  log_rhos         [T, B]  log pi(a_s|x_s) - log mu(a_s|x_s)
  discounts        [T, B]  gamma_s = gamma * (1 - done_s)
  rewards, values  [T, B]  r_s and V(x_s)
  bootstrap_value  [B]     V(x_T), shape values.shape[1:]
  clip_rho_threshold = rho_bar, clip_c_threshold = c_bar,
  clip_pg_rho_threshold = rho_bar_pg: each a float, or None for no truncation
  lambda_          a float in [0, 1], a 0-dim tensor, or a per-step [T, B] tensor
Output: VTraceReturns(vs=[T, B], pg_advantages=[T, B]), constants (no gradient).

  rho_s       = exp(log_rhos[s])
  rho_bar_s   = min(rho_bar, rho_s)
  c_s         = lambda * min(c_bar, rho_s)                 (c_bar, not rho_bar!)
  delta_s V   = rho_bar_s * (r_s + gamma_s V(x_{s+1}) - V(x_s)),  V(x_T) = bootstrap_value
  v_s - V(x_s) = delta_s V + gamma_s c_s (v_{s+1} - V(x_{s+1})),
                accumulated backwards from 0 after step T - 1
  A_s         = min(rho_bar_pg, rho_s) * (r_s + gamma_s v_{s+1} - V(x_s)),  v_T = bootstrap
lambda multiplies only the trace (SEED RL's convention): the pg target keeps v_{s+1}.

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py vtrace <this script>""",

    "per_token_rewards": """Exercise rlhf (1 of 2): the per-token reward of RLHF's PPO stage
(InstructGPT Eq. 2, spread over the tokens).

Inputs, torch tensors:
  kl      [B, L]  the per-token KL estimate log pi(y_t|..) - log pi_ref(y_t|..); it may be
                  nonzero past a response's end
  scores  [B]     the reward model's score r(x, y)
  mask    [B, L]  1.0 on the response's tokens up to and including its EOS (a prefix of
                  ones), 0.0 after
  beta            float
Output: rewards [B, L]:
  r_t = -beta * KL_t on every response token (mask 1), 0 after the response,
  plus the score on the response's LAST token: index mask.sum(1) - 1 (the EOS, or the
  final token when there is no EOS).
A response may end at its first token (mask [1, 0, 0, ...]).

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py rlhf <this script>""",

    "bradley_terry_loss": """Exercise rlhf (2 of 2): the reward model's Bradley-Terry loss
(InstructGPT Eq. 1 with K = 2).

Inputs: r_chosen [P], r_rejected [P], the reward model's scores of the preferred and the
other response of P pairs.
Output: a scalar, the mean negative log-likelihood of the labellers' choices:
  loss = E[-log sigma(r_chosen - r_rejected)]
Keep it finite for margins of hundreds: use a numerically stable log-sigmoid.

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py rlhf <this script>""",

    "group_relative_advantages": """Exercise grpo_rloo (1 of 2): GRPO's group-relative advantage
(GRPO paper, Sec. 4.1.2, used in its Eq. 3).

Inputs:
  scores      [B] torch tensor: one return per response (the reward model's score, minus
              the KL penalty when it is in the reward)
  group_size  int k >= 2: the responses come in groups of k CONSECUTIVE rows, the k
              responses to one prompt (B is a multiple of k)
  eps         float, added to the std
Output: advantages [B]:
  A_i = (r_i - mean(group)) / (std(group) + eps)
over the group of response i, where std is the SAMPLE standard deviation (divide by
k - 1; torch's default .std()). A group of equal scores gets advantages 0.

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py grpo_rloo <this script>""",

    "leave_one_out_advantages": """Exercise grpo_rloo (2 of 2): RLOO's leave-one-out baseline
(Ahmadian et al. 2024, after Kool et al. 2019).

Inputs:
  scores      [B] torch tensor: one return per response
  group_size  int k >= 2: groups of k CONSECUTIVE rows, the k responses to one prompt
Output: advantages [B]:
  A_i = r_i - b_i,   b_i = the mean score of the OTHER k - 1 responses of its group
The baseline b_i does not depend on response i, so the gradient estimate stays
unbiased. No division by a std.

Contract: outputs in the inputs' dtype and on their device; never modify an input in place.

Grade it:  python exercises/grade.py grpo_rloo <this script>""",
}
