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
    version 1: E x b-bit indices within the chunk, LSB first      ceil(b E / 8) bytes
    version 2: r u8 | E x r-bit low parts | unary high parts      the rest

Entries are chunk-major: chunk c's come after chunk c-1's, ascending within a chunk. Version 2
Rice-codes the gaps between them: an entry's gap ``g`` (its index minus the previous one's minus 1;
the first of a chunk, its index) is sent as its low ``r`` bits and ``g >> r`` one-bits closed by a
zero-bit, in a stream of its own (LSB first, zero-padded to a byte). The encoder picks the ``r`` of
fewest bits: top-k positions are spread like a Bernoulli sample, whose gaps are near geometric, and
the Rice code of geometric gaps is within a few per cent of their entropy; about 7.5 bits an index
at 64 of 4096 where version 1 spends 12. A gap cannot be negative, so a duplicate index cannot be
written in version 2. :func:`encode` falls back to version 1 whenever version 2 would not be
shorter (or cannot carry the entries), so no message is longer than :func:`wire_nbytes`, the
receive bound: 960 bits per chunk in version 1 at chunk 4096 and k 64, 0.234 bits per parameter
(int8 with raw indices: 8.0 and a codebook); about 0.164 in version 2.

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
>>> data = encode(s, cfg, packed=False)       # version 1: 3-bit indices
>>> len(data) == wire_nbytes(11, cfg) == 20 + 8 * 2 + 1 + 2
True
>>> len(encode(s, cfg))         # version 2 saves nothing on 11 values: version 1 again
39
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

import numpy as np
import torch

from intellect.diloco.robust import Screen, centred_clip

__all__ = ["TopK", "Sparse", "Refused", "compress", "densify", "encode", "decode", "wire_nbytes",
           "entries", "aggregate", "bits_per_value", "SPARSE_SCREEN"]

_MAGIC = b"ITK"
_FIXED, _RICE = 1, 2  # versions: fixed-width indices, Rice-coded gaps
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
    """Length of version 1 of :func:`encode`'s output for ``numel`` values: the longest message, the
    bound a receiver holds a peer's to.

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
    if codes.numel() == 0 or bits == 0:
        return b""
    stream = ((codes[:, None] >> torch.arange(bits, dtype=torch.int64)) & 1).to(torch.uint8).numpy()
    return np.packbits(stream.reshape(-1), bitorder="little").tobytes()


def _unpack(data: memoryview, count: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: ``count`` codes of ``bits`` bits (data holds exactly enough)."""
    if count == 0 or bits == 0:
        return torch.zeros(count, dtype=torch.int64)
    stream = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * bits, bitorder="little")
    codes = torch.from_numpy(stream.astype(np.int64)).view(count, bits)
    return (codes << torch.arange(bits, dtype=torch.int64)).sum(dim=1)


