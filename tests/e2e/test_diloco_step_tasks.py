"""Each DiLoCo outer step is one live ``diloco-outer-step`` flow run whose phases are task runs
(``flows.diloco_worker``), read back from a real Prefect server while and after a 2-worker run.
(A run where every step commits, its five phases in order: ``test_diloco_flow.py``.)"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId,
                                            TaskRunFilter, TaskRunFilterName, TaskRunFilterState,
                                            TaskRunFilterStateType)
from prefect.client.schemas.objects import StateType

from flows.diloco import diloco_train
from flows.diloco_worker import EXCLUDED, OUTER_STEP, run_phase
from intellect.diloco.worker import PHASES
from intellect.config import load_config
from intellect.diloco.config import DilocoRunConfig

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64", "train.batch_size=8", "train.threads=1"]


@pytest.mark.usefixtures("prefect_harness")
def test_a_phase_task_runs_in_the_thread_that_calls_it():
    @flow
    def probe() -> tuple[int, int]:
        return threading.get_ident(), run_phase("probe", threading.get_ident)

    caller, phase = probe()
    assert phase == caller == threading.get_ident()


class RunningInner(threading.Thread):
    """Polls the API for task runs named ``inner`` in state Running until stopped, as a dashboard
    user sees them while a worker trains; keeps the names of their flow runs."""

    def __init__(self, poll: float = 0.2):
        super().__init__(daemon=True)
        self.poll, self.stop, self.seen = poll, threading.Event(), set()

    def run(self) -> None:
        with get_client(sync_client=True) as client:
            while not self.stop.wait(self.poll):
                runs = client.read_task_runs(task_run_filter=TaskRunFilter(
                    name=TaskRunFilterName(any_=["inner"]),
                    state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING]))))
                self.seen |= {client.read_flow_run(r.flow_run_id).name for r in runs if r.flow_run_id}


def worker_pid(folder: Path, worker: str) -> int | None:
    """The process of ``worker`` whose config lies under ``folder`` (a subprocess of the diloco-train
    flow: its coordinator's temporary files are the test's), from /proc."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"flows.diloco_worker" in argv and worker.encode() in argv and any(str(folder).encode() in a for a in argv):
            return int(proc.name)
    return None


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("prefect_harness")
def test_a_step_is_shown_live_and_an_excluded_one_as_excluded(tmp_path):
    """w1 is paused (SIGSTOP) once the dashboard shows one of its inner phases Running, past the heartbeat
    timeout: w0 commits that step alone, and w1's run of it ends Excluded, the phase that found it Failed.
    The step is read back, not assumed: a poll of a loaded server can see a phase Running late, and the
    pause then lands in a later step (three steps leave room for that)."""
    # inner phases of a few seconds: long enough for a poll of the API to see them Running
    cfg = load_config(DilocoRunConfig, overrides=[
        "run_name=dl-step-tasks", f"storage.url=file://{tmp_path}", *TINY, "diloco.workers=2",
        "diloco.inner_steps=200", "diloco.outer_steps=3", "diloco.heartbeat_interval=0.5",
        "diloco.heartbeat_timeout=2.5", "diloco.collective_timeout=6",
    ], environ={})
    poller, result = RunningInner(), {}
    train = threading.Thread(target=lambda: result.update(report=diloco_train(cfg, timeout_s=300)), daemon=True)
    poller.start()
    train.start()
    try:
        deadline = time.monotonic() + 240
        while not any(n.startswith("w1-") for n in poller.seen) and time.monotonic() < deadline and train.is_alive():
            time.sleep(0.1)
        assert any(n.startswith("w1-") for n in poller.seen), "w1's inner phase never showed as Running"
        pid = worker_pid(tmp_path, "w1")
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # its heartbeat stops with it: to w0 it is gone
        time.sleep(3 * cfg.diloco.heartbeat_timeout)
        os.kill(pid, signal.SIGCONT)
        train.join(300)
    finally:
        poller.stop.set()
        poller.join()
    report = result["report"]
    assert report.committed_steps == 3 and report.exit_codes == {"w0": 0, "w1": 0}

    with get_client(sync_client=True) as client:
        runs = {r.name: r for r in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[OUTER_STEP])))
                if r.parameters.get("run_name") == cfg.run_name}
        # a Completed-type state named Excluded, the reason as its message: exactly one of w1's steps
        steps = [k for k in range(3) if (r := runs.get(f"w1-step-{k}")) and r.state and r.state.name == EXCLUDED]
        assert len(steps) == 1, {name: r.state for name, r in runs.items()}
        step = steps[0]
        by_id = FlowRunFilter(id=FlowRunFilterId(any_=[runs[f"w1-step-{step}"].id]))
        tasks = sorted(client.read_task_runs(flow_run_filter=by_id), key=lambda t: t.start_time or 0)
        tables = [json.loads(a.data) for a in client.read_artifacts(flow_run_filter=by_id)]
    excluded, w0 = runs[f"w1-step-{step}"].state, runs[f"w0-step-{step}"].state
    assert w0 is not None and w0.is_completed() and w0.name == "Completed"
    assert excluded is not None and excluded.is_completed(), excluded
    assert "w1" in (excluded.message or "")
    names, states = [t.name for t in tasks], [t.state for t in tasks]
    assert names[:2] == list(PHASES[:2]) and names[-1] == "abandon" and names[-2] in PHASES, names
    assert all(s is not None for s in states)
    failed = [t for t in tasks if t.state is not None and t.state.is_failed()]
    assert [t.name for t in failed] == [names[-2]] and "Excluded" in (failed[0].state.message or "")
    assert [(row["worker"], row["step"], row["committed"]) for t in tables for row in t] == [("w1", step, False)]
