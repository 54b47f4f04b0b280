"""Nothing lost in sweeps, full disks and preemptions, on ppo_procgen.py's shared plumbing blocks: run
directories are never shared, a failed checkpoint or metrics write costs one line and nothing else, an unwritable
runs/ fails before anything heavy, and a second signal stops at once with one line."""
import dataclasses
import errno
import json
import os
import signal
import threading
import time
import types

import pytest
import torch
from conftest import ROOT

import ppo_procgen as ppo


def tiny_args(**overrides):
    base = dict(env_id="coinrun", total_timesteps=96, num_envs=4, num_steps=8, num_minibatches=1, update_epochs=1,
                channels=(4,), hidden_size=16, eval_every=0, eval_episodes=2, torch_threads=1)
    return ppo.Args(**{**base, **overrides})


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_runs_started_in_one_second_with_one_name_get_their_own_directories(cue_env, in_tmp, monkeypatch):
    """A sweep over --learning-rate with the same seed and name, both runs in the same second: two directories,
    each with its own flags and only its own rows."""
    cue_env(ppo)
    clock = [1_700_000_000.0]

    def frozen_second():  # the same whole second for both runs, yet time moves on within it
        clock[0] += 1e-4
        return clock[0]
    monkeypatch.setattr(ppo, "time", types.SimpleNamespace(time=frozen_second, perf_counter=time.perf_counter))
    first = ppo.train(tiny_args(learning_rate=1e-3))
    second = ppo.train(tiny_args(learning_rate=2e-3))
    assert second != first and os.path.dirname(first) == os.path.dirname(second) == "runs"
    assert os.path.basename(first).startswith("coinrun__ppo_procgen__1__1700000000_")
    for run_dir, learning_rate in [(first, 1e-3), (second, 2e-3)]:
        with open(os.path.join(run_dir, "args.json")) as f:
            assert json.load(f)["learning_rate"] == learning_rate
        assert [row["iteration"] for row in rows(run_dir) if "losses/policy_loss" in row] == [1, 2, 3]


def test_racing_runs_never_take_the_same_directory(in_tmp, monkeypatch):
    """Eight runs of one name in one second, started together: eight folders (a clash would raise)."""
    monkeypatch.setattr(ppo, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.0))
    names = []
    threads = [threading.Thread(target=lambda: names.append(ppo.run_folder(tiny_args(), None, rank=0)[1]))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(names)) == 8 and sorted(os.listdir("runs")) == sorted(os.path.basename(name) for name in names)


@pytest.mark.parametrize("how", ["runs is a file", "read-only"])
def test_unwritable_runs_parent_fails_with_one_line_before_anything_heavy(how, in_tmp, monkeypatch):
    if how == "runs is a file":
        open("runs", "w").close()
    else:
        def read_only(path, mode=0o777):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        monkeypatch.setattr(os, "mkdir", read_only)
    monkeypatch.setattr(ppo, "make_env", lambda *args: pytest.fail("games made before the check"))
    monkeypatch.setattr(ppo, "Agent", lambda *args, **kwargs: pytest.fail("network built before the check"))
    with pytest.raises(SystemExit, match="^error: cannot create the run directory runs/coinrun__") as raised:
        ppo.train(tiny_args())
    assert len(str(raised.value).splitlines()) == 1


def full_disk_after(monkeypatch, failing_saves):
    """The disk fills up while a checkpoint's .tmp file is written, at the `failing_saves`-th saves (1-based): half
    of it is on the disk, then the write fails with ENOSPC (reported at the latest by fsync)."""
    real_fsync = os.fsync
    calls = [0]

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".pt.tmp"):
            calls[0] += 1
            if calls[0] in failing_saves:
                os.ftruncate(fd, os.fstat(fd).st_size // 2)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_costs_one_line_and_the_run_goes_on(cue_env, in_tmp, monkeypatch, capsys):
    cue_env(ppo)
    full_disk_after(monkeypatch, failing_saves={2})
    run_dir = ppo.train(tiny_args(save_model=True, save_every=1))
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line]
    path = os.path.join(run_dir, "checkpoint.pt")
    assert warning.startswith(f"warning: could not write {path}: No space left on device (it needs ")
    assert "MiB free); the previous checkpoint is kept" in warning
    assert os.listdir(run_dir).count("checkpoint.pt.tmp") == 0
    assert torch.load(path, weights_only=True)["iteration"] == 3  # retried at the next save
    assert [row["iteration"] for row in rows(run_dir) if "losses/policy_loss" in row] == [1, 2, 3]


