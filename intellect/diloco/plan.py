"""Planning the DiLoCo all-reduce (pure: no process group, no I/O): its algorithms, how tensors
are cut into buckets and chunks, and the cost model that picks an algorithm for a membership.

The executor (``allreduce.all_reduce_mean``) flattens each bucket (e.g. one layer:
``layer_buckets``) and splits it into W chunks (``chunk_bounds``); chunk c is owned by ring
position c, i.e. rank ``order[c]``. The owner divides its fp32 sum by the number of
contributors and quantizes the mean once; the all-gather moves those exact bytes, so every
rank ends bit-identical. This module says which messages each algorithm sends
(``relay_counts``, ``link_chunks``), how many bytes (``payload_bytes``), how long the busiest
link takes (``estimate_seconds``), and which algorithm to run on a probed bandwidth matrix
(``choose_algorithm``).

Algorithms (``ALGORITHMS``):

* ``"direct"`` (the executor's default): each rank sends its quantized chunk c straight to
  owner c, and each owner sends its result straight to every rank (one exchange per phase).
  Every value is quantized twice (as a contribution, as the result), and the bytes equal the
  classic ring's. Not neighbour-only: each ordered pair carries two chunks per bucket (2/W of
  the bucket), where a ring pushes 2(W-1) chunks over each ring link, so on a mesh of equal
  links it needs 1/(W-1) of a ring's time (per-host uplinks: the same time, the bytes per host
  are equal), unless the network is itself ring-shaped. The cost: with one slow pair the
  exchange crosses it too; there ``"ring-owner"`` on the solved ring is faster. A worker's
  ``diloco.algorithm = "auto"`` (its config's default) makes that choice per membership from
  the probed bandwidths: ``choose_algorithm`` compares the two algorithms' link-bandwidth bounds.
* ``"ring-residual"``: classic ring, but each hop sends its fp32 partial sum as int8 plus int8
  of the residual that missed: the partial sums stay ~16-bit accurate, so only the owner's
  final quantization counts. Neighbour-only, lowest error, 1.5x the bytes at any W.
* ``"ring-owner"``: each hop relays the ORIGINAL contribution bytes it received and appends
  its own; the owner decodes each once. Two quantizations, as ``"direct"``, neighbour-only, but
  hop s carries s+1 contributions: W(W-1)/2 chunk messages instead of W-1. Fewest bytes of the
  neighbour-only accurate options for W <= 3 (same as residual at W = 4, more above).
* ``"ring"``: classic ring; each hop requantizes the fp32 partial sum (PRIME's reduce-scatter),
  so error compounds with W. Fewest bytes, neighbour-only. ``relay=k`` interpolates to
  ``"ring-owner"``: requantize only when a message would exceed k contributions.

Which of them a worker may run (``settle_plan``). Robust aggregation (``robust.py``) needs the
owner of each chunk to see every contribution as its member sent it: ``"direct"`` and
``"ring-owner"`` (``SCREENED``). A ring of partial sums hides them, and a sum cannot be clipped
per member after the fact, so ``"ring"`` and ``"ring-residual"`` are never chosen by ``"auto"``,
never taken from a peer, and a worker's config may name them only with ``diloco.outlier_clip = 0``
(robust aggregation off: every member trusted).

Compression (``COMPRESSIONS``). ``"int8"`` (the default) is all of the above. ``"fp32"`` sends
the values as they are (``quantize.values_to_bytes``: 4 bytes each, about 4x int8's bytes on
large chunks): every algorithm's messages and links stay the same, the owner's fp32 sum over
contributors is exact up to fp32 summation order, and so is the mean every rank decodes from
the owner's bytes (bit-identical on all ranks). Nothing is lost per hop, so ``"ring-residual"``
sends no residual (``stages``) and equals ``"ring"``. For equivalence checks (a worker sharded
over M ranks reduces other chunks than an unsharded one, which changes int8 rounding but not
fp32 sums beyond their order) and as the full-precision baseline of the compression work.

INTELLECT-1's own scheme (``"ring"`` plus requantization at every all-gather hop) is a baseline
for benchmarks only: ``benchmarks/prime_allreduce.py``. Its excess error over ``"direct"`` is
all in the reduce-scatter: requantizing decoded int8 values is lossless with this quantizer.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from intellect.diloco.quantize import values_nbytes, wire_nbytes
from intellect.diloco.ring_order import ring_order

__all__ = [
    "ALGORITHMS",
    "COMPRESSIONS",
    "SCREENED",
    "fallback_plan",
    "own_plan",
    "read_plan",
    "settle_plan",
    "allreduce_plan",
    "AUTO_CANDIDATES",
    "choose_algorithm",
    "chunk_bounds",
    "chunk_nbytes",
    "estimate_seconds",
    "layer_buckets",
    "link_chunks",
    "payload_bytes",
    "relay_counts",
    "relay_limit",
    "stages",
]

ALGORITHMS = ("direct", "ring-owner", "ring-residual", "ring")
AUTO_CANDIDATES = ("direct", "ring-owner")
SCREENED = ("direct", "ring-owner")  # owners see each contribution as sent: robust aggregation applies
COMPRESSIONS = ("int8", "fp32")  # what a value costs on the wire: a codebook index, or itself


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous chunks whose sizes differ by at most 1.

    >>> chunk_bounds(10, 4)
    [(0, 2), (2, 5), (5, 7), (7, 10)]
    >>> chunk_bounds(2, 3)
    [(0, 0), (0, 1), (1, 2)]
    """
    if parts < 1 or n < 0:
        raise ValueError(f"chunk_bounds: need n >= 0 and parts >= 1, got {n}, {parts}")
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


