"""The RL flows under a real (temporary) Prefect server: ``rl-train`` with worker processes,
``rl-step``, a killed run resumed, and ``filter-pass-at-k``."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from prefect.settings import PREFECT_API_URL
from safetensors.torch import load_file

from flows.filter import filter_pass_at_k
from flows.rl import rl_step, rl_train
from flows.rl_stages import rl_orchestrate
from intellect import progress
from intellect.config import ModelConfig
from intellect.ledger import Ledger
from intellect.model.checkpoint import build_model
from intellect.checkpoints import CHECKPOINTS, OPTIMIZER, publish
from intellect.data.loaders import load_math_tasks
from intellect.rl.config import FilterRunConfig, RLRunConfig
from intellect.rl.trainer.report import CURVE, load_evals
from intellect.rl.wire.rollouts import list_submissions
from intellect.rl.trainer.setup import ledger_path, run_storage
from intellect.shardcast.store import VersionStore
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
PROMPTS, GROUP = 2, 4


@pytest.fixture
def base(tmp_path):
    """A run ``base`` whose checkpoint 0 is an untrained tiny model: where RL starts."""
    model, tok = build_model(TINY)
    publish(model, tok, RunStorage(f"file://{tmp_path}/base"), 0)
    return tmp_path


def rl_cfg(root, **over) -> RLRunConfig:
    data = {
        "run_name": "rl", "storage": {"url": f"file://{root}"}, "init": {"from_run": "base"},
        "tasks": {"size": 64, "data": {"max_digits": 1}}, "steps": 4, "async_level": 1,
        "workers": {"names": ["alice", "bob"], "poll_interval": 0.02, "submission_timeout": 120,
                    "checkpoint_timeout": 120},
        "submission": {"prompts_per_submission": PROMPTS, "group_size": GROUP, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1},
        "eval": {"every": 2, "size": 16}, "trainer_threads": 1,
        "toploc": {"k": 16},  # on, as by default; the tiny model's hidden size is 32
    }
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return RLRunConfig.model_validate(data)


def check_ledger(cfg: RLRunConfig, steps: int) -> None:
    per_step = len(cfg.workers.names) * PROMPTS * GROUP
    with Ledger(ledger_path(cfg)) as ledger:
        assert ledger.committed_steps() == list(range(steps))
        for n in range(steps):
            acc = ledger.accepted(n)
            assert len(acc) == per_step and len({a["content_hash"] for a in acc}) == per_step
            assert len({(a["file"], a["row_index"]) for a in acc}) == per_step
            assert {a["policy_step"] for a in acc} <= set(range(max(0, n - cfg.async_level), n + 1))
        assert all(ledger.checkpoint(n + 1) is not None for n in range(steps))


@pytest.mark.usefixtures("prefect_harness")
def test_rl_train_with_worker_processes(base):
    cfg = rl_cfg(base)
    report = rl_train(cfg)
    assert report.steps == 4 and report.first_step == 0
    assert report.worker_exit_codes == {"alice": 0, "bob": 0}
    storage = run_storage(cfg)
    assert storage.complete_steps(CHECKPOINTS) == [0, 1, 2, 3, 4]
    assert storage.exists(f"{storage.step_path(4, CHECKPOINTS)}/{OPTIMIZER}")
    assert [e["step"] for e in load_evals(storage)] == [0, 2, 4]
    assert storage.read_bytes(CURVE)[:8] == b"\x89PNG\r\n\x1a\n"
    check_ledger(cfg, 4)
    for worker in ("alice", "bob"):  # each `intellect worker` says where it is, without a terminal
        text = (base / "rl" / "logs" / f"{worker}.log").read_text()
        assert re.search(r"intellect\.progress worker \S+: step 4/4 \(100%\)", text), text[-2000:]
        assert re.search(r"intellect\.progress worker \S+: done, 4 steps", text), text[-2000:]
    # a finished run run again has nothing left to do
    assert rl_train(cfg).steps == 0


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("inference_dtype", ["fp32", "bf16"])
def test_rl_train_with_shardcast_carrying_the_weights(base, inference_dtype):
    """Checkpoints go trainer -> origin -> 2 relays -> worker caches; no server outlives the run. In
    bf16 the workers generate, and the validator's TOPLOC check prefills, with the same bf16 weights:
    every sample is accepted."""
    cfg = rl_cfg(base, shardcast={"shard_size": 8192, "local_relays": 2, "keep": 3},
                 trainer={"inference_dtype": inference_dtype})
    report = rl_train(cfg)
    assert report.steps == 4 and report.worker_exit_codes == {"alice": 0, "bob": 0}
    check_ledger(cfg, 4)
    run = base / "rl"
    origin = VersionStore(run / "shardcast" / "origin")
    # the newest 3 and the base chain they are weight patches of: anchor 0 (whole), then a patch per step
    assert origin.versions() == [0, 1, 2, 3, 4]
    anchor, m = origin.manifest(0), origin.manifest(4)
    assert anchor is not None and anchor.complete and anchor.lineage.encoding == "full" and len(anchor.shards) > 2
    assert "optimizer.pt" not in {f.name for f in anchor.files}
    assert m is not None and m.complete and m.lineage.base == 3 and m.total_size < anchor.total_size
    for relay in ("relay0", "relay1"):
        assert VersionStore(run / "shardcast" / relay).versions() == [0, 1, 2, 3, 4]
    for worker in ("alice", "bob"):
        cached = sorted(p.name for p in (run / "weights" / worker).iterdir())
        assert cached and all((run / "weights" / worker / c / "STABLE").exists() for c in cached)
        # a worker generated with what it downloaded: its weights equal the trainer's checkpoint
        newest = cached[-1]
        assert (run / "weights" / worker / newest / "model.safetensors").read_bytes() == \
            (run / "checkpoints" / newest / "model.safetensors").read_bytes()
    weights = load_file(str(run / run_storage(cfg).step_path(4, CHECKPOINTS) / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16 if inference_dtype == "bf16" else torch.float32}
    with Ledger(ledger_path(cfg)) as ledger:  # each step's broadcast: a patch, smaller than the checkpoint
        shares = [ledger.get_step(n)["timings"]["broadcast_share"] for n in range(4)]  # pyright: ignore[reportOptionalSubscript]
    assert all(0 < s < 1 for s in shares), shares
    leftover = subprocess.run(["pgrep", "-f", f"intellect.shardcast .*{run}"], capture_output=True, text=True)
    assert leftover.stdout == "", leftover.stdout


@pytest.mark.usefixtures("prefect_harness")
def test_rl_orchestrate_runs_each_stage_as_a_flow_run(base, caplog):
    """Local dispatch: rl-generate per worker, rl-validate, rl-update as sub-flow runs of rl-orchestrate,
    with the orchestrator's progress lines (one per step, as without a terminal)."""
    cfg = rl_cfg(base, steps=2, eval={"every": 0})
    with caplog.at_level(logging.INFO, logger=progress.LOGGER):
        out = rl_orchestrate(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == progress.LOGGER
             and r.getMessage().startswith("rl-orchestrate: ")]
    assert lines[0] == "rl-orchestrate: steps 0..1" and lines[-1].startswith("rl-orchestrate: done, 2 steps"), lines
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"rl-orchestrate: step (\d+)/2 ", line))]
    assert steps == sorted(steps) and {1, 2} <= set(steps), lines  # heartbeats may repeat a step
    assert [r["step"] for r in out["steps"]] == [0, 1]
    assert all(r["accepted"] == len(cfg.workers.names) * PROMPTS * GROUP for r in out["steps"])
    check_ledger(cfg, 2)
    with get_client(sync_client=True) as client:
        # the Prefect harness is shared by the session: keep this run's flow runs only
        names = {f: [r.state.type.value if r.state else None for r in client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[f])))
            if r.parameters["config"]["run_name"] == cfg.run_name and r.parameters["config"]["storage"]["url"]
            == cfg.storage.url]
            for f in ("rl-generate", "rl-validate", "rl-update")}
    assert names == {"rl-generate": ["COMPLETED"] * 4, "rl-validate": ["COMPLETED"] * 2,
                     "rl-update": ["COMPLETED"] * 2}
    assert rl_orchestrate(cfg)["steps"] == []  # all committed: nothing left


