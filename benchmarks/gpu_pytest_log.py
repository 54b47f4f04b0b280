"""A pytest plugin for the GPU check's cuda-tests step (benchmarks/gpu_check.py): every test's
outcome as one JSON line in the file $GPU_CHECK_TEST_LOG, written when the test ends, so that a step
cut at its budget still reports the tests that ran (pytest's closing line and its --junitxml
report are written only when the whole run ends).

  GPU_CHECK_TEST_LOG=tests.jsonl PYTHONPATH=benchmarks python -m pytest -p gpu_pytest_log ...

Lines: {"collected": N} once the tests are collected; {"test": NODE_ID, "outcome": passed |
failed | skipped | error} per test; {"exit_status": N} when pytest finishes. Under pytest-xdist
only the controller writes. $GPU_CHECK_TESTS_FIRST (comma-separated test names) moves those tests
to the front of the run, after tests/conftest.py's order, in every process (xdist's workers send
their tests in the order they collected them).
"""
import json
import os

import pytest


class OutcomeLog:
    """Appends one line per event to `path`, flushed and synced at once (the step may be killed any
    time after)."""

    def __init__(self, path):
        self.path = path
        self.collected_written = False

    def write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_collected(self, count):
        if not self.collected_written:  # under xdist every worker reports the same collection
            self.collected_written = True
            self.write({"collected": count})

    def pytest_collection_finish(self, session):
        if session.items:  # the controller of xdist collects nothing itself
            self.write_collected(len(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.write_collected(len(ids))

    def pytest_runtest_logreport(self, report):
        """A test's outcome is decided by its call, or by a set-up that did not pass (a skip, an
        error), or by a tear-down that failed (an error on top of the call's outcome, as pytest
        counts it)."""
        if report.when == "call":
            outcome = report.outcome
        elif report.when == "setup" and report.skipped:
            outcome = "skipped"
        elif report.failed:
            outcome = "error"
        else:
            return
        self.write({"test": report.nodeid, "outcome": outcome})

    def pytest_sessionfinish(self, exitstatus):
        self.write({"exit_status": int(exitstatus)})


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The tests named in $GPU_CHECK_TESTS_FIRST first, each group in its order: a cut step has
    run them."""
    first = [name for name in os.environ.get("GPU_CHECK_TESTS_FIRST", "").split(",") if name]
    items.sort(key=lambda item: item.originalname not in first)  # stable


def pytest_configure(config):
    path = os.environ.get("GPU_CHECK_TEST_LOG")
    if path and not hasattr(config, "workerinput"):  # an xdist worker: its controller writes
        config.pluginmanager.register(OutcomeLog(path), "gpu_check_test_log")
