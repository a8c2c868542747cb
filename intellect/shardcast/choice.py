"""Which relay a downloader asks for the next shard, and what it learns from each try.

:func:`pick` draws a relay at random, weighted by EMA(success) x EMA(bandwidth) and divided by 1 + the
downloader's tries in flight there. :class:`Scheduler` holds one downloader's scores, its tries in
flight and the relays each shard was tried from; the client and each relay own one.

INTELLECT-2's rule, with the units kept straight. Each relay carries an exponential moving average
of its success rate (0..1) and of the bandwidth it delivered (bytes/s, from successful downloads
only). After every observation all relays *heal*: their success rate moves up by ``heal`` (capped
at 1), so a relay that failed is tried again after a while instead of being starved forever. A
relay not measured yet gets the best bandwidth measured so far, so a new relay is tried early.

A failed observation is one sample of success = 0 and nothing else (:func:`observe_failure` takes
no duration). How long a try took to fail says nothing about the relay's speed: a refused
connection fails at once, a missed deadline after the whole budget, a mismatched shard after every
byte came at full speed. Folding that time into the bandwidth would reward fast failures and count
a slow one twice (INTELLECT-2's package records its timeout in seconds as a bandwidth).

>>> scores = {"a": RelayScore(), "b": RelayScore()}
>>> observe_success(scores, "a", nbytes=100e6, seconds=1.0, alpha=0.5, heal=0.0)
>>> observe_failure(scores, "b", alpha=0.5, heal=0.0)
>>> scores["a"].bandwidth, scores["b"].success, scores["b"].bandwidth
(100000000.0, 0.5, None)
>>> weights(scores)  # b: success 0.5 x the best known bandwidth
{'a': 100000000.0, 'b': 50000000.0}
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

# Weight of a relay whose every observation failed and that has not healed yet: never exactly 0,
# so a client whose relays all failed once still picks one instead of dividing by zero.
_FLOOR = 1e-6


@dataclass
class RelayScore:
    success: float = 1.0
    bandwidth: float | None = None  # bytes/s; None: not measured yet
    picks: int = 0
    failures: int = 0


def observe_success(scores: dict[str, RelayScore], relay: str, *, nbytes: float, seconds: float,
                    alpha: float, heal: float) -> None:
    """Fold one download of ``nbytes`` in ``seconds`` from ``relay`` into the scores, then heal every relay."""
    s = scores[relay]
    s.picks += 1
    s.success = alpha + (1 - alpha) * s.success
    bw = nbytes / max(seconds, 1e-6)
    s.bandwidth = bw if s.bandwidth is None else alpha * bw + (1 - alpha) * s.bandwidth
    _heal(scores, heal)


def observe_failure(scores: dict[str, RelayScore], relay: str, *, alpha: float, heal: float) -> None:
    """Fold one failure of ``relay`` into its success rate (its bandwidth stays), then heal every relay."""
    s = scores[relay]
    s.picks += 1
    s.success = (1 - alpha) * s.success
    s.failures += 1
    _heal(scores, heal)


def _heal(scores: dict[str, RelayScore], heal: float) -> None:
    for s in scores.values():
        s.success = min(1.0, s.success + heal)


def weights(scores: Mapping[str, RelayScore]) -> dict[str, float]:
    """Each relay's pick weight: success x bandwidth (unmeasured bandwidth: the best measured, or 1)."""
    known = [s.bandwidth for s in scores.values() if s.bandwidth is not None]
    prior = max(known) if known else 1.0
    return {r: max(s.success * (s.bandwidth if s.bandwidth is not None else prior), _FLOOR)
            for r, s in scores.items()}


