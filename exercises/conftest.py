"""The pytest route to the graders: `pytest exercises/ --script PATH -m gae` (--no-train: the checks only)."""


def pytest_addoption(parser):
    parser.addoption("--script", default=None,
                     help="the student's script to grade (default: the repository's script of each exercise)")
    parser.addoption("--no-train", action="store_true", default=False,
                     help="skip the learning check; only compare the functions with the references")
