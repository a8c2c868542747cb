"""The phases of one RL step, shared by every way of running it: generate, validate, train, publish,
commit.

:class:`~intellect.rl.trainer.run.RLRun` composes them (its methods are the Prefect tasks of ``flows/rl.py``
and ``flows/rl_stages.py``, and :func:`~intellect.rl.trainer.run.run_rl_step` runs them in order in one
process). Each phase leaves durable state, and a rerun of a crashed step resumes from it without
double counting:

* a worker's submission file that exists is not regenerated (it may already be in the ledger,
  which keys verdicts by file and row), and a worker whose done marker exists is finished (done
  markers are written by in-process generation only: operator-owned machines with run storage);
* every file is validated again and recorded; the ledger ignores rows it already holds;
* checkpoint ``step + 1`` found ``STABLE`` is adopted only when the ledger holds its digest, which
  the trainer records right after publishing it (:func:`~intellect.checkpoints.adopt`); any other
  one (a crash between publish and record, or a folder the trainer did not write) is deleted and
  retrained;
* committing an already committed step is a no-op.

Every checkpoint read here is verified against the digest the ledger recorded for its step
(:func:`~intellect.checkpoints.digest`; checkpoint 0 is recorded when it is seeded), and only
recorded checkpoints count as available (:func:`~intellect.checkpoints.recorded_steps`).

Training step ``n`` starts from checkpoint ``n``; generation uses the newest checkpoint the lag rule
allows (:func:`~intellect.rl.wire.lag.policy_for`). Groups whose accepted rewards are all equal carry no
gradient and are dropped; with the online filter on, the step asks for more submissions until it holds
enough validated samples with signal (:mod:`~intellect.rl.trainer.online_filter`, :func:`add_submission`
for workers generating here); a step left with no sample publishes the unchanged weights, so the run keeps moving. Advantages and rewards come from the ledger (the
validator's), never from the workers' files, and the samples are trained in a canonical order (by
content hash), so the order in which submissions arrived cannot change the update.
"""

from __future__ import annotations

import functools
import io
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from intellect.checkpoints import (
    OPTIMIZER, STEP_REPORT, SavedStepReport, adopt, load_step_report, record, recorded_copy, recorded_digest,
)
from intellect.config import ComputeConfig
from intellect.inference.engines import make_engine
from intellect.inference.protocol import stop_ids
from intellect.ledger import StepMetrics
from intellect.model.checkpoint import load_checkpoint_copy
from intellect.rl.advantages import nonzero_signal
from intellect.rl.wire.assignment import NO_SALT
from intellect.ids import canonical_worker
from intellect.rl.wire.rollouts import (
    KIND, RolloutLimits, parse_submission_path, submission_path, write_submission,
)
from intellect.rl.worker.submission import RewardFn, generate_submission, math_task_reward
from intellect.rl.trainer.grpo import GRPOTrainer, Sample, load_accepted
from intellect.rl.trainer.ranks import ShardedTrainer, TrainerSpec, reference_model
from intellect.rl.trainer.state import drop_state, has_state, load_state, save_state
from intellect.rl.service.validator import RowCheck, validate_submission
from intellect.storage import step_name
from intellect.toploc.check import toploc_check

if TYPE_CHECKING:
    from intellect.data.loaders import Task
    from intellect.inference.torch_engine import TorchEngine
    from intellect.inference.protocol import InferenceEngine
    from intellect.ledger import Ledger
    from intellect.rl.config import RLRunConfig
    from intellect.storage import RunStorage
    from intellect.verdict import Verdict

#: the engine of a verified checkpoint folder that a worker generates with
EngineFactory = Callable[[Path], "InferenceEngine"]


