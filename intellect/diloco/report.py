"""What a DiLoCo worker reports of each outer step: the :class:`StepReport` it writes to the rendezvous
(``METRICS``) and, one row per committed step, to its metrics series in run storage; and, while it
trains, its progress lines (:class:`WorkerLog`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from intellect import progress
from intellect.metrics import MetricsLog
from intellect.progress import Progress

if TYPE_CHECKING:
    from intellect.diloco.config import DilocoRunConfig
    from intellect.storage import RunStorage


Phase = Callable[[str, Callable[[], Any]], Any]  # runs one named phase of an outer step: phase(name, fn)


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
    inner_steps: int = 0  # inner steps trained in the phase (fewer than H: the others closed it, diloco.quorum)
    weight: float = 1.0  # the weight of this worker's contribution in the mean, a full phase's 1 (diloco.quorum)
    late_step: int = -1  # the step of the late pseudo-gradient this worker contributed instead (-1: its own)
    tokens_per_s: float = 0.0  # tokens / outer_seconds
    mfu: float = 0.0  # model FLOPs of those tokens over outer_seconds, as a fraction of the devices' peak
    device_memory_mb: float = 0.0  # CUDA: the peak memory allocated on the worker's busiest device, MiB
    excluded: str = ""  # why this worker was left out of the step (then not committed)
    shard: list[int] = field(default_factory=list)  # [i, n]: the data shard read (text: member i of n)
    data_sketch: list[str] = field(default_factory=list)  # data_sketch() of the sequences trained on


def metrics_series(worker: str) -> str:
    """The run storage name of ``worker``'s metrics time series (one row per committed outer step)."""
    return f"metrics/diloco/{worker}.jsonl"


class WorkerLog:
    """A worker's metrics series (one row per committed outer step, written at once: steps are long,
    and a killed worker keeps its series) and its progress over the run's inner steps: a line every
    ``logging.progress_seconds`` (or ``progress_steps`` inner steps), and while it waits on its peers
    (all-reduce, the next boundary) a heartbeat line saying so."""

    def __init__(self, storage: RunStorage, run: DilocoRunConfig, worker: str, checkpoint: int):
        d = run.diloco
        self.inner_steps, self.outer_steps = d.inner_steps, d.outer_steps
        self.series = MetricsLog(storage, metrics_series(worker), run.logging, flush_every=1)
        progress.configure(run.logging.progress_seconds)  # a worker process serves one run
        self.progress = Progress(worker, d.outer_steps * d.inner_steps, unit="inner step",
                                 start=checkpoint * d.inner_steps, every=run.logging.progress_steps, heartbeat=True)
        self.progress.begin(f"{d.outer_steps} outer steps of {d.inner_steps} inner steps, from checkpoint "
                            f"{checkpoint}; joining the first boundary")

    def log(self, step: int, row: dict) -> None:
        self.series.log(step, row)

    def on_inner_step(self, check: Callable[[], object]) -> Callable[[int, dict], None]:
        """The trainer's ``on_step`` for an inner phase: ``check`` (the store's liveness), then the
        progress of inner step ``n`` (the run's count)."""

        def on_step(n: int, rec: dict) -> None:
            check()
            outer = (n - 1) // self.inner_steps
            self.progress.update(n, tokens=int(rec["tokens"]), loss=rec["loss"],
                                 outer_step=f"{outer + 1}/{self.outer_steps}")
            if n % self.inner_steps == 0:
                self.progress.waiting(f"all-reduce and boundary after outer step {outer + 1}")

        return on_step

    def close(self) -> None:
        self.progress.close()
        self.series.close()


__all__ = ["StepReport", "WorkerLog", "metrics_series"]
