"""Sub-8-bit DiLoCo pseudo-gradients: top-k per chunk, 2-bit values, packed indices, error feedback
(the SparseLoCo scheme, arXiv 2508.15706; facts in ``shared/reference/overlap-compression.md``).

The codec. Its all-reduce (every member's message to every other, sealed, echoed, averaged per
index) and the error-feedback state a worker keeps per shard: ``topk_reduce``.

Per flat tensor of ``numel`` values (one all-reduce bucket), cut into chunks of ``TopK.chunk``:

1. error feedback: ``acc = decay * residual + delta`` (:func:`compress`);
2. the ``k`` largest ``|acc|`` of each chunk (the last chunk sends ``min(k, its length)``);
3. 2 bits per value: a sign bit and a "high" bit. The high half of the chosen magnitudes (by
   rank) decode to their mean ``hi``, the low half to theirs, ``lo``: per chunk two fp32 scales,
   each a centroid, so decoding never lengthens a chunk (as the int8 codebook of bucket means);
4. ``residual = acc - decoded``: what is not sent (or sent inexactly) is sent later, so the sum of
   what was transmitted tracks the sum of the pseudo-gradients within one residual.

Why two magnitudes and not SparseLoCo's 4 bins over +-6 sigma: the chosen values are the largest
of their chunk, so they sit in two tails; with one sign bit the other bit is best spent on the
magnitude within the tail. Why ``decay = 1`` by default (SparseLoCo: 0.95): with 1 nothing is
forgotten, which is the guarantee the tests check; a decay below 1 trades it for staleness.

Wire format (:func:`encode`), little-endian, ``C`` chunks, ``E`` entries (sum of per-chunk counts),
``b = (chunk - 1).bit_length()`` index bits::

    b"ITK" | version u8 | chunk u32 | k u32 | numel u64          20 bytes
    C x (hi f32, lo f32)                                          8 C bytes
    E x 2-bit codes (bit 0: negative, bit 1: high), LSB first     ceil(2 E / 8) bytes
    E x b-bit indices within the chunk, LSB first                 ceil(b E / 8) bytes

Entries are chunk-major: chunk c's come after chunk c-1's. At chunk 4096 and k 64 that is 960
bits per chunk, 0.234 bits per parameter (int8 with raw indices: 8.0 and a codebook).

Decoding a peer's message (:func:`decode`) checks the length against :func:`wire_nbytes` of the
geometry the receiver expects before reading anything else, so memory is bounded by the caller's
``numel``; a malformed message is returned as :class:`Refused` with its reason, never raised.

>>> cfg = TopK(chunk=8, k=2)
>>> x = torch.tensor([0.1, -4.0, 0.0, 3.0, 0.2, 0.0, 0.0, 0.0,   1.0, 0.0, -0.5])
>>> s, residual = compress(torch.zeros(11), x, cfg)
>>> s.indices.tolist(), s.values.tolist()      # chunk 0: -4, 3 -> hi=4, lo=3; chunk 1: 1, -0.5
([1, 3, 8, 10], [-4.0, 3.0, 1.0, -0.5])
>>> residual.tolist()[:5]
[0.10000000149011612, 0.0, 0.0, 0.0, 0.20000000298023224]
>>> data = encode(s, cfg)
>>> len(data) == wire_nbytes(11, cfg) == 20 + 8 * 2 + 1 + 2
True
>>> decode(data, 11, cfg).values.tolist()
[-4.0, 3.0, 1.0, -0.5]
>>> decode(data[:-1], 11, cfg)
Refused(reason='length: 38 bytes, expected 39')
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from intellect.diloco.robust import Screen, centred_clip

__all__ = ["TopK", "Sparse", "Refused", "compress", "densify", "encode", "decode", "wire_nbytes",
           "entries", "aggregate", "bits_per_value", "SPARSE_SCREEN"]

_MAGIC = b"ITK"
_VERSION = 1
_HEADER = struct.Struct("<3sBIIQ")  # magic, version, chunk, k, numel
_MAX_SCALE = 1e4  # no honest pseudo-gradient value is near this; a peer's scale above it is refused
# The leave-one-out median of sparse members is mostly zero where their supports differ, so the
# direction screen would measure support overlap, not direction: off until measured on top-k.
SPARSE_SCREEN = Screen(direction=0.0)


@dataclass(frozen=True)
class TopK:
    """Geometry of the codec. Defaults near SparseLoCo's (64 of each 4096-value chunk, 1.56%).

    ``max_scale``: a decoded scale above it is refused (a receiver may pass a tighter bound)."""

    chunk: int = 4096
    k: int = 64
    decay: float = 1.0
    max_scale: float = _MAX_SCALE

    def __post_init__(self) -> None:
        if not (1 <= self.k <= self.chunk < 1 << 32 and self.chunk >= 2):
            raise ValueError(f"TopK: need 1 <= k <= chunk and 2 <= chunk < 2^32, got {self}")
        if not (0.0 < self.decay <= 1.0 and self.max_scale > 0):
            raise ValueError(f"TopK: need 0 < decay <= 1 and max_scale > 0, got {self}")

    @property
    def index_bits(self) -> int:
        return (self.chunk - 1).bit_length()


@dataclass(frozen=True)
class Sparse:
    """A decoded contribution: flat positions (int64, chunk-major) and their fp32 values."""

    numel: int
    indices: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class Refused:
    """A peer's message that was not accepted, and why."""

    reason: str


