"""One RL step, locally and synchronously: generate, validate, record, train, publish, commit.

:func:`run_rl_step` plays every role of an INTELLECT-2 step in one process (each worker, the
validator, the trainer) over real run storage and the ledger. Each phase leaves durable state, and
a rerun of a crashed step resumes from it without double counting:

* a worker's submission file that exists is not regenerated (it may already be in the ledger,
  which keys verdicts by file and row);
* every file is validated again and recorded; the ledger ignores rows it already holds;
* if checkpoint ``step + 1`` is already ``STABLE``, training is skipped and its saved report used;
* committing an already committed step is a no-op (and a committed step returns at once).

Training step ``n`` starts from checkpoint ``n``; generation uses the newest checkpoint the lag rule
allows (:func:`~intellect.rl.lag.policy_for`). Groups whose accepted rewards are all equal carry no
gradient and are dropped (INTELLECT-2's online filter); a step left with no sample publishes the
unchanged weights, so the run keeps moving. Advantages and rewards come from the ledger (the
validator's), never from the workers' files.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from pydantic import Field

from intellect.config import StrictModel
from intellect.inference.torch_engine import TorchEngine
from intellect.ledger import StepMetrics
from intellect.pretrain import CHECKPOINTS, fetch_checkpoint
from intellect.rl.advantages import nonzero_signal
from intellect.rl.lag import DEFAULT_ASYNC_LEVEL, policy_for
from intellect.rl.rollouts import RolloutLimits, list_submissions, submission_path, write_submission
from intellect.rl.submission import RewardFn, SubmissionConfig, generate_submission, math_task_reward
from intellect.rl.trainer import GRPOTrainer, RLTrainerConfig, Sample, load_accepted
from intellect.rl.validator import RowCheck, validate_submission

if TYPE_CHECKING:
    from intellect.data.loaders import MathTask
    from intellect.inference.protocol import InferenceEngine
    from intellect.ledger import Ledger
    from intellect.storage import RunStorage

STEP_REPORT = "rl_step.json"  # saved with each checkpoint, so a rerun that skips training can still commit

EngineFactory = Callable[[torch.nn.Module, Any], "InferenceEngine"]


def torch_engine(model: torch.nn.Module, tokenizer) -> InferenceEngine:
    # no TOPLOC proofs yet, so the hidden states would be thrown away
    return TorchEngine.for_tokenizer(model, tokenizer, capture_hidden=False)


class RLRunConfig(StrictModel):
    """A local RL run: who samples what, how the trainer steps, what the validator allows."""

    run: str = Field("rl", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Run name written into every rollout.")
    async_level: int = Field(DEFAULT_ASYNC_LEVEL, ge=0, le=1024, description="Most policy lag of a sample.")
    submission: SubmissionConfig = Field(default_factory=SubmissionConfig)
    trainer: RLTrainerConfig = Field(default_factory=RLTrainerConfig)
    limits: RolloutLimits | None = Field(None, description="Validator bounds; None: defaults, vocab from the model.")


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


def _checkpoint_sha256(storage: RunStorage, step: int) -> str:
    return hashlib.sha256(storage.read_bytes(f"{storage.step_path(step, CHECKPOINTS)}/model.safetensors")).hexdigest()


def _signal_rows(rows: list[dict]) -> list[dict]:
    """The accepted ledger rows of groups whose rewards are not all equal."""
    if not rows:
        return []
    keys = {}
    ids = torch.tensor([keys.setdefault((r["file"], r["group_id"]), len(keys)) for r in rows])
    keep = nonzero_signal(torch.tensor([r["reward"] for r in rows], dtype=torch.float64), ids)
    return [r for r, k in zip(rows, keep.tolist()) if k]


def _counts(ledger: Ledger, step: int) -> tuple[int, int]:
    n = {"accepted": 0, "rejected": 0}
    for row in ledger.summary():
        if row["step"] == step:
            n[row["status"]] += row["n"]
    return n["accepted"], n["rejected"]


def run_rl_step(
    cfg: RLRunConfig,
    storage: RunStorage,
    ledger: Ledger,
    step: int,
    workers: Sequence[str],
    tasks: Sequence[MathTask],
    *,
    engine_factory: EngineFactory = torch_engine,
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
    todo = [w for w in workers if not storage.exists(submission_path(step, w, 0))]
    if todo:
        engine = engine_factory(policy_model, tokenizer)
        for w in todo:
            rows = generate_submission(engine, tokenizer, tasks, w, step, 0, policy, cfg.submission,
                                       run=cfg.run, reward_fn=reward_fn)
            generated.append(write_submission(storage, step, w, 0, rows, limits=limits))
    del policy_model
    timings["generate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    files = list_submissions(storage, step)
    for rel in files:
        # one transaction per file: a crash between files loses nothing recorded, and a rerun adds the rest
        ledger.record_verdicts(step, validate_submission(
            storage, rel, tasks=tasks, tokenizer=tokenizer, step=step, async_level=cfg.async_level,
            limits=limits, cfg=cfg.submission, run=cfg.run, reward_fn=reward_fn, extra_checks=extra_checks,
        ))
    timings["validate"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    trained = not storage.is_stable(step + 1, CHECKPOINTS)
    if trained:
        rows = _signal_rows(ledger.accepted(step))
        rollouts = load_accepted(storage, rows, limits)
        samples = [Sample(r.prompt_tokens, r.output_tokens, float(row["advantage"])) for r, row in zip(rollouts, rows)]
        if trainer is None:
            model, tok = fetch_checkpoint(storage, step)
            trainer = GRPOTrainer(model, tok, cfg.trainer)
        stats = trainer.train_step(samples) if samples else None
        saved = {"policy_step": policy, "trained_samples": len(samples),
                 "loss": None if stats is None else stats.loss,
                 "clip_fraction": None if stats is None else stats.clip_fraction}
        trainer.publish(storage, step + 1, {STEP_REPORT: saved})
    else:
        saved = json.loads(storage.read_text(f"{storage.step_path(step + 1, CHECKPOINTS)}/{STEP_REPORT}"))
    timings["train"] = time.perf_counter() - t0

    ledger.record_checkpoint(step + 1, next_uri, _checkpoint_sha256(storage, step + 1))
    committed = ledger.commit_step(step, StepMetrics(
        loss=saved["loss"], clip_fraction=saved["clip_fraction"], trained_samples=saved["trained_samples"],
        timings=timings,
    ))
    accepted, rejected = _counts(ledger, step)
    return StepReport(step, policy, files, generated, accepted, rejected, saved["trained_samples"], trained,
                      next_uri, committed, saved["loss"], timings)
