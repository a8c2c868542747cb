"""Int8-on-the-wire, fp32-accumulating all-reduce (mean over contributors) for DiLoCo.

``all_reduce_mean(tensors, group, order=..., contribute=...)`` replaces each
tensor, in place, with the mean over the contributing ranks, bit-identical on
every rank, and returns ``AllReduceStats`` (bytes sent, by peer, contributors).

Values only cross the wire as ``quantize.to_bytes`` messages (uint8 indices +
a 256-entry fp32 codebook; with ``codec="zstd"``, the default, the indices are
entropy-coded, see below); receivers dequantize and add in fp32, never in the
quantized space. Each bucket (e.g. one layer: ``layer_buckets``) is flattened
and split into W chunks (``chunk_bounds``); chunk c is owned by ring position
c, i.e. rank ``order[c]``. The owner divides its fp32 sum by the number of
contributors and quantizes the mean ONCE; the all-gather moves those exact
bytes (never requantized), and every rank, the owner included, ends with
``dequantize(owner bytes)``: bit-identical by construction.

Reduce-scatter algorithms:

* ``"direct"`` (default): each rank sends its quantized chunk c straight to
  owner c, and each owner sends its result straight to every rank (one
  exchange per phase). Every value is quantized twice (as a contribution, as
  the result), and the bytes equal the classic ring's. Not neighbour-only:
  each ordered pair carries two chunks per bucket (2/W of the bucket), where a
  ring pushes 2(W-1) chunks over each ring link, so on a mesh of equal links it
  needs 1/(W-1) of a ring's time (per-host uplinks: the same time, the bytes
  per host are equal), unless the network is itself ring-shaped. An earlier
  version all-gathered along the ring: its ring links then carried W chunks
  per bucket and the others one, through W-1 dependent hops. On the 4-host
  WAN testbed (``benchmarks/wan_allreduce.py``, 50 Mbit/s links, raw indices)
  that halved the busiest link's bytes (4.03 -> 2.02 MB) and the time went
  0.81 -> 0.56-0.59 s; the time is now CPU-bound there (4 ranks on 2 shared
  cores: the same run on unshaped links takes 0.25-0.59 s), so it is 1.6-1.7x
  its link bound where the ring family, with 2.7-4.5x the bytes, hides its CPU
  time behind the links (1.00-1.10x, 0.96-1.47 s). The cost: with one slow
  pair the all-gather crosses it too (testbed part 2, one 5 Mbit/s pair among
  100 Mbit/s, solved order: 1.19 -> 1.57 s); there, ``"ring-owner"`` on the
  solved ring is the algorithm to use (0.40-0.44 s). A worker's
  ``diloco.algorithm = "auto"`` (its config's default) makes that choice per
  membership from the probed bandwidths: ``choose_algorithm`` compares the two
  algorithms' link-bandwidth bounds.
* ``"ring-residual"``: classic ring, but each hop sends its fp32 partial sum as
  int8 plus int8 of the residual that missed: the partial sums stay ~16-bit
  accurate, so only the owner's final quantization counts. Neighbour-only,
  lowest error, 1.5x the bytes at any W.
* ``"ring-owner"``: each hop relays the ORIGINAL contribution bytes it received
  and appends its own; the owner decodes each once. Two quantizations, as
  ``"direct"``, neighbour-only, but hop s carries s+1 contributions: W(W-1)/2
  chunk messages instead of W-1. Fewest bytes of the neighbour-only accurate
  options for W <= 3 (same as residual at W = 4, more above).
* ``"ring"``: classic ring; each hop requantizes the fp32 partial sum (PRIME's
  reduce-scatter), so error compounds with W. Fewest bytes, neighbour-only.
  ``relay=k`` interpolates to ``"ring-owner"``: requantize only when a message
  would exceed k contributions.
* ``"prime"``: the INTELLECT-1 baseline: ``"ring"`` plus requantization at every
  all-gather hop. Benchmark only; ranks may end with different values.

``codec``: ``"zstd"`` (default) entropy-codes each message's indices
(``quantize.to_bytes``); ``"none"`` sends them raw. Every receive buffer has
room for the raw message and the headers give each message's length, so ranks
may differ in codec; a coded message that fails its checksum or does not decode
to the expected size raises ``AllReduceError`` like any garbled message. NCCL
groups always send raw (NCCL needs exact receive sizes). Measured on this
2-core box (CPU time of ``to_bytes`` + ``from_bytes`` with and without zstd,
4M N(0,1) / Laplace values, 1 thread): 0.89 / 0.87x the bytes at c=4,
0.81 / 0.80x at c=6, for 1.6-1.8 ms of CPU per raw MB (encode + decode): a
win on links slower than ~500 Mbit/s even with no overlap of CPU and
network, which is where DiLoCo runs. Not where the CPU is the bottleneck: on
the 4-host WAN testbed (4 ranks on 2 shared cores, 50 Mbit/s links) raw
"direct" took 0.56-0.59 s, coded 0.67-0.69 s.

``clip_sigmas``: candidate clip ranges; each chunk is quantized with the
candidate that fits it best (``quantize.quantize_best``). The default tries
4 (Gaussian optimum) and 6 (the quantizer's default, best on Laplace). Chunks
of 64K+ values judge the candidates on a 1/16 sample, so two candidates cost
~1.2x one quantization (the first version quantized each chunk fully per
candidate: 2x, and on the 4-host WAN testbed, where 4 ranks share 2 cores,
that CPU time added to the link time).

Measured (``benchmarks/allreduce_error.py``, W real gloo processes, 1M floats
per rank in 4 buckets = shared signal + equal-power worker noise; relative L2
error vs the exact fp32 mean, max over ranks; payload bytes sent per rank
divided by the fp32 size of the tensor, an fp32 ring sends 2(W-1)/W)::

    Gaussian, clip (4, 6)          W=2     W=4     W=8     W=16
    direct (default)             1.06%   1.04%   0.99%   0.95%
    ring-residual                0.92%   0.91%   0.91%   0.90%
    ring-owner                   1.06%   1.04%   0.99%   0.95%
    ring relay=2                 1.06%   1.22%   1.43%   1.75%
    ring                         1.06%   1.29%   1.65%   2.20%
    prime                        1.06%   1.29%   1.65%   2.20%
    Gaussian, clip 6 fixed: direct 1.56 1.54 1.47 1.42%; ring 1.56 1.91 2.46 3.29%
    Laplace, clip (4, 6), W=8/16: direct 1.60/1.52%; residual 1.50/1.45%;
                                  ring = prime 2.57/3.35%
    bytes / fp32 size, codec "none"
    direct, ring, prime          0.252   0.381   0.451   0.499
    ring-residual                0.378   0.571   0.677   0.748
    ring-owner                   0.252   0.571   1.128   2.243
    ring relay=2                 0.252   0.444   0.548   0.615
    codec "zstd" (default): 0.89x those, e.g. direct 0.225 0.340 0.404 0.449
    (the errors are the same: coding is lossless)

"prime" equals "ring": requantizing decoded int8 values is lossless with this
quantizer (<= 256 distinct values, one per bucket), so PRIME's excess error is
all in its reduce-scatter. Wire bytes vs DDP at H=100 on the tiny model: see
``benchmarks/wire_bytes.py`` (raw indices and codebooks cap the ratio just under
4H = 400x; coded, 444-448x with one bucket, 420-442x per layer, W=2-8).

Contributors. A rank whose tensors hold NaN/Inf (or that passes
``contribute=False``) contributes nothing but still relays and receives; the
mean divides by the number of contributors. The flags go round the ring first
(W-1 tiny hops), so every message's largest size is known in advance: each
receive buffer fits the raw message, and a coded one states its length in its
header; they carry a digest of the plan (algorithm, W, order, bucket
shapes), so a rank with a different algorithm or layout fails at once rather
than garbling data (a different ``order`` can also change who its neighbours
are, and then fails by timeout). With no contributor at all the tensors are
zeroed and ``stats.contributors`` is empty.

Failures. Every wait is bounded by the group's timeout (``timeout=``
overrides it): a peer whose process dies makes the ranks waiting on it raise
``AllReduceError`` at once (closed socket), a silent one after ``timeout``;
ranks not talking to it raise once their peers give up, at worst after
``timeout``. The group is unusable afterwards: rebuild it
(``transport.new_group`` under a new prefix) and retry. Buckets are written
back as they finish, so after an error the tensors are partly averaged:
recompute the pseudo-gradient before retrying.

Trust. ``mac_key`` seals every message, flags and announcements included, with an HMAC over
(sender, receiver, tag, bytes) (``transport.Channel``): bytes forged or altered by anyone
without the key raise ``AllReduceError`` like garbled ones. ``outlier_clip`` (``"direct"`` and
``"ring-owner"``, 3+ contributors) makes every member announce its chunks' norms straight to
every other member first; each owner then cuts contributions to their announced norms, takes
the centred clip of its chunk (``robust.centred_clip``) and clips its result to
``robust.owner_bound``; every receiver checks each owner's result against
``robust.receiver_bound`` and, after the last exchange, raises ``Misbehaviour`` naming the
owners that broke it. ``AllReduceStats.outliers`` says whom this rank's chunks flagged. What
this bounds and what it does not: ``robust``'s docstring.

Pipelining: up to ``window`` buckets are in flight; while this rank quantizes
one, gloo's threads move the others, and per-hop latency overlaps across
buckets. Not measurable on loopback with 2 busy cores (tiny model, 6 layer
buckets, W=4/8: window=4 vs 1 took 0.08/0.37 vs 0.21/0.58 s in one run and
0.11/0.26 vs 0.08/0.36 s in another); the gain is meant for WAN round trips.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Generator, Iterator, Sequence

import torch
import torch.distributed as dist

from intellect.diloco.quantize import (
    CODECS,
    DEFAULT_CLIP_SIGMAS,
    Quantized,
    dequantize,
    from_bytes,
    message_nbytes,
    quantize_best,
    to_bytes,
    wire_nbytes,
)
from intellect.diloco.robust import centred_clip, owner_bound, receiver_bound
from intellect.diloco.transport import Channel, CommError, group_timeout

__all__ = [
    "ALGORITHMS",
    "CODECS",
    "DEFAULT_CODEC",
    "DEFAULT_ALGORITHM",
    "DEFAULT_CLIPS",
    "AllReduceError",
    "AllReduceStats",
    "Misbehaviour",
    "AUTO_CANDIDATES",
    "all_reduce_mean",
    "choose_algorithm",
    "chunk_bounds",
    "estimate_seconds",
    "link_chunks",
    "layer_buckets",
    "merge_small",
    "relay_counts",
    "payload_bytes",
]

ALGORITHMS = ("direct", "ring-owner", "ring-residual", "ring", "prime")
DEFAULT_ALGORITHM = "direct"  # all_reduce_mean's; a worker's config defaults to "auto" (choose_algorithm)
AUTO_CANDIDATES = ("direct", "ring-owner")
DEFAULT_CLIPS = (4.0, DEFAULT_CLIP_SIGMAS)  # Gaussian optimum and the quantizer's default
DEFAULT_CODEC = "zstd"


class AllReduceError(CommError):
    """The all-reduce failed (peer died, timed out, garbled or mismatched plan);
    rebuild the group and retry."""


class Misbehaviour(AllReduceError):
    """The all-reduce ran to its end, but owners in ``blamed`` (group ranks) sent result chunks
    longer than the announced norms allow, or members sent unusable announcements."""

    def __init__(self, message: str, blamed: Sequence[int]):
        super().__init__(message)
        self.blamed = tuple(sorted(set(blamed)))


@dataclass(frozen=True)
class AllReduceStats:
    algorithm: str
    contributors: tuple[int, ...]  # group ranks whose tensors are in the mean
    payload_bytes: int  # quantized data this rank handed to the transport
    control_bytes: int  # contributor flags + plan digest
    messages: int
    seconds: float
    bytes_by_peer: dict[int, int]  # destination rank -> bytes (payload + control)
    # group rank -> share of its contributed values (in the chunks this rank owns) that this
    # rank's centred clip found to be outliers (``outlier_clip``); ranks never clipped are absent
    outliers: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def bytes_sent(self) -> int:
        return self.payload_bytes + self.control_bytes


# ---------------------------------------------------------------- planning (pure)


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


def merge_small(buckets: Sequence[Sequence[int]], numels: Sequence[int], min_numel: int) -> list[list[int]]:
    """Merge consecutive buckets until each holds >= ``min_numel`` elements (a short
    tail joins the last bucket). Each chunk message carries a 1 KiB codebook, so tiny
    buckets cost bytes; merged buckets share one codebook per chunk, which costs
    accuracy when their scales differ.

    >>> merge_small([[0], [1, 2], [3], [4]], [10, 500, 500, 500, 500], 100)
    [[0, 1, 2], [3], [4]]
    >>> merge_small([[0], [1], [2]], [500, 500, 5], 100)
    [[0], [1, 2]]
    """
    out: list[list[int]] = []
    acc: list[int] = []
    for b in buckets:
        acc += b
        if sum(numels[i] for i in acc) >= min_numel:
            out.append(acc)
            acc = []
    if acc:
        if out:
            out[-1] += acc
        else:
            out.append(acc)
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


def _wire(numel: int) -> int:
    return wire_nbytes(numel) if numel else 0  # empty chunks are skipped, not sent


def payload_bytes(numels: Sequence[int], world: int, position: int, algorithm: str, relay: int | None = None) -> int:
    """Payload bytes sent by ring position ``position`` when every rank contributes,
    with raw indices (``codec="none"``; coded messages are at most this).

    >>> payload_bytes([8], 2, 0, "ring") == 2 * wire_nbytes(4)
    True
    >>> payload_bytes([8], 2, 0, "ring-owner") == payload_bytes([8], 2, 0, "direct")
    True
    """
    relay = _relay(algorithm, relay, world)
    total = 0
    for n in numels:
        w = [_wire(e - s) for s, e in chunk_bounds(n, world)]
        p = position
        if algorithm == "direct":  # own chunk to every other rank, twice (contribution, result)
            total += sum(w) - w[p] + (world - 1) * w[p]
            continue
        ag = sum(w) - w[(p + 1) % world]  # ring all-gather: all but the chunk owned by next
        stages = 2 if algorithm == "ring-residual" else 1
        total += stages * sum((s % relay + 1) * w[(p - s - 1) % world] for s in range(world - 1)) + ag
    return total


def _relay(algorithm: str, relay: int | None, world: int) -> int:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if relay is not None:
        if algorithm not in ("ring", "ring-owner") or relay < 1:
            raise ValueError(f"relay={relay!r} needs a ring algorithm and relay >= 1")
        return relay
    return max(world - 1, 1) if algorithm == "ring-owner" else 1


def link_chunks(algorithm: str, order: Sequence[int], relay: int | None = None) -> dict[tuple[int, int], int]:
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
    relay = _relay(algorithm, relay, W)
    if W < 2:
        return {}
    if algorithm == "direct":
        return {(i, j): 2 for i in range(W) for j in range(W) if i != j}
    stages = 2 if algorithm == "ring-residual" else 1
    per_link = stages * sum(relay_counts([True] * (W - 1), relay)) + (W - 1)
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

    Worked example, the WAN testbed's part 2: 4 hosts at 100 Mbit/s (12.5 MB/s)
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


# ---------------------------------------------------------------- the all-reduce

_Step = Generator[tuple[list, str], None, None]


def _enc(q: Quantized, codec: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(to_bytes(q, codec)), dtype=torch.uint8)


def _dec(t: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode one message; ``t`` may be a receive buffer longer than the message."""
    return dequantize(from_bytes(t.cpu().numpy(), numel=numel, prefix=True))