_INT = re.compile(r"\d+")


def layer_buckets(names: Sequence[str]) -> list[list[int]]:
    """Indices of consecutive parameters grouped by the first integer in their name
    (PRIME's layer cut); names without one group with their unnumbered neighbours.

    >>> layer_buckets(["embed.w", "layers.0.q", "layers.0.k", "layers.1.q", "norm.w", "head.w"])
    [[0], [1, 2], [3], [4, 5]]
    """
    out: list[list[int]] = []
    prev: object = object()
    for i, name in enumerate(names):
        m = _INT.search(name)
        key = m.group() if m else None
        if key != prev:
            out.append([])
            prev = key
        out[-1].append(i)
    return out


def relay_counts(contributes: Sequence[bool], relay: int) -> list[int]:
    """Pieces in each reduce-scatter message along one chunk's chain of senders.

    A sender appends its own quantized contribution to the pieces it received,
    unless that would exceed ``relay`` pieces: then it sums them in fp32 with
    its contribution and sends one requantized piece. Non-contributors forward.

    >>> relay_counts([1, 1, 1, 1], 1)   # classic ring: one requantized partial sum
    [1, 1, 1, 1]
    >>> relay_counts([1, 1, 1, 1], 4)   # ring-owner: every contribution as sent
    [1, 2, 3, 4]
    >>> relay_counts([1, 0, 1, 1, 1], 2)
    [1, 1, 2, 1, 2]
    """
    k, out = 0, []
    for f in contributes:
        if f:
            k = 1 if k + 1 > relay else k + 1
        out.append(k)
    return out


def chunk_nbytes(numel: int, compression: str = "int8") -> int:
    """Bytes of one raw chunk message of ``numel`` values (``quantize.wire_nbytes``, or
    ``quantize.values_nbytes`` for ``"fp32"``); an empty chunk is skipped, not sent.

    >>> chunk_nbytes(0), chunk_nbytes(4) == wire_nbytes(4), chunk_nbytes(4, "fp32")
    (0, True, 32)
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
    if not numel:
        return 0
    return wire_nbytes(numel) if compression == "int8" else values_nbytes(numel)


def stages(algorithm: str, compression: str = "int8") -> int:
    """Messages per reduce-scatter piece: 2 for int8 ``"ring-residual"`` (the partial sum and
    what its quantization missed), else 1 (fp32 misses nothing).

    >>> stages("ring-residual"), stages("ring-residual", "fp32"), stages("ring")
    (2, 1, 1)
    """
    return 2 if algorithm == "ring-residual" and compression == "int8" else 1


def payload_bytes(numels: Sequence[int], world: int, position: int, algorithm: str, relay: int | None = None,
                  compression: str = "int8") -> int:
    """Payload bytes sent by ring position ``position`` when every rank contributes,
    with raw indices (``codec="none"``; coded messages are at most this).

    >>> payload_bytes([8], 2, 0, "ring") == 2 * wire_nbytes(4)
    True
    >>> payload_bytes([8], 2, 0, "ring-owner") == payload_bytes([8], 2, 0, "direct")
    True
    >>> payload_bytes([8], 2, 0, "ring-residual", compression="fp32") == 2 * values_nbytes(4)
    True
    """
    relay = relay_limit(algorithm, relay, world)
    total = 0
    for n in numels:
        w = [chunk_nbytes(e - s, compression) for s, e in chunk_bounds(n, world)]
        p = position
        if algorithm == "direct":  # own chunk to every other rank, twice (contribution, result)
            total += sum(w) - w[p] + (world - 1) * w[p]
            continue
        ag = sum(w) - w[(p + 1) % world]  # ring all-gather: all but the chunk owned by next
        reduce_scatter = sum((s % relay + 1) * w[(p - s - 1) % world] for s in range(world - 1))
        total += stages(algorithm, compression) * reduce_scatter + ag
    return total


def relay_limit(algorithm: str, relay: int | None, world: int) -> int:
    """Most contributions one reduce-scatter message carries (``relay_counts``): ``relay``
    if given (ring algorithms only), else W-1 for ``"ring-owner"`` and 1 otherwise.
    Raises ``ValueError`` on an unknown algorithm or a bad ``relay``.

    >>> relay_limit("ring-owner", None, 4), relay_limit("ring", None, 4), relay_limit("ring", 2, 4)
    (3, 1, 2)
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if relay is not None:
        if algorithm not in ("ring", "ring-owner") or relay < 1:
            raise ValueError(f"relay={relay!r} needs a ring algorithm and relay >= 1")
        return relay
    return max(world - 1, 1) if algorithm == "ring-owner" else 1


