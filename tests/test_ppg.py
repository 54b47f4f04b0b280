"""ppg_procgen.py: the auxiliary phase, both architectures, the memory check, learning, and the CLI end to end."""
import copy
import dataclasses
import glob
import json
import os
import resource
import signal
import types

import numpy as np
import pytest
import torch
from conftest import ROOT, CueEnv

import fault_driver
import forked_run
import ppg_procgen as ppg
import ppo_procgen as ppo

TINY = ["--env-id", "starpilot", "--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--channels", "4",
        "--hidden-size", "16", "--eval-episodes", "2", "--eval-every", "0", "--n-pi", "2", "--num-aux-rollouts", "2",
        "--e-aux", "2", "--save-every", "2", "--torch-threads", "1"]
# What a resume or an evaluation takes from its command line, not from the checkpoint (the script's RUNTIME_FLAGS):
# without them it would evaluate the default 32 episodes of StarPilot with a team of torch threads.
RUNTIME = ["--eval-episodes", "2", "--torch-threads", "1"]


# Bytes of B at the default flags: N_pi x num_envs x num_steps frames of 64 x 64 x 3 bytes, each with a float32 V_targ.
DEFAULT_B = 32 * 64 * 256 * (64 * 64 * 3 + 4)


def tiny_args(**overrides):
    return ppg.Args(**{**dict(channels=(8,), hidden_size=32, num_aux_rollouts=2, e_aux=6), **overrides})


def cue_buffer(num_rollouts=8, num_steps=16, seed=0):
    """Stored rollouts of CueEnv frames whose value target is a function of the colour (so it can be learned)."""
    env = CueEnv(num_rollouts)
    frames = [env.reset(seed=seed)[0]]
    cues = [env.cue.copy()]
    for _ in range(num_steps - 1):
        frames.append(env.step(np.zeros(num_rollouts))[0])
        cues.append(env.cue.copy())
    targets = np.array([1.0, -1.0, 0.5])[np.array(cues)]  # [T, R]
    return torch.as_tensor(np.stack(frames, 1)), torch.as_tensor(targets.T, dtype=torch.float32)


def buffer_losses(agent, aux_obs, aux_returns, old_logits, beta_clone=1.0):
    with torch.no_grad():
        logits, value, aux_value = agent.forward_aux(aux_obs.flatten(0, 1))
        return ppg.ppg_aux_loss(logits, old_logits, value, aux_value, aux_returns.flatten(), beta_clone)[1]


@pytest.mark.parametrize("arch", ["dual", "detach"])
def test_auxiliary_phase_fits_values_and_keeps_the_policy(arch):
    torch.manual_seed(0)
    args = tiny_args(arch=arch)
    agent = ppg.Agent(args, num_actions=15)
    aux_obs, aux_returns = cue_buffer()
    with torch.no_grad():
        old_logits = agent.forward_aux(aux_obs.flatten(0, 1))[0]
    aux_before, kl_before, value_before = buffer_losses(agent, aux_obs, aux_returns, old_logits)
    assert kl_before == 0  # pi_old is the starting policy
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    stats = ppg.auxiliary_phase(agent.forward_aux, optimizer, aux_obs, aux_returns, args)
    aux_after, kl_after, value_after = buffer_losses(agent, aux_obs, aux_returns, old_logits)
    assert aux_after < 0.5 * aux_before and value_after < 0.5 * value_before, (aux_before, aux_after, value_after)
    assert 0 < kl_after < 0.02 and stats["aux/kl"] < 0.02
    assert set(stats) == {"aux/aux_value_loss", "aux/kl", "aux/value_loss"}


def test_kl_is_zero_when_nothing_moves():
    """With lr = 0 every minibatch's KL(pi_old || pi) must be exactly 0: pi_old is computed once, before the phase,
    and stays aligned with the shuffled rollouts of each minibatch."""
    torch.manual_seed(1)
    args = tiny_args(e_aux=2)
    agent = ppg.Agent(args, num_actions=15)
    aux_obs, aux_returns = cue_buffer()
    optimizer = torch.optim.Adam(agent.parameters(), lr=0.0)
    stats = ppg.auxiliary_phase(agent.forward_aux, optimizer, aux_obs, aux_returns, args)
    assert abs(stats["aux/kl"]) < 1e-7 and stats["aux/value_loss"] > 0.1


