"""Elastic membership of DiLoCo workers over the rendezvous store: liveness, bounded waits, write scopes.

The store is the authenticated rendezvous the coordinator hosts (:mod:`intellect.diloco.rendezvous`:
nobody without a peer key of the run can read or write a key); the keys are those of
:mod:`intellect.diloco.protocol`, and :func:`scope` is the policy that enforces each family's
:class:`~intellect.diloco.protocol.Writer`.

Liveness is judged from the heartbeat *counter* changing in the observer's own clock, so clock
skew between hosts cannot kill anyone; a worker is dead when its deathrattle is set or its counter
has not moved for ``heartbeat_timeout`` seconds. Every wait has a deadline; a store that stops
answering raises :class:`StoreLost` so a worker stops instead of hanging.
"""

from __future__ import annotations

import re

import threading
import time
from datetime import timedelta
from typing import Callable, Iterable

from intellect.diloco.protocol import (AHEAD, ARRIVE, BAN, BANNED, BEHIND, BOUNDARY_GROUPS, BW, CATCHUP_GROUP, CLOSE,
                                       COMMITTED, DEAD, FAMILIES, HB, KEEP_STEPS, LEFT, MAX_SCAN, MEMBERS, OUTCOME, PG, PROGRESS,
                                       READY, START, VOTE, Writer, ban_votes, onboarding_source, read_ban, read_count,
                                       read_json, read_names)
from intellect.diloco.rendezvous import COORDINATOR, unb64, peer_key
from intellect.diloco.stragglers import needed
from intellect.diloco.rendezvous_client import RendezvousStore, StoreError


class StoreLost(RuntimeError):
    """The rendezvous store (the coordinator) is unreachable: stop cleanly."""


class RefusedBanned(StoreLost):
    """The rendezvous refuses this worker's writes: the run banned it."""


def _lost(e: Exception) -> StoreLost:
    if isinstance(e, StoreError) and e.reason == "banned":
        return RefusedBanned(f"the rendezvous refuses our writes: {e}")
    return StoreLost(f"rendezvous store lost: {e}")


class MembershipTimeout(TimeoutError):
    """A bounded wait on other workers ran out."""


