"""Run by tests/test_distributed.py under torchrun with 2 ranks (gloo, CPU): each rank takes one half of a batch and
one optimizer step with the all-reduced gradient; then the process group is closed and rank 0 takes the same step in
one process on the whole batch. With SGD (lr 1) the weights move by exactly the gradient, so equal weights mean equal
gradients. Checks PPO's update (advantages normalized over the global minibatch), PPG's auxiliary phase and the
IMPALA learner's V-trace step (each rank with half of the unrolls)."""
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppg_procgen as ppg  # noqa: E402
import ppo_procgen as ppo  # noqa: E402
import vtrace  # noqa: E402


def ppo_case():
    args = ppo.Args(channels=(4,), hidden_size=16, num_minibatches=1, update_epochs=1, cuda=False)
    torch.manual_seed(0)
    agent = ppo.Agent(args, num_actions=15)
    generator = torch.Generator().manual_seed(1)
    obs = torch.randint(0, 256, (64, 64, 64, 3), dtype=torch.uint8, generator=generator)
    with torch.no_grad():
        logits, values = agent(obs)
    logits = logits + torch.randn(logits.shape, generator=generator)  # pi_old != pi: ratios and KL are not trivial
    actions = torch.randint(0, 15, (64,), generator=generator)
    batch = dict(obs=obs, actions=actions, log_probs=ppo.log_prob_entropy(logits, actions)[0], logits=logits,
                 values=values, advantages=torch.randn(64, generator=generator) * 3 + 1,
                 returns=values + torch.randn(64, generator=generator))

    def step(part):
        optimizer = torch.optim.SGD(agent.parameters(), lr=1.0)
        ppo.ppo_update(agent, optimizer, {key: value[part] for key, value in batch.items()}, args)
        return torch.cat([p.detach().flatten() for p in agent.parameters()])
    return agent, step


def ppg_case():
    args = ppg.Args(channels=(4,), hidden_size=16, e_aux=1, num_aux_rollouts=4, cuda=False)
    torch.manual_seed(0)
    agent = ppg.Agent(args, num_actions=15)
    generator = torch.Generator().manual_seed(2)
    aux_obs = torch.randint(0, 256, (4, 8, 64, 64, 3), dtype=torch.uint8, generator=generator)
    aux_value_targets = torch.randn(4, 8, generator=generator)

    def step(part):
        optimizer = torch.optim.SGD(agent.networks(), lr=1.0)
        ppg.auxiliary_phase(agent.forward_aux, optimizer, aux_obs[part], aux_value_targets[part], args)
        return torch.cat([p.detach().flatten() for p in agent.parameters()])
    return agent, step


def vtrace_case():
    args = vtrace.Args(channels=(4,), hidden_size=16, cuda=False, max_grad_norm=float("inf"))
    torch.manual_seed(0)
    agent = vtrace.Agent(args, num_actions=15)
    generator = torch.Generator().manual_seed(3)
    steps, unrolls = 6, 4  # [T + 1, B] frames, [T, B] the rest, as collect_unroll lays them out
    batch = dict(obs=torch.randint(0, 256, (steps + 1, unrolls, 64, 64, 3), dtype=torch.uint8, generator=generator),
                 actions=torch.randint(0, 15, (steps, unrolls), generator=generator),
                 behaviour_logits=torch.randn(steps, unrolls, 15, generator=generator),
                 rewards=torch.randn(steps, unrolls, generator=generator),
                 dones=(torch.rand(steps, unrolls, generator=generator) < 0.2).float())

    def step(part):
        optimizer = torch.optim.SGD(agent.parameters(), lr=1.0)
        vtrace.vtrace_backward(agent, optimizer, {key: value[:, part] for key, value in batch.items()}, args,
                               contextlib.nullcontext)
        optimizer.step()
        return torch.cat([p.detach().flatten() for p in agent.parameters()])
    return agent, step


threads_before = len(os.listdir("/proc/self/task"))  # torchrun sets OMP_NUM_THREADS=1: torch starts no pool
rank, world_size, _ = ppo.setup_distributed(ppo.Args(cuda=False))
assert world_size == 2
results = {}
for name, case, size in (("ppo", ppo_case, 64), ("ppg", ppg_case, 4), ("vtrace", vtrace_case, 4)):
    agent, step = case()
    initial = {key: value.clone() for key, value in agent.state_dict().items()}
    half = size // 2
    results[name] = (agent, initial, step, step(slice(rank * half, (rank + 1) * half)))
torch.distributed.destroy_process_group()
# gloo's worker threads must be gone: one still alive at exit can abort the process (see setup_distributed)
threads_after = len(os.listdir("/proc/self/task"))
assert threads_after == threads_before, f"rank {rank}: {threads_after} threads after destroy_process_group, " \
    f"{threads_before} before init_process_group"
if rank == 0:
    for name, (agent, initial, step, distributed) in results.items():
        agent.load_state_dict(initial)
        single = step(slice(None))
        moved = (single - torch.cat([value.flatten() for value in initial.values()])).abs().max().item()
        difference = (single - distributed).abs().max().item()
        print(f"{name}: weights moved by up to {moved:.3g}; two ranks vs one process differ by {difference:.3g}")
        assert moved > 1e-3 and difference < 1e-5 * max(1.0, moved), name
