"""Slow members (``diloco.quorum`` below 1): a minimum quorum, a grace window from the members' own phase
times, an inner phase the others close, and token-weighted merging. Decoupled DiLoCo's policy on this
project's commit protocol.

Without it a step waits for every member's pseudo-gradient (up to ``boundary_timeout``), so one member twice
as slow makes every step take twice as long for all, and one later than the timeout is dropped with its whole
phase. With it, the wait at an attempt's readiness (:meth:`~intellect.diloco.protocol.Quorum.ready`) goes::

    quorum reached  -> grace window opens: grace_ratio x the median phase time of the members ready
    grace passed    -> CLOSE(t) decided: members still training end their inner phase after the inner step
                       they are in, and bring the pseudo-gradient of the steps they did
    late window     -> whoever is still not ready is absent (dead, stalled): the attempt is retried without it

Each member's ``READY`` record carries the tokens its pseudo-gradient holds and the seconds its phase took
(:func:`ready_record`). Every member scales its own contribution by :func:`token_weights` before the
reduction, so the mean the reduction computes is the token-weighted mean: a member that trained half the
phase counts half. A record cannot buy more than a full phase's weight: tokens are capped at the median of the
records (a minority of liars moves neither the median nor, so, anyone's cap), and an unreadable record
counts as a full phase, as before weighting.

>>> p = StragglerPolicy(quorum=0.5, grace_ratio=0.1, grace_min=0.5, inner_steps=50)
>>> p.needed(4), p.needed(3), p.needed(1)
(2, 2, 1)
>>> ready = [Ready(1000, 20.0), Ready(1000, 30.0), None]
>>> p.grace(ready), p.late(ready, interval=1.0)   # 0.1 x the median 25 s; then + 2 heartbeats + 4 steps of 0.5 s
(2.5, 6.5)
>>> token_weights([Ready(1000, 20.0), Ready(500, 40.0), Ready(10**9, 1.0)])   # the liar is capped at the median
[1.0, 0.5, 1.0]
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

MAX_TOKENS = 1 << 48  # a READY record's tokens above this are no phase's
MAX_SECONDS = 1e7  # nor its seconds
SLOWEST = 4  # the late window lets a member this many times slower than the median finish its inner step


@dataclass(frozen=True)
class Ready:
    """What a member's ``READY`` record says of its pseudo-gradient: the tokens it holds (0: it contributes
    nothing) and the seconds its inner phase took."""

    tokens: int
    seconds: float


def ready_record(tokens: int, seconds: float) -> str:
    """A ``READY`` value.

    >>> ready_record(1024, 3.25), read_ready(ready_record(1024, 3.25))
    ('{"tokens": 1024, "seconds": 3.25}', Ready(tokens=1024, seconds=3.25))
    """
    return json.dumps({"tokens": int(tokens), "seconds": round(float(seconds), 3)})


def read_ready(raw: bytes | str | None) -> Ready | None:
    """A :func:`ready_record` read back; None for anything else (an old ``1``, garbage, out of bounds).

    >>> read_ready(b"1"), read_ready(b'{"tokens": -1, "seconds": 1}'), read_ready(b'{"tokens": 1, "seconds": NaN}')
    (None, None, None)
    """
    try:
        v = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(v, dict):
        return None
    tokens, seconds = v.get("tokens"), v.get("seconds")
    if type(tokens) is not int or not 0 <= tokens <= MAX_TOKENS:
        return None
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds <= MAX_SECONDS:
        return None  # NaN fails both comparisons
    return Ready(tokens, float(seconds))


def token_weights(records: Sequence[Ready | None]) -> list[float]:
    """Each record's weight relative to a full phase: its tokens over the median of the records' tokens,
    at most 1; an unreadable record weighs 1 (a full phase, as an unweighted mean counts it), one that
    contributes nothing 0.

    >>> token_weights([Ready(800, 1.0), Ready(800, 1.0), Ready(0, 0.0)]), token_weights([None, Ready(10, 1.0)])
    ([1.0, 1.0, 0.0], [1.0, 1.0])
    """
    known = [r.tokens for r in records if r is not None and r.tokens > 0]
    full = statistics.median(known) if known else 1
    return [1.0 if r is None else min(1.0, r.tokens / full) for r in records]


def scale_of(weights: Sequence[float], me: int) -> float:
    """The factor member ``me`` multiplies its contribution by so that the reduction's plain mean over the
    ``k`` members that contribute (weight > 0) is the weighted mean: ``k * w_me / sum(w)``.

    >>> scale_of([1.0, 1.0, 0.5], 2), scale_of([1.0, 1.0], 0), scale_of([0.0, 1.0], 0)
    (0.6, 1.0, 0.0)
    """
    live = [w for w in weights if w > 0]
    return len(live) * weights[me] / sum(live) if live and weights[me] > 0 else 0.0


def needed(quorum: float, members: int) -> int:
    """How many of a step's ``members`` make its ``quorum`` (at least one): the members ready before the grace
    window opens, and before the rendezvous lets one of them close the phase.

    >>> needed(0.6, 3), needed(0.5, 4), needed(1.0, 4), needed(0.01, 4)
    (2, 2, 4, 1)
    """
    return max(1, min(members, math.ceil(quorum * members - 1e-9)))


@dataclass(frozen=True)
class StragglerPolicy:
    """``diloco.quorum``, ``grace_ratio``, ``grace_min`` and ``inner_steps`` (H) of
    :class:`~intellect.diloco.config.DilocoConfig`."""

    quorum: float
    grace_ratio: float
    grace_min: float
    inner_steps: int

    def needed(self, members: int) -> int:
        """Members ready before the grace window opens (:func:`needed`)."""
        return needed(self.quorum, members)

    @staticmethod
    def phase_seconds(ready: Sequence[Ready | None]) -> float:
        """The median phase time of the members ready (what their readable records of a phase say; 0: none)."""
        seconds = [r.seconds for r in ready if r is not None and r.tokens > 0]
        return statistics.median(seconds) if seconds else 0.0

    def grace(self, ready: Sequence[Ready | None]) -> float:
        """The grace window once the quorum is ready: ``grace_ratio`` times the median phase time of those
        ready, at least ``grace_min``."""
        return max(self.grace_min, self.grace_ratio * self.phase_seconds(ready))

    def poll(self, heartbeat: float) -> float:
        """How often a member in its inner phase looks for the close: a quarter of the shortest grace window,
        at least 50 ms, at most a heartbeat ``interval``.

        >>> StragglerPolicy(0.5, 0.05, 1.0, 50).poll(2.0), StragglerPolicy(0.5, 0.05, 0.0, 50).poll(2.0)
        (0.25, 0.05)
        """
        return min(heartbeat, max(0.05, self.grace_min / 4))

    def late(self, ready: Sequence[Ready | None], interval: float) -> float:
        """How long after the close a member still training may take to be ready: the grace window again,
        noticing the close (two heartbeat ``interval``) and the inner step it is in, for a member up to
        :data:`SLOWEST` times slower than the median."""
        return self.grace(ready) + 2 * interval + SLOWEST * self.phase_seconds(ready) / self.inner_steps


class Window:
    """The wait of one attempt's readiness under a :class:`StragglerPolicy`: called with the members ready so
    far on every poll, it says when to stop waiting for the rest. ``records(present)`` reads their ``READY``
    records (once, as the quorum is reached), ``close()`` decides ``CLOSE(t)``; ``interval`` is the heartbeat's.
    ``cut`` False: close the phase but never stop the wait (an overlapped run's vote, which needs every member)."""

    def __init__(self, policy: StragglerPolicy, members: int, records: Callable[[list[str]], list[Ready | None]],
                 close: Callable[[], None], interval: float, now: Callable[[], float] = time.monotonic,
                 cut: bool = True):
        self.policy, self.needed, self.records, self.close, self.interval = policy, policy.needed(members), records, close, interval
        self.now, self.cut = now, cut
        self.opened: float | None = None
        self.closed: float | None = None
        self.ready: list[Ready | None] = []

    def __call__(self, present: list[str]) -> bool:
        if len(present) < self.needed:
            return False
        now = self.now()
        if self.opened is None:
            self.opened, self.ready = now, self.records(present)
        if self.closed is None:
            if now < self.opened + self.policy.grace(self.ready):
                return False
            self.close()
            self.closed = now
        return self.cut and now >= self.closed + self.policy.late(self.ready, self.interval)


__all__ = ["Ready", "StragglerPolicy", "Window", "needed", "read_ready", "ready_record", "scale_of", "token_weights"]
