"""The DiLoCo commit protocol: every rendezvous key, declared once, and the quorum that decides a step.

Each key family below is built only through its :class:`Family` (``READY(t, a, w)`` is
``"ready/<t>/<a>/<w>"``); its :class:`Writer` is who may write it, which the rendezvous enforces
(``membership.scope``). ``<t>`` is an outer step, ``<a>`` an attempt of it, ``<w>`` a worker.

One outer step, as :class:`Quorum` runs it: the step's members are proposed once
(``members/<t>/0``, first proposal wins); every member marks ``ready``, computes the attempt's
all-reduce ``plan`` (``plan.settle_plan``), each member votes ``ok`` or ``fail``, and ``outcome``
is decided once: ``commit`` only when every member voted ``ok`` (:meth:`Quorum.should_commit`), else everyone
discards and retries as attempt ``a + 1`` with the survivors (``members/<t>/<a+1>``).

Every decision is a ``compare_set`` on an empty key, so the first proposal wins and every worker
reads the same answer: no leader, no split brain. Every number or list a peer writes is read
through :func:`read_count` / :func:`read_names`, so a malformed value is ignored, never raised on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Iterable, Protocol, Sequence


class Writer(StrEnum):
    """Who may write a family's keys (``membership.scope`` turns this into the rendezvous policy)."""

    OWN = "own"  # only the worker the key names (its last part), with set (hb/: add)
    ATTEMPT = "attempt"  # only the worker the key names, as a member of attempt <t>/<a>
    DECISION = "decision"  # compare_set on an empty key by one taking part; first wins
    BAN = "ban"  # ban/<w>/<by>: only <by>, a {"step", "attempt"} record
    LEADER = "leader"  # the first member of the commit the value names
    COORDINATOR = "coordinator"  # the coordinator alone
    GLOO = "gloo"  # a group's gloo rendezvous: rank r's key, once, by the attempt's r-th member (membership._gloo)


@dataclass(frozen=True)
class Family:
    """A key family: ``name/<field>/<field>...``.

    >>> READY(3, 0, "w1"), READY.under(3, 0), PROGRESS(), LAUNCHED.under()
    ('ready/3/0/w1', 'ready/3/0', 'progress', 'launched')
    """

    name: str
    fields: tuple[str, ...]
    writer: Writer
    doc: str

    def __call__(self, *parts: object) -> str:
        if len(parts) != len(self.fields):
            raise TypeError(f"{self.name}/ keys take {self.fields}, not {parts}")
        return "/".join((self.name, *map(str, parts)))

    def under(self, *parts: object) -> str:
        """The prefix of the keys whose first fields are ``parts`` (what ``wait_for_keys`` takes)."""
        if len(parts) >= len(self.fields):
            raise TypeError(f"a prefix of {self.name}/ takes fewer than {len(self.fields)} parts")
        return "/".join((self.name, *map(str, parts)))


W, D, A = Writer.OWN, Writer.DECISION, Writer.ATTEMPT
LAUNCHED = Family("launched", ("index",), Writer.COORDINATOR,
                  "the index-th worker the coordinator admitted; ``launched`` itself counts them. Admission "
                  "order, never the names' sort order, ranks members: the first admitted live member leads")
START = Family("start", (), Writer.COORDINATOR, "the outer step the founders begin at (the newest checkpoint)")
BANNED = Family("banned", ("worker",), Writer.COORDINATOR,
                "a majority of an attempt's members recorded ban/<worker>/: never a member again")
HB = Family("hb", ("worker",), W, "heartbeat counter, bumped every heartbeat_interval s")
DEAD = Family("dead", ("worker",), W, "deathrattle, written on clean exit and on SIGTERM")
COMMITTED = Family("committed", ("step", "worker"), W, "outer steps <worker> had committed at boundary <step>")
ARRIVE = Family("arrive", ("step", "worker"), W, "<worker> is at the boundary of outer step <step>")
DATA_AT = Family("data_at", ("step", "worker"), W, "<worker>'s reading position at boundary <step> and its rows "
                 "per outer step (diloco.data.position_claim), written as its inner phase of <step> - 1 ends "
                 "(before the all-reduce) and again before it arrives")
