"""Int8 codebook quantizer for DiLoCo pseudo-gradients (the INTELLECT-1 scheme).

Per tensor (the caller passes one all-reduce chunk at a time):

1. mean ``mu`` and population std ``sigma``;
2. clip range ``[mu - c*sigma, mu + c*sigma]`` split into 256 equal buckets;
   values outside the range land in the edge buckets;
3. codebook value of a bucket = mean of the original values in it (not the
   midpoint), so clipped tails decode to the tail mean, not to the clip bound.
   Empty buckets get their midpoint (never referenced by an index, but keeps
   the codebook finite and monotone).

Wire format (``to_bytes``), little-endian::

    b"IQ8" | version u8 | ndim u8 | 3 zero bytes | ndim x i64 dims | 256 x f32 codebook
    version 1: | numel x u8 indices
    version 2: | codec u8 | 3 zero bytes | crc32 u32 | length u64 | length bytes

Full-precision messages (the all-reduce's ``compression="fp32"``: ``values_to_bytes``) share the
header and carry the values themselves, so they decode exactly::

    b"IQ8" | 3 | ndim u8 | 3 zero bytes | ndim x i64 dims | numel x f32 values

``values_nbytes(numel, ndim) = 8 + 8*ndim + 4*numel`` bytes. ``from_bytes`` refuses them and
``values_from_bytes`` refuses the int8 versions, so neither is ever read as the other.

Version 1 is ``wire_nbytes(numel, ndim) = 8 + 8*ndim + 1024 + numel`` bytes. Version 2
(``codec="zstd"``) entropy-codes the indices: bucket indices of a bell-shaped tensor are far
from uniform, and zstd's Huffman stage gets close to their entropy. ``to_bytes`` falls back to
version 1 whenever coding would not save bytes, so a message never exceeds ``wire_nbytes``: a
receive buffer of that size fits either version, and ``message_nbytes`` reads the actual length
from the header. The crc32 of the coded bytes turns a corrupted payload into a ``ValueError``
instead of silently wrong indices, and decoding is bounded by the caller's expected ``numel``
(no decompression bomb).

Choice of ``c`` (``DEFAULT_CLIP_SIGMAS = 6``, the report's). The optimum moves with the tails:
about 4 on a Gaussian, 6 on Laplace, far more on Student-t(3), where most of the error sits in
the two edge buckets and no range of 256 uniform buckets fixes it. 6 is best on Laplace and
within 1.5x of the Gaussian optimum; the PRIME and hivemind codes' effective c=3 (mean +- 3
sigma, or +-3 RMS around 0) is worse on all three. Re-run ``benchmarks/quantizer_bench.py
--sweep`` on real pseudo-gradients (``--tensor``) before changing it; the all-reduce tries
several candidates per chunk (``quantize_best``).

Non-finite input raises ``ValueError``: a worker whose pseudo-gradient has a
NaN/Inf must be excluded by the caller, not averaged in.

Example::

    >>> import torch
    >>> x = torch.tensor([0.0, 0.01, 1.0, 2.0, 90.0, 100.0])
    >>> q = quantize(x, clip_sigmas=1.0)   # mu=32.2, sigma=44.5: range [-12.4, 76.7], width 0.35
    >>> q.indices.tolist()                 # 0 and 0.01 share a bucket; 90, 100 clip to 255
    [35, 35, 38, 41, 255, 255]
    >>> [round(v, 4) for v in dequantize(q).tolist()]   # bucket means, not midpoints or bounds
    [0.005, 0.005, 1.0, 2.0, 95.0, 95.0]
    >>> len(to_bytes(q)) == wire_nbytes(6)
    True
    >>> y = torch.linspace(-1, 1, 10_000) ** 3      # peaked: few indices carry most values
    >>> packed = to_bytes(quantize(y), codec="zstd")
    >>> len(packed) < wire_nbytes(10_000), from_bytes(packed).indices.equal(quantize(y).indices)
    (True, True)
"""

from __future__ import annotations

import math
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "DEFAULT_CLIP_SIGMAS",
    "NUM_BUCKETS",
    "Quantized",
    "quantize",
    "quantize_best",
    "dequantize",
    "to_bytes",
    "from_bytes",
    "wire_nbytes",
    "message_nbytes",
    "values_from_bytes",
    "values_nbytes",
    "values_to_bytes",
    "CODECS",
]