def connect_store(host: str, port: int, timeout: float, secret: bytes | None, run: str, peer: str = "",
                  key: bytes | None = None) -> RendezvousStore:
    """A client of the run's rendezvous as ``peer`` (its ``key``, or one derived from the run
    ``secret``) with bounded waits; :class:`StoreLost` when it does not answer (or refuses our credential)."""
    store = RendezvousStore(host, port, secret, run, peer=peer, timeout=timedelta(seconds=timeout), key=key)
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
        secret: bytes | None,
        run: str,
        heartbeat_interval: float = 2.0,
        heartbeat_timeout: float = 10.0,
        store_timeout: float = 30.0,
        startup_grace: float = 120.0,
        key: bytes | None = None,
    ):
        if heartbeat_timeout <= heartbeat_interval:
            raise ValueError("heartbeat_timeout must exceed heartbeat_interval")
        self.host, self.port, self.worker, self.run = host, port, worker, run
        if key is None:
            if secret is None:
                raise ValueError("a member needs its key or the run secret")
            key = peer_key(secret, run, worker)
        self._key = key  # our own: never the secret
        self.interval, self.timeout, self.store_timeout = heartbeat_interval, heartbeat_timeout, store_timeout
        self.startup_grace = max(startup_grace, heartbeat_timeout)
        self.store = connect_store(host, port, store_timeout, None, run, worker, key=self._key)
        self._seen: dict[str, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._lost: Exception | None = None
        self._beat = None
        self._watch_lock = threading.Lock()
        self._watched_key: str | None = None  # a key the heartbeat thread looks for (watch) ...
        self.watch_interval = heartbeat_interval  # ... this often
        self._seen_watched = threading.Event()

    # ------------------------------------------------------------------ own liveness

    def start_heartbeat(self) -> None:
        self._call(self.store.delete_key, DEAD(self.worker))
        self._call(self.store.add, HB(self.worker), 1)
        self._beat = threading.Thread(target=self._heartbeat, name=f"heartbeat-{self.worker}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        # its own connection: TCPStore clients are not shared across threads
        try:
            store = connect_store(self.host, self.port, self.store_timeout, None, self.run, self.worker, key=self._key)
            beat = time.monotonic()
            while not self._stop.wait(self.watch_interval if self._watched_key is not None else self.interval):
                if time.monotonic() - beat >= self.interval - 1e-3:
                    store.add(HB(self.worker), 1)
                    beat = time.monotonic()
                with self._watch_lock:
                    key = self._watched_key
                if key is not None and store.check([key]):
                    with self._watch_lock:
                        if self._watched_key == key:
                            self._seen_watched.set()
        except Exception as e:  # noqa: BLE001
            self._lost = e

    def watch(self, key: str | None, interval: float | None = None) -> None:
        """Have the heartbeat thread look for ``key`` every ``interval`` s (at most the heartbeat's; None: stop
        looking); :meth:`watched` says whether it saw it. The heartbeat thread's request, not one per inner
        step: the look costs the inner loop nothing."""
        with self._watch_lock:
            self._watched_key = key
            self.watch_interval = min(self.interval, interval) if interval is not None else self.interval
            self._seen_watched.clear()

    def watched(self) -> bool:
        """Whether the heartbeat thread saw the key :meth:`watch` named."""
        return self._seen_watched.is_set()

    def check_store(self) -> None:
        """Raise :class:`StoreLost` if the heartbeat thread lost the store."""
        if self._lost is not None:
            raise _lost(self._lost)

    def deathrattle(self) -> None:
        """Announce a clean exit so peers drop this worker at once."""
        self._stop.set()
        try:
            self.store.set(DEAD(self.worker), "1")
        except Exception:  # noqa: BLE001 - the store may be gone already; exiting anyway
            pass

    # ------------------------------------------------------------------ others' liveness

    def _call(self, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            raise _lost(e) from e

    def counter(self, key: str) -> int:
        return int(self._call(self.store.add, key, 0))

    def has(self, key: str) -> bool:
        return bool(self._call(self.store.check, [key]))

    def get(self, key: str) -> str:
        return self._call(self.store.get, key).decode()

    def get_present(self, keys: list[str]) -> list[str | None]:
        """The values of ``keys``, None for those not written (one round trip to learn which are)."""
        there = self._call(self.store.check_many, keys) if keys else []
        return [self.get(k) if t else None for k, t in zip(keys, there)]

    def set(self, key: str, value: str) -> None:
        self._call(self.store.set, key, value)

    def alive(self, worker: str) -> bool:
        """False once ``worker`` sent its deathrattle or its heartbeat stalled for the timeout.

        A worker that has not beaten yet (still importing, loading its checkpoint) gets
        ``startup_grace`` from when we first looked; one seen beating, the heartbeat timeout.
        """
        if worker == self.worker:
            return True
        if self.has(DEAD(worker)):
            return False
        count = self.counter(HB(worker))
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

    def try_decide(self, key: str, proposal: str) -> str | None:
        """:meth:`decide`, or None when the rendezvous refuses the proposal under its policy (a close the
        rendezvous counts too early, say: nobody's state depends on it); a store that is gone still raises."""
        try:
            return self.store.compare_set(key, "", proposal).decode()
        except StoreError as e:
            if e.reason == "scope":
                return None
            raise _lost(e) from e
        except Exception as e:  # noqa: BLE001
            raise _lost(e) from e

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
        self.set(LEFT(step, self.worker), "1")

    def wait_for_keys(self, prefix: str, workers: Iterable[str], deadline: float, step: int | None = None,
                      until: Callable[[], bool] | None = None,
                      cutoff: Callable[[list[str]], bool] | None = None) -> tuple[list[str], list[str]]:
        """Wait until every worker has ``prefix/<w>``, is dead, or left ``step`` (or ``until()`` holds:
        whatever was waited for is decided already; or ``cutoff(present)``: those there are enough);
        returns (present, absent)."""
        workers = list(workers)

        def gone(w: str) -> bool:
            return not self.alive(w) or (step is not None and self.has(LEFT(step, w)))

        def settled() -> bool:
            if not workers:
                return True
            if until is not None and until():
                return True
            there = [w for w, t in zip(workers, self._call(self.store.check_many, [f"{prefix}/{w}" for w in workers])) if t]
            if len(there) < len(workers) and cutoff is not None and cutoff(there):
                return True
            return all(w in there or gone(w) for w in workers)

        try:
            self.wait_until(settled, deadline, f"{prefix} from {workers}")
        except MembershipTimeout:
            pass  # the stragglers count as absent: the step goes ahead without them
        there = self._call(self.store.check_many, [f"{prefix}/{w}" for w in workers]) if workers else []
        present = [w for w, t in zip(workers, there) if t]  # one round trip, not one per worker
        return present, [w for w in workers if w not in present]

    def banned(self, worker: str, voters: Iterable[str] = ()) -> bool:
        """Banned by the coordinator (``banned/<w>``) or by a majority of an attempt's members
        among ``voters`` (:func:`ban_votes`)."""
        if self.has(BANNED(worker)):
            return True
        voters = [v for v in voters if v != worker]
        if not voters:
            return False
        keys = [BAN(worker, v) for v in voters]
        asked = set(keys)
        present = {k for k, there in zip(keys, self._call(self.store.check_many, keys)) if there}
        if not present:
            return False

        def get(key: str) -> bytes | None:
            if key in asked and key not in present:
                return None
            return self._call(self.store.get, key) if self.has(key) else None

        return ban_votes(get, worker, voters)

    def progress(self) -> int | None:
        """The newest committed outer step (None: none yet, or a value that is not a count)."""
        raw = self.decided(PROGRESS())
        return None if raw is None else read_count(raw)

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=self.interval + 1)


# ---------------------------------------------------------------------- who may write what


def _member(data: dict, t: object, a: object, peer: str) -> bool:
    return peer in (read_names(data.get(MEMBERS(t, a))) or [])


def _committed_members(data: dict, t: int) -> list[list[str]]:
    """The members of each attempt of step ``t`` whose outcome is commit."""
    out, a = [], 0
    while a < MAX_SCAN and MEMBERS(t, a) in data:
        if data.get(OUTCOME(t, a)) == b"commit":
            out.append(read_names(data[MEMBERS(t, a)]) or [])
        a += 1
    return out


def _in_flight_member(data: dict, t: int, peer: str) -> bool:
    """Whether ``peer`` is a member of step ``t``'s latest attempt and that attempt is undecided: an
    overlapped run's members agree on the next step while step ``t`` still reduces."""
    a = 0
    while a + 1 < MAX_SCAN and MEMBERS(t, a + 1) in data:
        a += 1
    if MEMBERS(t, a) not in data or OUTCOME(t, a) in data:
        return False
    return peer in (read_names(data[MEMBERS(t, a)]) or [])


def _voted_on(data: dict, t: int, peer: str) -> bool:
    """Whether ``peer`` voted on step ``t``'s latest attempt: overlapped, a member does as its next phase ends."""
    if t < 0:
        return False
    a = 0
    while a + 1 < MAX_SCAN and MEMBERS(t, a + 1) in data:
        a += 1
    return VOTE(t, a, peer) in data


def _step(part: str) -> int | None:
    return int(part) if part.isdigit() and len(part) < 12 else None


def _decision(peer: str, parts: list[str], value: bytes, data: dict, quorum: float = 1.0) -> str | None:
    family = parts[0]
    if any(_step(p) is None for p in parts[1:]):
        return f"{family}: the step and attempt are numbers"
    t = int(parts[1])
    if family == OUTCOME.name:
        if value not in (b"commit", b"abort"):
            return "an outcome is commit or abort"
        if not (_member(data, parts[1], parts[2], peer) and VOTE(parts[1], parts[2], peer) in data):
            return "only a member that has voted decides an attempt's outcome"
        return None
    if family == CLOSE.name:
        if value != b"1":
            return "a close is 1"
        members = read_names(data.get(MEMBERS(t, 0))) or []
        done = [w for w in members if READY(t, 0, w) in data or _voted_on(data, t - 1, w)]
        if peer not in done:
            return "only a member done with the step's phase closes it"
        if len(done) < needed(quorum, len(members)):
            return f"a step's phase is closed once {needed(quorum, len(members))} of its members are done with it"
        return None
    if family == "probe":
        if value not in (b"yes", b"no"):
            return "a probe decision is yes or no"
        return None if _member(data, parts[1], 0, peer) else "only a member of the step decides its probe"
    if family == "plan":
        plan = read_json(value)
        order = plan.get("order") if isinstance(plan, dict) else 0
        if not (isinstance(plan, dict) and isinstance(plan.get("algorithm"), str)
                and isinstance(plan.get("estimates"), dict)
                and (order is None or (isinstance(order, list) and all(type(i) is int for i in order)
                                       and len(set(order)) == len(order)))):
            return "a plan is an object with an algorithm, an order and estimates"
        return None if _member(data, parts[1], parts[2], peer) else "only a member of the attempt decides its plan"
    proposal, a = read_names(value), int(parts[2])
    if not proposal:
        return "a membership is a non-empty JSON list of distinct names"
    if a > 0:
        before = read_names(data.get(MEMBERS(t, a - 1)))
        if before is None or peer not in before or not set(proposal) <= set(before):
            return "a retry is proposed by a member of the attempt before, from its members"
        return None
    if ARRIVE(t, peer) not in data or not all(ARRIVE(t, w) in data for w in proposal):
        return "a step's members are proposed by one that arrived, from those that arrived"
    if PROGRESS() not in data:  # founders: the run's first step under this coordinator (overlapped: or the next)
        start = read_count(data.get(START()))
        if start is None or t == start or (t == start + 1 and _in_flight_member(data, start, peer)):
            return None
        return f"the founders' step is {start}, not {t}"
    if any(peer in m for m in _committed_members(data, t - 1)):
        return None
    if _in_flight_member(data, t - 1, peer) and any(peer in m for m in _committed_members(data, t - 2)):
        return None  # overlapped: a member of step t-1, in flight, that committed the step before
    return f"only a member of step {t - 1}'s commit (or, overlapped, of step {t - 1} in flight) proposes the members of step {t}"


def _own(family: str, parts: list[str], peer: str, op: str, req: dict) -> str | None:
    if len(parts) != len(FAMILIES[family].fields) + 1 or parts[-1] != peer or any(_step(p) is None for p in parts[1:-1]):
        return f"a worker writes only its own {family}/ key"
    if op == "add" and family != HB.name or op == "compare_set":
        return f"{family}/ is written with set"
    if family == COMMITTED.name and op == "set" and read_count(unb64(req.get("value", "")), 0, int(parts[1])) is None:
        return "committed/<t>/<w> is a number of steps, at most t"
    return None


def _in_attempt(family: str, parts: list[str], peer: str, op: str, req: dict, data: dict) -> str | None:
    if len(parts) != 4 or parts[3] != peer or any(_step(p) is None for p in parts[1:3]):
        return f"a worker writes only its own {family}/ key"
    if op != "set":
        return f"{family}/ is written with set"
    if not _member(data, parts[1], parts[2], peer):
        return f"only a member of attempt {parts[1]}/{parts[2]} writes its {family}/ keys"
    value = unb64(req.get("value", ""))
    if family == VOTE.name and value not in (b"ok", b"fail"):
        return "a vote is ok or fail"
    if family != READY.name and family != VOTE.name and read_names(value) is None:
        return f"{family} is a JSON list of names"
    return None


def current_step(data: dict) -> int | None:
    """The outer step the run is at, as the rendezvous sees it: ``progress``, else the founders'
    ``start`` (the coordinator writes it before it admits anyone), else None."""
    step = read_count(data.get(PROGRESS()))
    return step if step is not None else read_count(data.get(START()))


def _window(family: str, part: str, data: dict) -> str | None:
    t, now = int(part), current_step(data)
    if now is not None and not now - BEHIND <= t <= now + AHEAD:
        return f"{family}/ keys are written for steps {max(0, now - BEHIND)}-{now + AHEAD} (the run is at {now})"
    return None


_SHARD = re.compile(r"^shard([1-9]|[1-5][0-9]|6[0-3])$")  # transport.shard_prefix, ranks 1..63 of a worker


def _gloo(parts: list[str], peer: str, op: str, key: str, data: dict) -> str | None:
    """gloo's rendezvous of a group (``transport.new_group``): rank ``r`` sets its address key once,
    ``pg/<t>/<group>//<device>/<r>`` (its PrefixStore's layout; ``pg/<t>/<group>/shard<i>//<device>/<r>``
    for local rank *i* > 0 of workers of several ranks, any of whose processes speaks as the worker),
    and the bandwidth probe its column,
    ``bw/<t>/col/<r>``. Only the member holding rank ``r`` in the group's member order writes it,
    and an attempt's only once all its members are ready (the group forms after that), so nobody
    plants a value in another's key or in a group before it forms."""
    if op != "set":
        return "gloo's keys are written with set"
    if parts[0] == PG.name and len(parts) == 6 and parts[3] == "" and parts[4].isdigit():
        t, group, rank = parts[1], parts[2], parts[5]
    elif (parts[0] == PG.name and len(parts) == 7 and _SHARD.match(parts[3]) and parts[4] == ""
          and parts[5].isdigit()):  # local rank i's ring of a worker of several ranks: pg/<t>/<group>/shard<i>/...
        t, group, rank = parts[1], parts[2], parts[6]
    elif parts[0] == BW.name and len(parts) == 4 and parts[2] == "col":
        t, group, rank = parts[1], BOUNDARY_GROUPS[1], parts[3]
    else:
        return f"{parts[0]}/ holds only gloo's per-rank keys"
    if (c := CATCHUP_GROUP.match(group)) is not None:
        return _catchup(t, int(c.group(1)), rank, peer, key, data)
    attempt = "0" if group in BOUNDARY_GROUPS else group
    if _step(t) is None or _step(attempt) is None or _step(rank) is None:
        return f"{parts[0]}/: the step, group and rank are numbers (or a boundary group)"
    if key in data:
        return "a rank's gloo key is written once"
    members = read_names(data.get(MEMBERS(t, attempt))) or []
    if int(rank) >= len(members) or members[int(rank)] != peer:
        return f"only rank {rank} of attempt {t}/{attempt}'s members writes that key"
    if group not in BOUNDARY_GROUPS and not all(READY(t, attempt, w) in data for w in members):
        return f"the group of attempt {t}/{attempt} forms once every member is ready"
    return None


def _catchup(t: str, joiner: int, rank: str, peer: str, key: str, data: dict) -> str | None:
    """A catch-up group (``protocol.catchup_group``) of step ``t``: rank 0 is the step's onboarding
    source, rank 1 the member ``joiner`` behind it; each writes its own key once."""
    if _step(t) is None or rank not in ("0", "1"):
        return "a catch-up group has two ranks, 0 (the source) and 1 (the member behind)"
    if key in data:
        return "a rank's gloo key is written once"
    members = read_names(data.get(MEMBERS(t, "0"))) or []
    if joiner >= len(members):
        return f"step {t} has no member {joiner}"
    def committed(w: str) -> int:
        return read_count(data.get(COMMITTED(t, w)), 0, int(t)) or 0

    source = onboarding_source(members, lambda w: data.get(COMMITTED(t, w)), int(t))
    if source is None or committed(members[joiner]) >= committed(source):
        return f"member {joiner} of step {t} is not behind"
    want = source if rank == "0" else members[joiner]
    return None if peer == want else f"only {want} writes rank {rank} of that catch-up group"


def retire(key: str, data: dict) -> list[str]:
    """The keys the rendezvous drops after ``key`` was written (``RendezvousServer(prune=retire)``):
    once ``progress`` reaches ``p``, every per-step key of steps before ``p - KEEP_STEPS``, so the
    store holds a bounded number of steps however long the run."""
    if key != PROGRESS():
        return []
    old = (read_count(data.get(key)) or 0) - KEEP_STEPS
    if old <= 0:
        return []
    out = []
    for k in data:
        parts = k.split("/", 2)
        family = FAMILIES.get(parts[0])
        if family is not None and family.fields[:1] == ("step",) and len(parts) > 1 and (t := _step(parts[1])) is not None:
            if t < old:
                out.append(k)
    return out


def _progress(op: str, req: dict, peer: str, data: dict) -> str | None:
    v = read_count(unb64(req.get("value", ""))) if op == "set" else None
    if v is None or v < 1:
        return "progress is set to a positive number of committed steps"
    now = read_count(data.get(PROGRESS()))
    if now is not None and v < now:
        return f"progress does not go back ({now} to {v})"
    if not any(m and m[0] == peer for m in _committed_members(data, v - 1)):
        return f"only the leader of step {v - 1}'s commit sets progress to {v}"
    return None


def scope(peer: str, op: str, req: dict, data: dict, quorum: float = 1.0) -> str | tuple[str, str] | None:
    """The rendezvous write policy (``RendezvousServer(policy=partial(scope, quorum=...))``): None when ``peer``
    may make the write ``op`` (body ``req``) on the table ``data``, else why not. Each key family's
    :class:`~intellect.diloco.protocol.Writer` decides; decisions' values are checked too. ``quorum``: the run's
    ``diloco.quorum``, the members done with a phase before one of them may close it.

    >>> data = {"members/0/0": b'["a", "b"]', "arrive/0/a": b"1", "vote/0/0/a": b"ok"}
    >>> scope("a", "set", {"key": "hb/a"}, data), scope("a", "set", {"key": "hb/b"}, data)
    (None, 'a worker writes only its own hb/ key')
    >>> scope("a", "set", {"key": "banned/b", "value": "MQ=="}, data)
    "banned/ is the coordinator's"
    >>> import base64
    >>> cs = lambda k, v: {"key": k, "expected": "", "desired": base64.b64encode(v).decode()}
    >>> scope("a", "compare_set", cs("outcome/0/0", b"commit"), data)
    >>> scope("b", "compare_set", cs("outcome/0/0", b"abort"), data)  # b has not voted
    "only a member that has voted decides an attempt's outcome"
    >>> scope("a", "compare_set", cs("outcome/0/1", b"abort"), data)  # an attempt nobody agreed on yet
    "only a member that has voted decides an attempt's outcome"
    """
    if peer == COORDINATOR:
        return None
    key = req.get("key")
    if not isinstance(key, str):
        return None  # malformed: the table refuses it
    parts = key.split("/")
    family = parts[0]
    if op == "add" and req.get("amount") == 0:
        return None  # reads a counter and creates nothing
    if BANNED(peer) in data:
        return "banned", f"{peer} was banned from the run: it writes nothing"
    writer = FAMILIES[family].writer if family in FAMILIES else Writer.COORDINATOR
    if writer is Writer.GLOO:
        return _gloo(parts, peer, op, key, data)
    if writer in (Writer.OWN, Writer.ATTEMPT) and FAMILIES[family].fields[:1] == ("step",) and len(parts) > 1:
        if _step(parts[1]) is None:
            return f"{family}: the step is a number"
        if (why := _window(family, parts[1], data)) is not None:
            return why
    if writer in (Writer.ATTEMPT, Writer.DECISION) and len(parts) > 2 and (_step(parts[2]) or 0) >= MAX_SCAN:
        return f"{family}: at most {MAX_SCAN} attempts of a step"
    if writer is Writer.OWN:
        return _own(family, parts, peer, op, req)
    if writer is Writer.ATTEMPT:
        return _in_attempt(family, parts, peer, op, req, data)
    if writer is Writer.DECISION:
        n = len(FAMILIES[family].fields)
        if len(parts) != n + 1:
            return f"{family}/ has {n} numbers"
        if op != "compare_set" or req.get("expected") != "":
            return f"{family}/ is decided once, with compare_set on an empty key"
        if key in data:
            return None  # decided already: the answer is the decision, nothing is written
        return _decision(peer, parts, unb64(req.get("desired", "")), data, quorum)
    if writer is Writer.BAN:
        if len(parts) != 3 or parts[2] != peer or op != "set":
            return "a worker writes only its own ban/<w>/<me> record, with set"
        return None if read_ban(unb64(req.get("value", ""))) is not None else "a ban record is {step, attempt}"
    if writer is Writer.LEADER and key == PROGRESS():
        return _progress(op, req, peer, data)
    return f"{family}/ is the coordinator's"
