"""``demo``: the whole pipeline on one machine, with one report.

DiLoCo pretraining (``diloco-train``: worker processes, int8 all-reduce) -> the pass@k difficulty
filter (``filter-pass-at-k``) -> asynchronous GRPO (``rl-train``: ``intellect worker`` processes
behind the submission service, TOPLOC validation, signed SHARDCAST broadcast, the DuckDB ledger).
Held-out greedy accuracy is measured on the same problems before and after each phase; the report
(markdown artifact, printed, and ``<rl run>/report.md``) has the gains, the plots, the ledger
summary and where to look in the dashboard.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from flows.artifacts import artifact_key
from flows.diloco import diloco_train, start_run
from flows.filter import filter_pass_at_k
from flows.rl import rl_train
from intellect.ledger import Ledger
from intellect.pipeline import DemoConfig, plot_pretraining
from intellect.rl.trainer.report import CURVE
from intellect.rl.trainer.setup import ledger_path, run_storage
from intellect.storage import RunStorage
from tasks.rl import EvalPoint, evaluate_run


class DemoReport(BaseModel):
    accuracy: dict[str, EvalPoint]  # before, pretrained, after
    seconds: dict[str, float]
    kept_prompts: int | None
    ledger: dict[str, int]  # accepted and rejected samples, rejected by reason
    plots: dict[str, str]
    report: str


def _ledger_summary(cfg) -> dict[str, int]:
    out: dict[str, int] = {"accepted": 0, "rejected": 0}
    with Ledger(ledger_path(cfg)) as ledger:
        for row in ledger.summary():
            out[row["status"]] += row["n"]
            if row["status"] == "rejected":
                out[f"rejected:{row['reason']}"] = out.get(f"rejected:{row['reason']}", 0) + row["n"]
    return out


@flow(name="demo", log_prints=True)
def demo(config: DemoConfig | None = None) -> DemoReport:
    cfg = config or DemoConfig()
    logger = get_run_logger()
    rl = cfg.rl
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()

    def acc(run: str, step: int | None) -> EvalPoint:
        return evaluate_run(rl.storage, run, step, rl.tasks, rl.eval.size, rl.submission)

    t = time.perf_counter()
    # the newest checkpoint before pretraining (step 0 on a fresh run; retention prunes it later)
    before = acc(cfg.diloco.run_name, start_run(cfg.diloco))
    pre = diloco_train(cfg.diloco)
    seconds["diloco"] = time.perf_counter() - t
    pretrained = acc(cfg.diloco.run_name, None)
    logger.info("DiLoCo: held-out accuracy %.1f%% -> %.1f%%", 100 * before.accuracy, 100 * pretrained.accuracy)
    diloco_storage = RunStorage.from_config(cfg.diloco.storage, cfg.diloco.run_name)
    diloco_storage.write_bytes("metrics/loss.png", plot_pretraining(pre.steps, f"DiLoCo {cfg.diloco.run_name}"))

    kept = None
    if cfg.filter is not None:
        t = time.perf_counter()
        kept = filter_pass_at_k(cfg.filter).kept
        seconds["filter"] = time.perf_counter() - t

    t = time.perf_counter()
    report = rl_train(rl)
    seconds["rl"] = time.perf_counter() - t
    after = acc(rl.run_name, None)
    seconds["total"] = time.perf_counter() - t0
    ledger = _ledger_summary(rl)
    plots = {"pretraining loss": diloco_storage.uri("metrics/loss.png"), "RL curve": run_storage(rl).uri(CURVE)}

    rows = [
        {"phase": f"DiLoCo pretraining ({cfg.diloco.diloco.workers} workers, outer steps {before.step} -> "
                  f"{pretrained.step}, {cfg.diloco.diloco.inner_steps} inner steps each)",
         "start": before.accuracy, "end": pretrained.accuracy,
         "gain_points": 100 * (pretrained.accuracy - before.accuracy), "seconds": seconds["diloco"]},
        {"phase": f"RL ({report.steps} steps, async_level {rl.async_level}, policy lag {rl.policy_lag}, TOPLOC "
                  f"{'on' if rl.toploc else 'off'}, SHARDCAST {'on' if rl.shardcast else 'off'})",
         "start": pretrained.accuracy, "end": after.accuracy,
         "gain_points": 100 * (after.accuracy - pretrained.accuracy), "seconds": seconds["rl"]},
    ]
    lines = ["# intellect demo", "", "| phase | held-out accuracy before | after | gain | wall time |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['phase']} | {r['start']:.1%} | {r['end']:.1%} | {r['gain_points']:+.1f} points | "
              f"{r['seconds']:.0f} s |" for r in rows]
    lines += ["", f"Held-out: {rl.eval.size} arithmetic problems never trained on, greedy exact match.",
              f"Filter: {kept} prompts kept." if kept is not None else "Filter: skipped.",
              f"Ledger ({ledger_path(rl)}): {ledger['accepted']:,} samples accepted, {ledger['rejected']:,} rejected"
              + "".join(f"; {k.split(':', 1)[1]}: {v:,}" for k, v in ledger.items() if k.startswith("rejected:")),
              "", "Plots: " + ", ".join(f"{k}: {v}" for k, v in plots.items()),
              f"Total wall time: {seconds['total']:.0f} s", "",
              "In the dashboard: the `demo` flow run and its sub-flow runs `diloco-train`, `filter-pass-at-k` and "
              "`rl-train` (with a `diloco-outer-step` run per worker and outer step); artifacts "
              f"`{artifact_key(rl.run_name, 'rl-step')}` (per-step table), "
              f"`{artifact_key(rl.run_name, 'rl-summary')}`, `{artifact_key('demo', 'report')}`; "
              "events `intellect.rl.*` and `intellect.diloco.*` in the event feed."]
    text = "\n".join(lines)
    run_storage(rl).write_text("report.md", text + "\n")
    create_table_artifact(key=artifact_key("demo", "phases"), table=rows, description="Accuracy by phase")
    create_markdown_artifact(key=artifact_key("demo", "report"), markdown=text, description="intellect demo")
    print(text)
    return DemoReport(accuracy={"before": before, "pretrained": pretrained, "after": after}, seconds=seconds,
                      kept_prompts=kept, ledger=ledger, plots=plots, report=run_storage(rl).uri("report.md"))
