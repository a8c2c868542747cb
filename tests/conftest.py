"""Shared test setup: an isolated Prefect home, telemetry off, and the flow harness.

The environment is set at import time, before any test module imports
Prefect, so no test ever touches the user's ~/.prefect or phones home.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

from mfu_rows import mfu_above_one

# tests/ is on sys.path (rootdir conftest), so the WAN testbed fixtures load by module name; pytester
# runs the unit guard's own test (tests/unit/test_unit_guard.py)
pytest_plugins = ["wan_fixtures", "pytester"]
# helper modules under tests/ that hold test classes: their asserts report values as a test module's do
pytest.register_assert_rewrite("storage_contract")

_PREFECT_HOME = tempfile.mkdtemp(prefix="intellect-prefect-home-")
atexit.register(shutil.rmtree, _PREFECT_HOME, True)  # every session made one; none outlives it
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "120"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# A developer's shell may point at a real server; tests use their own.
os.environ.pop("PREFECT_API_URL", None)
for key in [k for k in os.environ if k.startswith("INTELLECT_")]:
    del os.environ[key]
# Under pytest-xdist (`make test` runs `-n 2`) each worker computes on its share of the cores: torch's
# default of one thread per core in every worker oversubscribes them, and its threads then spin-wait.
torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def _temporary_files_in_tmp_path(tmp_path, monkeypatch):
    """What a test or a docstring example makes with ``tempfile`` lands in the test's own folder, which
    pytest removes in time, never in /tmp for good."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny models gain nothing from more, and on a busy 2-core box
    they spin-wait for minutes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def prefect_harness():
    """A temporary Prefect server for tests that run flows (started once, on first use)."""
    # noqa below: lazy on purpose. conftest loads for every run; only flow tests pay for Prefect, and
    # Prefect must first see the environment set above (a top-level import would precede it).
    from prefect.testing.utilities import prefect_test_harness  # noqa: PLC0415 - see comment above

    with prefect_test_harness(server_startup_timeout=120):
        yield


def pytest_collection_modifyitems(items):  # pluggy passes only the hook arguments named here
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001 - pluggy passes only the hook arguments named here
    """No run the suite made may report MFU above 1 (issue: honest MFU): the metrics rows under the
    session's temporary folders (every xdist worker's included) are read once, by the controller."""
    if hasattr(session.config, "workerinput"):
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None) if factory is not None else None
    if base is None or not base.is_dir():
        return
    bad = mfu_above_one(base)
    if bad:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line("metrics rows with MFU above 1:\n  " + "\n  ".join(bad), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
