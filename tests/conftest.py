"""Shared test helpers: the scripts live at the repo root; CueEnv is a tiny pixel task that a few thousand
steps of a working algorithm solve on a CPU, used by the learning tests of every Procgen script."""
import os
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(min(2, os.cpu_count() or 1))


class CueEnv(gym.vector.VectorEnv):
    """Each frame is filled with one of `num_cues` colours; action k earns reward 1 iff k equals the colour's index,
    so a random policy (15 actions) earns 1/15 per step. Episodes last `length` steps. Same autoreset contract as
    ProcgenVecEnv (SAME_STEP, never truncated)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}
    COLOURS = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 0]], dtype=np.uint8)

    def __init__(self, num_envs, length=8, num_cues=3):
        self.num_envs, self.length, self.num_cues = num_envs, length, num_cues
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(15)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def _frames(self):
        return np.broadcast_to(self.COLOURS[self.cue][:, None, None, :], (self.num_envs, 64, 64, 3)).copy()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cue = self.np_random.integers(self.num_cues, size=self.num_envs)
        self.t = np.zeros(self.num_envs, dtype=int)
        return self._frames(), {}

    def step(self, actions):
        reward = (np.asarray(actions) == self.cue).astype(np.float64)
        self.t += 1
        done = self.t >= self.length
        self.t[done] = 0
        self.cue = self.np_random.integers(self.num_cues, size=self.num_envs)
        return self._frames(), reward, done, np.zeros(self.num_envs, dtype=bool), {}


@pytest.fixture
def cue_env(monkeypatch):
    """Replace a script's Procgen adapter by CueEnv, for training and evaluation alike."""
    def patch(module):
        monkeypatch.setattr(module, "ProcgenVecEnv", lambda num_envs, *args, **kwargs: CueEnv(num_envs))
    return patch


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a temporary directory, so runs/ lands there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