def _counts(numel: int, cfg: TopK) -> torch.Tensor:
    """Entries sent per chunk: ``k``, the last chunk ``min(k, its length)``."""
    c = -(-numel // cfg.chunk)
    counts = torch.full((c,), cfg.k, dtype=torch.int64)
    if c:
        counts[-1] = min(cfg.k, numel - (c - 1) * cfg.chunk)
    return counts


def entries(numel: int, cfg: TopK) -> int:
    """E, the number of (index, value) pairs in a message for ``numel`` values."""
    c = -(-numel // cfg.chunk)
    return 0 if c == 0 else (c - 1) * cfg.k + min(cfg.k, numel - (c - 1) * cfg.chunk)


def wire_nbytes(numel: int, cfg: TopK) -> int:
    """Exact length of :func:`encode`'s output for ``numel`` values.

    >>> wire_nbytes(1 << 24, TopK())     # 4096 chunks: 0.234 bits per value
    491540
    """
    e = entries(numel, cfg)
    return _HEADER.size + 8 * (-(-numel // cfg.chunk)) + -(-2 * e // 8) + -(-cfg.index_bits * e // 8)


def compress(residual: torch.Tensor, delta: torch.Tensor, cfg: TopK) -> tuple[Sparse, torch.Tensor]:
    """Error-feedback step: (what to send, the new residual) for the flat ``delta`` and the residual
    carried from the previous step (zeros at first). Neither input is modified.
    ``ValueError`` if the accumulator is not finite: such a worker must not send."""
    kept = residual.reshape(-1).float()
    acc = delta.reshape(-1).float() + (kept if cfg.decay == 1.0 else kept * cfg.decay)  # a new tensor
    # a finite sum proves every value finite (NaN and Inf propagate); only an overflowed sum needs the scan
    if not (bool(torch.isfinite(acc.sum())) or bool(torch.isfinite(acc).all())):
        raise ValueError("compress: pseudo-gradient or residual contains NaN or Inf")
    n = acc.numel()
    full = n // cfg.chunk * cfg.chunk
    idx_parts, val_parts, hi_lo = [], [], []
    for start, stop in ((0, full), (full, n)):
        if stop == start:
            continue
        rows = acc[start:stop].view(-1, stop - start if start == full else cfg.chunk)
        kk = min(cfg.k, rows.shape[1])
        mag, pos = rows.abs().topk(kk, dim=1)  # sorted by magnitude, descending
        nhi = (kk + 1) // 2
        hi = mag[:, :nhi].mean(dim=1)
        lo = mag[:, nhi:].mean(dim=1) if kk > nhi else torch.zeros_like(hi)
        pos, order = pos.sort(dim=1)  # ascending indices within a chunk (canonical order)
        high = (order < nhi)
        sign = torch.gather(rows, 1, pos) < 0
        mags = torch.where(high, hi[:, None], lo[:, None])
        vals = torch.where(sign, -mags, mags)
        base = start + torch.arange(rows.shape[0], dtype=torch.int64)[:, None] * rows.shape[1]
        idx_parts.append((pos + base).reshape(-1))
        val_parts.append(vals.reshape(-1))
        hi_lo.append(torch.stack([hi, lo], dim=1))
    s = Sparse(n, _cat(idx_parts, torch.int64), _cat(val_parts, torch.float32))
    acc[s.indices] -= s.values  # acc is this call's own tensor: it becomes the new residual
    return s, acc


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def densify(s: Sparse) -> torch.Tensor:
    """The flat fp32 tensor a contribution stands for (zeros where nothing was sent)."""
    out = torch.zeros(s.numel, dtype=torch.float32)
    out.index_add_(0, s.indices, s.values)
    return out


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    """``codes`` (int64, each < 2^bits) as a little-endian bit stream, LSB first."""
    if codes.numel() == 0:
        return b""
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((codes[:, None] >> shifts) & 1).reshape(-1).to(torch.uint8)
    pad = -stream.numel() % 8
    stream = torch.cat([stream, torch.zeros(pad, dtype=torch.uint8)]).view(-1, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (stream * weights).sum(dim=1, dtype=torch.int64).to(torch.uint8).numpy().tobytes()


def _unpack(data: memoryview, count: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``count`` codes of ``bits`` bits (data holds exactly enough)."""
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    stream = ((raw[:, None] >> torch.arange(8)) & 1).reshape(-1)[: count * bits].view(count, bits)
    return (stream << torch.arange(bits, dtype=torch.int64)).sum(dim=1)


def encode(s: Sparse, cfg: TopK) -> bytes:
    """The wire bytes of ``s`` (as made by :func:`compress` with ``cfg``): exactly
    ``wire_nbytes(s.numel, cfg)`` long. Each chunk's scales are read back from its values."""
    counts = _counts(s.numel, cfg)
    if s.indices.numel() != int(counts.sum()):
        raise ValueError(f"encode: {s.indices.numel()} entries, geometry needs {int(counts.sum())}")
    chunk_of = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    mag = s.values.abs()
    # hi = the largest magnitude of the chunk, lo = the smallest (two centroids, or one if equal)
    hi = torch.zeros(counts.numel()).scatter_reduce(0, chunk_of, mag, "amax", include_self=False)
    lo = torch.zeros(counts.numel()).scatter_reduce(0, chunk_of, mag, "amin", include_self=False)
    high = mag > lo[chunk_of]  # equal scales: every entry decodes to lo == hi
    codes = (s.values < 0).to(torch.int64) | (high.to(torch.int64) << 1)
    local = s.indices - chunk_of * cfg.chunk
    scales = torch.stack([hi, lo], dim=1).to(torch.float32).numpy().astype("<f4").tobytes()
    return b"".join((_HEADER.pack(_MAGIC, _VERSION, cfg.chunk, cfg.k, s.numel), scales,
                     _pack(codes, 2), _pack(local, cfg.index_bits)))


def decode(data: bytes | bytearray | memoryview, numel: int, cfg: TopK) -> Sparse | Refused:
    """Parse a peer's message for a tensor of ``numel`` values under ``cfg``; every check is
    made before the payload is unpacked, and a failed one is returned as :class:`Refused`."""
    try:
        return _decode(memoryview(data).cast("B"), numel, cfg)
    except (ValueError, TypeError, struct.error, RuntimeError) as e:  # defence in depth: all checks are above
        return Refused(f"malformed: {e}")


def _decode(mv: memoryview, numel: int, cfg: TopK) -> Sparse | Refused:
    expected = wire_nbytes(numel, cfg)
    if len(mv) != expected:
        return Refused(f"length: {len(mv)} bytes, expected {expected}")
    magic, version, chunk, k, n = _HEADER.unpack_from(mv)
    if magic != _MAGIC or version != _VERSION:
        return Refused(f"header: magic {bytes(magic)!r} version {version}")
    if (chunk, k, n) != (cfg.chunk, cfg.k, numel):
        return Refused(f"geometry: chunk {chunk} k {k} numel {n}, expected {cfg.chunk} {cfg.k} {numel}")
    counts = _counts(numel, cfg)
    c, e = counts.numel(), int(counts.sum())
    off = _HEADER.size
    scales = torch.frombuffer(bytearray(mv[off : off + 8 * c]), dtype=torch.float32).view(c, 2) if c \
        else torch.zeros(0, 2)
    if not bool(torch.isfinite(scales).all()):
        return Refused("scale: NaN or Inf")
    if c and float(scales.max()) > cfg.max_scale:
        return Refused(f"scale: {float(scales.max()):.3g} above {cfg.max_scale:.3g}")
    if bool((scales[:, 1] < 0).any()) or bool((scales[:, 0] < scales[:, 1]).any()):
        return Refused("scale: need hi >= lo >= 0")
    off += 8 * c
    ncode = -(-2 * e // 8)
    codes = _unpack(mv[off : off + ncode], e, 2)
    local = _unpack(mv[off + ncode :], e, cfg.index_bits)
    chunk_of = torch.repeat_interleave(torch.arange(c), counts)
    lengths = torch.full((c,), cfg.chunk, dtype=torch.int64)
    if c:
        lengths[-1] = numel - (c - 1) * cfg.chunk
    if bool((local >= lengths[chunk_of]).any()):
        return Refused("index: out of range of its chunk")
    flat, order = (local + chunk_of * cfg.chunk).sort()  # canonical: ascending, as compress makes
    if bool((flat[1:] == flat[:-1]).any()):
        return Refused("index: duplicate")
    codes, chunk_of = codes[order], chunk_of[order]
    mags = torch.where((codes & 2).bool(), scales[chunk_of, 0], scales[chunk_of, 1])
    return Sparse(numel, flat, torch.where((codes & 1).bool(), -mags, mags))


def aggregate(contribs: Sequence[Sparse], numel: int, clip: float = 0.0, block: int = 1 << 18,
              screen: Screen = SPARSE_SCREEN) -> tuple[torch.Tensor, dict[int, float]]:
    """The average of the members' decoded contributions (gather-and-average per index): at each
    position, the sum of what the members sent there divided by their number M (a member that did
    not send a position contributes 0: its value is still in its residual and arrives later, so
    dividing by the senders only would over-weight rarely sent positions). Returns the dense fp32
    mean and, per member index, the share of its entries that lay in a block where the robust
    clip flagged it. Contributions come from :func:`compress` or :func:`decode` (ascending indices).

    ``clip > 0`` and 3+ members: each block of ``block`` positions goes through the project's
    centred clip (``robust.centred_clip`` with multiple ``clip``) over the members' dense blocks;
    a flagged block uses the clip's result instead of the mean.

    >>> a = Sparse(4, torch.tensor([0, 2]), torch.tensor([1.0, 2.0]))
    >>> b = Sparse(4, torch.tensor([2, 3]), torch.tensor([4.0, -2.0]))
    >>> aggregate([a, b], 4)[0].tolist()
    [0.5, 0.0, 3.0, -1.0]
    """
    m = len(contribs)
    out = torch.zeros(numel, dtype=torch.float32)
    if m == 0:
        return out, {}
    for s in contribs:
        if s.numel != numel:
            raise ValueError(f"aggregate: contribution of {s.numel} values, expected {numel}")
        out.index_add_(0, s.indices, s.values)
    out /= m
    if clip <= 0 or m < 3:
        return out, {}
    flagged_entries = [0] * m
    # entries are chunk-major (sorted by position), so a block's entries are one slice per member
    for start in range(0, numel, block):
        stop = min(start + block, numel)
        dense = torch.zeros(m, stop - start)
        spans = []
        for i, s in enumerate(contribs):
            lo, hi = (int(v) for v in torch.searchsorted(s.indices, torch.tensor([start, stop])))
            spans.append(hi - lo)
            dense[i].index_add_(0, s.indices[lo:hi] - start, s.values[lo:hi])
        v, outliers = centred_clip(list(dense), clip, screen=screen)
        if v is not None:
            out[start:stop] = v
        for i in outliers:
            flagged_entries[i] += spans[i]
    return out, {i: f / max(1, contribs[i].indices.numel()) for i, f in enumerate(flagged_entries) if f}


def bits_per_value(numel: int, cfg: TopK) -> float:
    """Wire bits per parameter, header included.

    >>> round(bits_per_value(1 << 24, TopK()), 4)
    0.2344
    """
    return 8 * wire_nbytes(numel, cfg) / max(1, numel) if numel else math.nan