def test_gradient_accumulation_gives_the_same_step():
    aux_obs, aux_returns = cue_buffer(num_rollouts=4)
    results = []
    for accum in (1, 2):
        torch.manual_seed(2)
        args = tiny_args(e_aux=1, num_aux_rollouts=4, n_aux_grad_accum=accum)
        agent = ppg.Agent(args, num_actions=15)
        optimizer = torch.optim.SGD(agent.parameters(), lr=0.1)
        ppg.auxiliary_phase(agent.forward_aux, optimizer, aux_obs, aux_returns, args)
        results.append(torch.cat([p.flatten() for p in agent.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ["dual", "detach"])
def test_value_loss_never_reaches_the_policy_network(arch):
    torch.manual_seed(0)
    agent = ppg.Agent(tiny_args(arch=arch), num_actions=15)
    obs = torch.randint(0, 256, (6, 64, 64, 3), dtype=torch.uint8)
    _, value = agent(obs)
    (value ** 2).mean().backward()
    policy_parts = [agent.trunk, agent.actor, agent.aux_critic]
    assert all(p.grad is None or not p.grad.any() for part in policy_parts for p in part.parameters())
    assert agent.critic.weight.grad.abs().sum() > 0
    if arch == "dual":
        assert any(p.grad.abs().sum() > 0 for p in agent.value_trunk.parameters())
    else:
        assert agent.value_trunk is None


def tiny_batch(agent, size=32):
    obs = torch.randint(0, 256, (size, 64, 64, 3), dtype=torch.uint8)
    with torch.no_grad():
        logits, values = agent(obs)
    actions = ppg.sample_action(logits)
    return dict(obs=obs, actions=actions, log_probs=ppg.log_prob_entropy(logits, actions)[0], logits=logits,
                values=values, advantages=torch.randn(size), returns=values + torch.randn(size))


def test_value_only_epochs_leave_the_policy_network_alone():
    """E_V > E_pi: in the extra value epochs the policy network gets no gradient at all, so Adam's momentum cannot
    move it either: its weights end exactly where E_V = E_pi leaves them."""
    torch.manual_seed(3)
    args = ppg.Args(channels=(4,), hidden_size=16, num_minibatches=2, minibatch_unit="frames")  # a batch of frames
    agent = ppg.Agent(args, num_actions=15)
    batch = tiny_batch(agent)
    policy_weights = []
    for e_v in (1, 3):
        trained = copy.deepcopy(agent)
        torch.manual_seed(4)
        ppg.ppo_update(trained, torch.optim.Adam(trained.parameters(), lr=1e-3), batch,
                       dataclasses.replace(args, e_pi=1, e_v=e_v))
        policy_weights.append([p.clone() for m in (trained.trunk, trained.actor) for p in m.parameters()])
        value_weights = [p.clone() for m in (trained.value_trunk, trained.critic) for p in m.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(*policy_weights))
    assert not all(torch.equal(p, q) for p, q in zip(value_weights, agent.value_trunk.parameters()))


@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_policy_phase_value_step_is_the_official_one(optimizer_name):
    """At PPG's defaults one policy-phase step moves the value network exactly as the official code's does: that
    code minimizes 0.5 * mean((V - V_targ)^2) (`vfcoef` 0.5 times the mean squared error), which is the paper's
    L^value = 1/2 E[(V - V_targ)^2] with weight 1. The reference below takes that step by hand on a copy. SGD shows
    the gradient itself; Adam shows that no constant factor is left for its epsilon to turn into a different step."""
    torch.manual_seed(5)
    args = ppg.Args(channels=(4,), hidden_size=16, num_minibatches=1, minibatch_unit="frames")
    agent = ppg.Agent(args, num_actions=15)
    batch = tiny_batch(agent)
    reference = copy.deepcopy(agent)

    def make_optimizer(parameters):
        if optimizer_name == "sgd":
            return torch.optim.SGD(parameters, lr=1.0)
        return torch.optim.Adam(parameters, lr=args.learning_rate, eps=args.adam_eps)

    def value_weights(model):
        return torch.cat([p.detach().flatten() for p in [*model.value_trunk.parameters(), *model.critic.parameters()]])

    before = value_weights(agent)
    ppg.ppo_update(agent, make_optimizer(agent.networks()), batch, args)
    optimizer = make_optimizer([*reference.value_trunk.parameters(), *reference.critic.parameters()])
    value = reference(batch["obs"])[1]
    (0.5 * ((value - batch["returns"]) ** 2).mean()).backward()  # the official code's value loss
    optimizer.step()
    ours, official = value_weights(agent) - before, value_weights(reference) - before
    assert official.abs().max() > 0
    torch.testing.assert_close(ours, official, rtol=1e-3, atol=1e-3 * official.abs().max().item())


def test_without_aux_phase_the_training_loop_is_ppo(cue_env, in_tmp, monkeypatch):
    """--e-aux 0: PPG's whole loop (rollouts, GAE, policy-phase updates, logging) reproduces PPO's loop run on the
    same networks with the same settings, number for number."""
    cue_env(ppg)
    cue_env(ppo)
    monkeypatch.setattr(ppo, "Agent", ppg.Agent)
    common = dict(env_id="coinrun", total_timesteps=4 * 64, num_envs=4, num_steps=16, num_minibatches=2,
                  channels=(4,), hidden_size=16, eval_every=2, eval_episodes=2, adv_norm="batch", init="normed",
                  vf_coef=1.0,
                  max_grad_norm=float("inf"), clip_vloss=False, adam_eps=1e-8, reward_norm_gamma=0.99,
                  minibatch_unit="games", torch_threads=1)
    ppo_args = ppo.Args(**common, update_epochs=1)
    ppo_args.arch = "detach"  # what PPG's Agent reads
    ppg_rows = read_rows(ppg.train(ppg.Args(**common, e_pi=1, e_v=1, e_aux=0, n_pi=2, save_every=2, arch="detach")))
    ppo_rows = read_rows(ppo.train(ppo_args))
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time", "charts/SPS"))} for r in rows
                         if "aux/kl" not in r]
    assert drop(ppg_rows) == drop(ppo_rows)
    assert len(drop(ppo_rows)) == 6  # 4 iterations + 2 evaluations


def test_a_buffer_that_does_not_fit_fails_with_one_line_before_anything_big(in_tmp):
    """B is allocated before the networks and the games: one that cannot be stops the run with one line naming the
    flags, its size in closed form (frames of 64 x 64 x 3 bytes and a float32 V_targ each), and nothing big is
    allocated."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gib = 100_000 * 64 * 256 * (64 * 64 * 3 + 4) / 2**30
    with pytest.raises(SystemExit, match=rf"^error: PPG's buffer B needs {gib:.1f} GiB per rank \(--n-pi 100000 x "
                                         r"--num-envs 64 / 1 ranks x --num-steps 256 frames\), more than host memory "
                                         r"can hold; lower --n-pi or --num-envs, or set --aux-buffer$"):
        ppg.train(ppg.Args(n_pi=100_000, save_every=100_000, cuda=False))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: nothing big was allocated


@pytest.mark.parametrize("aux_buffer, device, free, place", [
    ("auto", "cuda", 2 * DEFAULT_B + 2, ("cuda", False)), ("auto", "cuda", 2 * DEFAULT_B - 2, ("cpu", True)),
    ("cpu", "cuda", 100 * DEFAULT_B, ("cpu", True)), ("cuda", "cuda", 0, ("cuda", False)),
    ("auto", "cpu", 0, ("cpu", False))])
def test_buffer_is_on_the_gpu_when_it_takes_under_half_of_its_free_memory(aux_buffer, device, free, place,
                                                                            monkeypatch):
    """B at the default flags: on the GPU when it takes less than half of the GPU's free memory, else in host memory,
    pinned on a CUDA run; --aux-buffer forces a place. The GPU's free memory and torch.empty are stand-ins (no GPU
    needed); an allocation that fails is one line naming the flags."""
    placed = []

    def empty(shape, dtype=torch.float32, device=None, pin_memory=False):
        placed.append((torch.device(device).type, pin_memory))  # "cpu" or a torch.device
        return shape

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 200 * DEFAULT_B))
    monkeypatch.setattr(torch, "empty", empty)
    run = types.SimpleNamespace(args=ppg.Args(aux_buffer=aux_buffer), device=torch.device(device), world_size=1)
    assert ppg.allocate_buffer(run) == ((32, 64, 256, 64, 64, 3), (32, 64, 256)) and placed == [place, place]

    def out_of_memory(*arguments, **keywords):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")

    monkeypatch.setattr(torch, "empty", out_of_memory)
    memory = {"cuda": "GPU", "cpu": "host"}[place[0]]
    with pytest.raises(SystemExit, match=f"more than {memory} memory can hold; lower --n-pi or --num-envs, or set "
                                         "--aux-buffer"):
        ppg.allocate_buffer(run)


def test_bad_ppg_flags_fail_at_once():
    # A checkpoint is taken only at the end of a phase: --save-every counts whole phases when checkpoints are saved.
    ppg.check_args(ppg.Args(save_every=100))
    ppg.check_args(ppg.Args(save_every=100, save_model=True, e_aux=0))  # no auxiliary phase: PPO's checkpoints
    ppg.check_args(ppg.Args(save_every=96, save_model=True))
    with pytest.raises(SystemExit, match=r"^error: --save-every 100 must be a multiple of --n-pi 32: a run saves a "
                                         r"checkpoint only at the end of an auxiliary phase; try 96$"):
        ppg.check_args(ppg.Args(save_every=100, save_model=True))
    with pytest.raises(SystemExit, match="--minibatch-unit games splits each rank's 64 envs into --num-minibatches 128"):
        ppg.check_args(ppg.Args(num_minibatches=128))
    with pytest.raises(SystemExit, match="--n-aux-grad-accum 3 must divide the 4 rollouts of each rank's auxiliary"):
        ppg.check_args(ppg.Args(n_aux_grad_accum=3))
    with pytest.raises(SystemExit, match="--e-v 0 must be > 0"):
        ppg.check_args(ppg.Args(e_v=0))
    with pytest.raises(SystemExit, match="--n-pi 0 must be > 0"):
        ppg.check_args(ppg.Args(n_pi=0))


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_ppg_learns_the_cue_task(ppg_cue_run):
    """The PPG run on the cue task that the test suite trains once (conftest.py's PPG_CUE; test_exercises.py's full
    PPG grade reads the same run)."""
    rows = read_rows(ppg_cue_run.run_dir)
    assert rows[-1]["eval/episodic_return"] > 4.0, rows[-1]  # random play: 8/15 per episode
    aux_rows = [r for r in rows if "aux/kl" in r]
    assert len(aux_rows) == 2  # 12 iterations = 3 phases of N_pi = 4; none after the last iteration
    assert [r["iteration"] for r in aux_rows] == [4, 8]  # the phase is in the row of the iteration it ends
    assert all(r["time/update"] > 0 and "losses/policy_loss" in r for r in aux_rows)


def test_budget_and_annealing_follow_the_global_step(cue_env, in_tmp, capsys):
    """7 iterations with N_pi = 3: two whole phases, and the 7th iteration is trained by the policy phase only (an
    auxiliary phase costs no environment steps; the paper's phases are whole); the learning rate falls linearly over
    the whole run instead of restarting each phase (CleanRL's PPG bug)."""
    cue_env(ppg)
    args = ppg.Args(env_id="coinrun", total_timesteps=7 * 32 + 5, num_envs=4, num_steps=8, num_minibatches=2,
                    channels=(4,), hidden_size=16, eval_every=0, eval_episodes=2, n_pi=3, e_aux=1, save_every=3,
                    num_aux_rollouts=4, anneal_lr=True, torch_threads=1)
    rows = read_rows(ppg.train(args))
    output = capsys.readouterr().out
    assert "note: training 224 steps (7 whole iterations)" in output
    assert "note: the last 1 iterations are not followed by an auxiliary phase" in output
    lrs = [r["charts/learning_rate"] for r in rows if "charts/learning_rate" in r]
    np.testing.assert_allclose(lrs, [5e-4 * (1 - i / 7) for i in range(7)])
    assert [r["iteration"] for r in rows if "aux/kl" in r] == [3, 6]


def test_no_auxiliary_phase_after_the_last_iteration(cue_env, in_tmp):
    """A run of a whole number of phases ends after its last policy phase, as the PPG code's loop does
    (openai/phasic-policy-gradient ppg.py 259-260 leaves before the auxiliary phase): 2 phases of N_pi = 2, one
    auxiliary phase (the old loop ran two); 5 iterations still get the one after iteration 4."""
    cue_env(ppg)
    common = dict(env_id="coinrun", num_envs=4, num_steps=8, num_minibatches=2, channels=(4,), hidden_size=16,
                  eval_every=0, eval_episodes=2, n_pi=2, e_aux=1, num_aux_rollouts=4, torch_threads=1)
    for iterations, phases in ((4, [2]), (5, [2, 4])):
        rows = read_rows(ppg.train(ppg.Args(**common, total_timesteps=iterations * 32)))
        assert [r["iteration"] for r in rows if "aux/kl" in r] == phases
        assert rows[-1]["iteration"] == iterations and "eval/episodic_return" in rows[-1]


def test_without_aux_epochs_there_is_no_buffer_and_no_pi_old(cue_env, in_tmp, monkeypatch):
    cue_env(ppg)
    allocate, buffers = ppg.allocate_buffer, []

    def recording(run):
        buffers.append(allocate(run))
        return buffers[-1]

    monkeypatch.setattr(ppg, "allocate_buffer", recording)
    monkeypatch.setattr(ppg, "auxiliary_phase", lambda *arguments: pytest.fail("auxiliary_phase called with --e-aux 0"))
    rows = read_rows(ppg.train(ppg.Args(env_id="coinrun", total_timesteps=4 * 32, num_envs=4, num_steps=8,
                                        num_minibatches=2, channels=(4,), hidden_size=16, eval_every=0,
                                        eval_episodes=2, n_pi=2, e_aux=0, save_every=2, torch_threads=1)))
    assert len([r for r in rows if "losses/policy_loss" in r]) == 4 and not any("aux/kl" in r for r in rows)
    assert buffers == [(None, None)]


def test_each_network_is_clipped_on_its_own():
    """A huge value-loss gradient must not shrink the policy network's step: with 'dual', the policy's gradient after
    clipping is what clipping the policy loss alone gives."""
    torch.manual_seed(0)
    args = tiny_args(arch="dual", channels=(4,), hidden_size=16)
    agent = ppg.Agent(args, num_actions=15)
    optimizer = torch.optim.Adam(agent.networks())
    obs = torch.randint(0, 256, (8, 64, 64, 3), dtype=torch.uint8)
    policy_params = optimizer.param_groups[0]["params"]
    assert {id(p) for p in policy_params}.isdisjoint(id(p) for p in [*agent.value_trunk.parameters(),
                                                                         *agent.critic.parameters()])

    def clipped_policy_grads(value_weight):
        optimizer.zero_grad()
        logits, value, aux_value = agent.forward_aux(obs)
        (logits.logsumexp(-1).mean() + aux_value.mean() + value_weight * value.pow(2).mean()).backward()
        norms = ppg.clip_grad_norms(optimizer, 0.5)
        return norms, [p.grad.clone() for p in policy_params]

    norms_alone, alone = clipped_policy_grads(0.0)
    norms_with_value, with_value = clipped_policy_grads(1e6)
    assert norms_with_value[1] > 1e3 * norms_with_value[0]  # the value network's gradient is huge ...
    assert all(torch.allclose(a, b) for a, b in zip(alone, with_value))  # ... and the policy's step is unchanged


@pytest.mark.parametrize("channels", [(16,), (16, 32, 32), (8, 8, 8, 8, 8)])
def test_normed_init_scales_follow_the_ppg_code(channels):
    """Each output unit's weight norm: 1.0 for a stack's first conv, sqrt(1/sqrt(stacks)/sqrt(2)) for residual convs
    (0.6389 for the 3 stacks of the default), 1.4 for the dense layer, 0.1 for the heads; biases 0."""
    agent = ppg.Agent(tiny_args(channels=channels, hidden_size=16), num_actions=15)
    unit_norms = lambda layer: layer.weight.flatten(1).norm(dim=1)
    residual_scale = (1 / len(channels) ** 0.5 / 2**0.5) ** 0.5
    layers = list(agent.trunk.net)
    for stack in range(len(channels)):
        conv, _, *blocks = layers[4 * stack : 4 * stack + 4]
        torch.testing.assert_close(unit_norms(conv), torch.ones(channels[stack]))
        for block in blocks:
            for residual_conv in (block.conv0, block.conv1):
                torch.testing.assert_close(unit_norms(residual_conv), torch.full((channels[stack],), residual_scale))
                assert residual_conv.bias.abs().max() == 0
    torch.testing.assert_close(unit_norms(layers[-2]), torch.full((16,), 1.4))
    torch.testing.assert_close(unit_norms(agent.actor), torch.full((15,), 0.1))
    assert abs((1 / 3**0.5 / 2**0.5) ** 0.5 - 0.6389) < 1e-4


def run_script(*flags):
    """`python ppg_procgen.py FLAGS`, forked from a server that has imported torch (tests/forked_run.py)."""
    return forked_run.run(os.path.join(ROOT, "ppg_procgen.py"), *flags, timeout=300)


@pytest.mark.parametrize("arch", ["dual", "detach"])
def test_end_to_end_phase_checkpoint_resume(arch, in_tmp):
    result = run_script(*TINY, "--arch", arch, "--total-timesteps", str(4 * 32), "--save-model")
    assert result.returncode == 0, result.stderr
    aux_lines = [line for line in result.stdout.splitlines() if line.startswith("iter ") and "aux/kl" in line]
    assert [line.split()[1] for line in aux_lines] == ["2/4"]  # after iteration 2; none after the last
    (run,) = os.listdir("runs")
    path = os.path.join("runs", run, "checkpoint.pt")
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["iteration"] == 4 and "aux_optimizer" in checkpoint
    assert checkpoint["args"]["arch"] == arch
    assert ("value_trunk.net.0.weight" in checkpoint["agent"]) == (arch == "dual")
    # Pretend the run was cut after its first phase: resume from a copy whose counters say so. The rows logged after
    # that point are dropped and logged again by the resumed run, into the same run directory.
    checkpoint.update(iteration=2, global_step=64)
    torch.save(checkpoint, os.path.join("runs", run, "phase1.pt"))
    first_rows = read_rows(os.path.join("runs", run))
    result = run_script("--resume", os.path.join("runs", run, "phase1.pt"), *RUNTIME)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stdout and "aux/kl" not in result.stdout  # no phase after the last iteration
    rows = read_rows(os.path.join("runs", run))
    assert [r["iteration"] for r in rows if "losses/policy_loss" in r] == [1, 2, 3, 4]
    assert rows[:2] == first_rows[:2] and rows[2:] != first_rows[2:]  # iterations 1, 2 (with its phase) kept
    assert rows[-1]["global_step"] == 128 and "eval/episodic_return" in rows[-1]
    result = run_script("--eval-only", "--checkpoint", path, *RUNTIME)
    assert result.returncode == 0 and "eval @ 128 steps: return" in result.stdout, result.stderr
    assert "over 2 episodes" in result.stdout


PHASES = dict(env_id="coinrun", total_timesteps=12 * 32, num_envs=4, num_steps=8, num_minibatches=2, channels=(4,),
              hidden_size=16, eval_every=0, eval_episodes=2, n_pi=3, e_aux=1, save_every=3, torch_threads=1)


def signal_on_call(monkeypatch, name, call, signum=signal.SIGTERM):
    """Wrap ppg.<name> so that its `call`-th call sends this process `signum` (then runs as usual); returns the calls."""
    function, calls = getattr(ppg, name), []

    def wrapped(*arguments, **keywords):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return function(*arguments, **keywords)

    monkeypatch.setattr(ppg, name, wrapped)
    return calls


def resume_to_the_end(monkeypatch, path):
    """Resume `path` without signals; returns the run's rows and the buffer size of each auxiliary phase."""
    path = os.path.abspath(path)
    monkeypatch.undo()  # the signal-sending wrappers, and the working directory too
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(path))))
    aux_phase, rollouts = ppg.auxiliary_phase, []

    def recording(*arguments, **keywords):
        rollouts.append(arguments[2].shape[0])
        return aux_phase(*arguments, **keywords)

    monkeypatch.setattr(ppg, "auxiliary_phase", recording)
    monkeypatch.setattr(ppg, "ProcgenVecEnv", lambda num_envs, *args, **kwargs: CueEnv(num_envs))
    rows = read_rows(ppg.train(ppg.Args(resume=path, torch_threads=1)))  # a runtime flag: not the checkpoint's
    return rows, rollouts


