"""Prefect tasks of an RL step: each one side effect on run storage, the ledger or the worker processes.

Tasks take the run config and step numbers and return small pydantic reports; weights and rollouts
travel through run storage. The trainer's model and optimizer stay in this process between steps
(:class:`_Session`): reloading them each step would cost more than the step. A fresh process
(a rerun after a crash) rebuilds the session from the newest checkpoint and its saved optimizer
state.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from intellect.config import StorageConfig
from intellect.ledger import Ledger
from intellect.pretrain import CHECKPOINTS, fetch_checkpoint
from intellect.rl import step as S
from intellect.rl.config import RLRunConfig, TaskPoolConfig
from intellect.rl.lag import policy_for
from intellect.rl.rollouts import RolloutLimits
from intellect.rl.setup import heldout_tasks, ledger_path, local_run_dir, run_storage, seed_checkpoint, task_pool
from intellect.rl.verdicts import read_verdicts, write_verdicts
from intellect.rl.weights import publish_to_origin
from intellect.shardcast.local import LocalCDN, start_local
from intellect.storage import RunStorage
from intellect.train import evaluate


class RunInfo(BaseModel):
    first_step: int  # the first step not committed in the ledger
    origin: str
    ledger: str
    pool: int


class WorkerResult(BaseModel):
    worker: str
    files: list[str]
    policy_step: int | None
    seconds: float
    missing: bool = False  # no done marker within workers.submission_timeout


class RecordReport(BaseModel):
    accepted: int
    rejected: int
    reasons: dict[str, int]
    mean_reward: float | None
    inserted: int


class UpdateReport(BaseModel):
    step: int
    policy_step: int
    trained: bool  # False: checkpoint step + 1 existed (a rerun)
    trained_samples: int
    loss: float | None
    clip_fraction: float | None
    tokens: int
    tokens_per_second: float | None
    checkpoint: str


@dataclass
class _Session:
    """What the trainer process keeps between steps of one run."""

    storage: RunStorage
    ledger: Ledger
    tasks: list
    tokenizer: object = None
    limits: RolloutLimits | None = None
    trainer: object = None  # GRPOTrainer holding checkpoint `trainer_step`
    trainer_step: int = -1
    heldout: list = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)  # set: waits for workers give up
    engines: S.CheckpointEngines | None = None  # the validator's TOPLOC prefill engines
    cdn: LocalCDN | None = None  # SHARDCAST origin and relays this process started


_SESSIONS: dict[str, _Session] = {}
_PROCS: dict[int, subprocess.Popen] = {}  # worker processes this process started, by PID


def _key(cfg: RLRunConfig) -> str:
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()


def session(cfg: RLRunConfig) -> _Session:
    key = _key(cfg)
    if key not in _SESSIONS:
        storage = run_storage(cfg)
        _SESSIONS[key] = _Session(storage, Ledger(ledger_path(cfg)), task_pool(cfg.tasks, storage),
                                  engines=S.CheckpointEngines(storage, keep=cfg.async_level + 2))
    s = _SESSIONS[key]
    if s.tokenizer is None and storage_has_checkpoint(s.storage):
        _, s.tokenizer = fetch_checkpoint(s.storage, 0)
        s.limits = cfg.limits or RolloutLimits(vocab_size=len(s.tokenizer))
    return s


def storage_has_checkpoint(storage: RunStorage) -> bool:
    return storage.is_stable(0, CHECKPOINTS)


def stop_waiting(cfg: RLRunConfig) -> None:
    """Make ``generate`` tasks still waiting for a worker of this run fail at their next poll."""
    s = _SESSIONS.get(_key(cfg))
    if s is not None:
        s.stopping.set()


def close_session(cfg: RLRunConfig) -> None:
    s = _SESSIONS.pop(_key(cfg), None)
    if s is not None:
        s.ledger.close()
        if s.cdn is not None:
            s.cdn.stop()


def _origin_dir(cfg: RLRunConfig) -> Path:
    return local_run_dir(cfg) / "shardcast" / "origin"


@task(name="start-shardcast", cache_policy=NO_CACHE, timeout_seconds=120)
def start_shardcast(cfg: RLRunConfig) -> list[str]:
    """Start the run's SHARDCAST origin, and ``local_relays`` relays unless ``shardcast.relays`` names
    relays run elsewhere; the relay URLs workers download from."""
    s = session(cfg)
    sc = cfg.shardcast
    if s.cdn is None:
        local = sc if sc.relays is None else sc.model_copy(update={"local_relays": 0})
        s.cdn = start_local(local, _origin_dir(cfg).parent)
    return sc.relays or s.cdn.relay_urls


@task(name="stop-shardcast", cache_policy=NO_CACHE, timeout_seconds=60)
def stop_shardcast(cfg: RLRunConfig) -> None:
    s = session(cfg)
    if s.cdn is not None:
        s.cdn.stop()
        s.cdn = None


@task(name="publish-weights", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def publish_weights(cfg: RLRunConfig, step: int) -> dict:
    """Checkpoint ``step``'s inference files into the SHARDCAST origin (idempotent)."""
    return publish_to_origin(cfg, session(cfg).storage, step, _origin_dir(cfg))


