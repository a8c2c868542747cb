"""INTELLECT-2's online filter on the trainer's side: a step trains once it holds enough samples with signal.

A step's samples with signal are its accepted ledger rows in groups whose rewards, as the validator
computed them, are not all equal (:func:`~intellect.rl.trainer.step.signal_rows`, what the step trains
on): a worker's claimed rewards never enter the count, so no claim makes a step train early, and no
worker can hold a step back, since every wait is bounded. While the count is below
``online_filter.min_signal_samples``, :meth:`~intellect.rl.trainer.run.RLRun.fill` opens rounds of
assignment (with the submission service, a round any worker may answer with one submission,
:mod:`intellect.rl.wire.refill`; without it, each worker generating here adds one), validates and records
what a round brought, and counts again. It stops at the count, after ``max_rounds`` rounds, or when
a round brings nothing within ``round_timeout``; the step then trains on what it holds, and
:class:`FillReport` says why. The report is written beside the step's rollouts
(:func:`report_path`) and its figures go into the step's metrics in the ledger when it commits
(:func:`metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from intellect.rl.trainer.step import signal_rows
from intellect.storage import step_name

if TYPE_CHECKING:
    from intellect.ledger import Ledger
    from intellect.storage import RunStorage

KIND = "online_filter"

#: why the filter stopped: off, the count reached, the rounds used up, a round that brought no file, the run stopping
Reason = Literal["off", "reached", "max_rounds", "no_submissions", "stopping"]


class FillReport(BaseModel):
    """What a step held when it went on to train."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    target: int = Field(ge=0, description="online_filter.min_signal_samples (0: off).")
    accepted: int = Field(ge=0, description="Accepted samples of the step.")
    signal: int = Field(ge=0, description="Accepted samples in groups with unequal rewards (trained on).")
    rounds: int = Field(ge=0, description="Rounds of assignment past the first the step asked for.")
    files: int = Field(ge=0, description="Submission files the rounds brought.")
    reason: Reason

    @property
    def short(self) -> bool:
        """Whether the step trains below its count (it stopped at a bound)."""
        return self.signal < self.target


def signal_count(ledger: Ledger, step: int) -> tuple[int, int]:
    """(accepted samples, accepted samples with signal) of ``step`` in the ledger."""
    rows = ledger.accepted(step)
    return len(rows), len(signal_rows(rows))


def report_path(step: int) -> str:
    """Where :class:`FillReport` of ``step`` is kept in run storage."""
    return f"{KIND}/{step_name(step)}.json"


def write_report(storage: RunStorage, report: FillReport) -> None:
    storage.write_text(report_path(report.step), report.model_dump_json())


def read_report(storage: RunStorage, step: int) -> FillReport | None:
    """The filter's report of ``step`` (None: the step never ran the filter here)."""
    rel = report_path(step)
    return FillReport.model_validate_json(storage.read_text(rel)) if storage.exists(rel) else None


def metrics(report: FillReport | None) -> dict[str, float]:
    """The report's figures as the step's metrics in the ledger (its ``timings`` map holds numbers only;
    the reason stays in the report file).

    >>> metrics(FillReport(step=0, target=8, accepted=16, signal=6, rounds=2, files=4, reason="max_rounds"))
    {'filter_signal': 6.0, 'filter_rounds': 2.0, 'filter_files': 4.0, 'filter_short': 1.0}
    """
    if report is None or report.reason == "off":
        return {}
    return {"filter_signal": float(report.signal), "filter_rounds": float(report.rounds),
            "filter_files": float(report.files), "filter_short": float(report.short)}