def worker_engines(cfg: RLRunConfig) -> EngineFactory:
    """The worker engine ``cfg`` needs: of ``cfg.workers.engine.kind``, on ``cfg.compute``, batching as
    ``cfg.workers.engine``, with hidden-state capture when ``cfg.toploc`` is set."""
    return functools.partial(make_engine, cfg.workers.engine.kind, compute=cfg.compute, cfg=cfg.workers.engine,
                             capture_hidden=cfg.toploc is not None)


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

    Calling it with a policy step returns an engine holding that checkpoint, verified against the
    ledger's digest (``FileNotFoundError`` when it is not complete in storage or not recorded, which
    the TOPLOC check reports as an unknown checkpoint); the ``keep`` most recently loaded stay in
    memory. Each engine prefills on ``compute``'s device and in its precision, as the workers' engines
    generate (None: as loaded, on the CPU in float32). Safe to use from several validation threads: each
    engine's prefills are serialized.
    """

    def __init__(self, storage: RunStorage, ledger: Ledger, keep: int = 4, compute: ComputeConfig | None = None):
        self.storage, self.ledger, self.keep, self.compute = storage, ledger, keep, compute
        self._engines: dict[int, _Serialized] = {}
        self._lock = threading.Lock()

    def __call__(self, policy: int) -> _Serialized:
        with self._lock:
            if policy not in self._engines:
                with recorded_copy(self.storage, self.ledger, policy) as folder:
                    # torch whatever the workers run: the checks are defined by the project's own forward
                    engine = make_engine("torch", folder, self.compute, capture_hidden=True)
                self._engines[policy] = _Serialized(engine)
                for old in sorted(self._engines)[:-self.keep]:
                    del self._engines[old]
            return self._engines[policy]


def signal_rows(rows: list[dict]) -> list[dict]:
    """The accepted ledger rows of groups whose rewards are not all equal: what a step trains on, and
    what the online filter counts (:mod:`~intellect.rl.trainer.online_filter`)."""
    if not rows:
        return []
    keys = {}
    ids = torch.tensor([keys.setdefault((r["file"], r["group_id"]), len(keys)) for r in rows])
    keep = nonzero_signal(torch.tensor([r["reward"] for r in rows], dtype=torch.float64), ids)
    return [r for r, k in zip(rows, keep.tolist()) if k]


def done_marker(step: int, worker: str) -> str:
    """Where a worker says it has written all its submissions of ``step`` (a :class:`DoneMarker`)."""
    return f"{KIND}/{step_name(step)}/{canonical_worker(worker)}.done"


class DoneMarker(BaseModel):
    """What a worker generating in an operator's process says it submitted for a step: written by
    :func:`worker_step`, read by :func:`read_done_marker`, nowhere else."""

    model_config = ConfigDict(extra="forbid")

    files: list[str] = Field(max_length=10_000, description="Its submission files of the step.")
    policy_step: int = Field(ge=0, description="The checkpoint it generated them with.")


def read_done_marker(storage: RunStorage, step: int, worker: str) -> DoneMarker | None:
    """``worker``'s done marker of ``step``; None when it has not written one."""
    rel = done_marker(step, worker)
    if not storage.exists(rel):
        return None
    return DoneMarker.model_validate_json(storage.read_text(rel))


def worker_step(
    cfg: RLRunConfig,
    storage: RunStorage,
    step: int,
    worker: str,
    tasks: Sequence[Task],
    engine: InferenceEngine,
    tokenizer,
    policy: int,
    *,
    limits: RolloutLimits,
    reward_fn: RewardFn = math_task_reward,
) -> tuple[list[str], list[str]]:
    """One worker's part of ``step``: its submission 0 (kept when it exists, not regenerated), then
    the done marker. Returns (all its files of the step, the files this call wrote)."""
    rel = submission_path(step, worker, 0)
    written = []
    if not storage.exists(rel):
        rows = generate_submission(engine, tokenizer, tasks, worker, step, 0, policy, cfg.submission,
                                   run=cfg.run_name, reward_fn=reward_fn, proofs=cfg.toploc)
        write_submission(storage, step, worker, 0, rows, limits=limits)
        written.append(rel)
    storage.write_text(done_marker(step, worker), DoneMarker(files=[rel], policy_step=policy).model_dump_json())
    return [rel], written


