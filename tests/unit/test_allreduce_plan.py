import doctest
import itertools
from typing import get_args

import pytest
import torch

from intellect import config as C
from intellect.diloco import config as DC
from intellect.diloco import allreduce, claims, plan, schedules, tcp_group, transport, worker
from intellect.diloco.allreduce import _finite, all_reduce_mean
from intellect.diloco.plan import (
    choose_algorithm,
    chunk_bounds,
    estimate_seconds,
    layer_buckets,
    link_chunks,
    payload_bytes,
    relay_counts,
)
from intellect.diloco.quantize import quantize, wire_nbytes
from intellect.diloco.ring_order import bottleneck, ring_order

from benchmarks import prime_allreduce  # PRIME's baseline lives with the benchmarks (pythonpath: pyproject)


def test_doctests():
    for mod in (allreduce, claims, plan, schedules, tcp_group, transport):
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


@pytest.mark.parametrize("algorithm", plan.ALGORITHMS)
def test_fp32_payload_is_about_four_times_int8(algorithm):
    """Same messages, 4 bytes a value instead of 1 (plus a 1 KiB codebook); an fp32 residual
    misses nothing, so ``"ring-residual"`` sends ``"ring"``'s messages."""
    numels, W = [1 << 20, 1000, 3], 4
    fp32 = payload_bytes(numels, W, 1, algorithm, compression="fp32")
    int8 = payload_bytes(numels, W, 1, "ring" if algorithm == "ring-residual" else algorithm)
    assert 3.9 < fp32 / int8 < 4.0
    assert link_chunks(algorithm, [0, 1, 2, 3], compression="fp32") == link_chunks(
        "ring" if algorithm == "ring-residual" else algorithm, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="unknown compression"):
        payload_bytes(numels, W, 1, algorithm, compression="fp16")


def test_compression_config_matches_the_executor():
    # every compression has its executor: the all-reduce's, and topk's gather (intellect/diloco/topk_reduce.py)
    assert set(get_args(DC.DilocoConfig.model_fields["compression"].annotation)) == {*plan.COMPRESSIONS, "topk"}
    assert DC.DilocoConfig().compression == allreduce.DEFAULT_COMPRESSION == "int8"


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
        {"algorithm": "prime"},  # the INTELLECT-1 baseline is benchmarks/prime_allreduce.py, not an algorithm
        {"algorithm": "direct", "relay": 2},
        {"relay": 0},
        {"buckets": [[0], [0, 1]]},
        {"buckets": [[0]]},
        {"window": 0},
        {"compression": "bf16"},
    ],
)
def test_bad_arguments_raise_before_any_communication(kw):
    with pytest.raises(ValueError):
        all_reduce_mean([torch.zeros(3), torch.zeros(2)], _FakeGroup(), **kw)


def test_prime_baseline_plans_as_ring_and_requantizes_what_it_forwards():
    """PRIME's messages are ``PLAN``'s (sizes checked on real ranks in test_allreduce.py); the
    planner refuses its name; each all-gather hop re-encodes the chunk it decoded."""
    assert prime_allreduce.PLAN in plan.ALGORITHMS and "prime" not in plan.ALGORITHMS
    with pytest.raises(ValueError, match="unknown algorithm 'prime'"):
        payload_bytes([8], 2, 0, "prime")
    x = torch.linspace(-1, 1, 1000) ** 3
    run = object.__new__(prime_allreduce.PrimeRun)  # _forwarded reads only clip and codec
    run.clip, run.codec = (4.0, 6.0), "none"
    msg = schedules.encode(quantize(x), "none")
    out = run._forwarded(msg, x.numel())
    assert out.numel() == msg.numel() == wire_nbytes(x.numel())
    assert not torch.equal(out, msg)  # requantized (a different codebook), not the owner's bytes
    y = schedules.decode(msg, x.numel())
    assert float((schedules.decode(out, x.numel()) - y).norm() / y.norm()) < 0.02
    base = object.__new__(schedules.Run)
    assert base._forwarded(msg, x.numel()) is msg  # production forwards the owner's exact bytes


def test_finite_check_handles_overflowing_sums():
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


# ---------------------------------------------------------------- choosing the algorithm (diloco.algorithm "auto")


def test_worker_plan_doctests():
    assert doctest.testmod(worker).failed == 0