def test_a_failed_final_checkpoint_fails_the_run_and_keeps_the_previous_one(cue_env, in_tmp, monkeypatch, capsys):
    cue_env(ppo)
    full_disk_after(monkeypatch, failing_saves={2, 3})
    with pytest.raises(SystemExit, match="^error: the final checkpoint could not be written .* the last checkpoint "
                                         "is iteration 1 in runs/.*/checkpoint.pt") as raised:
        ppo.train(tiny_args(save_model=True, save_every=1))
    assert len(str(raised.value).splitlines()) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 2  # one line per failed save
    (run_dir,) = [os.path.join("runs", name) for name in os.listdir("runs")]
    assert "checkpoint.pt.tmp" not in os.listdir(run_dir)
    assert torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["iteration"] == 1  # intact


def test_a_failed_metrics_write_leaves_no_half_row(in_tmp, capsys):
    logger = ppo.Logger(tiny_args(), "run", "runs/run")
    logger.log({"global_step": 1, "iteration": 1})

    class FullDisk:  # writes half of what it is given, then the disk is full
        def __init__(self, file):
            self.file, self.name = file, file.name

        def seek(self, *args):
            return self.file.seek(*args)

        def truncate(self, length):
            return self.file.truncate(length)

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_file = logger.file
    logger.file = FullDisk(real_file)
    logger.log({"global_step": 2, "iteration": 2})
    logger.file = real_file
    logger.log({"global_step": 3, "iteration": 3})
    logger.close()
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert "could not write a row to runs/run/metrics.jsonl (No space left on device)" in warning
    assert [row["iteration"] for row in rows("runs/run")] == [1, 3]


def test_a_second_signal_stops_at_once_with_one_line(cue_env, in_tmp, monkeypatch, capsys):
    """The first SIGTERM asks for a stop at the iteration's end; a second one more than 2 s later (within that
    iteration) stops at once: exit 143 and one line naming the last checkpoint, no KeyboardInterrupt traceback."""
    cue_env(ppo)
    real_gae = ppo.compute_gae
    calls = [0]

    def gae_then_signals(*args):
        calls[0] += 1
        if calls[0] == 2:  # in iteration 2, after iteration 1's checkpoint
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2.2)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_gae(*args)
    monkeypatch.setattr(ppo, "compute_gae", gae_then_signals)
    with pytest.raises(SystemExit) as raised:
        ppo.train(tiny_args(save_model=True, save_every=1))
    assert raised.value.code == 128 + signal.SIGTERM
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("stopped at once by a second SIGTERM: the last checkpoint is iteration 1 in runs/")
    assert last.endswith("checkpoint.pt (continue with --resume)")


def test_the_resumed_directory_is_the_checkpoints_own(cue_env, in_tmp):
    cue_env(ppo)
    run_dir = ppo.train(tiny_args(save_model=True, save_every=1, total_timesteps=64))
    args = dataclasses.replace(tiny_args(), resume=os.path.join(run_dir, "checkpoint.pt"))
    assert os.path.samefile(ppo.train(args), run_dir)
    assert os.listdir("runs") == [os.path.basename(run_dir)]


def test_a_nonfinite_stop_before_any_checkpoint_says_so(in_tmp, monkeypatch):
    monkeypatch.setattr(ppo, "compute_gae", lambda rewards, *args: torch.full_like(rewards, float("nan")))
    with pytest.raises(SystemExit, match="^error: non-finite .*; no checkpoint of this run was saved \\(a lower "
                                         "--learning-rate may avoid it\\)$"):
        ppo.train(tiny_args(env_id="bigfish", total_timesteps=32, save_model=True))
    (run_dir,) = os.listdir("runs")
    assert not [name for name in os.listdir(os.path.join("runs", run_dir)) if name.startswith("checkpoint")]


