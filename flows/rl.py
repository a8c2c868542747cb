"""Asynchronous GRPO as Prefect flows: ``rl-step`` (one step's DAG) and ``rl-train`` (the run).

One step is the DAG ``collect -> validate -> record -> grpo-update -> broadcast -> commit-step``:
six task runs whatever the number of workers (``collect`` and ``validate`` handle each worker in a
thread of their own). In ``rl-train`` the generation is done by ``intellect worker`` processes
(:mod:`intellect.rl.worker.worker`; subprocesses of the flow run, or with ``workers.launch =
"deployments"`` flow runs of ``rl-worker`` on ``gpu-rollout``, :mod:`flows.rl_worker`), each with
its own key, which reach the run only through the submission service the flow starts beside the
trainer and get weights only through SHARDCAST (signed by the trainer; without ``cfg.shardcast``
the run starts a local origin alone, so remote workers can join the same way). They run up to
``async_level`` steps ahead of the trainer, so ``collect`` mostly finds their files already
written, and the flow ingests (collect, validate, record) step ``n + 1`` in a second thread while
step ``n`` trains: the pipelining of INTELLECT-2, bounded by the lag rule. ``rl-step`` alone
generates in this process (synchronous).

Each flow opens the run once (:func:`tasks.rl.open_run`, an :class:`~intellect.rl.trainer.run.RLRun`) and
its tasks act on it; ``rl-train`` holds SHARDCAST, the submission service and the workers in
context managers, so whatever it started stops when it ends, however it ends.

A killed run is resumed by running it again: the ledger says which steps are committed, storage
holds the files and checkpoints, and every task is idempotent.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, cast

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.utilities.annotations import quote
from pydantic import BaseModel

from flows.artifacts import BackgroundArtifacts, artifact_key
from flows.events import emit_rejections
from flows.progress import show_progress
from flows.rl_worker import worker_launcher
from intellect.progress import Progress
from intellect.rl.config import RLRunConfig
from tasks import rl as rl_tasks


class StepSummary(BaseModel):
    step: int
    policy_steps: list[int]
    accepted: int
    rejected: int
    reasons: dict[str, int]
    mean_reward: float | None
    trained_samples: int
    loss: float | None
    clip_fraction: float | None
    tokens_per_second: float | None
    missing_workers: list[str]
    kl: float | None = None
    seconds: float
    timings: dict[str, float]


class RLReport(BaseModel):
    run_name: str
    first_step: int
    steps: int
    seconds: float  # the step loop, evaluations included
    eval_seconds: float
    steps_per_hour: float  # evaluations excluded
    evals: list[dict]
    worker_exit_codes: dict[str, int | None]
    curve: str | None


class Ingested(BaseModel):
    """A step's rollouts, validated and recorded: what its update needs."""

    step: int
    results: list[rl_tasks.WorkerResult]
    record: rl_tasks.RecordReport
    seconds: float
    timings: dict[str, float]


def _q(cfg: RLRunConfig) -> RLRunConfig:
    # quote(): Prefect would otherwise walk the config's fields looking for futures at every task run,
    # a good share of a task run's cost; the task receives the config itself
    return cast(RLRunConfig, quote(cfg))


def ingest(cfg: RLRunConfig, step: int, local: bool) -> Ingested:
    """``collect -> validate -> record`` of one step (called inside a flow)."""
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    results = rl_tasks.collect(_q(cfg), step, local)
    timings["generate_wait"] = time.perf_counter() - t0

    rec = validate_and_record(cfg, step, timings)
    return Ingested(step=step, results=results, record=rec, seconds=time.perf_counter() - t0, timings=timings)


def validate_and_record(cfg: RLRunConfig, step: int, timings: dict[str, float]) -> rl_tasks.RecordReport:
    """``validate`` (the files of every worker that sent some) ``-> record`` (called inside a flow)."""
    t = time.perf_counter()
    by_worker = rl_tasks.step_files(cfg, step)  # every file, also from workers this run did not start
    reports = rl_tasks.validate(_q(cfg), step, by_worker)
    timings["validate"] = time.perf_counter() - t

    t = time.perf_counter()
    rec = rl_tasks.record(_q(cfg), step, [(r.verdicts, r.mac) for r in reports])
    timings["record"] = time.perf_counter() - t
    emit_rejections(cfg.run_name, step, {r.worker: (r.accepted, r.rejected) for r in reports},
                    cfg.alert_rejection_rate)
    return rec


def update(cfg: RLRunConfig, ing: Ingested) -> StepSummary:
    """``grpo-update -> broadcast -> commit-step`` of an ingested step (called inside a flow)."""
    t0 = time.perf_counter()
    step, results, rec, timings = ing.step, ing.results, ing.record, dict(ing.timings)
    # what the workers this run started say; a remote worker's done record is its own claim
    policies = sorted({r.policy_step for r in results if r.policy_step is not None and r.worker in cfg.workers.names})
    upd = train_broadcast_commit(cfg, step, policies[0] if policies else step, timings)
    rec = upd.counts or rec  # the online filter's rounds added samples after the ingest
    return StepSummary(
        step=step, policy_steps=policies, accepted=rec.accepted, rejected=rec.rejected, reasons=rec.reasons,
        mean_reward=rec.mean_reward, trained_samples=upd.trained_samples, loss=upd.loss,
        clip_fraction=upd.clip_fraction, tokens_per_second=upd.tokens_per_second, kl=upd.kl,
        missing_workers=[r.worker for r in results if r.missing], seconds=ing.seconds + time.perf_counter() - t0,
        timings={k: round(v, 4) for k, v in timings.items()},
    )


