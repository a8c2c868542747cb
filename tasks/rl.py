"""Prefect tasks of an RL step: each one side effect on run storage, the ledger, the submission
service or the worker processes.

Tasks take the run config and step numbers and return small pydantic reports; weights travel
through SHARDCAST (signed with the trainer's key) and rollouts through the submission service. The
trainer's model and optimizer, the service and the SHARDCAST servers stay in this process between
steps (:class:`_Session`): reloading them each step would cost more than the step. A fresh process
(a rerun after a crash) rebuilds the session from the newest recorded checkpoint and its saved
optimizer state.

What only the trainer may write stays in this process or behind its secret: done state is the
service's (``service.done``), verdict files carry a MAC under the run's secret
(:mod:`intellect.rl.verdicts`), and every checkpoint read is checked against the ledger's digest.
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
from intellect.pretrain import CHECKPOINTS, CheckpointMismatch, checkpoint_digest, fetch_checkpoint
from intellect.rl import step as S
from intellect.rl.admission import uploads_settled_at
from intellect.rl.config import RLRunConfig, TaskPoolConfig
from intellect.rl.lag import policy_for
from intellect.rl.rollouts import RolloutLimits
from intellect.rl.service import SubmissionService
from intellect.rl.setup import (
    heldout_tasks, ledger_path, local_run_dir, run_storage, seed_checkpoint, task_pool, trainer_dir, trainer_key,
    trainer_secret,
)
from intellect.rl.verdicts import read_verdicts, write_verdicts
from intellect.rl.weights import publish_to_origin
from intellect.rl.worker import WorkerRunInfo
from intellect.shardcast.local import LocalCDN, start_local
from intellect.storage import RunStorage
from intellect.train import evaluate
from intellect.trust.keys import SigningKey


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
    relays: list[str] = field(default_factory=list)  # what the workers download from
    service: SubmissionService | None = None  # the workers' door into the run, while rl-train runs
    local_workers: dict[str, str] = field(default_factory=dict)  # name -> key id of the workers started here
    secret: bytes = b""  # the run's secret: MACs of the verdict files
    key: SigningKey | None = None  # the trainer's key: signs every SHARDCAST version


_SESSIONS: dict[str, _Session] = {}
_PROCS: dict[int, subprocess.Popen] = {}  # worker processes this process started, by PID


def _key(cfg: RLRunConfig) -> str:
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()


def session(cfg: RLRunConfig) -> _Session:
    key = _key(cfg)
    if key not in _SESSIONS:
        storage = run_storage(cfg)
        ledger = Ledger(ledger_path(cfg))
        _SESSIONS[key] = _Session(storage, ledger, task_pool(cfg.tasks, storage),
                                  engines=S.CheckpointEngines(storage, ledger, keep=cfg.async_level + 2),
                                  secret=trainer_secret(cfg), key=trainer_key(cfg))
    s = _SESSIONS[key]
    if s.tokenizer is None and s.ledger.checkpoint(0) is not None:
        _, s.tokenizer = S.fetch_recorded(s.storage, s.ledger, 0)
        s.limits = cfg.limits or RolloutLimits(vocab_size=len(s.tokenizer))
    return s


def stop_waiting(cfg: RLRunConfig) -> None:
    """Make ``generate`` tasks still waiting for a worker of this run fail at their next poll."""
    s = _SESSIONS.get(_key(cfg))
    if s is not None:
        s.stopping.set()


def close_session(cfg: RLRunConfig) -> None:
    s = _SESSIONS.pop(_key(cfg), None)
    if s is not None:
        if s.service is not None:
            s.service.stop()
        s.ledger.close()
        if s.cdn is not None:
            s.cdn.stop()


def _origin_dir(cfg: RLRunConfig) -> Path:
    return local_run_dir(cfg) / "shardcast" / "origin"


@task(name="start-shardcast", cache_policy=NO_CACHE, timeout_seconds=120)
def start_shardcast(cfg: RLRunConfig) -> list[str]:
    """Start the run's SHARDCAST origin, and ``local_relays`` relays unless ``shardcast.relays`` names
    relays run elsewhere (without ``cfg.shardcast``: an origin alone); the URLs workers download from."""
    s = session(cfg)
    sc = cfg.weights_broadcast()
    if s.cdn is None:
        local = sc if sc.relays is None else sc.model_copy(update={"local_relays": 0})
        s.cdn = start_local(local, _origin_dir(cfg).parent, s.key.public)
    s.relays = sc.relays or s.cdn.relay_urls
    return s.relays


@task(name="stop-shardcast", cache_policy=NO_CACHE, timeout_seconds=60)
def stop_shardcast(cfg: RLRunConfig) -> None:
    s = session(cfg)
    if s.cdn is not None:
        s.cdn.stop()
        s.cdn = None


@task(name="publish-weights", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def publish_weights(cfg: RLRunConfig, step: int) -> dict:
    """Checkpoint ``step``'s inference files into the SHARDCAST origin, signed (idempotent)."""
    s = session(cfg)
    return _publish(cfg, s, step)


