"""A long-lived DiLoCo worker: inner AdamW phases, int8 all-reduce, elastic commits.

One outer step ``t`` (:meth:`DilocoWorker.outer_step`) is four phases:

1. :meth:`DilocoWorker.boundary` agrees on the members of step ``t`` (the previous members that
   arrived plus any joiner), and, when someone is behind (a joiner, a worker that was excluded),
   broadcasts ``theta_sync``, the outer momentum and the step counter from the most advanced
   member: onboarding blocks at the boundary, as INTELLECT-1 chose.
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
4. :meth:`DilocoWorker.checkpoint` publishes the synced model and the outer state to run storage
   (the first member by admission order does it, every N steps).

Trust. A worker holds its own rendezvous key and the all-reduce root, never the run secret
(``coordinator.worker_credentials``), and writes only what ``membership.scope`` allows. Every
all-reduce message is sealed with ``derive_key(root, "allreduce", run, step, attempt)``, so a
forged or altered one fails the attempt like a garbled one; with 3+ contributors each owner
aggregates its chunk with a centred clip and screens and reports outliers (``robust.py``), under
a plan each member computes itself (``plan.settle_plan``: no peer can pick an unscreened one); a
worker that a majority reports in ``diloco.exclude_after`` committed steps is banned once a
majority of an attempt's members record ``BAN(w, me)``.

Invariant after every commit: all members hold bit-identical ``theta_sync`` (their SHA-256 is
written to ``DIGEST(t, w)`` for anyone to compare).

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
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from intellect.checkpoints import CHECKPOINTS, fetch
from intellect.config import TrainConfig
from intellect.data.text import PackedStream
from intellect.device import local_rank, prepare_model, resolve_device
from intellect.diloco.config import DilocoRunConfig
from intellect.diloco import worker_state
from intellect.diloco.data import align_to_members, data_sketch, position_claim, sketched_batches, worker_stream
from intellect.diloco.faults import NO_FAULTS, Faults
from intellect.diloco.membership import Membership, StoreLost
from intellect.diloco.outer import OuterState, host_model, load_outer_state, publish_outer_checkpoint
from intellect.diloco.report import StepReport, WorkerLog
from intellect.diloco.protocol import ARRIVE, COMMITTED, DATA_AT, LAUNCHED, LEFT, METRICS, PROGRESS, Quorum, read_count
from intellect.diloco.rendezvous import allreduce_root, peer_key
from intellect.diloco.sync import Excluded, Synchronizer
from intellect.diloco.transport import CommError
from intellect.metrics import Peak, flops_per_token
from intellect.storage import RunStorage
from intellect.train import Trainer

log = logging.getLogger("intellect.diloco")


class Banned(RuntimeError):
    """This worker was banned from the run for its outlying contributions; it stops."""


def inner_train_config(run: DilocoRunConfig) -> TrainConfig:
    # one schedule across the whole run, not one per outer step
    return run.train.model_copy(update={"steps": run.diloco.outer_steps * run.diloco.inner_steps})


class DilocoWorker:
    def __init__(self, run: DilocoRunConfig, worker: str, index: int, store_host: str, store_port: int,
                 secret: bytes | None = None, *, key: bytes | None = None, allreduce_key: bytes | None = None,
                 faults: Faults = NO_FAULTS):
        """``key`` (this worker's rendezvous key) and ``allreduce_key`` (the all-reduce root) are
        what a worker holds; ``secret``, the run secret, derives both where they are not given."""
        self.run, self.cfg, self.worker, self.index, self.faults = run, run.diloco, worker, index, faults
        # train.threads 0: the machine's cores split among the run's workers; at torch's default
        # (all cores each), co-located workers spin on each other's threads
        torch.set_num_threads(run.train.threads or max(1, (os.cpu_count() or 1) // run.diloco.workers))
        self.storage = RunStorage.from_config(run.storage, run.run_name)
        if key is None or allreduce_key is None:
            if secret is None:
                raise ValueError("a worker needs its credentials (key, allreduce_key) or the run secret")
            key = key if key is not None else peer_key(secret, run.run_name, worker)
            allreduce_key = allreduce_key if allreduce_key is not None else allreduce_root(secret, run.run_name)
        self.m = Membership(store_host, store_port, worker, None, run.run_name, self.cfg.heartbeat_interval,
                            self.cfg.heartbeat_timeout, store_timeout=max(30.0, self.cfg.heartbeat_timeout),
                            startup_grace=self.cfg.boundary_timeout, key=key)
        n = self.storage.latest_step(CHECKPOINTS)
        if n is None:
            raise FileNotFoundError(f"run {self.storage.url} has no outer checkpoint; the coordinator publishes step 0")
        # the GPU of this process's local rank (the coordinator sets LOCAL_RANK for the workers it starts)
        self.device = resolve_device(run.compute.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # what torch allocates on without naming a device
        self.model, self.tok = fetch(self.storage, n)
        # theta_sync from the fp32 checkpoint, before the model is cast to the inner precision
        self.outer = OuterState(self.model, self.cfg.outer_lr, self.cfg.outer_momentum, self.cfg.nesterov,
                                device=self.device)
        load_outer_state(self.storage, n, self.outer)
        prepare_model(self.model, run.compute, self.device)
        self.sync = Synchronizer(self.m, self.model, self.outer, self.cfg, run.run_name, allreduce_key, faults)
        log.info("%s: device %s (local rank %d), precision %s", worker, self.device, local_rank(), run.compute.precision)
        self._host: torch.nn.Module | None = None  # the fp32 CPU model checkpoints are published from
        self.committed: int = n  # outer steps committed into theta_sync
        self.step: int = n  # the outer step being worked on (0-based): step t produces checkpoint t+1
        self.trainer = Trainer(self.model, self.tok, inner_train_config(run), compute=run.compute)
        self.trainer.step = n * self.cfg.inner_steps
        # this worker's inner AdamW state and data position at checkpoint n, when it saved them
        saved, why = worker_state.restore(self.storage, worker, n, self.trainer) if n else (None, "")
        if saved is not None:
            self.trainer.step = n * self.cfg.inner_steps  # the run's schedule, if the state is older
            log.info("%s: resuming with its inner state and data position of checkpoint %d", worker, saved.step)
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
        self.metrics_log = WorkerLog(self.storage, run, worker, n)  # its series and progress lines
        self.flops_per_token = flops_per_token(self.model.config, self.seq_len())
        self.peak = Peak.of(self.device, run.compute.precision, run.compute.peak_tflops)
        self._started = time.perf_counter()  # the current outer step's start (boundary)
        self.members: list[str] = []
        self.prev_members: list[str] = []
        self.m.start_heartbeat()

    # ------------------------------------------------------------------ helpers

    def admitted(self) -> list[str]:
        """Workers the coordinator has admitted so far (``LAUNCHED``), in admission order."""
        n = min(self.m.counter(LAUNCHED.under()), 1 << 16)  # the coordinator's own count
        return list(dict.fromkeys(self.m.get(LAUNCHED(i)) for i in range(n) if self.m.has(LAUNCHED(i))))

    def launched(self) -> list[str]:
        """:meth:`admitted`, banned ones left out."""
        names = self.admitted()
        return [w for w in names if w not in self.sync.banned_here and not self.m.banned(w, names)]

    def seq_len(self) -> int:
        """Tokens per training sequence, for the attention FLOPs: the packed length of a corpus; for the
        short arithmetic problems the model's context, an upper bound."""
        if self.text:
            return self.run.data.text.seq_len
        return int(getattr(self.model.config, "max_position_embeddings", self.run.model.max_position_embeddings))

    def host(self) -> torch.nn.Module:
        """The fp32 CPU model checkpoints are published from (:func:`host_model`, made once)."""
        if self._host is None:
            self._host = host_model(self.model)
        return self._host

    def reshard(self, members: list[str]) -> None:
        """Read shard ``i`` of ``n``, this worker's place among the step's members (text corpus), from the
        members' furthest position when its own is not current (:mod:`intellect.diloco.data`)."""
        if not isinstance(self.stream, PackedStream):
            return
        shard = (members.index(self.worker), len(members))
        if shard != self.shard:
            if self.data_at[1] and members != self.data_at[1]:
                log.info("%s: membership changed at step %d: reading shard %d of %d", self.worker, self.step, *shard)
            self.stream.reshard(*shard)
            self.shard = shard
        if self.data_at != (self.step, members):
            m = self.m
            align_to_members(self.stream, lambda k: m.get(k).encode() if m.has(k) else None, self.step, members,
                             self.worker, max(0, self.step - self.data_at[0]), self.rows_per_step)

    def _deadline(self, seconds: float) -> float:
        return time.monotonic() + seconds

    # ------------------------------------------------------------------ phases

    def boundary(self) -> bool:
        """Agree on the members of the next step; onboard whoever is behind. True if we were.

        Founders (a fresh or resumed run: no progress in the store yet) wait for every
        launched worker; veterans wait for the previous step's members; anyone else is a
        joiner, which never proposes: it waits for the veterans' decision at the next
        undecided boundary and is onboarded there.
        """
        me, m = self.worker, self.m
        if m.banned(me, self.admitted()):
            raise Banned(f"{me} was banned from the run for outlying contributions")
        founder = m.progress() is None
        veteran = me in self.prev_members
        if not (founder or veteran) and (p := m.progress()) is not None:
            self.step = p if Quorum(m, me, p).members(0) is None else p + 1
        t = self.step
        q = Quorum(m, me, t)
        m.set(COMMITTED(t, me), str(self.committed))
        if isinstance(self.stream, PackedStream):  # before arriving: a member's claim is there when it is
            m.set(DATA_AT(t, me), position_claim(self.stream.position, self.rows_per_step))
        m.set(ARRIVE(t, me), "1")
        members = q.members(0)
        if members is None and (founder or veteran):
            # veterans block for newcomers still starting up, as INTELLECT-1's onboarding does;
            # a newcomer that never comes up is dropped after its startup grace
            launched = self.launched()
            expected = launched if founder else [w for w in self.prev_members if w in launched] + [
                w for w in launched if w not in self.prev_members and not m.has(LEFT(t, w))]
            m.wait_for_keys(ARRIVE.under(t), [w for w in expected if w != me],
                            self._deadline(self.cfg.boundary_timeout), step=t)
            arrived = [w for w in self.launched() if m.has(ARRIVE(t, w)) and m.alive(w)]
            members = q.propose_members(0, arrived)
        elif members is None:
            m.wait_until(lambda: q.members(0) is not None, self._deadline(self.cfg.boundary_timeout * 10),
                         f"the members of step {t}")
            members = q.members(0) or []
        if me not in members:
            raise Excluded(f"{me} arrived after the members of step {t} were decided")
        self.members = members
        self.reshard(members)
        behind = self._onboard(members)
        self.sync.probe(self.step, members)
        return behind

    def _onboard(self, members: list[str]) -> bool:
        m = self.m
        # the rendezvous takes only counts up to the step; one unreadable all the same is taken as behind
        progress = {w: read_count(m.get(COMMITTED(self.step, w)), 0, self.step) or 0 for w in members}
        newest = max(progress.values())
        if min(progress.values()) == newest:
            return False
        src = members.index(min(w for w in members if progress[w] == newest))
        behind = progress[self.worker] < newest
        flat = self.outer.flat(self.committed)
        try:
            self.sync.group(self.step, "onboard", members).broadcast(flat, src).wait()
        except (CommError, dist.DistError, RuntimeError) as e:
            if behind:  # without the state we cannot contribute: try again at the next boundary
                raise Excluded(f"{self.worker}: onboarding at step {self.step} failed: {e}") from e
            log.warning("%s: onboarding broadcast at step %d failed: %s", self.worker, self.step, e)
            return False
        if behind:
            self.committed = self.outer.load_flat(flat)
            self.step = self.committed
            self.trainer.step = self.committed * self.cfg.inner_steps
            self.outer.load_into(self.model)
        return behind

    def batches(self, seen: list[str]) -> Iterator:
        """Training batches of this worker's shard; ``seen`` keeps the :func:`data_sketch` of their sequences."""
        return sketched_batches(self.stream, self.run.train.batch_size, seen)

    def inner(self, report: StepReport) -> None:
        """H inner steps: the report's inner_loss, inner_seconds, tokens, shard and data_sketch."""
        t0 = time.perf_counter()
        seen: list[str] = []
        rows = getattr(self.stream, "passed", 0)
        logs = self.trainer.train_steps(self.cfg.inner_steps, self.batches(seen), self.metrics_log.on_inner_step(self.m.check_store))
        report.inner_seconds = time.perf_counter() - t0
        self.rows_per_step = getattr(self.stream, "passed", 0) - rows
        self.data_at = (self.step + 1, list(self.members))
        report.inner_loss = sum(rec["loss"] for rec in logs) / len(logs)
        report.tokens = int(sum(rec["tokens"] for rec in logs))
        report.shard, report.data_sketch = list(self.shard), data_sketch(seen)

    def timing(self, report: StepReport) -> None:
        """The committed step's wall time and the utilization, throughput and MFU over it."""
        wall = report.outer_seconds = time.perf_counter() - self._started
        report.compute_utilization = report.inner_seconds / wall if wall > 0 else 0.0
        report.tokens_per_s = report.tokens / wall if wall > 0 else 0.0
        report.mfu = self.peak.mfu(report.tokens_per_s, self.flops_per_token)

    def commit(self, members: list[str], report: StepReport) -> None:
        """Record the step the synchronizer committed among ``members``: the next boundary's veterans,
        the step's timing, and (its first member) the run's progress."""
        self.committed = self.step + 1
        self.prev_members, self.members = members, members
        self.timing(report)
        if self.worker == members[0]:
            self.m.set(PROGRESS(), json.dumps(self.committed))

    def checkpoint_step(self, n: int) -> bool:
        """Whether committing outer step ``n - 1`` publishes checkpoint ``n``."""
        return n % self.cfg.checkpoint_every == 0 or n == self.cfg.outer_steps

    def save_state(self) -> None:
        """Save this worker's inner state and data position for the checkpoint this step commits into
        (before the all-reduce: see :mod:`~intellect.diloco.worker_state`)."""
        n = self.step + 1
        if self.checkpoint_step(n):
            state = worker_state.WorkerState(n, self.trainer.state_bytes(), self.stream.state_dict(),
                                             self.data_at[1], self.rows_per_step)
            worker_state.save(self.storage, self.worker, state, self.run.storage.keep_last)

    def checkpoint(self) -> str | None:
        n = self.committed
        if self.worker != self.members[0] or not self.checkpoint_step(n):
            return None
        uri = publish_outer_checkpoint(self.storage, n, self.host(), self.tok, self.outer, self.members)
        self.storage.retain(CHECKPOINTS, self.run.storage.keep_last)
        return uri

    # ------------------------------------------------------------------ driver

    def outer_step(self) -> StepReport:
        """One whole outer step; an excluded worker reverts and reports an uncommitted step."""
        report = StepReport(step=self.step, worker=self.worker)
        self._started = time.perf_counter()
        try:
            report.onboarded = self.boundary()
            report.step = self.step
            self.inner(report)
            self.save_state()
            self.sync.start(self.step, self.members, report)
            members = self.sync.finish()
            self.commit(members, report)
            self.checkpoint()
        except Excluded as e:
            log.warning("%s", e)
            self.m.leave(self.step)
            self.outer.load_into(self.model)  # drop the local progress; rejoin and catch up
            self.prev_members = []
            time.sleep(self.cfg.heartbeat_interval)  # the others are mid-step: no point in spinning
        else:
            self.step = self.committed
            self.m.set(METRICS(report.step, self.worker), json.dumps(asdict(report)))
            self.metrics_log.log(report.step, asdict(report))
        return report

    def run_until_done(self, observe: Callable[[StepReport], None] | None = None) -> None:
        """Outer steps until the run is done; ``observe`` sees each step's report once it is over."""
        while not self.done():
            r = self.outer_step()
            log.info("step %d committed=%s members=%s loss=%.4f bytes=%d algorithm=%s digest=%s",
                     r.step, r.committed, r.members, r.inner_loss, r.bytes_sent, r.algorithm, r.digest[:12])
            if observe is not None:
                observe(r)

    def done(self) -> bool:
        """Our own steps are done, or (a late joiner) the others finished the run."""
        return self.committed >= self.cfg.outer_steps or (self.m.progress() or 0) >= self.cfg.outer_steps

    def close(self, clean: bool = True) -> None:
        if clean:
            self.m.deathrattle()
        self.m.close()
        self.metrics_log.close()


__all__ = ["Banned", "DilocoWorker", "StoreLost", "inner_train_config"]
