"""A GPU pool's flow runs get devices of their own: a real ``prefect server`` on 127.0.0.1, the
``gpu-diloco`` pool and one ``python -m infra.pool_worker --devices 0,1,2,3`` (device ids are only
strings in the flow runs' environment, so no GPU is needed). Two runs asking 2 each see disjoint
pairs, a third waits SCHEDULED (its log says why) until one ends and then gets that one's pair, a
run asking for more than the host has is crashed with the reason, and a poster's own
``CUDA_VISIBLE_DEVICES`` is refused by the server and, on the route the server does not check, by
the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from prefect import Flow, flow
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import State
from prefect.deployments import run_deployment
from prefect.exceptions import PrefectHTTPStatusError

from infra import cluster
from infra.pool_worker import pool_template
from intellect.diloco.coordinator import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
POOL = "gpu-diloco"
DEVICES = ("0", "1", "2", "3")
TIMEOUT = 240.0

HOLD_FLOW = '''import os
import time
from pathlib import Path

from prefect import flow


@flow(name="hold")
def hold(seen: str, release: str) -> None:
    """Write the devices this run sees, then hold them until the test writes ``release`` (or, ending,
    ``release-all`` beside it)."""
    tmp = Path(seen + ".tmp")
    tmp.write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    tmp.rename(seen)
    deadline = time.monotonic() + 300
    while not (Path(release).exists() or Path(release).with_name("release-all").exists()):
        if time.monotonic() > deadline:
            raise TimeoutError(release)
        time.sleep(0.1)
'''


@pytest.fixture
def device_pool(tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """The server, the gpu-diloco pool, one pool worker lending devices 0..3 and the ``hold``
    deployment on the pool; the cluster's env and the worker's log."""
    state = tmp_path / "cluster"
    env = cluster.up(state, free_port(), pools=())
    log = state / "logs" / "worker-devices.log"
    worker = None
    try:
        # the pool without the cluster's concurrency limit (2 runs), which would hold the third run back
        # before the worker saw it: here only the devices may
        with cluster.api_settings(env), get_client(sync_client=True) as client:
            client.create_work_pool(WorkPoolCreate(name=POOL, type="process", base_job_template=pool_template(POOL)))
        with open(log, "ab") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "infra.pool_worker", "--pool", POOL, "--devices", ",".join(DEVICES),
                 "--name", "gpu-host"], env={**os.environ, **env, "PREFECT_LOGGING_LEVEL": "INFO"}, cwd=ROOT,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        job = tmp_path / "job"
        job.mkdir()
        (job / "hold.py").write_text(HOLD_FLOW)
        with cluster.api_settings(env):
            hold = flow.from_source(source=str(job), entrypoint="hold.py:hold")
            assert isinstance(hold, Flow)
            hold.deploy(name="hold", work_pool_name=POOL, print_next_steps=False, ignore_warnings=True)
        yield env, log
    finally:
        (tmp_path / "release-all").write_text("")
        if worker is not None:
            _stop(worker)
        cluster.down(state)
    assert cluster.running(state) == {}


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue


def _until(what: str, check: Callable[[], Any], log: Path) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}; the worker's log ends:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)
    return got


def _state(client: SyncPrefectClient, run_id: UUID) -> State | None:
    return client.read_flow_run(run_id).state


def _final(client: SyncPrefectClient, run_id: UUID, log: Path) -> State:
    return _until(f"flow run {run_id} ends", lambda: (s := _state(client, run_id)) and s.is_final() and s, log)


def test_runs_of_a_gpu_pool_hold_disjoint_devices_wait_for_them_and_reuse_them(device_pool, tmp_path):
    env, log = device_pool
    release_all = tmp_path / "release-all"  # the fixture writes it: no run outlives the test

    def start(name: str, devices: int) -> UUID:
        release = tmp_path / f"release-{name}"
        fr = run_deployment("hold/hold", timeout=0, job_variables={"devices": devices},
                            parameters={"seen": str(tmp_path / f"seen-{name}"), "release": str(release)})
        return fr.id  # pyright: ignore[reportAttributeAccessIssue] - a FlowRun when called from sync code

    def seen(name: str) -> set[str] | None:
        path = tmp_path / f"seen-{name}"
        return set(path.read_text().split(",")) if path.exists() else None

    with cluster.api_settings(env), get_client(sync_client=True) as client:
        # whoever posts a run cannot pick its devices: the server refuses the variable (422) ...
        with pytest.raises(PrefectHTTPStatusError) as refused:
            run_deployment("hold/hold", timeout=0, parameters={"seen": "x", "release": str(release_all)},
                           job_variables={"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}})
        assert refused.value.response.status_code == 422 and "CUDA_VISIBLE_DEVICES" in refused.value.response.text
        # ... and the worker crashes it where the server stores it unchecked (POST /flow_runs/)
        deployment = client.read_deployment_by_name("hold/hold")
        body = {"flow_id": str(deployment.flow_id), "deployment_id": str(deployment.id), "work_pool_name": POOL,
                "parameters": {"seen": str(tmp_path / "seen-poster"), "release": str(release_all)},
                "state": {"type": "SCHEDULED"}, "idempotency_key": uuid4().hex,
                "job_variables": {"devices": 1, "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}}
        poster = UUID(client.request("POST", "/flow_runs/", json=body).json()["id"])
        too_many = start("too-many", 5)
        for run_id, reason in ((poster, "the flow run's job variables are refused"),
                               (too_many, "the flow run asks for 5 devices; this worker has 4 (0,1,2,3)")):
            state = _final(client, run_id, log)
            assert state.is_crashed() and reason in (state.message or ""), state

        a, b, c = start("a", 2), start("b", 2), start("c", 2)
        got_a, got_b = _until("a and b start", lambda: seen("a") and seen("b") and (seen("a"), seen("b")), log)
        assert len(got_a) == len(got_b) == 2 and got_a | got_b == set(DEVICES)  # disjoint, all four lent

        def waits() -> bool:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[c])))
            return any("waits for devices: it asks for 2, 0 of this worker's 4 are free" in x.message for x in logs)

        _until("c's log says it waits for devices", waits, log)
        state = _state(client, c)
        assert state is not None and state.is_scheduled() and seen("c") is None, state

        (tmp_path / "release-a").write_text("")
        assert _final(client, a, log).is_completed()
        assert _until("c starts", lambda: seen("c"), log) == got_a  # a's devices, once a ended
        assert seen("b") == got_b and _state(client, b).is_running()  # pyright: ignore[reportOptionalMemberAccess]
        for name in ("b", "c"):
            (tmp_path / f"release-{name}").write_text("")
        assert _final(client, b, log).is_completed() and _final(client, c, log).is_completed()
    assert not (tmp_path / "seen-poster").exists() and not (tmp_path / "seen-too-many").exists()
