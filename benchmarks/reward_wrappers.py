"""Host time per vector step of the training envs' reward and statistics wrappers, without the games: the scripts'
stack (`RecordEpisodeStatistics`, then `NormalizeReward`, which also clips) against the stack it replaced (the same,
with gymnasium's vector `ClipReward` clipping on top, per game in a Python loop), and each wrapper alone. The games
are a stand-in that returns random rewards and ends at once, so only the wrappers are timed. Alternated round by
round; the median over rounds of microseconds per step.

    python benchmarks/reward_wrappers.py --num-envs 64 --rounds 5 --out benchmarks/results/cpu_reward_wrappers.json
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import ClipReward, RecordEpisodeStatistics

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppo_procgen  # noqa: E402


class InstantGames(gym.vector.VectorEnv):
    """Frames of zeros, random rewards and about one end per 100 steps per game, returned at once."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs):
        self.num_envs, self.rng = num_envs, np.random.default_rng(0)
        self.frames = np.zeros((num_envs, 64, 64, 3), np.uint8)
        self.single_observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(15)

    def reset(self, *, seed=None, options=None):
        return self.frames, {}

    def step(self, actions):
        ends = self.rng.random(self.num_envs) < 0.01
        return self.frames, self.rng.random(self.num_envs), ends, np.zeros(self.num_envs, dtype=bool), {}


STACKS = {
    "games alone": lambda n: InstantGames(n),
    "episode statistics": lambda n: RecordEpisodeStatistics(InstantGames(n)),
    "normalizer with its clip": lambda n: ppo_procgen.NormalizeReward(InstantGames(n), 0.99, clip=10.0),
    "gymnasium ClipReward": lambda n: ClipReward(InstantGames(n), -10.0, 10.0),
    "the scripts' stack": lambda n: ppo_procgen.NormalizeReward(RecordEpisodeStatistics(InstantGames(n)), 0.99,
                                                                clip=10.0),
    "the previous stack": lambda n: ClipReward(ppo_procgen.NormalizeReward(
        RecordEpisodeStatistics(InstantGames(n)), 0.99, clip=np.inf), -10.0, 10.0),
}


def microseconds_per_step(envs, steps):
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    start = time.perf_counter()
    for _ in range(steps):
        envs.step(actions)
    return (time.perf_counter() - start) / steps * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-envs", type=int, default=64, help="games in the vector env")
    parser.add_argument("--steps", type=int, default=2000, help="vector steps per timing")
    parser.add_argument("--rounds", type=int, default=5, help="timings of each stack, alternated")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    rounds = {name: [] for name in STACKS}
    for _ in range(args.rounds):
        for name, make in STACKS.items():
            rounds[name].append(microseconds_per_step(make(args.num_envs), args.steps))
    results = {name: {"us_per_step_median": statistics.median(times), "us_per_step_rounds": times}
               for name, times in rounds.items()}
    for name, result in results.items():
        print(f"{name:26s} {result['us_per_step_median']:8.1f} us per step")
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"num_envs": args.num_envs, "steps": args.steps, "rounds": args.rounds,
                       "machine": platform.processor() or platform.machine(), "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
