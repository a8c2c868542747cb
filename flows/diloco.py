"""``diloco-train``: start the rendezvous store and N workers, watch them, report.

Each worker is a long-lived process that runs each of its outer steps as a flow run
(``diloco-outer-step``, ``flows.diloco_worker``) of its phases as task runs, so the dashboard
shows one live run per worker per outer step; this flow publishes the run-level table and progress. Workers are
subprocesses of this flow run (``dispatch.mode = "local"``) or flow runs of the
``diloco-worker`` deployment on its work pool (``"deployments"``,
:func:`deployment_launcher`). Members that the robust all-reduce flags or bans
show in the event feed (``flows.diloco_events``) and in the table's ``flagged``. Each row of the
outer-step table and the run report show how well the run used its devices: compute utilization
(inner-phase seconds over the outer step's wall seconds), tokens, tokens/s and MFU. Local workers'
output is kept in the run folder's ``logs/<worker>.log`` (copied there at the end for remote
storage).

The run secret reaches the workers as ``Coordinator`` hands it out: in the
environment of local subprocesses, in the job variables of deployment flow runs
(readable by whoever holds the Prefect API credential) unless every worker host
has ``diloco.secret_file``, in which case nothing is passed. Contributors
(``diloco.contributors``) hold none of it: each joins with its own key (``intellect diloco-join``,
pinning the coordinator key this flow's report names) and gets only its own credentials.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

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
from flows.progress import show_progress
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco.coordinator import (EXIT_BANNED, EXIT_DONE, EXIT_FAILED, Coordinator, parse_worker_args,
                                          save_logs, worker_launcher, worker_log_dir)
from intellect.diloco.outer import init_run
from intellect.launch import Launcher
from intellect.progress import Progress
from intellect.storage import RunStorage


class DilocoReport(BaseModel):
    run_name: str
    committed_steps: int
    exit_codes: dict[str, int | None]
    steps: list[dict]
    compute: dict[str, float] = {}  # run_compute() of the committed steps


def step_row(n: int, metrics: list[dict], flagged: Sequence[str]) -> dict:
    """One row of the outer-step table from the members' reports of outer step ``n - 1``: the slowest
    member's seconds and utilization (everyone waits for it), throughput summed over the members.

    >>> m = {"inner_loss": 2.0, "bytes_sent": 10, "allreduce_seconds": 0.5, "algorithm": "direct", "attempts": 1,
    ...      "compute_utilization": 0.8, "tokens": 1000, "tokens_per_s": 100.0, "mfu": 0.25}
    >>> r = step_row(1, [m, m | {"compute_utilization": 0.6}], [])
    >>> r["compute_utilization"], r["tokens"], r["tokens_per_s"], r["mfu"]
    (0.6, 2000, 200.0, 0.25)
    """
    loss = sum(m["inner_loss"] for m in metrics) / max(len(metrics), 1)
    return {"outer_step": n, "participants": len(metrics), "mean_inner_loss": round(loss, 4),
            "bytes_sent": sum(m["bytes_sent"] for m in metrics),
            "allreduce_s": round(max((m["allreduce_seconds"] for m in metrics), default=0.0), 3),
            "compute_utilization": round(min((m.get("compute_utilization", 0.0) for m in metrics), default=0.0), 4),
            "tokens": sum(int(m.get("tokens", 0)) for m in metrics),
            "tokens_per_s": round(sum(m.get("tokens_per_s", 0.0) for m in metrics), 1),
            "mfu": round(sum(m.get("mfu", 0.0) for m in metrics) / max(len(metrics), 1), 4),
            "algorithm": metrics[0].get("algorithm", "") if metrics else "",
            "attempts": max((m["attempts"] for m in metrics), default=0),
            "flagged": ",".join(flagged)}


def run_compute(rows: Sequence[dict]) -> dict[str, float]:
    """The run's device use over the outer-step rows: mean compute utilization, tokens, tokens/s, MFU.

    >>> run_compute([{"compute_utilization": 0.5, "tokens": 10, "tokens_per_s": 4.0, "mfu": 0.1},
    ...              {"compute_utilization": 0.7, "tokens": 30, "tokens_per_s": 6.0, "mfu": 0.3}])
    {'compute_utilization': 0.6, 'tokens': 40, 'tokens_per_s': 5.0, 'mfu': 0.2}
    """
    rows = [r for r in rows if "tokens" in r]
    n = max(len(rows), 1)
    return {"compute_utilization": round(sum(r["compute_utilization"] for r in rows) / n, 4),
            "tokens": sum(r["tokens"] for r in rows),
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in rows) / n, 1),
            "mfu": round(sum(r["mfu"] for r in rows) / n, 4)}


def compute_line(c: dict[str, float]) -> str:
    """The run report's line on device use (:func:`run_compute`)."""
    return (f"compute utilization {100 * c['compute_utilization']:.1f}% (inner phase / outer-step wall time), "
            f"{c['tokens']:,} tokens, {c['tokens_per_s']:,.0f} tokens/s, MFU {100 * c['mfu']:.2f}%")


