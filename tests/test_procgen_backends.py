"""The Procgen adapter (`ProcgenVecEnv`) over both backends, procgen-mirror and EnvPool: the contract that the
algorithms rely on, checked against each installed backend, and parity with a trace of the official package.

tests/data/procgen_trace.npz was recorded with procgen-mirror by `python tests/test_procgen_backends.py`: every
game's first frames, and scripted random actions played in four games with each step's rewards and episode ends, the
frames that start new episodes and their levels. EnvPool must reproduce the rewards, the ends and the new episodes'
levels exactly (the same levels, the same game logic, the same-step reset). Its frames are not pixel-identical to
procgen-mirror's: the two backends draw with different Qt 5 builds (procgen-mirror's wheel bundles Qt 5.9, EnvPool
loads the system's 5.15), which anti-alias some edges differently (docs/platforms.md). So the frame that an episode's
end returns is checked exactly on its own backend: it must be the first frame of a fresh game on the next level.
"""
import os
import sys

import numpy as np
import pytest
from conftest import ROOT
from gymnasium.wrappers.vector import RecordEpisodeStatistics

import ppo_procgen as ppo

TRACE = os.path.join(ROOT, "tests", "data", "procgen_trace.npz")
PLAYED = ("starpilot", "bigfish", "bossfight", "coinrun")  # the speed table's games, and one with rare ends
NUM_ENVS, STEPS, SEED, FIRST_SEED = 4, 300, 7, 11
# How many of a frame's 4,096 pixels EnvPool may draw differently from the trace's first frames: 2 at most with
# Debian 12's Qt 5.15.8, but in other frames, seeds and games up to 67 (docs/platforms.md), and other Qt builds may
# differ more. A wrong level differs in thousands of pixels, but the wrong moment of the same game can differ in fewer
# than this (in Maze 112 between the frame before an end and the next level's first): so the levels and the frames
# that ends return are checked exactly instead.
MAX_PIXELS_REDRAWN = 128
WHEELS = {"procgen": "CPython 3.11 and 3.12 on Linux x86-64",
          "envpool": "CPython 3.13 and 3.14 on Linux x86-64; 3.11-3.14 on Linux aarch64, macOS arm64 and Windows"}


@pytest.fixture(params=["procgen", "envpool"])
def backend(request):
    """Each backend in turn. One that is not installed is skipped with what to install, except the one that
    requirements.txt installs on this platform when CI runs: there it must be present."""
    name = request.param
    try:
        return ppo.procgen_backend(name)
    except SystemExit as missing:
        if os.environ.get("CI") and name == platform_backend():
            pytest.fail(f"CI: {missing}")
        pytest.skip(f"{name} backend: {str(missing).split(';')[0].split(': ')[-1]} (requirements.txt installs it where "
                    f"it has wheels: {WHEELS[name]})")


def platform_backend():
    """The backend that requirements.txt's environment markers install here."""
    import platform
    official = sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info < (3, 13)
    return "procgen" if official else "envpool"


class LevelSeeds:
    """A backend's games, passed through unchanged, that also tell each game's current level seed from the backend's
    own reports: procgen's gym3 `get_info()`, and the info of each EnvPool call (`level_seed` of the games it lists
    in `env_id`). The adapter reports no levels itself."""

    def __init__(self, games, backend, num_envs):
        self.games, self.backend = games, backend
        self.seeds = np.full(num_envs, -1)  # EnvPool's, as its calls report them

    def __getattr__(self, name):  # act, observe, get_info, close: the games' own
        return getattr(self.games, name)

    def step(self, *args, **kwargs):  # EnvPool's
        result = self.games.step(*args, **kwargs)
        info = result[-1]
        self.seeds[info["env_id"]] = info["level_seed"]
        return result

    def current(self):
        if self.backend == "procgen":
            return np.array([info["level_seed"] for info in self.games.get_info()])
        return self.seeds.copy()