def add_submission(
    cfg: RLRunConfig, storage: RunStorage, step: int, worker: str, tasks: Sequence[Task], engine: InferenceEngine,
    tokenizer, policy: int, *, limits: RolloutLimits, reward_fn: RewardFn = math_task_reward,
) -> str | None:
    """A worker generating here answers a round of the online filter: its next submission of ``step``
    (the first index not in storage), None when it holds ``workers.max_submissions`` already."""
    k = next(k for k in range(cfg.workers.max_submissions + 1) if not storage.exists(submission_path(step, worker, k)))
    if k >= cfg.workers.max_submissions:
        return None
    rows = generate_submission(engine, tokenizer, tasks, worker, step, k, policy, cfg.submission,
                               run=cfg.run_name, reward_fn=reward_fn, proofs=cfg.toploc)
    write_submission(storage, step, worker, k, rows, limits=limits)
    return submission_path(step, worker, k)


def validate_files(
    cfg: RLRunConfig, storage: RunStorage, step: int, files: Sequence[str], tasks: Sequence[Task], tokenizer,
    *, limits: RolloutLimits, engines: CheckpointEngines, reward_fn: RewardFn = math_task_reward,
    extra_checks: Sequence[RowCheck] = (), recorded: Mapping[str, Any] | None = None,
    salts: Mapping[str, bytes] | None = None, eos_ids: Sequence[int] | None = None,
) -> list[Verdict]:
    """The validator's verdicts on every sample of ``files`` (never raises on their content). With
    ``cfg.toploc``, every row's proofs are checked too, by one prefill with the checkpoint it claims
    (``engines``). ``recorded`` maps a file to what the submission service recorded of it (its
    ``worker``, ``sha256`` and ``size``): the file must be that worker's, of that size, and hash as
    recorded. ``salts`` maps each worker the service admitted to the salt its registry holds; a
    worker not in it is an operator-run one (:data:`~intellect.rl.wire.assignment.NO_SALT`). ``eos_ids``:
    what the run's engines stop at (None: the tokenizer's EOS alone)."""
    eos = list(eos_ids) if eos_ids is not None else stop_ids(tokenizer.eos_token_id, None)
    if cfg.toploc is not None:
        # the check only prefills, which is all a serialized engine offers
        check = toploc_check(engines, cfg.submission.sampling(), cfg.toploc, eos)
        extra_checks = [*extra_checks, check]
    out = []
    for rel in files:
        rec = (recorded or {}).get(rel)
        salt = (salts or {}).get(parse_submission_path(rel)[1], NO_SALT)
        out += validate_submission(
            storage, rel, tasks=tasks, tokenizer=tokenizer, step=step, async_level=cfg.async_level,
            policy_lag=cfg.policy_lag, limits=limits, cfg=cfg.submission, run=cfg.run_name, reward_fn=reward_fn, extra_checks=extra_checks,
            worker=None if rec is None else rec.worker, sha256=None if rec is None else rec.sha256,
            size=None if rec is None else rec.size, salt=salt, eos_ids=eos,
        )
    return out


def load_trainer(cfg: RLRunConfig, storage: RunStorage, ledger: Ledger, step: int) -> GRPOTrainer | ShardedTrainer:
    """A trainer holding checkpoint ``step`` and, when saved with it, the optimizer state, both read
    from one copy verified against the ledger's digest, on ``cfg.compute``'s device and precision.
    The optimizer state is the checkpoint's sidecar (a trainer of one process) or the trainer's
    sharded state of the step (:mod:`~intellect.rl.trainer.state`, saved by any number of ranks, and by
    one with ``trainer.inference_dtype = "bf16"``: its fp32 master weights replace the checkpoint's).
    ``trainer.ranks > 1``: the trainer's processes, this one its rank 0 (:class:`ShardedTrainer`),
    which reads either too. With ``loss.kl_coef > 0`` the trainer holds :func:`reference_model` too."""
    if cfg.trainer.ranks > 1:
        return ShardedTrainer.start(TrainerSpec(
            run_name=cfg.run_name, storage=cfg.storage, trainer=cfg.trainer, compute=cfg.compute, checkpoint=step,
            sha256=recorded_digest(ledger, step), threads=cfg.trainer_threads,
            reference_sha256=recorded_digest(ledger, 0) if cfg.trainer.loss.kl_coef > 0 else None))
    ref = reference_model(storage, recorded_digest(ledger, 0)) if cfg.trainer.loss.kl_coef > 0 else None
    with recorded_copy(storage, ledger, step) as folder:
        model, tok = load_checkpoint_copy(folder)
        trainer = GRPOTrainer(model, tok, cfg.trainer, ref_model=ref, compute=cfg.compute)
        if (folder / OPTIMIZER).exists():
            # saved on the CPU; AdamW moves each state tensor to its parameter's device and dtype
            trainer.load_state_dict(torch.load(folder / OPTIMIZER, weights_only=True, map_location="cpu"))
        elif has_state(storage, step):
            load_state(storage, step, trainer)
    return trainer