@pytest.mark.usefixtures("prefect_harness")
def test_rl_step_flow_generates_in_process(base):
    cfg = rl_cfg(base, async_level=0, workers={"max_submissions": 2},
                 online_filter={"min_signal_samples": 10_000, "max_rounds": 1})
    summary = rl_step(cfg, 0)
    # the online filter: with no signal (an untrained model never solves a sum) one round, each worker twice
    assert len(list_submissions(run_storage(cfg), 0)) == 4
    assert summary.accepted == 4 * PROMPTS * GROUP and summary.rejected == 0 and summary.policy_steps == [0]
    with Ledger(ledger_path(cfg)) as ledger:  # the summary counts every round, as the ledger's step does
        step = ledger.get_step(0)
        assert (step["accepted"], step["timings"]["filter_rounds"]) == (4 * PROMPTS * GROUP, 1)
    with pytest.raises(ValueError, match="already committed"):
        rl_step(cfg, 0)


def _cli_env() -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def to_toml(data: dict, prefix: str = "") -> str:
    """TOML of a config dump: scalars and lists first, then one table per nested dict."""
    flat = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    head = [f"[{prefix}]"] if prefix and flat else []
    tables = [to_toml(v, f"{prefix}.{k}" if prefix else k) for k, v in data.items() if isinstance(v, dict)]
    return "\n".join(head + flat + [""] + tables)