DEFAULT_CLIP_SIGMAS = 6.0
NUM_BUCKETS = 256

CODECS = ("none", "zstd")  # index coding in ``to_bytes``; the wire byte is the position here

_MAGIC = b"IQ8"
_RAW, _PACKED, _VALUES = 1, 2, 3  # wire format versions: int8 raw, int8 coded, fp32 values
_HEADER = struct.Struct("<3sBB3x")  # magic, version, ndim
_PACK = struct.Struct("<B3xIQ")  # version 2: codec, crc32 of the coded bytes, their length
_ZSTD_LEVEL = 1  # levels 1-3 code these indices equally well (Huffman stage); 1 is fastest
_MAX_NDIM = 64
# Chunks keep the fp32 temporaries and int64 gather indices in L2 and stay below ATen's
# 32768-element grain size, so each op runs inline: a parallel op per chunk waits at an
# OpenMP barrier, which another process on the other core makes very slow. Just under the
# grain (a multiple of 64) rather than smaller: per-op dispatch is a large share of a small
# chunk's time.
_CHUNK = 32768 - 64
_FP32_MAX = torch.finfo(torch.float32).max
# With torch.get_num_threads() > 1, tensors of at least this many elements are split
# into one contiguous part per thread, each bucketized and histogrammed by its own
# Python thread (torch releases the GIL): the L2-sized chunks stay inline, so no
# OpenMP barrier, and bincount, single-threaded in ATen, runs on every core. Below it
# the hand-off costs more than the second core saves.
_PARALLEL_MIN = 1 << 18
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
# quantize_best: below _SAMPLE_MIN values every candidate quantizes the whole tensor.
_SAMPLE_MIN, _SAMPLE_FRACTION, _SAMPLE_BLOCK = 1 << 16, 16, 64


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor: flat uint8 ``indices`` into a 256-entry fp32 ``codebook``."""

    indices: torch.Tensor
    codebook: torch.Tensor
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.indices.numel()

    @property
    def nbytes(self) -> int:
        return wire_nbytes(self.numel, len(self.shape))


def wire_nbytes(numel: int, ndim: int = 1) -> int:
    """Size of ``to_bytes`` output for a tensor of ``numel`` elements and ``ndim`` dims.

    >>> wire_nbytes(1 << 24)
    16778256
    """
    return _HEADER.size + 8 * ndim + 4 * NUM_BUCKETS + numel


def values_nbytes(numel: int, ndim: int = 1) -> int:
    """Size of ``values_to_bytes`` output for a tensor of ``numel`` elements and ``ndim`` dims.

    >>> values_nbytes(1 << 24) - wire_nbytes(1 << 24)   # 4 bytes a value instead of 1, no codebook
    50330624
    """
    return _HEADER.size + 8 * ndim + 4 * numel


def _stats(x: torch.Tensor) -> tuple[float, float, bool]:
    """(mean, population std, needs_fp64) of a flat fp32 tensor; ValueError if non-finite."""
    n = x.numel()
    # sum and dot are ~40x faster than var_mean; E[x^2]-mu^2 is fine while |mu| < 10 sigma.
    s = float(x.sum())
    ss = float(torch.dot(x, x))
    mu = s / n
    var = ss / n - mu * mu
    if math.isfinite(s) and math.isfinite(ss) and var > 1e-2 * mu * mu:
        return mu, math.sqrt(var), False
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            "quantize: input contains NaN or Inf; exclude this worker's contribution"
        )
    # |mu| >> sigma (incl. constant tensors) or |x| near the fp32 range: fp32 bucket
    # positions and sums would lose the spread or overflow, so this rare path uses fp64.
    var64, mu64 = torch.var_mean(x.double(), correction=0)
    return float(mu64), math.sqrt(float(var64)), True


def quantize(x: torch.Tensor, clip_sigmas: float = DEFAULT_CLIP_SIGMAS) -> Quantized:
    """Quantize ``x`` (any float dtype, computed in fp32) to 256 bucket-mean codes.

    Raises ``ValueError`` for NaN/Inf input or a non-positive ``clip_sigmas``,
    ``TypeError`` for non-floating input.

    >>> q = quantize(torch.full((3,), 0.1))   # constant: exact round trip
    >>> dequantize(q).tolist() == torch.full((3,), 0.1).tolist()
    True
    """
    c = _clip(clip_sigmas)
    flat, shape = _flatten(x)
    if flat.numel() == 0:
        return Quantized(flat.to(torch.uint8), torch.zeros(NUM_BUCKETS, device=flat.device), shape)
    return _quantize(flat, c, *_stats(flat), shape)


def quantize_best(x: torch.Tensor, candidates: Sequence[float]) -> Quantized:
    """``quantize(x, c)`` with whichever ``c`` in ``candidates`` fits ``x`` best in L2.

    Codebook entries are bucket means, so the squared error is
    ``|x|^2 - sum_k count_k * codebook_k^2``: the best candidate maximizes the sum.
    Tensors of at least 2^16 values judge the candidates on a sample (1/16 of the
    values, in random 64-value blocks, fixed seed), with the whole tensor's mean and
    std, and quantize once: little more than one ``quantize``, not ``len(candidates)`` of them.
    Only the choice is sampled; the codebook is the bucket means of all of ``x``.
    On near-ties the sample may pick the slightly worse candidate.

    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.empty(100_000).exponential_(generator=g) - torch.empty(100_000).exponential_(generator=g)
    >>> y = dequantize(quantize_best(x, (4.0, 6.0)))   # Laplace tails: c=6 wins
    >>> float((y - x).norm()) == float((dequantize(quantize(x, 6.0)) - x).norm())
    True
    """
    cs = [_clip(c) for c in candidates]
    if not cs:
        raise ValueError("quantize_best: give at least one candidate")
    flat, shape = _flatten(x)
    n = flat.numel()
    if len(cs) == 1 or n == 0:
        return quantize(x, cs[0])
    mu, sigma, fp64 = _stats(flat)
    if n < _SAMPLE_MIN or fp64 or sigma == 0:
        return max((_quantize(flat, c, mu, sigma, fp64, shape) for c in cs), key=_fit)  # first of ties
    blocks = n // (_SAMPLE_FRACTION * _SAMPLE_BLOCK)
    g = torch.Generator(device=flat.device).manual_seed(n)
    starts = torch.randint(n - _SAMPLE_BLOCK + 1, (blocks, 1), generator=g, device=flat.device)
    sample = flat[(starts + torch.arange(_SAMPLE_BLOCK, device=flat.device)).view(-1)]
    best = max(cs, key=lambda c: _fit(_quantize(sample, c, mu, sigma, False, (sample.numel(),))))
    return _quantize(flat, best, mu, sigma, fp64, shape)


def _fit(q: Quantized) -> float:
    """sum_k count_k * codebook_k^2 = |x|^2 - squared error of ``q``."""
    counts = torch.bincount(q.indices, minlength=NUM_BUCKETS).double()
    return float(counts @ q.codebook.double().square())


def _clip(clip_sigmas) -> float:
    c = float(clip_sigmas)
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"quantize: clip_sigmas must be a positive finite number, got {clip_sigmas!r}")
    return c


def _flatten(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    if not x.is_floating_point():
        raise TypeError(f"quantize: expected a floating-point tensor, got {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32).contiguous(), tuple(x.shape)


def _quantize(flat: torch.Tensor, c: float, mu: float, sigma: float, fp64: bool, shape) -> Quantized:
    """``quantize`` of a non-empty flat fp32 tensor whose ``_stats`` are given."""
    n = flat.numel()
    width = 2.0 * c * sigma / NUM_BUCKETS
    lo = mu - c * sigma
    inv_w = 1.0 / width if width > 0 else math.inf
    if not math.isfinite(inv_w):
        # Constant tensor: mu is its exact value (fp64 mean of equal fp32 numbers).
        idx = torch.zeros(n, dtype=torch.uint8, device=flat.device)
        return Quantized(idx, torch.full((NUM_BUCKETS,), mu, device=flat.device), shape)

    work = torch.float64 if fp64 or inv_w > 1e30 else torch.float32  # fp32 scalar would overflow
    idx = torch.empty(n, dtype=torch.uint8, device=flat.device)
    offset = torch.tensor(-lo * inv_w, dtype=work, device=flat.device)
    parts = max(1, min(torch.get_num_threads(), n // _PARALLEL_MIN)) if flat.device.type == "cpu" else 1
    bounds = [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]
    if len(bounds) == 1:
        sums, counts = _bucketize(flat, idx, offset, inv_w, work, 0, n)
    else:
        futs = [_executor(len(bounds) - 1).submit(_bucketize, flat, idx, offset, inv_w, work, s, e)
                for s, e in bounds[1:]]
        sums, counts = _bucketize(flat, idx, offset, inv_w, work, *bounds[0])
        for f in futs:
            s_, c_ = f.result()
            sums, counts = sums + s_, counts + c_
    mids = lo + width * (torch.arange(NUM_BUCKETS, dtype=torch.float64, device=flat.device) + 0.5)
    mids = mids.clamp(-_FP32_MAX, _FP32_MAX)  # a clip bound may lie past fp32 range
    codebook = torch.where(counts > 0, sums.double() / counts.clamp(min=1), mids).to(torch.float32)
    return Quantized(idx, codebook, shape)


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="quantize")
        return _pool


def _forget_pool() -> None:
    # A forked child inherits the pool object but not its threads: work submitted
    # to it would wait forever, so the child starts a pool of its own.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _bucketize(flat, idx, offset, inv_w, work, start, stop) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``idx[start:stop]`` with bucket indices; return (sum, count) per bucket of that range."""
    buf = torch.empty(min(stop - start, _CHUNK), dtype=work, device=flat.device)
    for s in range(start, stop, _CHUNK):
        e = min(s + _CHUNK, stop)
        b = buf[: e - s]
        torch.add(offset, flat[s:e].to(work), alpha=inv_w, out=b).clamp_(0.0, NUM_BUCKETS - 1)
        idx[s:e].copy_(b)  # float -> uint8 truncates, i.e. floor on [0, 255]
    i = idx[start:stop]
    # fp32 sums: ~1e-5 relative error in the bucket means on 16M elements, far below
    # the bucket width; fp64 weights cost 5x, so only the fp64 path pays for them.
    sums = torch.bincount(i, weights=flat[start:stop].to(work), minlength=NUM_BUCKETS)
    return sums, torch.bincount(i, minlength=NUM_BUCKETS)


