"""One RL step, locally and synchronously: generate, validate, record, train, publish, commit.

:func:`run_rl_step` plays every role of an INTELLECT-2 step in one process (each worker, the
validator, the trainer) over real run storage and the ledger; the phases it calls are also the
bodies of the Prefect tasks of ``flows/rl.py``, where the workers are ``intellect worker``
processes that submit through the submission service (:mod:`intellect.rl.worker`). Each phase
leaves durable state, and a rerun of a crashed step resumes from it without double counting:

* a worker's submission file that exists is not regenerated (it may already be in the ledger,
  which keys verdicts by file and row), and a worker whose done marker exists is finished (done
  markers are written by in-process generation only: operator-owned machines with run storage);
* every file is validated again and recorded; the ledger ignores rows it already holds;
* checkpoint ``step + 1`` found ``STABLE`` is adopted only when the ledger holds its digest, which
  the trainer records right after publishing it (:func:`adopt_checkpoint`); any other one (a crash
  between publish and record, or a folder the trainer did not write) is deleted and retrained;
* committing an already committed step is a no-op (and a committed step returns at once).

Every checkpoint read here is verified against the digest the ledger recorded for its step
(:func:`~intellect.pretrain.checkpoint_digest`; checkpoint 0 is recorded when it is seeded), and
only recorded checkpoints count as available (:func:`recorded_steps`).

Training step ``n`` starts from checkpoint ``n``; generation uses the newest checkpoint the lag rule
allows (:func:`~intellect.rl.lag.policy_for`). Groups whose accepted rewards are all equal carry no
gradient and are dropped, and a worker keeps adding submissions until it holds enough samples with
signal (INTELLECT-2's online filter, :func:`worker_step`); a step left with no sample publishes the
unchanged weights, so the run keeps moving. Advantages and rewards come from the ledger (the
validator's), never from the workers' files, and the samples are trained in a canonical order (by
content hash), so the order in which submissions arrived cannot change the update.
"""

from __future__ import annotations

import functools
import io
import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from intellect.inference.torch_engine import TorchEngine
from intellect.ledger import StepMetrics
from intellect.pretrain import CHECKPOINTS, checkpoint_digest, fetch_checkpoint, verified_checkpoint
from intellect.rl.advantages import nonzero_signal
from intellect.rl.assignment import canonical_worker
from intellect.rl.lag import policy_for
from intellect.rl.rollouts import (
    KIND, RolloutLimits, list_submissions, load_submission, submission_path, write_submission,
)
from intellect.rl.submission import RewardFn, generate_submission, math_task_reward
from intellect.model.checkpoint import load_checkpoint_copy
from intellect.rl.trainer import GRPOTrainer, Sample, load_accepted
from intellect.rl.validator import RowCheck, validate_submission
from intellect.toploc.check import toploc_check

if TYPE_CHECKING:
    from intellect.data.loaders import MathTask
    from intellect.inference.protocol import InferenceEngine
    from intellect.ledger import Ledger
    from intellect.rl.config import RLRunConfig
    from intellect.storage import RunStorage
    from intellect.verdict import Verdict

STEP_REPORT = "rl_step.json"  # saved with each checkpoint, so a rerun that skips training can still commit
OPTIMIZER = "optimizer.pt"  # the trainer's AdamW state and step count, so a resumed run keeps its moments

EngineFactory = Callable[[torch.nn.Module, Any], "InferenceEngine"]


def torch_engine(model: torch.nn.Module, tokenizer, capture_hidden: bool = False) -> InferenceEngine:
    """The worker's engine; hidden states are captured only when TOPLOC proofs are built from them."""
    return TorchEngine.for_tokenizer(model, tokenizer, capture_hidden=capture_hidden)


def worker_engines(cfg: RLRunConfig) -> EngineFactory:
    """The worker engine ``cfg`` needs: with hidden-state capture when ``cfg.toploc`` is set."""
    return functools.partial(torch_engine, capture_hidden=cfg.toploc is not None)


class _Serialized:
    """An engine whose ``prefill`` runs one call at a time: the engine collects hidden states in
    per-call hooks on the shared model, so two threads in one prefill would mix their rows."""

    def __init__(self, engine: TorchEngine):
        self.engine, self._lock = engine, threading.Lock()

    def prefill(self, *args: Any, **kwargs: Any):
        with self._lock:
            return self.engine.prefill(*args, **kwargs)