LEFT = Family("left", ("step", "worker"), W, "<worker> was left out of <step> and rejoins later: do not wait for it")
DIGEST = Family("digest", ("step", "worker"), W, "SHA-256 of theta_sync after committing <step>")
METRICS = Family("metrics", ("step", "worker"), W, "<worker>'s report of <step> (report.StepReport, JSON)")
READY = Family("ready", ("step", "attempt", "worker"), A, "<worker> holds its pseudo-gradient for the attempt: the tokens "
               "it holds and the seconds its phase took (stragglers.ready_record)")
VOTE = Family("vote", ("step", "attempt", "worker"), A, "``ok`` or ``fail`` after the all-reduce")
FLAGS = Family("flags", ("step", "attempt", "worker"), A, "the members <worker> found outliers (JSON list)")
BLAME = Family("blame", ("step", "attempt", "worker"), A, "the owners whose results <worker> refused (JSON list)")
MEMBERS = Family("members", ("step", "attempt"), D, "the members of the attempt (JSON list, admission order)")
PLAN = Family("plan", ("step", "attempt"), D, "the attempt's all-reduce as first proposed: {algorithm, order, "
              "estimates}. Only a member that cannot compute it (one that missed the bandwidth probe) runs "
              "it; every other member runs its own computation and refuses one that differs (plan.settle_plan)")
OUTCOME = Family("outcome", ("step", "attempt"), D, "``commit`` or ``abort``")
PROBE = Family("probe", ("step",), D, "``yes`` or ``no``: whether the step's members measure bandwidth")
CLOSE = Family("close", ("step",), D, "``1``: the step's quorum was ready and its grace window passed: members still "
               "in their inner phase end it after the inner step they are in (diloco.stragglers)")
BAN = Family("ban", ("worker", "by"), Writer.BAN, "<by> counted <worker> an outlier in too many steps")
PROGRESS = Family("progress", (), Writer.LEADER, "the number of committed outer steps (JSON)")
PG = Family("pg", ("step", "group"), Writer.GLOO, "prefix of a process group's gloo rendezvous")
BW = Family("bw", ("step",), Writer.GLOO, "prefix of the bandwidth probe's columns")
del W, D, A

FAMILIES: dict[str, Family] = {f.name: f for f in globals().values() if isinstance(f, Family)}
MAX_SCAN = 1024  # attempts of one step looked through when checking a claim about them
BOUNDARY_GROUPS = ("onboard", "bw")  # groups of a step's members (members/<t>/0) besides its attempts'
BEHIND, AHEAD = 4, 2  # a member writes per-step keys for steps progress - BEHIND .. progress + AHEAD only
KEEP_STEPS = 16  # once progress passes t + KEEP_STEPS, the rendezvous drops step t's keys


# ---------------------------------------------------------------------- reading what peers wrote


def read_json(raw: bytes | str | None):
    try:
        return None if raw is None else json.loads(raw)
    except ValueError:
        return None


def read_count(raw, lo: int = 0, hi: int = 1 << 40) -> int | None:
    """``raw`` as an integer in ``[lo, hi]`` (a JSON number or its text), else None.

    >>> read_count(b"3"), read_count("x"), read_count(b"1e9"), read_count(b"10", hi=5), read_count(True)
    (3, None, None, None, None)
    """
    v = read_json(raw) if isinstance(raw, (bytes, str)) else raw
    return v if type(v) is int and lo <= v <= hi else None


def read_names(raw, cap: int = 4096) -> list[str] | None:
    """A JSON list of distinct worker names, else None.

    >>> read_names(b'["w0", "w1"]'), read_names(b'["w0", "w0"]'), read_names(b'{"a": 1}'), read_names(b"[")
    (['w0', 'w1'], None, None, None)
    """
    v = read_json(raw) if isinstance(raw, (bytes, str)) else raw
    if not (isinstance(v, list) and len(v) <= cap and all(isinstance(w, str) and 0 < len(w) <= 64 for w in v)):
        return None
    return v if len(set(v)) == len(v) else None