def train_broadcast_commit(cfg: RLRunConfig, step: int, policy_step: int, timings: dict[str, float]
                           ) -> rl_tasks.UpdateReport:
    """``grpo-update -> broadcast -> commit-step`` (called inside a flow); adds train/broadcast timings
    and the broadcast's bytes."""
    t = time.perf_counter()
    upd = rl_tasks.grpo_update(_q(cfg), step, policy_step)
    timings["train"] = time.perf_counter() - t
    t = time.perf_counter()
    pub = rl_tasks.broadcast(_q(cfg), step + 1)
    timings["broadcast"] = time.perf_counter() - t
    if pub is not None and pub.bytes is not None and pub.share is not None:
        # in the ledger's step metrics: what a worker downloads of each checkpoint (a patch or all of it)
        timings["broadcast_bytes"] = float(pub.bytes)
        timings["broadcast_share"] = pub.share
    rl_tasks.commit_step(_q(cfg), step, timings)
    return upd


def run_step(cfg: RLRunConfig, step: int, local: bool) -> StepSummary:
    """The tasks of one step, in order (called inside a flow)."""
    return update(cfg, ingest(cfg, step, local))


def _step_row(s: StepSummary) -> dict:
    return {
        "step": s.step, "policy_steps": str(s.policy_steps), "mean_reward": s.mean_reward,
        "accepted": s.accepted, "rejected": s.rejected,
        "rejected_by_reason": ", ".join(f"{k}: {v}" for k, v in sorted(s.reasons.items())) or "-",
        "trained_samples": s.trained_samples, "clip_fraction": s.clip_fraction, "kl": s.kl,
        "train_tokens_per_s": s.tokens_per_second, "broadcast_s": s.timings.get("broadcast"),
        "broadcast_share": s.timings.get("broadcast_share"),
        "seconds": round(s.seconds, 3),
    }


def _publish_step(cfg: RLRunConfig, s: StepSummary, publish: Callable[..., Any] | None = None) -> None:
    """The step's keyed table artifact, created now or handed to ``publish`` (a background queue)."""
    call = publish or (lambda fn, **kw: fn(**kw))
    call(create_table_artifact, key=artifact_key(cfg.run_name, "rl-step"), table=[_step_row(s)],
         description=f"RL step {s.step} of {cfg.run_name}")


@flow(name="rl-step", log_prints=True)
def rl_step(config: RLRunConfig, step: int) -> StepSummary:
    """Run (or resume) one step with every worker generating in this process."""
    with rl_tasks.open_run(config):
        info = rl_tasks.prepare_run(config)
        if step < info.first_step:
            raise ValueError(f"step {step} is already committed (next: {info.first_step})")
        summary = run_step(config, step, local=True)
    _publish_step(config, summary)
    return summary


