"""Shared test helpers: the scripts live at the repo root; CueEnv is a tiny pixel task that a few thousand
steps of a working algorithm solve on a CPU, used by the learning tests of every Procgen script."""
import copy
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# One torch thread for the tests' own tensors (test_vtrace.py set it at import anyway): with other jobs on the 2
# cores a team of two runs tiny networks several times slower. A test's train() sets its own (--torch-threads).
torch.set_num_threads(1)

from exercises.cue_env import CueEnv  # noqa: E402 (one copy: the graders' learning check uses it too)


def cue_vec_env(num_envs, *args, **kwargs):
    """CueEnv in place of a script's ProcgenVecEnv(num_envs, ...)."""
    return CueEnv(num_envs)


@pytest.fixture
def cue_env(monkeypatch):
    """Replace a script's Procgen adapter by CueEnv, for training and evaluation alike."""
    def patch(module):
        monkeypatch.setattr(module, "ProcgenVecEnv", cue_vec_env)
    return patch


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a temporary directory, so runs/ lands there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cpu_has_bfloat16_instructions():
    """Whether the CPU computes bfloat16 itself: x86's AVX512-BF16 or AMX-BF16, as Linux lists them in
    /proc/cpuinfo (the CPUID bits that oneDNN reads). Without them torch emulates --amp's bfloat16 convolutions
    on the CPU, many times slower than float32. False where there is no such list (not Linux): no claim."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def train_in(workdir, module, args, cue_env=False):
    """`module.train` on a copy of `args` (it may fill some in: env_threads) with runs/ in `workdir` (on CueEnv if
    asked); torch's thread count restored afterwards (train() sets its own)."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        if cue_env:
            patch.setattr(module, "ProcgenVecEnv", cue_vec_env)
        patch.chdir(workdir)
        returned = module.train(copy.copy(args))
    torch.set_num_threads(threads)
    return returned


# ppo_rlhf_toy.py at tiny flags (about 30 s on the 2-core CPU): the RM beats chance and PPO raises the gold score.
RLHF_TINY = dict(corpus_size=3000, sft_steps=200, num_pairs=2500, rm_epochs=3, rm_lr=3e-3, ppo_iterations=20,
                 rollout_batch_size=64, eval_samples=256, bon_pool=16)


def shared_by_the_workers(tmp_path_factory, name, make):
    """A folder that `make(folder)` fills once per test run, however many pytest-xdist workers ask for it: the first
    fills it under a file lock in the test run's temporary directory, the others wait for it and read it (a
    session-scoped fixture is otherwise made once per worker, and these runs are most of a worker's time)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the test run's folder; each worker's own is below it
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that died while filling it
            folder.mkdir()
            make(folder)
            (folder / "done").write_text("")
    return folder


@pytest.fixture(scope="session")
def rlhf_tiny_run(tmp_path_factory):
    """One run of ppo_rlhf_toy.py at RLHF_TINY with --save-model, trained once per test run: test_rlhf.py's end
    to end test reads it, and test_exercises.py's full RLHF grade (the same flags) is given its summary."""
    import ppo_rlhf_toy

    args = ppo_rlhf_toy.Args(**RLHF_TINY, save_model=True)

    def make(folder):
        summary = train_in(folder, ppo_rlhf_toy, args)
        summary["histories"] = list(summary["histories"].items())  # JSON's keys are strings; these are betas
        (folder / "summary.json").write_text(json.dumps(summary))

    folder = shared_by_the_workers(tmp_path_factory, "rlhf_tiny", make)
    summary = json.loads((folder / "summary.json").read_text())
    summary["histories"] = {beta: history for beta, history in summary["histories"]}
    (run_dir,) = list((folder / "runs").iterdir())
    return types.SimpleNamespace(args=args, summary=summary, run_dir=run_dir)


# ppg_procgen.py on CueEnv at the flags of test_ppg.py's learning test, which the PPG grader's learning curve uses too
PPG_CUE = dict(env_id="coinrun", total_timesteps=6144, num_envs=16, num_steps=32, num_minibatches=4, channels=(8,),
               hidden_size=32, learning_rate=2e-3, eval_every=0, eval_episodes=16, torch_threads=1, n_pi=4, e_aux=2,
               save_every=4, arch="detach")


@pytest.fixture(scope="session")
def ppg_cue_run(tmp_path_factory):
    """One run of ppg_procgen.py on CueEnv at PPG_CUE, trained once per test run, for the tests that read it
    (test_exercises.py's full PPG grade is given it): its Args and its run directory's absolute path."""
    import ppg_procgen

    args = ppg_procgen.Args(**PPG_CUE)

    def make(folder):
        train_in(folder, ppg_procgen, args, cue_env=True)

    folder = shared_by_the_workers(tmp_path_factory, "ppg_cue", make)
    (run_dir,) = list((folder / "runs").iterdir())
    return types.SimpleNamespace(args=args, run_dir=str(run_dir))


