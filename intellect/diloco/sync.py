"""The synchronizer: one outer step's reduction of the pseudo-gradient, the vote, and the outer step.

A :class:`DilocoWorker` drives it in torchft's shape, once per outer step::

    worker.boundary()                  # the step's members (and onboarding)
    worker.inner(report)               # H inner steps
    sync.start(step, members, report)  # the pseudo-gradient, and its reduction begun: a Reduction
    members = sync.finish()            # wait, vote, then the outer step (and DIGEST), or roll back and retry
    worker.commit(members, report)     # the committed count, the step's timing, PROGRESS

:meth:`Synchronizer.start` computes ``theta_sync - theta_local`` on the caller's thread (it reads the
model) and hands the attempt (mark ``ready``, the plan, the group, ``all_reduce_mean``, the
``FLAGS``/``BLAME`` report) to a background thread; it returns a :class:`Reduction` at once.
:meth:`Synchronizer.finish` waits for it and asks :meth:`Synchronizer.should_commit`: the worker's
result (every one of its local ranks' rings succeeded), then the quorum's vote and decision
(:meth:`~intellect.diloco.protocol.Quorum.should_commit`). On commit it
applies the outer step to ``theta_sync`` and loads it into the model, then strikes and bans the
members a majority flagged. On abort nothing changed: the outer state and the model are as
:meth:`start` found them (the average was reduced into a copy; the pseudo-gradient is kept for the
retry), a majority's blame costs strikes, and the next attempt runs with the survivors who voted,
up to ``diloco.max_attempts``. A worker left out of a retry gets :class:`Excluded`; attempts run out,
:class:`~intellect.diloco.membership.MembershipTimeout`.

Local ranks. A worker of M ranks (``diloco.ranks_per_worker``; :mod:`~intellect.diloco.siblings`)
runs one synchronizer per rank over that rank's shard of ``theta_sync``
(:class:`~intellect.diloco.outer_shard.ShardedOuterState`): rank *i* reduces in the group of rank *i*
of every member (:meth:`Synchronizer.group`, its own store prefix and MAC keys), the M rings at
once. The leader alone talks to the rendezvous (ready, plan, reports, vote, decision, bans) and hands
each decision to its siblings: the plan before the rings start, then commit, retry (its members
and attempt), exclusion or giving up. It votes ok only when every ring of the worker succeeded, so a
step commits on every shard of every member or on none: never an averaged shard beside a local one.

Threads. While a reduction is in flight its thread owns the worker's rendezvous connection (TCPStore
clients are not shared across threads): the caller may compute (an inner phase touches only the
heartbeat thread's liveness flag) but must not talk to the store until :meth:`finish` returns.

Overlap (``diloco.overlap``: delayed, eager). The worker moves only the place of ``finish``: after
inner phase ``t`` it computes the pseudo-gradient, finishes step ``t-1`` (in flight all through phase
``t``), then starts step ``t`` with it and trains phase ``t+1`` while it reduces::

    pseudo = outer.pseudo_gradient(model)          # after inner phase t, from where phase t started
    members = sync.finish()                        # step t-1: vote, commit into theta_sync (not the model)
    sync.start(t, members_t, report_t, pseudo=pseudo)
    outer.load_into(model, ...)                    # theta_sync (delayed) or outer.preview(pseudo, 1/n) (eager)

A commit then leaves the model alone (the worker is training it); the committed ``theta_sync`` and its
``DIGEST`` are the same on every member as in a blocking run. The reduction thread's rendezvous client
keeps a connection of its own, so the next boundary runs beside it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from intellect.device import dist_backend
from intellect.diloco.allreduce import AllReduceError, AllReduceStats, Misbehaviour, all_reduce_mean
from intellect.diloco.bandwidth import measure_ring
from intellect.diloco.config import DilocoConfig
from intellect.diloco.faults import NO_FAULTS, Faults
from intellect.diloco.membership import Membership, MembershipTimeout, StoreLost
from intellect.diloco.outer import OuterState
from intellect.diloco.plan import SCREENED, fallback_plan, own_plan, settle_plan
from intellect.diloco.protocol import BAN, BLAME, BW, DIGEST, FLAGS, PG, PROBE, READY, Quorum, ban_record
from intellect.diloco.report import StepReport
from intellect.diloco.robust import Screen, Strikes, majority_flagged, reported
from intellect.diloco.siblings import ALONE, Siblings
from intellect.diloco.sparse import TopK
from intellect.diloco.stragglers import Ready, StragglerPolicy, Window, read_ready, ready_record, scale_of, token_weights
from intellect.diloco.topk_reduce import ErrorFeedback, topk_all_reduce_mean
from intellect.diloco.transport import CommError, new_group, shard_prefix
from intellect.trust.mac import derive_key

log = logging.getLogger("intellect.diloco")


JOIN_GRACE = 2  # contributions of a newly onboarded member that are not struck (Synchronizer.newcomers)


class Excluded(RuntimeError):
    """This worker was left out of a step's membership; it rejoins at a later boundary."""


