"""The RL step's stages as flows of their own, and ``rl-orchestrate``, which dispatches them to work pools.

* ``rl-generate`` one worker's submissions of a step (pool ``gpu-rollout``): run storage only, so
  only for GPU pools the operator owns; untrusted machines join a run as ``intellect worker``
  (:mod:`intellect.rl.worker.worker`), never as a Prefect worker.
* ``rl-validate`` every submission of a step checked and recorded in the ledger (pool ``validator``).
* ``rl-update`` GRPO update, broadcast and commit of a step (pool ``gpu-train``).

``rl-orchestrate`` (pool ``cpu``) runs the steps in order, each stage through
:func:`flows.dispatch.dispatch`: sub-flows in its own process by default, flow runs of the
deployments in ``prefect.yaml`` with ``dispatch.mode = "deployments"``. Stages talk through run
storage and the ledger, and every stage is idempotent, so a failed stage is rerun by running the
orchestrator again. Generation of step ``n + 1`` waits for update ``n`` here; the asynchronous
pipelining of INTELLECT-2 is ``rl-train`` with its long-lived worker processes (``flows/rl.py``).
A stage that runs in its own process opens the DuckDB ledger, and closes it before it returns, so
the next stage's process can write it.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.artifacts import artifact_key
from flows.dispatch import dispatch, dispatch_many
from flows.rl import eval_due, eval_table, train_broadcast_commit, validate_and_record
from intellect.progress import Progress
from intellect.rl.config import RLRunConfig
from tasks import rl as rl_tasks


@flow(name="rl-generate", flow_run_name="generate-step-{step}-{worker}")
def rl_generate(config: RLRunConfig, step: int, worker: str) -> dict:
    """Generate ``worker``'s submissions of ``step`` with the newest checkpoint the lag rule allows."""
    return rl_tasks.generate_here(config, step, worker).model_dump()


@flow(name="rl-validate", flow_run_name="validate-step-{step}")
def rl_validate(config: RLRunConfig, step: int) -> dict:
    """Check every submission of ``step`` (rewards, TOPLOC, lag) and record the verdicts."""
    with rl_tasks.open_run(config):
        timings: dict[str, float] = {}
        rec = validate_and_record(config, step, timings)
        return rec.model_dump() | {"timings": timings}


@flow(name="rl-update", flow_run_name="update-step-{step}")
def rl_update(config: RLRunConfig, step: int, timings: dict[str, float] | None = None) -> dict:
    """Train on ``step``'s accepted samples, publish and broadcast checkpoint ``step + 1``, commit ``step``."""
    with rl_tasks.open_run(config):
        timings = dict(timings or {})
        upd = train_broadcast_commit(config, step, min(rl_tasks.done_policies(config, step), default=step), timings)
        return upd.model_dump() | {"timings": timings}


@flow(name="rl-orchestrate", log_prints=True)
def rl_orchestrate(config: RLRunConfig | None = None) -> dict:
    """Steps from the first uncommitted one to ``config.steps``, every stage dispatched per ``config.dispatch``."""
    cfg = config or RLRunConfig()
    logger = get_run_logger()
    with rl_tasks.open_run(cfg):
        info = rl_tasks.prepare_run(cfg)
        rl_tasks.release_ledger(cfg)
        logger.info("run %s: first step %d, stages dispatched %s", cfg.run_name, info.first_step,
                    "here" if cfg.dispatch.mode == "local" else "to their deployments")
        if info.first_step == 0 and 0 not in info.evaluated:
            logger.info("checkpoint 0: held-out accuracy %.3f", rl_tasks.evaluate_step(cfg, 0))
            rl_tasks.release_ledger(cfg)  # evaluating reads the checkpoint's digest; the stages write the ledger next
        rows = []
        # the stages run elsewhere (sub-processes or deployments): the heartbeat says which one is awaited
        bar = Progress("rl-orchestrate", cfg.steps, start=info.first_step, interval=cfg.logging.progress_seconds,
                       heartbeat=True)
        bar.begin(f"steps {info.first_step}..{cfg.steps - 1}")
        with bar:
            for n in range(info.first_step, cfg.steps):
                t0 = time.perf_counter()
                bar.waiting(f"step {n}: generating")
                dispatch_many(rl_generate, [{"config": cfg, "step": n, "worker": w} for w in cfg.workers.names],
                              cfg.dispatch)
                timings = {"generate": time.perf_counter() - t0}
                t = time.perf_counter()
                bar.waiting(f"step {n}: validating")
                dispatch(rl_validate, {"config": cfg, "step": n}, cfg.dispatch)
                timings["validate_record"] = time.perf_counter() - t
                t = time.perf_counter()
                bar.waiting(f"step {n}: training")
                dispatch(rl_update, {"config": cfg, "step": n, "timings": timings}, cfg.dispatch)
                timings["update"] = time.perf_counter() - t
                row = _step_row(cfg, n) | {"seconds": round(time.perf_counter() - t0, 3)}
                rows.append(row)
                bar.update(n + 1, loss=row["loss"], accepted=row["accepted"])
                create_table_artifact(key=artifact_key(cfg.run_name, "rl-step"), table=[row],
                                      description=f"RL step {n} of {cfg.run_name}")
                logger.info("step %d: %s", n, row)
                if eval_due(cfg, n + 1):
                    bar.waiting(f"evaluating checkpoint {n + 1}")
                    logger.info("checkpoint %d: held-out accuracy %.3f", n + 1, rl_tasks.evaluate_step(cfg, n + 1))
                    rl_tasks.release_ledger(cfg)
        evals, _ = rl_tasks.summarize_run(cfg, curve=False)
    lines = [f"# RL run `{cfg.run_name}` (rl-orchestrate, stages {cfg.dispatch.mode})", "", *eval_table(evals)]
    create_markdown_artifact(key=artifact_key(cfg.run_name, "rl-summary"), markdown="\n".join(lines),
                             description=f"RL run {cfg.run_name}")
    return {"run_name": cfg.run_name, "first_step": info.first_step, "steps": rows, "evals": evals}


def _step_row(cfg: RLRunConfig, step: int) -> dict:
    """The committed step as the ledger has it (the stages may have run elsewhere)."""
    rec = rl_tasks.read_step(cfg, step)
    if rec is None:
        raise RuntimeError(f"step {step} is not committed in the ledger after rl-update")
    keep = ("step", "accepted", "rejected", "mean_reward", "loss", "clip_fraction", "trained_samples")
    return {k: rec.get(k) for k in keep}
