"""The pytest route to the graders: `pytest exercises/ --script PATH [-m gae]` (--no-train: the cases only).
The topic markers are registered here too, so a starter folder outside the repository (no pytest.ini) runs
without unknown-marker warnings."""
MARKERS = {"gae": "exercise gae (compute_gae)", "ppo_loss": "exercise ppo_loss (policy_loss, value_loss)",
           "ppg_aux": "exercise ppg_aux (ppg_aux_loss, auxiliary_phase)",
           "vtrace": "exercise vtrace (from_importance_weights)",
           "rlhf": "exercise rlhf (per_token_rewards, bradley_terry_loss)",
           "grpo_rloo": "exercise grpo_rloo (group_relative_advantages, leave_one_out_advantages)"}


def pytest_addoption(parser):
    parser.addoption("--script", default=None,
                     help="the student's script to grade: only the exercises whose functions it holds run "
                          "(default: each exercise grades the script of its name next to exercises/)")
    parser.addoption("--no-train", action="store_true", default=False,
                     help="skip the learning curve (informational: it gives no points); only the cases")


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
