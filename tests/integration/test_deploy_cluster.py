"""The deployed system: a real ``prefect server`` on 127.0.0.1, the five work pools, one process worker
each (``infra/cluster.py``), every deployment of ``prefect.yaml``, ``rl-orchestrate`` running two
RL steps whose generation, validation and update are each a flow run on its own pool, and
``diloco-train`` whose workers are flow runs on theirs. Everything is stopped by PID at the end and
nothing is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast

import pytest
from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from infra import cluster
from intellect.diloco.worker import PHASES
from infra.automations import NAME
from intellect.config import ModelConfig, load_config
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import free_port
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.checkpoints import publish
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.setup import ledger_path
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
STAGE_POOLS = {"rl-generate": "gpu-rollout", "rl-validate": "validator", "rl-update": "gpu-train",
               "rl-orchestrate": "cpu"}


class _Sink(BaseHTTPRequestHandler):
    """The alert webhook: records every POST body."""

    received: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def alert_sink():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/alerts", _Sink.received
    server.shutdown()


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory, alert_sink):
    state = tmp_path_factory.mktemp("cluster")
    env = cluster.up(state, free_port(), alert_webhook=alert_sink[0])
    try:
        yield state, env
    finally:
        stopped = cluster.down(state)
        assert stopped and cluster.running(state) == {}
        left = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True).stdout
        assert left == "", left


def test_rl_steps_run_as_flow_runs_on_their_pools(local_cluster, tmp_path):
    state, env = local_cluster
    cluster.deploy(state)
    model, tok = build_model(TINY)
    publish(model, tok, RunStorage(f"file://{tmp_path}/base"), 0)
    cfg = RLRunConfig.model_validate({
        "run_name": "rl-pools", "storage": {"url": f"file://{tmp_path}"}, "init": {"from_run": "base"},
        "tasks": {"size": 64, "data": {"max_digits": 1}}, "steps": 2, "async_level": 1,
        "workers": {"names": ["alice", "bob"]},
        "submission": {"prompts_per_submission": 2, "group_size": 4, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1},
        "eval": {"every": 0, "size": 16}, "trainer_threads": 1, "toploc": {"k": 16},  # k <= hidden size
        "dispatch": {"mode": "deployments", "timeout": 300, "poll_interval": 0.5},
    })
    with cluster.api_settings(env):
        run = run_deployment("rl-orchestrate/rl-orchestrate", parameters={"config": cfg.model_dump(mode="json")},
                             timeout=600, poll_interval=1)
        assert isinstance(run, FlowRun)  # run_deployment's result: called outside an event loop, it ran here
        assert run.state.is_completed(), (run.state, (state / "logs" / "worker-cpu.log").read_text()[-3000:])
        with get_client(sync_client=True) as client:
            runs = {name: client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
                    for name in STAGE_POOLS}
    counts = {name: len(rs) for name, rs in runs.items()}
    assert counts == {"rl-generate": 4, "rl-validate": 2, "rl-update": 2, "rl-orchestrate": 1}
    for name, rs in runs.items():
        assert {r.state.type.value for r in rs} == {"COMPLETED"}, name
        assert {r.work_pool_name for r in rs} == {STAGE_POOLS[name]}, name
    # every stage was its own process: the stage flow runs are children of the orchestrator's run
    assert all(r.parent_task_run_id is not None for name in ("rl-generate", "rl-validate", "rl-update")
               for r in runs[name])
    with Ledger(ledger_path(cfg)) as ledger:
        assert ledger.committed_steps() == [0, 1]
        assert all(len(ledger.accepted(n)) == 2 * 2 * 4 for n in (0, 1))
    assert RunStorage(f"file://{tmp_path}/rl-pools").complete_steps("checkpoints") == [0, 1, 2]
    assert Path(state / "env").read_text().count("export ") >= 5


def test_a_worker_with_many_rejections_triggers_the_automation(local_cluster, alert_sink):
    state, env = local_cluster
    url, received = alert_sink
    with cluster.api_settings(env):
        # cast: Prefect types Automation.read's overloads as async, but out of an event loop it returns the model
        assert cast(Automation, Automation.read(name=NAME)).enabled
    # emitted by a process of its own, as a flow run would: this test process's events client may
    # already be bound to another test's server
    emit = subprocess.run(
        [sys.executable, "-c", "from flows.events import emit_rejections; print(emit_rejections('rl-x', 3, "
         "{'mallory': (2, 14), 'alice': (16, 0), 'bob': (15, 1)}, 0.5))"],
        env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,
        timeout=120)
    assert emit.returncode == 0 and emit.stdout.strip() == "['mallory']", emit.stderr[-2000:]
    deadline = time.monotonic() + 60
    while not received and time.monotonic() < deadline:
        time.sleep(0.2)
    assert received, "the automation never called the webhook"
    assert received[0] == {"automation": NAME, "event": "intellect.rl.worker.rejections-high", "run": "rl-x",
                           "worker": "mallory", "step": 3, "rate": 0.875, "threshold": 0.5}
    time.sleep(2)
    assert len(received) == 1  # alice had none, bob's 1 of 16 is under the threshold


def _diloco_config(tmp_path, run_name: str, outer_steps: int) -> dict:
    return load_config(DilocoRunConfig, overrides=[
        f"run_name={run_name}", f"storage.url=file://{tmp_path}", "model.num_layers=1", "model.hidden_size=32",
        "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=64", "train.batch_size=8",
        "train.threads=1", "diloco.workers=2", "diloco.inner_steps=3", f"diloco.outer_steps={outer_steps}",
        "diloco.heartbeat_interval=0.5", "diloco.heartbeat_timeout=5",
        "dispatch.mode=deployments", "dispatch.poll_interval=0.5",
    ], environ={}).model_dump(mode="json")


def _runs_of(client, flow_name: str, run_name: str) -> list:
    return [r for r in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
            if (r.parameters.get("run_name") or r.parameters.get("config", {}).get("run_name")) == run_name]


def test_diloco_workers_run_as_flow_runs_on_their_pool(local_cluster, tmp_path):
    """diloco-train on `cpu` launches each worker as a diloco-worker flow run on `gpu-diloco`; a
    coordinator that gives up cancels its workers' flow runs and nothing keeps running."""
    state, env = local_cluster
    cluster.deploy(state)
    with cluster.api_settings(env):
        run = run_deployment("diloco-train/diloco-train", timeout=600, poll_interval=1,
                             parameters={"config": _diloco_config(tmp_path, "dl-pools", 2), "timeout_s": 300})
        assert isinstance(run, FlowRun)  # run_deployment's result: called outside an event loop, it ran here
        assert run.state.is_completed(), (run.state, (state / "logs" / "worker-gpu-diloco.log").read_text()[-3000:])
        with get_client(sync_client=True) as client:
            workers = _runs_of(client, "diloco-worker", "dl-pools")
            steps = _runs_of(client, "diloco-outer-step", "dl-pools")
            phases = [sorted(client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id]))),
                             key=lambda t: t.start_time or 0) for r in steps]
            coordinator = client.read_flow_run(run.id)
    assert coordinator.work_pool_name == "cpu"
    assert sorted(r.name for r in workers) == ["dl-pools-w0", "dl-pools-w1"]
    assert {(r.work_pool_name, r.state.type.value) for r in workers} == {("gpu-diloco", "COMPLETED")}
    assert all(r.parent_task_run_id is not None for r in workers)  # children of the coordinator's run
    assert sorted(r.name for r in steps) == ["w0-step-0", "w0-step-1", "w1-step-0", "w1-step-1"]
    # each step a sub-flow run of its worker's run, its phases its task runs
    assert all(r.parent_task_run_id is not None for r in steps)
    assert [[t.name for t in ts] for ts in phases] == [list(PHASES)] * len(steps)
    assert RunStorage(f"file://{tmp_path}/dl-pools").complete_steps("checkpoints") == [0, 1, 2]

    # a coordinator that gives up (timeout_s) stops its workers by cancelling their flow runs
    with cluster.api_settings(env):
        run = run_deployment("diloco-train/diloco-train", timeout=600, poll_interval=1,
                             parameters={"config": _diloco_config(tmp_path, "dl-cancel", 10_000), "timeout_s": 40})
        assert isinstance(run, FlowRun)  # as above
        assert run.state.is_failed(), run.state
        deadline = time.monotonic() + 90
        while True:
            with get_client(sync_client=True) as client:
                workers = _runs_of(client, "diloco-worker", "dl-cancel")
            if workers and all(r.state.is_final() for r in workers) or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert len(workers) == 2 and {r.state.type.value for r in workers} == {"CANCELLED"}, [r.state for r in workers]
    committed = RunStorage(f"file://{tmp_path}/dl-cancel").complete_steps("checkpoints")
    assert committed and committed[-1] >= 1  # they trained before being stopped
    # the flow runs' processes are children of the pool's process worker: none is left
    pool_worker = cluster.running(state)["worker-gpu-diloco"]
    left = subprocess.run(["pgrep", "-P", str(pool_worker)], capture_output=True, text=True).stdout
    assert left == "", left