def pick(scores: Mapping[str, RelayScore], candidates: Iterable[str], rng: random.Random,
         load: Mapping[str, int] | None = None) -> str:
    """One of ``candidates`` (relays that advertise the shard), drawn with probability proportional to its
    weight divided by 1 + ``load[relay]``, the picker's downloads in flight from that relay.

    The division spreads one client's parallel downloads over its relays. Without it they pile on
    whichever relay measured fastest a few seconds ago; its downloads then slow down, the other relay
    idles unmeasured, and a client's last shards can all wait on one relay while the other has nothing
    to do.

    >>> s = {"fast": RelayScore(bandwidth=9.0), "slow": RelayScore(bandwidth=1.0)}
    >>> rng = random.Random(0)
    >>> sum(pick(s, ["fast", "slow"], rng) == "fast" for _ in range(1000))  # ~900
    896
    >>> sum(pick(s, ["fast", "slow"], rng, load={"fast": 8}) == "fast" for _ in range(1000))  # 9/9 : 1/1, ~500
    491
    """
    cands = sorted(candidates)
    if not cands:
        raise ValueError("no relay to pick from")
    w = weights({r: scores[r] for r in cands})
    load = load or {}
    return rng.choices(cands, weights=[w[r] / (1 + load.get(r, 0)) for r in cands])[0]


@dataclass
class Try:
    """One download of shard ``key`` from ``relay``, started at ``started`` (``time.monotonic()``)."""

    key: Hashable
    relay: str
    started: float
    open: bool = True


class Scheduler:
    """One downloader's relay choice: the relays' scores, its tries in flight on each, and which relays
    each shard (any hashable ``key``) was tried from. Thread-safe.

    Each :meth:`start` is closed by one of :meth:`succeeded`, :meth:`failed` (a failure of the relay)
    or :meth:`abandon` (the downloader gave up: nothing learned); a second close of the same try does
    nothing. A retry goes to a relay the shard was not tried from while there is one.

    >>> sched = Scheduler(["a", "b"], alpha=0.5, heal=0.0, seed=1)
    >>> t = sched.start("s0", ["a", "b"])
    >>> t.relay, dict(sched.load)
    ('a', {'a': 1})
    >>> sched.failed(t), dict(sched.load), sched.scores["a"].success  # tries of s0 so far
    (1, {'a': 0}, 0.5)
    >>> sched.start("s0", ["a", "b"]).relay
    'b'
    """

    def __init__(self, relays: Iterable[str], *, alpha: float, heal: float, seed: int | None = None):
        self.scores = {r: RelayScore() for r in relays}
        self.load: Counter[str] = Counter()  # tries in flight on each relay
        self.alpha, self.heal = alpha, heal
        self._rng = random.Random(seed)
        self._tried: dict[Hashable, set[str]] = {}
        self._tries: Counter[Hashable] = Counter()
        self._lock = threading.Lock()

    def start(self, key: Hashable, candidates: Iterable[str]) -> Try:
        """Pick the relay to download ``key`` from, among ``candidates``, and count the try in flight."""
        cands = list(candidates)
        with self._lock:
            tried = self._tried.setdefault(key, set())
            relay = pick(self.scores, [r for r in cands if r not in tried] or cands, self._rng, self.load)
            self.load[relay] += 1
            tried.add(relay)
            self._tries[key] += 1
        return Try(key, relay, time.monotonic())

    def succeeded(self, t: Try, nbytes: float) -> None:
        with self._lock:
            if self._close(t):
                observe_success(self.scores, t.relay, nbytes=nbytes, seconds=time.monotonic() - t.started,
                                alpha=self.alpha, heal=self.heal)

    def failed(self, t: Try) -> int:
        """Record a failed try; returns how many tries ``t.key`` has had."""
        with self._lock:
            if self._close(t):
                observe_failure(self.scores, t.relay, alpha=self.alpha, heal=self.heal)
            return self._tries[t.key]

    def abandon(self, t: Try) -> None:
        with self._lock:
            self._close(t)

    def penalize(self, relay: str) -> None:
        """A failure outside a download (a listing past its deadline, a lie): counted as a failed try."""
        with self._lock:
            observe_failure(self.scores, relay, alpha=self.alpha, heal=self.heal)

    def tries(self, key: Hashable) -> int:
        with self._lock:
            return self._tries[key]

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop what is known of these shards' tries (they are held, or no longer wanted)."""
        with self._lock:
            for k in keys:
                self._tried.pop(k, None)
                self._tries.pop(k, None)

    def _close(self, t: Try) -> bool:
        if not t.open:
            return False
        t.open = False
        self.load[t.relay] -= 1
        return True
