"""One RL step in this process, every role played here, without Prefect: for tests and benchmarks.

:func:`run_rl_step` runs the phases of :class:`~intellect.rl.trainer.run.RLRun` in the order ``rl-step``
does; a committed step returns at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from intellect.checkpoints import CHECKPOINTS, recorded_steps
from intellect.progress import Progress
from intellect.rl.wire.lag import policy_for
from intellect.rl.wire.rollouts import list_submissions
from intellect.rl.trainer.run import RLRun
from intellect.rl.worker.submission import RewardFn
from intellect.trust.mac import new_secret

if TYPE_CHECKING:
    from intellect.data.loaders import Task
    from intellect.ledger import Ledger
    from intellect.rl.config import RLRunConfig
    from intellect.rl.trainer.step import EngineFactory
    from intellect.rl.trainer.grpo import GRPOTrainer
    from intellect.rl.trainer.online_filter import FillReport
    from intellect.rl.service.validator import RowCheck
    from intellect.storage import RunStorage


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
    filter: FillReport | None = None  # the online filter's account of the step (None: not trained here)


def step_counts(ledger: Ledger, step: int) -> tuple[int, int]:
    """(accepted, rejected) samples of ``step`` in the ledger."""
    n = {"accepted": 0, "rejected": 0}
    for row in ledger.step_verdicts(step):
        n[row["status"]] += row["n"]
    return n["accepted"], n["rejected"]


def run_rl_step(
    cfg: RLRunConfig, storage: RunStorage, ledger: Ledger, step: int, workers: Sequence[str],
    tasks: Sequence[Task], *, engine_factory: EngineFactory | None = None, reward_fn: RewardFn | None = None,
    extra_checks: Sequence[RowCheck] = (), trainer: GRPOTrainer | None = None,
) -> StepReport:
    """Run (or resume) RL step ``step`` in this process, every role played here (each of ``workers``,
    the validator, the trainer): the phases of ``rl-step`` (:meth:`RLRun.generate`, ``validate``,
    ``record``, ``update``, ``commit``) over ``storage`` and ``ledger``, without Prefect. A committed
    step returns at once.

    ``tasks`` is the prompt pool (unique ids). ``trainer``, when given, must hold checkpoint ``step``'s
    weights (e.g. the trainer of the previous call), which keeps its optimizer state; otherwise one is
    built from checkpoint ``step``.
    """
    policy = policy_for(step, cfg.async_level, recorded_steps(storage, ledger), cfg.policy_lag)
    if policy is None:
        raise FileNotFoundError(f"no checkpoint within {cfg.async_level} of step {step} in {storage.uri(CHECKPOINTS)}")
    next_uri = storage.uri(storage.step_path(step + 1, CHECKPOINTS))
    if (done := ledger.get_step(step)) is not None:
        return StepReport(step, policy, list_submissions(storage, step), [], done["accepted"], done["rejected"],
                          done["trained_samples"] or 0, False, next_uri, False, done["loss"])
    # the verdicts go from validate to record inside this call: a secret of its own MACs them
    # silent unless a phase outlasts a progress interval (a benchmark's long step)
    bar = Progress(f"RL step {step}", unit="", interval=cfg.logging.progress_seconds, heartbeat=True)
    bar.begin(quiet=True)
    with bar, RLRun(cfg, storage=storage, ledger=ledger, tasks=tasks, reward_fn=reward_fn, extra_checks=extra_checks,
                    engine_factory=engine_factory, secret=new_secret()) as run:
        if trainer is not None:
            run.trainer, run.trainer_step = trainer, step
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        bar.waiting(f"generating as {', '.join(workers)}")
        generated = run.generate(step, workers)
        timings["generate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        bar.waiting("validating")
        reports = run.validate(step, run.step_files(step))
        run.record(step, [(r.verdicts, r.mac) for r in reports])
        timings["validate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        bar.waiting("training")
        upd = run.update(step, policy)
        timings["train"] = time.perf_counter() - t0
        committed = run.commit(step, timings)
    accepted, rejected = step_counts(ledger, step)
    return StepReport(step, policy, list_submissions(storage, step), generated, accepted, rejected,
                      upd.trained_samples, upd.trained, next_uri, committed, upd.loss, timings, upd.filter)
