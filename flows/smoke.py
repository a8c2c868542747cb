"""The smoke run: build the tiny model, pretrain it briefly, report held-out accuracy."""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from flows.artifacts import artifact_key
from intellect.config import SmokeConfig
from tasks.pretrain import EvalReport, PassRateReport, PretrainReport, evaluate_checkpoint, init_checkpoint, pass_rates, pretrain


class SmokeReport(BaseModel):
    run_name: str
    before: EvalReport
    after: EvalReport
    pretrain: PretrainReport
    pass_rates: PassRateReport | None
    seconds: float


def summary(r: SmokeReport) -> str:
    lines = [
        f"# Smoke run `{r.run_name}`",
        "",
        "| | held-out loss | greedy exact match |",
        "|---|---|---|",
        f"| before (step {r.before.step}) | {r.before.loss:.3f} | {r.before.accuracy:.1%} |",
        f"| after (step {r.after.step}) | {r.after.loss:.3f} | {r.after.accuracy:.1%} |",
        "",
        f"Pretraining: {r.pretrain.step - r.before.step} steps, {r.pretrain.tokens:,} tokens in "
        f"{r.pretrain.seconds:.1f} s ({r.pretrain.tokens_per_second:,.0f} tokens/s)"
        + (" (reused an existing checkpoint)" if r.pretrain.resumed else ""),
    ]
    if r.pass_rates:
        p = r.pass_rates
        lines += [
            f"Pass rates over {p.prompts} held-out prompts, {p.k} samples at T={p.temperature}: "
            f"{p.share_in_window:.1%} solved by 1..{p.k // 2} of {p.k}; mean pass rate {p.mean_pass_rate:.1%}; "
            f"histogram of solves {p.histogram}",
        ]
    lines.append(f"Total wall time: {r.seconds:.1f} s")
    return "\n".join(lines)


@flow(name="smoke", log_prints=True)
def smoke(config: SmokeConfig | None = None) -> SmokeReport:
    cfg = config or SmokeConfig()
    t0 = time.perf_counter()
    start = init_checkpoint(cfg)
    before = evaluate_checkpoint(cfg, start)
    trained = pretrain(cfg, start)
    after = evaluate_checkpoint(cfg, trained.step)
    rates = pass_rates(cfg, trained.step) if cfg.pass_at_k_samples else None
    report = SmokeReport(run_name=cfg.run_name, before=before, after=after, pretrain=trained,
                         pass_rates=rates, seconds=time.perf_counter() - t0)
    create_table_artifact(
        key=artifact_key(cfg.run_name, "accuracy"),
        table=[{"phase": "before", **before.model_dump()}, {"phase": "after", **after.model_dump()}],
        description="Held-out loss and greedy exact-match accuracy before and after pretraining",
    )
    text = summary(report)
    create_markdown_artifact(markdown=text, description="Smoke run summary")
    print(text)
    return report
