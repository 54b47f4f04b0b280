"""Nothing lost under kill -9 at any moment. Each Procgen script on CueEnv is killed with SIGKILL at
seeded moments of each kind (tests/fault_driver.py: the instant of a checkpoint's or metrics.jsonl's rename, inside a
rollout, a minibatch, PPG's auxiliary phase, IMPALA's iteration, the final evaluation, start-up) and resumed from its
checkpoint until the run ends; then it must equal the same run stopped cleanly at the same iterations, bit for bit
(PPG's resume points are the ends of its phases, and each of its auxiliary phases distils the whole buffer B).
Together the three campaigns have every moment; benchmarks/fault_campaign.py runs many more kills."""
import concurrent.futures
import glob
import importlib
import os
import signal

import pytest

import fault_driver as driver

# A few kills per script; each moment is in at least one campaign. PPG's auxiliary phase comes first: the first
# child's second phase (iteration 4) is then surely reached.
CAMPAIGNS = {"ppo_procgen": ["mid-rollout", "mid-rewrite", "final-eval"],
             "ppg_procgen": ["aux-phase", "mid-update", "mid-save"],
             "vtrace": ["start-up", "mid-iteration", "mid-save"]}
SEED = 1


def test_the_campaigns_have_every_moment():
    assert {moment for moments in CAMPAIGNS.values() for moment in moments} == set(driver.MOMENTS)
    for script, moments in CAMPAIGNS.items():
        assert all(script in driver.MOMENTS[moment][1] for moment in moments)


@pytest.fixture(scope="module")
def campaigns(tmp_path_factory):
    """Each script's kill chain and its clean reference, run once for the module (two at a time, on 2 cores)."""
    context = driver.forkserver()

    def campaign(script):
        faults = driver.seeded_faults(script, CAMPAIGNS[script], SEED)
        return driver.campaign(context, script, str(tmp_path_factory.mktemp(script)), faults)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(CAMPAIGNS, pool.map(campaign, CAMPAIGNS)))


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_every_kill_lands_and_leaves_a_loadable_checkpoint(campaigns, script):
    assert driver.kill_problems(campaigns[script]) == []
    assert len(campaigns[script]["records"]) == len(CAMPAIGNS[script]) + 1


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_leftover_temporary_files_are_removed_on_resume(campaigns, script):
    assert driver.leftover_problems(campaigns[script]) == []


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_no_row_of_a_checkpointed_iteration_is_lost_or_repeated(campaigns, script):
    assert driver.row_problems(campaigns[script]) == []


def test_every_ppg_auxiliary_phase_distils_the_whole_buffer(campaigns):
    """Killed inside an auxiliary phase and inside a policy phase, PPG resumed at the phase's start: every auxiliary
    phase's row says N_pi x num_envs rollouts, in the killed run and in its reference."""
    assert [record["resumed_from"] for record in campaigns["ppg_procgen"]["records"]] == [None, 2, 4, 6]
    assert driver.aux_problems(campaigns["ppg_procgen"]) == []


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_killed_and_resumed_equals_stopped_and_resumed_bit_for_bit(campaigns, script):
    assert len(campaigns[script]["codes"]) > 1  # it did resume
    assert driver.equality_problems(campaigns[script]) == []


# ---- A SIGTERM inside an iteration: honoured at the next rollout step or minibatch (PPO and PPG) ----
def tiny(module, **overrides):
    flags = dict(driver.FLAGS[module.__name__], eval_every=0, save_model=False, total_timesteps=96)
    return module.Args(**{**flags, **overrides})


def signal_at_call(monkeypatch, owner, name, at):
    """`owner.name`'s `at`-th call sends this process SIGTERM first; returns the list of calls."""
    function, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return function(*args, **kwargs)
    monkeypatch.setattr(owner, name, wrapped)
    return calls


@pytest.fixture(params=["ppo_procgen", "ppg_procgen"])
def script(request, cue_env):
    module = importlib.import_module(request.param)
    cue_env(module)
    return module


def test_a_signal_mid_rollout_stops_at_the_next_step(script, in_tmp, monkeypatch, capsys):
    """The first resume point is iteration 1 (PPO) or the end of the first phase (PPG, iteration N_pi = 2); the
    signal comes in the rollout of the iteration after it."""
    first = driver.FLAGS[script.__name__]["save_every"]  # the first resume point
    at = 1 + driver.occurrences(script.__name__, "mid-rollout") + 3  # the reset's frames, `first` rollouts, 3 steps
    calls = signal_at_call(monkeypatch, script.FramesToDevice, "__call__", at)
    with pytest.raises(SystemExit) as raised:
        script.train(tiny(script))
    assert raised.value.code == 128 + signal.SIGTERM
    assert len(calls) == at  # the step in progress ends; the next one does not start
    (run_dir,) = [os.path.join("runs", name) for name in os.listdir("runs")]
    assert f"interrupted by SIGTERM: saved iteration {first} to " in capsys.readouterr().out
    assert driver.load(os.path.join(run_dir, "checkpoint.pt"))["iteration"] == first
    assert [row["iteration"] for row in driver.training_rows(run_dir)] == list(range(1, first + 1))


def test_a_signal_mid_update_saves_the_last_resume_point_untouched(script, in_tmp, monkeypatch):
    """Stopped after the first minibatch past the first resume point (PPO: iteration 1; PPG: the end of its first
    phase), the checkpoint is that point's as a stop there saves it, bit for bit: the minibatch steps taken before the
    stop are not in it."""
    first = driver.FLAGS[script.__name__]["save_every"]
    with monkeypatch.context() as patch:  # the reference: a signal in that iteration's log line, saved at its end
        signal_at_call(patch, script, "log_iteration", first)
        with pytest.raises(SystemExit):
            script.train(tiny(script, exp_name="clean"))
    minibatches = driver.occurrences(script.__name__, "mid-update")  # those up to the first resume point
    calls = signal_at_call(monkeypatch, script, "policy_loss", minibatches + 1)  # the first one after it
    with pytest.raises(SystemExit) as raised:
        script.train(tiny(script, exp_name="stopped"))
    assert raised.value.code == 128 + signal.SIGTERM and len(calls) == minibatches + 1
    clean, stopped = (driver.load(glob.glob(f"runs/*__{name}__*/checkpoint.pt")[0]) for name in ("clean", "stopped"))
    assert clean["iteration"] == stopped["iteration"] == first
    assert driver.differences(clean, stopped) == []


def test_a_resume_removes_the_temporary_files_of_killed_writes(in_tmp):
    import ppo_procgen as ppo

    run_dir = in_tmp / "runs" / "run"
    os.makedirs(run_dir / "videos")
    leftovers = ["checkpoint.pt.tmp", "metrics.jsonl.tmp", "args.json.tmp", "videos/eval_00002.mp4.tmp"]
    for name in leftovers + ["videos/eval_00001.mp4"]:
        (run_dir / name).write_bytes(b"half")
    args = ppo.Args(resume=str(run_dir / "checkpoint.pt"))
    ppo.run_folder(args, {"run_name": "run", "iteration": 1}, rank=0)
    assert not any((run_dir / name).exists() for name in leftovers)
    assert os.listdir(run_dir / "videos") == ["eval_00001.mp4"]
