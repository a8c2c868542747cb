"""The smoke pipeline on a text corpus: tokenizer trained on the corpus, packed batches, held-out
perplexity before and after, and a per-step metrics series DuckDB reads."""

from __future__ import annotations

import json
import random

import duckdb
import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.artifacts import artifact_key
from flows.smoke import smoke, summary
from intellect import pretrain as P
from intellect.checkpoints import fetch
from intellect.config import SmokeConfig
from intellect.storage import RunStorage

NAMES = ["alpha", "beta", "gamma", "delta", "omega", "total", "count", "value", "index", "score"]
OPS = ["+", "-", "*"]


def write_corpus(folder, documents: int = 240) -> str:
    """A JSONL corpus of small, regular Python functions: structure a tiny model learns in a few steps."""
    rng = random.Random(0)
    rows = []
    for i in range(documents):
        a, b = rng.sample(NAMES, 2)
        op = rng.choice(OPS)
        body = "\n".join(f"    {a} = {a} {rng.choice(OPS)} {rng.randint(1, 9)}" for _ in range(rng.randint(1, 3)))
        rows.append({"text": f"def {a}_{i}({a}, {b}):\n{body}\n    return {a} {op} {b}\n"})
    path = folder / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def text_cfg(tmp_path, **sections) -> SmokeConfig:
    base = {
        "run_name": "text",
        "storage": {"url": f"file://{tmp_path}/runs"},
        "model": {"tokenizer": str(tmp_path / "tokenizer"), "tokenizer_vocab": 320, "num_layers": 2,
                  "hidden_size": 64, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 128,
                  "max_position_embeddings": 64},
        "data": {"kind": "text", "heldout_percent": 20,
                 "text": {"files": [write_corpus(tmp_path)], "seq_len": 32, "eval_sequences": 8}},
        "train": {"steps": 40, "batch_size": 8, "micro_batch_size": 4, "lr": 5e-3, "warmup_steps": 5},
        "compute": {"device": "cpu"},
        "logging": {"every": 3},
    }
    for name, values in sections.items():
        base[name] = {**base[name], **values}
    return SmokeConfig.model_validate(base)


@pytest.mark.slow
def test_text_smoke_lowers_heldout_perplexity_and_logs_queryable_metrics(tmp_path):
    cfg = text_cfg(tmp_path)
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    assert not (tmp_path / "tokenizer").exists()
    start = P.init_checkpoint(cfg, storage)
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()  # trained on the corpus first
    before = P.heldout_eval(cfg, storage, start)
    assert before["accuracy"] is None and before["n"] == 8 and before["tokens"] == 8 * 31
    out = P.pretrain(cfg, storage, start)
    after = P.heldout_eval(cfg, storage, out.step)
    assert after["perplexity"] < 0.5 * before["perplexity"], (before, after)
    assert after["perplexity"] == pytest.approx(torch.tensor(after["loss"]).exp().item(), rel=1e-5)
    assert out.tokens == 40 * 8 * 31 and out.tokens_per_second > 0 and 0 < (out.mfu or 0) < 1
    assert out.device == "cpu" and out.precision == "fp32"

    series = storage.local_path(P.METRICS_SERIES)
    assert series is not None and series.is_file()
    rows, first, last, tokens, positive, mfu_max = duckdb.sql(
        f"SELECT count(*), min(step), max(step), min(tokens), bool_and(tokens_per_s > 0 AND seconds > 0), "
        f"max(mfu) FROM read_json_auto('{series}')"
    ).fetchall()[0]
    assert (rows, first, last, tokens) == (14, 3, 40, 8 * 31)  # every 3rd step, and the last
    assert positive and 0 < mfu_max < 1
    columns = {r[0] for r in duckdb.sql(f"DESCRIBE SELECT * FROM read_json_auto('{series}')").fetchall()}
    assert {"step", "time", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "seconds"} <= columns

    # a retried task reuses the published checkpoint and its report
    again = P.pretrain(cfg, storage, start)
    assert again.resumed and again.tokens == out.tokens and again.mfu == out.mfu


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.float32), ("bf16", torch.bfloat16)])
def test_text_checkpoints_are_published_on_the_cpu_in_the_weight_dtype(tmp_path, precision, dtype):
    cfg = text_cfg(tmp_path, compute={"device": "cpu", "precision": precision},
                   train={"steps": 3, "batch_size": 4, "micro_batch_size": 2},
                   data={"text": {"files": [write_corpus(tmp_path)], "seq_len": 32, "eval_sequences": 4,
                                  "document_mask": True}})
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    out = P.pretrain(cfg, storage, P.init_checkpoint(cfg, storage))
    model, _ = fetch(storage, out.step)
    assert {p.dtype for p in model.parameters()} == {dtype} and out.precision == precision
    assert P.heldout_eval(cfg, storage, out.step)["loss"] > 0
    with pytest.raises(ValueError, match="arithmetic"):
        P.pass_rate_report(cfg, storage, out.step)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_text_smoke_flow_reports_perplexity_throughput_and_no_pass_rates(tmp_path):
    cfg = text_cfg(tmp_path, train={"steps": 12})
    report = smoke(cfg)
    assert report.pass_rates is None and report.before.accuracy is None
    assert report.after.perplexity < report.before.perplexity
    text = summary(report)
    assert f"{report.after.perplexity:,.2f}" in text and "n/a" in text and "MFU" in text
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(cfg.run_name, "throughput")])))
    assert artifacts and "tokens_per_second" in str(artifacts[0].data)
