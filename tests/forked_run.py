"""A script's command line, `python SCRIPT FLAGS...`, run in a process of its own that is forked from a server which
has imported torch, torch._dynamo (the first torch.optim.Adam imports it), TensorBoard and the scripts: the server of
tests/fault_driver.py, one per pytest worker. A tiny run then starts in milliseconds instead of 3-4 s of imports,
which were most of its time.

In the child the script runs as `__main__` (runpy) with its own argv, working directory and environment, as the
interpreter would run it; stdout and stderr go to files, and the exit status is the interpreter's: SystemExit's code
(a message: printed, status 1), 1 and a traceback for any other exception, minus the signal that killed it. Signals
reach it as they would reach `python SCRIPT`. The interpreter's own start is the one thing not covered: the runs whose
command line is the point still start `python` (test_docs.py's runs of the commands the docs quote, two of
test_distributed.py's torchrun launches, the batch shell of test_preemption.py, the GPU check's dry run, the grader's
sandbox).

Used for the scripts' command lines in test_ppo.py, test_ppg.py, test_vtrace_learner.py, test_distributed.py (a
one-process resume of a two-rank checkpoint, and tests/torchrun_forked.py, torchrun with forked ranks) and
test_results.py (its real runs)."""
import atexit
import os
import runpy
import subprocess
import sys
import tempfile

import fault_driver


def script_main(script, argv, cwd, environment, stdout_path, stderr_path=None):
    """The child: `python script *argv` in `cwd` with `environment`, its output in the two files (stderr_path None:
    both in the first, as subprocess's stderr=STDOUT)."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        if path is None:
            os.dup2(1, 2)
            continue
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(script)  # as `python script` puts the script's folder first
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child skips them; the interpreter runs them at exit


class ForkedRun:
    """The running script, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, script, argv, cwd=None, env=None, stderr_to_stdout=False):
        self.output_folder = tempfile.mkdtemp(prefix="forked_run_")
        self.paths = [os.path.join(self.output_folder, "stdout")]
        if not stderr_to_stdout:
            self.paths.append(os.path.join(self.output_folder, "stderr"))
        environment = dict(os.environ if env is None else env)
        self.process = fault_driver.forkserver().Process(
            target=script_main, args=(script, list(argv), cwd or os.getcwd(), environment, *self.paths))
        self.process.start()
        self.pid = self.process.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and self.process.exitcode is not None:
            self.returncode = self.process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.paths, timeout)
        return self.returncode

    def send_signal(self, signal_number):
        if self.poll() is None:
            os.kill(self.pid, signal_number)

    def kill(self):
        self.process.kill()

    def communicate(self, timeout=None):
        """(stdout, stderr) once it ends (stderr None if it went to stdout); killed after `timeout` seconds, as
        subprocess.run does."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        texts = []
        for path in self.paths:
            with open(path, errors="replace") as f:
                texts.append(f.read())
            os.remove(path)
        os.rmdir(self.output_folder)
        if len(texts) == 1:
            texts.append(None)  # stderr went to stdout
        return tuple(texts)


def run(script, *argv, cwd=None, env=None, timeout=240):
    """`python script *argv` to its end: a subprocess.CompletedProcess with its text output."""
    forked = ForkedRun(script, argv, cwd, env)
    stdout, stderr = forked.communicate(timeout)
    return subprocess.CompletedProcess([script, *argv], forked.returncode, stdout, stderr)
