"""Nothing lost under kill -9 at any moment (issue 33). Each Procgen script on CueEnv is killed with SIGKILL at
seeded moments of each kind (tests/fault_driver.py: the instant of a checkpoint's or metrics.jsonl's rename, inside a
rollout, a minibatch, PPG's auxiliary phase, IMPALA's iteration, the final evaluation, start-up) and resumed from its
checkpoint until the run ends; then it must equal the same run stopped cleanly at the same iterations, bit for bit.
Together the three campaigns have every moment; benchmarks/fault_campaign.py runs many more kills."""
import concurrent.futures
import os

import pytest

import fault_driver as driver

# A few kills per script; each moment is in at least one campaign. PPG's auxiliary phase comes first: its first
# phase (iteration 2) is then surely reached.
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
        workdir = tmp_path_factory.mktemp(script)
        faults = driver.seeded_faults(script, CAMPAIGNS[script], SEED)
        run_dir, records = driver.chain(context, script, str(workdir / "killed"), faults)
        reference_dir, codes = driver.reference(context, script, str(workdir / "clean"), driver.resume_points(records))
        return dict(run_dir=run_dir, records=records, reference_dir=reference_dir, codes=codes)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(CAMPAIGNS, pool.map(campaign, CAMPAIGNS)))


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_every_kill_lands_and_leaves_a_loadable_checkpoint(campaigns, script):
    records = campaigns[script]["records"]
    assert [record["exit"] for record in records] == [-9] * len(CAMPAIGNS[script]) + [0], records
    saved = [record["saved"] for record in records]  # each one loaded (torch.load weights_only) in the chain
    first = next(index for index, iteration in enumerate(saved) if iteration is not None)
    assert None not in saved[first:] and saved[first:] == sorted(saved[first:]), records
    assert saved[-1] == driver.iterations(script)


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_leftover_temporary_files_are_removed_on_resume(campaigns, script):
    records = campaigns[script]["records"]
    for record, following in zip(records, records[1:]):
        if record["fault"][1] == "mid-save":  # killed between its complete .tmp and the rename
            assert "checkpoint.pt.tmp" in record["tmp_after"], record
        if record["fault"][1] == "mid-rewrite":  # killed as a resume rewrote the metrics
            assert "metrics.jsonl.tmp" in record["tmp_after"], record
        if record["tmp_after"] and following["resumed_from"] is not None:
            assert record["tmp_after"] == following["tmp_before"]
    assert records[-1]["tmp_after"] == []


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_no_row_of_a_checkpointed_iteration_is_lost_or_repeated(campaigns, script):
    rows = driver.training_rows(campaigns[script]["run_dir"])
    trained = [row["iteration"] for row in rows if "losses/policy_loss" in row]
    evaluated = [row["iteration"] for row in rows if "eval/episodic_return" in row]
    assert trained == evaluated == list(range(1, driver.iterations(script) + 1))


@pytest.mark.parametrize("script", CAMPAIGNS)
def test_killed_and_resumed_equals_stopped_and_resumed_bit_for_bit(campaigns, script):
    campaign = campaigns[script]
    assert campaign["codes"] == [128 + 15] * (len(campaign["codes"]) - 1) + [0]  # clean SIGTERM stops
    assert len(campaign["codes"]) > 1  # it did resume
    killed = driver.load(os.path.join(campaign["run_dir"], "checkpoint.pt"))
    clean = driver.load(os.path.join(campaign["reference_dir"], "checkpoint.pt"))
    assert driver.differences(killed, clean) == []
    assert driver.training_rows(campaign["run_dir"]) == driver.training_rows(campaign["reference_dir"])