@pytest.mark.parametrize("W", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("algorithm, relay", [("direct", None), ("ring", None), ("ring", 2), ("ring-owner", None),
                                              ("ring-residual", None)])
def test_link_chunks_add_up_to_payload_bytes(W, algorithm, relay):
    order = [0, *range(W - 1, 0, -1)]  # reversed: send to the rank below
    chunk = 1000
    links = link_chunks(algorithm, order, relay)
    for pos, rank in enumerate(order):
        sent = sum(k for (i, _), k in links.items() if i == rank) * wire_nbytes(chunk)
        assert sent == payload_bytes([W * chunk], W, pos, algorithm, relay)
    if algorithm != "direct":  # neighbour-only: exactly the ring's links
        assert set(links) == {(order[k], order[(k + 1) % W]) for k in range(W)}


def slow_pair(W: int, ratio: float, fast: float = 10e6) -> list[list[float]]:
    bw = [[0.0 if i == j else fast for j in range(W)] for i in range(W)]
    bw[1][2] = bw[2][1] = fast * ratio
    return bw


@pytest.mark.parametrize("W", [4, 5, 6, 8])
def test_auto_switches_to_ring_owner_at_the_cost_model_threshold(W):
    threshold = 4 / ((W - 1) * (W + 2))  # 2 chunks per pair vs W(W-1)/2 + W-1 per ring link
    for ratio, expect in ((threshold * 0.9, "ring-owner"), (threshold * 1.1, "direct"), (1.0, "direct")):
        bw = slow_pair(W, ratio)
        order = ring_order(bw)
        assert bottleneck(order, bw) == 10e6  # the solved ring avoids the slow pair
        algo, est = choose_algorithm(bw, order, nbytes=1e6)
        assert algo == expect, (ratio, est)
        assert choose_algorithm(bw, order, nbytes=123.0)[0] == algo  # the chunk size cancels


def test_auto_keeps_direct_when_the_ring_cannot_avoid_the_slow_pair():
    bw = slow_pair(3, 0.01)  # every 3-cycle uses 1->2 or 2->1
    order = ring_order(bw)
    algo, est = choose_algorithm(bw, order)
    assert algo == "direct" and est["ring-owner"] > est["direct"]


def test_choose_algorithm_ties_go_to_the_first_candidate_and_dead_links_cost_inf():
    two = [[0, 5.0], [5.0, 0]]  # W=2: both put 2 chunks on each direction of the one pair
    assert choose_algorithm(two, [0, 1]) == ("direct", {"direct": 0.2, "ring-owner": 0.2})
    assert choose_algorithm(two, [0, 1], candidates=("ring-owner", "direct"))[0] == "ring-owner"
    with pytest.raises(ValueError):
        choose_algorithm(two, [0, 1], candidates=())
    bw = [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    bw[0][1] = 0
    assert estimate_seconds(bw, "direct", [0, 1, 2]) == float("inf")
    assert estimate_seconds(bw, "ring", [0, 2, 1]) < float("inf")  # 0->2->1->0 never uses 0->1


@pytest.mark.parametrize("bw, order", [([[0, 1], [1, 0]], [0, 1, 2]), ([[0, 1, 1], [1, 0, 1], [1, 1, 0]], [0, 1, 1]),
                                       ([[0, 1, 1], [1, 0, 1]], [0, 1, 2])])
def test_estimate_rejects_mismatched_shapes(bw, order):
    with pytest.raises(ValueError):
        estimate_seconds(bw, "direct", order)


def test_auto_is_the_config_default_and_bad_algorithms_name_the_choices():
    assert DC.DilocoConfig().algorithm == "auto"
    assert C.load_config(DC.DilocoRunConfig, path="configs/diloco-tiny.toml", environ={}).diloco.algorithm == "auto"
    with pytest.raises(C.ConfigError, match="diloco.algorithm: Input should be 'auto', 'direct', 'ring-residual', "
                                            "'ring-owner' or 'ring'"):
        C.load_config(DC.DilocoRunConfig, overrides=["diloco.algorithm=tree"], environ={})
    with pytest.raises(ValueError, match="unknown algorithm 'auto'"):  # resolved by the worker, never sent
        payload_bytes([8], 2, 0, "auto")


# ---------------------------------------------------------------- which plan an attempt runs (plan.settle_plan)

HOSTILE = [None, "ring", 3, [], {"algorithm": "ring", "order": None, "estimates": {}},
           {"algorithm": "ring-residual", "order": None, "estimates": {}}, {"algorithm": "bogus"},
           {"algorithm": "direct", "order": [0, 1, 2, 99], "estimates": {}},
           {"algorithm": "direct", "order": [0, 0, 1, 2], "estimates": {}},
           {"algorithm": "direct", "order": [0, 1, 2, 3], "estimates": {"direct": float("nan")}},
           {"algorithm": "direct", "order": [0, 1, 2, 3], "estimates": {"x" * 9: 1.0}},
           {"algorithm": "ring-owner", "order": [3, 2, 1, 0], "estimates": {}}]


@pytest.mark.parametrize("decided", HOSTILE)
@pytest.mark.parametrize("own", [None, plan.fallback_plan("auto"),
                                 {"order": [0, 2, 1, 3], "algorithm": "ring-owner", "estimates": {"direct": 1.0}}])
def test_whatever_a_peer_decides_auto_runs_a_well_formed_screened_plan(own, decided):
    run, why = plan.settle_plan(own, decided, 4, "auto")
    assert run["algorithm"] in plan.SCREENED
    assert run["order"] is None or sorted(run["order"]) == [0, 1, 2, 3]
    checked, _ = plan.read_plan(decided, 4, "auto")
    if own is not None:  # a member that computes the plan runs its own, and says why it refused another
        ring = [0, 1, 2, 3]
        same = checked is not None and (checked["algorithm"], checked["order"] or ring) == (
            own["algorithm"], own["order"] or ring)
        assert run == own and (why == "") == same
    elif checked is None:  # one that cannot: never a malformed plan
        assert run == plan.fallback_plan("auto") and why


def test_a_fixed_algorithm_accepts_only_itself():
    ring = {"algorithm": "ring", "order": None, "estimates": {}}
    assert plan.read_plan(ring, 3, "ring")[0] == ring
    assert plan.read_plan({**ring, "algorithm": "direct"}, 3, "ring")[0] is None
    assert plan.settle_plan(None, {**ring, "algorithm": "direct"}, 3, "ring")[0]["algorithm"] == "ring"
