"""Which relay a client asks for the next shard: random, weighted by EMA(success) x EMA(bandwidth),
divided by 1 + the client's downloads in flight from that relay (:func:`pick`).

INTELLECT-2's rule, with the units kept straight. Each relay carries an exponential moving average
of its success rate (0..1) and of the bandwidth it delivered (bytes/s, from successful downloads
only: a failure says nothing about speed, so it moves the success rate and leaves the bandwidth
alone; the package records its timeout in seconds as a bandwidth). After every observation all
relays *heal*: their success rate moves up by ``heal`` (capped at 1), so a relay that failed is
tried again after a while instead of being starved forever. A relay not measured yet gets the best
bandwidth measured so far, so a new relay is tried early.

>>> scores = {"a": RelayScore(), "b": RelayScore()}
>>> observe(scores, "a", ok=True, nbytes=100e6, seconds=1.0, alpha=0.5, heal=0.0)
>>> observe(scores, "b", ok=False, nbytes=0, seconds=30.0, alpha=0.5, heal=0.0)
>>> scores["a"].bandwidth, scores["b"].success, scores["b"].bandwidth
(100000000.0, 0.5, None)
>>> weights(scores)  # b: success 0.5 x the best known bandwidth
{'a': 100000000.0, 'b': 50000000.0}
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Mapping

# Weight of a relay whose every observation failed and that has not healed yet: never exactly 0,
# so a client whose relays all failed once still picks one instead of dividing by zero.
_FLOOR = 1e-6


@dataclass
class RelayScore:
    success: float = 1.0
    bandwidth: float | None = None  # bytes/s; None: not measured yet
    picks: int = 0
    failures: int = 0


def observe(scores: dict[str, RelayScore], relay: str, *, ok: bool, nbytes: float, seconds: float,
            alpha: float, heal: float) -> None:
    """Fold one download attempt from ``relay`` into the scores, then heal every relay."""
    s = scores[relay]
    s.picks += 1
    s.success = alpha * (1.0 if ok else 0.0) + (1 - alpha) * s.success
    if ok:
        bw = nbytes / max(seconds, 1e-6)
        s.bandwidth = bw if s.bandwidth is None else alpha * bw + (1 - alpha) * s.bandwidth
    else:
        s.failures += 1
    for other in scores.values():
        other.success = min(1.0, other.success + heal)


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
    to do (WAN testbed, 2 relays, 4 clients: one uplink idle for seconds at a time).

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
