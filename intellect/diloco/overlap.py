"""The overlapped outer step (``diloco.overlap`` delayed or eager) of a DiLoCo worker.

The reduction of step ``t`` runs through inner phase ``t+1`` and the boundary of ``t+1``; it is finished,
committed and checkpointed in the reduce phase of step ``t+1`` (:meth:`Overlap.overlapped_reduce`), and the
run's last step is drained by one more call of ``outer_step`` that only finishes it. Where phase ``t+1``
starts is the difference between the two modes: ``theta_sync`` with the averages up to ``t-1`` (delayed,
PCCL's async DiLoCo), or that after one outer step on the worker's own fresh pseudo-gradient at weight
1/n (eager, DeepMind's eager updates: :meth:`~intellect.diloco.outer.OuterState.preview`). With plain SGD
the eager start is what DeepMind's update gives, ``theta_sync(t-1) - lr * own(t) / n``; with momentum the
preview runs on a copy of it. ``diloco.eager_weight`` replaces 1/n (1: the worker's own pseudo-gradient
as its guess of the members' average, which starts the next phase nearer where the committed step will
land). ``theta_sync`` itself, its ``DIGEST`` and the checkpoints are those of the committed averages, as
in a blocking run, so replicas stay bit-identical and one worker's eager run is the blocking run bit for
bit.

A worker's ``COMMITTED`` record counts the step in flight (``claimed``), so members with a step in flight
are level at a boundary; a joiner there gets its source's state once the source committed that step
(``send_after_commit``), checks it against the digest the members then record, relays the step it
joined (contributing nothing) and trains from the next. Checkpoint ``n`` is published as step ``n-1``
commits, in the reduce phase of step ``n``: each worker's state saved with it is the one after inner phase
``n`` with that phase's pseudo-gradient (``in_flight``), written before it votes on step ``n-1`` (so a
complete checkpoint implies every member's state for it), and a run resumed from checkpoint ``n`` starts by
reducing step ``n`` again, skips the phase it trained, and goes on as the run it resumes would have.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

from intellect.diloco.report import Phase, StepReport
from intellect.diloco.sync import Excluded

if TYPE_CHECKING:
    import torch

    from intellect.diloco.config import DilocoConfig
    from intellect.diloco.outer import OuterState
    from intellect.diloco.sync import Synchronizer

__all__ = ["Overlap"]


class Overlap:
    """The overlapped phases of :class:`~intellect.diloco.worker.DilocoWorker` (which this is a part of: the
    attributes and methods it uses are the worker's)."""

    cfg: DilocoConfig
    step: int
    committed: int
    members: list[str]
    step_joiners: list[str]
    outer: OuterState
    sync: Synchronizer
    model: torch.nn.Module
    catching_up: object
    caught_up_in_flight: bool
    resumed_in_flight: list[torch.Tensor] | None
    in_flight_report: StepReport | None
    send_after_commit: dict | None

    if TYPE_CHECKING:  # the worker's
        def save_state(self, n: int | None = None, in_flight: list[torch.Tensor] | None = None) -> None: ...
        def enter(self, report: StepReport) -> None: ...
        def inner(self, report: StepReport) -> None: ...
        def commit(self, members: list[str], report: StepReport) -> None: ...
        def checkpoint(self) -> str | None: ...
        def abandon(self, e: Excluded) -> None: ...
        def timing(self, report: StepReport) -> None: ...
        def end(self, report: StepReport, advance: bool = True) -> None: ...
        def send_snapshots(self, onboard: dict) -> None: ...
        def _caught_up(self) -> None: ...

    def _overlapped_step(self, run: Phase, report: StepReport) -> StepReport:
        """:meth:`outer_step` overlapped: the phases of step ``t`` with the reduce phase finishing step
        ``t-1`` (then its commit and checkpoint) and starting step ``t``; returns the committed step's report
        (the first step's own, uncommitted, when nothing was in flight). Once the run's last step is in
        flight, a call only drains it."""
        drain = self.step >= self.cfg.outer_steps
        try:
            if not drain:
                run("boundary", lambda: self.enter(report))
                run("inner", lambda: self.inner(report))
            done: StepReport | None = run("reduce", lambda: self.overlapped_reduce(report, drain))
            if done is not None:
                run("commit", lambda: self.commit(done.members, done))
                run("checkpoint", self.checkpoint)
        except Excluded as e:
            report.excluded = str(e)
            run("abandon", partial(self.abandon, e))
            return report
        if not drain:
            self.timing(report)
            self.step += 1
        if done is not None:
            self.end(done, advance=False)
        elif drain:
            time.sleep(self.cfg.heartbeat_interval)  # nothing of its own left: the others finish the run
        return done if done is not None else report

    def overlapped_reduce(self, report: StepReport, drain: bool = False) -> StepReport | None:
        """The reduce phase overlapped: this phase's pseudo-gradient (from where it started), then the step
        in flight finished (committed into ``theta_sync``, or rolled back with :class:`Excluded`), a joiner's
        state taken, this step's reduction started with the pseudo-gradient, and the model loaded with the
        next phase's start: ``theta_sync`` (delayed; a worker that contributes nothing) or its preview with
        this worker's own share, 1/n of the step's n contributors (eager). Returns the report of the step
        it committed, if one was in flight."""
        contribute = not drain and self.catching_up is None
        pseudo = (self.resumed_in_flight or self.outer.pseudo_gradient(self.model)) if contribute else None
        self.resumed_in_flight = None
        done = None
        if self.sync.in_flight is not None:
            if pseudo is not None:  # for the checkpoint the step in flight publishes, before its vote
                self.save_state(self.step, pseudo)
            done, self.in_flight_report = self.in_flight_report, None
            assert done is not None
            done.members = self.sync.finish()
            self.committed = done.step + 1  # what a snapshot sent now holds
            if self.send_after_commit is not None:
                onboard, self.send_after_commit = self.send_after_commit, None
                self.send_snapshots(onboard)
        if drain:
            return done
        if self.catching_up is not None:
            self._caught_up()  # the state its source committed, or Excluded
            self.caught_up_in_flight = True
        self.sync.start(self.step, self.members, report, contribute=contribute, pseudo=pseudo)
        self.in_flight_report, self.prev_members = report, list(self.members)  # the next boundary's veterans
        n = len(self.members) - len(self.step_joiners)
        if self.cfg.overlap == "eager" and pseudo is not None and n > 0:
            weight = self.cfg.eager_weight if self.cfg.eager_weight is not None else 1.0 / n
            self.outer.load_into(self.model, self.outer.preview(pseudo, weight))
        else:
            self.outer.base = None
            self.outer.load_into(self.model)
        return done