def train_and_publish(
    storage: RunStorage, ledger: Ledger, step: int, policy: int, trainer: GRPOTrainer | ShardedTrainer,
    limits: RolloutLimits,
) -> SavedStepReport:
    """Train ``trainer`` (holding checkpoint ``step``) on the step's accepted samples with signal and
    publish checkpoint ``step + 1`` with its report and optimizer state; the report is returned.
    A step without such samples publishes the unchanged weights, so the run keeps moving."""
    rows = sorted(signal_rows(ledger.accepted(step)), key=lambda r: (r["content_hash"], r["file"], r["row_index"]))
    rollouts = load_accepted(storage, rows, limits)
    samples = [Sample(r.prompt_tokens, r.output_tokens, float(row["advantage"])) for r, row in zip(rollouts, rows)]
    stats = trainer.train_step(samples) if samples else None
    saved = SavedStepReport(policy_step=policy, trained_samples=len(samples)) if stats is None else SavedStepReport(
        policy_step=policy, trained_samples=len(samples), loss=stats.loss, clip_fraction=stats.clip_fraction,
        ratio_max=stats.ratio_max, grad_norm=stats.grad_norm, kl=stats.kl, tokens=stats.tokens,
        train_seconds=stats.seconds)
    sharded = isinstance(trainer, ShardedTrainer)
    if sharded or trainer.cfg.inference_dtype != "fp32":
        # the master weights and AdamW state as shards (every rank its own), before the checkpoint is
        # recorded; one of an unrecorded attempt is replaced. A bf16 checkpoint cannot hold fp32 masters.
        drop_state(storage, step + 1)
        if sharded:
            trainer.save_state(step + 1)
        else:
            save_state(storage, step + 1, trainer)
        extra: dict = {STEP_REPORT: saved}
    else:
        buf = io.BytesIO()
        torch.save(trainer.state_dict(), buf)
        extra = {STEP_REPORT: saved, OPTIMIZER: buf.getvalue()}
    for attempt in range(3):
        try:
            trainer.publish(storage, step + 1, extra)
            break
        except FileExistsError:  # a folder the trainer did not write appeared since adopt cleared it
            if attempt == 2 or adopt(storage, ledger, step + 1):
                raise
    # recorded right after publishing: a crash in between leaves a folder that adopt deletes
    record(storage, ledger, step + 1)
    return saved


def saved_report(storage: RunStorage, ledger: Ledger, step: int) -> SavedStepReport:
    """The report published with checkpoint ``step + 1`` by :func:`train_and_publish`, read from a copy
    verified against the ledger's digest."""
    with recorded_copy(storage, ledger, step + 1) as folder:
        return load_step_report(folder)


def commit(ledger: Ledger, step: int, saved: SavedStepReport, timings: dict[str, float]) -> bool:
    """Commit the step, whose checkpoint ``step + 1`` must be recorded (idempotent: False when already
    committed)."""
    recorded_digest(ledger, step + 1)
    return ledger.commit_step(step, StepMetrics(
        loss=saved.loss, clip_fraction=saved.clip_fraction, trained_samples=saved.trained_samples,
        timings=timings,
    ))
