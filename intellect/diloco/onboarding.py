"""Onboarding: how a worker behind the others (a joiner, a restarted worker) gets the run's state.

Blocking (``diloco.onboarding = "blocking"``, INTELLECT-1's first mode, the default): every member
waits at the boundary for newcomers still starting up, then the step's onboarding source
(:func:`~intellect.diloco.protocol.onboarding_source`) broadcasts its outer state (``theta_sync``, the
outer momentum, the step count: :meth:`OuterState.flat`) to all, rank *i* of every member over the
boundary group of local rank *i* (shard to shard), before anyone trains.

Non-blocking (``"non_blocking"``, INTELLECT-1's second mode): the members never wait for a joiner.

1. Veterans propose a step's members without waiting for newcomers; a joiner is in as soon as it has
   arrived, behind (its ``COMMITTED`` count is older than the step).
2. In that step the joiner trains nothing and contributes nothing to the all-reduce (it relays and
   receives, as a member with a non-finite pseudo-gradient does), while the step's onboarding source
   (:func:`~intellect.diloco.protocol.onboarding_source`) sends it, in the background, the state the
   step starts from: ``theta_sync``, the outer momentum and the step count (:meth:`OuterState.flat`),
   rank *i* of the source to rank *i* of the joiner (shard to shard), over a group of two of their own
   (:func:`~intellect.diloco.protocol.catchup_group`, whose keys only they may write).
3. At the step's commit the joiner takes that state, then applies the step's average like everyone:
   it holds the members' ``theta_sync`` bit for bit and contributes from the next step on.

The source sends a snapshot taken at the boundary, so its own outer step never waits for the
transfer; only the joiner waits for it, at its own commit (a transfer slower than a whole inner
phase delays that joiner's vote, nobody else's training). A transfer that fails costs the joiner
the step: it leaves and rejoins.

Both modes check what arrives before taking it: the step count must be the one the source committed,
and ``theta_sync`` must hash to the ``DIGEST`` a strict majority of the members as far ahead as the
source recorded for that step (:func:`~intellect.diloco.protocol.agreed_digest`); otherwise the joiner
keeps its own state, says why, and tries again at the next boundary (a source that lies cannot put
other weights into a joiner, only keep it out). With no such record (a run resumed under a new
rendezvous) the state is taken unchecked and the log says so. The momentum has no record of its own:
a wrong one moves the joiner's ``theta_sync`` off the members' at its first commit, which its digest
shows.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from intellect.diloco.protocol import (
    COMMITTED, DIGEST, PG, agreed_digest, catchup_group, onboarding_source, read_count, read_digest,
)
from intellect.diloco.sync import Excluded

if TYPE_CHECKING:
    from intellect.diloco.config import DilocoConfig
    from intellect.diloco.membership import Membership
    from intellect.diloco.outer import OuterState
    from intellect.diloco.siblings import Siblings
    from intellect.diloco.sync import Synchronizer
    from intellect.diloco.worker_ranks import WorkerRanks
    from intellect.train import Trainer
from intellect.diloco.transport import CommError, new_group, shard_prefix

__all__ = ["Onboarding", "Transfer"]

log = logging.getLogger("intellect.diloco")


class Transfer:
    """One background send (``rank`` 0, the source) or receive (``rank`` 1, the joiner) of ``flat`` over
    a gloo group of two under ``prefix`` on the rendezvous ``store`` (whose client keeps a connection
    per thread), bounded by ``timeout`` seconds."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, flat: torch.Tensor,  # pyright: ignore[reportPrivateImportUsage]
                 timeout: float, name: str):
        self.flat, self.error = flat, ""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, prefix, rank, timeout), name=name, daemon=True)
        self._thread.start()

    def _run(self, store, prefix: str, rank: int, timeout: float) -> None:
        try:
            group = new_group(store, prefix, rank, 2, timeout=timeout)
            group.broadcast(self.flat, 0).wait()
        except (CommError, dist.DistError, RuntimeError, ValueError) as e:
            self.error = str(e) or type(e).__name__
        finally:
            close: Callable[[], None] | None = getattr(store, "close", None)
            if close is not None:
                close()  # this thread's connection
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """Whether the transfer completed within ``timeout`` seconds (else :attr:`error` says why)."""
        if not self._done.wait(timeout):
            self.error = self.error or f"not done in {timeout:.0f} s"
            return False
        return not self.error