@task(name="prepare-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=600)
def prepare_run(cfg: RLRunConfig) -> RunInfo:
    """Checkpoint 0 from ``cfg.init`` (kept when it exists) and the run's config beside it."""
    storage = run_storage(cfg)
    origin = seed_checkpoint(cfg, storage)
    storage.write_text("run.json", cfg.model_dump_json(indent=1))
    s = session(cfg)
    s.stopping.clear()
    committed = s.ledger.committed_steps()
    first = max(committed) + 1 if committed else 0
    return RunInfo(first_step=first, origin=origin, ledger=str(ledger_path(cfg)), pool=len(s.tasks))


@task(name="start-workers", cache_policy=NO_CACHE, timeout_seconds=60)
def start_workers(cfg: RLRunConfig, first_step: int, relays: list[str] | None = None) -> dict[str, int]:
    """One ``python -m intellect.rl.worker`` process per worker name; their PIDs. Logs go to the run's
    ``logs/`` folder (local storage) or ``./runs/<run>``. ``relays``: the SHARDCAST relays they download from."""
    local = local_run_dir(cfg)
    (local / "logs").mkdir(parents=True, exist_ok=True)
    config = local / "worker-config.json"
    if cfg.shardcast is not None:
        cfg = cfg.model_copy(update={"shardcast": cfg.shardcast.model_copy(update={"relays": relays})})
    config.write_text(cfg.model_dump_json())
    pids = {}
    for w in cfg.workers.names:
        with open(local / "logs" / f"{w}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "intellect.rl.worker", "--config", str(config), "--worker", w,
                 "--first", str(first_step)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                  os.environ.get("PYTHONPATH", "")])},
            )
        pids[w] = proc.pid
        _PROCS[proc.pid] = proc
    return pids


@task(name="stop-workers", cache_policy=NO_CACHE, timeout_seconds=60)
def stop_workers(pids: dict[str, int], grace: float = 10.0) -> dict[str, int | None]:
    """Wait up to ``grace`` seconds for the workers to finish, then SIGTERM, then SIGKILL; exit codes."""
    procs = {w: _PROCS.pop(pid) for w, pid in pids.items() if pid in _PROCS}
    deadline = time.monotonic() + grace
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        for p in procs.values():
            if sig is not None and p.poll() is None:
                p.send_signal(sig)
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 5
    return {w: p.poll() for w, p in procs.items()}


