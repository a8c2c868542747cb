"""``diloco-train``: start the rendezvous store and N workers, watch them, report.

Each worker is a long-lived process that drives its own outer steps and records each one as a
flow run (``diloco-outer-step``, ``flows.diloco_worker``), so the dashboard shows one run per
worker per outer step; this flow publishes the run-level table and progress. Workers are
subprocesses of this flow run (``dispatch.mode = "local"``) or flow runs of the
``diloco-worker`` deployment on its work pool (``"deployments"``,
:func:`deployment_launcher`). Members that the robust all-reduce flags or bans
show in the event feed (``flows.diloco_events``) and in the table's ``flagged``.

The run secret reaches the workers as ``Coordinator`` hands it out: in the
environment of local subprocesses, in the job variables of deployment flow runs
(readable by whoever holds the Prefect API credential) unless every worker host
has ``diloco.secret_file``, in which case nothing is passed.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.settings import get_current_settings
from pydantic import BaseModel

from flows.artifacts import artifact_key, synced
from flows.diloco_events import emit_outliers
from flows.diloco_worker import diloco_worker
from flows.events import emit_membership
from flows.launch import DeploymentLauncher
from flows.progress import progress_bar
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import (EXIT_BANNED, EXIT_DONE, EXIT_FAILED, Coordinator, parse_worker_args,
                                          worker_launcher)
from intellect.diloco.worker import init_run
from intellect.launch import Launcher
from intellect.storage import RunStorage


class DilocoReport(BaseModel):
    run_name: str
    committed_steps: int
    exit_codes: dict[str, int | None]
    steps: list[dict]


@task(name="init-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def start_run(cfg: DilocoRunConfig) -> int:
    """Publish outer checkpoint 0 unless the run already has checkpoints; returns the newest."""
    return init_run(cfg, RunStorage.from_config(cfg.storage, cfg.run_name))


def deployment_launcher(run: DilocoRunConfig) -> DeploymentLauncher:
    """Each worker as a flow run of the ``diloco-worker`` deployment, a child of this flow run, on the
    deployment's work pool (e.g. one per GPU host). The run's config travels as a parameter, so its
    storage secret does not: remote workers take S3 credentials from their own ``AWS_*`` environment."""

    def parameters(name: str, args: Sequence[str]) -> dict:  # noqa: ARG001 - the worker name is in args
        a = parse_worker_args(list(args))  # its --config is the coordinator's own copy, unreadable elsewhere
        return {"config": run.model_dump(mode="json"), "worker": a.worker, "index": a.index, "store": a.store,
                "run_name": run.run_name}

    return DeploymentLauncher(diloco_worker, run.dispatch, parameters, failed=EXIT_FAILED)


def _api_env() -> dict[str, str]:
    # children must report to this flow's API server, never start ephemeral servers of their own
    with get_client(sync_client=True) as client:
        env = {"PREFECT_API_URL": str(client.api_url).rstrip("/")}
    auth = get_current_settings().api.auth_string  # a locked-down server refuses children without it
    if auth is not None:
        env["PREFECT_API_AUTH_STRING"] = auth.get_secret_value()
    return env


@flow(name="diloco-train", log_prints=True)
def diloco_train(config: DilocoRunConfig | None = None, timeout_s: float = 6 * 3600,
                 worker_module: str = "flows.diloco_worker") -> DilocoReport:
    cfg = config or DilocoRunConfig()
    logger = get_run_logger()
    start = start_run(cfg)
    local = cfg.dispatch.mode == "local"
    env = _api_env() if local and worker_module == "flows.diloco_worker" else {}
    progress = synced(create_progress_artifact(progress=100.0 * start / cfg.diloco.outer_steps,
                                               description=f"DiLoCo {cfg.run_name}: outer steps committed"))
    rows: list[dict] = []
    members: list[list[str]] = []
    bar = progress_bar(cfg.diloco.outer_steps, f"DiLoCo {cfg.run_name}", initial=start, unit="outer step")

    def on_commit(n: int, metrics: list[dict]) -> None:
        bar.update(n - bar.n)
        now = sorted(metrics[0].get("members", [])) if metrics else []
        emit_membership(cfg.run_name, n, now, members[-1] if members else None)
        members.append(now)
        flagged = emit_outliers(cfg.run_name, n - 1, metrics)
        loss = sum(m["inner_loss"] for m in metrics) / max(len(metrics), 1)
        row = {"outer_step": n, "participants": len(metrics), "mean_inner_loss": round(loss, 4),
               "bytes_sent": sum(m["bytes_sent"] for m in metrics),
               "allreduce_s": round(max((m["allreduce_seconds"] for m in metrics), default=0.0), 3),
               "algorithm": metrics[0].get("algorithm", "") if metrics else "",
               "attempts": max((m["attempts"] for m in metrics), default=0),
               "flagged": ",".join(flagged)}
        rows.append(row)
        logger.info("outer step %d/%d committed: %s", n, cfg.diloco.outer_steps, row)
        update_progress_artifact(artifact_id=progress, progress=100.0 * n / cfg.diloco.outer_steps)

    with tempfile.TemporaryDirectory(prefix="intellect-diloco-logs-") as logs:
        launcher: Launcher = worker_launcher(logs, module=worker_module) if local else deployment_launcher(cfg)
        coord = Coordinator(cfg, launcher, env=env)
        try:
            for _ in range(cfg.diloco.workers):
                coord.start_worker()
            codes = coord.watch(timeout=timeout_s, on_commit=on_commit)
            committed = coord.progress() or start
            refused = dict(coord.server.refusals)  # requests without the run secret, by reason
        finally:
            coord.close()
            bar.close()
    create_table_artifact(key=artifact_key(cfg.run_name, "outer-steps"),
                          table=rows or [{"outer_step": start}], description="DiLoCo outer steps")
    create_markdown_artifact(markdown=f"# DiLoCo `{cfg.run_name}`\n\n{committed}/{cfg.diloco.outer_steps} outer steps "
                             f"committed; worker exit codes {codes}"
                             + (f"; the rendezvous refused requests: {refused}" if refused else ""))
    # a banned worker is the run defending itself (its events are in the feed), not a failure
    if any(c not in (EXIT_DONE, EXIT_BANNED) for c in codes.values()):
        raise RuntimeError(f"DiLoCo workers failed: exit codes {codes}")
    return DilocoReport(run_name=cfg.run_name, committed_steps=committed, exit_codes=codes, steps=rows)
