"""What a verdict is, and which verdict tables the ledger accepts.

A :class:`Verdict` is the validator's decision on one sample of a submission (or, with ``row = -1``,
on a whole file it could not read); :func:`verdict_table` lays verdicts out as an Arrow table with
:data:`VERDICT_SCHEMA`, the form the validator writes and :class:`~intellect.ledger.Ledger` records.

**Bounds.** The ledger takes status, reward and advantage from such a table, so
:func:`check_verdict_table` checks every row first: known status, a short reason code
(:data:`REASON_RE`) exactly when rejected, finite reward and advantage within :data:`MAX_ABS_REWARD`
and :data:`MAX_ABS_ADVANTAGE`, sane ids and counts. One bad row refuses the whole table
(:class:`BadVerdictTable`), unwritten.

:class:`LedgerError` lives here, below the ledger, because a refused table is one of the ledger's
refusals and the ledger imports this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable, Literal

import pyarrow as pa
import pyarrow.compute as _pc

from intellect.ids import canonical_worker

if TYPE_CHECKING:
    from intellect.rl.wire.rollout_schema import Rollout

#: pyarrow's compute kernels take Python scalars, which the overloads of pyarrow-stubs reject.
pc: Any = _pc

#: The reason the ledger records for an accepted sample whose content is accepted elsewhere already.
DUPLICATE = "duplicate"

_SAMPLE_FIELDS = (
    "content_hash", "policy_step", "prompt_id", "group_id", "reward", "advantage", "prompt_tokens", "output_tokens"
)
#: Columns of :func:`verdict_table`: the fields of :class:`Verdict`, in order.
VERDICT_SCHEMA = pa.schema(
    [
        ("file", pa.string()), ("row", pa.int32()), ("step", pa.int64()), ("worker", pa.string()),
        ("submission", pa.int64()), ("status", pa.string()), ("reason", pa.string()),
        ("content_hash", pa.string()), ("policy_step", pa.int64()), ("prompt_id", pa.string()),
        ("group_id", pa.int32()), ("reward", pa.float64()), ("advantage", pa.float64()),
        ("prompt_tokens", pa.int32()), ("output_tokens", pa.int32()),
    ]
)

#: Largest group a GRPO advantage is normalised over (``SubmissionConfig.group_size`` allows no more).
MAX_GROUP_SIZE = 1024
#: Bound on an accepted row's |advantage|: a z-score with the sample std of ``n`` values is at most
#: ``(n - 1) / sqrt(n)`` (Samuelson's inequality), 31.97 for ``n = 1024``.
MAX_ABS_ADVANTAGE = 32.0
#: Bound on any row's |reward| and |advantage| (``RolloutLimits`` allows no wider reward range).
MAX_ABS_REWARD = 1e6
MAX_FILE_CHARS = 1024
MAX_TOKENS = 1 << 24  # per sample, prompt or output
MAX_SUBMISSION = (1 << 31) - 1
#: A rejection reason is a short machine code (``assignment``, ``toploc_sampling``...).
REASON_RE = r"^[a-z][a-z0-9_]{0,63}$"


class LedgerError(RuntimeError):
    """A ledger operation that would break an invariant (see :mod:`intellect.ledger`)."""


class BadVerdictTable(LedgerError, ValueError):
    """A verdict table that :meth:`~intellect.ledger.Ledger.record_table` refuses whole; the message names the
    row and field."""


def check_verdict_table(step: int, table: pa.Table) -> None:
    """Raise :class:`BadVerdictTable` naming the first row and field out of bounds (see the module docstring).

    >>> ok = verdict_table([Verdict("rollouts/step_0/a-0.parquet", -1, 0, "a", 0, "rejected", "schema")])
    >>> check_verdict_table(0, ok)
    >>> forged = ok.set_column(5, "status", pa.array(["accepted"]))
    >>> try:
    ...     check_verdict_table(0, forged)
    ... except BadVerdictTable as e:
    ...     print(e)
    verdict row 0 (rollouts/step_0/a-0.parquet:-1): row is -1 (a whole file) but not rejected
    """
    if table.schema.remove_metadata() != VERDICT_SCHEMA:
        raise BadVerdictTable(f"not a verdict table: schema {table.schema} is not {VERDICT_SCHEMA}")
    if not table.num_rows:
        return
    c, and_, not_ = table.column, pc.and_kleene, pc.invert

    def within(name: str, lo: float, hi: float) -> Any:
        return and_(pc.greater_equal(c(name), lo), pc.less_equal(c(name), hi))

    def out(name: str, lo: float, hi: float) -> Any:  # present and outside [lo, hi] (NaN is outside)
        return and_(pc.is_valid(c(name)), not_(within(name, lo, hi)))

    def unlike(name: str, pattern: str) -> Any:
        return not_(pc.match_substring_regex(c(name), pattern))

    row, chars = c("row"), pc.utf8_length(c("file"))
    acc, rej = pc.equal(c("status"), "accepted"), pc.equal(c("status"), "rejected")
    workers = [w for w in pc.unique(c("worker")).to_pylist() if w is not None]
    canonical = pa.array([w for w in workers if _is_canonical(w)], pa.string())
    complete = pc.is_valid(c(_SAMPLE_FIELDS[0]))
    for f in _SAMPLE_FIELDS[1:]:
        complete = and_(complete, pc.is_valid(c(f)))
    checks = [
        ("status", "is not accepted or rejected", not_(pc.or_kleene(acc, rej))),
        ("step", f"is not {step} (verdicts for other steps than {step})", pc.not_equal(c("step"), step)),
        ("file", f"is missing, empty or over {MAX_FILE_CHARS} characters",
         not_(and_(pc.greater(chars, 0), pc.less_equal(chars, MAX_FILE_CHARS)))),
        ("row", "is missing or below -1", not_(pc.greater_equal(row, -1))),
        ("row", "is -1 (a whole file) but not rejected", and_(pc.equal(row, -1), not_(rej))),
        ("worker", "is not a canonical worker id", not_(pc.is_in(c("worker"), canonical))),
        ("submission", f"is missing or outside 0..{MAX_SUBMISSION}", not_(within("submission", 0, MAX_SUBMISSION))),
        ("reason", "is set on an accepted row", and_(acc, pc.is_valid(c("reason")))),
        ("reason", f"of a rejected row is not a reason code ({REASON_RE})", and_(rej, unlike("reason", REASON_RE))),
        (", ".join(_SAMPLE_FIELDS), "missing on a sample row", and_(pc.greater_equal(row, 0), not_(complete))),
        ("content_hash", "is not a hex sha256",
         and_(pc.is_valid(c("content_hash")), unlike("content_hash", "^[0-9a-f]{64}$"))),
        ("policy_step", f"is outside 0..{step}", out("policy_step", 0, step)),
        ("group_id", "is negative", out("group_id", 0, MAX_SUBMISSION)),
        ("reward", f"is not finite within +-{MAX_ABS_REWARD:g}", out("reward", -MAX_ABS_REWARD, MAX_ABS_REWARD)),
        ("advantage", f"is not finite within +-{MAX_ABS_REWARD:g}", out("advantage", -MAX_ABS_REWARD, MAX_ABS_REWARD)),
        ("advantage", f"of an accepted row is over {MAX_ABS_ADVANTAGE:g} in magnitude (no GRPO group of at most "
                      f"{MAX_GROUP_SIZE} gives that)",
         and_(acc, out("advantage", -MAX_ABS_ADVANTAGE, MAX_ABS_ADVANTAGE))),
        ("prompt_tokens", f"is outside 0..{MAX_TOKENS}", out("prompt_tokens", 0, MAX_TOKENS)),
        ("output_tokens", f"is outside 0..{MAX_TOKENS}", out("output_tokens", 0, MAX_TOKENS)),
    ]
    first = None
    for name, what, bad in checks:
        bad = pc.fill_null(bad, True)  # a comparison with a missing value is a failed check
        i = pc.index(bad, True).as_py()
        if i >= 0 and (first is None or i < first[0]):
            first = (i, name, what)
    if first is not None:
        i, name, what = first
        where = f"{table['file'][int(i)].as_py()}:{table['row'][int(i)].as_py()}"
        raise BadVerdictTable(f"verdict row {i} ({where}): {name} {what}")


def _is_canonical(worker: str) -> bool:
    try:
        return canonical_worker(worker) == worker
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Verdict:
    """The validator's decision on one sample (or, with ``row = -1``, on a whole unreadable file)."""

    file: str
    row: int
    step: int
    worker: str
    submission: int
    status: Literal["accepted", "rejected"]
    reason: str | None = None
    content_hash: str | None = None
    policy_step: int | None = None
    prompt_id: str | None = None
    group_id: int | None = None
    reward: float | None = None
    advantage: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.status not in ("accepted", "rejected"):
            raise ValueError(f"status must be accepted or rejected, got {self.status!r}")
        if (self.status == "rejected") != bool(self.reason):
            raise ValueError("a rejected verdict needs a reason and an accepted one has none")
        if self.row < -1 or (self.row == -1 and self.status == "accepted"):
            raise ValueError(f"row must be >= 0 (or -1 for a rejected file), got {self.row}")
        if self.row >= 0 and any(getattr(self, f) is None for f in _SAMPLE_FIELDS):
            raise ValueError(f"a sample verdict needs {', '.join(_SAMPLE_FIELDS)}")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError("reward must be finite")
        canonical_worker(self.worker)

    @classmethod
    def of(cls, rollout: Rollout, file: str, row: int, reason: str | None = None) -> Verdict:
        """The verdict on row ``row`` of ``file``: accepted without ``reason``, rejected with one."""
        return cls(
            file=file,
            row=row,
            step=rollout.step,
            worker=rollout.worker,
            submission=rollout.submission,
            status="rejected" if reason else "accepted",
            reason=reason,
            content_hash=rollout.content_hash,
            policy_step=rollout.policy_step,
            prompt_id=rollout.prompt_id,
            group_id=rollout.group_id,
            reward=float(rollout.reward),
            advantage=float(rollout.advantage),
            prompt_tokens=len(rollout.prompt_tokens),
            output_tokens=len(rollout.output_tokens),
        )

    @classmethod
    def file_rejected(cls, file: str, step: int, worker: str, submission: int, reason: str) -> Verdict:
        return cls(file=file, row=-1, step=step, worker=worker, submission=submission, status="rejected", reason=reason)


def verdict_table(verdicts: Iterable[Verdict]) -> pa.Table:
    """Verdicts as an Arrow table with :data:`VERDICT_SCHEMA` (worker names canonical).

    >>> t = verdict_table([Verdict("rollouts/step_0/a-0.parquet", -1, 0, "A", 0, "rejected", "schema")])
    >>> t.num_rows, t["worker"][0].as_py(), t["reason"][0].as_py()
    (1, 'a', 'schema')
    """
    vs = list(verdicts)
    cols = {f.name: [getattr(v, f.name) for v in vs] for f in fields(Verdict)}
    cols["worker"] = [canonical_worker(w) for w in cols["worker"]]
    return pa.table(cols, schema=VERDICT_SCHEMA)
