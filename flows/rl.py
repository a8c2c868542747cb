"""Asynchronous GRPO as Prefect flows: ``rl-step`` (one step's DAG) and ``rl-train`` (the run).

One step is the DAG ``collect -> validate -> record -> grpo-update -> broadcast -> commit-step``:
six task runs whatever the number of workers (``collect`` and ``validate`` handle each worker in a
thread of their own). In ``rl-train`` the generation is done by ``intellect worker`` processes
(:mod:`intellect.rl.worker`), each with its own key, which reach the run only through the
submission service the flow starts beside the trainer and get weights only through SHARDCAST
(signed by the trainer; without ``cfg.shardcast`` the run starts a local origin alone, so remote
workers can join the same way). They run up to ``async_level`` steps ahead of the trainer, so
``collect`` mostly finds their files already written, and the flow ingests (collect, validate,
record) step ``n + 1`` in a second thread while step ``n`` trains: the
pipelining of INTELLECT-2, bounded by the lag rule. ``rl-step`` alone generates in this process
(synchronous).

A killed run is resumed by running it again: the ledger says which steps are committed, storage
holds the files and checkpoints, and every task is idempotent.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

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
from flows.progress import progress_bar
from intellect.rl.config import RLRunConfig
from intellect.rl.report import CURVE, add_eval, load_evals, plot_curve
from intellect.rl.step import recorded_steps
from tasks import rl as T


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
    results: list[T.WorkerResult]
    record: T.RecordReport
    seconds: float
    timings: dict[str, float]


def ingest(cfg: RLRunConfig, step: int, local: bool) -> Ingested:
    """``collect -> validate -> record`` of one step (called inside a flow)."""
    # quote(): Prefect would otherwise walk the config's ~170 fields looking for futures at every
    # task run, about a third of a task run's cost in this process.
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    results = T.collect(quote(cfg), step, local)
    timings["generate_wait"] = time.perf_counter() - t0

    rec = validate_and_record(cfg, step, timings)
    return Ingested(step=step, results=results, record=rec, seconds=time.perf_counter() - t0, timings=timings)


def validate_and_record(cfg: RLRunConfig, step: int, timings: dict[str, float]) -> T.RecordReport:
    """``validate`` (the files of every worker that sent some) ``-> record`` (called inside a flow)."""
    t = time.perf_counter()
    by_worker = T.step_files(cfg, step)  # every file, also from workers this run did not start
    reports = T.validate(quote(cfg), step, by_worker)
    timings["validate"] = time.perf_counter() - t

    t = time.perf_counter()
    rec = T.record(quote(cfg), step, [(r.verdicts, r.mac) for r in reports])
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
    return StepSummary(
        step=step, policy_steps=policies, accepted=rec.accepted, rejected=rec.rejected, reasons=rec.reasons,
        mean_reward=rec.mean_reward, trained_samples=upd.trained_samples, loss=upd.loss,
        clip_fraction=upd.clip_fraction, tokens_per_second=upd.tokens_per_second,
        missing_workers=[r.worker for r in results if r.missing], seconds=ing.seconds + time.perf_counter() - t0,
        timings={k: round(v, 4) for k, v in timings.items()},
    )


def train_broadcast_commit(cfg: RLRunConfig, step: int, policy_step: int, timings: dict[str, float]
                           ) -> T.UpdateReport:
    """``grpo-update -> broadcast -> commit-step`` (called inside a flow); adds train/broadcast timings."""
    t = time.perf_counter()
    upd = T.grpo_update(quote(cfg), step, policy_step)
    timings["train"] = time.perf_counter() - t
    t = time.perf_counter()
    T.broadcast(quote(cfg), step + 1)
    timings["broadcast"] = time.perf_counter() - t
    T.commit_step(quote(cfg), step, timings)
    return upd


def run_step(cfg: RLRunConfig, step: int, local: bool) -> StepSummary:
    """The tasks of one step, in order (called inside a flow)."""
    return update(cfg, ingest(cfg, step, local))


def _step_row(s: StepSummary) -> dict:
    return {
        "step": s.step, "policy_steps": str(s.policy_steps), "mean_reward": s.mean_reward,
        "accepted": s.accepted, "rejected": s.rejected,
        "rejected_by_reason": ", ".join(f"{k}: {v}" for k, v in sorted(s.reasons.items())) or "-",
        "trained_samples": s.trained_samples, "clip_fraction": s.clip_fraction,
        "train_tokens_per_s": s.tokens_per_second, "broadcast_s": s.timings.get("broadcast"),
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
    info = T.prepare_run(config)
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


def _evaluate(cfg: RLRunConfig, step: int) -> float:
    acc = T.evaluate_step(cfg, step)
    add_eval(T.session(cfg).storage, step, acc)
    return acc


@flow(name="rl-train", log_prints=True)
def rl_train(config: RLRunConfig | None = None) -> RLReport:
    """The run: checkpoint 0, worker processes, steps until ``config.steps``, evaluations, curve."""
    cfg = config or RLRunConfig()
    logger = get_run_logger()
    info = T.prepare_run(cfg)
    logger.info("run %s: from %s, %d prompts, ledger %s, first step %d", cfg.run_name, info.origin, info.pool,
                info.ledger, info.first_step)
    storage = T.session(cfg).storage
    if info.first_step == 0 and not any(e["step"] == 0 for e in load_evals(storage)):
        logger.info("checkpoint 0: held-out accuracy %.3f", _evaluate(cfg, 0))
    progress = create_progress_artifact(progress=100.0 * info.first_step / cfg.steps,
                                        description=f"RL {cfg.run_name}: steps committed")
    relays, url, pids = None, None, {}
    if info.first_step < cfg.steps:
        relays = T.start_shardcast(cfg)
        T.publish_weights(cfg, max(recorded_steps(storage, T.session(cfg).ledger)))
        logger.info("SHARDCAST: workers download from %s", relays)
        url = T.start_service(cfg, info.first_step)
        logger.info("submission service: %s (trainer key %s)", url, T.session(cfg).key.public.hex)
        pids = T.start_workers(cfg, url)
    t0 = time.perf_counter()
    eval_seconds = 0.0
    codes: dict[str, int | None] = {}
    artifacts = BackgroundArtifacts(logger)
    ahead = ThreadPoolExecutor(1, thread_name_prefix="ingest")

    def ingest_ahead(step: int) -> Future | None:
        if step >= cfg.steps:
            return None
        return ahead.submit(contextvars.copy_context().run, ingest, cfg, step, False)

    bar = progress_bar(cfg.steps, f"RL {cfg.run_name}", initial=info.first_step)
    try:
        nxt = ingest_ahead(info.first_step)
        for n in range(info.first_step, cfg.steps):
            ing = nxt.result()
            # Step n + 1's rollouts are validated and recorded while step n trains: the lag rule makes
            # them independent of this update (with async_level 0 its worker waits for the update).
            nxt = ingest_ahead(n + 1)
            s = update(cfg, ing)
            _publish_step(cfg, s, artifacts.submit)
            logger.info("step %d: reward %s, accepted %d, rejected %d %s, trained %d, loss %s, %.2f s",
                        n, None if s.mean_reward is None else round(s.mean_reward, 4), s.accepted, s.rejected,
                        s.reasons or "", s.trained_samples, None if s.loss is None else round(s.loss, 5), s.seconds)
            artifacts.submit(update_progress_artifact, artifact_id=progress, progress=100.0 * (n + 1) / cfg.steps)
            bar.update(1)
            bar.set_postfix(reward=s.mean_reward, rejected=s.rejected, refresh=False)
            if eval_due(cfg, n + 1):
                te = time.perf_counter()
                logger.info("checkpoint %d: held-out accuracy %.3f", n + 1, _evaluate(cfg, n + 1))
                eval_seconds += time.perf_counter() - te
    finally:
        bar.close()
        T.stop_waiting(cfg)  # an ingest still waiting for a worker gives up at its next poll
        ahead.shutdown(wait=True, cancel_futures=True)
        if pids:
            codes = T.stop_workers(pids)
        if url is not None:
            T.stop_service(cfg)
        if relays is not None:
            T.stop_shardcast(cfg)
        artifacts.close()
    seconds = time.perf_counter() - t0
    done = max(cfg.steps - info.first_step, 0)
    evals = load_evals(storage)
    curve = None
    if evals:
        storage.write_bytes(CURVE, plot_curve(T.session(cfg).ledger.steps(), evals,
                                              f"GRPO {cfg.run_name} (async_level {cfg.async_level})"))
        curve = storage.uri(CURVE)
    step_seconds = seconds - eval_seconds
    per_hour = 3600 * done / step_seconds if step_seconds > 0 else 0.0
    lines = [f"# RL run `{cfg.run_name}`", "",
             f"{done} steps in {step_seconds:.1f} s ({per_hour:.0f} steps/hour; evaluations took another "
             f"{eval_seconds:.1f} s), "
             f"async_level {cfg.async_level}, workers {cfg.workers.names}", "", *eval_table(evals),
             "", f"Curve: {curve}", f"Worker exit codes: {codes}"]
    create_markdown_artifact(key=artifact_key(cfg.run_name, "rl-summary"), markdown="\n".join(lines),
                             description=f"RL run {cfg.run_name}")
    T.close_session(cfg)
    return RLReport(run_name=cfg.run_name, first_step=info.first_step, steps=done, seconds=seconds,
                    eval_seconds=eval_seconds, steps_per_hour=per_hour, evals=evals, worker_exit_codes=codes,
                    curve=curve)