# No timeout_seconds on the tasks of a step's ingest (collect, validate, record): they run in a
# worker thread (rl-train ingests the next step in a second thread), where Prefect cannot interrupt
# them and warns at every call. Their bounds are their own: the wait below has a deadline, every
# reward check a time limit, the ledger a lock timeout.
# A step has a fixed number of task runs whatever the number of workers (each task run costs the API
# server ~15 ms of CPU, benchmarks/orchestration_overhead.py); the per-worker work inside a task runs
# in threads, as separate task runs did.
@task(name="collect", cache_policy=NO_CACHE, retries=1)
def collect(cfg: RLRunConfig, step: int, local: bool) -> list[WorkerResult]:
    """Every worker's submissions of ``step``: generated here (``local``, a thread per worker), or
    written by the worker processes, awaited up to ``workers.submission_timeout`` from now (a worker
    that sends nothing by then is reported missing and the step goes on without it)."""
    s = session(cfg)
    t0 = time.perf_counter()
    if local:
        with ThreadPoolExecutor(len(cfg.workers.names)) as pool:
            list(pool.map(lambda w: _generate_here(cfg, s.storage, s.tasks, step, w), cfg.workers.names))
    deadline = time.monotonic() + cfg.workers.submission_timeout
    done: dict[str, WorkerResult] = {}
    while len(done) < len(cfg.workers.names):
        for w in cfg.workers.names:
            if w not in done and s.storage.exists(S.done_marker(step, w)):
                done[w] = _submitted(s.storage, step, w, t0)
        if len(done) == len(cfg.workers.names):
            break
        if s.stopping.is_set():
            raise RuntimeError(f"run {cfg.run_name} is stopping: no longer waiting for step {step}'s submissions")
        if time.monotonic() > deadline:
            missing = [w for w in cfg.workers.names if w not in done]
            get_run_logger().warning("workers %s sent nothing for step %d within %.0f s", missing, step,
                                     cfg.workers.submission_timeout)
            done |= {w: WorkerResult(worker=w, files=[], policy_step=None, seconds=time.perf_counter() - t0,
                                     missing=True) for w in missing}
            break
        time.sleep(cfg.workers.poll_interval)
    return [done[w] for w in cfg.workers.names]


def _generate_here(cfg: RLRunConfig, storage: RunStorage, tasks: list, step: int, worker: str) -> None:
    """Generate ``worker``'s submissions of ``step`` in this process (skipped when its done marker exists)."""
    if storage.exists(S.done_marker(step, worker)):
        return
    policy = policy_for(step, cfg.async_level, storage.complete_steps(CHECKPOINTS))
    if policy is None:
        raise FileNotFoundError(f"no checkpoint within {cfg.async_level} of step {step}")
    model, tok = fetch_checkpoint(storage, policy)
    S.worker_step(cfg, storage, step, worker, tasks, S.worker_engines(cfg)(model, tok), tok, policy,
                  limits=cfg.limits or RolloutLimits(vocab_size=len(tok)))


