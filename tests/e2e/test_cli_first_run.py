"""A newcomer's first run of the ``intellect`` command, without a terminal: no traceback or error at
start, no line per task run on the console, and the task runs' logs still in the API."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect import flow, get_client, get_run_logger, task
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler
from prefect.runtime import flow_run

from flows.cli import quiet_task_runs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_a_first_cli_run_prints_no_error_and_no_task_run_lines(tmp_path):
    # as on a clean machine: a fresh Prefect home, no server, nothing set by the test suite's conftest
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DO_NOT_TRACK"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "flows.cli", "smoke", "--config", "configs/smoke.toml",
           f"storage.url=file://{tmp_path / 'runs'}", "train.steps=20", "train.batch_size=16", "train.eval_size=16",
           "pass_at_k_prompts=8", "pass_at_k_samples=2", "model.num_layers=1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=500)
    out = done.stdout
    assert done.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert "Traceback" not in out, out[-3000:]
    assert not [ln for ln in lines if "| ERROR" in ln or "| CRITICAL" in ln], out[-3000:]
    assert not [ln for ln in lines if "| INFO    | Task run" in ln], out[-3000:]
    assert [ln for ln in lines if "| INFO    | Flow run" in ln and "Beginning flow run" in ln]


@pytest.mark.usefixtures("prefect_harness")
def test_task_run_info_reaches_the_api_but_not_the_console(monkeypatch):
    assert quiet_task_runs() >= 1
    monkeypatch.setattr(logging.getLogger("prefect.task_runs"), "level", logging.INFO)  # the suite runs at WARNING
    monkeypatch.setattr(logging.getLogger("prefect.flow_runs"), "level", logging.INFO)
    shown: list[str] = []
    for h in logging.getLogger().handlers:
        if isinstance(h, PrefectConsoleHandler):
            monkeypatch.setattr(h, "emit", lambda record: shown.append(record.getMessage()))

    @task
    def noisy() -> None:
        get_run_logger().info("task info for the dashboard")
        get_run_logger().warning("task warning for everyone")

    @flow
    def quiet_flow() -> str:
        noisy()
        get_run_logger().info("one line per step")
        return flow_run.id

    run_id = quiet_flow()
    APILogHandler().flush()
    assert "one line per step" in shown and "task warning for everyone" in shown
    assert "task info for the dashboard" not in shown
    want = {"task info for the dashboard", "task warning for everyone", "one line per step"}
    # the server stores a flushed batch of logs asynchronously: read until it has them, within a bound
    deadline, stored = time.monotonic() + 30, set()
    while not want <= stored and time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        stored = {log.message for log in logs}
        if not want <= stored:
            time.sleep(0.5)
    assert want <= stored
