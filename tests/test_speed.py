"""The speed flags never change the algorithm, and the benchmark harness works (at tiny flags, on CPU)."""
import importlib
import json
import os
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT
from gpu_bench_commands import parsed_commands

import ppo_procgen as ppo

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench  # noqa: E402
import gpu_check  # noqa: E402


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    keys = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl", "eval/episodic_return")
    return np.array([[r.get(k, np.nan) for k in keys] for r in rows], dtype=float)


def test_fast_path_gives_the_plain_path_losses(in_tmp, monkeypatch):
    """channels_last + torch.compile against the plain NCHW eager path: same seed, same losses up to float noise. One
    IMPALA block (convolution, pooling, two residual blocks) holds every layer whose layout the fast path changes, at
    half the kernels torch.compile builds for two. A minibatch as large as the rollout's batch of games (8) gives
    the update's graph the shapes of the rollout's: compiled for that one size, not for any (half the update's
    compile time)."""
    # Inductor trusts the CPU's own list of vector instruction sets instead of test-compiling a program for each
    # (10 s of this test's 43 on a fresh machine, whose compile cache is empty); the kernels are the same.
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", True)
    common = dict(env_id="bigfish", num_envs=8, num_steps=8, num_minibatches=8, update_epochs=2,
                  total_timesteps=128, channels=(4,), hidden_size=8, eval_episodes=2, torch_threads=1)
    plain = losses(ppo.train(ppo.Args(**common, channels_last=False, compile=False)))
    fast = losses(ppo.train(ppo.Args(**common, channels_last=True, compile=True)))
    assert plain.shape == fast.shape == (3, 5)
    np.testing.assert_allclose(fast, plain, rtol=2e-3, atol=1e-5)
    assert np.abs(plain[:2, :2]).sum() > 0  # the comparison is not between zeros


@pytest.mark.parametrize("script", ["ppo_procgen", "ppg_procgen"])
def test_no_amp_rollout_keeps_bf16_to_the_update(script, in_tmp):
    """--amp --no-amp-rollout: the first rollout is the float32 run's (the same values, so the same explained
    variance: a bf16 rollout's values differ), and its update is --amp's own bf16 one (losses unlike the float32
    run's)."""
    import importlib
    module = importlib.import_module(script)
    common = dict(env_id="bigfish", num_envs=4, num_steps=16, num_minibatches=2, total_timesteps=64, channels=(4,),
                  hidden_size=8, eval_every=0, eval_episodes=1, torch_threads=1, seed=2)
    if script == "ppg_procgen":
        common.update(n_pi=1, e_aux=1)

    def first_row(**flags):
        with open(os.path.join(module.train(module.Args(**common, **flags)), "metrics.jsonl")) as f:
            return json.loads(f.readline())
    plain, update_only = first_row(), first_row(amp=True, amp_rollout=False)
    assert update_only["losses/explained_variance"] == plain["losses/explained_variance"]
    assert update_only["losses/value_loss"] != plain["losses/value_loss"]