def _packed(buf: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The ``k`` messages laid back to back at the start of receive buffer ``buf``
    (sized for raw messages; coded ones leave spare room at the end)."""
    mv, off, out = memoryview(buf.cpu().numpy()), 0, []
    for _ in range(k):
        m = message_nbytes(mv[off:])
        if off + m > len(mv):
            raise ValueError(f"message {len(out)} of {k} overruns its {len(mv)}-byte buffer")
        out.append(buf[off : off + m])
        off += m
    return out


def all_reduce_mean(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    *,
    order: Sequence[int] | None = None,
    contribute: bool = True,
    algorithm: str = DEFAULT_ALGORITHM,
    relay: int | None = None,
    buckets: Sequence[Sequence[int]] | None = None,
    window: int = 4,
    timeout: float | None = None,
    clip_sigmas: float | Sequence[float] = DEFAULT_CLIPS,
    codec: str = DEFAULT_CODEC,
    mac_key: bytes | None = None,
    outlier_clip: float = 0.0,
) -> AllReduceStats:
    """Replace each of ``tensors`` (same shapes on every rank) with its mean over contributors.

    ``order``: the ring, a permutation of the group's ranks (default ``range(W)``);
    ring algorithms send only to ``order``'s next rank and receive from its previous.
    ``contribute=False``, or any NaN/Inf in ``tensors``, makes this rank a
    non-contributor: it still relays and receives the mean. ``buckets``: lists of
    tensor indices reduced independently (default one per tensor), each tensor in
    exactly one. All arguments except ``tensors`` and ``contribute`` must agree on
    every rank (checked). ``timeout`` (seconds) bounds each wait; default: the group's.
    ``mac_key``: seal every message (``transport.Channel``); every rank must pass the same key.
    ``outlier_clip``: k > 0 makes each owner aggregate its chunk with ``robust.centred_clip``
    (3+ contributors; ``"direct"`` and ``"ring-owner"``, where owners see each contribution).
    Raises ``AllReduceError`` on any communication failure; ``ValueError`` on bad
    arguments before anything is sent.
    """
    t0 = time.perf_counter()
    world, rank = group.size(), group.rank()
    order = list(range(world)) if order is None else [int(r) for r in order]
    if sorted(order) != list(range(world)):
        raise ValueError(f"order must be a permutation of range({world}), got {order}")
    relay = _relay(algorithm, relay, world)
    clip = (float(clip_sigmas),) if isinstance(clip_sigmas, (int, float)) else tuple(map(float, clip_sigmas))
    if not clip:
        raise ValueError("clip_sigmas: give at least one value")
    buckets = [[i] for i in range(len(tensors))] if buckets is None else [list(b) for b in buckets]
    if sorted(i for b in buckets for i in b) != list(range(len(tensors))):
        raise ValueError("buckets must use every tensor index exactly once")
    if window < 1:
        raise ValueError("window must be >= 1")
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    if not all(t.is_floating_point() for t in tensors):
        raise ValueError("all_reduce_mean: tensors must be floating point")
    contribute = bool(contribute) and all(_finite(t) for t in tensors)

    dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in group.name().lower() else None
    to = group_timeout(group) if timeout is None else datetime.timedelta(seconds=timeout)
    if outlier_clip and algorithm not in ("direct", "ring-owner"):
        raise ValueError(f"outlier_clip needs an algorithm whose owners see each contribution, not {algorithm!r}")
    plan = (algorithm, relay, world, order, [[tuple(tensors[i].shape) for i in b] for b in buckets],
            mac_key is not None, float(outlier_clip))
    codec = "none" if dev is not None else codec  # NCCL: receive sizes must match exactly
    run = _Run(Channel(group, to, dev, mac_key), tensors, order, order.index(rank), algorithm, relay, clip, codec)
    run.outlier_clip = float(outlier_clip)
    try:
        flags = run.exchange_flags(contribute, _digest(plan)) if world > 1 else [contribute]
        run.set_contributors(flags)
        if run.outlier_clip and world > 1 and run.n >= 3:  # fewer: no majority to judge by
            run.exchange_claims(buckets)
        if run.n == 0:
            with torch.no_grad():
                for t in tensors:
                    t.zero_()
        elif world > 1:
            run.drive((run.bucket(b, idx) for b, idx in enumerate(buckets)), window)
    except (CommError, ValueError) as e:  # ValueError here: a garbled message
        raise AllReduceError(f"all_reduce_mean on rank {rank}/{world}: {e}") from e
    if run.blamed:
        raise Misbehaviour(f"all_reduce_mean on rank {rank}/{world}: owners {sorted(run.blamed)} sent result chunks "
                           "over the announced norms' bound", run.blamed)
    sent = run.ch.sent
    return AllReduceStats(
        algorithm,
        tuple(r for r in range(world) if flags[r]),
        sent.get("payload", 0),
        sent.get("control", 0),
        run.ch.messages,
        time.perf_counter() - t0,
        dict(run.ch.sent_to),
        {r: round(v / run.contributed[r], 6) for r, v in run.flagged.items() if run.contributed.get(r)},
    )


def _finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``. A finite sum proves it in one reduction (NaN and Inf
    propagate); only a sum that overflowed needs the elementwise check, which
    allocates a bool tensor (4M fp32 values, this box: 3.9 vs 19.7 ms)."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _digest(plan) -> int:
    return int.from_bytes(hashlib.blake2b(repr(plan).encode(), digest_size=8).digest(), "little", signed=True)


class _Run:
    """One call's state; ``bucket`` generators yield (works, label) once per exchange."""

    def __init__(self, ch: Channel, tensors, order, pos, algorithm, relay, clip, codec):
        self.ch, self.tensors, self.order, self.pos = ch, tensors, order, pos
        self.algorithm, self.relay, self.clip, self.codec = algorithm, relay, clip, codec
        self.stages = 2 if algorithm == "ring-residual" else 1
        self.W = len(order)
        self.nxt, self.prv = order[(pos + 1) % self.W], order[(pos - 1) % self.W]
        self.outlier_clip = 0.0
        self.flagged: dict[int, int] = {}  # group rank -> values of its contributions found outliers
        self.contributed: dict[int, int] = {}  # group rank -> values of its contributions this rank owned
        self.claims: torch.Tensor | None = None  # [group rank, bucket, ring position]: announced chunk norms
        self.blamed: set[int] = set()  # owners whose result chunks broke the receivers' bound

    def exchange_flags(self, contribute: bool, digest: int) -> list[bool]:
        """Ring all-gather of (plan digest, contributor flag) along ``order``."""
        W, me = self.W, self.order[self.pos]
        vec = torch.full((W + 1,), -1, dtype=torch.int64)
        vec[0], vec[1 + me] = digest, int(contribute)
        for s in range(W - 1):
            raw = self.ch.empty(vec.numel() * vec.element_size())
            works = [self.ch.irecv(raw, self.prv, s), self.ch.isend(vec.clone().view(torch.uint8), self.nxt, s, "control")]
            self.ch.wait(works, f"contributor exchange step {s}")
            body = self.ch.open(raw, self.prv, s)
            if body.numel() != vec.numel() * vec.element_size():
                raise CommError(f"rank {self.prv} sent a contributor vector of {body.numel()} bytes")
            buf = body.clone().view(torch.int64)
            if int(buf[0]) != digest:
                raise CommError(f"rank {self.prv} runs a different plan (order, algorithm or bucket shapes)")
            vec[1:] = torch.where(vec[1:] < 0, buf[1:], vec[1:])
        return [bool(v) for v in vec[1:].tolist()]

    def exchange_claims(self, buckets: Sequence[Sequence[int]]) -> None:
        """Send every other rank, directly, the L2 norm of each of this rank's chunks (``robust``)."""
        W, me = self.W, self.order[self.pos]
        own = torch.zeros(len(buckets), W, dtype=torch.float64)
        for b, idx in enumerate(buckets if self.flags[self.pos] else ()):
            flat = torch.cat([self.tensors[i].detach().reshape(-1).to("cpu", torch.float32) for i in idx])
            for c, (s, e) in enumerate(chunk_bounds(flat.numel(), W)):
                own[b, c] = float(flat[s:e].norm()) if e > s else 0.0
        self.claims = torch.zeros(W, len(buckets), W, dtype=torch.float64)
        self.claims[me] = own
        tag, works, bufs = self.tag(len(buckets), 0, 0), [], {}
        for r in self.order:
            if r != me:
                bufs[r] = self.ch.empty(own.numel() * 8)
                works.append(self.ch.irecv(bufs[r], r, tag))
        for r in bufs:
            works.append(self.ch.isend(own.view(-1).view(torch.uint8).clone(), r, tag, "control"))
        self.ch.wait(works, "norm announcements")
        for r, buf in bufs.items():
            body = self.ch.open(buf, r, tag)
            if not self.flags[self.order.index(r)]:
                continue  # a non-contributor's announcement is never used
            got = body.clone().view(torch.float64).view(len(buckets), W) if body.numel() == own.numel() * 8 else None
            if got is None or not bool(torch.isfinite(got).all()) or bool((got < 0).any()):
                self.blamed.add(r)  # unusable: the attempt fails and r is blamed; its values count as 0
                continue
            self.claims[r] = got

    def _claimed(self, b: int, c: int) -> list[float]:
        """Announced norms of chunk ``c`` (ring position) of bucket ``b`` by the contributors."""
        return [float(self.claims[self.order[p], b, c]) for p in range(self.W) if self.flags[p]]

    def _check_results(self, b: int, decoded: list[torch.Tensor | None]) -> None:
        """Blame each owner whose result chunk is longer than ``receiver_bound`` allows."""
        if self.claims is None or self.n < 4:
            return
        for c, v in enumerate(decoded):
            if v is not None and c != self.pos and v.numel():
                bound = receiver_bound(self._claimed(b, c), self.outlier_clip)
                if float(v.norm()) > bound * (1 + 1e-3) + 1e-30:
                    self.blamed.add(self.order[c])

    def set_contributors(self, flags: Sequence[bool]) -> None:
        self.flags = [flags[r] for r in self.order]  # by ring position
        self.n = sum(self.flags)
        W = self.W
        # pieces[c][s]: pieces in the step-s reduce-scatter message of chunk c, sent by position c+s+1
        self.pieces = [relay_counts([self.flags[(c + 1 + s) % W] for s in range(W - 1)], self.relay) for c in range(W)]

    def tag(self, b: int, phase: int, s: int) -> int:
        return self.W * (1 + 2 * b + phase) + s  # tags < W belong to the flag exchange

    def drive(self, gens: Iterator[_Step], window: int) -> None:
        """Round-robin over up to ``window`` bucket generators, waiting oldest-first."""
        pending: deque = deque()

        def push(g) -> bool:
            try:
                works, what = next(g)
            except StopIteration:
                return False
            pending.append((g, works, what))
            return True

        active = 0

        def fill() -> None:
            nonlocal active
            while active < window and (g := next(gens, None)) is not None:
                active += push(g)

        fill()
        while pending:
            g, works, what = pending.popleft()
            self.ch.wait(works, what)
            if not push(g):
                active -= 1
                fill()

    def bucket(self, b: int, idx: list[int]) -> _Step:
        ts = [self.tensors[i] for i in idx]
        if sum(t.numel() for t in ts) == 0:
            return
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in ts])
        parts = [flat[s:e] for s, e in chunk_bounds(flat.numel(), self.W)]
        algo = self._direct if self.algorithm == "direct" else self._ring
        result = yield from algo(b, parts)
        for c, part in enumerate(parts):
            if part.numel():
                part.copy_(result[c])
        off = 0
        with torch.no_grad():
            for t in ts:
                t.copy_(flat[off : off + t.numel()].view_as(t))
                off += t.numel()

    def quantize(self, x: torch.Tensor) -> Quantized:
        """``quantize`` with whichever ``clip_sigmas`` candidate fits ``x`` best in L2.
        Encoder side only; receivers read the values from the codebook."""
        return quantize_best(x, self.clip)

    def _piece(self, x: torch.Tensor) -> torch.Tensor:
        """One reduce-scatter piece: int8 of ``x``, plus (residual) int8 of what that missed."""
        q = self.quantize(x)
        if self.stages == 1:
            return _enc(q, self.codec)
        return torch.cat([_enc(q, self.codec), _enc(self.quantize(x - dequantize(q)), self.codec)])

    def _ring(self, b: int, parts: list[torch.Tensor]) -> Generator:
        W, pos, ch, st = self.W, self.pos, self.ch, self.stages
        wire = [_wire(p.numel()) for p in parts]
        me = self.flags[pos]

        def pieces(msgs, c):  # decoded pieces of a reduce-scatter message
            dec = [_dec(m, parts[c].numel()) for m in msgs]
            return dec if st == 1 else [dec[j] + dec[j + 1] for j in range(0, len(dec), 2)]

        got, k_got = None, 0  # message received in the previous step: chunk c_out of this step
        for s in range(W - 1):
            c_out, c_in = (pos - s - 1) % W, (pos - s - 2) % W
            works, buf = [], None
            k_in = self.pieces[c_in][s]
            if k_in and wire[c_in]:
                buf = ch.empty(k_in * st * wire[c_in])
                works.append(ch.irecv(buf, self.prv, self.tag(b, 0, s)))
            if self.pieces[c_out][s] and wire[c_out]:
                if not me:  # forward what came in
                    msg = torch.cat([m.cpu() for m in got])
                elif k_got + 1 <= self.relay:
                    own = self._piece(parts[c_out])
                    msg = own if got is None else torch.cat([m.cpu() for m in got] + [own])
                else:  # collapse: partial sum in fp32, requantized once
                    total = parts[c_out].clone()
                    for p in pieces(got, c_out):
                        total += p
                    msg = self._piece(total)
                works.append(ch.isend(msg, self.nxt, self.tag(b, 0, s), "payload"))
            yield works, f"bucket {b} reduce-scatter step {s}"
            got = _packed(ch.open(buf, self.prv, self.tag(b, 0, s)), k_in * st) if buf is not None else None
            k_got = k_in
        senders = [self.order[(pos + 1 + s) % W] for s in range(W - 1) if self.flags[(pos + 1 + s) % W]]
        return (yield from self._ring_gather(b, parts, pieces(got, pos) if got is not None else [], senders))

    def _direct(self, b: int, parts: list[torch.Tensor]) -> Generator:
        W, pos, ch = self.W, self.pos, self.ch
        others = [(pos + i) % W for i in range(1, W)]  # staggered so ranks don't all hit one owner
        # Both phases' receives are posted up front: gloo moves a message only once its
        # receive is posted, so a late receiver (busy quantizing) would leave the link idle.
        works, bufs, senders, ag_works, ag_bufs = [], [], [], [], {}
        if parts[pos].numel():
            for p in others:
                if self.flags[p]:
                    bufs.append(ch.empty(_wire(parts[pos].numel())))
                    senders.append(self.order[p])
                    works.append(ch.irecv(bufs[-1], self.order[p], self.tag(b, 0, 0)))
        for p in others:
            if parts[p].numel():
                ag_bufs[p] = ch.empty(_wire(parts[p].numel()))
                ag_works.append(ch.irecv(ag_bufs[p], self.order[p], self.tag(b, 1, 0)))
        if self.flags[pos]:
            for p in others:
                if parts[p].numel():
                    msg = _enc(self.quantize(parts[p]), self.codec)
                    works.append(ch.isend(msg, self.order[p], self.tag(b, 0, 0), "payload"))
        yield works, f"bucket {b} direct reduce"
        received = [_dec(ch.open(t, r, self.tag(b, 0, 0)), parts[pos].numel()) for t, r in zip(bufs, senders)]
        mine = self._owner(parts, received, senders, b)
        if mine is not None:
            for p in others:
                ag_works.append(ch.isend(mine, self.order[p], self.tag(b, 1, 0), "payload"))
        yield ag_works, f"bucket {b} direct all-gather"
        res = {c: _packed(ch.open(buf, self.order[c], self.tag(b, 1, 0)), 1)[0] for c, buf in ag_bufs.items()}
        res |= {pos: mine} if mine is not None else {}
        out = [_dec(res[c], p.numel()) if c in res else None for c, p in enumerate(parts)]
        self._check_results(b, out)
        return out

    def _owner(self, parts: list[torch.Tensor], received: list[torch.Tensor],
               senders: Sequence[int] = (), b: int = 0) -> torch.Tensor | None:
        """The owner's message: mean of its fp32 chunk and ``received`` (from group ranks
        ``senders``), or, with ``outlier_clip``, their centred clip within the announced
        norms (``robust``), quantized once."""
        pos = self.pos
        if not parts[pos].numel():
            return None
        result = None
        if self.outlier_clip and self.n >= 3 and senders:
            me = [self.order[pos]] if self.flags[pos] else []
            ranks = me + list(senders)
            xs = ([parts[pos]] if me else []) + list(received)
            lied = set()
            if self.claims is not None:  # decoding never lengthens a chunk: longer than announced is a lie
                for i, r in enumerate(ranks):
                    claim = float(self.claims[r, b, pos])
                    norm = float(xs[i].norm())
                    if norm > claim * (1 + 1e-3) + 1e-30:
                        xs[i] = xs[i] * (claim / norm)
                        lied.add(i)
            result, outliers = centred_clip(xs, self.outlier_clip)
            for r in ranks:
                self.contributed[r] = self.contributed.get(r, 0) + parts[pos].numel()
            for i in set(outliers) | lied:
                self.flagged[ranks[i]] = self.flagged.get(ranks[i], 0) + parts[pos].numel()
            received = xs[len(me):]
        if result is None:
            total = parts[pos].clone() if self.flags[pos] else torch.zeros_like(parts[pos])
            for r in received:
                total += r
            result = total.div_(self.n)
        if self.claims is not None:  # an honest result never needs this; receivers check it
            bound = owner_bound(self._claimed(b, pos), self.outlier_clip)
            norm = float(result.norm())
            if norm > bound:
                result = result * (bound / norm)
        return _enc(self.quantize(result), self.codec)

    def _ring_gather(self, b: int, parts: list[torch.Tensor], received: list[torch.Tensor],
                     senders: Sequence[int] = ()) -> Generator:
        """``_owner``, then a ring all-gather forwarding the owners' bytes. Returns every
        chunk decoded from its owner's bytes."""
        W, pos, ch = self.W, self.pos, self.ch
        wire = [_wire(p.numel()) for p in parts]
        res: dict[int, torch.Tensor] = {}
        if wire[pos]:
            # senders: only "ring-owner" relays each contribution as sent (robust aggregation needs that)
            res[pos] = self._owner(parts, received, senders if self.relay >= W - 1 and self.stages == 1 else (), b)
        vals: dict[int, torch.Tensor] = {}  # "prime" only: what this rank decoded
        for s in range(W - 1):
            c_out, c_in = (pos - s) % W, (pos - s - 1) % W
            works, buf = [], None
            if wire[c_in]:
                buf = ch.empty(wire[c_in])
                works.append(ch.irecv(buf, self.prv, self.tag(b, 1, s)))
            if wire[c_out]:
                works.append(ch.isend(res[c_out], self.nxt, self.tag(b, 1, s), "payload"))
            yield works, f"bucket {b} all-gather step {s}"
            if buf is None:
                continue
            buf = ch.open(buf, self.prv, self.tag(b, 1, s))
            res[c_in] = _packed(buf, 1)[0]
            if self.algorithm == "prime":  # PRIME requantizes what it forwards
                vals[c_in] = _dec(buf, parts[c_in].numel())
                if s < W - 2:
                    res[c_in] = _enc(self.quantize(vals[c_in]), self.codec)
        out = [vals[c] if c in vals else _dec(res[c], p.numel()) if wire[c] else None for c, p in enumerate(parts)]
        self._check_results(b, out)
        return out
