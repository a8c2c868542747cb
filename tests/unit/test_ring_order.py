import doctest
import math

import numpy as np
import pytest
import torch

import intellect.diloco.ring_order as mod
from intellect.diloco.ring_order import all_orders_brute_force, bottleneck, ring_order


def random_bw(n, rng, kind):
    bw = rng.uniform(1e8, 1e10, size=(n, n))
    if kind == "ties":  # few distinct values: many optimal cycles, tests the tie-break
        bw = rng.integers(0, 4, size=(n, n)).astype(float)
    if kind in ("symmetric", "ties"):
        bw = np.triu(bw, 1) + np.triu(bw, 1).T
    np.fill_diagonal(bw, 0.0)
    return bw


def planted(n, rng):
    """Links of a hidden ring in [10, 11), all others in [0, 10): that ring is the unique optimum."""
    bw = rng.uniform(0, 10, size=(n, n))
    perm = [0, *rng.permutation(np.arange(1, n)).tolist()]
    for a, b in zip(perm, perm[1:] + perm[:1]):
        bw[a, b] = rng.uniform(10, 11)
    return bw, perm


def assert_valid_cycle(c, n):
    assert c[0] == 0 and sorted(c) == list(range(n))


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("kind", ["asymmetric", "symmetric", "ties"])
def test_exact_equals_brute_force(n, kind):
    rng = np.random.default_rng(1000 * n + len(kind))
    for _ in range(25):
        bw = random_bw(n, rng, kind)
        cycle = ring_order(bw)
        bf_cycle, bf_value = all_orders_brute_force(bw)
        assert_valid_cycle(cycle, n)
        assert bottleneck(cycle, bw) == bf_value
        assert cycle == bf_cycle  # same tie-break: lexicographically smallest optimum


@pytest.mark.parametrize("n", [9, 12, 17, 18])
def test_exact_finds_planted_ring(n):
    # n >= 17 has > 254 distinct values: exercises the uint16 rank path.
    bw, perm = planted(n, np.random.default_rng(n))
    assert ring_order(bw) == perm
    assert bottleneck(perm, bw) >= 10


def test_tie_break_lexicographic_and_reverse_stable():
    bw = np.ones((5, 5))  # every ring is optimal
    assert ring_order(bw) == [0, 1, 2, 3, 4]
    rng = np.random.default_rng(7)
    sym = random_bw(7, rng, "symmetric")
    c = ring_order(sym)
    rev = [0, *c[1:][::-1]]
    assert c < rev and bottleneck(rev, sym) == bottleneck(c, sym)


def test_deterministic_and_input_types():
    bw = random_bw(10, np.random.default_rng(3), "asymmetric")
    expected = ring_order(bw)
    assert ring_order(bw) == expected
    assert ring_order(bw.tolist()) == expected
    assert ring_order(torch.tensor(bw)) == expected
    assert ring_order(bw.astype(np.float32)) == ring_order(bw.astype(np.float32))


def test_tiny_rings():
    assert ring_order([[0.0]]) == [0]
    assert bottleneck([0], [[5.0]]) == math.inf
    assert ring_order([[0, 3], [4, 0]]) == [0, 1]
    assert bottleneck([0, 1], [[0, 3], [4, 0]]) == 3.0
    bw = [[0, 1, 9], [9, 0, 1], [1, 9, 0]]
    assert ring_order(bw) == [0, 2, 1]
    assert bottleneck([0, 2, 1], bw) == 9.0


def test_diagonal_is_ignored():
    bw = random_bw(6, np.random.default_rng(4), "asymmetric")
    expected = ring_order(bw)
    np.fill_diagonal(bw, np.nan)
    assert ring_order(bw) == expected
    np.fill_diagonal(bw, -1.0)
    assert ring_order(bw) == expected


def test_zero_bandwidth_links_allowed():
    bw = np.zeros((4, 4))
    bw[0, 1] = bw[1, 2] = bw[2, 3] = bw[3, 0] = 1.0
    assert ring_order(bw) == [0, 1, 2, 3]
    assert ring_order(np.zeros((4, 4))) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.ones((3, 4)), "square"),
        (np.ones(3), "square"),
        (np.ones((0, 0)), "square"),
        (np.ones((2, 2, 2)), "square"),
        ([[0, -1], [1, 0]], "negative"),
        ([[0, np.nan], [1, 0]], "NaN or Inf"),
        ([[0, np.inf], [1, 0]], "NaN or Inf"),
    ],
)
def test_bad_input_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        ring_order(bad)
    with pytest.raises(ValueError, match=match):
        bottleneck([0, 1], bad)


def test_bottleneck_rejects_non_permutation():
    bw = np.ones((3, 3))
    for c in ([0, 1], [0, 1, 1], [0, 1, 3]):
        with pytest.raises(ValueError, match="permutation"):
            bottleneck(c, bw)


def test_brute_force_limit():
    with pytest.raises(ValueError, match="n <= 10"):
        all_orders_brute_force(np.ones((11, 11)))


@pytest.mark.parametrize("kind", ["asymmetric", "symmetric", "ties"])
def test_heuristic_n24_valid_and_beats_identity(kind):
    rng = np.random.default_rng(24)
    for _ in range(2):
        bw = random_bw(24, rng, kind)
        c = ring_order(bw)
        assert_valid_cycle(c, 24)
        assert bottleneck(c, bw) >= bottleneck(list(range(24)), bw)
        assert ring_order(bw) == c  # seeded: deterministic


def test_heuristic_finds_planted_ring_n24():
    bw, perm = planted(24, np.random.default_rng(5))
    c = ring_order(bw)
    assert bottleneck(c, bw) == bottleneck(perm, bw)


@pytest.mark.parametrize("n", range(3, 9))
def test_heuristic_close_to_exact_on_small_n(n):
    rng = np.random.default_rng(50 + n)
    for kind in ("asymmetric", "symmetric"):
        bw = random_bw(n, rng, kind)
        c = ring_order(bw, exact_limit=0)  # force the heuristic
        assert_valid_cycle(c, n)
        assert bottleneck(c, bw) == all_orders_brute_force(bw)[1]


def test_docstring_examples():
    assert doctest.testmod(mod).failed == 0