def encode(s: Sparse, cfg: TopK, packed: bool = True) -> bytes:
    """The wire bytes of ``s`` (as made by :func:`compress` with ``cfg``): version 2 (Rice-coded
    gaps) where ``packed`` and it is shorter, else version 1 (exactly ``wire_nbytes(s.numel, cfg)``
    long). Each chunk's scales are read back from its values."""
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
    rice = _rice(local, counts, cfg.index_bits) if packed else None
    if rice is not None and len(rice) < -(-cfg.index_bits * local.numel() // 8):  # version 1's index bytes
        version, tail = _RICE, rice
    else:
        version, tail = _FIXED, _pack(local, cfg.index_bits)
    return b"".join((_HEADER.pack(_MAGIC, version, cfg.chunk, cfg.k, s.numel), scales, _pack(codes, 2), tail))


def _gaps(local: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each entry's index minus the previous entry's minus 1 within its chunk (the first: its index)."""
    g = local.clone()
    g[1:] -= local[:-1] + 1
    first = torch.cumsum(counts, 0) - counts
    g[first[counts > 0]] = local[first[counts > 0]]
    return g


def _rice(local: torch.Tensor, counts: torch.Tensor, bits: int) -> bytes | None:
    """Version 2's index part: ``r`` u8, the gaps' low ``r`` bits, their unary high parts; None when
    the indices are not ascending within their chunks (a gap below 0 has no code)."""
    g = _gaps(local, counts)
    e = g.numel()
    if e and int(g.min()) < 0:
        return None
    r = min(range(bits + 1), key=lambda r: e * (r + 1) + int((g >> r).sum()))
    q = g >> r
    stream = np.ones(e + int(q.sum()), dtype=np.uint8)
    stream[(torch.cumsum(q + 1, 0) - 1).numpy()] = 0  # entry i's closing zero-bit
    return bytes([r]) + _pack(g & ((1 << r) - 1), r) + np.packbits(stream, bitorder="little").tobytes()


def _unrice(mv: memoryview, counts: torch.Tensor, bits: int) -> torch.Tensor | Refused:
    """Inverse of :func:`_rice`: each entry's index within its chunk, or why the part is malformed."""
    e = int(counts.sum())
    if len(mv) < 1 or mv[0] > bits:
        return Refused(f"index: Rice parameter {mv[0] if len(mv) else None} outside 0..{bits}")
    r = mv[0]
    nlow = -(-r * e // 8)
    if len(mv) < 1 + nlow:
        return Refused("index: Rice part shorter than its low bits")
    low = _unpack(mv[1 : 1 + nlow], e, r)
    ustream = mv[1 + nlow :]
    bits_in = np.unpackbits(np.frombuffer(ustream, dtype=np.uint8), bitorder="little")
    ends = torch.from_numpy(np.flatnonzero(bits_in == 0)[:e])  # where each entry's unary code closes
    if ends.numel() < e:
        return Refused(f"index: {ends.numel()} unary codes for {e} entries")
    if e and len(ustream) != -(-(int(ends[-1]) + 1) // 8):
        return Refused(f"index: {len(ustream)} bytes of unary codes, {-(-(int(ends[-1]) + 1) // 8)} used")
    q = torch.diff(ends, prepend=torch.tensor([-1])) - 1
    step = ((q << r) | low) + 1
    csum = torch.cumsum(step, 0)
    first = torch.cumsum(counts, 0) - counts
    before = torch.where(first > 0, csum[(first - 1).clamp(min=0)], torch.zeros_like(first)) if e else first
    return csum - torch.repeat_interleave(before, counts) - 1


def decode(data: bytes | bytearray | memoryview, numel: int, cfg: TopK) -> Sparse | Refused:
    """Parse a peer's message for a tensor of ``numel`` values under ``cfg``; every check is
    made before the payload is unpacked, and a failed one is returned as :class:`Refused`."""
    try:
        return _decode(memoryview(data).cast("B"), numel, cfg)
    except (ValueError, TypeError, struct.error, RuntimeError, IndexError) as e:  # defence in depth
        return Refused(f"malformed: {e}")


def _decode(mv: memoryview, numel: int, cfg: TopK) -> Sparse | Refused:
    expected = wire_nbytes(numel, cfg)
    if len(mv) > expected or len(mv) < _HEADER.size:
        return Refused(f"length: {len(mv)} bytes, expected at most {expected}")
    magic, version, chunk, k, n = _HEADER.unpack_from(mv)
    if magic != _MAGIC or version not in (_FIXED, _RICE):
        return Refused(f"header: magic {bytes(magic)!r} version {version}")
    if version == _FIXED and len(mv) != expected:
        return Refused(f"length: {len(mv)} bytes, expected {expected}")
    if (chunk, k, n) != (cfg.chunk, cfg.k, numel):
        return Refused(f"geometry: chunk {chunk} k {k} numel {n}, expected {cfg.chunk} {cfg.k} {numel}")
    counts = _counts(numel, cfg)
    c, e = counts.numel(), int(counts.sum())
    off = _HEADER.size
    ncode = -(-2 * e // 8)
    if len(mv) < off + 8 * c + ncode:
        return Refused(f"length: {len(mv)} bytes, shorter than the scales and codes")
    scales = torch.frombuffer(bytearray(mv[off : off + 8 * c]), dtype=torch.float32).view(c, 2) if c \
        else torch.zeros(0, 2)
    if not bool(torch.isfinite(scales).all()):
        return Refused("scale: NaN or Inf")
    if c and float(scales.max()) > cfg.max_scale:
        return Refused(f"scale: {float(scales.max()):.3g} above {cfg.max_scale:.3g}")
    if bool((scales[:, 1] < 0).any()) or bool((scales[:, 0] < scales[:, 1]).any()):
        return Refused("scale: need hi >= lo >= 0")
    off += 8 * c
    codes = _unpack(mv[off : off + ncode], e, 2)
    if version == _FIXED:
        local = _unpack(mv[off + ncode :], e, cfg.index_bits)
    else:
        got = _unrice(mv[off + ncode :], counts, cfg.index_bits)
        if isinstance(got, Refused):
            return got
        local = got
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
    """Wire bits per parameter of the longest message (version 1), header included.

    >>> round(bits_per_value(1 << 24, TopK()), 4)
    0.2344
    """
    return 8 * wire_nbytes(numel, cfg) / max(1, numel) if numel else math.nan
