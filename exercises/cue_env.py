"""A tiny pixel task for the graders' learning check, and the tests' CueEnv (tests/conftest.py imports
it; exercises/ needs nothing from tests/). Each 64x64 frame is filled with one of `num_cues` colours;
action k earns reward 1 iff k is the colour's index, so random play (15 actions) earns 1/15 per step,
8/15 ~ 0.53 per episode of 8 steps, and a solved task 8. Same autoreset contract as the scripts'
ProcgenVecEnv: SAME_STEP, never truncated."""
import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode


class CueEnv(gym.vector.VectorEnv):
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


def patch(module):
    """Replace a script's Procgen adapter by CueEnv, for training and evaluation alike."""
    module.ProcgenVecEnv = lambda num_envs, *args, **kwargs: CueEnv(num_envs)