def play(backend, game, actions, step=None, seed=SEED):
    """Scripted play from reset(seed=seed): the first frames, every step's rewards and ends, and what each end
    returned as a list of (step, env, frame, level): the frame, and the level seed the game then plays."""
    envs = ppo.ProcgenVecEnv(actions.shape[1], game, backend=backend)
    obs, _ = envs.reset(seed=seed)
    envs.pools = [LevelSeeds(envs.pools[0], backend, envs.num_envs)]  # one pool: halves=1
    first, rewards, ends, starts = obs.copy(), [], [], []
    for t, action in enumerate(actions):
        obs, reward, terminated, truncated, info = (step or type(envs).step)(envs, action)
        assert not truncated.any() and info == {}
        rewards.append(reward)
        ends.append(terminated)
        levels = envs.pools[0].current()
        starts += [(t, i, obs[i].copy(), levels[i]) for i in np.flatnonzero(terminated)]
    envs.close()
    return first, np.array(rewards), np.array(ends), starts


def first_frame_of_level(backend, game, level):
    """The first frame of a fresh game that plays only `level` (a level seed)."""
    envs = ppo.ProcgenVecEnv(1, game, num_levels=1, start_level=int(level), backend=backend)
    frame = envs.reset(seed=0)[0][0]
    envs.close()
    return frame


def assert_ends_return_the_next_levels_first_frame(backend, game, starts):
    """Exactly, on the same backend: each end's frame is the first frame of a fresh game on the level that the end
    moved to (not, say, the old episode's last frame, which in Maze differs from it in as few as 112 pixels)."""
    for t, i, frame, level in starts:
        np.testing.assert_array_equal(frame, first_frame_of_level(backend, game, level),
                                      err_msg=f"{game}: the frame returned with the end at step {t}, env {i}")


def scripted_actions(game, steps=STEPS, num_envs=NUM_ENVS):
    actions_seed = PLAYED.index(game) if game in PLAYED else len(PLAYED)  # the trace's games: as recorded
    return np.random.default_rng(actions_seed).integers(15, size=(steps, num_envs))


def first_frames(backend):
    """Two games per Procgen title, easy, from reset(seed=FIRST_SEED)."""
    frames = {}
    for game in ppo.PROCGEN_RANGES:
        envs = ppo.ProcgenVecEnv(2, game, backend=backend)
        frames[game] = envs.reset(seed=FIRST_SEED)[0]
        envs.close()
    return frames


def redrawn_pixels(a, b):
    return int((a != b).any(-1).sum())


def assert_frames_match(backend, recorded, played, where):
    """Equal on the backend the trace was recorded with; on the other, up to this trace's anti-aliasing."""
    if backend == "procgen":
        np.testing.assert_array_equal(played, recorded, err_msg=where)
    else:
        assert redrawn_pixels(played, recorded) <= MAX_PIXELS_REDRAWN, where


def assert_play_matches_the_trace(backend, trace, game, step=None):
    first, rewards, ends, starts = play(backend, game, scripted_actions(game), step)
    np.testing.assert_array_equal(ends, trace[f"{game}/ends"], err_msg=f"{game}: episode ends")
    np.testing.assert_array_equal(rewards, trace[f"{game}/rewards"], err_msg=f"{game}: rewards")
    for env in range(NUM_ENVS):
        assert_frames_match(backend, trace[f"{game}/first"][env], first[env], f"{game}: first frame of env {env}")
    assert [(t, i) for t, i, _, _ in starts] == [tuple(where) for where in trace[f"{game}/starts_at"]]
    assert [level for _, _, _, level in starts] == list(trace[f"{game}/start_levels"]), f"{game}: new levels"
    assert_ends_return_the_next_levels_first_frame(backend, game, starts)
    if backend == "procgen":  # the recorded frames themselves, which the other backend draws slightly differently
        for (t, i, frame, _), recorded in zip(starts, trace[f"{game}/starts"]):
            np.testing.assert_array_equal(frame, recorded, err_msg=f"{game}: the frame of the end at {t}, env {i}")