# Topic markers for grading subsets (`pytest -m gae tests`; the markers are registered in pytest.ini), assigned by
# test file and name. Tests that need Procgen games, torchrun or a CUDA GPU are marked procgen / torchrun / cuda
# instead and kept out of the topic subsets. Names are fnmatch patterns of the test's name without its parameters.
TOPIC_TESTS = {
    "gae": {"test_ppo": ["test_gae_*", "test_ppo_learns_the_cue_task"],
            "test_ppg": ["test_without_aux_phase_the_training_loop_is_ppo"]},
    "ppo_loss": {"test_ppo": ["test_first_minibatch_has_ratio_one_and_no_clipping", "test_clipped_surrogate_*",
                              "test_kl_penalty_surrogate_*", "test_categorical_kl_*", "test_clipped_value_loss_*",
                              "test_beta_is_adapted_to_the_kl_after_the_update",
                              "test_official_kl_estimator_on_a_hand_made_example",
                              "test_paper_ppo_baseline_recipe_has_the_official_value_loss_scale",
                              "test_ppo_learns_the_cue_task"],
                 "test_ppg": ["test_value_only_epochs_leave_the_policy_network_alone"]},
    "ppg_aux": {"test_ppg": ["test_auxiliary_phase_*", "test_kl_is_zero_when_nothing_moves",
                             "test_gradient_accumulation_*", "test_value_loss_never_reaches_the_policy_network",
                             "test_each_network_is_clipped_on_its_own", "test_ppg_learns_the_cue_task",
                             "test_without_aux_epochs_there_is_no_buffer_and_no_pi_old"],
                "test_distributed": ["test_ppg_auxiliary_minibatch_is_global"]},
    "vtrace": {"test_vtrace": ["test_*"],
               "test_vtrace_learner": ["test_learner_feeds_vtrace_the_aligned_batch", "test_correction_none_*",
                                       "test_actor_learner_learns_the_cue_task_with_a_throttled_lag",
                                       "test_rho_bar_below_c_bar_warns"]},
    "rlhf": {"test_rlhf": ["test_bradley_terry_*", "test_response_mask_and_per_token_rewards_*",
                           "test_reward_whitening_keeps_the_mean_and_feeds_gae", "test_ppo_reaches_the_kl_*",
                           "test_huge_beta_keeps_the_policy_at_the_reference", "test_end_to_end_small"]},
    "grpo_rloo": {"test_rlhf": ["test_group_advantages_*", "test_the_kl_in_the_loss_is_grpos_k3_*",
                                "test_critic_free_estimators_*",
                                "test_each_estimator_samples_the_same_number_of_responses_k_per_prompt"]},
}
NEEDS = {
    "procgen": {"test_ppo": ["test_same_seed_same_run_on_cpu", "test_nonfinite_loss_saves_a_checkpoint_and_stops",
                             "test_end_to_end_*", "test_track_offline_*"],
                "test_procgen_backends": ["test_*"],
                "test_ppg": ["test_end_to_end_phase_checkpoint_resume"],
                "test_results": ["test_real_runs_*"],
                "test_docs": ["test_quoted_exit_statuses_and_messages_are_a_real_runs"],
                "test_vtrace_learner": ["test_end_to_end_interrupt_resume_and_eval_only"],
                "test_reliability": ["test_damaged_foreign_and_old_checkpoints_fail_with_one_line"],
                "test_preemption": ["test_a_batch_shell_that_forwards_sigterm_gets_the_checkpoint"],
                "test_speed": ["test_fast_path_gives_the_plain_path_losses", "test_benchmark_harness_*",
                               "test_cuda_fast_path_*", "test_no_amp_rollout_*"],
                "test_overlap": ["test_a_run_with_overlap_plays_the_same_episodes"],
                "test_gpu_check": ["test_benchmark_harness_*"],
                "test_distributed": ["test_torchrun_sigterm_and_resume_end_to_end", "test_a_rank_that_raises_*"]},
    "torchrun": {"test_distributed": ["test_two_ranks_*", "test_torchrun_sigterm_and_resume_end_to_end",
                                      "test_a_rank_that_raises_*"]},
    "cuda": {"test_speed": ["test_cuda_*"], "test_vtrace": ["test_cuda_*"],
             "test_vtrace_learner": ["test_actor_and_learner_on_cuda_streams", "test_cuda_*"]},
}


# The test files by their CPU time, longest first (docs/testing.md). pytest.ini's --no-loadscope-reorder makes the
# two workers take the files in this order, each the next one as it finishes, so that neither is left with a long
# file at the end while the other waits; the GPU check's module comes first, so that its dry run runs in the
# background of the whole suite. Files not named follow, in the usual order.
LONGEST_FIRST = ["test_gpu_check", "test_rlhf", "test_ppo", "test_vtrace_learner", "test_grader_sandbox",
                 "test_exercises", "test_gradescope", "test_ppg", "test_distributed", "test_evidence", "test_docs",
                 "test_results", "test_speed"]


def pytest_collection_modifyitems(config, items):
    import fnmatch

    def cost_rank(item):
        stem = os.path.splitext(os.path.basename(str(item.path)))[0]
        return LONGEST_FIRST.index(stem) if stem in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=cost_rank)  # stable: each file's tests keep their order

    def matches(table, stem, name):
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in table.get(stem, ()))

    tests_dir = os.path.join(ROOT, "tests")
    # Without either Procgen backend the tests that play real games are skipped with what to install; on CI, where
    # requirements.txt installed one, they never are.
    no_games = not any(importlib.util.find_spec(name) for name in ("procgen", "envpool")) and not os.environ.get("CI")
    skip_games = pytest.mark.skip(reason="plays Procgen games: `pip install -r requirements.txt` installs "
                                  "procgen-mirror or EnvPool for this platform")
    for item in items:
        if os.path.dirname(str(item.path)) != tests_dir:
            continue
        stem = os.path.splitext(os.path.basename(str(item.path)))[0]
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        needs = [need for need, table in NEEDS.items() if matches(table, stem, name)]
        if "[" in item.name and "cuda" in item.name.split("[", 1)[1].rstrip("]").split("-"):  # a cuda parameter
            needs.append("cuda")
        for need in dict.fromkeys(needs):
            item.add_marker(need)
        if "procgen" in needs and no_games:
            item.add_marker(skip_games)
        if needs:
            continue
        for topic, table in TOPIC_TESTS.items():
            if matches(table, stem, name):
                item.add_marker(topic)