def recorded_digest(ledger: Ledger, step: int) -> str:
    """The digest the ledger recorded for checkpoint ``step``; ``FileNotFoundError`` when none is."""
    got = ledger.checkpoint(step)
    if got is None:
        raise FileNotFoundError(f"checkpoint {step} is not recorded in the ledger")
    return got[1]


def recorded_steps(storage: RunStorage, ledger: Ledger) -> list[int]:
    """The complete checkpoints whose digest the ledger holds: the only ones the run uses."""
    return [c for c in storage.complete_steps(CHECKPOINTS) if ledger.checkpoint(c) is not None]


def fetch_recorded(storage: RunStorage, ledger: Ledger, step: int):
    """Model and tokenizer of checkpoint ``step``, verified against the ledger's digest."""
    return fetch_checkpoint(storage, step, sha256=recorded_digest(ledger, step))


class CheckpointEngines:
    """The validator's engines of recent checkpoints (hidden states captured), loaded on first use.

    Calling it with a policy step returns an engine holding that checkpoint, verified against the
    ledger's digest (``FileNotFoundError`` when it is not complete in storage or not recorded, which
    the TOPLOC check reports as an unknown checkpoint); the ``keep`` most recently loaded stay in
    memory. Safe to use from several validation threads: each engine's prefills are serialized.
    """

    def __init__(self, storage: RunStorage, ledger: Ledger, keep: int = 4):
        self.storage, self.ledger, self.keep = storage, ledger, keep
        self._engines: dict[int, _Serialized] = {}
        self._lock = threading.Lock()

    def __call__(self, policy: int) -> _Serialized:
        with self._lock:
            if policy not in self._engines:
                model, tok = fetch_recorded(self.storage, self.ledger, policy)
                self._engines[policy] = _Serialized(TorchEngine.for_tokenizer(model, tok, capture_hidden=True))
                for old in sorted(self._engines)[:-self.keep]:
                    del self._engines[old]
            return self._engines[policy]


@dataclass(frozen=True)
class StepReport:
    step: int
    policy_step: int
    files: list[str]
    generated: list[str]  # files written by this call (the rest existed)
    accepted: int
    rejected: int
    trained_samples: int
    trained: bool  # False when the checkpoint existed (a rerun) or the step was committed already
    checkpoint: str
    committed: bool  # True when this call committed the step
    loss: float | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _signal_rows(rows: list[dict]) -> list[dict]:
    """The accepted ledger rows of groups whose rewards are not all equal."""
    if not rows:
        return []
    keys = {}
    ids = torch.tensor([keys.setdefault((r["file"], r["group_id"]), len(keys)) for r in rows])
    keep = nonzero_signal(torch.tensor([r["reward"] for r in rows], dtype=torch.float64), ids)
    return [r for r, k in zip(rows, keep.tolist()) if k]


def step_counts(ledger: Ledger, step: int) -> tuple[int, int]:
    """(accepted, rejected) samples of ``step`` in the ledger."""
    n = {"accepted": 0, "rejected": 0}
    for row in ledger.step_verdicts(step):
        n[row["status"]] += row["n"]
    return n["accepted"], n["rejected"]


def done_marker(step: int, worker: str) -> str:
    """Where a worker says it has written all its submissions of ``step`` (JSON: the file list)."""
    return f"{KIND}/step_{step}/{canonical_worker(worker)}.done"


def _signal_samples(rows: Sequence) -> int:
    """Samples of ``rows`` (one submission) in groups whose claimed rewards differ."""
    if not rows:
        return 0
    keep = nonzero_signal(torch.tensor([r.reward for r in rows], dtype=torch.float64),
                          torch.tensor([r.group_id for r in rows]))
    return int(keep.sum())


def worker_step(
    cfg: RLRunConfig,
    storage: RunStorage,
    step: int,
    worker: str,
    tasks: Sequence[MathTask],
    engine: InferenceEngine,
    tokenizer,
    policy: int,
    *,
    limits: RolloutLimits,
    reward_fn: RewardFn = math_task_reward,
) -> tuple[list[str], list[str]]:
    """One worker's part of ``step``: submissions ``0, 1, ...`` until their samples with signal reach
    ``cfg.workers.min_signal_samples`` (INTELLECT-2's online filter) or ``max_submissions`` files
    exist, then the done marker. Files already there count and are not regenerated. Returns
    (all its files of the step, the files this call wrote)."""
    files, written, signal = [], [], 0
    for k in range(cfg.workers.max_submissions):
        rel = submission_path(step, worker, k)
        if storage.exists(rel):
            rows = load_submission(storage, rel, limits)
        else:
            rows = generate_submission(engine, tokenizer, tasks, worker, step, k, policy, cfg.submission,
                                       run=cfg.run_name, reward_fn=reward_fn, proofs=cfg.toploc)
            write_submission(storage, step, worker, k, rows, limits=limits)
            written.append(rel)
        files.append(rel)
        signal += _signal_samples(rows)
        if signal >= cfg.workers.min_signal_samples:
            break
    storage.write_text(done_marker(step, worker), json.dumps({"files": files, "policy_step": policy}))
    return files, written


