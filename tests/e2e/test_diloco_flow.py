"""The ``diloco-train`` flow with workers whose outer steps are flow runs of their own."""

from __future__ import annotations

import asyncio
import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId

from flows.diloco import diloco_train
from intellect.diloco.worker import PHASES
from intellect.config import load_config
from intellect.diloco.config import DilocoRunConfig
from intellect.storage import RunStorage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.mark.usefixtures("prefect_harness")
def test_diloco_flow_runs_one_flow_run_per_worker_and_outer_step(tmp_path):
    cfg = load_config(DilocoRunConfig, overrides=[
        f"storage.url=file://{tmp_path}", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
        "model.num_kv_heads=2", "model.intermediate_size=64", "train.batch_size=8", "diloco.workers=2",
        "diloco.inner_steps=3", "diloco.outer_steps=2", "diloco.heartbeat_interval=0.5",
        "diloco.heartbeat_timeout=5",
    ], environ={})
    report = diloco_train(cfg, timeout_s=300)
    assert report.committed_steps == 2 and report.exit_codes == {"w0": 0, "w1": 0}
    assert [r["outer_step"] for r in report.steps] == [1, 2]
    assert all(r["participants"] == 2 and r["bytes_sent"] > 0 for r in report.steps)
    assert RunStorage.from_config(cfg.storage, cfg.run_name).complete_steps("checkpoints") == [0, 1, 2]

    async def outer_step_runs():
        async with get_client() as client:
            return await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["diloco-outer-step"])))

    # the Prefect harness is shared by the session: keep this run's flow runs only
    runs = [r for r in asyncio.run(outer_step_runs()) if r.parameters.get("run_name") == cfg.run_name]
    assert sorted(r.name for r in runs) == ["w0-step-0", "w0-step-1", "w1-step-0", "w1-step-1"]
    assert all(r.state.is_completed() and r.state.name == "Completed" for r in runs)

    async def phases_and_tables(run_id):
        by_id = FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=by_id), await client.read_artifacts(flow_run_filter=by_id)

    # each step's phases are its task runs, in order, one after the other; its row is its table artifact
    for r in runs:
        tasks, artifacts = asyncio.run(phases_and_tables(r.id))
        tasks = sorted(tasks, key=lambda t: t.start_time or 0)
        assert [t.name for t in tasks] == list(PHASES), r.name
        assert all(t.state is not None and t.state.is_completed() for t in tasks), r.name
        assert all(a.end_time and b.start_time and a.end_time <= b.start_time for a, b in zip(tasks, tasks[1:]))
        worker, step = r.name.split("-step-")
        assert [[(row["worker"], row["step"], row["committed"]) for row in json.loads(a.data)] for a in artifacts] == [
            [(worker, int(step), True)]], r.name
