"""One RL step, locally and synchronously: generate, validate, record, train, publish, commit.

:func:`run_rl_step` plays every role of an INTELLECT-2 step in one process (each worker, the
validator, the trainer) over real run storage and the ledger; the phases it calls are also the
bodies of the Prefect tasks of ``flows/rl.py``, where the workers are separate processes
(:mod:`intellect.rl.worker`). Each phase leaves durable state, and a rerun of a crashed step
resumes from it without double counting:

* a worker's submission file that exists is not regenerated (it may already be in the ledger,
  which keys verdicts by file and row), and a worker whose done marker exists is finished;
* every file is validated again and recorded; the ledger ignores rows it already holds;
* if checkpoint ``step + 1`` is already ``STABLE``, training is skipped and its saved report used;
* committing an already committed step is a no-op (and a committed step returns at once).

Training step ``n`` starts from checkpoint ``n``; generation uses the newest checkpoint the lag rule
allows (:func:`~intellect.rl.lag.policy_for`). Groups whose accepted rewards are all equal carry no
gradient and are dropped, and a worker keeps adding submissions until it holds enough samples with
signal (INTELLECT-2's online filter, :func:`worker_step`); a step left with no sample publishes the
unchanged weights, so the run keeps moving. Advantages and rewards come from the ledger (the
validator's), never from the workers' files.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from intellect.inference.torch_engine import TorchEngine
from intellect.ledger import StepMetrics
from intellect.pretrain import CHECKPOINTS, fetch_checkpoint
from intellect.rl.advantages import nonzero_signal
from intellect.rl.assignment import canonical_worker
from intellect.rl.lag import policy_for
from intellect.rl.rollouts import (
    KIND, RolloutLimits, list_submissions, load_submission, submission_path, write_submission,
)
from intellect.rl.submission import RewardFn, generate_submission, math_task_reward
from intellect.rl.trainer import GRPOTrainer, Sample, load_accepted
from intellect.rl.validator import RowCheck, validate_submission
from intellect.toploc.check import toploc_check

if TYPE_CHECKING:
    from intellect.data.loaders import MathTask
    from intellect.inference.protocol import InferenceEngine
    from intellect.ledger import Ledger, Verdict
    from intellect.rl.config import RLRunConfig
    from intellect.storage import RunStorage

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


class CheckpointEngines:
    """The validator's engines of recent checkpoints (hidden states captured), loaded on first use.

    Calling it with a policy step returns an engine holding that checkpoint (``FileNotFoundError``
    when it is not complete in storage); the ``keep`` most recently loaded stay in memory. Safe to
    use from several validation threads: each engine's prefills are serialized.
    """

    def __init__(self, storage: RunStorage, keep: int = 4):
        self.storage, self.keep = storage, keep
        self._engines: dict[int, _Serialized] = {}
        self._lock = threading.Lock()

    def __call__(self, policy: int) -> _Serialized:
        with self._lock:
            if policy not in self._engines:
                model, tok = fetch_checkpoint(self.storage, policy)  # FileNotFoundError if not STABLE
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


def checkpoint_sha256(storage: RunStorage, step: int) -> str:
    return hashlib.sha256(storage.read_bytes(f"{storage.step_path(step, CHECKPOINTS)}/model.safetensors")).hexdigest()


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
    *, limits: RolloutLimits, reward_fn: RewardFn = math_task_reward, extra_checks: Sequence[RowCheck] = (),
    engines: CheckpointEngines | None = None,
) -> list[Verdict]:
    """The validator's verdicts on every sample of ``files`` (never raises on their content). With
    ``cfg.toploc``, every row's proofs are checked too, by one prefill with the checkpoint it claims
    (``engines``, by default loaded from ``storage``)."""
    if cfg.toploc is not None:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        extra_checks = [*extra_checks, toploc_check(engines or CheckpointEngines(storage), cfg.submission.sampling(),
                                                    cfg.toploc, eos)]
    return [v for rel in files for v in validate_submission(
        storage, rel, tasks=tasks, tokenizer=tokenizer, step=step, async_level=cfg.async_level,
        limits=limits, cfg=cfg.submission, run=cfg.run_name, reward_fn=reward_fn, extra_checks=extra_checks,
    )]


def load_trainer(cfg: RLRunConfig, storage: RunStorage, step: int) -> GRPOTrainer:
    """A trainer holding checkpoint ``step`` and, when saved with it, the optimizer state."""
    model, tok = fetch_checkpoint(storage, step)
    trainer = GRPOTrainer(model, tok, cfg.trainer)
    rel = f"{storage.step_path(step, CHECKPOINTS)}/{OPTIMIZER}"
    if storage.exists(rel):
        trainer.load_state_dict(torch.load(io.BytesIO(storage.read_bytes(rel)), weights_only=True))
    return trainer


def train_and_publish(
    cfg: RLRunConfig, storage: RunStorage, ledger: Ledger, step: int, policy: int, trainer: GRPOTrainer,
    limits: RolloutLimits,
) -> dict:
    """Train ``trainer`` (holding checkpoint ``step``) on the step's accepted samples with signal and
    publish checkpoint ``step + 1`` with its report and optimizer state; the report is returned.
    A step without such samples publishes the unchanged weights, so the run keeps moving."""
    rows = _signal_rows(ledger.accepted(step))
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
    trainer.publish(storage, step + 1, {STEP_REPORT: saved, OPTIMIZER: buf.getvalue()})
    return saved


def saved_report(storage: RunStorage, step: int) -> dict:
    """The report published with checkpoint ``step + 1`` by :func:`train_and_publish`."""
    return json.loads(storage.read_text(f"{storage.step_path(step + 1, CHECKPOINTS)}/{STEP_REPORT}"))


def commit(storage: RunStorage, ledger: Ledger, step: int, saved: dict, timings: dict[str, float]) -> bool:
    """Record checkpoint ``step + 1`` (unless the broadcast did) and commit the step (idempotent: False
    when already committed)."""
    if ledger.checkpoint(step + 1) is None:
        ledger.record_checkpoint(step + 1, storage.uri(storage.step_path(step + 1, CHECKPOINTS)),
                                 checkpoint_sha256(storage, step + 1))
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
    policy = policy_for(step, cfg.async_level, storage.complete_steps(CHECKPOINTS))
    if policy is None:
        raise FileNotFoundError(f"no checkpoint within {cfg.async_level} of step {step} in {storage.uri(CHECKPOINTS)}")
    next_uri = storage.uri(storage.step_path(step + 1, CHECKPOINTS))
    done = ledger.get_step(step)
    if done is not None:
        return StepReport(step, policy, list_submissions(storage, step), [], done["accepted"], done["rejected"],
                          done["trained_samples"] or 0, False, next_uri, False, done["loss"])

    policy_model, tokenizer = fetch_checkpoint(storage, policy)
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
    engines = CheckpointEngines(storage) if cfg.toploc is not None else None  # loaded once for every file
    for rel in files:
        # one transaction per file: a crash between files loses nothing recorded, and a rerun adds the rest
        ledger.record_verdicts(step, validate_files(cfg, storage, step, [rel], tasks, tokenizer, limits=limits,
                                                    reward_fn=reward_fn, extra_checks=extra_checks, engines=engines))
    timings["validate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    trained = not storage.is_stable(step + 1, CHECKPOINTS)
    if trained:
        saved = train_and_publish(cfg, storage, ledger, step, policy, trainer or load_trainer(cfg, storage, step),
                                  limits)
    else:
        saved = saved_report(storage, step)
    timings["train"] = time.perf_counter() - t0

    committed = commit(storage, ledger, step, saved, timings)
    accepted, rejected = step_counts(ledger, step)
    return StepReport(step, policy, files, generated, accepted, rejected, saved["trained_samples"], trained,
                      next_uri, committed, saved["loss"], timings)
