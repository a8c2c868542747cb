import doctest
import itertools

import pytest
import torch

from intellect.diloco import allreduce, transport
from intellect.diloco.allreduce import (
    all_reduce_mean,
    chunk_bounds,
    layer_buckets,
    merge_small,
    payload_bytes,
    relay_counts,
)
from intellect.diloco.quantize import wire_nbytes


def test_doctests():
    for mod in (allreduce, transport):
        assert doctest.testmod(mod).failed == 0


@pytest.mark.parametrize("n, parts", [(0, 1), (0, 3), (1, 4), (10, 3), (1000, 7), (17, 17)])
def test_chunk_bounds_tile_the_range_evenly(n, parts):
    b = chunk_bounds(n, parts)
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == n
    assert all(e0 == s1 for (_, e0), (s1, _) in zip(b, b[1:]))
    sizes = [e - s for s, e in b]
    assert max(sizes) - min(sizes) <= 1


def test_chunk_bounds_rejects_bad_input():
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)


def test_layer_buckets_on_llama_names():
    names = ["model.embed_tokens.weight"]
    names += [f"model.layers.{i}.{p}" for i in range(3) for p in ("q.weight", "mlp.weight", "norm.weight")]
    names += ["model.norm.weight", "lm_head.weight"]
    assert layer_buckets(names) == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11]]
    assert layer_buckets([]) == []
    # the first integer decides: "layers.1.mlp.2" belongs to layer 1
    assert layer_buckets(["l.1.a.0", "l.1.b.2", "l.2.a.1"]) == [[0, 1], [2]]


def test_merge_small_keeps_order_and_reaches_minimum():
    numels = [10, 3, 400, 5, 5, 900, 1]
    buckets = [[i] for i in range(len(numels))]
    merged = merge_small(buckets, numels, 100)
    assert list(itertools.chain(*merged)) == list(range(len(numels)))
    assert all(sum(numels[i] for i in b) >= 100 for b in merged)
    assert merge_small(buckets, numels, 1) == buckets
    assert merge_small([[0, 1]], [1, 1], 100) == [[0, 1]]


@pytest.mark.parametrize("relay", [1, 2, 3, 100])
def test_relay_counts_never_exceed_relay_and_count_contributors(relay):
    for flags in itertools.product([0, 1], repeat=6):
        counts = relay_counts(flags, relay)
        assert all(0 <= k <= relay for k in counts)
        if relay >= len(flags):  # ring-owner: every contribution arrives as sent
            assert counts == list(itertools.accumulate(flags))
        assert all(k == p for k, p, f in zip(counts[1:], counts, flags[1:]) if not f)  # forward


def test_payload_bytes_tradeoff():
    numels, W = [1 << 20, 1000, 3], 8
    ring = payload_bytes(numels, W, 0, "ring")
    owner = payload_bytes(numels, W, 0, "ring-owner")
    residual = payload_bytes(numels, W, 0, "ring-residual")
    assert payload_bytes(numels, W, 0, "prime") == ring
    # direct all-gathers owner -> all instead of along the ring: equal bytes in total
    # (and per rank when chunks are equal), spread over all pairs
    total = lambda algo: sum(payload_bytes(numels, W, p, algo) for p in range(W))  # noqa: E731
    assert total("direct") == total("ring")
    assert payload_bytes([1 << 20], W, 3, "direct") == payload_bytes([1 << 20], W, 3, "ring")
    assert residual / ring == pytest.approx(1.5, rel=0.01)
    # int8 + codebooks: about 2(W-1)/W bytes per value, vs 8(W-1)/W for an fp32 ring
    assert 2 * (W - 1) / W < ring / sum(numels) < 2 * (W - 1) / W * 1.05
    assert owner / ring == pytest.approx((W / 2 + 1) / 2, rel=0.01)
    assert payload_bytes(numels, W, 0, "ring", relay=W) == owner
    assert payload_bytes([2 * 4], 2, 1, "ring-owner") == 2 * wire_nbytes(4)


class _FakeGroup:
    def size(self):
        return 3

    def rank(self):
        return 0

    def name(self):
        return "gloo"


@pytest.mark.parametrize(
    "kw",
    [
        {"order": [0, 1, 1]},
        {"order": [0, 1]},
        {"algorithm": "tree"},
        {"algorithm": "direct", "relay": 2},
        {"relay": 0},
        {"buckets": [[0], [0, 1]]},
        {"buckets": [[0]]},
        {"window": 0},
    ],
)
def test_bad_arguments_raise_before_any_communication(kw):
    with pytest.raises(ValueError):
        all_reduce_mean([torch.zeros(3), torch.zeros(2)], _FakeGroup(), **kw)


def test_single_rank_group_is_exact_and_honours_the_mask():
    store = torch.distributed.HashStore()
    g = transport.new_group(store, "solo", 0, 1, timeout=5, hostname="127.0.0.1")
    x = torch.randn(10)
    y = x.clone()
    st = all_reduce_mean([y], g)
    assert torch.equal(x, y) and st.contributors == (0,) and st.bytes_sent == 0
    y[0] = float("inf")
    st = all_reduce_mean([y], g)
    assert not y.any() and st.contributors == ()


def test_finite_check_handles_overflowing_sums():
    from intellect.diloco.allreduce import _finite

    x = torch.randn(1000)
    assert _finite(x) and _finite(torch.zeros(0))
    assert _finite(torch.full((10,), 3e38))  # the sum overflows; the values are finite
    assert _finite(torch.full((10,), 6e4, dtype=torch.float16))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[500] = bad
        assert not _finite(y)
    y = torch.full((10,), 3e38)
    y[3] = float("nan")
    assert not _finite(y)
