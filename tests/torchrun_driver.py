"""Runs a training script under torchrun for tests/test_distributed.py:
    python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_driver.py SCRIPT.py [flags]
(or tests/torchrun_forked.py in place of `python -m torch.distributed.run`: the same, with the ranks forked).
Test-only hooks, by environment variable: CUE_ENV=1 swaps Procgen for CueEnv (as the cue_env fixture does);
FAIL_RANK=r with FAIL_FUNCTION=name makes that rank's module function raise on its second call; WAIT_FOR_SIGNAL=1
makes each rank's first stop check after its first checkpoint wait (up to 120 s) for the test's signal, so that a
short run is always stopped mid-run, however fast or slow the machine. After training each rank writes a checksum of
its final weights to <run_dir>/weights_rank<r>.txt."""
import hashlib
import importlib
import os
import sys
import time

import torch
import tyro

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]
from exercises.cue_env import CueEnv  # noqa: E402 (not conftest's: a rank needs no pytest)

module = importlib.import_module(os.path.splitext(sys.argv[1])[0])
rank = int(os.environ["RANK"])
if os.environ.get("CUE_ENV"):
    module.ProcgenVecEnv = lambda num_envs, *args, **kwargs: CueEnv(num_envs)
if os.environ.get("FAIL_RANK") == str(rank):
    original, calls = getattr(module, os.environ["FAIL_FUNCTION"]), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(f"injected failure on rank {rank}")
        return original(*args, **kwargs)
    setattr(module, os.environ["FAIL_FUNCTION"], failing)
if os.environ.get("WAIT_FOR_SIGNAL"):
    check = module.StopOnSignal.check

    def check_once_signalled(self):
        if self.run.saved is not None and not getattr(self, "waited", False):
            self.waited = True
            deadline = time.time() + 120
            while self.signum is None and time.time() < deadline:
                time.sleep(0.05)  # the signal's handler runs during the sleep
        return check(self)
    module.StopOnSignal.check = check_once_signalled
agents, make_agent = [], module.Agent
module.Agent = lambda *args, **kwargs: agents.append(make_agent(*args, **kwargs)) or agents[-1]

run_dir = module.train(tyro.cli(module.Args, args=sys.argv[2:]))
weights = torch.cat([tensor.detach().flatten().cpu().float() for tensor in agents[0].state_dict().values()])
with open(os.path.join(run_dir, f"weights_rank{rank}.txt"), "w") as f:
    f.write(hashlib.sha256(weights.numpy().tobytes()).hexdigest())
