"""The validator: turn one untrusted submission file into one verdict per sample, never raising on it.

Checks, in order (the first failing one is the recorded reason):

1. **The file** (:func:`~intellect.rl.wire.rollouts.load_submission`): with a service record, a file
   whose worker is not the key id the service recorded for it (``identity``) or whose bytes do not
   hash as recorded; unreadable, too large, wrong schema
   or version, NaN, out-of-range values, an identity or step that disagrees with its path, or a
   policy step outside the lag bound (``stale``): one file-level verdict (``row = -1``) with the
   :class:`~intellect.rl.wire.rollout_schema.RolloutRejected` reason.
2. **The assignment** (:func:`~intellect.rl.wire.assignment.check_assignment`, with group sizes,
   prompt tokens and the worker's salt): every row of a file that answers other prompts than its
   assigned ones is rejected as ``assignment``.
3. **The seed** (:func:`assigned_seeds`, always on): a row whose seed is not the one its position
   is assigned (:func:`~intellect.rl.worker.submission.sample_seed` of worker, step, submission, group,
   index and salt) is ``seed``. The validator computes the seed itself and hands the extra checks
   the rows with that seed in place of the row's, so TOPLOC's seeded re-check replays the assigned
   sampler: a worker can neither keep the best of many draws nor search a seed that "picks" tokens
   it wrote. A copy of another worker's rows carries that worker's seeds, so it is ``seed`` too.
4. **The length** (:func:`length_check`): a completion longer than the submission's ``max_tokens``
   is ``too_long``; one whose ``finish_reason`` does not match its tokens (``stop`` without a final
   EOS, ``length`` short of ``max_tokens`` or ending in EOS, an EOS before the last token) is
   ``finish_reason``.
5. **Extra checks** (``extra_checks``: e.g. TOPLOC proofs): each returns one reason or ``None`` per
   row, given the rows with their assigned seeds.
6. **The reward**: the validator decodes each output and recomputes its reward with the run's
   :data:`~intellect.rl.worker.submission.RewardFn`. An operator-run worker (no salt) holds the tasks and
   claims its rewards, and a row whose claimed ``task_reward`` or ``reward`` differs is rejected
   as ``reward_mismatch``; a worker of the service is told no reference answer, so it claims 0
   (:func:`~intellect.rl.worker.submission.unclaimed_reward`) and any other claim is ``reward_mismatch``.
   A claimed length penalty (no length shaping here yet) is ``reward_mismatch`` too.

Advantages are never taken from the worker: each group's are recomputed from the validator's
rewards of the rows that passed the extra checks (the samples it believes the policy drew;
rows with a lying reward claim still count at their true reward), and an accepted verdict carries
the validator's reward and advantage. The trainer must take both from the ledger, not the file.

Duplicates are the ledger's job: :meth:`~intellect.ledger.Ledger.record_verdicts` turns an accepted
verdict whose content hash is already recorded elsewhere into ``rejected`` / ``duplicate``, in the
same transaction that records it, so no check-then-write race exists and it is not repeated here.
The verdicts are returned, not recorded: the caller records them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Callable, Sequence

from intellect.inference.protocol import stop_ids
from intellect.rl.wire.assignment import NO_SALT, check_assignment
from intellect.rl.wire.lag import PolicyLag
from intellect.rl.wire.rollouts import Rollout, RolloutLimits, RolloutRejected, load_submission, parse_submission_path
from intellect.rl.worker.submission import (
    RewardFn,
    SubmissionConfig,
    advantages_of,
    completion_text,
    math_task_reward,
    task_rewards,
    prompt_tokens,
    sample_seed,
)
from intellect.trust.keys import is_key_id
from intellect.verdict import Verdict

if TYPE_CHECKING:
    from intellect.data.loaders import Task
    from intellect.storage import RunStorage

log = logging.getLogger("intellect.rl.service.validator")

#: ``check(rows) -> reasons``: one ledger reason (or ``None`` to pass) per row of one submission.
RowCheck = Callable[[Sequence[Rollout]], Sequence["str | None"]]

ASSIGNMENT = "assignment"
REWARD_MISMATCH = "reward_mismatch"
SEED = "seed"
TOO_LONG = "too_long"
IDENTITY = "identity"
FINISH_REASON = "finish_reason"


def length_check(max_tokens: int, eos_ids: Sequence[int]) -> RowCheck:
    """``too_long`` / ``finish_reason`` per row, as the sampler bounds a completion (module docstring).

    >>> from intellect.rl.wire.rollouts import Rollout
    >>> row = lambda out, why: Rollout("r", 0, 0, "w", 0, 1, "p", 0, (1,), out, why, 0.0, 0.0, 0.0, 0.0)
    >>> length_check(3, [2])([row((5, 2), "stop"), row((5, 6, 7), "length"), row((5, 6, 7, 8), "length"),
    ...                       row((5, 6), "length"), row((2, 6, 2), "stop"), row((5, 6, 2), "length")])
    [None, None, 'too_long', 'finish_reason', 'finish_reason', 'finish_reason']
    """
    eos = frozenset(eos_ids)

    def check(rows: Sequence[Rollout]) -> list[str | None]:
        out: list[str | None] = []
        for r in rows:
            toks = r.output_tokens
            ends_eos = bool(toks) and toks[-1] in eos
            if len(toks) > max_tokens:
                out.append(TOO_LONG)
            elif any(t in eos for t in toks[:-1]) or (
                    not ends_eos if r.finish_reason == "stop" else ends_eos or len(toks) != max_tokens):
                out.append(FINISH_REASON)
            else:
                out.append(None)
        return out

    return check


def assigned_seeds(rows: Sequence[Rollout], salt: bytes = NO_SALT) -> list[int]:
    """The seed each row of one submission is assigned: :func:`sample_seed` of its worker, step,
    submission, group and index in its group (file order), with the worker's ``salt``."""
    seen: dict[int, int] = {}
    out = []
    for r in rows:
        i = seen[r.group_id] = seen.get(r.group_id, -1) + 1
        out.append(sample_seed(r.worker, r.step, r.submission, r.group_id, i, salt))
    return out