@pytest.mark.usefixtures("prefect_harness")
def test_killed_run_resumes_and_counts_each_sample_once(base, tmp_path):
    cfg = rl_cfg(base, steps=8, eval={"every": 0})
    config = tmp_path / "rl.toml"
    config.write_text("# run: rl\n" + to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    cmd = [sys.executable, "-m", "flows.cli", "rl", "--config", str(config)]
    log = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_cli_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    storage = run_storage(cfg)
    deadline = time.monotonic() + 240
    while not storage.is_stable(3, CHECKPOINTS):  # mid-run: steps 0-2 done, later ones in flight
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the orchestrating flow only; its workers notice and exit
    proc.wait(timeout=30)
    log.close()
    with Ledger(ledger_path(cfg)) as ledger:
        assert len(ledger.committed_steps()) < 8

    second = subprocess.run(cmd, cwd=ROOT, env=_cli_env(), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert storage.complete_steps(CHECKPOINTS) == list(range(9))
    check_ledger(cfg, 8)


@pytest.mark.usefixtures("prefect_harness")
def test_filter_flow_scores_keeps_window_and_records(base):
    cfg = FilterRunConfig.model_validate({
        "storage": {"url": f"file://{base}"}, "init": {"from_run": "base"},
        "tasks": {"size": 40, "data": {"max_digits": 1}},
        "filter": {"k": 4, "min_rate": 0.0, "max_rate": 0.5, "max_tokens": 3, "chunk_size": 16},
    })
    report = filter_pass_at_k(cfg)
    assert report.prompts == 40 and sum(report.histogram) == 40
    assert report.kept == sum(report.histogram[:3])  # 0, 1 or 2 of 4 solved
    storage = run_storage(cfg)
    assert len(storage.listdir("parts")) == 3
    kept = load_math_tasks(Path(str(base)) / "filter" / "tasks.jsonl").tasks
    assert len(kept) == report.kept
    with Ledger(ledger_path(cfg)) as ledger:
        (model,) = {r["model"] for r in ledger._query("SELECT model FROM solve_rates")}
        rows = ledger.solve_rates(model)
        assert len(rows) == 40 and sum(r["kept"] for r in rows) == report.kept
    assert filter_pass_at_k(cfg).histogram == report.histogram  # a rerun reuses the parts
