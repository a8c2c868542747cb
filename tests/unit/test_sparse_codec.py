"""Top-k 2-bit pseudo-gradient codec with error feedback (intellect/diloco/sparse.py)."""

from __future__ import annotations

import doctest
import struct

import pytest
import torch

from intellect.diloco import sparse
from intellect.diloco.sparse import (
    Refused,
    Sparse,
    TopK,
    aggregate,
    compress,
    decode,
    densify,
    encode,
    entries,
    wire_nbytes,
)

CFG = TopK(chunk=4096, k=64)


def _stream(step: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    # a persistent direction plus fresh noise, like successive pseudo-gradients
    base = torch.randn(numel, generator=torch.Generator().manual_seed(7)) * 0.5
    return base + torch.randn(numel, generator=g)


@pytest.mark.parametrize("numel", [1, 63, 64, 4096, 4097, 3 * 4096 + 100, 20_000])
@pytest.mark.parametrize("packed", [False, True])
def test_round_trip_and_length(numel, packed):
    x = _stream(0, numel)
    s, residual = compress(torch.zeros(numel), x, CFG)
    data = encode(s, CFG, packed=packed)
    e = entries(numel, CFG)
    chunks = -(-numel // 4096)
    assert e == (chunks - 1) * 64 + min(64, numel - (chunks - 1) * 4096)
    v1 = 20 + 8 * chunks + -(-2 * e // 8) + -(-12 * e // 8)
    assert wire_nbytes(numel, CFG) == v1
    if packed and numel > 1:  # Rice-coded gaps: shorter than 12-bit indices from the first chunk on
        assert data[3] == 2 and len(data) < v1
    else:
        assert data[3] == 1 and len(data) == v1
    d = decode(data, numel, CFG)
    assert isinstance(d, Sparse)
    assert d.indices.equal(s.indices) and d.values.equal(s.values)
    # what was sent plus what was kept is the accumulator (up to fp32 rounding)
    assert torch.allclose(densify(d) + residual, x, atol=1e-6, rtol=0)


def test_rice_coded_indices_cost_near_their_entropy():
    """64 of 4096 spread at random: gaps near geometric with mean 64, whose entropy is about 7.4
    bits; the Rice code spends under 7.6 where version 1 spends 12. The encoder's choice of ``r``
    follows the gaps: one contiguous run at the start of each chunk costs a bit an index."""
    numel = 64 * 4096
    s, _ = compress(torch.zeros(numel), _stream(5, numel), CFG)
    fixed = len(encode(s, CFG, packed=False)) - _indices_offset(numel)
    rice = len(encode(s, CFG)) - _indices_offset(numel)
    e = entries(numel, CFG)
    assert fixed == 12 * e // 8 and 7.0 < 8 * rice / e < 7.6, 8 * rice / e
    run = torch.zeros(numel)
    run.view(64, 4096)[:, :64] = 1.0 + torch.rand(64, 64)
    s, _ = compress(torch.zeros(numel), run, CFG)
    rice = len(encode(s, CFG)) - _indices_offset(numel)
    assert 8 * (rice - 1) / e == 1.0 and encode(s, CFG)[_indices_offset(numel)] == 0  # r = 0, one byte
    d = decode(encode(s, CFG), numel, CFG)
    assert isinstance(d, Sparse) and d.indices.equal(s.indices)


def test_topk_picks_largest_and_two_levels_per_chunk():
    x = _stream(1, 2 * 4096)
    s, _ = compress(torch.zeros_like(x), x, CFG)
    for c in range(2):
        chunk = x[c * 4096 : (c + 1) * 4096]
        want = chunk.abs().topk(64).indices.sort().values + c * 4096
        got = s.indices[c * 64 : (c + 1) * 64]
        assert got.equal(want)
        mags = s.values[c * 64 : (c + 1) * 64].abs().unique()
        assert mags.numel() == 2
        top = chunk.abs().topk(64).values
        assert torch.allclose(mags.sort().values, torch.stack([top[32:].mean(), top[:32].mean()]))
        assert (torch.sign(s.values[c * 64 : (c + 1) * 64]) == torch.sign(x[got])).all()


def test_error_feedback_sum_converges():
    numel, steps = 3 * 4096 + 500, 200
    residual = torch.zeros(numel)
    sent_sum, true_sum = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    norms = []
    for t in range(steps):
        delta = _stream(t, numel)
        s, residual = compress(residual, delta, CFG)
        d = decode(encode(s, CFG), numel, CFG)
        assert isinstance(d, Sparse)
        sent_sum += densify(d).double()
        true_sum += delta.double()
        # the invariant: sum of pseudo-gradients = sum transmitted + residual, at every step
        assert torch.allclose(true_sum, sent_sum + residual.double(), atol=1e-3)
        norms.append(float(residual.norm()))
        if t + 1 == steps // 2:
            gap_half = float((true_sum - sent_sum).norm() / true_sum.norm())
    # the residual plateaus (about 64 steps for top-64 of 4096 to cycle through a chunk) while the
    # sums grow linearly, so the relative gap between them falls like 1/t
    assert max(norms[steps // 2 :]) < 1.1 * norms[steps // 2 - 1]
    gap = float((true_sum - sent_sum).norm() / true_sum.norm())
    assert gap < 0.6 * gap_half and gap < 0.15, (gap, gap_half)


def _message(numel=5000, packed=False):
    s, _ = compress(torch.zeros(numel), _stream(3, numel), CFG)
    return bytearray(encode(s, CFG, packed=packed)), numel


def _set_scale(data: bytearray, chunk: int, which: int, value: float) -> None:
    struct.pack_into("<f", data, 20 + 8 * chunk + 4 * which, value)


def _indices_offset(numel: int) -> int:
    e = entries(numel, CFG)
    return 20 + 8 * (-(-numel // 4096)) + -(-2 * e // 8)


def test_hostile_messages_refused_with_reason():
    data, n = _message()
    cases = {}
    cases["length"] = bytes(data[:-1])
    cases["length_long"] = bytes(data) + b"\0"
    bad = bytearray(data)
    struct.pack_into("<Q", bad, 12, 1 << 40)  # claims 2^40 values in the same bytes
    cases["geometry"] = bytes(bad)
    bad = bytearray(data)
    bad[0:3] = b"XXX"
    cases["header"] = bytes(bad)
    for name, v in (("nan", float("nan")), ("inf", float("inf")), ("huge", 1e30)):
        bad = bytearray(data)
        _set_scale(bad, 0, 0, v)
        cases[name] = bytes(bad)
    bad = bytearray(data)
    _set_scale(bad, 1, 1, -1.0)
    cases["negative"] = bytes(bad)
    # last chunk holds 5000 - 4096 = 904 values: point its first index (12 bits) at 4095
    off = _indices_offset(n) + 64 * 12 // 8
    bad = bytearray(data)
    bad[off] = 0xFF
    bad[off + 1] = (bad[off + 1] & 0xF0) | 0x0F
    cases["range"] = bytes(bad)
    # copy chunk 0's first index onto its second (12-bit fields: bytes 0-1 hold index 0, 1-2 index 1)
    off = _indices_offset(n)
    bad = bytearray(data)
    first = bad[off] | ((bad[off + 1] & 0x0F) << 8)
    bad[off + 1] = (bad[off + 1] & 0x0F) | ((first & 0x0F) << 4)
    bad[off + 2] = first >> 4
    cases["duplicate"] = bytes(bad)
    want = {"length": "length:", "length_long": "length:", "geometry": "geometry:", "header": "header:",
            "nan": "scale: NaN", "inf": "scale: NaN", "huge": "scale: 1e+30 above", "negative": "scale: need",
            "range": "index: out of range", "duplicate": "index: duplicate"}
    for name, msg in cases.items():
        r = decode(msg, n, CFG)
        assert isinstance(r, Refused), name
        assert r.reason.startswith(want[name]), (name, r.reason)
    assert isinstance(decode(b"", n, CFG), Refused)
    assert isinstance(decode(bytes(data), n, TopK(chunk=4096, k=32)), Refused)  # receiver expects other k
    assert isinstance(decode(bytes(data), n, CFG), Sparse)  # the untouched message still decodes


def test_hostile_rice_coded_messages_refused_with_reason():
    """Version 2's index part from a liar: a Rice parameter above the index width, fewer unary
    codes than entries, bytes past the last code, a gap that runs past its chunk, a message
    longer than version 1 (the receive bound); each refused with its reason, never raised."""
    data, n = _message(packed=True)
    assert data[3] == 2
    off = _indices_offset(n)
    cases = {}
    bad = bytearray(data)
    bad[off] = 13
    cases["parameter"] = bytes(bad)
    cases["codes"] = bytes(data[:-2])
    cases["trailing"] = bytes(data) + b"\xff"
    cases["longer"] = bytes(data) + b"\xff" * (wire_nbytes(n, CFG) - len(data))
    # every bit of the unary stream set but the last few: the codes run out (or one gap is huge)
    bad = bytearray(data)
    low = -(-bad[off] * entries(n, CFG) // 8)
    for i in range(off + 1 + low, len(bad) - 1):
        bad[i] = 0xFF
    cases["ones"] = bytes(bad)
    s, _ = compress(torch.zeros(n), _stream(3, n), CFG)
    idx = s.indices.clone()
    idx[-1] = 4096 + 1000  # the last chunk holds 904 values; still ascending, so version 2 carries it
    far = encode(Sparse(n, idx, s.values), CFG)
    assert far[3] == 2
    cases["range"] = far
    want = {"parameter": "index: Rice parameter 13", "codes": "index:", "trailing": "index: ",
            "longer": "index: ", "ones": "index:", "range": "index: out of range"}
    for name, msg in cases.items():
        r = decode(msg, n, CFG)
        assert isinstance(r, Refused), name
        assert r.reason.startswith(want[name]), (name, r.reason)
    assert isinstance(decode(bytes(data) + b"\0" * wire_nbytes(n, CFG), n, CFG), Refused)  # over the bound
    assert isinstance(decode(bytes(data), n, CFG), Sparse)


def test_unsorted_indices_are_canonicalised():
    cfg = TopK(chunk=8, k=2)
    s = Sparse(8, torch.tensor([5, 1]), torch.tensor([-1.0, 2.0]))
    d = decode(encode(s, cfg), 8, cfg)
    assert isinstance(d, Sparse)
    assert d.indices.tolist() == [1, 5] and d.values.tolist() == [2.0, -1.0]


def test_aggregate_two_members_per_index_average():
    a = Sparse(10, torch.tensor([0, 3, 7]), torch.tensor([1.0, -2.0, 4.0]))
    b = Sparse(10, torch.tensor([3, 5, 7]), torch.tensor([6.0, 3.0, -1.0]))
    mean, flagged = aggregate([a, b], 10, clip=4.0)
    want = [0.5, 0, 0, 2.0, 0, 1.5, 0, 1.5, 0, 0]
    assert mean.tolist() == want and flagged == {}


def test_aggregate_through_the_wire_matches_dense_mean():
    numel = 2 * 4096 + 10
    members = [compress(torch.zeros(numel), _stream(10 + i, numel), CFG)[0] for i in range(2)]
    decoded = [decode(encode(s, CFG), numel, CFG) for s in members]
    assert all(isinstance(d, Sparse) for d in decoded)
    mean, _ = aggregate(decoded, numel)  # type: ignore[arg-type]
    assert torch.equal(mean, (densify(members[0]) + densify(members[1])) / 2)


def test_aggregate_clips_a_hostile_member():
    numel = 3 * 4096
    honest = [compress(torch.zeros(numel), _stream(20 + i, numel), CFG)[0] for i in range(4)]
    liar_s = compress(torch.zeros(numel), _stream(30, numel), CFG)[0]
    liar = Sparse(numel, liar_s.indices, liar_s.values * 1000.0)  # within max_scale, 1000x honest
    cfg = TopK(chunk=4096, k=64, max_scale=1e4)
    decoded = [decode(encode(s, cfg), numel, cfg) for s in honest + [liar]]
    assert all(isinstance(d, Sparse) for d in decoded)
    mean, flagged = aggregate(decoded, numel, clip=4.0, block=4096)  # type: ignore[arg-type]
    honest_mean = sum(densify(s) for s in honest) / 4
    assert flagged == {4: 1.0}
    assert torch.allclose(mean, honest_mean)  # a flagged minority is left out
    plain, none = aggregate(decoded[:4], numel, clip=4.0, block=4096)  # type: ignore[arg-type]
    assert none == {} and torch.allclose(plain, honest_mean)


def test_compress_refuses_non_finite():
    x = torch.zeros(10)
    x[3] = float("nan")
    with pytest.raises(ValueError):
        compress(torch.zeros(10), x, CFG)


def test_docstring_examples():
    failed, attempted = doctest.testmod(sparse, optionflags=doctest.ELLIPSIS)
    assert attempted > 0 and failed == 0
