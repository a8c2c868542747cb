"""A long-lived DiLoCo worker: inner AdamW phases, int8 all-reduce, elastic commits.

One outer step ``t`` (:meth:`DilocoWorker.outer_step`) is four phases:

1. :meth:`DilocoWorker.boundary` agrees on the members of step ``t`` (the previous members that
   arrived plus any joiner) and onboards whoever is behind (:mod:`~intellect.diloco.onboarding`).
2. :meth:`DilocoWorker.inner` runs H AdamW steps on the worker's data shard, on the configured
   device and precision (``run.compute``); the inner optimizer state stays resident across outer
   steps. With a text corpus (``data.kind = "text"``) the shard is member ``i`` of the ``n``
   members of the step (:class:`~intellect.data.text.PackedStream`, resharded whenever the
   membership changes), so live workers read disjoint documents.
3. The :class:`~intellect.diloco.sync.Synchronizer` all-reduces the pseudo-gradient in int8 with fp32
   accumulation (``start``, a handle), votes and commits only when every member succeeded
   (``finish``, ``should_commit``); otherwise everyone discards and retries with the survivors
   (Decoupled DiLoCo: the average is over the contributors; a non-finite pseudo-gradient
   contributes nothing). :meth:`DilocoWorker.commit` then records the committed step.
4. :meth:`DilocoWorker.checkpoint` publishes the synced model and the outer state (the first member by
   admission order, every N steps).

Overlap (``diloco.overlap`` delayed or eager): the reduction of step ``t`` runs through inner phase ``t+1``
and the next boundary (:mod:`~intellect.diloco.overlap`).

Trust. A worker holds its own rendezvous key and the all-reduce root, never the run secret
(``coordinator.worker_credentials``), and writes only what ``membership.scope`` allows. Every
all-reduce message is sealed with ``derive_key(root, "allreduce", run, step, attempt)``, so a
forged or altered one fails the attempt like a garbled one; with 3+ contributors each owner
aggregates its chunk with a centred clip and screens and reports outliers (``robust.py``), under
a plan each member computes itself (``plan.settle_plan``: no peer can pick an unscreened one); a
worker that a majority reports in ``diloco.exclude_after`` committed steps is banned once a
majority of an attempt's members record ``BAN(w, me)``.

Invariant after every commit: all members hold bit-identical ``theta_sync`` (their SHA-256 is
written to ``DIGEST(t, w)``; a worker whose digest is not the majority's leaves to be onboarded again).

Devices. Whatever the inner device and precision, ``theta_sync``, the pseudo-gradients and the outer
momentum are fp32 on the CPU (:class:`~intellect.diloco.outer.OuterState`), so the collectives run on
gloo (:meth:`~intellect.diloco.sync.Synchronizer.group`), and checkpoints are fp32 CPU weights. Each
committed step's :class:`StepReport` (compute utilization, tokens/s, MFU among its fields) goes to the
rendezvous (``METRICS``) and as one row to the worker's series in run storage (:func:`metrics_series`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from functools import partial
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from intellect.checkpoints import CHECKPOINTS, fetch
from intellect.config import TrainConfig
from intellect.data.text import PackedStream
from intellect.device import local_rank, prepare_model, resolve_device
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco import worker_state
from intellect.diloco.data import (align_to_members, data_sketch, publish_position, rows_of, sketched_batches,
                                   worker_stream)
from intellect.diloco.faults import NO_FAULTS, Faults
from intellect.diloco.membership import Membership, StoreLost, connect_store
from intellect.diloco.mesh import WorkerMesh
from intellect.diloco.outer_shard import ShardedOuterState, consolidated
from intellect.diloco.outer import OuterState, host_model, load_outer_state, publish_outer_checkpoint
from intellect.diloco.report import Phase, StepReport, WorkerLog
from intellect.diloco.protocol import AHEAD, ARRIVE, CLOSE, COMMITTED, LAUNCHED, LEFT, METRICS, PROGRESS, Quorum
from intellect.diloco.rendezvous import allreduce_root, peer_key
from intellect.diloco.siblings import ALONE, Siblings
from intellect.diloco.sync import Excluded, Synchronizer
from intellect.diloco.onboarding import Onboarding, Transfer
from intellect.diloco.overlap import Overlap
from intellect.diloco.worker_ranks import WorkerRanks
from intellect.metrics import Peak, flops_per_token
from intellect.parallel import parallelize
from intellect.storage import RunStorage
from intellect.train import Trainer

log = logging.getLogger("intellect.diloco")


T = TypeVar("T")
PHASES = ("boundary", "inner", "reduce", "commit", "checkpoint")  # an outer step's phases, in order


def _directly(name: str, fn: Callable[[], T]) -> T:  # noqa: ARG001 - the phase's name is for flows that show it
    return fn()


class Banned(RuntimeError):
    """This worker was banned from the run for its outlying contributions; it stops."""


def inner_train_config(run: DilocoRunConfig) -> TrainConfig:
    # one schedule across the whole run, not one per outer step
    return run.train.model_copy(update={"steps": run.diloco.outer_steps * run.diloco.inner_steps})


class DilocoWorker(Onboarding, Overlap):
    def __init__(self, run: DilocoRunConfig, worker: str, index: int, store_host: str, store_port: int,
                 secret: bytes | None = None, *, key: bytes | None = None, allreduce_key: bytes | None = None,
                 faults: Faults = NO_FAULTS, ranks: WorkerRanks | None = None):
        """``key`` (this worker's rendezvous key) and ``allreduce_key`` (the all-reduce root) are
        what a worker holds; ``secret``, the run secret, derives both where they are not given.
        ``ranks``: this process's place in a worker of several ranks (None: the worker is one)."""
        self.run, self.cfg, self.worker, self.index, self.faults = run, run.diloco, worker, index, faults
        self.ranks = ranks
        rank, size = (ranks.rank, ranks.size) if ranks is not None else (0, 1)
        self.leader = rank == 0
        # train.threads 0: the machine's cores split among the run's processes; at torch's default
        # (all cores each), co-located workers spin on each other's threads
        torch.set_num_threads(run.train.threads or max(1, (os.cpu_count() or 1) // (run.diloco.workers * size)))
        self.storage = RunStorage.from_config(run.storage, run.run_name)
        if key is None or allreduce_key is None:
            if secret is None:
                raise ValueError("a worker needs its credentials (key, allreduce_key) or the run secret")
            key = key if key is not None else peer_key(secret, run.run_name, worker)
            allreduce_key = allreduce_key if allreduce_key is not None else allreduce_root(secret, run.run_name)
        store_timeout = max(30.0, self.cfg.heartbeat_timeout)
        if self.leader:
            self.m: Membership | None = Membership(
                store_host, store_port, worker, None, run.run_name, self.cfg.heartbeat_interval,
                self.cfg.heartbeat_timeout, store_timeout=store_timeout, startup_grace=self.cfg.boundary_timeout, key=key)
            store = self.m.store
        else:  # a follower speaks only for its rings' gloo groups
            self.m, store = None, connect_store(store_host, store_port, store_timeout, None, run.run_name, worker, key=key)
        self.store = store
        self.siblings = self._siblings("worker")
        n = self.siblings.share(self.storage.latest_step(CHECKPOINTS) if self.leader else None)
        if n is None:
            raise FileNotFoundError(f"run {self.storage.url} has no outer checkpoint; the coordinator publishes step 0")
        # the GPU of this process's local rank (the coordinator sets LOCAL_RANK for the workers it starts)
        self.device = resolve_device(run.compute.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # what torch allocates on without naming a device
        self.model, self.tok = fetch(self.storage, n)
        self.mesh = None
        if ranks is not None and ranks.size > 1:
            # fp32 weights sharded over the worker's ranks, theta_sync per shard (never cast before sharding)
            self.mesh = WorkerMesh.create(self.device, rank, size, store=ranks.store, timeout=self.cfg.boundary_timeout)
            parallelize(self.model, self.mesh.fsdp_mesh, run.compute)
            self.outer: OuterState = ShardedOuterState(self.model, self.cfg.outer_lr, self.cfg.outer_momentum,
                                                       self.cfg.nesterov, device=self.device)
            load_outer_state(self.storage, n, self.outer)
        else:
            # theta_sync from the fp32 checkpoint, before the model is cast to the inner precision
            self.outer = OuterState(self.model, self.cfg.outer_lr, self.cfg.outer_momentum, self.cfg.nesterov,
                                    device=self.device)
            load_outer_state(self.storage, n, self.outer)
            prepare_model(self.model, run.compute, self.device)
        self.sync = Synchronizer(self.m, self.model, self.outer, self.cfg, run.run_name, allreduce_key, faults,
                                 self._siblings("sync"), worker=worker, store=store)
        log.info("%s: device %s (local rank %d, rank %d of %d in the worker), precision %s", worker, self.device,
                 local_rank(), rank, size, run.compute.precision)
        self._host: torch.nn.Module | None = None  # the fp32 CPU model checkpoints are published from
        self.committed: int = n  # outer steps committed into theta_sync
        self.step: int = n  # the outer step being worked on (0-based): step t produces checkpoint t+1
        self.trainer = Trainer(self.model, self.tok, inner_train_config(run), compute=run.compute)
        self.trainer.step = n * self.cfg.inner_steps
        # this worker's inner AdamW state and data position at checkpoint n, when it saved them
        group = self.mesh.intra if self.mesh is not None else None
        saved, why = worker_state.restore_any(self.storage, worker, n, self.trainer, self.outer, group,
                                              self.sync.feedback) if n else (None, "")
        # overlap: its own pseudo-gradient of the step in flight at checkpoint n, reduced again at once
        self.resumed_in_flight = self._in_flight_of(saved, n)
        if saved is not None:
            # the run's schedule, if the state is older (past the phase in flight when it resumes that)
            self.trainer.step = (n + (self.resumed_in_flight is not None)) * self.cfg.inner_steps
            log.info("%s: resuming with its inner state and data position of checkpoint %d%s", worker, saved.step,
                     " and its pseudo-gradient of step %d in flight" % n if self.resumed_in_flight else "")
        elif n:
            log.warning("%s: %s for checkpoint %d: a fresh inner AdamW, its shard read from the start",
                        worker, why, n)
        self.text = run.data.kind == "text"
        # arithmetic: worker index's own seeded stream; text: the whole corpus until the first boundary
        # gives this worker its place among the members, and so its shard
        self.stream = worker_stream(run, self.tok, index, saved.data if saved else None)
        self.shard: tuple[int, int] = (0, 1) if self.text else (index, run.diloco.workers)
        # (the boundary, its members) this data position is current at: at any other it is realigned
        self.data_at: tuple[int, list[str]] = (saved.step, saved.members) if saved else (0, [])
        self.rows_per_step = saved.rows_per_step if saved else 0  # the reader's pace in its last inner phase
        # its series and progress lines (the leader's)
        self.metrics_log: WorkerLog | None = WorkerLog(self.storage, run, worker, n) if self.leader else None
        self.flops_per_token = flops_per_token(self.model.config, self.seq_len())
        self.peak = Peak.of(self.device, run.compute.precision, run.compute.peak_tflops)
        self._started = time.perf_counter()  # the current outer step's start (boundary)
        self.members: list[str] = []
        self.prev_members: list[str] = []
        self.catching_up: Transfer | None = None  # non-blocking onboarding: the state on its way here
        self.in_flight_report: StepReport | None = None  # overlap: the report of the step being reduced
        self.step_joiners: list[str] = []  # members of this step who catch up (they contribute nothing)
        self.caught_up_in_flight = False  # overlap: caught up into the step now in flight
        if self.m is not None:
            self.m.start_heartbeat()

    def _in_flight_of(self, saved: worker_state.WorkerState | None, n: int) -> list[torch.Tensor] | None:
        """The pseudo-gradient in flight ``saved`` with checkpoint ``n``, shaped as ``theta_sync``, when this
        run overlaps and it fits (else None: the phase it came from is lost, and the log says so)."""
        flat = saved.in_flight if saved is not None else None
        if flat is None or saved is None:
            return None
        sizes = [p.numel() for p in self.outer.params]
        if self.cfg.overlap == "none" or saved.step != n or flat.numel() != sum(sizes):
            log.warning("%s: not resuming the step in flight saved with checkpoint %d (overlap %s, resuming at %d)",
                        self.worker, saved.step, self.cfg.overlap, n)
            return None
        return [c.view_as(p).clone() for c, p in zip(flat.to(torch.float32).split(sizes), self.outer.params)]

    def _siblings(self, name: str) -> Siblings:
        """A control group of the worker's ranks (:mod:`~intellect.diloco.siblings`), bounded by the
        longest the leader may legitimately keep its followers waiting (a joiner's boundary)."""
        if self.ranks is None or self.ranks.size == 1:
            return ALONE
        bound = self.cfg.boundary_timeout * 10 + self.cfg.max_attempts * (
            self.cfg.boundary_timeout + self.cfg.collective_timeout + self.cfg.heartbeat_timeout) + 3600
        return Siblings.on(self.ranks.store, name, self.ranks.rank, self.ranks.size, timeout=bound)

    @property
    def membership(self) -> Membership:
        """The worker's membership: the leader's alone."""
        assert self.m is not None, "only the worker's leader talks to the rendezvous"
        return self.m

    # ------------------------------------------------------------------ helpers

    def admitted(self) -> list[str]:
        """Workers the coordinator has admitted so far (``LAUNCHED``), in admission order."""
        m = self.membership
        n = min(m.counter(LAUNCHED.under()), 1 << 16)  # the coordinator's own count
        return list(dict.fromkeys(m.get(LAUNCHED(i)) for i in range(n) if m.has(LAUNCHED(i))))

    def launched(self) -> list[str]:
        """:meth:`admitted`, banned ones left out."""
        names = self.admitted()
        return [w for w in names if w not in self.sync.banned_here and not self.membership.banned(w, names)]

    def seq_len(self) -> int:
        """Tokens per training sequence, for the attention FLOPs: the packed length of a corpus; for the
        short arithmetic problems the model's context, an upper bound."""
        if self.text:
            return self.run.data.text.seq_len
        return int(getattr(self.model.config, "max_position_embeddings", self.run.model.max_position_embeddings))

    def host(self) -> torch.nn.Module:
        """The fp32 CPU model checkpoints are published from (:func:`host_model`, made once; overlapped, never
        the training model itself, which holds the next phase's start and not ``theta_sync``)."""
        if self._host is None:
            self._host = host_model(self.model, own=self.cfg.overlap != "none")
        return self._host

    def claimed(self) -> int:
        """The outer steps this worker stands for at a boundary (its ``COMMITTED`` record): those committed,
        and the one in flight (overlap), which it commits with the members before it trains again."""
        return self.committed + (self.sync.in_flight is not None)

    def reshard(self, members: list[str]) -> dict | None:
        """Read shard ``i`` of ``n``, this worker's place among the step's members (text corpus), from the
        members' furthest position when its own is not current (:mod:`intellect.diloco.data`). Returns
        the new position when it moved (for the worker's other ranks), else None."""
        if not isinstance(self.stream, PackedStream):
            return None
        shard = (members.index(self.worker), len(members))
        moved = shard != self.shard or self.data_at != (self.step, members)
        if shard != self.shard:
            if self.data_at[1] and members != self.data_at[1]:
                log.info("%s: membership changed at step %d: reading shard %d of %d", self.worker, self.step, *shard)
            self.stream.reshard(*shard)
            self.shard = shard
        if self.data_at != (self.step, members):
            m = self.membership
            align_to_members(self.stream, lambda k: m.get(k).encode() if m.has(k) else None, self.step, members,
                             self.worker, max(0, self.step - self.data_at[0]), self.rows_per_step, self.data_at[1])
        return self.stream.state_dict() if moved else None

    def _deadline(self, seconds: float) -> float:
        return time.monotonic() + seconds

    # ------------------------------------------------------------------ phases

    def boundary(self) -> bool:
        """Agree on the members of the next step; onboard whoever is behind. True if we were.

        Founders (a fresh or resumed run: no progress in the store yet) wait for every
        launched worker; veterans wait for the previous step's members; anyone else is a
        joiner, which never proposes: it waits for the veterans' decision at the next
        undecided boundary and is onboarded there. The leader agrees for the worker and hands
        its followers the outcome (:meth:`_follow`).
        """
        if not self.leader:
            return self._follow(self.siblings.share())
        try:
            members = self._agree()
            position = self.reshard(members)
            onboard = self._onboarding(members)
        except Excluded as e:
            self.siblings.share({"excluded": str(e)})
            raise
        self.step_joiners = [members[j] for j in onboard["joiners"]] if onboard is not None else []
        if onboard is not None:
            self.sync.newcomers(self.step_joiners)
        self.siblings.share({"step": self.step, "members": members, "committed": self.committed,
                             "position": position, "shard": list(self.shard), "onboard": onboard})
        self.members = members
        behind = self._onboard(onboard)
        self.sync.probe(self.step, members)
        return behind

    def _follow(self, d: dict) -> bool:
        """A follower's boundary: the leader's decision (``d``), its data position, the onboarding."""
        if "excluded" in d:
            raise Excluded(d["excluded"])
        self.step, self.members, self.committed = int(d["step"]), list(d["members"]), int(d["committed"])
        onboard = d["onboard"]
        self.step_joiners = [self.members[j] for j in onboard["joiners"]] if onboard is not None else []
        if d["position"] is not None and isinstance(self.stream, PackedStream):
            shard = (int(d["shard"][0]), int(d["shard"][1]))
            if shard != self.shard:
                self.stream.reshard(*shard)
                self.shard = shard
            self.stream.load_state_dict(d["position"])
        return self._onboard(d["onboard"])

    def _agree(self) -> list[str]:
        """The leader's part of the boundary: the step's members (this worker among them)."""
        me, m = self.worker, self.membership
        if m.banned(me, self.admitted()):
            raise Banned(f"{me} was banned from the run for outlying contributions")
        founder = m.progress() is None and self.sync.in_flight is None  # (overlapped: none committed yet)
        # overlapped, a worker that caught up into the step in flight did not commit the one before: the
        # rendezvous lets only those who did propose, so it waits for the decision once
        veteran = me in self.prev_members and not self.caught_up_in_flight
        self.caught_up_in_flight = False
        if not (founder or veteran) and (p := m.progress()) is not None:
            # the first step whose members are undecided (overlapped, the members are a step past progress)
            self.step = next((t for t in range(p, p + AHEAD) if Quorum(m, me, t).members(0) is None), p + AHEAD)
        t = self.step
        q = Quorum(m, me, t)
        m.set(COMMITTED(t, me), str(self.claimed()))
        if isinstance(self.stream, PackedStream):  # before arriving: a member's claim is there when it is
            publish_position(m.set, t, me, self.stream, self.rows_per_step)
        m.set(ARRIVE(t, me), "1")
        members = q.members(0)
        if members is None and (founder or veteran):
            # veterans block for newcomers still starting up, as INTELLECT-1's onboarding does;
            # a newcomer that never comes up is dropped after its startup grace
            launched = self.launched()
            # non-blocking onboarding: veterans never wait for a newcomer, who is in once it has arrived
            # nor (diloco.quorum < 1) for a member the last step left out as too late: it rejoins when it can
            late = set(Quorum(m, me, t - 1).members(0) or []) if self.cfg.quorum < 1 and t > 0 else set()
            newcomers = [] if self.cfg.onboarding == "non_blocking" else [
                w for w in launched if w not in self.prev_members and w not in late and not m.has(LEFT(t, w))]
            expected = launched if founder else [w for w in self.prev_members if w in launched] + newcomers
            # until a peer decided the members: one that never saw a newcomer this one waits for
            # proposes without it, and the decision is final
            m.wait_for_keys(ARRIVE.under(t), [w for w in expected if w != me],
                            self._deadline(self.cfg.boundary_timeout), step=t, until=lambda: q.members(0) is not None)
            arrived = [w for w in self.launched() if m.has(ARRIVE(t, w)) and m.alive(w)]
            members = q.propose_members(0, arrived)
        elif members is None:
            m.wait_until(lambda: q.members(0) is not None, self._deadline(self.cfg.boundary_timeout * 10),
                         f"the members of step {t}")
            members = q.members(0) or []
        if me not in members:
            raise Excluded(f"{me} arrived after the members of step {t} were decided")
        return members

    def batches(self, seen: list[str]) -> Iterator:
        """This rank's rows of the worker's training batches; ``seen`` keeps the :func:`data_sketch` of
        the worker's sequences. Every rank reads the worker's whole batch and trains on its slice, so a
        worker of M ranks takes the step a worker of one would (FSDP averages the ranks' gradients)."""
        size = self.ranks.size if self.ranks is not None else 1
        rank = self.ranks.rank if self.ranks is not None else 0
        for batch in sketched_batches(self.stream, self.run.train.batch_size, seen):
            yield batch if size == 1 else rows_of(batch, rank, size)

    def inner(self, report: StepReport) -> None:
        """H inner steps: the report's inner_loss, inner_seconds, tokens, shard and data_sketch. A worker
        catching up (non-blocking onboarding) has no weights to train yet, and one that resumed a step in
        flight (overlap) trained its phase before the run stopped: they skip it."""
        if self.catching_up is not None or self.resumed_in_flight is not None:
            if self.resumed_in_flight is not None:  # trained before the run stopped: its reduction resumes
                self.data_at = (self.step + 1, list(self.members))
                self._claim_position()
            report.shard = list(self.shard)
            return
        t0 = time.perf_counter()
        seen: list[str] = []
        rows = getattr(self.stream, "passed", 0)
        on_step = self.metrics_log.on_inner_step(self.membership.check_store) if self.metrics_log is not None else None
        stop = self._closed() if self.cfg.stragglers() is not None else None
        try:
            logs = self.trainer.train_steps(self.cfg.inner_steps, self.batches(seen), on_step, stop)
        finally:
            if self.m is not None and stop is not None:
                self.m.watch(None)
        report.inner_seconds = time.perf_counter() - t0
        report.inner_steps = len(logs)
        if len(logs) < self.cfg.inner_steps:  # the others closed the phase: the run's schedule goes on
            log.info("%s: the members closed phase %d after %d of %d inner steps", self.worker, self.step, len(logs),
                     self.cfg.inner_steps)
            self.trainer.step = (self.step + 1) * self.cfg.inner_steps
        self.rows_per_step = getattr(self.stream, "passed", 0) - rows
        self.data_at = (self.step + 1, list(self.members))
        self._claim_position()
        # the worker's figures: every rank's tokens, the ranks' mean loss (equal token counts per rank)
        loss, tokens = self.siblings.sum([sum(rec["loss"] for rec in logs) / len(logs),
                                          sum(rec["tokens"] for rec in logs)])
        report.inner_loss = loss / self.siblings.size
        report.tokens = int(tokens)
        peak = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else 0.0
        report.device_memory_mb = max(self.siblings.gather(peak) or [peak])
        report.shard, report.data_sketch = list(self.shard), data_sketch(seen)

    def _closed(self) -> Callable[[], bool]:
        """Whether the members closed the inner phase of this step (``CLOSE``, :mod:`~intellect.diloco.stragglers`):
        the leader's heartbeat looks for it; a worker of several ranks agrees on it at every inner step, so
        they all stop after the same one."""
        policy = self.cfg.stragglers()
        if self.m is not None and policy is not None:
            self.m.watch(CLOSE(self.step), policy.poll(self.cfg.heartbeat_interval))
        if self.mesh is None:
            return lambda: self.m is not None and self.m.watched()
        intra = self.mesh.intra

        def agreed() -> bool:
            flag = torch.tensor([1.0 if self.m is not None and self.m.watched() else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=intra)
            return bool(flag.item())

        return agreed

    def _claim_position(self) -> None:
        """Claim the data position for the next boundary as the inner phase ends, before the all-reduce:
        should this worker die before that boundary, the survivors taking over its shard still read on
        past what it read (:mod:`~intellect.diloco.data`)."""
        if self.m is not None and isinstance(self.stream, PackedStream):
            publish_position(self.m.set, self.step + 1, self.worker, self.stream, self.rows_per_step)

    def timing(self, report: StepReport) -> None:
        """The committed step's wall time and the utilization, throughput and MFU over it (MFU of the
        worker's devices together)."""
        wall = report.outer_seconds = time.perf_counter() - self._started
        report.compute_utilization = report.inner_seconds / wall if wall > 0 else 0.0
        report.tokens_per_s = report.tokens / wall if wall > 0 else 0.0
        report.mfu = self.peak.mfu(report.tokens_per_s / self.siblings.size, self.flops_per_token)

    def commit(self, members: list[str], report: StepReport) -> None:
        """Record the step the synchronizer committed among ``members``: the next boundary's veterans,
        the step's timing, and (its first member) the run's progress. Overlapped, the veterans are the
        members of the step just started (:meth:`overlapped_reduce`), and the committed step's timing was
        taken as its phase ended."""
        self.committed = report.step + 1
        if self.cfg.overlap == "none":
            self.prev_members, self.members = members, members
            self.timing(report)
        if self.leader and self.worker == members[0]:
            self.membership.set(PROGRESS(), json.dumps(self.committed))

    def checkpoint_step(self, n: int) -> bool:
        """Whether committing outer step ``n - 1`` publishes checkpoint ``n``."""
        return n % self.cfg.checkpoint_every == 0 or n == self.cfg.outer_steps

    def save_state(self, n: int | None = None, in_flight: list[torch.Tensor] | None = None) -> None:
        """Save this worker's inner state and data position for the checkpoint the step about to be reduced
        commits into (before the all-reduce: see :mod:`~intellect.diloco.worker_state`). Overlapped
        (:mod:`~intellect.diloco.overlap`): for checkpoint ``n``, which the step in flight commits into,
        with the inner state after phase ``n`` and its pseudo-gradient ``in_flight``, the step to start
        next, which a resumed run reduces again."""
        if n is None:
            n, fb = self.step + 1, self.sync.feedback_after(self.catching_up is None)
        else:
            fb = self.sync.feedback_in_flight()
        if not self.checkpoint_step(n):
            return
        flat = torch.cat([g.reshape(-1) for g in in_flight]) if in_flight is not None else None
        keep = self.run.storage.keep_last
        if self.mesh is None:
            state = worker_state.WorkerState(n, self.trainer.state_bytes(), self.stream.state_dict(),
                                             self.data_at[1], self.rows_per_step, fb, flat)
            worker_state.save(self.storage, self.worker, state, keep)
        else:  # every rank writes its shards of the AdamW state
            state = worker_state.WorkerState(n, b"", self.stream.state_dict(), self.data_at[1], self.rows_per_step, fb,
                                             flat)
            worker_state.save_sharded(self.storage, self.worker, state, self.trainer, self.outer, keep,
                                      self.mesh.intra, lambda: self.siblings.all(True))

    def checkpoint(self) -> str | None:
        """Publish outer checkpoint :attr:`committed` (the step's first member, every N steps); a
        sharded worker's ranks gather ``theta_sync`` and the momentum for its leader to write."""
        n = self.committed
        if self.worker != self.members[0] or not self.checkpoint_step(n):
            return None
        outer: OuterState | None = self.outer
        if isinstance(self.outer, ShardedOuterState):
            outer = consolidated(self.outer, self.host() if self.leader else None)
            if outer is None:
                return None
        uri = publish_outer_checkpoint(self.storage, n, self.host(), self.tok, outer, self.members)
        self.storage.retain(CHECKPOINTS, self.run.storage.keep_last)
        return uri

    # ------------------------------------------------------------------ driver

    def begin(self) -> StepReport:
        """Open outer step :attr:`step`: its report, and the clock its timing runs on."""
        self._started = time.perf_counter()
        return StepReport(step=self.step, worker=self.worker)

    def enter(self, report: StepReport) -> None:
        """The boundary phase: the step's members, onboarding, the report's step (a joiner's may move)."""
        report.onboarded = self.boundary()
        report.step = self.step

    def reduce(self, report: StepReport) -> list[str]:
        """The reduce phase: save this worker's state for the checkpoint, then the synchronizer's
        start and finish; the committed attempt's members."""
        self.save_state()
        late = self.sync.take_late(self.step, relaying=self.catching_up is not None)
        if late is not None:  # relaying while it catches up: its pseudo-gradient the others did not wait for
            log.info("%s: merging its pseudo-gradient of step %d (%d tokens) into step %d", self.worker, late.step,
                     late.tokens, self.step)
            report.tokens, report.inner_seconds, report.late_step = late.tokens, late.seconds, late.step
        self.sync.start(self.step, self.members, report, contribute=self.catching_up is None or late is not None,
                        pseudo=late.pseudo if late is not None else None)
        return self.sync.finish()

    def abandon(self, e: Excluded) -> None:
        """Leave a step this worker was excluded from: drop the local progress, rejoin and catch up later."""
        log.warning("%s", e)
        if self.m is not None:
            self.m.leave(self.step)
        self.catching_up, self.catching_up_from, self.sync.before_step = None, None, None
        self.send_after_commit, self.in_flight_report, self.outer.base = None, None, None
        self.sync.abandon()  # overlap: the step in flight too (nothing of it was applied)
        self.outer.load_into(self.model)
        self.prev_members = []
        time.sleep(self.cfg.heartbeat_interval)  # the others are mid-step: no point in spinning

    def end(self, report: StepReport, advance: bool = True) -> None:
        """Close a committed step: the next step's number (``advance``), the report to the rendezvous and the
        series."""
        if advance:
            self.step = self.committed
        if self.m is not None and self.metrics_log is not None:
            self.m.set(METRICS(report.step, self.worker), json.dumps(asdict(report)))
            self.metrics_log.log(report.step, asdict(report))

    def outer_step(self, phase: Phase | None = None, report: StepReport | None = None) -> StepReport:
        """One whole outer step, its :data:`PHASES` in order, each run through ``phase(name, fn)`` (default:
        ``fn()``; a flow passes one that shows each as a task); an excluded worker runs ``abandon``
        instead of the rest and reports an uncommitted step, with the reason (``report.excluded``)."""
        run: Phase = phase or _directly
        report = report or self.begin()
        if self.cfg.overlap != "none":
            return self._overlapped_step(run, report)
        try:
            run("boundary", lambda: self.enter(report))
            run("inner", lambda: self.inner(report))
            members = run("reduce", lambda: self.reduce(report))
            run("commit", lambda: self.commit(members, report))
            run("checkpoint", self.checkpoint)
        except Excluded as e:
            report.excluded = str(e)
            run("abandon", partial(self.abandon, e))
        else:
            self.end(report)
        return report

    def run_until_done(self, observe: Callable[[StepReport], None] | None = None,
                       drive: Callable[[DilocoWorker], StepReport] | None = None) -> None:
        """Outer steps until the run is done; ``observe`` sees each step's report once it is over;
        ``drive`` runs one outer step (default :meth:`outer_step`; a flow passes one that runs each
        phase as a task of its own)."""
        while not self.done():
            r = (drive or DilocoWorker.outer_step)(self)
            if not self.leader:
                continue  # the leader reports for the worker
            log.info("step %d committed=%s members=%s loss=%.4f bytes=%d algorithm=%s digest=%s",
                     r.step, r.committed, r.members, r.inner_loss, r.bytes_sent, r.algorithm, r.digest[:12])
            if observe is not None:
                observe(r)

    def done(self) -> bool:
        """Our own steps are done, or (a late joiner) the others finished the run (the leader's word)."""
        return bool(self.siblings.share(
            self.committed >= self.cfg.outer_steps or (self.membership.progress() or 0) >= self.cfg.outer_steps
            if self.leader else None))

    def close(self, clean: bool = True, finished: bool = True) -> None:
        """Leave: the deathrattle when ``clean``; the worker's FSDP group is torn down only when it
        ``finished`` (after a sibling's death its teardown would wait on the dead rank)."""
        if self.m is not None:
            if clean:
                self.m.deathrattle()
            self.m.close()
        if self.metrics_log is not None:
            self.metrics_log.close()
        if self.mesh is not None and finished:
            self.mesh.close()


__all__ = ["PHASES", "Banned", "DilocoWorker", "Phase", "StoreLost", "inner_train_config"]
