"""Reliability of the three Procgen scripts (their shared checkpoint and flag blocks): loading a file never runs code
from it; damaged, foreign and old checkpoints fail with one line naming the file; every numeric flag is range-checked
before anything is allocated (a table over each script's Args, so a new flag without a check fails here); SIGTERM
is tested end to end in test_ppo.py (a real signal on a real run, then --resume)."""
import dataclasses
import os
import typing

import numpy as np
import pytest
import torch

import ppg_procgen
import ppo_procgen
import vtrace

SCRIPTS = {"ppo_procgen.py": ppo_procgen, "ppg_procgen.py": ppg_procgen, "vtrace.py": vtrace}

# One bad value per numeric flag, with the words of the one-line error. Every numeric field of every script's Args
# must appear here (test_every_numeric_flag_is_in_the_table).
BAD_VALUES = {
    "seed": (-1, "must be >= 0"), "total_timesteps": (0, "must be > 0"), "num_levels": (-1, "must be >= 0"),
    "start_level": (-1, "must be >= 0"), "num_envs": (0, "must be > 0"), "env_threads": (-1, "must be >= 0"),
    "num_steps": (0, "must be > 0"), "learning_rate": (float("nan"), "must be finite"),
    "gamma": (1.5, "must be in [0, 1]"), "gae_lambda": (-0.1, "must be in [0, 1]"),
    "num_minibatches": (0, "must be > 0"), "update_epochs": (0, "must be > 0"), "clip_coef": (0.0, "must be > 0"),
    "ent_coef": (float("nan"), "must be finite"), "vf_coef": (-0.5, "must be >= 0"),
    "max_grad_norm": (-1.0, "must be > 0"), "target_kl": (float("inf"), "must be finite"),
    "adam_eps": (0.0, "must be > 0"), "reward_clip": (-10.0, "must be > 0"), "hidden_size": (0, "must be > 0"),
    "eval_every": (-1, "must be >= 0"), "eval_episodes": (0, "must be > 0"), "save_every": (0, "must be > 0"),
    "torch_threads": (-2, "must be >= 0"), "n_pi": (0, "must be > 0"), "e_pi": (0, "must be > 0"),
    "e_v": (0, "must be > 0"), "e_aux": (-1, "must be >= 0"), "beta_clone": (float("-inf"), "must be finite"),
    "num_aux_rollouts": (0, "must be > 0"), "n_aux_grad_accum": (0, "must be > 0"), "kl_beta": (-1.0, "must be >= 0"),
    "reward_norm_gamma": (1.5, "must be in [0, 1]"), "unroll_length": (0, "must be > 0"),
    "updates_per_iteration": (0, "must be > 0"), "max_policy_lag": (-1, "must be >= 0"),
    "rho_bar": (float("nan"), "must be finite"), "c_bar": (0.0, "must be > 0"), "pg_rho_bar": (-1.0, "must be > 0"),
    "vtrace_lambda": (1.5, "must be in [0, 1]"), "baseline_cost": (-0.5, "must be >= 0"),
    "entropy_cost": (float("inf"), "must be finite"),
}


def numeric_fields(module):
    hints = typing.get_type_hints(module.Args)
    optional_number = ({int, type(None)}, {float, type(None)})
    numeric = lambda hint: hint in (int, float) or set(typing.get_args(hint)) in optional_number  # noqa: E731
    return [field.name for field in dataclasses.fields(module.Args) if numeric(hints[field.name])]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_numeric_flag_is_in_the_table(script):
    assert set(numeric_fields(SCRIPTS[script])) <= set(BAD_VALUES)


@pytest.mark.parametrize("script,flag", [(script, flag) for script in SCRIPTS
                                         for flag in numeric_fields(SCRIPTS[script])])
def test_bad_numeric_flag_fails_with_one_line_naming_it(script, flag):
    module = SCRIPTS[script]
    value, words = BAD_VALUES[flag]
    with pytest.raises(SystemExit) as failure:
        module.check_args(module.Args(**{flag: value}))
    message = str(failure.value.code)
    assert message.startswith(f"error: --{flag.replace('_', '-')} ") and words in message and "\n" not in message


@pytest.mark.parametrize("script", SCRIPTS)
def test_infinite_grad_norm_means_no_clipping_and_is_accepted(script):
    SCRIPTS[script].check_args(SCRIPTS[script].Args(max_grad_norm=float("inf")))


class RunsCode:
    """A pickle that runs a shell command when it is unpickled: what a malicious shared checkpoint looks like."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def one_line_error(module, path):
    args = module.Args(resume=str(path))
    with pytest.raises(SystemExit) as failure:
        module.load_checkpoint(args)
    message = str(failure.value.code)
    assert message.startswith(f"error: {path}") and "\n" not in message, message
    return message


@pytest.mark.parametrize("script", SCRIPTS)
def test_malicious_checkpoint_is_refused_and_runs_nothing(script, tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "shared.pt"
    torch.save({"agent": RunsCode(marker), "args": {}, "iteration": 1, "ranks": []}, path)
    message = one_line_error(SCRIPTS[script], path)
    assert "refused to load" in message and "system" in message
    assert not marker.exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_damaged_foreign_and_old_checkpoints_fail_with_one_line(script, tmp_path, monkeypatch):
    module = SCRIPTS[script]
    monkeypatch.chdir(tmp_path)
    tiny = {ppo_procgen: dict(num_steps=8, num_minibatches=1, total_timesteps=16),
            ppg_procgen: dict(num_steps=8, num_minibatches=1, total_timesteps=16, n_pi=1),
            vtrace: dict(unroll_length=8, updates_per_iteration=1, total_timesteps=16)}[module]
    # One torch thread: these tiny convolutions gain nothing from two, and with other jobs on the cores a team of two
    # runs them many times slower.
    args = module.Args(env_id="bigfish", num_envs=2, channels=(4,), hidden_size=8, eval_episodes=1, save_model=True,
                       save_every=1, torch_threads=1, **tiny)
    run_dir = module.train(args)
    good = os.path.join(run_dir, "checkpoint.pt")
    checkpoint, _ = module.load_checkpoint(module.Args(resume=good))  # the real thing loads
    assert checkpoint["iteration"] == 1

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(open(good, "rb").read()[:2000])
    assert "is damaged or not a checkpoint" in one_line_error(module, truncated)
    foreign = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), foreign)
    assert "is not a checkpoint of" in one_line_error(module, foreign)
    old = tmp_path / "old.pt"  # the first version's format: numpy RNG state and numpy statistics inside
    torch.save({**checkpoint, "rng": {"numpy": np.random.get_state()}, "reward_rms": (np.zeros(()), np.ones(()), 1.0)},
               old)
    assert "refused to load" in one_line_error(module, old)