def validate_files(
    cfg: RLRunConfig, storage: RunStorage, step: int, files: Sequence[str], tasks: Sequence[MathTask], tokenizer,
    *, limits: RolloutLimits, engines: CheckpointEngines, reward_fn: RewardFn = math_task_reward,
    extra_checks: Sequence[RowCheck] = (), recorded: Mapping[str, Any] | None = None,
) -> list[Verdict]:
    """The validator's verdicts on every sample of ``files`` (never raises on their content). With
    ``cfg.toploc``, every row's proofs are checked too, by one prefill with the checkpoint it claims
    (``engines``). ``recorded`` maps a file to what the submission service recorded of it (its
    ``worker``, ``sha256`` and ``size``): the file must be that worker's, of that size, and hash as
    recorded."""
    if cfg.toploc is not None:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        extra_checks = [*extra_checks, toploc_check(engines, cfg.submission.sampling(), cfg.toploc, eos)]
    out = []
    for rel in files:
        rec = (recorded or {}).get(rel)
        out += validate_submission(
            storage, rel, tasks=tasks, tokenizer=tokenizer, step=step, async_level=cfg.async_level,
            limits=limits, cfg=cfg.submission, run=cfg.run_name, reward_fn=reward_fn, extra_checks=extra_checks,
            worker=None if rec is None else rec.worker, sha256=None if rec is None else rec.sha256,
            size=None if rec is None else rec.size,
        )
    return out


def load_trainer(cfg: RLRunConfig, storage: RunStorage, ledger: Ledger, step: int) -> GRPOTrainer:
    """A trainer holding checkpoint ``step`` and, when saved with it, the optimizer state, both read
    from one copy verified against the ledger's digest."""
    with verified_checkpoint(storage, step, sha256=recorded_digest(ledger, step)) as folder:
        model, tok = load_checkpoint_copy(folder)
        trainer = GRPOTrainer(model, tok, cfg.trainer)
        if (folder / OPTIMIZER).exists():
            trainer.load_state_dict(torch.load(folder / OPTIMIZER, weights_only=True))
    return trainer


def adopt_checkpoint(storage: RunStorage, ledger: Ledger, step: int) -> bool:
    """Whether checkpoint ``step`` is the trainer's and complete: ``STABLE`` with the digest the ledger
    recorded. Any other folder at that step (half-written, published by a crashed attempt before its
    record, or written by someone else) is deleted, and False means: train it (again)."""
    rel = storage.step_path(step, CHECKPOINTS)
    rec = ledger.checkpoint(step)
    if storage.is_stable(step, CHECKPOINTS) and rec is not None:
        try:
            if checkpoint_digest(storage, step) == rec[1]:
                return True
        except FileNotFoundError:
            pass
    if storage.exists(rel):
        storage.delete(rel, recursive=True)
    return False


def train_and_publish(
    cfg: RLRunConfig, storage: RunStorage, ledger: Ledger, step: int, policy: int, trainer: GRPOTrainer,
    limits: RolloutLimits,
) -> dict:
    """Train ``trainer`` (holding checkpoint ``step``) on the step's accepted samples with signal and
    publish checkpoint ``step + 1`` with its report and optimizer state; the report is returned.
    A step without such samples publishes the unchanged weights, so the run keeps moving."""
    rows = sorted(_signal_rows(ledger.accepted(step)), key=lambda r: (r["content_hash"], r["file"], r["row_index"]))
    rollouts = load_accepted(storage, rows, limits)
    samples = [Sample(r.prompt_tokens, r.output_tokens, float(row["advantage"])) for r, row in zip(rollouts, rows)]
    stats = trainer.train_step(samples) if samples else None
    saved = {"policy_step": policy, "trained_samples": len(samples),
             "loss": None if stats is None else stats.loss,
             "clip_fraction": None if stats is None else stats.clip_fraction,
             "ratio_max": None if stats is None else stats.ratio_max,
             "grad_norm": None if stats is None else stats.grad_norm,
             "tokens": 0 if stats is None else stats.tokens,
             "train_seconds": 0.0 if stats is None else stats.seconds}
    buf = io.BytesIO()
    torch.save(trainer.state_dict(), buf)
    extra = {STEP_REPORT: saved, OPTIMIZER: buf.getvalue()}
    for attempt in range(3):
        try:
            uri = trainer.publish(storage, step + 1, extra)
            break
        except FileExistsError:  # a folder the trainer did not write appeared since adopt_checkpoint cleared it
            if attempt == 2 or adopt_checkpoint(storage, ledger, step + 1):
                raise
    # recorded right after publishing: a crash in between leaves a folder that adopt_checkpoint deletes
    ledger.record_checkpoint(step + 1, uri, checkpoint_digest(storage, step + 1))
    return saved


