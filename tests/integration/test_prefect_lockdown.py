"""Prefect locked down: the local cluster's API answers only requests that carry its auth string, and a
flow run's job variables can neither replace the command a process worker starts nor put any
environment variable but the pools' allowlist (``infra/pool_worker.py``) into the flow run's process.

The API test runs a real ``prefect server`` and the pools' workers (``infra/cluster.py``) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import httpx
import pytest
from prefect import Flow, flow
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import FlowRun, State
from prefect.deployments import run_deployment
from prefect.exceptions import PrefectHTTPStatusError
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
from prefect.utilities.processutils import command_to_string, get_sys_executable
from prefect.workers.process import ProcessJobConfiguration

from infra import cluster
from infra.pool_worker import check_job_variables, pool_template
from intellect.diloco.coordinator import PEER_KEY_ENV, free_port, worker_credentials
from intellect.trust.mac import new_secret

MARKED_FLOW = '''import os
from pathlib import Path

from prefect import flow


@flow(name="marked")
def marked(path: str) -> None:
    Path(path).write_text(os.environ.get("PYTHONUNBUFFERED", "unset"))
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


def _payload(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose ``sitecustomize.py`` any interpreter with it on ``PYTHONPATH`` runs at startup,
    and the file that run writes."""
    evil, marker = tmp_path / "evil", tmp_path / "pwned"
    evil.mkdir()
    (evil / "sitecustomize.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('pwned')\n")
    return evil, marker


# Resolving a template asks the API: the session's test server answers, where without it each worker
# process would start an ephemeral Prefect server of its own.
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("pool", cluster.POOLS)
def test_a_pool_template_takes_no_command_and_only_allowlisted_env(pool, tmp_path):
    """The schema refuses ``command``, ``working_dir`` and any environment variable off the allowlist
    (or with a value it does not allow) and takes what the project's deployments set; Prefect's own
    rendering applies no ``command`` but passes ``env`` through, hence the worker's own check."""
    template = pool_template(pool)
    assert sorted(p.stem for p in cluster.POOLS_DIR.glob("*.json")) == sorted(cluster.POOLS)
    for name in ("command", "working_dir"):
        assert name not in template["job_configuration"] and name not in template["variables"]["properties"]
    evil, _ = _payload(tmp_path)
    check_job_variables(template, {"env": template["variables"]["properties"]["env"]["default"]}, "pool")
    check_job_variables(template, {"env": {**worker_credentials(new_secret(), "run", "w0"),
                                           "PYTHONUNBUFFERED": "1"}}, "flow run")
    # CUDA_VISIBLE_DEVICES is the GPU pools' device lease's alone (tests/integration/test_pool_devices.py)
    for hostile in ({"command": "touch pwned"}, {"working_dir": str(evil)}, {"env": {"PYTHONPATH": str(evil)}},
                    {"env": {"LD_PRELOAD": str(evil / "x.so")}}, {"env": {"PYTHONWARNINGS": "ignore::evil.W"}},
                    {"env": {"PREFECT_API_URL": "http://evil/api"}}, {"env.PYTHONPATH": str(evil)},
                    {"env": {"CUDA_VISIBLE_DEVICES": "0"}}, {"env": {PEER_KEY_ENV: "not hex"}},
                    {"env": {PEER_KEY_ENV: "00" * 16 + " $(touch pwned)"}}):
        with pytest.raises(ValueError, match="refused by this worker's pool template"):
            check_job_variables(template, hostile, "flow run")
    values = {"command": "touch pwned", "env": {"PYTHONPATH": str(evil)}}
    config = asyncio.run(ProcessJobConfiguration.from_template_and_values(template, values))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="lockdown"))
    assert config.command == _engine_command() and config.env["PYTHONPATH"] == str(evil)


def _deploy(job: Path, name: str, pool: str) -> None:
    marked = flow.from_source(source=str(job), entrypoint="marked.py:marked")
    assert isinstance(marked, Flow)  # from_source's result: called outside an event loop, it ran here
    marked.deploy(name=name, work_pool_name=pool, print_next_steps=False, ignore_warnings=True)


