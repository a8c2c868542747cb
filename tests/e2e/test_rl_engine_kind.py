"""``workers.engine.kind`` reaches the run's worker processes: a run asking for vLLM starts its workers from
the vLLM environment (``make venv-vllm``; ``make test`` builds it first) and trains with them, each worker's
engine taking every new policy in place; where no Python has vLLM the workers stop with their own exit code
and a line saying how to get it, never a traceback or a hang (the engine itself: tests/vllm)."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from flows.rl import rl_train
from intellect.checkpoints import publish
from intellect.config import ModelConfig
from intellect.inference.engines import VLLM_PYTHON_ENV, VLLM_VENV, vllm_installed
from intellect.ledger import Ledger
from intellect.rl.trainer.setup import ledger_path
from intellect.model.checkpoint import build_model
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


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM environment (make test builds .venv-vllm and names it)")
@pytest.mark.usefixtures("prefect_harness")
def test_an_rl_run_with_vllm_workers_trains_with_every_policy_loaded_in_place(tmp_path: Path):
    # vLLM's CPU attention takes head sizes of 32 and up (TINY's is 16)
    model, tok = build_model(TINY.model_copy(update={"hidden_size": 64}))
    publish(model, tok, RunStorage(f"file://{tmp_path}/base"), 0)
    steps, prompts, group = 3, 2, 4
    cfg = RLRunConfig.model_validate({
        "run_name": "rl", "storage": {"url": f"file://{tmp_path}"}, "init": {"from_run": "base"},
        "tasks": {"size": 16, "data": {"max_digits": 1}}, "steps": steps, "async_level": 1,
        "workers": {"names": ["alice"], "poll_interval": 0.05, "submission_timeout": 300, "checkpoint_timeout": 300,
                    "engine": {"kind": "vllm"}},
        "submission": {"prompts_per_submission": prompts, "group_size": group, "max_tokens": 4},
        "trainer": {"lr": 1e-2, "warmup_steps": 0, "steps_per_rollout": 1},
        "compute": {"device": "cpu", "precision": "fp32"},
        "eval": {"every": 0, "size": 4}, "trainer_threads": 1, "toploc": {"k": 16},
    })
    report = rl_train(cfg)
    log = (tmp_path / "rl" / "logs" / "alice.log").read_text()
    assert report.worker_exit_codes == {"alice": 0}, log[-3000:]
    with Ledger(ledger_path(cfg)) as ledger:  # every rollout of the vLLM worker passed the torch validator
        assert ledger.committed_steps() == list(range(steps))
        for n in range(steps):
            assert len(ledger.accepted(n)) == prompts * group
            assert ledger.get_step(n)["rejected"] == 0
    # one engine for the whole run: each new policy loaded into it, never a rebuild
    records = [ast.literal_eval(m) for m in re.findall(r"worker \S+ (\{'step'.*\})", log)]
    assert [r["step"] for r in records] == list(range(steps))
    policies = [r["policy_step"] for r in records]
    changes = [sum(a != b for a, b in zip(policies[:i], policies[1:i + 1])) for i in range(len(policies))]
    assert [r["weight_updates"] for r in records] == changes and changes[-1] >= 1, records
