"""What a DiLoCo worker reports of each outer step: the :class:`StepReport` it writes to the rendezvous
(``METRICS``) and, one row per committed step, to its metrics series in run storage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepReport:
    step: int
    worker: str
    members: list[str] = field(default_factory=list)
    contributors: int = 0
    attempts: int = 0
    inner_loss: float = math.nan
    inner_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    bytes_sent: int = 0
    algorithm: str = ""  # the all-reduce that committed (diloco.algorithm "auto" resolves per membership)
    estimates: dict[str, float] = field(default_factory=dict)  # auto: each candidate's link-bandwidth bound, s
    onboarded: bool = False
    committed: bool = False
    digest: str = ""
    flagged: list[str] = field(default_factory=list)  # members a majority reported as outliers in this step
    banned: list[str] = field(default_factory=list)  # members banned at this step (exclude_after strikes)
    outer_seconds: float = 0.0  # wall time of the step, boundary start to commit
    compute_utilization: float = 0.0  # inner_seconds / outer_seconds
    tokens: int = 0  # target tokens trained on in the inner phase
    tokens_per_s: float = 0.0  # tokens / outer_seconds
    mfu: float = 0.0  # model FLOPs of those tokens over outer_seconds, as a fraction of the device's peak
    shard: list[int] = field(default_factory=list)  # [i, n]: the data shard read (text: member i of n)
    data_sketch: list[str] = field(default_factory=list)  # data_sketch() of the sequences trained on


def metrics_series(worker: str) -> str:
    """The run storage name of ``worker``'s metrics time series (one row per committed outer step)."""
    return f"metrics/diloco/{worker}.jsonl"


__all__ = ["StepReport", "metrics_series"]
