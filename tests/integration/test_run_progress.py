"""Short ``intellect smoke``, ``intellect diloco`` (2 workers) and ``intellect rl`` runs with their output in a
file, as without a terminal: each long loop writes progress lines (step numbers rising to the total),
and no two lines of one loop are further apart than ``logging.progress_seconds`` plus slack, however
long a step, a wait on peers or a measurement takes (the heartbeat)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId, LogFilterName

from intellect import progress
from intellect.checkpoints import publish
from intellect.config import ModelConfig
from intellect.model.checkpoint import build_model
from intellect.storage import RunStorage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 1.0
# the heartbeat wakes when a line falls due; the slack is a busy 2-core machine delaying a thread or a write
SLACK = 4.0
TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
        "model.intermediate_size=64"]
# Prefect's console format: "21:36:02.058 | INFO    | intellect.progress - pretrain: step 1/40 (2%) | ..."
LINE = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) \| INFO +\| intellect\.progress - (.+?): (.*)$")
STEP = re.compile(r"^(?:[a-z ]+ )?(\d+)/(\d+) \(")


def progress_lines(text: str) -> dict[str, list[tuple[float, str]]]:
    """Each progress's lines (by its name), with their times in seconds of the day."""
    out: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for line in text.splitlines():
        if m := LINE.match(line):
            h, mi, s, what, rest = m.groups()
            out[what].append((int(h) * 3600 + int(mi) * 60 + float(s), rest))
    return out


def check(lines: list[tuple[float, str]], total: int) -> list[int]:
    """The step numbers of one progress's lines: rising to ``total``, no gap over the interval + slack."""
    times = [t for t, _ in lines]
    gaps = [(b - a) % 86400 for a, b in zip(times, times[1:])]
    assert max(gaps) <= INTERVAL + SLACK, (max(gaps), lines)
    steps = [(int(m.group(1)), int(m.group(2))) for _, rest in lines if (m := STEP.match(rest))]
    assert steps and all(t == total for _, t in steps), lines
    done = [n for n, _ in steps]
    assert done == sorted(done) and done[-1] == total, lines
    assert lines[-1][1].startswith("done"), lines[-1]
    return done


def run_cli(api: str, tmp_path: Path, name: str, args: list[str], timeout: float = 240) -> str:
    """``intellect ARGS`` reporting to the Prefect server at ``api``, its output in a file."""
    env = {**os.environ, "PREFECT_API_URL": api,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PREFECT_LOGGING_LEVEL", None)  # the suite's WARNING would hide the flows' own INFO lines
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:  # a file: no terminal
        done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
    text = log.read_text()
    assert done.returncode == 0, text[-3000:]
    return text


@pytest.fixture
def api(prefect_harness) -> str:  # noqa: ARG001 - the session's server, so no run starts a temporary one
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415 - after the harness set it

    return PREFECT_API_URL.value()


def test_smoke_prints_progress_without_a_terminal(api, tmp_path):
    text = run_cli(api, tmp_path, "smoke", [
        "smoke", "--config", "configs/smoke.toml", f"storage.url=file://{tmp_path}/runs", "train.steps=25",
        "train.batch_size=16", "train.eval_size=16", "pass_at_k_prompts=8", "pass_at_k_samples=2", "train.threads=1",
        f"logging.progress_seconds={INTERVAL}", *TINY])
    found = progress_lines(text)
    assert found["pretrain"][0][1].startswith("25 steps from checkpoint 0"), found["pretrain"][0]
    assert len(check(found["pretrain"], 25)) >= 2
    for what in ("held-out eval of checkpoint 0", "held-out eval of checkpoint 25", "pass@2 of checkpoint 25"):
        check(found[what], 32 if what.startswith("held") else 16)
    # the same lines in the run's logs on the Prefect server (the dashboard's view), which stores a
    # flushed batch asynchronously: read until it has them, within a bound
    want = {f"pretrain: {rest}" for _, rest in found["pretrain"]}
    deadline, stored = time.monotonic() + 30, set()
    while not want <= stored and time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            runs = [r for r in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["smoke"])))
                    if r.parameters["config"]["storage"]["url"] == f"file://{tmp_path}/runs"]
            assert len(runs) == 1
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[0].id]),
                                              name=LogFilterName(any_=[progress.LOGGER])))
        stored = {log.message for log in logs}
        if not want <= stored:
            time.sleep(0.5)
    assert want <= stored, want - stored


def test_diloco_workers_and_their_coordinator_print_progress(api, tmp_path):
    text = run_cli(api, tmp_path, "diloco", [
        "diloco", "--config", "configs/diloco-tiny.toml", f"storage.url=file://{tmp_path}/runs", "run_name=prog",
        "train.batch_size=8", "diloco.workers=2", "diloco.inner_steps=4", "diloco.outer_steps=3",
        "diloco.heartbeat_interval=0.5", "diloco.heartbeat_timeout=10", "train.threads=1",
        f"logging.progress_seconds={INTERVAL}", *TINY])
    check(progress_lines(text)["DiLoCo prog"], 3)
    for worker in ("w0", "w1"):
        log = (tmp_path / "runs" / "prog" / "logs" / f"{worker}.log").read_text()
        lines = progress_lines(log)[worker]
        assert lines[0][1].startswith("3 outer steps of 4 inner steps, from checkpoint 0"), lines[0]
        assert len(set(check(lines, 12))) >= 3  # the inner steps of several outer steps


def test_rl_prints_progress_without_a_terminal(api, tmp_path):
    model, tok = build_model(ModelConfig(**{k.split("=")[0][6:]: int(k.split("=")[1]) for k in TINY}))
    publish(model, tok, RunStorage(f"file://{tmp_path}/base"), 0)  # checkpoint 0: where RL starts
    cfg = {
        "run_name": "rl", "storage": {"url": f"file://{tmp_path}"}, "init": {"from_run": "base"},
        "tasks": {"size": 64, "data": {"max_digits": 1}}, "steps": 3, "async_level": 1,
        "workers": {"names": ["alice", "bob"], "poll_interval": 0.02, "submission_timeout": 120,
                    "checkpoint_timeout": 120},
        "submission": {"prompts_per_submission": 2, "group_size": 4, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1},
        "eval": {"every": 3, "size": 16}, "trainer_threads": 1, "toploc": {"k": 16},
        "logging": {"progress_seconds": INTERVAL},
    }
    config = tmp_path / "rl.toml"
    config.write_text(to_toml(cfg))
    found = progress_lines(run_cli(api, tmp_path, "rl", ["rl", "--config", str(config)]))
    check(found["RL rl"], 3)
    assert found["held-out eval of checkpoint 3"][-1][1].startswith("accuracy ")


def to_toml(data: dict, prefix: str = "") -> str:
    """TOML of a nested dict: scalars and lists first, then one table per nested dict."""
    flat = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    head = [f"[{prefix}]"] if prefix and flat else []
    tables = [to_toml(v, f"{prefix}.{k}" if prefix else k) for k, v in data.items() if isinstance(v, dict)]
    return "\n".join(head + flat + [""] + tables)