def test_a_batch_shell_that_forwards_sigterm_gets_the_checkpoint(tmp_path):
    """docs/scale-out.md's SLURM recipe for a shell that stays around the job: `trap` forwards the batch shell's
    SIGTERM to Python, which saves and exits 143, and the shell returns that status. A real signal, real games."""
    script = tmp_path / "job.sh"
    script.write_text(
        f"python {os.path.join(ppo.__file__)} --env-id coinrun --num-envs 2 --num-steps 16 --num-minibatches 2 "
        "--update-epochs 1 --channels 4 --hidden-size 16 --eval-every 0 --total-timesteps 1000000 --save-model "
        "--save-every 1000 --torch-threads 1 &\n"
        'child=$!\ntrap \'kill -TERM "$child"\' TERM\nwait "$child"\nwait "$child"\n')
    import subprocess
    import sys
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONUNBUFFERED": "1"}
    shell = subprocess.Popen(["bash", str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, start_new_session=True)
    lines = []
    try:
        for line in shell.stdout:
            lines.append(line)
            if line.startswith("iter 3/"):
                break
        shell.send_signal(signal.SIGTERM)  # to the shell only, as `#SBATCH --signal=B:TERM` does
        rest, _ = shell.communicate(timeout=60)
    finally:  # without the trap Python never hears of it: end the whole job
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    assert shell.returncode == 143, "".join(lines) + rest
    assert "interrupted by SIGTERM: saved iteration" in rest
    (checkpoint,) = list((tmp_path / "runs").glob("*/checkpoint.pt"))
    assert torch.load(checkpoint, weights_only=True)["iteration"] >= 3


# ---- A signal in the first seconds: one line, exit 128 + signal, no empty run folder ----
def script_module(name):
    if name == "ppo_procgen.py":
        return ppo
    import importlib
    return importlib.import_module(name[: -len(".py")])


def startup_args(module, **overrides):
    """Flags that pass every script's checks and make a run small: the run never reaches its loop."""
    small = dict(env_id="coinrun", num_envs=4, num_steps=8, num_minibatches=1, update_epochs=1, unroll_length=8,
                 n_pi=1, channels=(4,), hidden_size=16, eval_every=0, eval_episodes=2, torch_threads=1,
                 total_timesteps=1024, **overrides)
    return module.Args(**{key: value for key, value in small.items() if key in module.Args.__dataclass_fields__})


@pytest.fixture
def guarded_handlers():
    """SIGINT and SIGTERM handlers of the test's own in place of pytest's (and SIGTERM's default, which would end
    pytest): a signal that no script's handler takes fails the test; they must be back after the run."""
    def not_taken(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the handler from before the run")
    previous = {signum: signal.signal(signum, not_taken) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield not_taken
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def signal_during(module, moment, signum, monkeypatch):
    """Send `signum` to this process while the run makes its log (a signal held until the folder and the log are
    whole), its games or its network."""
    def send():
        os.kill(os.getpid(), signum)
    if moment == "log":
        class SignalledLogger(module.Logger):
            def __init__(self, *args, **kwargs):
                send()
                super().__init__(*args, **kwargs)
        monkeypatch.setattr(module, "Logger", SignalledLogger)
    else:
        name = {"games": "make_env", "network": "Agent"}[moment]
        real = getattr(module, name)

        def signalled(*args, **kwargs):
            send()
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, signalled)


@pytest.mark.parametrize("moment, signum", [("log", signal.SIGTERM), ("games", signal.SIGINT),
                                            ("network", signal.SIGTERM)])
@pytest.mark.parametrize("script", ["ppo_procgen.py", "vtrace.py", "ppg_procgen.py"])
def test_a_signal_during_startup_ends_with_the_documented_line_and_no_folder(
        script, moment, signum, cue_env, in_tmp, monkeypatch, capsys, guarded_handlers):
    """Before the training loop there is nothing to save: the run ends at once with docs/reliability.md's line and
    exit 128 + signal, removes its new folder (flags and empty logs), and gives the handlers back."""
    module = script_module(script)
    cue_env(module)
    signal_during(module, moment, signum, monkeypatch)
    with pytest.raises(SystemExit) as raised:
        module.train(startup_args(module))
    assert raised.value.code == 128 + signum
    name = signal.Signals(signum).name
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"interrupted by {name}: nothing new to save; no checkpoint of this run was saved"
    assert os.listdir("runs") == []
    assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM) is guarded_handlers
    assert signum not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_signal_before_the_first_whole_iteration_leaves_no_folder(cue_env, in_tmp, monkeypatch, capsys,
                                                                   guarded_handlers):
    """In the loop, before any row: the step in flight is dropped, nothing is saved, and the folder goes too."""
    cue_env(ppo)
    real_gae = ppo.compute_gae

    def gae_then_signal(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return real_gae(*args)
    monkeypatch.setattr(ppo, "compute_gae", gae_then_signal)
    with pytest.raises(SystemExit) as raised:
        ppo.train(tiny_args(save_model=True))
    assert raised.value.code == 130
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "interrupted by SIGINT: nothing new to save; no checkpoint of this run was saved"
    assert os.listdir("runs") == []


def test_a_signal_while_a_resumed_run_starts_keeps_its_folder(cue_env, in_tmp, monkeypatch, capsys,
                                                             guarded_handlers):
    cue_env(ppo)
    run_dir = ppo.train(tiny_args(save_model=True, save_every=1))
    checkpoint, rows_before = os.path.join(run_dir, "checkpoint.pt"), rows(run_dir)
    signal_during(ppo, "games", signal.SIGTERM, monkeypatch)
    with pytest.raises(SystemExit) as raised:
        ppo.train(dataclasses.replace(tiny_args(), resume=checkpoint))
    assert raised.value.code == 143
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f"interrupted by SIGTERM: nothing new to save; the last checkpoint is iteration 3 in "
                    f"{checkpoint} (continue with --resume)")
    assert "checkpoint.pt" in os.listdir(run_dir) and rows(run_dir) == rows_before


@pytest.mark.parametrize("script, first_library", [("ppo_procgen.py", "gymnasium"), ("vtrace.py", "gymnasium"),
                                                   ("ppg_procgen.py", "gymnasium"), ("ppo_rlhf_toy.py", "numpy")])
def test_ctrl_c_while_the_libraries_load_prints_no_traceback(script, first_library, tmp_path):
    """A Ctrl-C in the seconds that `python SCRIPT` spends importing torch: the process ends, status 128 + 2 in a
    shell, without a traceback (the interpreter starts afresh: a forked child has torch loaded already)."""
    import subprocess
    import sys
    sigint_on_import = (
        "import importlib.abc, os, runpy, signal, sys\n"
        "class Interrupt(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name == {first_library!r}:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        f"sys.argv = [{os.path.join(ROOT, script)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", sigint_on_import], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == -signal.SIGINT and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


def test_rlhf_toy_signal_while_the_run_starts_leaves_no_folder(in_tmp, monkeypatch, capsys, guarded_handlers):
    """The RLHF toy holds a signal from its folder to its StopOnSignal: the first safe point stops the run, which
    kept nothing, so its folder goes."""
    import ppo_rlhf_toy as M

    class SignalledLogger(M.Logger):
        def __init__(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(M, "Logger", SignalledLogger)
    with pytest.raises(SystemExit) as raised:
        M.train(M.Args(d_model=16, n_heads=2, n_layers=1, corpus_size=64, threads=1))
    assert raised.value.code == 143
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("SIGTERM: stopped during SFT; nothing kept (no record yet), runs/rlhf_sentiment__")
    assert os.listdir("runs") == []
    assert signal.getsignal(signal.SIGTERM) is guarded_handlers
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
