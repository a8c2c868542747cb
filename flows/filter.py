"""``filter-pass-at-k``: score a task pool with the current model and keep the prompts in the window.

Tasks: one ``score-chunk`` per ``filter.chunk_size`` prompts (writes ``parts/part-NNNNN.parquet``,
skipped when it exists, so a rerun resumes), then ``collect-scores`` (writes ``solve_rates.parquet``
and ``tasks.jsonl`` at the run's root and the solve rates into the ledger). An RL run trains on the
result with ``tasks.file = "<filter run>/tasks.jsonl"``.
"""

from __future__ import annotations

from typing import cast

import pyarrow as pa
import torch
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from flows.artifacts import artifact_key
from flows.progress import show_progress
from intellect.checkpoints import local_digest
from intellect.inference.engines import load_tokenizer, make_engine
from intellect.ledger import Ledger
from intellect.progress import Progress
from intellect.rl.trainer.filter import (
    from_parquet, histogram, kept_tasks_jsonl, scores_table, solve_counts, to_parquet,
)
from intellect.rl.config import FilterRunConfig
from intellect.rl.trainer.setup import initial_folder, ledger_path, run_storage, task_pool

PARTS = "parts"


class FilterReport(BaseModel):
    model: str
    prompts: int
    kept: int
    histogram: list[int]
    tasks_file: str
    solve_rates_file: str


_ENGINES: dict[str, tuple] = {}


def _engine(cfg: FilterRunConfig):
    """(engine, tokenizer, where from, checkpoint digest) of the filter's model, built once per process."""
    key = "\0".join(c.model_dump_json() for c in (cfg.init, cfg.engine, cfg.compute))
    if key not in _ENGINES:
        with initial_folder(cfg.init, cfg) as (folder, origin):
            engine = make_engine(cfg.engine.kind, folder, cfg.compute, cfg.engine)
            _ENGINES[key] = (engine, load_tokenizer(folder), origin, local_digest(folder, inference=True))
    return _ENGINES[key]


@task(name="score-chunk", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def score_chunk(cfg: FilterRunConfig, index: int) -> int:
    """Solve counts of prompts ``[index * chunk, (index + 1) * chunk)`` into ``parts/``; prompts scored."""
    storage = run_storage(cfg)
    rel = f"{PARTS}/part-{index:05d}.parquet"
    tasks = task_pool(cfg.tasks, storage)[index * cfg.filter.chunk_size:(index + 1) * cfg.filter.chunk_size]
    if not storage.exists(rel):
        engine, tok, _, _ = _engine(cfg)
        counts = solve_counts(engine, tok, tasks, cfg.filter, cfg.tasks.reward_fn())
        storage.write_bytes(rel, to_parquet(scores_table(tasks, counts, cfg.filter)))
    return len(tasks)


@task(name="collect-scores", cache_policy=NO_CACHE, retries=1, timeout_seconds=1800)
def collect_scores(cfg: FilterRunConfig, chunks: int) -> FilterReport:
    storage = run_storage(cfg)
    table = pa.concat_tables([from_parquet(storage.read_bytes(f"{PARTS}/part-{i:05d}.parquet"))
                              for i in range(chunks)])
    storage.write_bytes("solve_rates.parquet", to_parquet(table))
    storage.write_text("tasks.jsonl", kept_tasks_jsonl(table))
    _, _, origin, sha = _engine(cfg)
    # the scores table's schema (scores_table): non-null columns of these types
    ids = cast(list[str], table["prompt_id"].to_pylist())
    solved, kept = cast(list[int], table["solved"].to_pylist()), cast(list[bool], table["kept"].to_pylist())
    with Ledger(ledger_path(cfg)) as ledger:
        ledger.record_solve_rates(sha, cfg.filter.k, zip(ids, solved, kept))
    return FilterReport(model=origin, prompts=len(solved), kept=sum(kept), histogram=histogram(solved, cfg.filter.k),
                        tasks_file=storage.uri("tasks.jsonl"), solve_rates_file=storage.uri("solve_rates.parquet"))


@flow(name="filter-pass-at-k", log_prints=True)
def filter_pass_at_k(config: FilterRunConfig | None = None) -> FilterReport:
    cfg = config or FilterRunConfig()
    show_progress(cfg.logging)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    n = len(task_pool(cfg.tasks, run_storage(cfg)))
    chunks = -(-n // cfg.filter.chunk_size)
    bar = Progress(f"filter {cfg.run_name}", n, unit="prompt", heartbeat=True)
    bar.begin(f"pass@{cfg.filter.k} of {n} prompts in {chunks} chunks")
    with bar:
        for i in range(chunks):  # in turn: the chunks share the CPU, threads would only contend
            bar.waiting(f"scoring chunk {i + 1}/{chunks}")
            bar.update(advance=score_chunk(cfg, i))
    report = collect_scores(cfg, chunks)
    f = cfg.filter
    create_table_artifact(key=artifact_key(cfg.run_name, "solve-histogram"),
                          table=[{"solved_of_k": i, "prompts": c} for i, c in enumerate(report.histogram)],
                          description=f"Prompts by samples solved of {f.k}")
    text = (f"# Difficulty filter `{cfg.run_name}`\n\nModel {report.model}: {report.kept} of {report.prompts} prompts "
            f"kept (pass rate in [{f.min_rate:g}, {f.max_rate:g}] with k={f.k} at T={f.temperature}).\n\n"
            f"Histogram of solves: {report.histogram}\n\nTasks: {report.tasks_file}")
    create_markdown_artifact(markdown=text, description="pass@k filter")
    get_run_logger().info("kept %d of %d prompts (pass rate in [%g, %g], k=%d); solves histogram %s; tasks %s",
                          report.kept, report.prompts, f.min_rate, f.max_rate, f.k, report.histogram,
                          report.tasks_file)
    return report