def onboarding_source(members: list[str], committed: Callable[[str], object], step: int) -> str | None:
    """The member that hands its state to those behind at step ``step``'s boundary: one of those
    furthest ahead (``committed(w)``: the ``COMMITTED`` record of ``w``, taken as a count up to the
    step; unreadable counts as 0), in turn by step among them in name order, so a source whose state a
    joiner refuses (it lied) is not the one it asks at the next boundary; None when nobody is behind.
    The workers and the rendezvous (who may write the catch-up groups' keys) compute it alike.

    >>> records = {"w0": "3", "w1": "3", "w2": "1"}
    >>> onboarding_source(["w0", "w1", "w2"], records.get, 4), onboarding_source(["w0", "w1", "w2"], records.get, 5)
    ('w0', 'w1')
    >>> onboarding_source(["w0", "w1"], {"w0": "3", "w1": "3"}.get, 3) is None
    True
    """
    progress = {w: read_count(committed(w), 0, step) or 0 for w in members}
    newest = max(progress.values(), default=0)
    if not progress or min(progress.values()) == newest:
        return None
    ahead = sorted(w for w in members if progress[w] == newest)
    return ahead[step % len(ahead)]


def agreed_digest(records: Sequence[object]) -> str | None:
    """The ``DIGEST`` a strict majority of ``records`` (the records of the members the onboarding
    source is one of, unreadable ones included) hold, else None: what a worker behind checks the
    state it receives against, so a source that sends other weights than the ones it and the others
    committed is refused.

    >>> a, b = "a" * 64, "b" * 64
    >>> agreed_digest([a, a, b]) == a, agreed_digest([a, b]), agreed_digest([a, None, None]), agreed_digest([a])
    (True, None, None, 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa')
    """
    held = [read_digest(r) for r in records]
    for d in set(held) - {None}:
        if 2 * held.count(d) > len(held):
            return d
    return None


def read_digest(raw) -> str | None:
    """A SHA-256 hex digest (a ``DIGEST`` record), else None.

    >>> read_digest(b"0" * 64) == "0" * 64, read_digest("x" * 64), read_digest(b"0" * 65)
    (True, None, None)
    """
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    return text if isinstance(text, str) and _HEX64.match(text) else None


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def catchup_group(joiner: int) -> str:
    """The boundary group in which the onboarding source sends its state to member ``joiner`` (its
    index in the step's members) while the others train (``diloco.onboarding = "non_blocking"``): rank 0
    the source, rank 1 the joiner.

    >>> catchup_group(2), CATCHUP_GROUP.match("catchup2").group(1)
    ('catchup2', '2')
    """
    return f"catchup{joiner}"


CATCHUP_GROUP = re.compile(r"^catchup(0|[1-9][0-9]{0,3})$")


def ban_record(step: int, attempt: int) -> str:
    return json.dumps({"step": step, "attempt": attempt})


def read_ban(raw) -> tuple[int, int] | None:
    """A :func:`ban_record` read back: ``(step, attempt)``, else None."""
    record = read_json(raw)
    if not isinstance(record, dict):
        return None
    step, attempt = read_count(record.get("step")), read_count(record.get("attempt"))
    return None if step is None or attempt is None else (step, attempt)


def ban_votes(get: Callable[[str], bytes | None], worker: str, voters: Iterable[str]) -> bool:
    """Whether a majority of the members of some attempt recorded a ban of ``worker``
    (``BAN(worker, voter)``); ``get(key)`` reads a key (None: absent). A record counts only from
    a member of the attempt it names, so one peer bans nobody."""
    by_attempt: dict[tuple[int, int], set[str]] = {}
    for v in voters:
        record = read_ban(get(BAN(worker, v))) if v != worker else None
        if record is not None:
            by_attempt.setdefault(record, set()).add(v)
    for (t, a), who in by_attempt.items():
        members = read_names(get(MEMBERS(t, a))) or []
        if worker in members and 2 * len(who & set(members)) > len(members):
            return True
    return False


# ---------------------------------------------------------------------- the quorum of one step