def _same(claimed: float, truth: float) -> bool:
    # the column is float32: a claim equal to the truth may differ from it by float32 rounding
    return math.isclose(claimed, truth, rel_tol=1e-6, abs_tol=1e-6)


def validate_submission(
    storage: RunStorage,
    rel_path: str,
    *,
    tasks: Sequence[Task],
    tokenizer,
    step: int,
    async_level: int,
    limits: RolloutLimits,
    policy_lag: PolicyLag = "newest",
    cfg: SubmissionConfig,
    run: str | None = None,
    reward_fn: RewardFn = math_task_reward,
    extra_checks: Sequence[RowCheck] = (),
    worker: str | None = None,
    sha256: str | None = None,
    size: int | None = None,
    salt: bytes = NO_SALT,
    eos_ids: Sequence[int] | None = None,
) -> list[Verdict]:
    """Verdicts on every sample of the submission at ``rel_path`` of ``step`` (see the module docstring).

    ``rel_path`` is the caller's (from the submission service's records, or
    :func:`~intellect.rl.wire.rollouts.list_submissions` for operator-owned generation): one that is not a
    submission path of ``step`` is a ``ValueError``. ``worker``, ``sha256`` and ``size``, when given,
    are what the service recorded for the file, and ``salt`` the worker's salt in the service's
    registry (:data:`~intellect.rl.wire.assignment.NO_SALT` for an operator-run worker). ``eos_ids``: what
    the checkpoint's engines stop at (:func:`~intellect.inference.engines.folder_stop_ids`; None: the
    tokenizer's EOS alone). Nothing in the file's content raises.
    """
    file_step, file_worker, k = parse_submission_path(rel_path)
    if file_step != step:
        raise ValueError(f"{rel_path} is not a submission of step {step}")
    if worker is not None and not (is_key_id(worker) and worker == file_worker):
        log.info("rejected %s: the service recorded it for %r", rel_path, worker)
        return [Verdict.file_rejected(rel_path, step, file_worker, k, IDENTITY)]
    worker = file_worker
    try:
        rows = load_submission(storage, rel_path, limits, run=run, async_level=async_level,
                               policy_lag=policy_lag, sha256=sha256, size=size)
    except RolloutRejected as e:
        log.info("rejected %s: %s", rel_path, e)
        return [Verdict.file_rejected(rel_path, step, worker, k, e.reason)]

    by_id = {t.id: t for t in tasks}
    why = check_assignment(
        rows, [t.id for t in tasks], cfg.prompts_per_submission, group_size=cfg.group_size,
        prompt_tokens=lambda task_id: prompt_tokens(tokenizer, by_id[task_id], cfg.prompt), salt=salt,
    )
    if why is not None:
        log.info("rejected %s: assignment: %s", rel_path, why)
        return [Verdict.of(r, rel_path, i, ASSIGNMENT) for i, r in enumerate(rows)]

    seeds = assigned_seeds(rows, salt)
    reasons: list[str | None] = [SEED if r.seed != s else None for r, s in zip(rows, seeds)]
    eos = stop_ids(tokenizer.eos_token_id, None) if eos_ids is None else eos_ids
    reasons = [old or new for old, new in zip(reasons, length_check(cfg.max_tokens, eos)(rows))]
    # the extra checks see the seed the validator computed, never the one the worker wrote
    assigned = [r if r.seed == s else dataclasses.replace(r, seed=s) for r, s in zip(rows, seeds)]
    for check in extra_checks:
        got = list(check(assigned))
        if len(got) != len(rows):
            raise ValueError(f"check {check!r} returned {len(got)} reasons for {len(rows)} rows")
        reasons = [old or new for old, new in zip(reasons, got)]
    believed = [reason is None for reason in reasons]

    # Only rows the checks believe are scored (a rejected row's reward is never used), and a file's
    # rows are scored in one call, so the reward's per-file time budget bounds what one file costs.
    kept = [i for i in range(len(rows)) if believed[i]]
    rewards = dict(zip(kept, task_rewards(reward_fn, [completion_text(tokenizer, rows[i].output_tokens) for i in kept],
                                          [by_id[rows[i].prompt_id] for i in kept], worker=worker)))
    for i in kept:
        r, truth = rows[i], rewards[i]
        claim = truth if salt == NO_SALT else 0.0  # a worker of the service knows no reference answer
        if not (_same(r.task_reward, claim) and _same(r.reward, claim) and r.length_penalty == 0):
            reasons[i] = REWARD_MISMATCH

    advantages = dict(zip(kept, advantages_of([rewards[i] for i in kept], [rows[i].group_id for i in kept])))
    verdicts = []
    for i, r in enumerate(rows):
        if reasons[i] is None:
            r = dataclasses.replace(r, reward=rewards[i], task_reward=rewards[i], advantage=advantages[i])
        verdicts.append(Verdict.of(r, rel_path, i, reasons[i]))
    return verdicts
