"""Elastic membership of DiLoCo workers over the rendezvous store: liveness and agreement.

The store is the authenticated rendezvous the coordinator hosts (:mod:`intellect.diloco.rendezvous`:
nobody without the run's secret can read or write a key). Keys (all strings):

``launched/<i>``      the i-th worker the coordinator admitted (``launched``: how many); the
                      admission order, never the names' sort order, ranks members: the first
                      admitted live member leads (writes ``progress`` and checkpoints)
``committed/<t>/<w>`` outer steps ``w`` had committed when it reached boundary ``t``
``hb/<w>``            heartbeat counter, bumped every ``heartbeat_interval`` s
``dead/<w>``          deathrattle, written on clean exit and on SIGTERM
``arrive/<t>/<w>``    worker ``w`` is at the boundary of outer step ``t``
``members/<t>/<a>``   the agreed members of step ``t``, attempt ``a`` (JSON list)
``left/<t>/<w>``       ``w`` was left out of step ``t`` and rejoins later: do not wait for it
``ready/<t>/<a>/<w>`` worker ``w`` holds its pseudo-gradient for that attempt
``vote/<t>/<a>/<w>``  ``ok`` or ``fail`` after the all-reduce
``probe/<t>``, ``order/<t>/<a>``  whether to measure bandwidth; the ring order used
``outcome/<t>/<a>``   ``commit`` or ``abort``, decided once
``progress``          newest committed outer step (JSON)
``flags/<t>/<a>/<w>``  the members ``w`` found to be outliers in that attempt (JSON list)
``blame/<t>/<a>/<w>``  the owners whose results ``w`` refused in that attempt (JSON list)
``banned/<w>``        ``w`` was an outlier in too many steps: it is never a member again

Every decision is taken with ``compare_set`` on an empty key, so the first
proposal wins and every worker reads the same answer: no leader, no split
brain. Liveness is judged from the heartbeat *counter* changing in the
observer's own clock, so clock skew between hosts cannot kill anyone; a
worker is dead when its deathrattle is set or its counter has not moved for
``heartbeat_timeout`` seconds. Every wait has a deadline; a store that stops
answering raises :class:`StoreLost` so a worker stops instead of hanging.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable

from intellect.diloco.rendezvous import RendezvousStore


class StoreLost(RuntimeError):
    """The rendezvous store (the coordinator) is unreachable: stop cleanly."""


class MembershipTimeout(TimeoutError):
    """A bounded wait on other workers ran out."""


def connect_store(host: str, port: int, timeout: float, secret: bytes, run: str, peer: str = "") -> RendezvousStore:
    """A client of the run's rendezvous with bounded waits; :class:`StoreLost` when it does not answer
    (or refuses our credential)."""
    store = RendezvousStore(host, port, secret, run, peer=peer, timeout=timedelta(seconds=timeout))
    try:
        store.num_keys()
    except Exception as e:  # noqa: BLE001
        raise StoreLost(f"cannot reach the rendezvous store at {host}:{port}: {e}") from e
    return store


class Membership:
    """One worker's view of the group: its heartbeat, others' liveness, agreements."""

    def __init__(
        self,
        host: str,
        port: int,
        worker: str,
        secret: bytes,
        run: str,
        heartbeat_interval: float = 2.0,
        heartbeat_timeout: float = 10.0,
        store_timeout: float = 30.0,
        startup_grace: float = 120.0,
    ):
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError("heartbeat_timeout must exceed heartbeat_interval")
        self.host, self.port, self.worker, self._secret, self.run = host, port, worker, secret, run
        self.interval, self.timeout, self.store_timeout = heartbeat_interval, heartbeat_timeout, store_timeout
        self.startup_grace = max(startup_grace, heartbeat_timeout)
        self.store = connect_store(host, port, store_timeout, secret, run, worker)
        self._seen: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._lost: Exception | None = None
        self._beat = None

    # ------------------------------------------------------------------ own liveness

    def start_heartbeat(self) -> None:
        self.store.delete_key(f"dead/{self.worker}")
        self.store.add(f"hb/{self.worker}", 1)
        self._beat = threading.Thread(target=self._heartbeat, name=f"heartbeat-{self.worker}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        # its own connection: TCPStore clients are not shared across threads
        try:
            store = connect_store(self.host, self.port, self.store_timeout, self._secret, self.run, self.worker)
            while not self._stop.wait(self.interval):
                store.add(f"hb/{self.worker}", 1)
        except Exception as e:  # noqa: BLE001
            self._lost = e

    def check_store(self) -> None:
        """Raise :class:`StoreLost` if the heartbeat thread lost the store."""
        if self._lost is not None:
            raise StoreLost(f"rendezvous store lost: {self._lost}")

    def deathrattle(self) -> None:
        """Announce a clean exit so peers drop this worker at once."""
        self._stop.set()
        try:
            self.store.set(f"dead/{self.worker}", "1")
        except Exception:  # noqa: BLE001 - the store may be gone already; exiting anyway
            pass

    # ------------------------------------------------------------------ others' liveness

    def _call(self, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            raise StoreLost(f"rendezvous store lost: {e}") from e

    def counter(self, key: str) -> int:
        return int(self._call(self.store.add, key, 0))

    def has(self, key: str) -> bool:
        return bool(self._call(self.store.check, [key]))

    def get(self, key: str) -> str:
        return self._call(self.store.get, key).decode()

    def set(self, key: str, value: str) -> None:
        self._call(self.store.set, key, value)

    def alive(self, worker: str) -> bool:
        """False once ``worker`` sent its deathrattle or its heartbeat stalled for the timeout.

        A worker that has not beaten yet (still importing, loading its checkpoint) gets
        ``startup_grace`` from when we first looked; one seen beating, the heartbeat timeout.
        """
        if worker == self.worker:
            return True
        if self.has(f"dead/{worker}"):
            return False
        count = self.counter(f"hb/{worker}")
        now = time.monotonic()
        last = self._seen.get(worker)
        if last is None or last[0] != count:
            self._seen[worker] = (count, now)
            return True
        return now - last[1] < (self.startup_grace if count == 0 else self.timeout)

    def live(self, workers: Iterable[str]) -> list[str]:
        return [w for w in workers if self.alive(w)]

    # ------------------------------------------------------------------ agreement

    def decide(self, key: str, proposal: str) -> str:
        """The first value ever proposed for ``key``: ours, or the one that beat it."""
        return self._call(self.store.compare_set, key, "", proposal).decode()

    def decided(self, key: str) -> str | None:
        return self.get(key) if self.has(key) else None

    def wait_until(self, predicate: Callable[[], bool], deadline: float, what: str, poll: float = 0.05) -> None:
        """Poll ``predicate`` until true; :class:`MembershipTimeout` at ``deadline`` (monotonic)."""
        while not predicate():
            self.check_store()
            if time.monotonic() >= deadline:
                raise MembershipTimeout(f"timed out waiting for {what}")
            time.sleep(poll)

    def leave(self, step: int) -> None:
        """Tell the members of ``step`` not to wait for us (we rejoin at a later boundary)."""
        self.set(f"left/{step}/{self.worker}", "1")

    def wait_for_keys(self, prefix: str, workers: Iterable[str], deadline: float,
                      step: int | None = None) -> tuple[list[str], list[str]]:
        """Wait until every worker has ``prefix/<w>``, is dead, or left ``step``; returns (present, absent)."""
        workers = list(workers)

        def gone(w: str) -> bool:
            return not self.alive(w) or (step is not None and self.has(f"left/{step}/{w}"))

        def settled() -> bool:
            return all(self.has(f"{prefix}/{w}") or gone(w) for w in workers)

        try:
            self.wait_until(settled, deadline, f"{prefix} from {workers}")
        except MembershipTimeout:
            pass  # the stragglers count as absent: the step goes ahead without them
        present = [w for w in workers if self.has(f"{prefix}/{w}")]
        return present, [w for w in workers if w not in present]

    def members(self, step: int, attempt: int) -> list[str] | None:
        raw = self.decided(f"members/{step}/{attempt}")
        return None if raw is None else json.loads(raw)

    def propose_members(self, step: int, attempt: int, workers: list[str]) -> list[str]:
        """Propose ``workers`` in admission order (the caller's order; duplicates dropped): ranks and
        the leader follow it, so a name chosen to sort first gains nothing."""
        return json.loads(self.decide(f"members/{step}/{attempt}", json.dumps(list(dict.fromkeys(workers)))))

    def banned(self, worker: str) -> bool:
        return self.has(f"banned/{worker}")

    def progress(self) -> int | None:
        raw = self.decided("progress")
        return None if raw is None else int(json.loads(raw))

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=self.interval + 1)