def _post_run(client: SyncPrefectClient, deployment: Any, path: Path, job_variables: dict | None) -> UUID:
    """A scheduled flow run of ``deployment`` made with ``POST /flow_runs/``, which stores its job
    variables unchecked; its id."""
    body = {"flow_id": str(deployment.flow_id), "deployment_id": str(deployment.id), "work_pool_name": "cpu",
            "parameters": {"path": str(path)}, "state": {"type": "SCHEDULED"}, "job_variables": job_variables,
            "idempotency_key": uuid4().hex}  # the client retries a 503 of a busy database
    return UUID(client.request("POST", "/flow_runs/", json=body).json()["id"])


def _final(client: SyncPrefectClient, run_id: UUID, timeout: float = 300.0) -> State:
    deadline = time.monotonic() + timeout
    while not (state := client.read_flow_run(run_id).state) or not state.is_final():
        assert time.monotonic() < deadline, state
        time.sleep(1)
    return state


@pytest.mark.slow
def test_the_cluster_api_demands_its_auth_string_and_runs_no_foreign_job_variable(tmp_path):
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
        evil, marker = _payload(tmp_path)
        subprocess.run([sys.executable, "-c", "pass"], env={**os.environ, "PYTHONPATH": str(evil)}, check=True)
        assert marker.read_text() == "pwned"  # the payload is real: an interpreter given it runs it
        marker.unlink()
        ran, refused_ran, hijacked = tmp_path / "ran", tmp_path / "refused-ran", tmp_path / "hijacked"
        hostile = {"command": f"touch {hijacked}", "env": {"PYTHONPATH": str(evil)}}
        with cluster.api_settings(env):
            _deploy(job, "on-cpu", "cpu")
            # the server refuses each on a deployment's flow run, with its reason
            for variables, reason in (({"command": f"touch {hijacked}"}, "command"),
                                      ({"env": {"PYTHONPATH": str(evil)}}, "PYTHONPATH"),
                                      ({"env": {"LD_PRELOAD": str(evil / "x.so")}}, "LD_PRELOAD"),
                                      ({"env": {PEER_KEY_ENV: f"{'00' * 16};touch {hijacked}"}}, "does not match"),
                                      ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "CUDA_VISIBLE_DEVICES")):
                with pytest.raises(PrefectHTTPStatusError) as refused:
                    run_deployment("marked/on-cpu", parameters={"path": str(refused_ran)}, job_variables=variables,
                                   timeout=0)
                assert refused.value.response.status_code == 422 and reason in refused.value.response.text
            with get_client(sync_client=True) as client:
                deployment = client.read_deployment_by_name("marked/on-cpu")

        crashed: list[tuple[str, State]] = []
        with cluster.api_settings(env), get_client(sync_client=True) as client:
            # routes the server does not check: a flow run made directly, a deployment updated
            crashed.append(("flow run", _final(client, _post_run(client, deployment, refused_ran, hostile))))
            client.request("PATCH", "/deployments/{id}", path_params={"id": deployment.id},
                           json={"job_variables": hostile})
            crashed.append(("deployment", _final(client, _post_run(client, deployment, refused_ran, None))))
            client.request("PATCH", "/deployments/{id}", path_params={"id": deployment.id}, json={"job_variables": {}})
            # the pool's template replaced on the server: the worker keeps this checkout's
            relaxed = pool_template("cpu")
            relaxed["job_configuration"]["command"] = "{{ command }}"
            relaxed["variables"].pop("additionalProperties")
            relaxed["variables"]["properties"].update(env={"type": "object"}, command={"type": "string"})
            client.request("PATCH", "/work_pools/{name}", path_params={"name": "cpu"},
                           json={"base_job_template": relaxed})
            crashed.append(("flow run", _final(client, _post_run(client, deployment, refused_ran, hostile))))
            # an allowlisted variable still reaches the flow run
            honest = _final(client, _post_run(client, deployment, ran, {"env": {"PYTHONUNBUFFERED": "0"}}))
        for whose, refusal in crashed:
            assert refusal.is_crashed() and f"the {whose}'s job variables are refused" in (refusal.message or ""), refusal
        log = (state / "logs" / "worker-cpu.log").read_text()
        assert honest.is_completed(), (honest, log[-3000:])
        assert ran.read_text() == "0"
        assert not marker.exists() and not hijacked.exists() and not refused_ran.exists()
    finally:
        cluster.down(state)
    assert cluster.running(state) == {}