MAX_LATE_STEPS = 2  # a late pseudo-gradient is merged into a step at most this many past its own, else dropped


@dataclass
class Late:
    """A pseudo-gradient the others did not wait for (``diloco.quorum`` < 1): held for the step this worker
    next takes part in while catching up, where it is merged with the weight of its ``tokens``."""

    step: int
    pseudo: list[torch.Tensor]
    tokens: int
    seconds: float


@dataclass
class Attempt:
    """What one attempt's reduction gave: ``absent`` members that never became ready (no vote then),
    else ``ok`` with the ``average``, its ``stats`` and the ``plan`` that ran."""

    step: int
    attempt: int
    members: list[str]
    present: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    ok: bool = False
    average: list[torch.Tensor] | None = None
    stats: AllReduceStats | None = None
    plan: dict | None = None
    seconds: float = 0.0
    worker_ok: bool = False  # every local rank's ring succeeded (the leader's to know)
    worker_bytes: int = 0  # bytes the worker's rings sent (the leader's to know)


class Reduction:
    """One attempt's reduction, running on a daemon thread: :meth:`done` polls, :meth:`wait` joins
    and returns its :class:`Attempt` or raises what the thread raised."""

    def __init__(self, body: Callable[[], Attempt], name: str):
        self._result: Attempt | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(body,), name=name, daemon=True)
        self._thread.start()

    def _run(self, body: Callable[[], Attempt]) -> None:
        try:
            self._result = body()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Attempt:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Synchronizer:
    """Worker ``worker``'s reductions of ``model``'s pseudo-gradient against ``outer``, under ``cfg``
    (``diloco.*``), sealed with keys derived from ``allreduce_root`` for ``run_name``. ``m``: the
    worker's membership, on its leader; a follower passes None and its rendezvous connection as
    ``store``. ``siblings``: the worker's local ranks (:data:`~intellect.diloco.siblings.ALONE`: one).
    It keeps what outlives a step: the bandwidth rates measured at boundaries, the strikes, whom this
    worker banned."""

    def __init__(self, m: Membership | None, model: torch.nn.Module, outer: OuterState, cfg: DilocoConfig,
                 run_name: str, allreduce_root: bytes, faults: Faults = NO_FAULTS, siblings: Siblings = ALONE, *,
                 worker: str | None = None, store: dist.Store | None = None):  # pyright: ignore[reportPrivateImportUsage]
        if m is None and (worker is None or store is None or siblings.leader):
            raise ValueError("a synchronizer without membership is a follower's: name its worker and store")
        self.m, self.model, self.outer, self.cfg = m, model, outer, cfg
        self.worker: str = m.worker if m is not None else worker  # pyright: ignore[reportAttributeAccessIssue]
        self.store: dist.Store = m.store if m is not None else store  # pyright: ignore[reportAttributeAccessIssue,reportPrivateImportUsage]
        self.run_name, self.allreduce_root, self.faults, self.siblings = run_name, allreduce_root, faults, siblings
        self.strikes = Strikes(cfg.exclude_after)
        self.banned_here: set[str] = set()  # whom our own strikes banned: out of our proposals at once
        self.grace: dict[str, int] = {}  # newcomers' contributions left before their flags count as strikes
        self.rates: dict[tuple[str, str], float] = {}  # (sender, receiver) -> bytes/s
        self.last_algorithm = ""  # logged when it changes
        self._step = 0
        self._report = StepReport(step=0, worker=self.worker)
        self._pseudo: list[torch.Tensor] = []
        self._contribute = True
        self._handle: Reduction | None = None
        self._in_flight = False  # started and not finished (overlap: through the next inner phase)
        self._tries = 0
        self.before_step: Callable[[], None] | None = None  # run at a commit, before the outer step
        self.late: Late | None = None  # our pseudo-gradient of a step we were too late for (diloco.quorum < 1)
        # compression "topk": this rank's error-feedback residual (its shard); the worker checkpoints it
        self.feedback = ErrorFeedback(sum(p.numel() for p in outer.params),
                                      TopK(cfg.topk_chunk, cfg.topk_k, cfg.topk_decay)) \
            if cfg.compression == "topk" else None

    @property
    def membership(self) -> Membership:
        """The worker's membership: the leader's alone."""
        assert self.m is not None, "the leader's synchronizer talks to the rendezvous"
        return self.m

    def _deadline(self, seconds: float) -> float:
        return time.monotonic() + seconds

    def group(self, step: int, attempt: int | str, members: list[str]):
        """This rank's group of ``members`` (TCP between workers: :mod:`~intellect.diloco.tcp_group`) under ``PG(step, attempt)``: local rank *i* > 0 in the
        ring of its shard (``.../shard<i>``, :func:`~intellect.diloco.transport.shard_prefix`). A fresh
        store prefix per membership: a dead member's half-written keys cannot leak in. Every tensor
        reduced or broadcast on it (pseudo-gradients, the onboarding state, probes) is fp32 on the host,
        whatever the inner device."""
        prefix = PG(step, attempt) if self.siblings.rank == 0 else shard_prefix(PG(step, attempt), self.siblings.rank)
        return new_group(self.store, prefix, members.index(self.worker), len(members),
                         timeout=self.cfg.collective_timeout,
                         backend="nccl" if dist_backend(self.outer.params[0].device) == "nccl" else "tcp")

    def mac_key(self, step: int, attempt: int) -> bytes:
        """The MAC key of this rank's ring in an attempt: one per shard, so no message crosses rings."""
        if self.siblings.rank == 0:
            return derive_key(self.allreduce_root, "allreduce", self.run_name, step, attempt)
        return derive_key(self.allreduce_root, "allreduce", self.run_name, step, attempt, f"shard{self.siblings.rank}")

    # ------------------------------------------------------------------ planning

    def probe(self, step: int, members: list[str]) -> None:
        """Measure the pairs of a new membership (best effort: on failure the ring is unordered)."""
        if self.cfg.bandwidth_probe_bytes == 0 or len(members) < 3:
            return
        known = all((a, b) in self.rates for a in members for b in members if a != b)
        # one decision for all: a restarted worker that forgot its rates must not probe alone
        if self.membership.decide(PROBE(step), "no" if known else "yes") == "no":
            return
        try:
            group = self.group(step, "bw", members)
            store = dist.PrefixStore(BW(step), self.store)  # pyright: ignore[reportPrivateImportUsage]
            _, columns = measure_ring(group, store, "col", self.cfg.bandwidth_probe_bytes)
        except (CommError, dist.DistError, RuntimeError) as e:
            log.warning("%s: bandwidth probe at step %d failed: %s", self.worker, step, e)
            return
        for j, receiver in enumerate(members):
            for i, sender in enumerate(members):
                if i != j:
                    self.rates[(sender, receiver)] = columns[j][i]

    def bandwidth(self, members: list[str]) -> list[list[float]] | None:
        """Probed bytes/s between ``members`` (row: sender, in group rank order), if measured."""
        if len(members) < 3 or not all((a, b) in self.rates for a in members for b in members if a != b):
            return None
        return [[self.rates[(a, b)] if a != b else 0.0 for b in members] for a in members]

    def plan(self, members: list[str], attempt: int) -> dict | None:
        """This worker's own plan for an attempt (``plan.own_plan``; ``plan.settle_plan`` says what runs)."""
        probed = bool(self.cfg.bandwidth_probe_bytes) and len(members) >= 3
        nbytes = sum(p.numel() for p in self.outer.params)
        return own_plan(self.cfg.algorithm, self.bandwidth(members), nbytes, attempt, probed)

    def _settle(self, q: Quorum, a: int, members: list[str]) -> dict:
        own = self.plan(members, a)
        plan, refused = settle_plan(own, q.plan(a, own or fallback_plan(self.cfg.algorithm)), len(members),
                                    self.cfg.algorithm)
        if refused:
            log.warning("%s: step %d attempt %d: refused the decided plan (%s); running %s over %s",
                        self.worker, q.step, a, refused, plan["algorithm"], plan["order"])
        if plan["algorithm"] != self.last_algorithm:
            log.info("%s: step %d attempt %d: all-reduce %s over ring %s (estimated s: %s)", self.worker, q.step, a,
                     plan["algorithm"], plan["order"], plan["estimates"] or "unmeasured")
            self.last_algorithm = plan["algorithm"]
        return plan

    # ------------------------------------------------------------------ one attempt (its own thread)

    def _reduce(self, step: int, a: int, members: list[str]) -> Attempt:
        """Ready, plan, reduce and report one attempt; the vote is :meth:`finish`'s. The leader waits
        for the members and settles the plan, the worker's rings run it, the leader reports."""
        me, sib = self.worker, self.siblings
        q = Quorum(self.membership, me, step) if sib.leader else None
        setup: dict = {}
        if q is not None:
            policy = self.cfg.stragglers()
            tokens = self._report.tokens if self._contribute else 0
            # a pseudo-gradient whose phase was trained before a resume holds tokens nobody counted: a full phase's
            record = ready_record(tokens, self._report.inner_seconds) if tokens or not self._contribute else "1"
            window = self._window(q, policy, members) if policy is not None and a == 0 else None
            present, absent = q.ready(a, members, self._deadline(self.cfg.boundary_timeout), record, window)
            setup = {"present": present, "absent": absent, "plan": None, "scale": 1.0}
            if not absent:
                self.faults.before_allreduce(step, a, me)
                try:
                    setup["plan"] = self._settle(q, a, members)
                    if policy is not None:
                        weights = token_weights(self._records(q, a, members))
                        setup["scale"] = scale_of(weights, members.index(me))
                        self._report.weight = weights[members.index(me)]
                except StoreLost:
                    sib.share({"lost": True})
                    raise
        setup = sib.share(setup)
        if setup.get("lost"):
            raise StoreLost(f"{me}: the worker's leader lost the rendezvous")
        if setup["absent"]:
            return Attempt(step, a, members, present=setup["present"], absent=setup["absent"])
        t0 = time.perf_counter()
        out = Attempt(step, a, members, present=setup["present"], plan=setup["plan"])
        average = [g.clone() for g in self._pseudo]  # reduced in place; keep ours for a retry
        scale = float(setup["scale"])
        if scale != 1.0:  # token-weighted: the reduction's plain mean is then the weighted one
            for g in average:
                g.mul_(scale)
        flagged: list[str] | None = None
        blamed: list[str] | None = None
        try:
            if out.plan is None:
                raise AllReduceError("no plan")
            plan = out.plan
            # built only once every member is ready: a member that died before then cannot stall it
            group = self.group(step, a, members)
            self.faults.ring(step, a, me, sib.rank)
            # a ring of partial sums runs only where the config names it, with outlier_clip 0 (DilocoConfig)
            robust = self.cfg.outlier_clip if plan["algorithm"] in SCREENED else 0.0
            if self.feedback is not None:  # a gather: every contribution is seen as sent, so the clip applies
                stats = topk_all_reduce_mean(average, group, self.feedback, order=plan["order"],
                                             contribute=self._contribute and scale > 0, mac_key=self.mac_key(step, a),
                                             outlier_clip=self.cfg.outlier_clip,
                                             screen=Screen(self.cfg.outlier_clip_crowd, 0.0))
            else:
                stats = all_reduce_mean(average, group, order=plan["order"], contribute=self._contribute and scale > 0,
                                        algorithm=plan["algorithm"], clip_sigmas=tuple(self.cfg.clip_sigmas),
                                        codec=self.cfg.wire_codec, compression=self.cfg.compression,
                                        outlier_clip=robust,
                                        screen=Screen(self.cfg.outlier_clip_crowd, self.cfg.direction_screen),
                                        mac_key=self.mac_key(step, a))
            flagged = reported(stats.outliers, members)
            out.ok, out.average, out.stats = True, average, stats
        except Misbehaviour as e:
            log.warning("%s: all-reduce of step %d attempt %d: %s", me, step, a, e)
            blamed = [members[r] for r in e.blamed if r < len(members)]
        except (AllReduceError, CommError, dist.DistError, RuntimeError) as e:
            # RuntimeError: gloo's own, e.g. a group whose connection handshake someone who
            # reaches its ports broke (gloo's listeners are unauthenticated): the attempt fails
            log.warning("%s: all-reduce of step %d attempt %d failed: %s", me, step, a, e)
        rings = sib.gather({"ok": out.ok, "flagged": flagged, "blamed": blamed,
                            "bytes": out.stats.bytes_sent if out.stats else 0})
        if q is not None and rings is not None:
            out.worker_ok = all(r["ok"] for r in rings)
            out.worker_bytes = sum(int(r["bytes"]) for r in rings)
            blames = [r["blamed"] for r in rings if r["blamed"] is not None]
            if blames:  # an owner whose result a ring refused: the worker blames it
                q.report(a, blamed=sorted({w for b in blames for w in b}))
            elif out.worker_ok:
                q.report(a, flagged=sorted({w for r in rings for w in r["flagged"] or []}))
        out.seconds = time.perf_counter() - t0
        return out

    def _records(self, q: Quorum, a: int, members: list[str]) -> list[Ready | None]:
        """The ``READY`` records of ``members`` for attempt ``a``, read (None where unreadable)."""
        return [read_ready(raw) for raw in self.membership.get_present([READY(q.step, a, w) for w in members])]

    def _window(self, q: Quorum, policy: StragglerPolicy, members: list[str]) -> Window:
        """The first attempt's wait under the straggler policy (:class:`~intellect.diloco.stragglers.Window`)."""
        return Window(policy, len(members), lambda present: self._records(q, 0, present), q.close,
                      self.cfg.heartbeat_interval)

    def _begin(self, a: int, members: list[str]) -> Reduction:
        self._report.attempts += 1
        self._tries += 1
        step = self._step
        self._handle = Reduction(lambda: self._reduce(step, a, members), f"reduce-{self.worker}-{step}-{a}")
        return self._handle

    # ------------------------------------------------------------------ the interface

    def start(self, step: int, members: list[str], report: StepReport | None = None, contribute: bool = True,
              pseudo: list[torch.Tensor] | None = None) -> Reduction:
        """Begin outer step ``step``'s reduction among ``members`` (its first attempt) and return at once.
        ``report``: the step's report, whose attempts, all-reduce time, bytes and verdicts it fills;
        ``contribute`` False: relay and receive only (a worker catching up); ``pseudo``: the
        pseudo-gradient when the caller took it already (overlap), else the model's now. Collective over
        the worker's ranks (they contribute together or not at all)."""
        if self._in_flight:
            raise RuntimeError("start: the previous reduction is still in flight; finish it first")
        self._step, self._tries = step, 0
        self._report = report if report is not None else StepReport(step=step, worker=self.worker)
        pseudo = pseudo if pseudo is not None else self.outer.pseudo_gradient(self.model)
        self.faults.pseudo_gradient(step, self.worker, pseudo)
        self._contribute = self.siblings.all(contribute and all(bool(torch.isfinite(g).all()) for g in pseudo))
        if contribute and not self._contribute:
            log.warning("%s: non-finite pseudo-gradient at step %d; contributing nothing", self.worker, step)
        self._pseudo = pseudo
        self._in_flight = True
        return self._begin(0, members)

    @property
    def in_flight(self) -> int | None:
        """The step whose reduction was started and not yet finished, if any."""
        return self._step if self._in_flight else None

    def abandon(self) -> None:
        """Forget the step in flight (this worker was excluded from a later step while it reduced, or is
        leaving): nothing of it is applied, and this worker casts no vote on it (the others retry without
        it). Its thread is waited for, which its own timeouts bound, so no two reductions share the
        worker's connections."""
        if self._in_flight and self._handle is not None:
            try:
                self._handle.wait()
            except Exception as e:  # noqa: BLE001 - an abandoned attempt's failure is nobody's concern now
                log.info("%s: the abandoned reduction of step %d ended with %s", self.worker, self._step, e)
        self._in_flight = False
        if self.feedback is not None:
            self.feedback.discard()

    def take_late(self, step: int, relaying: bool) -> Late | None:
        """The late pseudo-gradient to merge into ``step``, given once: when this worker only relays the step
        (it catches up) and the pseudo-gradient is at most :data:`MAX_LATE_STEPS` old. Not overlapped (the
        step in flight went with it), nor with ``compression = "topk"``, whose residual already carries what
        a step did not send."""
        late, self.late = self.late, None
        if late is None:
            return None
        if (not relaying or step - late.step > MAX_LATE_STEPS or self.feedback is not None
                or self.cfg.overlap != "none"):
            log.info("%s: dropping its late pseudo-gradient of step %d at step %d", self.worker, late.step, step)
            return None
        return late

    def feedback_after(self, contribute: bool = True, pseudo: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The error-feedback residual (``compression = "topk"``; None for the others) as the step about to
        start (or, overlapped, the one in flight: its ``pseudo``) leaves it once it commits: what the
        worker's state for the next checkpoint holds (``contribute`` False: a worker catching up keeps its
        residual)."""
        if self.feedback is None:
            return None
        if not contribute:
            return self.feedback.state_dict()["residual"]
        pseudo = pseudo if pseudo is not None else self.outer.pseudo_gradient(self.model)
        flat = torch.cat([g.reshape(-1) for g in pseudo])
        return self.feedback.state_dict_after(flat)["residual"]

    def feedback_in_flight(self) -> torch.Tensor | None:
        """:meth:`feedback_after` the step in flight (overlap): the residual once it commits."""
        return self.feedback_after(self._contribute, self._pseudo)

    def should_commit(self, ok: bool) -> bool:
        """Whether everyone commits the attempt in flight (the leader asks): ``ok``, the worker's result
        (every local rank's ring succeeded), then the quorum's vote and its one decision (any member's
        failure makes it False for all)."""
        assert self._handle is not None
        r = self._handle.wait()
        q = Quorum(self.membership, self.worker, r.step)
        deadline = self._deadline(self.cfg.collective_timeout + self.cfg.heartbeat_timeout)
        policy, watch = self.cfg.stragglers(), None
        if policy is not None and self.cfg.overlap != "none":
            # overlapped, a member votes on step t as its phase t+1 ends: the vote's wait is where the others
            # wait for a slow one, so it closes phase t+1 (and, needing every vote, cuts nobody off)
            watch = Window(policy, len(r.members), lambda voted: self._records(q, r.attempt, voted),
                           Quorum(self.membership, self.worker, r.step + 1).close, self.cfg.heartbeat_interval,
                           cut=False)
        return q.should_commit(r.attempt, ok, r.members, deadline, watch)

    def _direct(self, q: Quorum, r: Attempt, report: StepReport) -> dict:
        """The leader's decision on attempt ``r``, as its siblings act on it: commit, retry (members,
        attempt), excluded or out of attempts (why)."""
        try:
            if r.absent:
                members, a = self._next_attempt(q, r.attempt, r.present)
            else:
                report.allreduce_seconds += r.seconds
                if self.should_commit(r.worker_ok):
                    return {"do": "commit"}
                blamed = majority_flagged(q.reports(BLAME, r.attempt, r.members), r.members)
                self._ban(self.strikes.add(blamed), q.step, r.attempt)  # strikes for a majority's blame, out of the retry
                survivors = [w for w in q.voted(r.attempt, r.members) if self.membership.alive(w) and w not in blamed]
                members, a = self._next_attempt(q, r.attempt, survivors)
        except Excluded as e:
            # too late for the step (the others went on without us): our pseudo-gradient may count later
            return {"do": "excluded", "why": str(e), "late": self.worker in r.absent}
        if self._tries >= self.cfg.max_attempts:
            return {"do": "timeout", "why": f"outer step {q.step} did not commit in {self.cfg.max_attempts} attempts"}
        return {"do": "retry", "members": members, "attempt": a}

    def finish(self) -> list[str]:
        """Wait for the reduction; commit (the outer step, into ``theta_sync`` and the model) or roll back
        and retry with the survivors. Returns the committed attempt's members; raises :class:`Excluded`
        when a retry leaves this worker out and ``MembershipTimeout`` when the attempts run out, with
        the outer state and the model as :meth:`start` found them. Collective over the worker's ranks:
        the leader decides, every rank acts on its decision."""
        assert self._handle is not None, "finish without start"
        report, sib = self._report, self.siblings
        q = Quorum(self.membership, self.worker, self._step) if sib.leader else None
        while True:
            r = self._handle.wait()
            do = sib.share(self._direct(q, r, report) if q is not None else None)
            if do["do"] != "retry":
                self._in_flight = False
            if do["do"] == "commit":
                if r.stats is None or r.average is None:  # the worker voted ok: every ring succeeded
                    raise RuntimeError(f"{self.worker}: committing step {r.step} without this rank's average")
                self._commit(r, report)
                if q is not None:
                    self._judge(q, r.attempt, r.members, report, [r.members[i] for i in r.stats.contributors])
                return r.members
            if do["do"] == "excluded":
                if do.get("late") and self._contribute and self.cfg.stragglers() is not None:
                    self.late = Late(self._step, self._pseudo, self._report.tokens, self._report.inner_seconds)
                raise Excluded(do["why"])
            if do["do"] == "timeout":
                raise MembershipTimeout(do["why"])
            self._begin(int(do["attempt"]), list(do["members"]))

    def apply(self) -> None:
        """Bring the committed ``theta_sync`` into the model for the next inner phase."""
        self.outer.load_into(self.model)

    # ------------------------------------------------------------------ after the vote

    def _commit(self, r: Attempt, report: StepReport) -> None:
        assert r.stats is not None and r.average is not None and r.plan is not None
        if self.before_step is not None:
            self.before_step()  # a worker catching up takes the state the step started from
        if self.feedback is not None:
            self.feedback.commit()  # what this attempt sent leaves the residual only now that it counts
        if r.stats.contributors:
            self.outer.step(r.average)
        if self.cfg.overlap == "none":
            self.apply()  # overlapped, the worker is training the model: it loads the next start itself
        digest = self.digest()
        if self.siblings.leader:
            report.members, report.contributors = r.members, len(r.stats.contributors)
            report.bytes_sent += r.worker_bytes
            report.algorithm, report.estimates = r.stats.algorithm, r.plan["estimates"]
            report.committed, report.digest = True, digest
            self.membership.set(DIGEST(r.step, self.worker), digest)

    def digest(self) -> str:
        """SHA-256 of the worker's whole ``theta_sync`` (collective over its ranks when sharded): equal
        on every member after a commit, and equal for any number of ranks per worker."""
        full = getattr(self.outer, "full_digest", None)
        return full() if full is not None else self.outer.digest()

    def newcomers(self, workers: list[str]) -> None:
        """``workers`` were onboarded at this boundary: their first :data:`JOIN_GRACE` contributions are
        not struck (a fresh inner AdamW's first steps move further than the members' warm ones: clipped
        and left out when they stand out, as any flagged contribution, but no step toward a ban)."""
        for w in workers:
            self.grace[w] = JOIN_GRACE

    def _judge(self, q: Quorum, a: int, members: list[str], report: StepReport,
               contributors: list[str] | None = None) -> None:
        """Strike the members a majority reported in this committed attempt (newcomers in their grace
        excepted); ban the repeat offenders."""
        report.flagged = majority_flagged(q.reports(FLAGS, a, members), members)
        report.banned = self.strikes.add([w for w in report.flagged if not self.grace.get(w)])
        for w in contributors or []:
            if self.grace.get(w):
                self.grace[w] -= 1
        self._ban(report.banned, q.step, a)
        if report.flagged:
            log.warning("%s: step %d: outlier contributions from %s", self.worker, q.step, report.flagged)

    def _ban(self, workers: list[str], t: int, a: int) -> None:
        """Record our ban of ``workers``; it takes effect once a majority of attempt ``a``'s members record it."""
        for w in workers:
            log.warning("%s: banning %s: outlying contributions in %d steps", self.worker, w, self.cfg.exclude_after)
            self.banned_here.add(w)
            self.membership.set(BAN(w, self.worker), ban_record(t, a))

    def _next_attempt(self, q: Quorum, a: int, candidates: list[str]) -> tuple[list[str], int]:
        members = q.propose_members(a + 1, candidates)
        if self.worker not in members:
            raise Excluded(f"{self.worker} was left out of step {q.step} attempt {a + 1}")
        return members, a + 1


__all__ = ["JOIN_GRACE", "MAX_LATE_STEPS", "Attempt", "Excluded", "Late", "Reduction", "Synchronizer"]