@pytest.fixture(scope="module")
def stopped_at_the_first_phase_end(tmp_path_factory):
    """The reference of the signal tests: the run of PHASES stopped cleanly (SIGTERM) at the end of its first phase
    (iteration 3, after its auxiliary phase) and resumed to the end: its rows and its final checkpoint."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(tmp_path_factory.mktemp("reference"))
        monkeypatch.setattr(ppg, "ProcgenVecEnv", lambda num_envs, *args, **kwargs: CueEnv(num_envs))
        signal_on_call(monkeypatch, "log_iteration", 3)  # honoured at the end of iteration 3
        with pytest.raises(SystemExit, match="143"):
            ppg.train(ppg.Args(**PHASES, save_model=True))
        (path,) = glob.glob("runs/*/checkpoint.pt")
        assert torch.load(path, weights_only=True)["iteration"] == 3
        resume_to_the_end(monkeypatch, path)
        return fault_driver.training_rows(os.path.dirname(path)), fault_driver.load(path)


def check_resumed_at_the_first_phase_end(monkeypatch, reference):
    """A run of PHASES cut inside its second phase: its checkpoint is the end of the first phase (iteration 3), with
    none of the cut phase's rows kept after the resume; resumed to the end, every auxiliary phase distils the whole of
    B (N_pi x num_envs = 12 rollouts), and the run equals the reference stopped there cleanly, bit for bit."""
    (path,) = glob.glob("runs/*/checkpoint.pt")
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["iteration"] == 3 and not any("aux" in key and key != "aux_optimizer" for key in checkpoint)
    rows, rollouts = resume_to_the_end(monkeypatch, path)
    assert [r["iteration"] for r in rows if "losses/policy_loss" in r] == list(range(1, 13))  # each once
    assert [(r["iteration"], r["aux/rollouts"]) for r in rows if "aux/kl" in r] == [(3, 12), (6, 12), (9, 12)]
    assert rollouts == [12, 12]  # the phases after the resume were given all of B
    reference_rows, reference_checkpoint = reference  # rows without their timing columns
    assert fault_driver.training_rows(os.path.dirname(path)) == reference_rows
    assert fault_driver.differences(fault_driver.load(path), reference_checkpoint) == []


def test_ctrl_c_in_a_policy_phase_resumes_at_the_phase_start(cue_env, in_tmp, monkeypatch,
                                                              stopped_at_the_first_phase_end):
    """The first Ctrl-C in iteration 5's update (the second of the second phase) stops at its next minibatch, exit
    130: the iterations of the phase in flight are dropped, the checkpoint is the end of the phase before (iteration
    3), and nothing of the auxiliary buffer is in it. The resume plays the phase again from its first iteration."""
    cue_env(ppg)
    signal_on_call(monkeypatch, "ppo_update", 5, signal.SIGINT)
    with pytest.raises(SystemExit, match="130"):
        ppg.train(ppg.Args(**PHASES, save_model=True))
    (path,) = glob.glob("runs/*/checkpoint.pt")
    rows = read_rows(os.path.dirname(path))
    assert [r["iteration"] for r in rows if "losses/policy_loss" in r] == [1, 2, 3, 4]  # none of iteration 5
    check_resumed_at_the_first_phase_end(monkeypatch, stopped_at_the_first_phase_end)


def test_sigterm_in_an_auxiliary_phase_resumes_at_the_phase_start(cue_env, in_tmp, monkeypatch,
                                                                  stopped_at_the_first_phase_end):
    """SIGTERM in the second auxiliary phase (12 one-rollout minibatches a phase; it follows iteration 6) stops before
    its next minibatch, exit 143, with the end of the first phase saved (iteration 3) and no row of iteration 6."""
    cue_env(ppg)
    calls = signal_on_call(monkeypatch, "ppg_aux_loss", 12 + 2)
    with pytest.raises(SystemExit) as stop:
        ppg.train(ppg.Args(**PHASES, save_model=True))
    assert stop.value.code == 143 and len(calls) == 14  # the minibatch under way was finished, no further one began
    (path,) = glob.glob("runs/*/checkpoint.pt")
    rows = read_rows(os.path.dirname(path))
    assert [r["iteration"] for r in rows if "losses/policy_loss" in r] == [1, 2, 3, 4, 5]
    check_resumed_at_the_first_phase_end(monkeypatch, stopped_at_the_first_phase_end)


def test_a_signal_in_the_first_phase_saves_nothing(cue_env, in_tmp, monkeypatch, capsys):
    """Before the end of the first phase there is no resume point: a signal in the first auxiliary phase (after
    iteration 3) stops the run with nothing saved, and says so."""
    cue_env(ppg)
    signal_on_call(monkeypatch, "ppg_aux_loss", 2)
    with pytest.raises(SystemExit, match="143"):
        ppg.train(ppg.Args(**PHASES))
    assert "interrupted by SIGTERM: nothing new to save; no checkpoint of this run was saved" in capsys.readouterr().out
    assert glob.glob("runs/*/checkpoint.pt") == []


def test_a_checkpoint_inside_a_phase_is_refused(in_tmp):
    """A checkpoint inside a phase (only an earlier version wrote one) cannot refill B: one line, before B exists.
    The end of a phase, and the run's end after a partial last phase, resume."""
    args = ppg.Args(**{**PHASES, "total_timesteps": 13 * 32}, resume="runs/x/checkpoint.pt")  # 13 iterations
    for iteration, accepted in ((4, False), (6, True), (13, True)):
        run = types.SimpleNamespace(args=args, device=torch.device("cpu"), world_size=1,
                                    checkpoint={"iteration": iteration})
        if accepted:
            assert ppg.allocate_buffer(run)[0].shape == (3, 4, 8, 64, 64, 3)
            continue
        with pytest.raises(SystemExit, match=r"^error: --resume runs/x/checkpoint.pt: iteration 4 is inside a phase "
                                             r"of --n-pi 3, where B is partly filled and not saved"):
            ppg.allocate_buffer(run)


