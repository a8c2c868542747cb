"""The smoke flow end to end under a real (temporary) Prefect server, on a few steps."""

from __future__ import annotations

import json
import math

import pytest

from flows.cli import main
from flows.smoke import smoke, summary
from intellect.config import SmokeConfig, load_config
from intellect.pretrain import METRICS_SERIES
from intellect.storage import RunStorage

pytestmark = pytest.mark.slow


def tiny_cfg(tmp_path, **over) -> SmokeConfig:
    overrides = [
        f"storage.url=file://{tmp_path}", "train.steps=30", "train.batch_size=16",
        "train.eval_size=32", "pass_at_k_prompts=8", "pass_at_k_samples=4", "model.num_layers=2",
    ] + [f"{k}={v}" for k, v in over.items()]
    return load_config(SmokeConfig, overrides=overrides, environ={})


@pytest.mark.usefixtures("prefect_harness")
def test_smoke_flow_trains_publishes_and_reports(tmp_path):
    cfg = tiny_cfg(tmp_path)
    state = smoke(cfg, return_state=True)
    assert state.is_completed()
    report = state.result()
    assert report.pretrain.step == 30 and not report.pretrain.resumed
    assert report.after.loss < report.before.loss
    assert report.after.perplexity < report.before.perplexity
    assert report.after.perplexity == pytest.approx(math.exp(report.after.loss))
    assert report.pass_rates and sum(report.pass_rates.histogram) == 8
    assert report.pretrain.tokens_per_second > 0 and 0 < (report.pretrain.mfu or 0) < 1
    text = summary(report)
    assert "held-out perplexity" in text and "tokens/s" in text and "MFU" in text

    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    assert storage.complete_steps("checkpoints") == [0, 30]
    saved = json.loads(storage.read_text("checkpoints/step_30/train_report.json"))
    assert saved["tokens"] == report.pretrain.tokens
    rows = [json.loads(line) for line in storage.read_text(METRICS_SERIES).splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31)) and sum(r["tokens"] for r in rows) == saved["tokens"]
    assert report.pretrain.metrics == storage.uri(METRICS_SERIES)

    # a rerun of the same run reuses the published checkpoint instead of failing or retraining
    again = smoke(cfg)
    assert again.pretrain.resumed and again.after.accuracy == report.after.accuracy


def test_cli_rejects_bad_config_in_one_line(capsys):
    assert main(["smoke", "train.lr=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "intellect: invalid config: train.lr: Input should be greater than 0 (got -1)"
