"""``workers.engine.kind`` reaches the run's worker processes: a run asking for vLLM where this Python has
none gets workers that stop with their own exit code and a line saying how to get vLLM, never a
traceback or a hang (vLLM runs themselves: tests/vllm, in the vLLM environment)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flows.rl import rl_train
from intellect.checkpoints import publish
from intellect.config import ModelConfig
from intellect.inference.engines import VLLM_PYTHON_ENV, vllm_installed
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