def link_chunks(algorithm: str, order: Sequence[int], relay: int | None = None,
                compression: str = "int8") -> dict[tuple[int, int], int]:
    """Chunk messages (each 1/W of a bucket) every directed link (sender, receiver)
    carries per bucket when every rank contributes; links not listed carry none.

    ``"direct"``: every ordered pair, two chunks (a contribution, a result). Ring
    algorithms: only ``order``'s links, each carrying its reduce-scatter pieces
    (``relay_counts``, doubled for the residual) plus W-1 all-gather chunks.

    >>> link_chunks("direct", [0, 1, 2])[(2, 0)]
    2
    >>> link_chunks("ring-owner", [0, 2, 1, 3])   # 1+2+3 relayed pieces + 3 gathered
    {(0, 2): 9, (2, 1): 9, (1, 3): 9, (3, 0): 9}
    """
    W = len(order)
    relay = relay_limit(algorithm, relay, W)
    if W < 2:
        return {}
    if algorithm == "direct":
        return {(i, j): 2 for i in range(W) for j in range(W) if i != j}
    per_link = stages(algorithm, compression) * sum(relay_counts([True] * (W - 1), relay)) + (W - 1)
    return {(order[k], order[(k + 1) % W]): per_link for k in range(W)}


def estimate_seconds(bw: Sequence[Sequence[float]], algorithm: str, order: Sequence[int], nbytes: float = 1.0) -> float:
    """Link-bandwidth bound of one all-reduce of ``nbytes`` wire bytes per rank:
    the busiest link's bytes / its throughput (``bw[i][j]``: bytes/s from i to j,
    as probed). Latency and CPU are left out: buckets are pipelined, and CPU time
    does not depend on the link the bytes take.

    Pairs are probed one at a time, so a shared uplink looks like W-1 independent
    links and ``"direct"``'s true time can be up to W-1 times this; that never
    changes its choice against ``"ring-owner"``, whose (W+2)/4 times larger
    per-host bytes all cross one ring link, no faster than the host's fastest.

    >>> estimate_seconds([[0, 2e6, 1e6], [2e6, 0, 2e6], [2e6, 2e6, 0]], "direct", [0, 1, 2], 3e6)
    2.0
    """
    W = len(order)
    if sorted(order) != list(range(W)) or len(bw) != W or any(len(row) != W for row in bw):
        raise ValueError(f"estimate_seconds: need a {W} x {W} bandwidth matrix and a permutation order, got {order}")
    worst = 0.0
    for (i, j), k in link_chunks(algorithm, order).items():
        rate = float(bw[i][j])
        worst = max(worst, math.inf if rate <= 0 else k * nbytes / W / rate)
    return worst