@task(name="generate-here", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def generate_here(cfg: RLRunConfig, step: int, worker: str) -> WorkerResult:
    """Worker ``worker``'s submissions of ``step``, generated by this process (an inference machine's
    flow run): no ledger, no trainer, only run storage."""
    t0 = time.perf_counter()
    storage = run_storage(cfg)
    _generate_here(cfg, storage, task_pool(cfg.tasks, storage), step, worker)
    return _submitted(storage, step, worker, t0)


def _submitted(storage: RunStorage, step: int, worker: str, t0: float) -> WorkerResult:
    """What ``worker``'s done marker of ``step`` says it submitted (``t0``: when the wait began)."""
    info = json.loads(storage.read_text(S.done_marker(step, worker)))
    return WorkerResult(worker=worker, files=info["files"], policy_step=info["policy_step"],
                        seconds=time.perf_counter() - t0)


def release_ledger(cfg: RLRunConfig) -> None:
    """Close this process's connection to the run's ledger (reopened on next use), so a flow run in
    another process can write it (DuckDB: one writing process at a time)."""
    s = _SESSIONS.get(_key(cfg))
    if s is not None:
        s.ledger.close()


class ValidationReport(BaseModel):
    worker: str
    verdicts: str  # the verdict file, relative to run storage
    accepted: int
    rejected: int


@task(name="validate", cache_policy=NO_CACHE, retries=1)
def validate(cfg: RLRunConfig, step: int, files: dict[str, list[str]]) -> list[ValidationReport]:
    """Verdicts on every sample of ``step``'s submission ``files`` (worker -> files; rewards recomputed,
    every check of the validator), one verdict file per worker, the workers validated in parallel."""
    s = session(cfg)

    def one(worker: str) -> ValidationReport:
        verdicts = S.validate_files(cfg, s.storage, step, files[worker], s.tasks, s.tokenizer, limits=s.limits,
                                    engines=s.engines)
        accepted = sum(v.status == "accepted" for v in verdicts)
        return ValidationReport(worker=worker, verdicts=write_verdicts(s.storage, step, worker, verdicts),
                                accepted=accepted, rejected=len(verdicts) - accepted)

    if not files:
        return []
    with ThreadPoolExecutor(len(files)) as pool:
        return list(pool.map(one, sorted(files)))


@task(name="record", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def record(cfg: RLRunConfig, step: int, verdict_files: list[str]) -> RecordReport:
    """The verdict files of ``step`` into the ledger, one transaction, idempotent; the step's counts."""
    s = session(cfg)
    res = s.ledger.record_table(step, read_verdicts(s.storage, verdict_files))
    rows = s.ledger.step_verdicts(step)
    accepted = next((r for r in rows if r["status"] == "accepted"), None)
    reasons = {r["reason"]: r["n"] for r in rows if r["status"] == "rejected"}
    return RecordReport(accepted=accepted["n"] if accepted else 0, rejected=sum(reasons.values()), reasons=reasons,
                        mean_reward=accepted["mean_reward"] if accepted else None, inserted=res.inserted)


@task(name="grpo-update", cache_policy=NO_CACHE, timeout_seconds=6 * 3600)
def grpo_update(cfg: RLRunConfig, step: int, policy_step: int) -> UpdateReport:
    """Train on the step's accepted samples and publish checkpoint ``step + 1`` (skipped when it exists)."""
    s = session(cfg)
    uri = s.storage.uri(s.storage.step_path(step + 1, CHECKPOINTS))
    trained = not s.storage.is_stable(step + 1, CHECKPOINTS)
    if trained:
        if s.trainer is None or s.trainer_step != step:
            if cfg.trainer_threads:
                torch.set_num_threads(cfg.trainer_threads)
            torch.manual_seed(cfg.seed + step)
            s.trainer = S.load_trainer(cfg, s.storage, step)
        saved = S.train_and_publish(cfg, s.storage, s.ledger, step, policy_step, s.trainer, s.limits)
        s.trainer_step = step + 1
    else:
        saved = S.saved_report(s.storage, step)
    secs = saved.get("train_seconds") or 0.0
    return UpdateReport(step=step, policy_step=saved["policy_step"], trained=trained,
                        trained_samples=saved["trained_samples"], loss=saved["loss"],
                        clip_fraction=saved["clip_fraction"], tokens=saved.get("tokens", 0),
                        tokens_per_second=saved.get("tokens", 0) / secs if secs else None, checkpoint=uri)


@task(name="broadcast", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def broadcast(cfg: RLRunConfig, step: int) -> str:
    """Make checkpoint ``step`` known to the inference workers and record its hash in the ledger.

    Without SHARDCAST workers read checkpoints straight from run storage (``STABLE`` is the signal);
    with it the checkpoint is published to the origin, whose relays pick it up shard by shard."""
    s = session(cfg)
    uri = s.storage.uri(s.storage.step_path(step, CHECKPOINTS))
    s.ledger.record_checkpoint(step, uri, S.checkpoint_sha256(s.storage, step))
    if cfg.shardcast is not None:
        publish_to_origin(cfg, s.storage, step, _origin_dir(cfg))
    return uri


@task(name="commit-step", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def commit_step(cfg: RLRunConfig, step: int, timings: dict[str, float]) -> bool:
    s = session(cfg)
    return S.commit(s.storage, s.ledger, step, S.saved_report(s.storage, step), timings)


class EvalPoint(BaseModel):
    run: str
    step: int
    accuracy: float


@task(name="evaluate-run", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def evaluate_run(storage: StorageConfig, run_name: str, step: int | None, tasks: TaskPoolConfig, size: int
                 ) -> EvalPoint:
    """Held-out greedy exact-match accuracy of checkpoint ``step`` (None: the newest) of any run in
    ``storage``, on the held-out problems of ``tasks`` (the ones RL evaluates on)."""
    st = RunStorage.from_config(storage, run_name)
    step = st.latest_step(CHECKPOINTS) if step is None else step
    if step is None:
        raise FileNotFoundError(f"run {run_name} has no complete checkpoint")
    model, tok = fetch_checkpoint(st, step)
    return EvalPoint(run=run_name, step=step, accuracy=evaluate(model, tok, heldout_tasks(tasks, size)).accuracy)


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, timeout_seconds=3600)
def evaluate_step(cfg: RLRunConfig, step: int) -> float:
    """Held-out greedy exact-match accuracy of checkpoint ``step``."""
    s = session(cfg)
    if not s.heldout:
        s.heldout = heldout_tasks(cfg.tasks, cfg.eval.size)
    model, tok = fetch_checkpoint(s.storage, step)
    return evaluate(model, tok, s.heldout).accuracy