@pytest.fixture(scope="module")
def trace():
    return np.load(TRACE)


def test_contract_spaces_dtypes_and_no_truncation(backend):
    envs = ppo.ProcgenVecEnv(3, "coinrun", backend=backend)
    assert envs.backend == backend and envs.metadata["autoreset_mode"].name == "SAME_STEP"
    assert envs.single_observation_space.shape == (64, 64, 3) and envs.single_action_space.n == 15
    assert envs.observation_space.shape == (3, 64, 64, 3) and envs.action_space.shape == (3,)
    obs, info = envs.reset(seed=0)
    assert obs.shape == (3, 64, 64, 3) and obs.dtype == np.uint8 and info == {}
    obs, reward, terminated, truncated, info = envs.step(np.zeros(3, dtype=np.int64))
    assert obs.shape == (3, 64, 64, 3) and obs.dtype == np.uint8 and reward.dtype == np.float64
    assert reward.shape == terminated.shape == truncated.shape == (3,)
    assert terminated.dtype == truncated.dtype == bool and not truncated.any()
    envs.close()


def test_the_same_seed_plays_the_same_games_and_another_seed_others(backend):
    actions = scripted_actions("bigfish")[:150]
    first_a, rewards_a, ends_a, starts_a = play(backend, "bigfish", actions)
    first_b, rewards_b, ends_b, starts_b = play(backend, "bigfish", actions)
    np.testing.assert_array_equal(first_a, first_b)
    np.testing.assert_array_equal(rewards_a, rewards_b)
    np.testing.assert_array_equal(ends_a, ends_b)
    envs = ppo.ProcgenVecEnv(NUM_ENVS, "bigfish", backend=backend)
    assert not np.array_equal(envs.reset(seed=SEED + 1)[0], first_a)
    envs.close()


def test_episode_statistics_are_sums_of_raw_rewards_and_lengths(backend):
    """SAME_STEP autoreset: the reward that comes with terminated=True belongs to the finished episode."""
    envs = RecordEpisodeStatistics(ppo.ProcgenVecEnv(8, "starpilot", backend=backend))
    envs.reset(seed=3)
    running, lengths = np.zeros(8), np.zeros(8, dtype=int)
    expected, recorded = [], []
    rng = np.random.default_rng(0)
    for _ in range(400):
        _, reward, terminated, truncated, info = envs.step(rng.integers(15, size=8))
        running += reward
        lengths += 1
        for i in np.flatnonzero(terminated | truncated):
            expected.append((running[i], lengths[i]))
            running[i], lengths[i] = 0, 0
        if "_episode" in info:
            ended = info["_episode"]
            recorded += list(zip(info["episode"]["r"][ended], info["episode"]["l"][ended]))
    envs.close()
    assert len(expected) >= 8 and any(r > 0 for r, _ in expected)  # enough episodes, some with points
    assert recorded == expected


def test_episodes_end_at_the_games_own_time_limit_as_terminations(backend):
    """Leaper ends an episode after 500 steps (procgen's timeout); EnvPool's own step limit must not cut it shorter
    or mark it truncated."""
    envs = ppo.ProcgenVecEnv(2, "leaper", backend=backend)
    envs.reset(seed=0)
    ends = [envs.step(np.full(2, 4))[2] for _ in range(500)]  # action 4 does nothing: the frog stays put
    envs.close()
    assert not np.any(ends[:-1]) and np.all(ends[-1])


def test_every_game_starts_on_the_official_first_frames(backend, trace):
    for game, frames in first_frames(backend).items():
        for env in range(len(frames)):
            assert_frames_match(backend, trace[f"first_frames/{game}"][env], frames[env], f"{game}, env {env}")


