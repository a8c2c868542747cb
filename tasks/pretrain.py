"""Prefect tasks of single-machine pretraining: each one side effect on run storage.

Tasks take the run config (a small pydantic model) and step numbers, and
return small pydantic reports; weights travel through run storage, never
through Prefect.
"""

from __future__ import annotations

from dataclasses import asdict

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from intellect import pretrain as pretraining
from intellect.config import SmokeConfig
from intellect.storage import RunStorage


class EvalReport(BaseModel):
    step: int
    loss: float
    perplexity: float
    accuracy: float | None  # greedy exact match (arithmetic); None for a text corpus
    n: int  # held-out problems or packed sequences
    tokens: int
    seconds: float


class PretrainReport(BaseModel):
    step: int
    seconds: float
    tokens: int
    first_loss: float
    final_loss: float
    resumed: bool
    tokens_per_second: float
    mfu: float | None
    device: str
    precision: str
    metrics: str  # URI of the per-step metrics series (JSONL)


class PassRateReport(BaseModel):
    step: int
    k: int
    prompts: int
    temperature: float
    histogram: list[int]
    share_in_window: float
    mean_pass_rate: float
    seconds: float


def _storage(cfg: SmokeConfig) -> RunStorage:
    return RunStorage.from_config(cfg.storage, cfg.run_name)


@task(name="init-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=600)
def init_checkpoint(cfg: SmokeConfig) -> int:
    return pretraining.init_checkpoint(cfg, _storage(cfg))


@task(name="pretrain", cache_policy=NO_CACHE, retries=1, timeout_seconds=6 * 3600)
def pretrain(cfg: SmokeConfig, from_step: int) -> PretrainReport:
    out = pretraining.pretrain(cfg, _storage(cfg), from_step)  # its progress lines: intellect.progress
    return PretrainReport(**asdict(out), tokens_per_second=out.tokens_per_second,
                          metrics=_storage(cfg).uri(pretraining.METRICS_SERIES))


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE, retries=1, timeout_seconds=1800)
def evaluate_checkpoint(cfg: SmokeConfig, step: int) -> EvalReport:
    return EvalReport(**pretraining.heldout_eval(cfg, _storage(cfg), step))


@task(name="pass-rates", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def pass_rates(cfg: SmokeConfig, step: int) -> PassRateReport:
    return PassRateReport(**pretraining.pass_rate_report(cfg, _storage(cfg), step))
