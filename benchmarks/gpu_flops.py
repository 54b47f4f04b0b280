"""The floating-point work of one update of a Procgen script, for the GPU check's achieved TFLOPS
(benchmarks/gpu_check.py divides it by the update's measured seconds).

  python benchmarks/gpu_flops.py --script ppo_procgen.py --flags "--amp" --flags ""

torch's FlopCounterMode counts one frame through the agent's forward and backward passes (its
convolutions and matrix products; elementwise work is left out, so the figure is a floor); an
update trains on num_envs x num_steps frames for PPO's update_epochs, or for PPG's max(E_pi, E_V)
policy-phase epochs (both networks). Prints one JSON line per --flags, in order: the flags,
num_steps, flop_per_frame, frames_per_update and update_flop."""
import argparse
import contextlib
import importlib
import io
import json
import os
import shlex
import sys

import torch
import tyro
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def update_work(module, flags):
    args = tyro.cli(module.Args, args=shlex.split(flags))
    agent = module.Agent(args, num_actions=15)
    frame = torch.zeros((1, 64, 64, 3), dtype=torch.uint8)
    with FlopCounterMode(display=False) as counter:
        logits, value = agent(frame)
        (logits.float().sum() + value.float().sum()).backward()
    epochs = args.update_epochs if hasattr(args, "update_epochs") else max(args.e_pi, args.e_v)
    frames = args.num_envs * args.num_steps * epochs
    flop_per_frame = counter.get_total_flops()
    return {"flags": flags, "num_steps": args.num_steps, "flop_per_frame": flop_per_frame,
            "frames_per_update": frames, "update_flop": flop_per_frame * frames}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--script", required=True, choices=["ppo_procgen.py", "ppg_procgen.py"],
                        help="the script whose agent is counted")
    parser.add_argument("--flags", action="append", default=[], help="one configuration's flags (repeatable)")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    with contextlib.redirect_stderr(io.StringIO()):  # procgen's import of old gym prints a notice
        module = importlib.import_module(os.path.splitext(args.script)[0])
    for flags in args.flags or [""]:
        print(json.dumps(update_work(module, flags)), flush=True)


if __name__ == "__main__":
    main()