@task(name="init-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def start_run(cfg: DilocoRunConfig) -> int:
    """Publish outer checkpoint 0 unless the run already has checkpoints; returns the newest."""
    return init_run(cfg, RunStorage.from_config(cfg.storage, cfg.run_name))


def deployment_launcher(run: DilocoRunConfig) -> DeploymentLauncher:
    """Each worker as a flow run of the ``diloco-worker`` deployment, a child of this flow run, on the
    deployment's work pool (e.g. one per GPU host), asking the pool worker for
    ``diloco.ranks_per_worker`` devices of its own (the ``devices`` job variable). The run's config
    travels as a parameter, so its storage secret does not: remote workers take S3 credentials from
    their own ``AWS_*`` environment."""

    def parameters(name: str, args: Sequence[str]) -> dict:  # noqa: ARG001 - the worker name is in args
        a = parse_worker_args(list(args))  # its --config is the coordinator's own copy, unreadable elsewhere
        return {"config": run.model_dump(mode="json"), "worker": a.worker, "index": a.index, "store": a.store,
                "run_name": run.run_name}

    return DeploymentLauncher(diloco_worker, run.dispatch, parameters, failed=EXIT_FAILED,
                              job_variables={"devices": run.diloco.ranks_per_worker})


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
    show_progress(cfg.logging)
    start = start_run(cfg)
    local = cfg.dispatch.mode == "local"
    env = _api_env() if local and worker_module == "flows.diloco_worker" else {}
    progress = synced(create_progress_artifact(progress=100.0 * start / cfg.diloco.outer_steps,
                                               description=f"DiLoCo {cfg.run_name}: outer steps committed"))
    rows: list[dict] = []
    members: list[list[str]] = []
    # every worker writes its own inner-step lines (logs/<worker>.log); this is the run's
    bar = Progress(f"DiLoCo {cfg.run_name}", cfg.diloco.outer_steps, unit="outer step", start=start, heartbeat=True)
    bar.begin(f"{cfg.diloco.workers} workers, {cfg.diloco.outer_steps} outer steps of {cfg.diloco.inner_steps} "
              f"inner steps, from outer step {start}")

    def on_commit(n: int, metrics: list[dict]) -> None:
        now = sorted(metrics[0].get("members", [])) if metrics else []
        emit_membership(cfg.run_name, n, now, members[-1] if members else None)
        members.append(now)
        row = step_row(n, metrics, emit_outliers(cfg.run_name, n - 1, metrics))
        rows.append(row)
        bar.update(n, tokens=row["tokens"], loss=row["mean_inner_loss"])
        bar.waiting("the workers publishing and leaving" if n >= cfg.diloco.outer_steps else f"outer step {n + 1}")
        logger.info("outer step %d/%d committed: %s", n, cfg.diloco.outer_steps, row)
        update_progress_artifact(artifact_id=progress, progress=100.0 * n / cfg.diloco.outer_steps)

    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    with tempfile.TemporaryDirectory(prefix="intellect-diloco-logs-") as tmp:
        logs = worker_log_dir(storage) or Path(tmp)  # remote storage: copied there when the run ends
        launcher: Launcher = worker_launcher(logs, module=worker_module) if local else deployment_launcher(cfg)
        coord = Coordinator(cfg, launcher, env=env, local_ranks=local)
        try:
            coord.announce_start(start)
            if cfg.diloco.contributors:
                logger.info("contributors join at %s with --run %s --coordinator-key %s", coord.address,
                            cfg.run_name, coord.identity.hex)
            for _ in range(cfg.diloco.workers):
                coord.start_worker()
            codes = coord.watch(timeout=timeout_s, on_commit=on_commit)
            committed = coord.progress() or start
            refused = dict(coord.server.refusals)  # requests without the run secret, by reason
            identity = coord.identity.hex
        finally:
            coord.close()
            bar.close()
            if local:
                save_logs(storage, logs)
    compute = run_compute(rows)
    create_table_artifact(key=artifact_key(cfg.run_name, "outer-steps"),
                          table=rows or [{"outer_step": start}], description="DiLoCo outer steps")
    create_markdown_artifact(markdown=f"# DiLoCo `{cfg.run_name}`\n\n{committed}/{cfg.diloco.outer_steps} outer steps "
                             f"committed; worker exit codes {codes}"
                             + (f"; the rendezvous refused requests: {refused}" if refused else "")
                             + (f"\n\ncontributors joined with `--coordinator-key {identity}`"
                                if cfg.diloco.contributors else "")
                             + (f"\n\n{compute_line(compute)}" if rows else ""))
    # a banned worker is the run defending itself (its events are in the feed), not a failure
    if any(c not in (EXIT_DONE, EXIT_BANNED) for c in codes.values()):
        raise RuntimeError(f"DiLoCo workers failed: exit codes {codes}")
    return DilocoReport(run_name=cfg.run_name, committed_steps=committed, exit_codes=codes, steps=rows,
                        compute=compute)