@pytest.mark.parametrize("game", PLAYED)
def test_scripted_play_gives_the_official_rewards_ends_and_new_episodes(backend, trace, game):
    assert_play_matches_the_trace(backend, trace, game)


def test_an_end_in_maze_returns_the_next_levels_first_frame(backend):
    """Maze's frames change little from one level to the next (the frame before an end and the next level's first
    can differ in about a hundred pixels, fewer than the backends' drawing differs elsewhere), so only an exact check
    tells them apart."""
    _, _, _, starts = play(backend, "maze", scripted_actions("maze", steps=250, num_envs=16), seed=2)
    assert len(starts) >= 5, "too few episode ends to check"
    assert_ends_return_the_next_levels_first_frame(backend, "maze", starts)


def test_sending_half_by_half_plays_the_same_games_as_one_step(backend):
    """--overlap-games' two halves: the same actions, sent half by half as it does or all at once, give the same frames, rewards and
    ends at every step."""
    actions = np.random.default_rng(0).integers(15, size=(120, 8))
    plain, halves = (ppo.ProcgenVecEnv(8, "bigfish", backend=backend, halves=2) for _ in range(2))
    np.testing.assert_array_equal(plain.reset(seed=5)[0], halves.reset(seed=5)[0])
    ends = 0
    for action in actions:
        expected = plain.step(action)
        halves.send(0, action[:4])
        halves.send(1, action[4:])
        got = halves.step(np.full(8, -1))  # both halves already sent: these actions are not used
        for want, have in zip(expected[:3], got[:3]):
            np.testing.assert_array_equal(want, have)
        ends += int(expected[2].sum())
    assert ends > 0  # episodes ended and the next ones began inside the comparison
    plain.close()
    halves.close()


def test_the_two_halves_play_different_levels(backend):
    """Each pool draws its own seed: two pools seeded alike would play every level twice, game i of one half on
    the same level as game i of the other."""
    envs = ppo.ProcgenVecEnv(8, "starpilot", backend=backend, halves=2)
    frames = envs.reset(seed=3)[0]
    envs.close()
    assert not any(np.array_equal(frames[i], frames[4 + i]) for i in range(4))


def test_envpools_raw_reset_step_in_a_rollout_would_be_caught(trace):
    """EnvPool on its own resets a finished game one step late: the end's step returns the old episode's last frame,
    and the next step is a transition whose action is ignored, with reward 0 and no end, from the last frame into
    the next episode's first. In a rollout GAE and V-trace would bootstrap across the episode through it. Passed
    through unconverted, the parity check above fails."""
    try:
        ppo.procgen_backend("envpool")
    except SystemExit as missing:
        pytest.skip(f"envpool backend: envpool is not installed (requirements.txt installs it where it has wheels: "
                    f"{WHEELS['envpool']})")

    def raw_step(envs, actions):
        obs, reward, terminated, truncated, _ = envs.pools[0].step(np.asarray(actions, dtype=np.int32))
        return obs, reward.astype(np.float64), terminated | truncated, np.zeros(envs.num_envs, dtype=bool), {}

    with pytest.raises(AssertionError):
        assert_play_matches_the_trace("envpool", trace, "bossfight", step=raw_step)


def record(path):
    """The trace, from procgen-mirror."""
    arrays = {}
    for game, frames in first_frames("procgen").items():
        arrays[f"first_frames/{game}"] = frames
    for game in PLAYED:
        first, rewards, ends, starts = play("procgen", game, scripted_actions(game))
        arrays.update({f"{game}/first": first, f"{game}/rewards": rewards, f"{game}/ends": ends,
                       f"{game}/starts_at": np.array([(t, i) for t, i, _, _ in starts]).reshape(-1, 2),
                       f"{game}/starts": np.array([frame for _, _, frame, _ in starts]),
                       f"{game}/start_levels": np.array([level for _, _, _, level in starts])})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    record(TRACE)
    print(f"wrote {TRACE}")
