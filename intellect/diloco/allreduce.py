"""Int8-on-the-wire (or exact fp32: ``compression``), fp32-accumulating all-reduce (mean over
contributors) for DiLoCo: the executor.

``all_reduce_mean(tensors, group, order=..., contribute=...)`` replaces each tensor, in place,
with the mean over the contributing ranks, bit-identical on every rank, and returns
``AllReduceStats`` (bytes sent, by peer, contributors). What each algorithm sends, what it
costs and which one to run: ``plan`` (pure). The per-bucket message schedules:
``schedules.Run``; the robust-aggregation steps: ``claims``.

Values only cross the wire as ``quantize.to_bytes`` messages (``"fp32"``:
``values_to_bytes``); receivers dequantize and add in fp32, never in the quantized space. Chunk c of each bucket (``plan.chunk_bounds``) is owned by
ring position c, i.e. rank ``order[c]``; the owner divides its fp32 sum by the number of
contributors and quantizes the mean once, the all-gather moves those exact bytes, and every
rank, the owner included, ends with ``dequantize(owner bytes)``: bit-identical by construction.

``compression``: ``"int8"`` (default) as above; ``"fp32"`` sends every value as it is
(``quantize.values_to_bytes``, 4 bytes each: about 4x int8's bytes) through the same schedules,
so the owner's fp32 sum over contributors, divided by their number, is what every rank gets:
the exact mean up to fp32 summation order, bit-identical on all ranks. For equivalence checks
(a worker sharded over M ranks reduces other chunks than an unsharded one: int8 rounding
differs, fp32 sums only in their order) and as the full-precision baseline. ``codec`` and
``clip_sigmas`` apply to int8 only; ``"ring-residual"`` sends no residual under fp32
(``plan.stages``). Received fp32 messages are checked as int8 ones: the expected count and
length, finite values; an int8 message where fp32 is expected (or the reverse) is refused.

``codec``: ``"zstd"`` (default) entropy-codes each message's indices, ``"none"`` sends them
raw. Every receive buffer has room for the raw message and the headers give each message's
length, so ranks may differ in codec; a coded message that fails its checksum or does not
decode to the expected size raises ``AllReduceError`` like any garbled message. NCCL groups
always send raw (NCCL needs exact receive sizes). Coding pays on links slower than the CPU
that encodes, which is where DiLoCo runs; where the CPU is the bottleneck, ``"none"``.

``clip_sigmas``: candidate clip ranges; each chunk is quantized with the candidate that fits
it best (``quantize.quantize_best``). The default tries 4 (Gaussian optimum) and 6 (the
quantizer's default, best on Laplace); large chunks judge the candidates on a sample, so two
candidates cost little more than one.

Contributors. A rank whose tensors hold NaN/Inf (or that passes ``contribute=False``)
contributes nothing but still relays and receives; the mean divides by the number of
contributors. The flags go round the ring first (W-1 tiny hops), so every message's largest
size is known in advance; they carry a digest of the plan (algorithm, W, order, bucket shapes,
compression, schedule), so a rank with a different algorithm or layout fails at once rather
than garbling data (a different ``order`` can also change who its neighbours are, and then fails by
timeout). With no contributor at all the tensors are zeroed and ``stats.contributors`` is empty.

Failures. Every wait is bounded by the group's timeout (``timeout=`` overrides it): a peer
whose process dies makes the ranks waiting on it raise ``AllReduceError`` at once (closed
socket), a silent one after ``timeout``; ranks not talking to it raise once their peers give
up, at worst after ``timeout``. The group is unusable afterwards: rebuild it
(``transport.new_group`` under a new prefix) and retry. Buckets are written back as they
finish, so after an error the tensors are partly averaged: recompute the pseudo-gradient
before retrying.

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

Pipelining: up to ``window`` buckets are in flight; while this rank quantizes one, gloo's
threads move the others, and per-hop latency overlaps across buckets (meant for WAN round
trips; on loopback the CPU is the limit).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from intellect.diloco.plan import COMPRESSIONS, SCREENED, relay_limit
from intellect.diloco.quantize import CODECS, DEFAULT_CLIP_SIGMAS
from intellect.diloco.robust import DEFAULT_SCREEN, Screen
from intellect.diloco.schedules import Run
from intellect.diloco.transport import Channel, CommError, group_timeout

__all__ = [
    "DEFAULT_ALGORITHM",
    "DEFAULT_CLIPS",
    "DEFAULT_CODEC",
    "DEFAULT_COMPRESSION",
    "AllReduceError",
    "AllReduceStats",
    "Misbehaviour",
    "all_reduce_mean",
]

DEFAULT_ALGORITHM = "direct"  # all_reduce_mean's; a worker's config defaults to "auto" (plan.choose_algorithm)
DEFAULT_CLIPS = (4.0, DEFAULT_CLIP_SIGMAS)  # Gaussian optimum and the quantizer's default
DEFAULT_CODEC = "zstd"
DEFAULT_COMPRESSION = "int8"


class AllReduceError(CommError):
    """The all-reduce failed (peer died, timed out, garbled or mismatched plan);
    rebuild the group and retry."""


class Misbehaviour(AllReduceError):
    """The all-reduce ran to its end, but owners in ``blamed`` (group ranks) sent result chunks
    longer than the announced norms allow, or members sent unusable announcements."""

    def __init__(self, message: str, blamed: Iterable[int]):
        super().__init__(message)
        self.blamed = tuple(sorted(set(blamed)))


@dataclass(frozen=True)
class AllReduceStats:
    algorithm: str
    contributors: tuple[int, ...]  # group ranks whose tensors are in the mean
    payload_bytes: int  # chunk messages (int8 or fp32) this rank handed to the transport
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
    compression: str = DEFAULT_COMPRESSION,
    mac_key: bytes | None = None,
    outlier_clip: float = 0.0,
    screen: Screen = DEFAULT_SCREEN,
    schedule: type[Run] = Run,
) -> AllReduceStats:
    """Replace each of ``tensors`` (same shapes on every rank) with its mean over contributors.

    ``order``: the ring, a permutation of the group's ranks (default ``range(W)``);
    ring algorithms send only to ``order``'s next rank and receive from its previous.
    ``contribute=False``, or any NaN/Inf in ``tensors``, makes this rank a
    non-contributor: it still relays and receives the mean. ``buckets``: lists of
    tensor indices reduced independently (default one per tensor), each tensor in
    exactly one. All arguments except ``tensors`` and ``contribute`` must agree on
    every rank (checked). ``timeout`` (seconds) bounds each wait; default: the group's.
    ``compression``: ``"int8"`` (values quantized on the wire) or ``"fp32"`` (sent as they are:
    the exact mean up to summation order, 4x the bytes); part of the plan digest.
    ``mac_key``: seal every message (``transport.Channel``); every rank must pass the same key.
    ``outlier_clip``: k > 0 makes each owner aggregate its chunk with ``robust.centred_clip``
    (3+ contributors; ``"direct"`` and ``"ring-owner"``, where owners see each contribution);
    ``screen``: its tighter multiple and direction screen from 4 contributors (``robust.Screen``).
    ``schedule``: the message schedules, ``schedules.Run`` or a subclass (a baseline to compare
    against: ``benchmarks/prime_allreduce.py``); part of the plan digest.
    Raises ``AllReduceError`` on any communication failure; ``ValueError`` on bad
    arguments before anything is sent.
    """
    t0 = time.perf_counter()
    world, rank = group.size(), group.rank()
    order = list(range(world)) if order is None else [int(r) for r in order]
    if sorted(order) != list(range(world)):
        raise ValueError(f"order must be a permutation of range({world}), got {order}")
    relay = relay_limit(algorithm, relay, world)
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
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
    if not all(t.is_floating_point() for t in tensors):
        raise ValueError("all_reduce_mean: tensors must be floating point")
    contribute = bool(contribute) and all(_finite(t) for t in tensors)

    dev = torch.device("cuda", torch.cuda.current_device()) if "nccl" in group.name().lower() else None
    to = group_timeout(group) if timeout is None else datetime.timedelta(seconds=timeout)
    if outlier_clip and algorithm not in SCREENED:
        raise ValueError(f"outlier_clip needs an algorithm whose owners see each contribution, not {algorithm!r}")
    plan = (algorithm, relay, world, order, [[tuple(tensors[i].shape) for i in b] for b in buckets],
            mac_key is not None, float(outlier_clip), screen, schedule.__qualname__, compression)
    codec = "none" if dev is not None else codec  # NCCL: receive sizes must match exactly
    run = schedule(Channel(group, to, dev, mac_key), tensors, order, order.index(rank), algorithm, relay, clip, codec,
                   compression)
    run.outlier_clip, run.screen = float(outlier_clip), screen
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
    allocates a bool tensor and is several times slower."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _digest(plan) -> int:
    return int.from_bytes(hashlib.blake2b(repr(plan).encode(), digest_size=8).digest(), "little", signed=True)