class Board(Protocol):
    """The rendezvous as a worker sees it (``membership.Membership``)."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> str: ...
    def has(self, key: str) -> bool: ...
    def decide(self, key: str, proposal: str) -> str: ...
    def try_decide(self, key: str, proposal: str) -> str | None: ...
    def wait_for_keys(self, prefix: str, workers: Iterable[str], deadline: float, step: int | None = None,
                      until: Callable[[], bool] | None = None,
                      cutoff: Callable[[list[str]], bool] | None = None) -> tuple[list[str], list[str]]: ...


class Quorum:
    """Worker ``me``'s part in the agreement of outer step ``step``; every wait ends at a deadline
    (monotonic seconds), and a member that dies or leaves the step counts as absent."""

    def __init__(self, board: Board, me: str, step: int):
        self.board, self.me, self.step = board, me, step

    def members(self, attempt: int = 0) -> list[str] | None:
        """The decided members of ``attempt`` (None: not decided yet)."""
        key = MEMBERS(self.step, attempt)
        return read_names(self.board.get(key)) if self.board.has(key) else None

    def propose_members(self, attempt: int, workers: list[str]) -> list[str]:
        """Propose ``workers`` in admission order (duplicates dropped; ranks and the leader follow
        it, so a name chosen to sort first gains nothing); the decided members."""
        return json.loads(self.board.decide(MEMBERS(self.step, attempt), json.dumps(list(dict.fromkeys(workers)))))

    def ready(self, attempt: int, members: list[str], deadline: float, record: str = "1",
              cutoff: Callable[[list[str]], bool] | None = None) -> tuple[list[str], list[str]]:
        """Mark ``me`` ready (``record``: :func:`~intellect.diloco.stragglers.ready_record`) and wait for the
        other members, or until ``cutoff(present)`` says to stop (:class:`~intellect.diloco.stragglers.Window`);
        ``(present, absent)``."""
        self.board.set(READY(self.step, attempt, self.me), record)
        retried = MEMBERS(self.step, attempt + 1)
        present, absent = self.board.wait_for_keys(READY.under(self.step, attempt), members, deadline, step=self.step,
                                                   until=lambda: self.board.has(retried), cutoff=cutoff)
        if self.board.has(retried):  # the others went on without waiting for us: this attempt is over
            return [w for w in present if w != self.me], [self.me]
        return present, absent

    def close(self) -> None:
        """Decide ``CLOSE(step)``: the members still training end their phase. The rendezvous may count the
        quorum otherwise (the step's members, not this attempt's): then the phase goes on, as with quorum 1."""
        self.board.try_decide(CLOSE(self.step), "1")

    def plan(self, attempt: int, proposal: dict) -> object:
        """The attempt's decided all-reduce plan, parsed JSON, unchecked: ``proposal`` or the one a peer
        decided before it (``plan.settle_plan`` decides what runs)."""
        return read_json(self.board.decide(PLAN(self.step, attempt), json.dumps(proposal)))

    def report(self, attempt: int, flagged: list[str] | None = None, blamed: list[str] | None = None) -> None:
        """Record the members ``me`` found outliers (before the vote, so whoever sees the commit can
        read every member's report) or the owners whose results it refused."""
        if flagged is not None:
            self.board.set(FLAGS(self.step, attempt, self.me), json.dumps(flagged))
        if blamed is not None:
            self.board.set(BLAME(self.step, attempt, self.me), json.dumps(blamed))

    def reports(self, family: Family, attempt: int, members: list[str]) -> dict[str, list[str]]:
        """The ``FLAGS`` or ``BLAME`` records of ``members`` for the attempt (unreadable ones: empty)."""
        keys = {w: family(self.step, attempt, w) for w in members}
        return {w: read_names(self.board.get(k)) or [] for w, k in keys.items() if self.board.has(k)}

    def vote(self, attempt: int, ok: bool, members: list[str], deadline: float,
             watch: Callable[[list[str]], bool] | None = None) -> bool:
        """Vote and wait for the others' votes (``watch(voted)`` sees who voted at every look); whether every
        member voted ok."""
        self.board.set(VOTE(self.step, attempt, self.me), "ok" if ok else "fail")
        _, missing = self.board.wait_for_keys(VOTE.under(self.step, attempt), members, deadline, step=self.step,
                                              cutoff=watch)
        return not missing and all(self.board.get(VOTE(self.step, attempt, w)) == "ok" for w in members)

    def voted(self, attempt: int, members: list[str]) -> list[str]:
        """The members whose vote on the attempt is in."""
        return [w for w in members if self.board.has(VOTE(self.step, attempt, w))]

    def decide(self, attempt: int, all_ok: bool) -> bool:
        """The attempt's outcome, decided once: True for commit."""
        return self.board.decide(OUTCOME(self.step, attempt), "commit" if all_ok else "abort") == "commit"

    def should_commit(self, attempt: int, ok: bool, members: list[str], deadline: float,
                      watch: Callable[[list[str]], bool] | None = None) -> bool:
        """:meth:`vote` then :meth:`decide`: whether everyone commits the attempt."""
        return self.decide(attempt, self.vote(attempt, ok, members, deadline, watch))
