"""The RL run as one object: what the trainer's process holds between steps, and the phases of a step.

``with RLRun(cfg) as run:`` opens the run's storage, ledger, prompt pool and validator engines once
per process; leaving it (``close()``) stops whatever the run started (submission service, SHARDCAST
servers, worker processes) and closes the ledger. The trainer stays in memory between steps
(reloading it each step would cost more than the step); a fresh process rebuilds it from the newest
recorded checkpoint and its saved optimizer state. Each method is one phase with one side effect,
and each Prefect task of ``tasks/rl.py`` calls one; :func:`intellect.rl.trainer.local_step.run_rl_step` runs
them in order without Prefect.

What only the trainer may write stays in this process or behind its secret: done state is the
service's (``service.done``), verdict files carry a MAC under the run's secret
(:mod:`intellect.rl.service.verdicts`), and every checkpoint read is checked against the ledger's digest.
Workers reach the run only through the submission service and get weights only through SHARDCAST
versions signed with the trainer's key.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
from pydantic import BaseModel

from intellect.checkpoints import (
    CHECKPOINTS, CheckpointMismatch, SavedStepReport, adopt, digest, recorded_copy, recorded_digest,
    recorded_steps, verified_copy,
)
from intellect.inference.engines import folder_stop_ids, load_tokenizer
from intellect.launch import Handle, Launcher
from intellect.ledger import Ledger
from intellect.progress import Progress, duration
from intellect.rl.trainer import step as step_phases
from intellect.rl.wire.lag import policy_for
from intellect.rl.service.registry import read_salts, uploads_settled_at
from intellect.rl.trainer.evaluation import HeldOut
from intellect.rl.trainer.online_filter import FillReport, Reason, metrics, read_report, signal_count, write_report
from intellect.rl.trainer.report import CURVE, add_eval, load_evals, plot_curve
from intellect.rl.wire.rollouts import RolloutLimits, list_submissions, parse_submission_path
from intellect.rl.service.server import SubmissionService
from intellect.rl.trainer.setup import (
    SERVICE_DIR, ledger_path, local_run_dir, run_storage, seed_checkpoint, task_pool, trainer_dir, trainer_key,
    trainer_secret,
)
from intellect.rl.trainer.step import DoneMarker, EngineFactory, read_done_marker
from intellect.rl.worker.submission import RewardFn, prompt_tokens
from intellect.rl.service.verdicts import read_verdicts, write_verdicts
from intellect.rl.trainer.publish import publish_to_origin
from intellect.rl.trainer.ranks import ShardedTrainer
from intellect.rl.worker.worker import WorkerRunInfo
from intellect.rl.trainer.workers import WorkerResult, await_done, start_workers, stop_workers
from intellect.shardcast.local import LocalCDN, start_local
from intellect.shardcast.origin import Published
from intellect.storage import RunStorage
from intellect.trust import mac

log = logging.getLogger("intellect.rl.trainer.run")

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from intellect.data.loaders import Task
    from intellect.rl.config import RLRunConfig
    from intellect.rl.trainer.grpo import GRPOTrainer
    from intellect.rl.service.validator import RowCheck
    from intellect.trust.keys import SigningKey


class RunInfo(BaseModel):
    first_step: int  # the first step not committed in the ledger
    origin: str
    ledger: str
    pool: int
    evaluated: list[int]  # checkpoints with a held-out accuracy on record
    trainer_key: str  # the trainer's public key (hex): workers pin it (`intellect worker --trainer-key`)


class ValidationReport(BaseModel):
    worker: str
    verdicts: str  # the verdict file, relative to run storage
    mac: str  # its MAC under the run's secret (hex): the record phase checks it
    accepted: int
    rejected: int


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
    kl: float | None = None  # to the reference model (loss.kl_coef > 0)
    filter: FillReport | None = None  # what the online filter did before training (None: not trained here)
    counts: RecordReport | None = None  # the step's samples after the filter's rounds (None: it asked for none)


def generate_here(cfg: RLRunConfig, storage: RunStorage, tasks: Sequence[Task], step: int, worker: str,
                  ledger: Ledger | None = None, *, engine_factory: EngineFactory | None = None,
                  reward_fn: RewardFn | None = None) -> tuple[DoneMarker, list[str]]:
    """Generate ``worker``'s submissions of ``step`` in this process (skipped when its done marker
    exists); its done marker and the files this call wrote. ``reward_fn`` replaces the tasks' reward. With ``ledger`` (the trainer's process)
    only recorded checkpoints are used, verified; without (an operator's generation machine, which
    holds run storage but not the ledger) storage is believed."""
    if (done := read_done_marker(storage, step, worker)) is not None:
        return done, []
    available = storage.complete_steps(CHECKPOINTS) if ledger is None else recorded_steps(storage, ledger)
    policy = policy_for(step, cfg.async_level, available, cfg.policy_lag)
    if policy is None:
        raise FileNotFoundError(f"no checkpoint within {cfg.async_level} of step {step}")
    with verified_copy(storage, policy) if ledger is None else recorded_copy(storage, ledger, policy) as folder:
        engine = (engine_factory or step_phases.worker_engines(cfg))(folder)
        tok = load_tokenizer(folder)
    files, written = step_phases.worker_step(cfg, storage, step, worker, tasks, engine, tok, policy,
                                             limits=cfg.limits or RolloutLimits(vocab_size=len(tok)),
                                             reward_fn=reward_fn or cfg.tasks.reward_fn())
    return DoneMarker(files=files, policy_step=policy), written


def update_report(step: int, saved: SavedStepReport, trained: bool, checkpoint: str,
                  filled: FillReport | None = None) -> UpdateReport:
    """The update of ``step`` as the report saved with checkpoint ``step + 1`` has it."""
    secs = saved.train_seconds
    return UpdateReport(step=step, policy_step=saved.policy_step, trained=trained,
                        trained_samples=saved.trained_samples, loss=saved.loss, clip_fraction=saved.clip_fraction,
                        kl=saved.kl, tokens=saved.tokens, tokens_per_second=saved.tokens / secs if secs else None,
                        checkpoint=checkpoint, filter=filled)


class RLRun:
    """One RL run as the trainer's process holds it (see the module docstring)."""

    def __init__(self, cfg: RLRunConfig, *, storage: RunStorage | None = None, ledger: Ledger | None = None,
                 tasks: Sequence[Task] | None = None, reward_fn: RewardFn | None = None,
                 extra_checks: Sequence[RowCheck] = (), engine_factory: EngineFactory | None = None,
                 secret: bytes | None = None):
        """The run of ``cfg``; ``storage``, ``ledger`` and ``tasks`` default to the run's own (a given
        ledger stays open on close: its owner closes it). ``reward_fn``, ``extra_checks`` and
        ``engine_factory`` replace the tasks' reward (``cfg.tasks.reward_fn()``), add validator checks and replace the workers'
        engines (tests and benchmarks); ``secret`` replaces the run's secret file for verdicts that
        never leave this process."""
        self.cfg = cfg
        self.storage = storage or run_storage(cfg)
        self._owns_ledger = ledger is None
        self.ledger = ledger or Ledger(ledger_path(cfg))
        self._tasks: list[Task] | None = list(tasks) if tasks is not None else None
        self.reward_fn = reward_fn or cfg.tasks.reward_fn()
        self.extra_checks, self.engine_factory = list(extra_checks), engine_factory
        self.engines = step_phases.CheckpointEngines(self.storage, self.ledger, keep=cfg.async_level + 2,
                                                     compute=cfg.compute)
        self.stopping = threading.Event()  # set: waits for workers give up
        self.trainer: GRPOTrainer | ShardedTrainer | None = None  # holding checkpoint `trainer_step`
        self.trainer_step = -1
        self.cdn: LocalCDN | None = None  # SHARDCAST origin and relays this process started
        self.relays: list[str] = []  # what the workers download from
        self.service: SubmissionService | None = None  # the workers' door into the run
        self.workers: dict[str, Handle] = {}  # the worker processes started here
        self.worker_ids: dict[str, str] = {}  # name -> key id of the workers started here
        self._secret = secret
        self._key: SigningKey | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._eos_ids: list[int] | None = None
        self._validated: dict[int, set[str]] = {}  # step -> its files validated by this process
        self._silent: dict[int, set[str]] = {}  # step -> workers that let one of its filter's rounds pass
        self.heldout = HeldOut(cfg.tasks, cfg.eval.size, self.storage)

    @property
    def secret(self) -> bytes:
        """The run's secret (``trainer/secret``): the key of the verdict files' MACs."""
        if self._secret is None:
            self._secret = trainer_secret(self.cfg)
        return self._secret

    @property
    def key(self) -> SigningKey:
        """The trainer's key (``trainer/trainer.key``): signs every SHARDCAST version."""
        if self._key is None:
            self._key = trainer_key(self.cfg)
        return self._key

    def __enter__(self) -> RLRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop what the run started here and close the ledger (idempotent)."""
        self.stopping.set()
        try:
            if self.workers:
                self.stop_workers()
        finally:
            self.close_trainer()
            self.stop_service()
            self.stop_shardcast()
            if self._owns_ledger:
                self.ledger.close()

    def close_trainer(self) -> None:
        """Stop the trainer's other ranks (``trainer.ranks > 1``); the trainer is built again when needed."""
        trainer, self.trainer, self.trainer_step = self.trainer, None, -1
        if isinstance(trainer, ShardedTrainer):
            trainer.close()

    def release_ledger(self) -> None:
        """Close the ledger connection (reopened on next use), so a flow run in another process can
        write it (DuckDB: one writing process at a time)."""
        self.ledger.close()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The run's tokenizer, from recorded checkpoint 0 (read on first use)."""
        tok = self._tokenizer
        if tok is None:
            with recorded_copy(self.storage, self.ledger, 0) as folder:
                tok = self._tokenizer = load_tokenizer(folder)
                self._eos_ids = folder_stop_ids(folder)
        return tok

    @property
    def eos_ids(self) -> list[int]:
        """What the run's engines stop at (the tokenizer's EOS and checkpoint 0's generation config's):
        the ends the validator accepts."""
        if self._eos_ids is None:
            _ = self.tokenizer
        assert self._eos_ids is not None
        return self._eos_ids

    @property
    def tasks(self) -> list[Task]:
        """The training prompts (:func:`~intellect.rl.trainer.setup.task_pool`, rendered with the run's tokenizer,
        loaded on first use)."""
        if self._tasks is None:
            self._tasks = task_pool(self.cfg.tasks, self.storage, tokenizer=self.tokenizer,
                                    prompt=self.cfg.submission.prompt)
        return self._tasks

    @property
    def limits(self) -> RolloutLimits:
        return self.cfg.limits or RolloutLimits(vocab_size=len(self.tokenizer))

    # ------------------------------------------------------------------ setup and servers

    def prepare(self) -> RunInfo:
        """Checkpoint 0 from ``cfg.init`` (kept when its digest is recorded) and the config beside it."""
        origin = seed_checkpoint(self.cfg, self.storage, self.ledger)
        self.storage.write_text("run.json", self.cfg.model_dump_json(indent=1))
        self.stopping.clear()
        committed = self.ledger.committed_steps()
        return RunInfo(first_step=max(committed) + 1 if committed else 0, origin=origin,
                       ledger=str(ledger_path(self.cfg)), pool=len(self.tasks),
                       evaluated=[e["step"] for e in load_evals(self.storage)], trainer_key=self.key.public.hex)

    def _origin_dir(self) -> Path:
        return local_run_dir(self.cfg) / "shardcast" / "origin"

    def start_shardcast(self) -> list[str]:
        """The SHARDCAST origin, and ``local_relays`` relays unless ``shardcast.relays`` names relays
        run elsewhere (without ``cfg.shardcast``: an origin alone); the URLs workers download from."""
        sc = self.cfg.weights_broadcast()
        if self.cdn is None:
            local = sc if sc.relays is None else sc.model_copy(update={"local_relays": 0})
            self.cdn = start_local(local, self._origin_dir().parent, self.key.public)
        self.relays = sc.relays or self.cdn.relay_urls
        return self.relays

    def stop_shardcast(self) -> None:
        if self.cdn is not None:
            self.cdn.stop()
            self.cdn = None

    def publish(self, step: int) -> dict:
        """Sign and publish checkpoint ``step`` to the origin only when it still has the digest the
        ledger recorded: the trainer's signature must never cover bytes it did not write."""
        want = recorded_digest(self.ledger, step)
        if (got := digest(self.storage, step)) != want:
            raise CheckpointMismatch(step, want, got, self.storage.uri(self.storage.step_path(step, CHECKPOINTS)))
        cfg = self.cfg if self.cfg.shardcast is not None else self.cfg.model_copy(
            update={"shardcast": self.cfg.weights_broadcast()})
        return publish_to_origin(cfg, self.storage, step, self._origin_dir(), signing_key=self.key)

    def newest_recorded(self) -> int:
        return max(recorded_steps(self.storage, self.ledger))

    def start_service(self, first_step: int) -> str:
        """The submission service beside the trainer (its records in ``trainer/service`` of the local
        run folder); its URL. Workers may run ``async_level`` steps past the newest committed one, unless
        ``service.ahead`` says otherwise (:meth:`~intellect.rl.config.RLRunConfig.service_config`)."""
        if self.service is None:
            cfg = self.cfg

            def run_info() -> dict:
                return WorkerRunInfo.of(cfg, service.committed, self.relays).model_dump(mode="json")

            # a submission's prompts are rendered tasks of the pool: the longest bounds what one can declare
            longest = max(len(prompt_tokens(self.tokenizer, t, cfg.submission.prompt)) for t in self.tasks)
            service = SubmissionService(
                cfg.service_config(prompt_tokens=longest), run=cfg.run_name, storage=self.storage, state_dir=trainer_dir(cfg) / SERVICE_DIR,
                run_info=run_info, tasks=self.tasks, prompts_per_submission=cfg.submission.prompts_per_submission,
                committed=first_step - 1, salt_key=mac.derive_key(self.secret, "worker-salt"),
            )
            service.start()
            self.service = service
        return self.service.url

    def stop_service(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None

    def start_workers(self, url: str, launcher: Launcher, env: Mapping[str, str] | None = None
                      ) -> dict[str, int | None]:
        """One ``intellect worker`` per name of ``workers.names`` through ``launcher``, talking to the
        run only through the service at ``url``; their PIDs (None: not a local process)."""
        handles, self.worker_ids = start_workers(self.cfg, url, self.key.public.hex, launcher, env)
        self.workers |= handles
        return {w: getattr(h, "pid", None) for w, h in handles.items()}

    def stop_workers(self, grace: float = 10.0) -> dict[str, int | None]:
        """Exit codes of the workers started here, stopped by :func:`~intellect.rl.trainer.workers.stop_workers`."""
        handles, self.workers = self.workers, {}
        return stop_workers(handles, grace)

    # ------------------------------------------------------------------ the phases of a step

    def collect(self, step: int, local: bool, on_missing: Callable[[list[str]], None] = lambda m: None
                ) -> list[WorkerResult]:
        """Every local worker's submissions of ``step``: generated here (``local``, a thread per
        worker, done markers in run storage), or sent by the ``intellect worker`` processes through
        the service (done when ``service.done(step)`` says so), awaited up to
        ``workers.submission_timeout`` (:func:`await_done`)."""
        cfg, t0 = self.cfg, time.perf_counter()
        if local:
            self.generate(step, cfg.workers.names)
        service = None if local else self.service
        # local workers by name; remote ones (service only) by key id
        ids = {w: self.worker_ids.get(w, "") for w in cfg.workers.names}
        if service is not None:
            ids |= {r: r for r in cfg.workers.remote}

        def finished() -> dict[str, WorkerResult]:
            if service is not None:
                recs = service.done(step)
                return {w: WorkerResult(worker=w, files=list(rec.files), policy_step=rec.policy_step,
                                        seconds=time.perf_counter() - t0)
                        for w, wid in ids.items() if (rec := recs.get(wid)) is not None}
            markers = {w: read_done_marker(self.storage, step, w) for w in ids}
            return {w: WorkerResult(worker=w, files=m.files, policy_step=m.policy_step, seconds=time.perf_counter() - t0)
                    for w, m in markers.items() if m is not None}

        try:
            return await_done(list(ids), finished, timeout=cfg.workers.submission_timeout,
                              poll=cfg.workers.poll_interval, stopping=self.stopping, on_missing=on_missing)
        except RuntimeError as e:
            raise RuntimeError(f"run {cfg.run_name}: {e} (step {step})") from None

    def generate(self, step: int, workers: Sequence[str]) -> list[str]:
        """Each of ``workers``' submissions of ``step``, generated in this process (a thread per worker;
        a worker whose done marker exists is skipped) with the newest recorded checkpoint the lag rule
        allows; the files written."""
        def one(w: str) -> list[str]:
            return generate_here(self.cfg, self.storage, self.tasks, step, w, self.ledger,
                                 engine_factory=self.engine_factory, reward_fn=self.reward_fn)[1]

        if not workers:
            return []
        with ThreadPoolExecutor(len(workers)) as pool:
            return [f for written in pool.map(one, workers) for f in written]

    def done_policies(self, step: int) -> list[int]:
        """The policy steps the done markers of ``step``'s local workers name."""
        return [m.policy_step for w in self.cfg.workers.names
                if (m := read_done_marker(self.storage, step, w)) is not None]

    def step_files(self, step: int) -> dict[str, list[str]]:
        """``step``'s submission files by worker, workers in the order their first file arrived: what the
        service recorded (while it runs here), else the files in run storage (operator-owned
        generation, in the order listed)."""
        rels = ([r.path for r in self.service.submissions(step)] if self.service is not None
                else list_submissions(self.storage, step))
        by_worker: dict[str, list[str]] = {}
        for rel in rels:
            by_worker.setdefault(parse_submission_path(rel)[1], []).append(rel)
        return by_worker

    def validate(self, step: int, files: Mapping[str, Sequence[str]], refill: int = 0) -> list[ValidationReport]:
        """Verdicts on every sample of ``step``'s submission ``files`` (worker -> files; rewards
        recomputed, every check of the validator, and with the service running, each file against
        what the service recorded of it, and each admitted worker's file against the salt of its key in
        the service's registry), one MAC'd verdict file per worker, workers in parallel. The reports
        keep the order of ``files`` (the service's arrival order, :meth:`step_files`): the ledger lets
        the first accepted copy of a sample win, and ids can be ground to sort first, arrivals not.
        ``refill``: the online filter's round of assignment the files answer (its verdict files are
        named apart, so a round never overwrites an earlier one's)."""
        recorded = {r.path: r for r in self.service.submissions(step)} if self.service is not None else None
        salts = (self.service.registry.salts() if self.service is not None
                 else read_salts(trainer_dir(self.cfg) / SERVICE_DIR))
        if recorded and self.storage.scheme == "s3":
            # a presigned POST can be reused until it expires: read each object once it is final
            settled = uploads_settled_at([recorded[f] for fs in files.values() for f in fs if f in recorded],
                                         self.cfg.service.presign_expiry)
            time.sleep(max(0.0, settled - time.time()))
        tokenizer, limits = self.tokenizer, self.limits

        def one(worker: str) -> ValidationReport:
            verdicts = step_phases.validate_files(self.cfg, self.storage, step, files[worker], self.tasks,
                                                  tokenizer, limits=limits, engines=self.engines, recorded=recorded,
                                                  reward_fn=self.reward_fn, extra_checks=self.extra_checks,
                                                  salts=salts, eos_ids=self.eos_ids)
            accepted = sum(v.status == "accepted" for v in verdicts)
            if accepted and self.service is not None:
                self.service.credit(worker)  # its uploads and connections may use the service's reserve
            rel, tag = write_verdicts(self.storage, step, f"{worker}.refill-{refill}" if refill else worker, verdicts,
                                      self.secret)
            return ValidationReport(worker=worker, verdicts=rel, mac=tag, accepted=accepted,
                                    rejected=len(verdicts) - accepted)

        if not files:
            return []
        self._validated.setdefault(step, set()).update(f for fs in files.values() for f in fs)
        with ThreadPoolExecutor(min(len(files), self.cfg.workers.validate_parallel)) as pool:
            return list(pool.map(one, list(files)))

    # ------------------------------------------------------------------ the online filter

    def fill(self, step: int) -> FillReport:
        """Hold ``step`` until its validated samples with signal reach ``online_filter.min_signal_samples``
        (:mod:`~intellect.rl.trainer.online_filter`): rounds of assignment, each validated and recorded,
        until the count, ``max_rounds`` or a round that brings nothing. The report is kept in run
        storage; the step then trains on what it holds."""
        f = self.cfg.online_filter
        accepted, signal = signal_count(self.ledger, step)
        rounds = files = 0
        reason: Reason = "reached" if f.min_signal_samples else "off"
        self._silent[step] = set()
        try:
            while signal < f.min_signal_samples:
                if self.stopping.is_set():
                    reason = "stopping"
                    break
                if rounds >= f.max_rounds:
                    reason = "max_rounds"
                    break
                rounds += 1
                got = self._refill_round(step, rounds)
                if not got:
                    reason = "no_submissions"
                    break
                files += got
                accepted, signal = signal_count(self.ledger, step)
        finally:
            self._silent.pop(step, None)
            if self.service is not None:
                self.service.end_refill(step)
        report = FillReport(step=step, target=f.min_signal_samples, accepted=accepted, signal=signal,
                            rounds=rounds, files=files, reason=reason)
        if f.min_signal_samples:
            write_report(self.storage, report)
            log.info("step %d online filter: %s", step, report.model_dump())
        return report

    def _refill_round(self, step: int, refill: int) -> int:
        """One round of assignment at ``step``, validated and recorded; the files it brought."""
        if self.service is not None:
            self._await_round(step)
        else:
            self._generate_round(step)
        seen = self._validated.get(step, set())
        new = {w: [x for x in fs if x not in seen] for w, fs in self.step_files(step).items()}
        new = {w: fs for w, fs in new.items() if fs}
        reports = self.validate(step, new, refill=refill)
        self.record(step, [(r.verdicts, r.mac) for r in reports])
        return sum(len(fs) for fs in new.values())

    def _await_round(self, step: int) -> None:
        """Open a round at the service and wait until every worker of the step that may still submit
        added a file (any other worker's file counts too), or ``round_timeout``. A worker that let a
        round pass without a file is not waited for again at this step (it may still answer)."""
        assert self.service is not None
        cap, poll, silent = self.service.per_step, self.cfg.workers.poll_interval, self._silent.setdefault(step, set())
        before = {w: len(fs) for w, fs in self.step_files(step).items()}
        self.service.request_refill(step)
        deadline = time.monotonic() + self.cfg.online_filter.round_timeout
        while True:
            now = self.step_files(step)
            waiting = {w for w, n in before.items() if n < cap and w not in silent and len(now.get(w, ())) <= n}
            if not waiting:
                return
            if time.monotonic() >= deadline or self.stopping.is_set():
                silent |= waiting
                return
            time.sleep(poll)

    def _generate_round(self, step: int) -> None:
        """Each worker generating here adds one submission of ``step``, with the checkpoint its done
        marker names (the lag rule's choice when it has none)."""
        engines: dict[int, tuple] = {}
        for w in self.cfg.workers.names:
            done = read_done_marker(self.storage, step, w)
            policy = done.policy_step if done is not None else policy_for(
                step, self.cfg.async_level, recorded_steps(self.storage, self.ledger), self.cfg.policy_lag)
            if policy is None:
                continue
            if policy not in engines:
                with recorded_copy(self.storage, self.ledger, policy) as folder:
                    engines[policy] = ((self.engine_factory or step_phases.worker_engines(self.cfg))(folder),
                                       load_tokenizer(folder))
            engine, tok = engines[policy]
            step_phases.add_submission(self.cfg, self.storage, step, w, self.tasks, engine, tok, policy,
                                       limits=self.limits, reward_fn=self.reward_fn)

    def record(self, step: int, verdict_files: Sequence[tuple[str, str]]) -> RecordReport:
        """The verdict files of ``step`` (``(path, MAC)`` pairs) into the ledger, one transaction,
        idempotent; the step's counts. A file whose MAC does not verify raises."""
        res = self.ledger.record_table(step, read_verdicts(self.storage, list(verdict_files), self.secret))
        return self.counts(step, res.inserted)

    def counts(self, step: int, inserted: int = 0) -> RecordReport:
        """The step's sample counts in the ledger (every round the online filter asked for included)."""
        rows = self.ledger.step_verdicts(step)
        accepted = next((r for r in rows if r["status"] == "accepted"), None)
        reasons = {r["reason"]: r["n"] for r in rows if r["status"] == "rejected"}
        return RecordReport(accepted=accepted["n"] if accepted else 0, rejected=sum(reasons.values()),
                            reasons=reasons, mean_reward=accepted["mean_reward"] if accepted else None,
                            inserted=inserted)

    def update(self, step: int, policy_step: int) -> UpdateReport:
        """Train on the step's accepted samples and publish checkpoint ``step + 1`` (skipped when it
        exists), once the online filter holds enough of them (:meth:`fill`); the trainer stays in
        memory for the next step."""
        uri = self.storage.uri(self.storage.step_path(step + 1, CHECKPOINTS))
        trained = not adopt(self.storage, self.ledger, step + 1)
        filled = None
        if trained:
            filled = self.fill(step)
            if self.trainer is None or self.trainer_step != step:
                self.close_trainer()
                if self.cfg.trainer_threads:
                    torch.set_num_threads(self.cfg.trainer_threads)
                self.trainer = step_phases.load_trainer(self.cfg, self.storage, self.ledger, step)
            torch.manual_seed(self.cfg.seed + step)
            saved = step_phases.train_and_publish(self.storage, self.ledger, step, policy_step, self.trainer,
                                                  self.limits)
            self.trainer_step = step + 1
        else:
            saved = step_phases.saved_report(self.storage, self.ledger, step)
        report = update_report(step, saved, trained, uri, filled)
        if filled is not None and filled.rounds:
            report.counts = self.counts(step)
        return report

    def broadcast(self, step: int) -> Published | None:
        """Make recorded checkpoint ``step`` known to the inference workers: published, signed, to the
        SHARDCAST origin when the run broadcasts weights (its servers run here, or ``cfg.shardcast``),
        and what that published (its bytes against the whole checkpoint's); without, workers read run
        storage, where ``STABLE`` is the signal (None)."""
        recorded_digest(self.ledger, step)
        if self.cdn is None and self.cfg.shardcast is None:
            return None
        pub = Published.model_validate(self.publish(step))
        if pub.share is not None:
            log.info("checkpoint %d broadcast as %s: %d bytes, %.1f%% of the checkpoint's %d", step, pub.encoding,
                     pub.bytes, 100 * pub.share, pub.full_bytes)
        return pub

    def commit(self, step: int, timings: Mapping[str, float]) -> bool:
        """Commit ``step`` (its checkpoint ``step + 1`` recorded) and tell the service; False when it
        was committed already."""
        saved = step_phases.saved_report(self.storage, self.ledger, step)
        committed = step_phases.commit(self.ledger, step, saved,
                                       {**timings, **metrics(read_report(self.storage, step))})
        if self.service is not None:
            self.service.set_committed(step)
        return committed

    def evaluate(self, step: int) -> float:
        """Held-out greedy accuracy of recorded checkpoint ``step`` (:mod:`intellect.rl.trainer.evaluation`),
        kept in the run's eval record."""
        bar = Progress(f"held-out eval of checkpoint {step}", unit="", interval=self.cfg.logging.progress_seconds,
                       heartbeat=True)
        bar.begin(f"greedy answers to {self.heldout.size} held-out prompts")
        with bar:
            bar.waiting("generating and scoring")
            with recorded_copy(self.storage, self.ledger, step) as folder:
                accuracy = self.heldout.accuracy(folder, load_tokenizer(folder), self.cfg.submission,
                                                 reward_fn=self.reward_fn, compute=self.cfg.compute)
            bar.close(f"accuracy {accuracy:.3f} in {duration(bar.clock() - bar.t0)}")
        add_eval(self.storage, step, accuracy)
        return accuracy

    def committed_step(self, step: int) -> dict | None:
        """The ledger's record of committed ``step`` (None: not committed)."""
        return self.ledger.get_step(step)

    def summarize(self, curve: bool) -> tuple[list[dict], str | None]:
        """The run's eval record and, with ``curve`` and some evals, the URI of its curve (written now)."""
        evals = load_evals(self.storage)
        if not (curve and evals):
            return evals, None
        self.storage.write_bytes(CURVE, plot_curve(self.ledger.steps(), evals,
                                                   f"GRPO {self.cfg.run_name} (async_level {self.cfg.async_level})"))
        return evals, self.storage.uri(CURVE)