def choose_algorithm(bw: Sequence[Sequence[float]], order: Sequence[int], nbytes: float = 1.0,
                     candidates: Sequence[str] = AUTO_CANDIDATES) -> tuple[str, dict[str, float]]:
    """The candidate with the smallest ``estimate_seconds`` (ties: the earlier one),
    and every candidate's estimate. ``order``: the solved ring (``ring_order(bw)``).

    With the defaults the rule is: ``"ring-owner"`` on the solved ring iff the
    slowest pair is below 4/((W-1)(W+2)) of the ring's slowest link (W=3: 0.4,
    W=4: 0.22, W=8: 0.057), since direct puts 2 chunks on every pair and
    ring-owner W(W-1)/2 + W-1 on each ring link. The chunk size cancels, so the
    choice does not depend on ``nbytes`` (it only scales the estimates).

    Worked example: 4 hosts at 100 Mbit/s (12.5 MB/s)
    but the pair 1<->2 at 5 Mbit/s, 4M int8 values per rank. Direct sends 2 of
    its 1 MB chunks over the slow pair: 3.2 s; the solved ring 0-1-3-2 avoids it
    and ring-owner moves 9 chunks per link: 0.72 s. With every link at 50 Mbit/s,
    direct (0.32 s) beats ring-owner (1.44 s).

    >>> fast, slow = 12.5e6, 0.625e6
    >>> bw = [[0, fast, fast, fast], [fast, 0, slow, fast], [fast, slow, 0, fast], [fast, fast, fast, 0]]
    >>> algo, est = choose_algorithm(bw, [0, 1, 3, 2], nbytes=4e6)
    >>> algo, {a: round(s, 2) for a, s in est.items()}
    ('ring-owner', {'direct': 3.2, 'ring-owner': 0.72})
    >>> even = [[0 if i == j else 6.25e6 for j in range(4)] for i in range(4)]
    >>> algo, est = choose_algorithm(even, [0, 1, 2, 3], nbytes=4e6)
    >>> algo, {a: round(s, 2) for a, s in est.items()}
    ('direct', {'direct': 0.32, 'ring-owner': 1.44})
    """
    if not candidates:
        raise ValueError("choose_algorithm: give at least one candidate")
    est = {a: estimate_seconds(bw, a, order, nbytes) for a in candidates}
    return min(candidates, key=est.__getitem__), est


def allreduce_plan(algorithm: str, bw: list[list[float]] | None, nbytes: float) -> dict:
    """Ring order, algorithm and (``"auto"``) each candidate's estimated seconds for one
    all-reduce of ``nbytes`` int8 values per rank, given the probed bytes/s ``bw`` (row:
    sender; None when unmeasured: the ring stays unordered and auto runs ``"direct"``,
    fastest on even links, as no slow pair is known).

    >>> bw = [[0, 9e6, 9e6, 9e6], [9e6, 0, 1e5, 9e6], [9e6, 1e5, 0, 9e6], [9e6, 9e6, 9e6, 0]]
    >>> allreduce_plan("auto", bw, 4e6)   # direct would push 2 MB over the 0.1 MB/s pair 1<->2
    {'order': [0, 1, 3, 2], 'algorithm': 'ring-owner', 'estimates': {'direct': 20.0, 'ring-owner': 1.0}}
    >>> allreduce_plan("auto", None, 4e6)["algorithm"], allreduce_plan("ring", bw, 4e6)["algorithm"]
    ('direct', 'ring')
    """
    if bw is None:
        return {"order": None, "algorithm": "direct" if algorithm == "auto" else algorithm, "estimates": {}}
    order = ring_order(bw)
    if algorithm != "auto":
        return {"order": order, "algorithm": algorithm, "estimates": {}}
    chosen, est = choose_algorithm(bw, order, nbytes=nbytes)
    # significant digits, not decimals: on fast links the estimates are microseconds
    return {"order": order, "algorithm": chosen, "estimates": {a: float(f"{v:.4g}") for a, v in est.items()}}


# ---------------------------------------------------------------------- which plan an attempt runs


def fallback_plan(algorithm: str) -> dict:
    """The plan that needs no measurement: ``algorithm`` (``"auto"``: ``"direct"``) over the ring of
    group ranks in order. A function of the member list alone, so every member computes the same.

    >>> fallback_plan("auto"), fallback_plan("ring-owner")["algorithm"]
    ({'order': None, 'algorithm': 'direct', 'estimates': {}}, 'ring-owner')
    """
    return allreduce_plan(algorithm, None, 0)


def own_plan(algorithm: str, bw: list[list[float]] | None, nbytes: float, attempt: int, probed: bool) -> dict | None:
    """A member's own plan for an attempt: the first attempt's from the probed matrix ``bw`` (every
    member reads the same columns, each published by the member whose receiving links it measured);
    a retry's, and an unprobed membership's, from the member list alone (:func:`fallback_plan`).
    None: the membership was ``probed`` but this member holds no rates for it (it restarted).

    >>> own_plan("auto", None, 8, 0, probed=True), own_plan("auto", None, 8, 1, probed=True)["algorithm"]
    (None, 'direct')
    """
    if attempt > 0:
        return fallback_plan(algorithm)
    if bw is None and probed:
        return None
    return allreduce_plan(algorithm, bw, nbytes)


