"""``workers.engine.kind`` reaches the run's worker processes: the demo (``intellect demo ...
rl.workers.engine.kind=vllm``) starts its RL workers from the vLLM environment (``make venv-vllm``; ``make
test`` builds it first) and its held-out accuracy rises, every rollout accepted by the torch validator and
each worker's one engine taking every new policy in place; where no Python has vLLM the workers stop with
their own exit code and a line saying how to get it, never a traceback or a hang (the engine itself:
tests/vllm)."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from flows.demo import demo
from flows.rl import rl_train
from intellect.checkpoints import publish
from intellect.config import ModelConfig, load_config
from intellect.inference.engines import VLLM_PYTHON_ENV, VLLM_VENV, vllm_installed
from intellect.ledger import Ledger
from intellect.rl.trainer.setup import ledger_path
from intellect.model.checkpoint import build_model
from intellect.pipeline import DemoConfig
from intellect.rl.config import RLRunConfig
from intellect.rl.worker.worker import EXIT_NO_ENGINE
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow

TINY = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here")
@pytest.mark.usefixtures("prefect_harness")
def test_a_vllm_run_without_vllm_stops_its_workers_with_a_clear_exit(tmp_path: Path, monkeypatch):
    # the workers of a vllm run start under the vLLM environment's Python: here, one without vLLM
    monkeypatch.setenv(VLLM_PYTHON_ENV, sys.executable)
    model, tok = build_model(TINY)
    publish(model, tok, RunStorage(f"file://{tmp_path}/base"), 0)
    cfg = RLRunConfig.model_validate({
        "run_name": "rl", "storage": {"url": f"file://{tmp_path}"}, "init": {"from_run": "base"},
        "tasks": {"size": 16, "data": {"max_digits": 1}}, "steps": 1, "async_level": 1,
        "workers": {"names": ["alice"], "poll_interval": 0.02, "submission_timeout": 10, "checkpoint_timeout": 60,
                    "engine": {"kind": "vllm"}},
        "submission": {"prompts_per_submission": 2, "group_size": 2, "max_tokens": 4},
        "eval": {"every": 0, "size": 4}, "trainer_threads": 1, "toploc": {"k": 16},
    })
    report = rl_train(cfg)
    assert report.worker_exit_codes == {"alice": EXIT_NO_ENGINE}
    log = (tmp_path / "rl" / "logs" / "alice.log").read_text()
    assert "make venv-vllm" in log and "Traceback" not in log


VLLM_PYTHON = os.environ.get(VLLM_PYTHON_ENV) or (str(VLLM_VENV / "bin" / "python")
                                                   if (VLLM_VENV / "bin" / "python").exists() else None)
ROOT = Path(__file__).resolve().parents[2]
DEMO_STEPS, DEMO_PROMPTS, DEMO_GROUP = 16, 8, 8


def learning_demo(root: Path, kind: str) -> DemoConfig:
    """``configs/demo.toml`` at a size that learns within a CI test, its RL workers on engine ``kind``.
    Single-digit sums and differences, a fifth of them held out, written with the sign flipped in 60% of
    the pretraining documents: DiLoCo teaches the magnitudes and leaves most greedy answers with the
    wrong sign, which RL's exact reward corrects. vLLM's CPU attention needs heads of 32 values or more."""
    url = f"file://{root}"
    model = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 128,
             "max_position_embeddings": 32}
    data = {"max_digits": 1, "heldout_percent": 20}
    return load_config(DemoConfig, ROOT / "configs" / "demo.toml", [
        *[f"diloco.model.{k}={v}" for k, v in model.items()],
        *[f"{phase}.{k}={v}" for phase in ("diloco.data", "filter.tasks.data", "rl.tasks.data")
          for k, v in data.items()],
        f"diloco.storage.url={url}", "diloco.train.batch_size=64", "diloco.train.lr=3e-3", "diloco.train.warmup_steps=20",
        "diloco.diloco.inner_steps=200", "diloco.diloco.outer_steps=4", "diloco.diloco.heartbeat_interval=0.5",
        "diloco.diloco.heartbeat_timeout=5",
        f"filter.storage.url={url}", "filter.tasks.size=200", "filter.filter.k=4", "filter.filter.min_rate=0",
        "filter.filter.max_rate=1", "filter.filter.max_tokens=4",
        f"rl.storage.url={url}", f"rl.steps={DEMO_STEPS}", "rl.eval.every=4", "rl.eval.size=64",
        "rl.workers.poll_interval=0.02",
        f"rl.submission.prompts_per_submission={DEMO_PROMPTS}", f"rl.submission.group_size={DEMO_GROUP}",
        "rl.submission.max_tokens=4", "rl.trainer.lr=3e-4", "rl.trainer.warmup_steps=0", "rl.toploc.k=32",
        "rl.shardcast.shard_size=65536", f"rl.workers.engine.kind={kind}",
    ], environ={})


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM environment (make test builds .venv-vllm and names it)")
@pytest.mark.usefixtures("prefect_harness")
def test_the_demo_with_vllm_workers_raises_held_out_accuracy_with_every_policy_loaded_in_place(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = learning_demo(tmp_path, "vllm")
    report = demo(cfg)
    before, after = report.accuracy["pretrained"], report.accuracy["after"]
    assert after.step == DEMO_STEPS and after.accuracy > before.accuracy, report.accuracy
    logs = {name: (tmp_path / cfg.rl.run_name / "logs" / f"{name}.log").read_text() for name in cfg.rl.workers.names}
    # each worker started one vLLM engine (the log line is vLLM's own) and kept it for the whole run
    starts = {name: log.count("Initializing a V1 LLM engine") for name, log in logs.items()}
    assert set(starts.values()) == {1}, starts
    with Ledger(ledger_path(cfg.rl)) as ledger:  # every rollout of the vLLM workers passed the torch validator
        assert ledger.committed_steps() == list(range(DEMO_STEPS))
        for n in range(DEMO_STEPS):
            assert len(ledger.accepted(n)) == len(logs) * DEMO_PROMPTS * DEMO_GROUP
            assert ledger.get_step(n)["rejected"] == 0
    # each new policy loaded into the running engine: with the demo's fixed policy lag step n samples
    # checkpoint n - 1, so every step from 2 on brings one
    for name, log in logs.items():
        records = [ast.literal_eval(m) for m in re.findall(r"worker \S+ (\{'step'.*\})", log)]
        assert [r["step"] for r in records] == list(range(DEMO_STEPS)), name
        assert [r["policy_step"] for r in records] == [max(0, n - 1) for n in range(DEMO_STEPS)], records
        assert [r["weight_updates"] for r in records] == [max(0, n - 1) for n in range(DEMO_STEPS)], records
        assert records[-1]["weight_update_seconds"] > 0, records
