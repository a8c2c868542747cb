"""The smoke run: build a model, pretrain it briefly (arithmetic or a text corpus), report held-out loss and
perplexity (and accuracy and pass rates for arithmetic), tokens/s and MFU."""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from flows.artifacts import artifact_key
from flows.progress import show_progress
from intellect.config import SmokeConfig
from tasks.pretrain import EvalReport, PassRateReport, PretrainReport, evaluate_checkpoint, init_checkpoint, pass_rates, pretrain


class SmokeReport(BaseModel):
    run_name: str
    before: EvalReport
    after: EvalReport
    pretrain: PretrainReport
    pass_rates: PassRateReport | None
    seconds: float


def _accuracy(e: EvalReport) -> str:
    return "n/a" if e.accuracy is None else f"{e.accuracy:.1%}"


def _mfu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2%}"


def summary(r: SmokeReport) -> str:
    p = r.pretrain
    lines = [
        f"# Smoke run `{r.run_name}`",
        "",
        "| | held-out loss | held-out perplexity | greedy exact match |",
        "|---|---|---|---|",
        f"| before (step {r.before.step}) | {r.before.loss:.3f} | {r.before.perplexity:,.2f} | {_accuracy(r.before)} |",
        f"| after (step {r.after.step}) | {r.after.loss:.3f} | {r.after.perplexity:,.2f} | {_accuracy(r.after)} |",
        "",
        f"Pretraining: {p.step - r.before.step} steps, {p.tokens:,} tokens in {p.seconds:.1f} s "
        f"({p.tokens_per_second:,.0f} tokens/s, MFU {_mfu(p.mfu)}"
        + (f", {p.device} {p.precision})" if p.device else ")")
        + (" (reused an existing checkpoint)" if p.resumed else ""),
        f"Per-step metrics: `{p.metrics}`",
    ]
    if r.pass_rates:
        q = r.pass_rates
        lines += [
            f"Pass rates over {q.prompts} held-out prompts, {q.k} samples at T={q.temperature}: "
            f"{q.share_in_window:.1%} solved by 1..{q.k // 2} of {q.k}; mean pass rate {q.mean_pass_rate:.1%}; "
            f"histogram of solves {q.histogram}",
        ]
    lines.append(f"Total wall time: {r.seconds:.1f} s")
    return "\n".join(lines)


@flow(name="smoke", log_prints=True)
def smoke(config: SmokeConfig | None = None) -> SmokeReport:
    cfg = config or SmokeConfig()
    show_progress(cfg.logging)
    t0 = time.perf_counter()
    start = init_checkpoint(cfg)
    before = evaluate_checkpoint(cfg, start)
    trained = pretrain(cfg, start)
    after = evaluate_checkpoint(cfg, trained.step)
    rates = pass_rates(cfg, trained.step) if cfg.pass_at_k_samples and cfg.data.kind == "arithmetic" else None
    report = SmokeReport(run_name=cfg.run_name, before=before, after=after, pretrain=trained,
                         pass_rates=rates, seconds=time.perf_counter() - t0)
    create_table_artifact(
        key=artifact_key(cfg.run_name, "accuracy"),
        table=[{"phase": "before", **before.model_dump()}, {"phase": "after", **after.model_dump()}],
        description="Held-out loss, perplexity and (arithmetic) greedy exact-match accuracy before and after "
        "pretraining",
    )
    create_table_artifact(
        key=artifact_key(cfg.run_name, "throughput"),
        table=[{k: getattr(trained, k) for k in ("step", "tokens", "seconds", "tokens_per_second", "mfu",
                                                 "device", "precision")}],
        description="Pretraining throughput: tokens/s and model FLOPs utilization",
    )
    text = summary(report)
    create_markdown_artifact(markdown=text, description="Smoke run summary")
    print(text)
    return report