def _publish(cfg: RLRunConfig, s: _Session, step: int) -> dict:
    """Sign and publish checkpoint ``step`` only when it still has the digest the ledger recorded: the
    trainer's signature must never cover bytes it did not write."""
    want = S.recorded_digest(s.ledger, step)
    if (got := checkpoint_digest(s.storage, step)) != want:
        raise CheckpointMismatch(step, want, got, s.storage.uri(s.storage.step_path(step, CHECKPOINTS)))
    return publish_to_origin(_broadcast_cfg(cfg), s.storage, step, _origin_dir(cfg), signing_key=s.key)


def _broadcast_cfg(cfg: RLRunConfig) -> RLRunConfig:
    return cfg if cfg.shardcast is not None else cfg.model_copy(update={"shardcast": cfg.weights_broadcast()})


@task(name="prepare-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=600)
def prepare_run(cfg: RLRunConfig) -> RunInfo:
    """Checkpoint 0 from ``cfg.init`` (kept when its digest is recorded) and the run's config beside it."""
    s = session(cfg)
    origin = seed_checkpoint(cfg, s.storage, s.ledger)
    s.storage.write_text("run.json", cfg.model_dump_json(indent=1))
    s = session(cfg)
    s.stopping.clear()
    committed = s.ledger.committed_steps()
    first = max(committed) + 1 if committed else 0
    return RunInfo(first_step=first, origin=origin, ledger=str(ledger_path(cfg)), pool=len(s.tasks))


@task(name="start-service", cache_policy=NO_CACHE, timeout_seconds=60)
def start_service(cfg: RLRunConfig, first_step: int) -> str:
    """Start the submission service beside the trainer (its records in ``trainer/service`` of the local
    run folder); its URL. Workers may run ``async_level`` steps past the newest committed one."""
    s = session(cfg)
    if s.service is None:
        svc_cfg = cfg.service.model_copy(update={"ahead": cfg.async_level + 1,
                                                 "max_submissions_per_step": cfg.workers.max_submissions})
        s.service = SubmissionService(
            svc_cfg, run=cfg.run_name, storage=s.storage, state_dir=trainer_dir(cfg) / "service",
            run_info=lambda: WorkerRunInfo.of(cfg, s.service.committed, s.relays).model_dump(mode="json"),
            tasks=s.tasks,
            prompts_per_submission=cfg.submission.prompts_per_submission, committed=first_step - 1,
        )
        s.service.start()
    return s.service.url


@task(name="stop-service", cache_policy=NO_CACHE, timeout_seconds=60)
def stop_service(cfg: RLRunConfig) -> None:
    s = session(cfg)
    if s.service is not None:
        s.service.stop()
        s.service = None


def worker_key_file(cfg: RLRunConfig, name: str) -> Path:
    """The key file of local worker ``name`` (``keys/<name>.key`` of the local run folder)."""
    return local_run_dir(cfg) / "keys" / f"{name}.key"


@task(name="start-workers", cache_policy=NO_CACHE, timeout_seconds=60)
def start_workers(cfg: RLRunConfig, url: str) -> dict[str, int]:
    """One ``intellect worker`` process per worker name, each with its own key file (made on first
    use), talking to the run only through the service at ``url``; their PIDs. Logs go to ``logs/`` of
    the local run folder, downloaded checkpoints to ``weights/<name>``."""
    s = session(cfg)
    local = local_run_dir(cfg).resolve()
    (local / "logs").mkdir(parents=True, exist_ok=True)
    pids = {}
    for w in cfg.workers.names:
        path = worker_key_file(cfg, w).resolve()
        if not path.exists():
            SigningKey.generate().save(path)
        s.local_workers[w] = SigningKey.load(path).public.id
        with open(local / "logs" / f"{w}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "worker", "--run-url", url, "--key", str(path),
                 "--trainer-key", s.key.public.hex, "--cache", str(local / "weights" / w),
                 "--threads", str(cfg.workers.threads), "--parent", str(os.getpid())],
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
    """Every local worker's submissions of ``step``: generated here (``local``, a thread per worker,
    done markers in run storage), or sent by the ``intellect worker`` processes through the service
    (done when ``service.done(step)`` says so), awaited up to ``workers.submission_timeout`` from now
    (a worker that sends nothing by then is reported missing and the step goes on without it)."""
    s = session(cfg)
    t0 = time.perf_counter()
    if local:
        with ThreadPoolExecutor(len(cfg.workers.names)) as pool:
            list(pool.map(lambda w: _generate_here(cfg, s.storage, s.tasks, step, w, s.ledger), cfg.workers.names))
    service = s.service if not local else None
    # local workers by name; remote ones (service only) by key id
    ids = {w: s.local_workers.get(w, "") for w in cfg.workers.names}
    if service is not None:
        ids |= {r: r for r in cfg.workers.remote}
    deadline = time.monotonic() + cfg.workers.submission_timeout
    done: dict[str, WorkerResult] = {}
    while len(done) < len(ids):
        finished = service.done(step) if service is not None else {}
        for w, wid in ids.items():
            if w in done:
                continue
            if service is not None:
                rec = finished.get(wid)
                if rec is not None:
                    done[w] = WorkerResult(worker=w, files=list(rec.files), policy_step=rec.policy_step,
                                           seconds=time.perf_counter() - t0)
            elif s.storage.exists(S.done_marker(step, w)):
                done[w] = _submitted(s.storage, step, w, t0)
        if len(done) == len(ids):
            break
        if s.stopping.is_set():
            raise RuntimeError(f"run {cfg.run_name} is stopping: no longer waiting for step {step}'s submissions")
        if time.monotonic() > deadline:
            missing = [w for w in ids if w not in done]
            get_run_logger().warning("workers %s sent nothing for step %d within %.0f s", missing, step,
                                     cfg.workers.submission_timeout)
            done |= {w: WorkerResult(worker=w, files=[], policy_step=None, seconds=time.perf_counter() - t0,
                                     missing=True) for w in missing}
            break
        time.sleep(cfg.workers.poll_interval)
    return [done[w] for w in ids]


def _generate_here(cfg: RLRunConfig, storage: RunStorage, tasks: list, step: int, worker: str,
                   ledger: Ledger | None = None) -> None:
    """Generate ``worker``'s submissions of ``step`` in this process (skipped when its done marker
    exists). With ``ledger`` (the trainer's process) only recorded checkpoints are used, verified;
    without (an operator's generation machine, which holds run storage but not the ledger) storage is
    believed."""
    if storage.exists(S.done_marker(step, worker)):
        return
    available = storage.complete_steps(CHECKPOINTS) if ledger is None else S.recorded_steps(storage, ledger)
    policy = policy_for(step, cfg.async_level, available)
    if policy is None:
        raise FileNotFoundError(f"no checkpoint within {cfg.async_level} of step {step}")
    model, tok = fetch_checkpoint(storage, policy) if ledger is None else S.fetch_recorded(storage, ledger, policy)
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


def step_files(cfg: RLRunConfig, step: int) -> dict[str, list[str]]:
    """``step``'s submission files by worker: what the service recorded (while it runs here), else the
    files in run storage (operator-owned generation)."""
    from intellect.rl.rollouts import list_submissions, parse_submission_path  # noqa: PLC0415

    s = session(cfg)
    rels = ([r.path for r in s.service.submissions(step)] if s.service is not None
            else list_submissions(s.storage, step))
    by_worker: dict[str, list[str]] = {}
    for rel in rels:
        by_worker.setdefault(parse_submission_path(rel)[1], []).append(rel)
    return by_worker


class ValidationReport(BaseModel):
    worker: str
    verdicts: str  # the verdict file, relative to run storage
    mac: str  # its MAC under the run's secret (hex): the record task checks it
    accepted: int
    rejected: int


@task(name="validate", cache_policy=NO_CACHE, retries=1)
def validate(cfg: RLRunConfig, step: int, files: dict[str, list[str]]) -> list[ValidationReport]:
    """Verdicts on every sample of ``step``'s submission ``files`` (worker -> files; rewards recomputed,
    every check of the validator, and with the service running, each file against what the service
    recorded of it), one MAC'd verdict file per worker, the workers validated in parallel."""
    s = session(cfg)
    recorded = {r.path: r for r in s.service.submissions(step)} if s.service is not None else None
    if recorded and s.storage.scheme == "s3":
        # a presigned POST can be reused until it expires: read each object once it is final
        settled = uploads_settled_at([recorded[f] for fs in files.values() for f in fs if f in recorded],
                                     cfg.service.presign_expiry)
        time.sleep(max(0.0, settled - time.time()))

    def one(worker: str) -> ValidationReport:
        verdicts = S.validate_files(cfg, s.storage, step, files[worker], s.tasks, s.tokenizer, limits=s.limits,
                                    engines=s.engines, recorded=recorded)
        accepted = sum(v.status == "accepted" for v in verdicts)
        rel, tag = write_verdicts(s.storage, step, worker, verdicts, s.secret)
        return ValidationReport(worker=worker, verdicts=rel, mac=tag, accepted=accepted,
                                rejected=len(verdicts) - accepted)

    if not files:
        return []
    with ThreadPoolExecutor(min(len(files), cfg.workers.validate_parallel)) as pool:
        return list(pool.map(one, sorted(files)))


@task(name="record", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def record(cfg: RLRunConfig, step: int, verdict_files: list[tuple[str, str]]) -> RecordReport:
    """The verdict files of ``step`` (``(path, MAC)`` pairs) into the ledger, one transaction,
    idempotent; the step's counts. A file whose MAC does not verify fails the task."""
    s = session(cfg)
    res = s.ledger.record_table(step, read_verdicts(s.storage, verdict_files, s.secret))
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
    trained = not S.adopt_checkpoint(s.storage, s.ledger, step + 1)
    if trained:
        if s.trainer is None or s.trainer_step != step:
            if cfg.trainer_threads:
                torch.set_num_threads(cfg.trainer_threads)
            s.trainer = S.load_trainer(cfg, s.storage, s.ledger, step)
        torch.manual_seed(cfg.seed + step)
        saved = S.train_and_publish(cfg, s.storage, s.ledger, step, policy_step, s.trainer, s.limits)
        s.trainer_step = step + 1
    else:
        saved = S.saved_report(s.storage, s.ledger, step)
    secs = saved.get("train_seconds") or 0.0
    return UpdateReport(step=step, policy_step=saved["policy_step"], trained=trained,
                        trained_samples=saved["trained_samples"], loss=saved["loss"],
                        clip_fraction=saved["clip_fraction"], tokens=saved.get("tokens", 0),
                        tokens_per_second=saved.get("tokens", 0) / secs if secs else None, checkpoint=uri)


@task(name="broadcast", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def broadcast(cfg: RLRunConfig, step: int) -> str:
    """Make recorded checkpoint ``step`` known to the inference workers: published, signed, to the
    SHARDCAST origin (its relays pick it up shard by shard) when the run broadcasts weights (rl-train,
    or ``cfg.shardcast``); rl-step and rl-generate read run storage, where ``STABLE`` is the signal."""
    s = session(cfg)
    uri = s.storage.uri(s.storage.step_path(step, CHECKPOINTS))
    S.recorded_digest(s.ledger, step)
    if s.cdn is not None or cfg.shardcast is not None:
        _publish(cfg, s, step)
    return uri


@task(name="commit-step", cache_policy=NO_CACHE, retries=2, timeout_seconds=600)
def commit_step(cfg: RLRunConfig, step: int, timings: dict[str, float]) -> bool:
    s = session(cfg)
    committed = S.commit(s.storage, s.ledger, step, S.saved_report(s.storage, s.ledger, step), timings)
    if s.service is not None:
        s.service.set_committed(step)
    return committed


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
    model, tok = S.fetch_recorded(s.storage, s.ledger, step)
    return evaluate(model, tok, s.heldout).accuracy

