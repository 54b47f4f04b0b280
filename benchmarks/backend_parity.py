"""How close EnvPool's Procgen is to procgen-mirror's: the same seeds and scripted random actions played through the
scripts' adapter on each backend, each in the interpreter given for it (requirements.txt installs procgen-mirror
with numpy 1.26 on CPython 3.11 and 3.12, EnvPool with numpy 2 on 3.13), then every step's rewards, episode ends and
frames compared; and the first frames of all 16 games, easy and hard, on unbounded levels and on one fixed level.
Each seed is one such comparison; the summary takes the worst over the seeds.

    python benchmarks/backend_parity.py --procgen-python .venv/bin/python --envpool-python .venv313/bin/python \
        --seeds 7 8 9 --out benchmarks/results/backend_parity.json

One interpreter with both installed may be given twice (docs/platforms.md says how to make one). The suite's shorter
version of this check runs against a recorded trace, and checks each episode end's frame exactly on its own backend
(tests/test_procgen_backends.py).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAYED = ("starpilot", "bigfish", "bossfight", "coinrun", "maze", "heist")  # the speed table's, few ends, few pixels
GAMES = ("bigfish", "bossfight", "caveflyer", "chaser", "climber", "coinrun", "dodgeball", "fruitbot", "heist",
         "jumper", "leaper", "maze", "miner", "ninja", "plunder", "starpilot")


def record(backend, path, games, steps, num_envs, seed):
    """In this interpreter: play and write every frame, reward and end to `path` (.npz), and the first frames of
    every game (unbounded levels from reset(seed=seed), and the fixed level 1234 + seed)."""
    sys.path.insert(0, ROOT)
    import ppo_procgen

    arrays = {}
    for game in games:
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
            fixed = ppo_procgen.ProcgenVecEnv(2, game, mode, num_levels=1, start_level=1234 + seed,
                                              backend=backend)
            arrays[f"first/{game}/{mode}"] = np.concatenate([unbounded.reset(seed=seed)[0],
                                                             fixed.reset(seed=3)[0]])
            unbounded.close(), fixed.close()
    np.savez_compressed(path, **arrays)


def redrawn(a, b):
    """Pixels (of 64 x 64) that differ, per frame."""
    return (a != b).any(-1).sum(axis=(-1, -2))


def fewest_at_ends(trace, game):
    """How unlike a wrong frame is: the fewest pixels between the frame before an episode's end and the next
    episode's first frame that the end returned (procgen-mirror's play)."""
    frames, ends = trace[f"{game}/frames"], trace[f"{game}/ends"]
    distances = [redrawn(frames[t + 1][i], frames[t][i]) for t, i in zip(*np.nonzero(ends))]
    return int(min(distances)) if distances else None


def compare(official, other, games):
    played = {}
    for game in games:
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


def worst_over_seeds(per_seed, games):
    """Per game: identical in every seed, the most pixels of a frame redrawn in any, the fewest at an end in any."""
    summary = {}
    for game in games:
        runs = [comparison["played"][game] for comparison in per_seed.values()]
        at_ends = [run["fewest_pixels_from_before_an_end_to_the_new_episode"] for run in runs]
        summary[game] = {"rewards_identical": all(run["rewards_identical"] for run in runs),
                         "ends_identical": all(run["ends_identical"] for run in runs),
                         "episode_ends": sum(run["episode_ends"] for run in runs),
                         "most_pixels_redrawn_in_a_frame": max(run["most_pixels_redrawn_in_a_frame"] for run in runs),
                         "fewest_pixels_from_before_an_end_to_the_new_episode":
                             min([pixels for pixels in at_ends if pixels is not None], default=None)}
    first = {}
    for name in per_seed[next(iter(per_seed))]["first_frames_pixels_redrawn"]:
        first[name] = max(max(comparison["first_frames_pixels_redrawn"][name]) for comparison in per_seed.values())
    return {"played": summary, "first_frames_most_pixels_redrawn": first}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--procgen-python", help="an interpreter with procgen-mirror installed")
    parser.add_argument("--envpool-python", help="an interpreter with envpool installed")
    parser.add_argument("--steps", type=int, default=1000, help="steps of each game")
    parser.add_argument("--num-envs", type=int, default=4, help="games of each backend")
    parser.add_argument("--seeds", type=int, nargs="+", default=[7], help="seeds of the games")
    parser.add_argument("--games", nargs="+", choices=GAMES, default=list(PLAYED), help="the games played")
    parser.add_argument("--out", help="write the comparison to this JSON file")
    parser.add_argument("--record", nargs=3, metavar=("BACKEND", "PATH", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record:
        backend, path, seed = args.record
        return record(backend, path, args.games, args.steps, args.num_envs, int(seed))
    if not (args.procgen_python and args.envpool_python):
        parser.error("give both --procgen-python and --envpool-python")
    per_seed = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as folder:
            traces = {}
            for backend, python in (("procgen", args.procgen_python), ("envpool", args.envpool_python)):
                path = os.path.join(folder, f"{backend}.npz")
                subprocess.run([python, os.path.abspath(__file__), "--record", backend, path, str(seed),
                                "--steps", str(args.steps), "--num-envs", str(args.num_envs), "--games",
                                *args.games], check=True)
                traces[backend] = np.load(path)
            per_seed[str(seed)] = compare(traces["procgen"], traces["envpool"], args.games)
        print(f"seed {seed}:")
        for game, stats in per_seed[str(seed)]["played"].items():
            print(f"  {game:10} rewards identical {stats['rewards_identical']}, ends identical "
                  f"{stats['ends_identical']} ({stats['episode_ends']} ends), frames identical "
                  f"{stats['frames_identical']}/{stats['frames']}, at most {stats['most_pixels_redrawn_in_a_frame']} "
                  f"pixels of a frame redrawn; before an end to the new episode: at least "
                  f"{stats['fewest_pixels_from_before_an_end_to_the_new_episode']}", flush=True)
    result = {"command": " ".join(["benchmarks/backend_parity.py"] + sys.argv[1:]), "steps": args.steps,
              "num_envs": args.num_envs, "seeds": args.seeds, **worst_over_seeds(per_seed, args.games),
              "per_seed": per_seed}
    differing = {name: pixels for name, pixels in result["first_frames_most_pixels_redrawn"].items() if pixels}
    print(f"first frames: {len(result['first_frames_most_pixels_redrawn']) - len(differing)} of "
          f"{len(result['first_frames_most_pixels_redrawn'])} game x difficulty pairs identical in every seed; "
          f"the most pixels redrawn in the others: {differing}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
