"""The ``demo`` flow end to end at toy size: DiLoCo pretraining (2 worker processes), the pass@k filter,
asynchronous RL with TOPLOC and SHARDCAST, and the report; plus the config's wiring checks."""

from __future__ import annotations

import pytest

from flows.demo import demo
from intellect.config import ConfigError, load_config
from intellect.pipeline import DemoConfig

pytestmark = pytest.mark.timeout(600)

TINY = ['model.num_layers=1', 'model.hidden_size=32', 'model.num_heads=2', 'model.num_kv_heads=2',
        'model.intermediate_size=64']


def demo_cfg(root) -> DemoConfig:
    url = f"file://{root}"
    return load_config(DemoConfig, "configs/demo.toml", [
        *[f"diloco.{o}" for o in TINY], f"diloco.storage.url={url}", "diloco.train.batch_size=8",
        "diloco.diloco.inner_steps=3", "diloco.diloco.outer_steps=2", "diloco.diloco.heartbeat_interval=0.5",
        "diloco.diloco.heartbeat_timeout=5", f"filter.storage.url={url}", "filter.tasks.size=64",
        "filter.filter.k=4", "filter.filter.min_rate=0", "filter.filter.max_rate=1", "filter.filter.max_tokens=4",
        f"rl.storage.url={url}", "rl.steps=2", "rl.eval.every=0", "rl.eval.size=16",
        "rl.submission.prompts_per_submission=2", "rl.submission.group_size=4", "rl.submission.max_tokens=4",
        "rl.toploc.k=32", "rl.shardcast.shard_size=4096", "rl.trainer.warmup_steps=0",
        "rl.workers.poll_interval=0.02",
    ], environ={})


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_the_demo_runs_every_phase_and_reports(tmp_path, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    report = demo(demo_cfg(tmp_path))
    assert set(report.accuracy) == {"before", "pretrained", "after"}
    assert report.accuracy["pretrained"].step == 2 and report.accuracy["after"].step == 2
    assert report.kept_prompts == 64
    assert report.ledger["accepted"] == 2 * 2 * 2 * 4 and report.ledger["rejected"] == 0
    text = (tmp_path / "demo-rl" / "report.md").read_text()
    assert "DiLoCo pretraining" in text and "TOPLOC on, SHARDCAST on" in text
    assert (tmp_path / "demo-diloco" / "metrics" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "demo-rl" / "metrics" / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_the_demo_config_keeps_the_phases_chained():
    ok = load_config(DemoConfig, "configs/demo.toml", [], environ={})
    assert ok.rl.init.from_run == ok.diloco.run_name == ok.filter.init.from_run
    for override, needle in [("rl.init.from_run=smoke", "rl.init.from_run must be the DiLoCo run"),
                             ("filter.init.from_run=smoke", "filter.init.from_run must be the DiLoCo run"),
                             ("rl.tasks.file=other.jsonl", "rl.tasks.file must be the filter's output"),
                             ("rl.storage.url=file:///elsewhere", "must share one storage.url"),
                             ("rl.run_name=demo-diloco", "distinct run_name")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(DemoConfig, "configs/demo.toml", [override], environ={})