@pytest.mark.parametrize("script", ["ppo_procgen", "vtrace"])
def test_threads_default_to_half_the_cores_for_torch_on_cpu(script, in_tmp, monkeypatch):
    """Rollout steps alternate between the games and the network, so their threads take turns (see start_run): on
    a CPU torch gets half the cores (a team as large as a busy machine collapses: docs/speed.md) and the games one
    thread; IMPALA's actor and learner split torch's half; flags given win."""
    module = importlib.import_module(script)
    for cores, torch_threads in [(1, 1), (2, 1), (3, 1), (8, 4)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
        run = module.start_run(module.Args(cuda=False))
        if script == "vtrace":
            module.actor_learner_threads(run)
            torch_threads = max(1, torch_threads // 2)
        module.close_run(run, closing=())
        module.restore_signal_handlers(run)
        assert run.args.env_threads == 1 and torch.get_num_threads() == torch_threads, cores
    run = module.start_run(module.Args(cuda=False, env_threads=3, torch_threads=2))
    module.close_run(run, closing=())
    module.restore_signal_handlers(run)
    assert run.args.env_threads == 3 and torch.get_num_threads() == 2
    torch.set_num_threads(1)


def test_benchmark_harness_times_vtrace_too():
    """vtrace.py's learner and actor phases (it takes one torch thread by itself on a CPU)."""
    (impala,) = bench.main(["--script", "vtrace.py", "--iterations", "2", "--warmup", "1", "--common",
                            "--env-id bigfish --num-envs 4 --unroll-length 8 --updates-per-iteration 2 --channels 4 "
                            "--hidden-size 8"])
    assert set(impala["seconds_per_iteration"]) == {"wait", "learn", "actor_wait", "actor_play"}
    assert impala["sps_median"] > 0


@pytest.mark.parametrize("channels_last", [False, True])
def test_channels_last_flag_sets_the_convolutions_input_layout(channels_last):
    cnn = ppo.ImpalaCNN((4,), 8, "default", channels_last)
    seen = []
    cnn.net[0].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    cnn(torch.zeros(2, 64, 64, 3, dtype=torch.uint8))
    assert seen[0].is_contiguous(memory_format=torch.channels_last) == channels_last
    assert seen[0].is_contiguous() == (not channels_last)


def test_gpu_bench_dry_run_flags_parse():
    """The GPU check runs only on a CUDA machine: its every command's flags must parse here first."""
    _, parsed = parsed_commands("")
    assert {script for script, _ in parsed} == {"ppo_procgen.py", "ppg_procgen.py", "vtrace.py"}
    # ppo-flags (each configuration), ppo-speed, ppg, impala, learning (2 games), NCCL
    assert len(parsed) == len(gpu_check.PPO_FLAGS) + 1 + 1 + 2 + 2 + 1, parsed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_bench.sh)")
def test_cuda_advantages_on_the_host_are_the_devices_bit_for_bit():
    """The scripts compute GAE on the host (a GPU's ~2,300 tiny kernels cost more than the loop's arithmetic): on a
    rollout with episode ends inside and at its end, the host's advantages equal the device's to the last bit."""
    import ppo_procgen as ppo

    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(256, 64, generator=generator), torch.randn(256, 64, generator=generator)
    dones = (torch.rand(256, 64, generator=generator) < 0.05).float()
    next_value, next_done = torch.randn(64, generator=generator), (torch.rand(64, generator=generator) < 0.5).float()
    inputs = (rewards, values, dones, next_value, next_done)
    on_host = ppo.compute_gae(*inputs, 0.999, 0.95)
    on_device = ppo.compute_gae(*(x.cuda() for x in inputs), 0.999, 0.95).cpu()
    assert torch.equal(on_host, on_device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_bench.sh)")
@pytest.mark.parametrize("script", ["ppo_procgen", "ppg_procgen"])
@pytest.mark.parametrize("flags", [{}, {"overlap_games": True}, {"amp": True}], ids=["eager", "overlap", "amp"])
def test_cuda_graph_rollouts_are_the_eager_ones_bit_for_bit(script, flags, in_tmp, monkeypatch):
    """--cuda-graph replays the eager rollout step: every step's logits, values, actions and log-probabilities, the
    generator's state at the end, and the losses and episodes, to the last bit, over iterations whose updates (and
    PPG's auxiliary phase) change the weights the graph reads; one graph per half of the games with
    --overlap-games; with --amp, bf16 casts of the current weights, not of the first step's. (cuDNN's deterministic
    algorithms, the default, make the eager path repeatable.)"""
    import importlib
    module = importlib.import_module(script)
    common = dict(env_id="bigfish", num_envs=8, num_steps=16, num_minibatches=2, total_timesteps=8 * 16 * 3,
                  channels=(4, 8), hidden_size=16, eval_every=0, eval_episodes=1, cuda=True, seed=5, **flags)
    if script == "ppg_procgen":
        common.update(n_pi=1, e_aux=1)
    calls = {"capture": 0, "replay": 0}

    class CountedAct(module.CapturedAct):
        def capture(self, obs):
            calls["capture"] += 1
            super().capture(obs)

        def __call__(self, obs):
            calls["replay"] += 1
            return super().__call__(obs)
    monkeypatch.setattr(module, "CapturedAct", CountedAct)
    policy_step = module.policy_step
    runs = {}
    for graph in (False, True):
        steps = []

        def recorded(acts, obs, games=None):
            outputs = policy_step(acts, obs, games)
            steps.append([x.detach().cpu().clone() for x in outputs[:4]])  # before the next replay
            return outputs
        monkeypatch.setattr(module, "policy_step", recorded)
        run_dir = module.train(module.Args(**common, cuda_graph=graph))
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        learned = ("global_step", "losses/", "charts/episod", "eval/")  # not the clock's figures
        runs[graph] = (steps, torch.cuda.get_rng_state(), [{key: value for key, value in row.items()
                                                            if key.startswith(learned)} for row in rows])
    halves = 2 if flags.get("overlap_games") else 1
    assert calls == {"capture": halves, "replay": halves * 16 * 3}  # the graph was used, at every step
    (eager_steps, eager_rng, eager_rows), (graph_steps, graph_rng, graph_rows) = runs[False], runs[True]
    assert len(eager_steps) == len(graph_steps) == 16 * 3
    for eager, graphed in zip(eager_steps, graph_steps):
        assert all(torch.equal(a, b) for a, b in zip(eager, graphed))
    assert torch.equal(eager_rng, graph_rng) and len(eager_rows) >= 3 and graph_rows == eager_rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by benchmarks/gpu_bench.sh)")
@pytest.mark.parametrize("script", ["ppo_procgen", "ppg_procgen", "vtrace"])
def test_cuda_fast_path_trains_with_finite_losses(script, in_tmp):
    """On a GPU: the fast path (channels_last, torch.compile, bf16 autocast, cuDNN autotuning) trains every script,
    with rollout storage on the device, and its losses stay finite. (bf16 changes the sampled actions, so the losses
    are not compared with the plain path's: tests/test_ppo.py checks that --amp learns.)"""
    import importlib
    module = importlib.import_module(script)
    common = dict(env_id="bigfish", num_envs=4, channels=(4, 8), hidden_size=16, eval_episodes=2, cuda=True)
    common.update(dict(unroll_length=8, updates_per_iteration=2, total_timesteps=128) if script == "vtrace" else
                  dict(num_steps=16, num_minibatches=2, total_timesteps=128))
    if script == "ppg_procgen":
        common.update(n_pi=2, e_aux=1)
    fast = losses(module.train(module.Args(**common, channels_last=True, compile=True, amp=True,
                                           torch_deterministic=False)))
    trained = fast[~np.isnan(fast[:, 0]), :3]  # the rows with losses (evaluation rows have none)
    assert len(trained) >= 2 and np.isfinite(trained).all()
