"""Prefect tasks of an RL run: each one phase of :class:`~intellect.rl.trainer.run.RLRun` (one side effect on
run storage, the ledger, the submission service, SHARDCAST or the worker processes), with its retries
and timeout set here.

Tasks take the run config and step numbers and return the small pydantic reports of
:mod:`intellect.rl.trainer.run`. They act on the run the calling flow opened in this process with
:func:`open_run` (a context manager: the run is closed when the flow leaves it); a task called with no
such run open fails at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Iterator

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from intellect.checkpoints import CHECKPOINTS, fetch, verified_copy
from intellect.config import StorageConfig
from intellect.inference.engines import load_tokenizer, worker_python
from intellect.launch import Launcher, LocalLauncher
from intellect.rl.config import RLRunConfig, TaskPoolConfig
from intellect.rl.trainer.run import RecordReport, RLRun, RunInfo, UpdateReport, ValidationReport
from intellect.rl.trainer.run import generate_here as _generate_here
from intellect.rl.trainer.evaluation import HeldOut
from intellect.rl.trainer.setup import local_run_dir, run_storage, task_pool
from intellect.rl.worker.submission import SubmissionConfig
from intellect.rl.trainer.workers import WORKER_MODULE, WorkerResult, worker_key_file
from intellect.shardcast.origin import Published
from intellect.storage import RunStorage

__all__ = ["RecordReport", "RunInfo", "UpdateReport", "ValidationReport", "WorkerResult", "worker_key_file"]

_OPEN: ContextVar[tuple[RLRun, ...]] = ContextVar("intellect_rl_open_runs", default=())
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def open_run(cfg: RLRunConfig) -> Iterator[RLRun]:
    """The run of ``cfg`` for the tasks called inside: opened here and closed on exit, or, inside a
    flow that already holds it open (a stage flow run as a sub-flow), that one, whose ledger
    connection is released on exit so the next stage's process can write it."""
    held = _find(cfg)
    if held is not None:
        try:
            yield held
        finally:
            held.release_ledger()
        return
    with RLRun(cfg) as run:
        token = _OPEN.set((*_OPEN.get(), run))
        try:
            yield run
        finally:
            _OPEN.reset(token)


def _find(cfg: RLRunConfig) -> RLRun | None:
    return next((r for r in _OPEN.get() if r.cfg is cfg or r.cfg == cfg), None)


def _run(cfg: RLRunConfig) -> RLRun:
    run = _find(cfg)
    if run is None:
        raise RuntimeError(f"run {cfg.run_name} is not open here: call its tasks inside `with tasks.rl.open_run(cfg)`")
    return run


def stop_waiting(cfg: RLRunConfig) -> None:
    """Make a ``collect`` still waiting for a worker of this run fail at its next poll."""
    _run(cfg).stopping.set()


def release_ledger(cfg: RLRunConfig) -> None:
    """Close this process's connection to the run's ledger (reopened on next use), so a flow run in
    another process can write it (DuckDB: one writing process at a time)."""
    _run(cfg).release_ledger()