def test_nonfinite_auxiliary_loss_stops_with_one_line_and_the_last_checkpoint(cue_env, in_tmp, monkeypatch):
    """A non-finite loss in the second auxiliary phase (iteration 6) stops the run before the step that would put a
    NaN in the weights: one line naming the loss and the last checkpoint on disk (iteration 3's, --save-every 3),
    which is left intact and finite."""
    cue_env(ppg)
    aux_loss, calls = ppg.ppg_aux_loss, []

    def failing_loss(*arguments):
        calls.append(1)
        loss, parts = aux_loss(*arguments)
        return (loss * float("nan") if len(calls) == 13 else loss), parts  # phase 1: 12 minibatches

    monkeypatch.setattr(ppg, "ppg_aux_loss", failing_loss)
    with pytest.raises(SystemExit, match=r"^error: non-finite auxiliary loss nan or gradient in epoch 0; the last "
                                         r"checkpoint is iteration 3 in runs/.*/checkpoint.pt \(continue with "
                                         r"--resume\)"):
        ppg.train(ppg.Args(**PHASES, save_model=True))
    assert len(calls) == 13
    (path,) = glob.glob("runs/*/checkpoint.pt")
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["iteration"] == 3 and all(t.isfinite().all() for t in checkpoint["agent"].values())
    rows = read_rows(os.path.dirname(path))
    assert [r["iteration"] for r in rows if "aux/kl" in r] == [3]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_buffer_minibatches_copy_asynchronously_and_intact():
    """A host buffer's minibatches reach the GPU through pinned blocks: the copies do not wait for the GPU, and a block
    is not reused while a copy out of it is still queued (the stream is held back by a sleep to widen the window)."""
    import time
    device = torch.device("cuda")
    buffer = torch.arange(64 * 1024, dtype=torch.float32).view(64, 1024).pin_memory()
    indices = [torch.randperm(64)[:8] for _ in range(4)]
    torch.cuda.synchronize()
    torch.cuda._sleep(2 * 10**9)  # about a second of GPU time queued before the copies
    start = time.time()
    copies = [ppg.rollouts_to_device(buffer, index, device) for index in indices]
    host_seconds = time.time() - start
    assert not torch.cuda.current_stream().query()  # the sleep still runs: the copies were only queued
    torch.cuda.synchronize()
    assert host_seconds < 0.2, host_seconds
    for index, copy_ in zip(indices, copies):
        assert torch.equal(copy_.cpu(), buffer[index])
