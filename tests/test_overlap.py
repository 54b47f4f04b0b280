"""--overlap-games: the games in two halves, one half stepping in procgen's threads while the network computes the
other half's actions. A run with it must play the same episodes as one without it (that the same actions, sent half
by half, play the same games as one step of the whole vector: tests/test_procgen_backends.py, on both backends)."""
import functools
import json

import numpy as np
import pytest
import torch
from conftest import train_in

import ppg_procgen as ppg
import ppo_procgen as ppo


class Recorder:
    """A stand-in for the network and the games that records the order of their calls."""

    def __init__(self):
        self.calls, self.halves = [], 2

    def __call__(self, obs):  # the network: logits for 15 actions and a value per game
        self.calls.append(("forward", len(obs)))
        return torch.zeros(len(obs), 15), torch.zeros(len(obs))

    def send(self, half, actions):
        self.calls.append(("send", half))


def test_each_halfs_actions_go_to_its_games_before_the_other_half_is_computed():
    """The overlap itself: half A's games have their actions (and step) while the network runs on half B."""
    recorder = Recorder()
    acts = [functools.partial(ppo.act, recorder)] * 2
    logits, value, action, log_prob, action_cpu = ppo.policy_step(acts, torch.zeros(8, 64, 64, 3), games=recorder)
    assert recorder.calls == [("forward", 4), ("send", 0), ("forward", 4), ("send", 1)]
    assert logits.shape == (8, 15) and value.shape == action.shape == log_prob.shape == action_cpu.shape == (8,)


class Trajectories:
    """Every step's frames, rewards and ends, recorded in the adapter itself (below the reward wrappers)."""

    def __init__(self, module, monkeypatch):
        self.steps, step = [], module.ProcgenVecEnv.step

        def recording_step(envs, actions):
            result = step(envs, actions)
            self.steps.append(tuple(np.copy(part) for part in result[:3]))
            return result
        monkeypatch.setattr(module.ProcgenVecEnv, "step", recording_step)


@pytest.mark.parametrize("module", [ppo, ppg], ids=["ppo", "ppg"])
def test_a_run_with_overlap_plays_the_same_episodes(module, tmp_path, monkeypatch):
    args = dict(env_id="bigfish", num_envs=8, num_steps=32, total_timesteps=8 * 32 * 2, num_minibatches=2,
                channels=(4,), hidden_size=8, eval_every=0, eval_episodes=1, torch_threads=1, seed=3)
    runs = {}
    for overlap in (False, True):
        (tmp_path / str(overlap)).mkdir()
        with monkeypatch.context() as patch:
            trajectories = Trajectories(module, patch)
            run_dir = train_in(tmp_path / str(overlap), module, module.Args(**args, overlap_games=overlap))
        rows = [json.loads(line) for line in open(tmp_path / str(overlap) / run_dir / "metrics.jsonl")]
        runs[overlap] = trajectories.steps, [row for row in rows if "losses/value_loss" in row]
    (plain_steps, plain_rows), (overlap_steps, overlap_rows) = runs[False], runs[True]
    assert len(plain_steps) == len(overlap_steps) >= 2 * 32  # the rollouts, then the evaluation
    for plain, overlapped in zip(plain_steps, overlap_steps):
        for want, have in zip(plain, overlapped):
            np.testing.assert_array_equal(want, have)
    # The network's numbers on half batches may differ from a full batch's in the last bits, no more.
    for plain, overlapped in zip(plain_rows, overlap_rows):
        for key in ("losses/policy_loss", "losses/value_loss", "losses/entropy"):
            assert overlapped[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize("module", [ppo, ppg], ids=["ppo", "ppg"])
def test_overlap_needs_an_even_number_of_games_per_rank(module):
    with pytest.raises(SystemExit, match="--overlap-games"):
        module.check_args(module.Args(num_envs=7, num_minibatches=7, overlap_games=True))
