"""The deployed system: a real ``prefect server`` on 127.0.0.1, the four work pools, one process worker
each (``infra/cluster.py``), every deployment of ``prefect.yaml``, and ``rl-orchestrate`` running two
RL steps whose generation, validation and update are each a flow run on its own pool. Everything
is stopped by PID at the end and nothing is left running."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from infra import cluster
from intellect.config import ModelConfig
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.pretrain import publish_checkpoint
from intellect.rl.config import RLRunConfig
from intellect.rl.setup import ledger_path
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
STAGE_POOLS = {"rl-generate": "gpu-rollout", "rl-validate": "validator", "rl-update": "gpu-train",
               "rl-orchestrate": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def local_cluster(tmp_path):
    state = tmp_path / "cluster"
    env = cluster.up(state, free_port())
    try:
        yield state, env
    finally:
        stopped = cluster.down(state)
        assert stopped and cluster.running(state) == {}
        left = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True).stdout
        assert left == "", left


def test_rl_steps_run_as_flow_runs_on_their_pools(local_cluster, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    state, env = local_cluster
    cluster.deploy(state)
    model, tok = build_model(TINY)
    publish_checkpoint(model, tok, RunStorage(f"file://{tmp_path}/base"), 0)
    cfg = RLRunConfig.model_validate({
        "run_name": "rl-pools", "storage": {"url": f"file://{tmp_path}"}, "init": {"from_run": "base"},
        "tasks": {"size": 64, "data": {"max_digits": 1}}, "steps": 2, "async_level": 1,
        "workers": {"names": ["alice", "bob"]},
        "submission": {"prompts_per_submission": 2, "group_size": 4, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1},
        "eval": {"every": 0, "size": 16}, "trainer_threads": 1,
        "dispatch": {"mode": "deployments", "timeout": 300, "poll_interval": 0.5},
    })
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        run = run_deployment("rl-orchestrate/rl-orchestrate", parameters={"config": cfg.model_dump(mode="json")},
                             timeout=600, poll_interval=1)
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
