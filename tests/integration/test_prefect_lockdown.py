"""Prefect locked down: the local cluster's API answers only requests that carry its auth string, and a
flow run's job variables cannot replace the command a process worker starts.

The API test runs a real ``prefect server`` and process workers (``infra/cluster.py``) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
from prefect import Flow, flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import PrefectHTTPStatusError
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
from prefect.utilities.processutils import command_to_string, get_sys_executable
from prefect.utilities.schema_tools import ValidationError, validate
from prefect.workers.process import ProcessJobConfiguration

from infra import cluster
from intellect.diloco.coordinator import free_port

POOL_FILES = sorted(cluster.POOLS_DIR.glob("*.json"))
MARKED_FLOW = '''from pathlib import Path

from prefect import flow


@flow(name="marked")
def marked(path: str) -> None:
    Path(path).write_text("ran")
'''


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _engine_command() -> str:
    return command_to_string([get_sys_executable(), "-m", "prefect.engine"])


def test_the_auth_string_is_made_once_private_and_reused(tmp_path):
    state = tmp_path / "cluster"
    secret = cluster.auth_string(state)
    assert _mode(state / cluster.AUTH_FILE) == 0o600
    assert secret.startswith("intellect:") and len(secret) >= 40
    assert cluster.auth_string(state) == secret  # reused, so workers started later still match
    assert cluster.auth_string(tmp_path / "other") != secret
    env = cluster.cluster_env(state, 4200)
    assert env["PREFECT_API_AUTH_STRING"] == secret
    assert "PREFECT_SERVER_API_AUTH_STRING" not in env  # clients, workers and flow runs never get the server's
    assert cluster.server_env(env)["PREFECT_SERVER_API_AUTH_STRING"] == secret
    (state / cluster.AUTH_FILE).chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        cluster.auth_string(state)


# Resolving a template asks the API: the session's test server answers, where without it each worker
# process would start an ephemeral Prefect server of its own.
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("path", POOL_FILES, ids=[p.stem for p in POOL_FILES])
def test_a_pool_template_has_no_command_for_job_variables_to_replace(path, tmp_path):
    """The server refuses a ``command`` job variable (the schema allows no unknown variable), and
    Prefect's own template machinery, given one anyway, still starts the flow-run engine."""
    template = json.loads(path.read_text())
    assert "command" not in template["job_configuration"]
    assert "command" not in template["variables"]["properties"]
    hostile = {"command": f"touch {tmp_path / 'hijacked'}", "env": {"PYTHONUNBUFFERED": "1"}}
    with pytest.raises(ValidationError, match="command"):
        validate(hostile, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True)
    validate({"env": {"CUDA_VISIBLE_DEVICES": "1"}}, template["variables"], raise_on_error=True, preprocess=True,
             ignore_required=True)  # what deployments do set still passes
    config = asyncio.run(ProcessJobConfiguration.from_template_and_values(template, hostile))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="lockdown"))
    assert config.command == _engine_command()


def _deploy(job: Path, name: str, pool: str) -> None:
    marked = flow.from_source(source=str(job), entrypoint="marked.py:marked")
    assert isinstance(marked, Flow)  # from_source's result: called outside an event loop, it ran here
    marked.deploy(name=name, work_pool_name=pool, print_next_steps=False, ignore_warnings=True)


@pytest.mark.slow
def test_the_cluster_api_demands_its_auth_string_and_runs_no_job_variable_command(tmp_path):
    state = tmp_path / "cluster"
    env = cluster.up(state, free_port(), pools=("cpu",))
    try:
        api, secret = env["PREFECT_API_URL"], env["PREFECT_API_AUTH_STRING"]
        assert _mode(state) == 0o700 and _mode(state / "env") == 0o600 and _mode(state / cluster.AUTH_FILE) == 0o600
        assert f"PREFECT_API_AUTH_STRING={secret}" in (state / "env").read_text()  # `source .cluster/env`
        user, _, password = secret.partition(":")
        with httpx.Client(timeout=10) as h:
            assert h.post(f"{api}/flows/filter", json={}).status_code == 401
            assert h.post(f"{api}/flows/filter", json={}, auth=(user, "not-the-secret")).status_code == 401
            assert h.post(f"{api}/work_pools/", json={"name": "mine", "type": "process"}).status_code == 401
            assert h.get(f"{api}/work_pools/cpu").status_code == 401
            assert h.post(f"{api}/flows/filter", json={}, auth=(user, password)).status_code == 200
            assert h.get(f"{api}/work_pools/cpu", auth=(user, password)).json()["name"] == "cpu"
            assert h.get(f"{api}/health").status_code == 200  # Prefect leaves GET /health open for probes
        # a Prefect client without the string is refused as well
        with temporary_settings({PREFECT_API_URL: api}, restore_defaults={PREFECT_API_AUTH_STRING}), \
                get_client(sync_client=True) as client:
            with pytest.raises(PrefectHTTPStatusError) as refused:
                client.read_work_pools()
            assert refused.value.response.status_code == 401

        job = tmp_path / "job"
        job.mkdir()
        (job / "marked.py").write_text(MARKED_FLOW)
        ran, hijacked = tmp_path / "ran", tmp_path / "hijacked"
        hostile = {"command": f"touch {hijacked}"}
        template = json.loads((cluster.POOLS_DIR / "cpu.json").read_text())
        relaxed = {**template, "variables": {k: v for k, v in template["variables"].items()
                                             if k != "additionalProperties"}}
        with cluster.api_settings(env):
            # the same job configuration under a schema that lets `command` through to the worker
            with get_client(sync_client=True) as client:
                client.create_work_pool(WorkPoolCreate(name="relaxed", type="process", base_job_template=relaxed))
            cluster.start_worker(state, env, "relaxed", 1)
            _deploy(job, "on-cpu", "cpu")
            _deploy(job, "on-relaxed", "relaxed")
            # the project's pool: the API refuses the variable, with its reason
            with pytest.raises(PrefectHTTPStatusError) as refused:
                run_deployment("marked/on-cpu", parameters={"path": str(ran)}, job_variables=hostile, timeout=0)
            assert refused.value.response.status_code == 422 and "command" in refused.value.response.text
            # the variable reaches a worker: it starts the flow-run engine, not the command
            run = run_deployment("marked/on-relaxed", parameters={"path": str(ran)}, job_variables=hostile,
                                 timeout=300, poll_interval=1)
        assert isinstance(run, FlowRun)  # run_deployment's result: called outside an event loop, it ran here
        assert run.job_variables == hostile
        log = (state / "logs" / "worker-relaxed.log").read_text()
        assert run.state.is_completed(), (run.state, log[-3000:])
        assert ran.read_text() == "ran"
        assert not hijacked.exists()
    finally:
        cluster.down(state)
    assert cluster.running(state) == {}
