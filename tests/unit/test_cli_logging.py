"""What the ``intellect`` command does to Prefect before a flow runs: analytics off where the user
set nothing, and task runs' INFO records kept off the console (not off the API)."""

from __future__ import annotations

import logging

from prefect.logging.handlers import APILogHandler, PrefectConsoleHandler

from flows.cli import PREFECT_DEFAULTS, _not_task_run_info, prefect_defaults, quiet_task_runs


def _record(name: str, level: int) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, "Finished in state Completed()", None, None)


def test_analytics_are_off_unless_the_user_set_them():
    env: dict[str, str] = {}
    assert prefect_defaults(env) == PREFECT_DEFAULTS == env
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false" and env["DO_NOT_TRACK"] == "1"
    mine = {"PREFECT_SERVER_ANALYTICS_ENABLED": "true"}
    assert prefect_defaults(mine)["PREFECT_SERVER_ANALYTICS_ENABLED"] == "true"
    assert mine["DO_NOT_TRACK"] == "1"


def test_task_run_info_is_dropped_and_everything_else_kept():
    assert not _not_task_run_info(_record("prefect.task_runs", logging.INFO))
    assert not _not_task_run_info(_record("prefect.task_runs", logging.DEBUG))
    assert _not_task_run_info(_record("prefect.task_runs", logging.WARNING))
    assert _not_task_run_info(_record("prefect.task_runs", logging.ERROR))
    assert _not_task_run_info(_record("prefect.flow_runs", logging.INFO))  # the per-step lines
    assert _not_task_run_info(_record("prefect", logging.INFO))


def test_the_filter_sits_on_the_console_handlers_only():
    assert quiet_task_runs() >= 1
    assert quiet_task_runs() >= 1  # idempotent: one filter per handler
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    assert consoles and all(h.filters.count(_not_task_run_info) == 1 for h in consoles)
    assert not any(h.filter(_record("prefect.task_runs", logging.INFO)) for h in consoles)
    assert all(h.filter(_record("prefect.task_runs", logging.WARNING)) for h in consoles)
    # the dashboard's path: the task-run logger's own API handler, unfiltered
    api = [h for h in logging.getLogger("prefect.task_runs").handlers if isinstance(h, APILogHandler)]
    assert api and all(h.filter(_record("prefect.task_runs", logging.INFO)) for h in api)
