"""How close EnvPool's Procgen is to procgen-mirror's: the same seeds and scripted random actions played through the
scripts' adapter on each backend (each in its own interpreter), then every step's rewards, episode ends and frames
compared; and the first frames of all 16 games, easy and hard, on unbounded levels and on one fixed level.

    python benchmarks/backend_parity.py --procgen-python .venv/bin/python --envpool-python .venv313/bin/python \
        --out benchmarks/results/backend_parity.json

The suite's shorter version of this check runs against a recorded trace (tests/test_procgen_backends.py)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAYED = ("starpilot", "bigfish", "bossfight", "coinrun")
GAMES = ("bigfish", "bossfight", "caveflyer", "chaser", "climber", "coinrun", "dodgeball", "fruitbot", "heist",
         "jumper", "leaper", "maze", "miner", "ninja", "plunder", "starpilot")


def record(backend, path, steps, num_envs, seed):
    """In this interpreter: play and write every frame, reward and end to `path` (.npz)."""
    sys.path.insert(0, ROOT)
    import ppo_procgen

    arrays = {}
    for game in PLAYED:
        envs = ppo_procgen.ProcgenVecEnv(num_envs, game, backend=backend)
        frames, rewards, ends = [envs.reset(seed=seed)[0].copy()], [], []
        for action in np.random.default_rng(seed).integers(15, size=(steps, num_envs)):
            obs, reward, terminated, _, _ = envs.step(action)
            frames.append(obs.copy()), rewards.append(reward), ends.append(terminated)
        envs.close()
        arrays.update({f"{game}/frames": np.array(frames), f"{game}/rewards": np.array(rewards),
                       f"{game}/ends": np.array(ends)})
    for game in GAMES:
        for mode in ("easy", "hard"):
            unbounded = ppo_procgen.ProcgenVecEnv(4, game, mode, backend=backend)
            fixed = ppo_procgen.ProcgenVecEnv(2, game, mode, num_levels=1, start_level=1234, backend=backend)
            arrays[f"first/{game}/{mode}"] = np.concatenate([unbounded.reset(seed=11)[0], fixed.reset(seed=3)[0]])
            unbounded.close(), fixed.close()
    np.savez_compressed(path, **arrays)


def redrawn(a, b):
    """Pixels (of 64 x 64) that differ, per frame."""
    return (a != b).any(-1).sum(axis=(-1, -2))


def fewest_at_ends(trace, game):
    """How unlike a wrong frame is: the fewest pixels between the frame before an episode's end and the next
    episode's first frame that the end returned (procgen-mirror's play)."""
    frames, ends = trace[f"{game}/frames"], trace[f"{game}/ends"]
    return int(min(redrawn(frames[t + 1][i], frames[t][i]) for t, i in zip(*np.nonzero(ends))))


def compare(official, other):
    played = {}
    for game in PLAYED:
        pixels = redrawn(official[f"{game}/frames"], other[f"{game}/frames"])
        played[game] = {"rewards_identical": bool(np.array_equal(official[f"{game}/rewards"],
                                                                 other[f"{game}/rewards"])),
                        "ends_identical": bool(np.array_equal(official[f"{game}/ends"], other[f"{game}/ends"])),
                        "episode_ends": int(official[f"{game}/ends"].sum()),
                        "frames_identical": int((pixels == 0).sum()), "frames": int(pixels.size),
                        "most_pixels_redrawn_in_a_frame": int(pixels.max()),
                        "share_of_pixels_redrawn": float(pixels.sum() / (pixels.size * 64 * 64)),
                        "fewest_pixels_from_before_an_end_to_the_new_episode": fewest_at_ends(official, game)}
    first = {}
    for game in GAMES:
        for mode in ("easy", "hard"):
            first[f"{game} {mode}"] = redrawn(official[f"first/{game}/{mode}"], other[f"first/{game}/{mode}"]).tolist()
    return {"played": played, "first_frames_pixels_redrawn": first}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procgen-python", help="an interpreter with procgen-mirror installed")
    parser.add_argument("--envpool-python", help="an interpreter with envpool installed")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", help="write the comparison to this JSON file")
    parser.add_argument("--record", nargs=2, metavar=("BACKEND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record:
        return record(*args.record, args.steps, args.num_envs, args.seed)
    if not (args.procgen_python and args.envpool_python):
        parser.error("give both --procgen-python and --envpool-python")
    with tempfile.TemporaryDirectory() as folder:
        traces = {}
        for backend, python in (("procgen", args.procgen_python), ("envpool", args.envpool_python)):
            path = os.path.join(folder, f"{backend}.npz")
            subprocess.run([python, os.path.abspath(__file__), "--record", backend, path, "--steps",
                            str(args.steps), "--num-envs", str(args.num_envs), "--seed", str(args.seed)], check=True)
            traces[backend] = np.load(path)
        result = {"command": " ".join(["benchmarks/backend_parity.py"] + sys.argv[1:]), "steps": args.steps,
                  "num_envs": args.num_envs, "seed": args.seed, **compare(traces["procgen"], traces["envpool"])}
    for game, stats in result["played"].items():
        print(f"{game:10} rewards identical {stats['rewards_identical']}, ends identical {stats['ends_identical']} "
              f"({stats['episode_ends']} ends), frames identical {stats['frames_identical']}/{stats['frames']}, "
              f"at most {stats['most_pixels_redrawn_in_a_frame']} pixels of a frame redrawn; a wrong frame at an "
              f"end: at least {stats['fewest_pixels_from_before_an_end_to_the_new_episode']}")
    differing = {name: pixels for name, pixels in result["first_frames_pixels_redrawn"].items() if any(pixels)}
    print(f"first frames: {len(result['first_frames_pixels_redrawn']) - len(differing)} of "
          f"{len(result['first_frames_pixels_redrawn'])} game x difficulty pairs identical; differing: {differing}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