class Onboarding:
    """The onboarding phases of :class:`~intellect.diloco.worker.DilocoWorker` (which this is a part of:
    the attributes it uses are the worker's)."""

    # the worker's, declared for the type checker
    cfg: DilocoConfig
    worker: str
    step: int
    committed: int
    members: list[str]
    outer: OuterState
    model: torch.nn.Module
    trainer: Trainer
    sync: Synchronizer
    siblings: Siblings
    store: dist.Store  # pyright: ignore[reportPrivateImportUsage]
    ranks: WorkerRanks | None
    catching_up: Transfer | None
    catching_up_from: dict | None = None  # the onboarding decision a background transfer is checked against

    send_after_commit: dict | None = None  # overlap: the onboarding a source serves once its step in flight commits

    @property
    def membership(self) -> Membership:
        raise NotImplementedError

    def claimed(self) -> int:
        raise NotImplementedError

    def _onboarding(self, members: list[str]) -> dict | None:
        """Who hands its state to the members behind at this boundary (``src``, its index), those
        (``joiners``) and whether this worker is one of them (None: nobody is behind). The rendezvous
        takes only counts up to the step; one unreadable all the same is taken as behind."""
        m, t = self.membership, self.step
        records = {w: m.get(COMMITTED(t, w)) for w in members}  # one read of each: the store is remote
        progress = {w: read_count(records[w], 0, t) or 0 for w in members}
        self._same_as_the_members([w for w in members if progress[w] == self.claimed()])
        source = onboarding_source(members, records.get, t)
        if source is None:
            return None
        count = progress[source]
        joiners = [j for j, w in enumerate(members) if progress[w] < count]
        # what the state sent must hash to: the digest the members as far ahead agree on for that step
        # (overlapped, not recorded yet: the members commit that step after this boundary; read at the take)
        held = m.get_present([DIGEST(count - 1, w) for w in members if progress[w] == count])
        return {"src": members.index(source), "joiners": joiners, "behind": members.index(self.worker) in joiners,
                "count": count, "digest": agreed_digest(held), "records": sum(r is not None for r in held)}

    def _same_as_the_members(self, peers: list[str]) -> None:
        """Leave, to be onboarded afresh, when this worker's ``theta_sync`` is not the one a strict majority
        of ``peers`` (the members with as many commits) recorded for the last step: a replica that drifted
        (a wrong momentum taken from a source that lied, a fault) never contributes or publishes from it."""
        n, m = self.committed, self.membership
        if n == 0 or len(peers) < 3:  # two that differ: no majority to side with
            return
        # (a joiner that took the state of step n-1 has no record of it)
        records = dict(zip(peers, m.get_present([DIGEST(n - 1, w) for w in peers])))
        agreed = agreed_digest(list(records.values()))
        mine = read_digest(records.get(self.worker))
        if agreed is not None and mine is not None and mine != agreed:
            self.committed = 0  # behind everyone: the next boundary onboards it
            raise Excluded(f"{self.worker}: theta_sync after step {n - 1} hashes to {mine[:12]}, "
                           f"the members recorded {agreed[:12]}: leaving to be onboarded again")

    def _onboard(self, onboard: dict | None) -> bool:
        """Every rank receives (or sends) its own shard of the state, from the same rank of the
        source member (shard to shard); the worker is onboarded only if every rank was."""
        if onboard is None:
            return False
        if self.cfg.onboarding == "non_blocking":
            return self._catch_up(onboard)
        behind = bool(onboard["behind"])
        flat = self.outer.flat(self.committed)
        if self.members.index(self.worker) == int(onboard["src"]):
            self.sync.faults.onboarding_state(self.step, self.worker, flat)
        error = None
        try:
            self.sync.group(self.step, "onboard", self.members).broadcast(flat, int(onboard["src"])).wait()
        except (CommError, dist.DistError, RuntimeError) as e:
            error = e
        if not self.siblings.all(error is None):
            if behind:  # without the state we cannot contribute: try again at the next boundary
                raise Excluded(f"{self.worker}: onboarding at step {self.step} failed: {error or 'on another rank'}")
            log.warning("%s: onboarding broadcast at step %d failed: %s", self.worker, self.step, error)
            return False
        if behind:
            self.committed = self._take(flat, onboard)
            self.step = self.committed
            self.trainer.step = self.committed * self.cfg.inner_steps
            self.outer.load_into(self.model)
        return behind

    def _take(self, flat: torch.Tensor, onboard: dict) -> int:
        """Load the received state ``flat`` and return its step count, or refuse it (the worker's own
        state back in place) with :class:`Excluded` saying why. Collective over the worker's ranks."""
        mine = self.outer.flat(self.committed)
        count = self.outer.load_flat(flat)
        source, expected = self.members[int(onboard["src"])], onboard.get("digest")
        why = ""
        if count != int(onboard["count"]):
            why = f"it holds {count} outer steps, {source} committed {onboard['count']}"
        got = self.sync.digest()  # every rank takes part (a sharded worker's digest gathers its shards)
        if not why and expected is None and onboard.get("records"):
            why = "the members as far ahead disagree on the digest of that step"
        elif not why and expected is not None and got != expected:
            why = f"its theta_sync hashes to {got[:12]}, the members recorded {expected[:12]}"
        if not self.siblings.all(not why):
            self.outer.load_flat(mine)
            raise Excluded(f"{self.worker}: refused the state {source} sent at step {self.step}: "
                           f"{why or 'on another rank'}")
        if expected is None:
            log.warning("%s: took the state %s sent at step %d unchecked: no member recorded its digest",
                        self.worker, source, self.step)
        return count

    def _catch_up(self, onboard: dict) -> bool:
        """Non-blocking onboarding (:mod:`~intellect.diloco.catchup`): the source sends a snapshot of its
        state to each member behind, which receives it during the step; True for those."""
        me, t = self.members.index(self.worker), self.step
        if me == int(onboard["src"]):
            if self.sync.in_flight is not None:
                self.send_after_commit = onboard  # overlap: the state with the step in flight committed
            else:
                self.send_snapshots(onboard)
            return False
        if me not in onboard["joiners"]:
            return False
        self.catching_up = Transfer(self.store, self._catchup_prefix(me), 1, self.outer.flat(self.committed),
                                    self._catchup_timeout(), f"catchup-receive-{t}")
        self.sync.before_step, self.catching_up_from = self._caught_up, onboard
        log.info("%s: catching up at step %d from %s in the background", self.worker, t,
                 self.members[int(onboard["src"])])
        return True

    def send_snapshots(self, onboard: dict) -> None:
        """The source's part: a snapshot of its state to each joiner, in the background (its own outer step
        never waits for the transfers)."""
        t = self.step
        snapshot = self.outer.flat(self.committed)
        self.sync.faults.onboarding_state(t, self.worker, snapshot)
        for j in onboard["joiners"]:
            Transfer(self.store, self._catchup_prefix(j), 0, snapshot, self._catchup_timeout(), f"catchup-send-{t}-{j}")

    def _catchup_timeout(self) -> float:
        """How long a transfer may wait for its peer: a boundary's wait; overlapped, the source sends only after
        its inner phase and the commit of its step in flight, so as long as a joiner waits for a decision."""
        return self.cfg.boundary_timeout * (1 if self.cfg.overlap == "none" else 10)

    def _digest_now(self, onboard: dict) -> dict:
        """``onboard`` with the digest a strict majority of the members as far ahead recorded for the step the
        state holds, read now (overlap: recorded after the boundary), waiting a bounded time for a majority."""
        count, names = int(onboard["count"]), [w for j, w in enumerate(self.members) if j not in onboard["joiners"]]
        held: list[str | None] = []
        if self.siblings.leader:
            m = self.membership
            deadline = time.monotonic() + self.cfg.collective_timeout + self.cfg.heartbeat_timeout
            while True:
                held = m.get_present([DIGEST(count - 1, w) for w in names])
                if agreed_digest(held) is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        held = self.siblings.share(held if self.siblings.leader else None)
        return {**onboard, "digest": agreed_digest(held), "records": sum(h is not None for h in held)}

    def _catchup_prefix(self, joiner: int) -> str:
        prefix = PG(self.step, catchup_group(joiner))
        rank = self.ranks.rank if self.ranks is not None else 0
        return prefix if rank == 0 else shard_prefix(prefix, rank)

    def _caught_up(self) -> None:
        """At the catch-up step's commit (before its outer step): take the state received, or leave."""
        transfer, self.catching_up, self.sync.before_step = self.catching_up, None, None
        onboard, self.catching_up_from = self.catching_up_from, None
        assert transfer is not None and onboard is not None
        ok = self.siblings.all(transfer.wait(self._catchup_timeout()))
        if not ok:
            raise Excluded(f"{self.worker}: catching up at step {self.step} failed: {transfer.error or 'on another rank'}")
        if self.cfg.overlap != "none":
            onboard = self._digest_now(onboard)
        self.committed = self._take(transfer.flat, onboard)
        self.trainer.step = (self.committed + 1) * self.cfg.inner_steps  # past the step it did not train