def eval_due(cfg: RLRunConfig, step: int) -> bool:
    """Whether checkpoint ``step`` (published by update ``step - 1``) is evaluated: every ``eval.every``
    steps, and the last."""
    return bool(cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.steps


def eval_table(evals: list[dict]) -> list[str]:
    """Markdown rows of held-out accuracy by checkpoint."""
    return ["| checkpoint | held-out greedy accuracy |", "|---|---|",
            *(f"| {e['step']} | {e['accuracy']:.1%} |" for e in evals)]


@contextlib.contextmanager
def shardcast(cfg: RLRunConfig, logger) -> Iterator[list[str]]:
    """The run's SHARDCAST servers, the newest recorded checkpoint published; stopped on exit."""
    relays = rl_tasks.start_shardcast(cfg)
    try:
        rl_tasks.publish_weights(cfg)
        logger.info("SHARDCAST: workers download from %s", relays)
        yield relays
    finally:
        rl_tasks.stop_shardcast(cfg)


@contextlib.contextmanager
def submission_service(cfg: RLRunConfig, first_step: int, logger) -> Iterator[str]:
    """The submission service, the workers' only door into the run; stopped on exit."""
    url = rl_tasks.start_service(cfg, first_step)
    try:
        logger.info("submission service: %s", url)
        yield url
    finally:
        rl_tasks.stop_service(cfg)


@contextlib.contextmanager
def inference_workers(cfg: RLRunConfig, url: str) -> Iterator[dict[str, int | None]]:
    """The run's ``intellect worker`` processes (``workers.launch``: subprocesses here, or flow runs of
    ``rl-worker`` on its pool); on exit their exit codes fill the yielded dict (an ingest still
    waiting for a worker gives up first)."""
    rl_tasks.start_workers(cfg, url, worker_launcher(cfg))
    codes: dict[str, int | None] = {}
    try:
        yield codes
    finally:
        rl_tasks.stop_waiting(cfg)
        codes |= rl_tasks.stop_workers(cfg)


def train_steps(cfg: RLRunConfig, first_step: int, progress, artifacts: BackgroundArtifacts, logger) -> float:
    """Steps ``first_step .. cfg.steps - 1`` with their evaluations; the seconds spent evaluating. Step
    ``n + 1`` is ingested in a second thread while step ``n`` trains: the lag rule makes them
    independent (with async_level 0 its worker waits for the update)."""
    eval_seconds = 0.0
    ahead = ThreadPoolExecutor(1, thread_name_prefix="ingest")

    def ingest_ahead(step: int) -> Future | None:
        return ahead.submit(contextvars.copy_context().run, ingest, cfg, step, False) if step < cfg.steps else None

    bar = Progress(f"RL {cfg.run_name}", cfg.steps, start=first_step, heartbeat=True)
    bar.begin(f"steps {first_step}..{cfg.steps - 1}, async_level {cfg.async_level}, workers {cfg.workers.names}; "
              "waiting for the first rollouts")
    try:
        nxt = ingest_ahead(first_step)
        for n in range(first_step, cfg.steps):
            assert nxt is not None  # n < cfg.steps
            ing = nxt.result()
            nxt = ingest_ahead(n + 1)
            s = update(cfg, ing)
            _publish_step(cfg, s, artifacts.submit)
            logger.info("step %d: reward %s, accepted %d, rejected %d %s, trained %d, loss %s, %.2f s",
                        n, None if s.mean_reward is None else round(s.mean_reward, 4), s.accepted, s.rejected,
                        s.reasons or "", s.trained_samples, None if s.loss is None else round(s.loss, 5), s.seconds)
            artifacts.submit(update_progress_artifact, artifact_id=progress, progress=100.0 * (n + 1) / cfg.steps)
            bar.update(n + 1, reward=s.mean_reward, accepted=s.accepted, rejected=s.rejected, loss=s.loss)
            bar.waiting(f"step {n + 1}: rollouts, validation, update")
            if eval_due(cfg, n + 1):
                te = time.perf_counter()
                logger.info("checkpoint %d: held-out accuracy %.3f", n + 1, rl_tasks.evaluate_step(cfg, n + 1))
                eval_seconds += time.perf_counter() - te
    finally:
        bar.close()
        rl_tasks.stop_waiting(cfg)  # an ingest still waiting for a worker gives up at its next poll
        ahead.shutdown(wait=True, cancel_futures=True)
    return eval_seconds


@flow(name="rl-train", log_prints=True)
def rl_train(config: RLRunConfig | None = None) -> RLReport:
    """The run: checkpoint 0, SHARDCAST, the submission service, worker processes, steps until
    ``config.steps`` with evaluations, the curve."""
    cfg = config or RLRunConfig()
    logger = get_run_logger()
    show_progress(cfg.logging)
    with rl_tasks.open_run(cfg):
        info = rl_tasks.prepare_run(cfg)
        logger.info("run %s: from %s, %d prompts, ledger %s, first step %d, trainer key %s", cfg.run_name,
                    info.origin, info.pool, info.ledger, info.first_step, info.trainer_key)
        if info.first_step == 0 and 0 not in info.evaluated:
            logger.info("checkpoint 0: held-out accuracy %.3f", rl_tasks.evaluate_step(cfg, 0))
        progress = create_progress_artifact(progress=100.0 * info.first_step / cfg.steps,
                                            description=f"RL {cfg.run_name}: steps committed")
        t0 = time.perf_counter()
        eval_seconds, codes = 0.0, {}
        if info.first_step < cfg.steps:
            with (BackgroundArtifacts(logger) as artifacts, shardcast(cfg, logger),
                  submission_service(cfg, info.first_step, logger) as url, inference_workers(cfg, url) as codes):
                eval_seconds = train_steps(cfg, info.first_step, progress, artifacts, logger)
        seconds = time.perf_counter() - t0
        evals, curve = rl_tasks.summarize_run(cfg)
    done = max(cfg.steps - info.first_step, 0)
    step_seconds = seconds - eval_seconds
    per_hour = 3600 * done / step_seconds if step_seconds > 0 else 0.0
    lines = [f"# RL run `{cfg.run_name}`", "",
             f"{done} steps in {step_seconds:.1f} s ({per_hour:.0f} steps/hour; evaluations took another "
             f"{eval_seconds:.1f} s), async_level {cfg.async_level}, workers {cfg.workers.names}", "",
             *eval_table(evals), "", f"Curve: {curve}", f"Worker exit codes: {codes}"]
    create_markdown_artifact(key=artifact_key(cfg.run_name, "rl-summary"), markdown="\n".join(lines),
                             description=f"RL run {cfg.run_name}")
    return RLReport(run_name=cfg.run_name, first_step=info.first_step, steps=done, seconds=seconds,
                    eval_seconds=eval_seconds, steps_per_hour=per_hour, evals=evals, worker_exit_codes=codes,
                    curve=curve)