def dequantize(q: Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode to fp32 with ``q.shape``; writes into ``out`` (fp32, same numel) if given.

    >>> q = Quantized(torch.tensor([2, 0], dtype=torch.uint8), torch.arange(256.0), (2,))
    >>> dequantize(q).tolist()
    [2.0, 0.0]
    """
    if q.indices.dtype != torch.uint8 or q.codebook.shape != (NUM_BUCKETS,):
        raise ValueError("dequantize: expected uint8 indices and a 256-entry codebook")
    n = q.indices.numel()
    if math.prod(q.shape) != n:
        raise ValueError(f"dequantize: shape {q.shape} does not match {n} indices")
    codebook = q.codebook.to(torch.float32)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=q.indices.device)
    elif out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
        raise ValueError("dequantize: out must be a contiguous fp32 tensor with q.numel elements")
    flat = out.view(-1)
    for s in range(0, n, _CHUNK):
        e = min(s + _CHUNK, n)
        torch.index_select(codebook, 0, q.indices[s:e].long(), out=flat[s:e])
    return out.view(q.shape)


def _codec_id(codec: str) -> int:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    return CODECS.index(codec)


def to_bytes(q: Quantized, codec: str = "none") -> bytes:
    """Serialize to the wire format described in the module docstring.

    ``codec="zstd"``: entropy-code the indices (version 2) unless that saves nothing,
    in which case the output is version 1, exactly as with ``codec="none"``."""
    cid = _codec_id(codec)
    if len(q.shape) > _MAX_NDIM:
        raise ValueError(f"to_bytes: at most {_MAX_NDIM} dims")
    indices = q.indices.detach().cpu().contiguous().numpy().data
    head = [
        struct.pack(f"<{len(q.shape)}q", *q.shape),
        q.codebook.detach().to(device="cpu", dtype=torch.float32).numpy().astype("<f4").tobytes(),
    ]
    if cid and len(indices) > _PACK.size:
        coded = _compress(indices)
        if len(coded) + _PACK.size < len(indices):
            pack = _PACK.pack(cid, zlib.crc32(coded), len(coded))
            return b"".join((_HEADER.pack(_MAGIC, _PACKED, len(q.shape)), *head, pack, coded))
    return b"".join((_HEADER.pack(_MAGIC, _RAW, len(q.shape)), *head, indices))  # join copies once


def _compress(data: memoryview) -> bytes:
    import pyarrow  # noqa: PLC0415 - zstd (C++, releases the GIL); imported only by the peers that code

    return pyarrow.Codec("zstd", compression_level=_ZSTD_LEVEL).compress(data, asbytes=True)


def _decompress(data: memoryview, numel: int) -> bytearray:
    import pyarrow  # noqa: PLC0415 - as in _compress

    # The output is allocated at numel bytes and zstd stops there; a frame that decodes to
    # more or fewer bytes raises (pyarrow checks the size), so time and memory stay bounded.
    try:
        out = pyarrow.Codec("zstd").decompress(data, decompressed_size=numel, asbytes=False)
    except (OSError, pyarrow.ArrowException) as e:
        raise ValueError(f"from_bytes: corrupt zstd payload ({e})") from None
    return bytearray(out)  # a writable copy: torch.frombuffer warns on read-only memory


def _parse(mv: memoryview, versions=(_RAW, _PACKED, _VALUES)) -> tuple[int, tuple[int, ...], int, int]:
    """(version, shape, offset of the codebook or values, message length) from a message's
    headers; ``ValueError`` unless its version is one of ``versions``."""
    if len(mv) < _HEADER.size:
        raise ValueError(f"from_bytes: {len(mv)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, ndim = _HEADER.unpack_from(mv)
    if magic != _MAGIC:
        raise ValueError(f"from_bytes: bad magic {bytes(magic)!r}, expected {_MAGIC!r}")
    if version not in versions:
        raise ValueError(f"from_bytes: unsupported version {version}, expected {' or '.join(map(str, versions))}")
    if ndim > _MAX_NDIM or len(mv) < _HEADER.size + 8 * ndim:
        raise ValueError(f"from_bytes: truncated or invalid shape header (ndim={ndim})")
    shape = struct.unpack_from(f"<{ndim}q", mv, _HEADER.size)
    if any(d < 0 for d in shape):
        raise ValueError(f"from_bytes: negative dimension in shape {shape}")
    off = _HEADER.size + 8 * ndim
    if version == _VALUES:
        return version, shape, off, values_nbytes(math.prod(shape), ndim)
    if version == _RAW:
        return version, shape, off, wire_nbytes(math.prod(shape), ndim)
    if len(mv) < off + 4 * NUM_BUCKETS + _PACK.size:
        raise ValueError("from_bytes: truncated coded-message header")
    length = _PACK.unpack_from(mv, off + 4 * NUM_BUCKETS)[2]
    return version, shape, off, off + 4 * NUM_BUCKETS + _PACK.size + length


def message_nbytes(data: bytes | bytearray | memoryview) -> int:
    """Length of the message at the start of ``data``, read from its headers (``data``
    may be a receive buffer with room to spare); ``ValueError`` if they are malformed.

    >>> q = quantize(torch.zeros(5))
    >>> message_nbytes(to_bytes(q) + b"spare room") == wire_nbytes(5)
    True
    """
    return _parse(memoryview(data).cast("B"))[3]


def from_bytes(
    data: bytes | bytearray | memoryview, *, numel: int | None = None, prefix: bool = False
) -> Quantized:
    """Parse ``to_bytes`` output (either version); ``ValueError`` on any malformed input.

    ``numel``: the element count the caller expects, checked before anything is
    decoded; pass it for bytes from a peer, or a header claiming 2^40 values makes
    zstd allocate that much. ``prefix=True``: the message may be followed by other bytes (a receive
    buffer sized for the largest message); they are ignored.

    >>> from_bytes(b"junk")
    Traceback (most recent call last):
    ...
    ValueError: from_bytes: 4 bytes is shorter than the 8-byte header
    """
    mv = memoryview(data).cast("B")
    version, shape, off, expected = _parse(mv, (_RAW, _PACKED))
    n = math.prod(shape)
    if numel is not None and n != numel:
        raise ValueError(f"from_bytes: message holds {n} values, expected {numel}")
    if len(mv) != expected and not (prefix and len(mv) > expected):
        raise ValueError(f"from_bytes: got {len(mv)} bytes, expected {expected} for shape {shape}")
    # bytearray copies: no aliasing of the caller's (possibly read-only) buffer.
    codebook = torch.frombuffer(bytearray(mv[off : off + 4 * NUM_BUCKETS]), dtype=torch.float32)
    if not bool(torch.isfinite(codebook).all()):
        raise ValueError("from_bytes: codebook contains NaN or Inf")
    off += 4 * NUM_BUCKETS
    if version == _PACKED:
        cid, crc, length = _PACK.unpack_from(mv, off)
        coded = mv[off + _PACK.size : expected]
        if cid == 0 or cid >= len(CODECS):
            raise ValueError(f"from_bytes: unknown codec id {cid}")
        if length >= n:
            raise ValueError(f"from_bytes: coded payload of {length} bytes for {n} values (never sent coded)")
        if zlib.crc32(coded) != crc:
            raise ValueError("from_bytes: payload checksum mismatch (corrupted in transit?)")
        raw = _decompress(coded, n)
    else:
        raw = bytearray(mv[off:expected])
    indices = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)
    return Quantized(indices, codebook, tuple(shape))


def values_to_bytes(x: torch.Tensor) -> bytes:
    """``x`` (any float dtype, sent as fp32) as a full-precision message (version 3, the module
    docstring); ``ValueError`` for NaN/Inf, which no peer would accept.

    >>> x = torch.tensor([[0.1, -2.0], [3e-30, 7.0]])
    >>> values_from_bytes(values_to_bytes(x), numel=4).equal(x), len(values_to_bytes(x)) == values_nbytes(4, 2)
    (True, True)
    """
    flat, shape = _flatten(x)
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"values_to_bytes: at most {_MAX_NDIM} dims")
    if not (bool(torch.isfinite(flat.sum())) or bool(torch.isfinite(flat).all())):  # one reduction when finite
        raise ValueError("values_to_bytes: input contains NaN or Inf")
    values = flat.cpu().numpy().astype("<f4", copy=False).data
    return b"".join((_HEADER.pack(_MAGIC, _VALUES, len(shape)), struct.pack(f"<{len(shape)}q", *shape), values))


def values_from_bytes(
    data: bytes | bytearray | memoryview, *, numel: int | None = None, prefix: bool = False
) -> torch.Tensor:
    """Parse ``values_to_bytes`` output into an fp32 tensor of its shape; ``ValueError`` on any
    malformed input, an int8 message, NaN/Inf values, or (``numel``) a count other than expected,
    checked before anything is copied. ``prefix`` as in ``from_bytes``.

    >>> values_from_bytes(to_bytes(quantize(torch.zeros(3))))
    Traceback (most recent call last):
    ...
    ValueError: from_bytes: unsupported version 1, expected 3
    """
    mv = memoryview(data).cast("B")
    _, shape, off, expected = _parse(mv, (_VALUES,))
    n = math.prod(shape)
    if numel is not None and n != numel:
        raise ValueError(f"values_from_bytes: message holds {n} values, expected {numel}")
    if len(mv) != expected and not (prefix and len(mv) > expected):
        raise ValueError(f"values_from_bytes: got {len(mv)} bytes, expected {expected} for shape {shape}")
    # bytearray copies: no aliasing of the caller's (possibly read-only) buffer.
    out = torch.frombuffer(bytearray(mv[off:expected]), dtype=torch.float32) if n else torch.zeros(0)
    if not bool(torch.isfinite(out.sum())) and not bool(torch.isfinite(out).all()):
        raise ValueError("values_from_bytes: values contain NaN or Inf")
    return out.view(shape)