def saved_report(storage: RunStorage, ledger: Ledger, step: int) -> dict:
    """The report published with checkpoint ``step + 1`` by :func:`train_and_publish`, read from a copy
    verified against the ledger's digest."""
    with verified_checkpoint(storage, step + 1, sha256=recorded_digest(ledger, step + 1)) as folder:
        return json.loads((folder / STEP_REPORT).read_text())


def commit(storage: RunStorage, ledger: Ledger, step: int, saved: dict, timings: dict[str, float]) -> bool:
    """Commit the step, whose checkpoint ``step + 1`` must be recorded (idempotent: False when already
    committed)."""
    recorded_digest(ledger, step + 1)
    return ledger.commit_step(step, StepMetrics(
        loss=saved["loss"], clip_fraction=saved["clip_fraction"], trained_samples=saved["trained_samples"],
        timings=timings,
    ))


def run_rl_step(
    cfg: RLRunConfig,
    storage: RunStorage,
    ledger: Ledger,
    step: int,
    workers: Sequence[str],
    tasks: Sequence[MathTask],
    *,
    engine_factory: EngineFactory | None = None,
    reward_fn: RewardFn = math_task_reward,
    extra_checks: Sequence[RowCheck] = (),
    trainer: GRPOTrainer | None = None,
) -> StepReport:
    """Run (or resume) RL step ``step``: see the module docstring.

    ``tasks`` is the prompt pool (unique ids); each worker sends submission 0. ``trainer``, when
    given, must hold checkpoint ``step``'s weights (e.g. the trainer of the previous call), which
    keeps its optimizer state; otherwise a fresh one is built from checkpoint ``step``.
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    policy = policy_for(step, cfg.async_level, recorded_steps(storage, ledger))
    if policy is None:
        raise FileNotFoundError(f"no checkpoint within {cfg.async_level} of step {step} in {storage.uri(CHECKPOINTS)}")
    next_uri = storage.uri(storage.step_path(step + 1, CHECKPOINTS))
    done = ledger.get_step(step)
    if done is not None:
        return StepReport(step, policy, list_submissions(storage, step), [], done["accepted"], done["rejected"],
                          done["trained_samples"] or 0, False, next_uri, False, done["loss"])

    policy_model, tokenizer = fetch_recorded(storage, ledger, policy)
    limits = cfg.limits or RolloutLimits(vocab_size=len(tokenizer))
    generated = []
    todo = [w for w in workers if not storage.exists(done_marker(step, w))]
    if todo:
        engine = (engine_factory or worker_engines(cfg))(policy_model, tokenizer)
        for w in todo:
            generated += worker_step(cfg, storage, step, w, tasks, engine, tokenizer, policy, limits=limits,
                                     reward_fn=reward_fn)[1]
    del policy_model
    timings["generate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    files = list_submissions(storage, step)
    engines = CheckpointEngines(storage, ledger)  # loaded once for every file
    for rel in files:
        # one transaction per file: a crash between files loses nothing recorded, and a rerun adds the rest
        ledger.record_verdicts(step, validate_files(cfg, storage, step, [rel], tasks, tokenizer, limits=limits,
                                                    reward_fn=reward_fn, extra_checks=extra_checks, engines=engines))
    timings["validate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    trained = not adopt_checkpoint(storage, ledger, step + 1)
    if trained:
        saved = train_and_publish(cfg, storage, ledger, step, policy,
                                  trainer or load_trainer(cfg, storage, ledger, step), limits)
    else:
        saved = saved_report(storage, ledger, step)
    timings["train"] = time.perf_counter() - t0

    committed = commit(storage, ledger, step, saved, timings)
    accepted, rejected = step_counts(ledger, step)
    return StepReport(step, policy, files, generated, accepted, rejected, saved["trained_samples"], trained,
                      next_uri, committed, saved["loss"], timings)