@task(name="prepare-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=600)
def prepare_run(cfg: RLRunConfig) -> RunInfo:
    """Checkpoint 0 from ``cfg.init`` (kept when its digest is recorded) and the run's config beside it."""
    return _run(cfg).prepare()


@task(name="start-shardcast", cache_policy=NO_CACHE, timeout_seconds=120)
def start_shardcast(cfg: RLRunConfig) -> list[str]:
    """Start the run's SHARDCAST origin (and local relays); the URLs workers download from."""
    return _run(cfg).start_shardcast()


@task(name="stop-shardcast", cache_policy=NO_CACHE, timeout_seconds=60)
def stop_shardcast(cfg: RLRunConfig) -> None:
    _run(cfg).stop_shardcast()


@task(name="publish-weights", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def publish_weights(cfg: RLRunConfig, step: int | None = None) -> dict:
    """Checkpoint ``step`` (None: the newest recorded) into the SHARDCAST origin, signed (idempotent)."""
    run = _run(cfg)
    return run.publish(run.newest_recorded() if step is None else step)


@task(name="start-service", cache_policy=NO_CACHE, timeout_seconds=60)
def start_service(cfg: RLRunConfig, first_step: int) -> str:
    """Start the submission service beside the trainer; its URL."""
    return _run(cfg).start_service(first_step)


@task(name="stop-service", cache_policy=NO_CACHE, timeout_seconds=60)
def stop_service(cfg: RLRunConfig) -> None:
    _run(cfg).stop_service()


# No timeout_seconds: waiting for the key ids of workers launched elsewhere has its own deadline
# (workers.submission_timeout), and a flow run on a busy pool may take a while to be picked up.
@task(name="start-workers", cache_policy=NO_CACHE)
def start_workers(cfg: RLRunConfig, url: str, launcher: Launcher | None = None) -> dict[str, int | None]:
    """One ``intellect worker`` per worker name, each with its own key, talking to the run only
    through the service at ``url``; their PIDs (None: not a process of this machine). ``launcher``
    None: local processes, their key files in ``keys/`` and their logs in ``logs/`` of the local run
    folder; otherwise that launcher's (e.g. flow runs of ``rl-worker``, ``flows/rl_worker.py``)."""
    env: dict[str, str] = {}
    if launcher is None:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        launcher = LocalLauncher(local_run_dir(cfg).resolve() / "logs", WORKER_MODULE,
                                 python=worker_python(cfg.workers.engine.kind))
    run = _run(cfg)
    pids = run.start_workers(url, launcher, env=env)
    get_run_logger().info("workers started, by key id: %s", run.worker_ids)
    return pids


@task(name="stop-workers", cache_policy=NO_CACHE, timeout_seconds=60)
def stop_workers(cfg: RLRunConfig, grace: float = 10.0) -> dict[str, int | None]:
    """Wait up to ``grace`` seconds for the workers to finish, then SIGTERM, then SIGKILL; exit codes."""
    return _run(cfg).stop_workers(grace)


# No timeout_seconds on the tasks of a step's ingest (collect, validate, record): they run in a
# worker thread (rl-train ingests the next step in a second thread), where Prefect cannot interrupt
# them and warns at every call. Their bounds are their own: the wait for submissions has a deadline,
# every reward check a time limit, the ledger a lock timeout.
# A step has a fixed number of task runs whatever the number of workers (each task run costs the API
# server CPU, benchmarks/orchestration_overhead.py); the per-worker work inside a task runs in threads.
@task(name="collect", cache_policy=NO_CACHE, retries=1)
def collect(cfg: RLRunConfig, step: int, local: bool) -> list[WorkerResult]:
    """Every local worker's submissions of ``step`` (:meth:`RLRun.collect`): a worker that sends nothing
    within ``workers.submission_timeout`` is reported missing and the step goes on without it."""
    def warn(missing: list[str]) -> None:
        get_run_logger().warning("workers %s sent nothing for step %d within %.0f s", missing, step,
                                 cfg.workers.submission_timeout)

    return _run(cfg).collect(step, local, on_missing=warn)


@task(name="generate-here", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def generate_here(cfg: RLRunConfig, step: int, worker: str) -> WorkerResult:
    """Worker ``worker``'s submissions of ``step``, generated by this process (an inference machine's
    flow run): no ledger, no trainer, only run storage."""
    t0 = time.perf_counter()
    storage = run_storage(cfg)
    # a lenient pool skips the prompts the run's tokenizer cannot render, as the trainer's pool does
    tok = fetch(storage, 0)[1] if cfg.tasks.lenient and cfg.tasks.file else None
    done, _ = _generate_here(cfg, storage, task_pool(cfg.tasks, storage, tokenizer=tok, prompt=cfg.submission.prompt),
                             step, worker)
    return WorkerResult(worker=worker, files=done.files, policy_step=done.policy_step,
                        seconds=time.perf_counter() - t0)


def step_files(cfg: RLRunConfig, step: int) -> dict[str, list[str]]:
    """``step``'s submission files by worker (every file, also from workers this run did not start)."""
    return _run(cfg).step_files(step)


@task(name="validate", cache_policy=NO_CACHE, retries=1)
def validate(cfg: RLRunConfig, step: int, files: dict[str, list[str]]) -> list[ValidationReport]:
    """Verdicts on every sample of ``step``'s submission ``files`` (worker -> files), one MAC'd verdict
    file per worker (:meth:`RLRun.validate`)."""
    return _run(cfg).validate(step, files)


@task(name="record", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def record(cfg: RLRunConfig, step: int, verdict_files: list[tuple[str, str]]) -> RecordReport:
    """The verdict files of ``step`` (``(path, MAC)`` pairs) into the ledger, one transaction,
    idempotent; the step's counts. A file whose MAC does not verify fails the task."""
    return _run(cfg).record(step, verdict_files)


@task(name="grpo-update", cache_policy=NO_CACHE, timeout_seconds=6 * 3600)
def grpo_update(cfg: RLRunConfig, step: int, policy_step: int) -> UpdateReport:
    """Train on the step's accepted samples and publish checkpoint ``step + 1`` (skipped when it exists)."""
    return _run(cfg).update(step, policy_step)


@task(name="broadcast", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def broadcast(cfg: RLRunConfig, step: int) -> Published | None:
    """Make recorded checkpoint ``step`` known to the inference workers (signed, to the SHARDCAST
    origin, when the run broadcasts weights: what it published; otherwise ``STABLE`` in run storage is
    the signal: None)."""
    return _run(cfg).broadcast(step)


@task(name="commit-step", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def commit_step(cfg: RLRunConfig, step: int, timings: dict[str, float]) -> bool:
    return _run(cfg).commit(step, timings)


def done_policies(cfg: RLRunConfig, step: int) -> list[int]:
    """The policy steps the done markers of ``step``'s local workers name (generated elsewhere)."""
    return _run(cfg).done_policies(step)


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def evaluate_step(cfg: RLRunConfig, step: int) -> float:
    """Held-out greedy exact-match accuracy of checkpoint ``step``, added to the run's eval record."""
    return _run(cfg).evaluate(step)


@task(name="read-step", cache_policy=NO_CACHE, retries=1, timeout_seconds=60)
def read_step(cfg: RLRunConfig, step: int) -> dict | None:
    """The ledger's record of committed ``step`` (None: not committed); the ledger is released after."""
    run = _run(cfg)
    try:
        return run.committed_step(step)
    finally:
        run.release_ledger()


@task(name="summarize-run", cache_policy=NO_CACHE, retries=1, timeout_seconds=600)
def summarize_run(cfg: RLRunConfig, curve: bool = True) -> tuple[list[dict], str | None]:
    """The run's eval record, and with ``curve`` the URI of its learning curve (written now)."""
    return _run(cfg).summarize(curve)


class EvalPoint(BaseModel):
    run: str
    step: int
    accuracy: float


@task(name="evaluate-run", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def evaluate_run(storage: StorageConfig, run_name: str, step: int | None, tasks: TaskPoolConfig, size: int,
                 submission: SubmissionConfig) -> EvalPoint:
    """Held-out greedy accuracy of checkpoint ``step`` (None: the newest) of any run in ``storage``, on
    the held-out tasks of ``tasks`` with ``submission``'s prompts and budget (as RL evaluates)."""
    st = RunStorage.from_config(storage, run_name)
    step = st.latest_step(CHECKPOINTS) if step is None else step
    if step is None:
        raise FileNotFoundError(f"run {run_name} has no complete checkpoint")
    with verified_copy(st, step) as folder:
        accuracy = HeldOut(tasks, size, st).accuracy(folder, load_tokenizer(folder), submission)
    return EvalPoint(run=run_name, step=step, accuracy=accuracy)
