"""rl-train's workers as flow runs of the ``rl-worker`` deployment: a real ``prefect server`` on
127.0.0.1 with the ``gpu-rollout`` pool and one process worker (``infra/cluster.py``), the
deployment from ``prefect.yaml``. A two-step ``rl-train`` with ``workers.launch = "deployments"``
completes with its one worker's samples accepted under the key id that worker made on its host; a
worker whose run stops it is cancelled and leaves no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId

from flows.rl import rl_train
from flows.rl_worker import RLWorkerLauncher
from infra import cluster
from intellect.checkpoints import publish
from intellect.config import ModelConfig
from intellect.diloco.coordinator import free_port
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.rl.config import RLRunConfig
from intellect.rl.trainer.run import RLRun
from intellect.rl.trainer.setup import ledger_path
from intellect.rl.trainer.workers import host_key_file, worker_key_file
from intellect.storage import RunStorage
from intellect.trust.keys import SigningKey

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
PROMPTS, GROUP = 2, 4
POOL = "gpu-rollout"


@pytest.fixture(scope="module")
def rollout_pool(tmp_path_factory):
    """The server, the gpu-rollout pool with one process worker, the rl-worker deployment; the
    worker host's home (flow runs inherit HOME from the process worker)."""
    state, home = tmp_path_factory.mktemp("cluster"), tmp_path_factory.mktemp("host-home")
    with mock.patch.dict(os.environ, {"HOME": str(home)}):
        env = cluster.up(state, free_port(), pools=(POOL,))
    try:
        prefect = str(Path(sys.executable).with_name("prefect"))
        subprocess.run([prefect, "--no-prompt", "deploy", "--name", "rl-worker"], env={**os.environ, **env},
                       cwd=ROOT, check=True, timeout=300, capture_output=True)
        yield state, env, home
    finally:
        stopped = cluster.down(state)
        assert stopped and cluster.running(state) == {}
        left = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True).stdout
        assert left == "", left


def rl_cfg(root: Path, run_name: str, steps: int) -> RLRunConfig:
    model, tok = build_model(TINY)
    publish(model, tok, RunStorage(f"file://{root}/base"), 0)
    return RLRunConfig.model_validate({
        "run_name": run_name, "storage": {"url": f"file://{root}"}, "init": {"from_run": "base"},
        "tasks": {"size": 64, "data": {"max_digits": 1}}, "steps": steps, "async_level": 1,
        "workers": {"names": ["w0"], "launch": "deployments", "poll_interval": 0.05, "submission_timeout": 180,
                    "checkpoint_timeout": 300},
        "submission": {"prompts_per_submission": PROMPTS, "group_size": GROUP, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1},
        "eval": {"every": 0, "size": 8}, "trainer_threads": 1, "toploc": {"k": 16},  # k <= hidden size
        "dispatch": {"poll_interval": 0.5},
    })


def worker_runs(run_name: str) -> list:
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl-worker"])))
    return [r for r in runs if r.parameters.get("run_name") == run_name]


def no_flow_run_process_left(state: Path) -> None:
    pool_worker = cluster.running(state)[f"worker-{POOL}"]
    deadline = time.monotonic() + 30
    while (left := subprocess.run(["pgrep", "-P", str(pool_worker)], capture_output=True, text=True).stdout):
        assert time.monotonic() < deadline, left
        time.sleep(0.5)


def test_rl_train_runs_its_worker_as_a_flow_run_on_the_rollout_pool(rollout_pool, tmp_path):
    state, env, home = rollout_pool
    cfg = rl_cfg(tmp_path, "rl-dep", steps=2)
    with cluster.api_settings(env):
        report = rl_train(cfg)
        (run,) = worker_runs("rl-dep")
    log = (state / "logs" / f"worker-{POOL}.log").read_text()[-3000:]
    assert report.steps == 2 and report.worker_exit_codes == {"w0": 0}, log
    assert (run.name, run.work_pool_name, run.state.type.value) == ("rl-dep-w0", POOL, "COMPLETED")
    assert run.parent_task_run_id is not None  # a child of rl-train's run
    # the key was made on the worker's host, private, and never in the trainer's run folder
    key_file = host_key_file("rl-dep", "w0", home=home / ".intellect")
    assert oct(key_file.stat().st_mode & 0o777) == "0o600" and not worker_key_file(cfg, "w0").exists()
    worker_id = SigningKey.load(key_file).public.id
    with Ledger(ledger_path(cfg)) as ledger:
        assert ledger.committed_steps() == [0, 1]
        for n in (0, 1):
            assert {a["worker"] for a in ledger.accepted(n)} == {worker_id}
            assert len(ledger.accepted(n)) == PROMPTS * GROUP
    no_flow_run_process_left(state)


def test_a_stopped_worker_flow_run_is_cancelled_and_its_worker_killed(rollout_pool, tmp_path):
    """The run's stop path (``stop_workers``) cancels a worker still waiting for checkpoints."""
    state, env, _ = rollout_pool
    cfg = rl_cfg(tmp_path, "rl-cancel", steps=50)
    with cluster.api_settings(env), RLRun(cfg) as run:
        run.prepare()
        run.start_shardcast()
        run.publish(0)
        url = run.start_service(0)
        run.start_workers(url, RLWorkerLauncher(cfg))  # returns once the worker announced its key id
        deadline = time.monotonic() + 120
        while not run.service or not run.service.done(0):  # the worker process is at work
            assert time.monotonic() < deadline, "the worker never finished step 0"
            time.sleep(0.2)
        assert list(run.service.done(0)) == [run.worker_ids["w0"]]
        codes = run.stop_workers(grace=0.0)
        deadline = time.monotonic() + 90
        while not (runs := worker_runs("rl-cancel")) or not runs[0].state.is_final():
            assert time.monotonic() < deadline, runs
            time.sleep(1)
        with get_client(sync_client=True) as client:
            logs = [g.message for g in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[0].id])))]
    assert codes["w0"] in (None, -15)  # None: the cancellation took longer than stop_workers waits
    assert runs[0].state.type.value == "CANCELLED", runs[0].state
    # the flow stopped its worker on the way out (the worker would also notice its parent gone)
    assert "worker w0 stopped: exit code -15" in logs, logs
    no_flow_run_process_left(state)
    left = subprocess.run(["pgrep", "-f", "intellect.rl.worker.worker.*rl-cancel"], capture_output=True, text=True).stdout
    assert left == "", left