def read_plan(raw: object, world: int, algorithm: str) -> tuple[dict | None, str]:
    """``raw`` (a decided plan, as parsed JSON) checked: ``(plan, "")`` when a worker configured with
    ``algorithm`` may run it over ``world`` ranks, else ``(None, why not)``. Never raises.

    >>> read_plan({"algorithm": "ring-owner", "order": [1, 0, 2], "estimates": {"direct": 2.0}}, 3, "auto")[1]
    ''
    >>> read_plan({"algorithm": "ring", "order": None, "estimates": {}}, 3, "auto")[1]
    "algorithm 'ring' is not one auto runs ('direct', 'ring-owner')"
    >>> read_plan({"algorithm": "direct", "order": [0, 1, 2, 99], "estimates": {}}, 4, "auto")[1]
    'order is not a permutation of the 4 group ranks'
    >>> read_plan("bogus", 4, "auto")[1]
    'not a plan object'
    """
    if not isinstance(raw, dict):
        return None, "not a plan object"
    algo, order, est = raw.get("algorithm"), raw.get("order"), raw.get("estimates", {})
    allowed = AUTO_CANDIDATES if algorithm == "auto" else (algorithm,)
    if algo not in allowed:
        return None, f"algorithm {str(algo)[:40]!r} is not one {algorithm} runs {allowed}"
    if order is not None and not (isinstance(order, list) and all(type(i) is int for i in order)
                                  and sorted(order) == list(range(world))):
        return None, f"order is not a permutation of the {world} group ranks"
    if not (isinstance(est, dict) and len(est) <= len(ALGORITHMS) and all(
            a in ALGORITHMS and type(v) in (int, float) and 0 <= v < math.inf for a, v in est.items())):
        return None, "estimates are not seconds per algorithm"
    return {"order": order, "algorithm": algo, "estimates": {a: float(v) for a, v in est.items()}}, ""


def settle_plan(own: dict | None, decided: object, world: int, algorithm: str) -> tuple[dict, str]:
    """The plan a member runs, and why it refused the decided one ("" when it did not).

    The rule no single member controls: every member that can computes the plan itself from inputs
    all members share (the attempt's member list, and the bandwidth columns each member measured
    and published about its own receiving links: ``own``, from ``allreduce_plan``), and runs that
    whatever was decided first under ``plan/<t>/<a>``; a decided plan that differs is refused with
    its reason. A member that cannot (``own`` None: it missed the membership's bandwidth probe,
    e.g. it restarted) runs the decided plan if :func:`read_plan` accepts it, else
    :func:`fallback_plan`. If that differs from what its peers computed, the plan digest every
    all-reduce exchanges first fails the attempt before any data moves; the retry runs
    :func:`fallback_plan`, which every member computes alike. Whatever runs is well formed and,
    under ``"auto"``, one of ``SCREENED``.

    >>> own = {"order": [0, 2, 1, 3], "algorithm": "ring-owner", "estimates": {}}
    >>> settle_plan(own, {"algorithm": "ring", "order": None, "estimates": {}}, 4, "auto")[0] == own
    True
    >>> settle_plan(own, {"algorithm": "direct", "order": None, "estimates": {}}, 4, "auto")[1]
    "differs from this member's own: direct over [0, 1, 2, 3], not ring-owner over [0, 2, 1, 3]"
    >>> settle_plan(None, {"algorithm": "bogus"}, 4, "auto")
    ({'order': None, 'algorithm': 'direct', 'estimates': {}}, "algorithm 'bogus' is not one auto runs ('direct', 'ring-owner')")
    """
    checked, why = read_plan(decided, world, algorithm)
    if own is None:
        return (checked, "") if checked is not None else (fallback_plan(algorithm), why)
    if checked is None:
        return own, why

    def ring(p: dict) -> list[int]:
        return list(range(world)) if p["order"] is None else p["order"]

    if (checked["algorithm"], ring(checked)) != (own["algorithm"], ring(own)):
        return own, (f"differs from this member's own: {checked['algorithm']} over {ring(checked)}, "
                     f"not {own['algorithm']} over {ring(own)}")
    return own, ""
