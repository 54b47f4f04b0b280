"""The communication of data-parallel training: one all-reduce of all gradients (one flat bucket) per optimizer step.
Run under torchrun; prints the bucket's size for each script's network and the time of one all-reduce of it:

  torchrun --standalone --nproc-per-node 2 benchmarks/allreduce_cost.py [--repeats 50] [--out FILE.json]

gloo on CPU, NCCL between GPUs (one GPU per rank: NCCL cannot put two ranks on one GPU)."""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ppg_procgen  # noqa: E402
import ppo_procgen  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--repeats", type=int, default=50, help="timed all-reduces per network (after 5 untimed)")
parser.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
options = parser.parse_args()
rank, world_size, device = ppo_procgen.setup_distributed(ppo_procgen.Args())
networks = {"PPO (ppo_procgen.py, vtrace.py)": ppo_procgen.Agent(ppo_procgen.Args(), 15),
            "PPG dual (ppg_procgen.py)": ppg_procgen.Agent(ppg_procgen.Args(), 15)}
results = []
for name, agent in networks.items():
    bucket = torch.cat([param.detach().flatten() for param in agent.parameters()]).to(device)
    times = []
    for repeat in range(5 + options.repeats):
        start = time.perf_counter()
        dist.all_reduce(bucket)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    results.append({"network": name, "parameters": bucket.numel(), "bytes": bucket.numel() * 4,
                    "all_reduce_ms_median": 1000 * statistics.median(times[5:]),
                    "all_reduce_ms_min": 1000 * min(times[5:]), "all_reduce_ms_max": 1000 * max(times[5:])})
    print(f"{name}: {bucket.numel():,} parameters = {bucket.numel() * 4 / 2**20:.2f} MiB per all-reduce; "
          f"{results[-1]['all_reduce_ms_median']:.2f} ms median ({results[-1]['all_reduce_ms_min']:.2f}-"
          f"{results[-1]['all_reduce_ms_max']:.2f}) over {options.repeats}, {world_size} ranks, "
          f"{dist.get_backend()} on {device.type}")
if options.out and rank == 0:
    with open(options.out, "w") as f:
        json.dump({"world_size": world_size, "backend": dist.get_backend(), "device": device.type,
                   "results": results}, f, indent=1)
dist.destroy_process_group()
