"""torchrun whose ranks are forked from it, for tests/test_distributed.py's SIGTERM-and-resume runs:
    python tests/torchrun_forked.py --standalone --nproc-per-node 2 SCRIPT.py [flags]
is `torchrun ... SCRIPT.py [flags]` (torch.distributed.run's own parser, configuration, elastic agent, signal handling
and exit status) except for how a rank starts: forked from this process, which runs SCRIPT as `__main__` with its
argv, instead of a new `python -u SCRIPT`. tests/forked_run.py forks this process from its server, which has imported
torch, torch._dynamo and the scripts: a launch then costs no interpreter start-ups (2-5 s of CPU each for the agent
and the ranks on a 2-core machine). The real command line, `python -m torch.distributed.run`, starts the ranks in
test_distributed.py's other two torchrun tests."""
import os
import runpy
import sys

import torch.distributed.run


def rank_main(script, *argv):
    """One rank: `python -u script *argv`, in the forked process that torchrun gave the rank's environment."""
    sys.stdout.reconfigure(line_buffering=True)  # each line as it is printed, as -u gives it
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` puts the script's folder first
    runpy.run_path(script, run_name="__main__")


def config_with_forked_ranks(args):
    """torchrun's configuration of the ranks, with rank_main as their entrypoint in place of `python -u SCRIPT`."""
    config, _, _ = config_from_args(args)
    return config, rank_main, [args.training_script, *args.training_script_args]


if __name__ == "__main__":
    config_from_args = torch.distributed.run.config_from_args
    torch.distributed.run.config_from_args = config_with_forked_ranks
    # torchrun starts a function's ranks with multiprocessing: forked, not spawned (a fresh interpreter)
    torch.distributed.run.main(["--start-method", "fork", *sys.argv[1:]])
