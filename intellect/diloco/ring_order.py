"""Bandwidth-aware ring order: the max-min bottleneck Hamiltonian cycle.

A ring all-reduce moves the same bytes over every link in lockstep, so it runs
at the speed of its slowest link. Given measured throughputs ``bw[i][j]``
(bytes/s, directed link i -> j; the diagonal is ignored), ``ring_order`` returns
the cycle ``[0, c1, ..., c_{n-1}]`` (each node sends to the next, the last to
0) that maximizes ``min_k bw[c_k][c_{k+1}]``. Among equally good cycles it
returns the lexicographically smallest, so the answer is deterministic and a
symmetric matrix does not flip between a ring and its reverse.

Exact for ``n <= exact_limit`` (default 20): Held-Karp over subsets with
(max, min) in place of (min, +), as toposolve does, but

* on ranks of the bandwidths (uint8/uint16) instead of doubles: max/min only
  compare, so ranks are exact and 4-8x smaller;
* one DP on suffix paths (from v through S back to 0), which lets a forward
  greedy pass read off the lexicographically smallest optimal cycle with no
  parent table: 2^(n-1) * (n-1) * 2 bytes;
* vectorized with numpy over all subsets of one size (a "layer") at a time.

Above ``exact_limit`` a heuristic runs: greedy (widest next link) from every
start, then first-improvement local search on the sorted link vector (segment
moves, reversed short segments, node swaps, 2-opt when the matrix is
symmetric), then seeded double-bridge kicks. It is NOT exact. It stops early
when the bottleneck reaches an upper bound (each node's widest in/out links;
strong connectivity of the links at or above the bottleneck), else after 100
kicks without progress. How close it gets to the optimum, and how fast each
runs: ``benchmarks/ring_order_bench.py``.

Example::

    >>> bw = [[0, 9, 1, 5],
    ...       [1, 0, 9, 1],
    ...       [5, 1, 0, 9],
    ...       [9, 5, 1, 0]]
    >>> ring_order(bw)                      # 0->1->2->3->0 uses only 9s
    [0, 1, 2, 3]
    >>> bottleneck([0, 1, 2, 3], bw), bottleneck([0, 2, 1, 3], bw)
    (9.0, 1.0)
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Sequence

import numpy as np

__all__ = ["ring_order", "bottleneck", "all_orders_brute_force", "DEFAULT_EXACT_LIMIT"]

DEFAULT_EXACT_LIMIT = 20
_DP_CHUNK = 1 << 14  # subsets per vectorized step: keeps (n-1) x chunk temporaries in L2
_BRUTE_FORCE_LIMIT = 10


def _check(bw) -> np.ndarray:
    a = np.asarray(bw, dtype=np.float64).copy()
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ValueError(f"bandwidth matrix must be square n x n with n >= 1, got shape {a.shape}")
    off = ~np.eye(a.shape[0], dtype=bool)
    if not np.isfinite(a[off]).all():
        raise ValueError("bandwidth matrix has NaN or Inf off the diagonal")
    if (a[off] < 0).any():
        raise ValueError("bandwidth matrix has negative entries")
    np.fill_diagonal(a, 0.0)
    return a


def _ranks(a: np.ndarray) -> np.ndarray:
    """Dense ranks 1..K of the off-diagonal values (order-preserving), 0 on the diagonal."""
    n = a.shape[0]
    off = ~np.eye(n, dtype=bool)
    uniq = np.unique(a[off])
    dtype = np.uint8 if len(uniq) < 255 else np.uint16
    r = np.zeros((n, n), dtype=dtype)
    r[off] = np.searchsorted(uniq, a[off]) + 1
    return r


def _popcount(x: np.ndarray, bits: int) -> np.ndarray:
    if hasattr(np, "bitwise_count"):  # numpy >= 2
        return np.bitwise_count(x)
    pc = np.zeros(x.shape, dtype=np.uint8)
    for b in range(bits):
        pc += ((x >> b) & 1).astype(np.uint8)
    return pc


def _exact(r: np.ndarray) -> list[int]:
    """Lexicographically smallest max-min Hamiltonian cycle; r: ranks, n >= 3."""
    n = r.shape[0]
    m = n - 1  # nodes 1..n-1 are bits 0..m-1; node 0 is the fixed start
    full = (1 << m) - 1
    rr = r[1:, 1:]  # rr[v, j] = rank of link v+1 -> j+1
    # f[v, S]: best bottleneck of a path v -> (rest of S) -> 0 visiting exactly S (v in S); 0 = none.
    f = np.zeros((m, 1 << m), dtype=r.dtype)
    f[np.arange(m), 1 << np.arange(m)] = r[1:, 0]

    pc = _popcount(np.arange(1 << m, dtype=np.int64), m)
    order = np.argsort(pc, kind="stable").astype(np.int32)  # subsets grouped by size
    bounds = np.concatenate(([0], np.cumsum(np.bincount(pc, minlength=m + 1))))
    del pc
    bit = (1 << np.arange(m, dtype=np.int64))[:, None]
    col = rr.T[:, :, None]  # col[j] = rr[:, j] as an (m, 1) column
    for k in range(1, m):  # extend all |S| = k paths by one node in front
        layer = order[bounds[k] : bounds[k + 1]]
        for s in range(0, len(layer), _DP_CHUNK):
            src = layer[s : s + _DP_CHUNK].astype(np.int64)
            fs = f[:, src]  # (m, L); rows j not in S are 0 and drop out of the max
            best = np.zeros_like(fs)
            tmp = np.empty_like(fs)
            for j in range(m):
                np.minimum(fs[j], col[j], out=tmp)
                np.maximum(best, tmp, out=best)
            free = (src & bit) == 0  # (m, L): v not in S
            v_idx, s_idx = np.nonzero(free)
            f[v_idx, src[s_idx] | (1 << v_idx)] = best[v_idx, s_idx]

    opt = np.minimum(r[0, 1:], f[:, full]).max()
    cycle, cur, rem = [0], 0, full
    while rem:
        for v in range(m):  # smallest feasible next node keeps the cycle lexicographically smallest
            if rem >> v & 1 and min(r[cur, v + 1], f[v, rem]) >= opt:
                break
        else:
            raise AssertionError("ring_order: DP table inconsistent")
        cycle.append(v + 1)
        cur, rem = v + 1, rem & ~(1 << v)
    return cycle


def _key(c: Sequence[int], r: np.ndarray) -> tuple:
    """Sorted ascending link ranks of cycle c: compare lexicographically, larger is better."""
    a = np.asarray(c)
    return tuple(np.sort(r[a, np.roll(a, -1)]).tolist())


def _lex_better(added: list[np.ndarray], removed: list[np.ndarray]) -> np.ndarray:
    """Per candidate: does swapping links `removed` for `added` (equal-length lists of
    broadcastable rank arrays) raise the cycle's sorted link vector?

    Lexicographic order of ascending-sorted multisets is decided by the smallest element
    of their symmetric difference, so the rest of the cycle cancels out.
    """
    k = len(added)
    arrs = np.broadcast_arrays(*added, *removed)
    add, rem = arrs[:k], arrs[k:]
    lo_a, lo_r = functools.reduce(np.minimum, add), functools.reduce(np.minimum, rem)
    better = lo_a > lo_r
    tie = np.nonzero(lo_a == lo_r)  # rare on measured bandwidths: full compare only there
    if tie[0].size:
        a = np.sort(np.stack([x[tie] for x in add], -1), axis=-1)
        b = np.sort(np.stack([x[tie] for x in rem], -1), axis=-1)
        diff = a != b
        first = diff.argmax(axis=-1)[:, None]
        wins = np.take_along_axis(a, first, 1) > np.take_along_axis(b, first, 1)
        better[tie] = diff.any(axis=-1) & wins[:, 0]
    return better


def _improve_once(c: list[int], r: np.ndarray, symmetric: bool) -> list[int] | None:
    """First improving move, cheap neighbourhoods first; None at a local optimum."""
    n = len(c)
    ca = np.asarray(c)
    at = lambda off: ca[(np.arange(n)[:, None] + off) % n]  # noqa: E731  node at position i+off

    def moved(i: int, seg_len: int, d: int, reverse: bool) -> list[int]:
        seg = [c[(i + t) % n] for t in range(seg_len)]
        rest = [c[(i + seg_len + t) % n] for t in range(n - seg_len)]  # starts after the segment
        cut = d - seg_len + 1  # rest[d - L] is c[i + d]
        return rest[:cut] + (seg[::-1] if reverse else seg) + rest[cut:]

    def segment_move(max_len: int) -> list[int] | None:
        """Move c[i:i+L] (L <= max_len) to between c[i+d], c[i+d+1]: 3 links change,
        as the inner links keep their direction (or are symmetric when reversed)."""
        i = np.arange(n)[:, None, None]
        seg_len = np.arange(1, max_len + 1)[None, :, None]
        d = np.arange(1, n - 1)[None, None, :]
        pos = lambda off: ca[(i + off) % n]  # noqa: E731
        a, b, s, e, u, w = pos(-1), pos(seg_len), pos(0), pos(seg_len - 1), pos(d), pos(d + 1)
        rem = [r[a, s], r[e, b], r[u, w]]
        for reverse in (False, True) if symmetric else (False,):
            ends = [r[u, e], r[s, w]] if reverse else [r[u, s], r[e, w]]
            ok = _lex_better([r[a, b], *ends], rem) & (d >= seg_len)
            if ok.any():
                ii, ll, dd = np.unravel_index(np.argmax(ok), ok.shape)
                return moved(int(ii), int(ll) + 1, int(dd) + 1, reverse)
        return None

    if n >= 4 and (out := segment_move(min(3, n - 3))) is not None:
        return out

    if not symmetric:  # reversed short segments: their inner links change direction too
        for seg_len in (2, 3):
            if seg_len > n - 3:
                break
            d = np.arange(seg_len, n - 1)[None, :]
            a, b, s, e, u, w = at(-1), at(seg_len), at(0), at(seg_len - 1), at(d), at(d + 1)
            inner = [at(t) for t in range(seg_len)]
            fwd = [r[inner[t], inner[t + 1]] for t in range(seg_len - 1)]
            rev = [r[inner[t + 1], inner[t]] for t in range(seg_len - 1)]
            ok = _lex_better([r[a, b], r[u, e], r[s, w], *rev], [r[a, s], r[e, b], r[u, w], *fwd])
            if ok.any():
                ii, dd = np.unravel_index(np.argmax(ok), ok.shape)
                return moved(int(ii), seg_len, int(dd) + seg_len, True)

    if n >= 5:  # swap the nodes at positions i < j (non-adjacent, also around the wrap)
        i, j = np.triu_indices(n, 2)
        keep = ~((i == 0) & (j == n - 1))
        i, j = i[keep], j[keep]
        x, y = ca[i], ca[j]
        pi, ni, pj, nj = ca[(i - 1) % n], ca[(i + 1) % n], ca[(j - 1) % n], ca[(j + 1) % n]
        ok = _lex_better(
            [r[pi, y], r[y, ni], r[pj, x], r[x, nj]], [r[pi, x], r[x, ni], r[pj, y], r[y, nj]]
        )
        if ok.any():
            k = int(np.argmax(ok))
            out = list(c)
            out[i[k]], out[j[k]] = out[j[k]], out[i[k]]
            return out

    if symmetric and n >= 4:  # 2-opt: reverse c[i+1..j]; only the two boundary links change
        i, j = np.triu_indices(n, 2)
        keep = ~((i == 0) & (j == n - 1))
        i, j = i[keep], j[keep]
        x, y, xn, yn = ca[i], ca[j], ca[i + 1], ca[(j + 1) % n]
        ok = _lex_better([r[x, y], r[xn, yn]], [r[x, xn], r[y, yn]])
        if ok.any():
            k = int(np.argmax(ok))
            return c[: i[k] + 1] + c[i[k] + 1 : j[k] + 1][::-1] + c[j[k] + 1 :]

    if n >= 12:  # long segments last. A B C -> B A C is, rotated, also A C B and C B A,
        return segment_move(n // 3)  # so the moved block can be the shortest of the three
    return None


def _local_search(c: list[int], r: np.ndarray, symmetric: bool) -> list[int]:
    while (nxt := _improve_once(c, r, symmetric)) is not None:
        c = nxt
    return c


def _connected(adj: np.ndarray) -> bool:
    """Is the directed graph strongly connected (all reachable from 0 and reaching 0)?"""
    for g in (adj, adj.T):
        seen = np.zeros(len(g), dtype=bool)
        seen[0] = True
        while True:
            grown = seen | g[seen].any(axis=0)
            if (grown == seen).all():
                break
            seen = grown
        if not seen.all():
            return False
    return True


def _upper_bound(r: np.ndarray, symmetric: bool) -> int:
    """Rank no ring can beat: every node needs a link in and out (two distinct
    neighbours if symmetric) and the links >= the bottleneck must be strongly connected."""
    off = r.astype(np.int64)
    np.fill_diagonal(off, -1)
    if symmetric:
        ub = int(np.sort(off, axis=1)[:, -2].min())
    else:
        ub = int(min(off.max(axis=1).min(), off.max(axis=0).min()))
    vals = np.unique(off[off >= 0])
    lo, hi = 0, int(np.searchsorted(vals, ub))  # vals[lo] always feasible (complete graph)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _connected(off >= vals[mid]):
            lo = mid
        else:
            hi = mid - 1
    return int(vals[lo])


def _heuristic(r: np.ndarray, seed: int, kicks: int, patience: int = 100) -> list[int]:
    n = r.shape[0]
    symmetric = bool((r == r.T).all())
    upper = _upper_bound(r, symmetric)
    rr = r.astype(np.int64)
    starts = []
    for s0 in range(n):  # greedy: always take the widest link to an unvisited node
        c, seen = [s0], np.zeros(n, dtype=bool)
        seen[s0] = True
        for _ in range(n - 1):
            v = int(np.argmax(np.where(seen, -1, rr[c[-1]])))
            c.append(v)
            seen[v] = True
        starts.append(c)
    starts.sort(key=lambda c: _key(c, r), reverse=True)
    # the first of the best (max keeps the first of equals)
    best = max((_local_search(c, r, symmetric) for c in starts[:4]), key=lambda c: _key(c, r))
    best_key = _key(best, r)
    rng = np.random.default_rng(seed)
    cur, cur_key, stale = best, best_key, 0
    for _ in range(kicks if n >= 5 else 0):
        if best_key[0] >= upper or stale >= patience:  # provably optimal bottleneck / stuck
            break
        p = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))  # double bridge
        c = cur[: p[0]] + cur[p[1] : p[2]] + cur[p[0] : p[1]] + cur[p[2] :]
        c = _local_search(c, r, symmetric)
        k = _key(c, r)
        stale += 1
        if k >= cur_key:
            cur, cur_key = c, k
            if k > best_key:
                best, best_key, stale = c, k, 0
    z = best.index(0)
    return best[z:] + best[:z]


def ring_order(bw, *, exact_limit: int = DEFAULT_EXACT_LIMIT, seed: int = 0, kicks: int = 300) -> list[int]:
    """Ring order [0, ...] maximizing the slowest link; exact for n <= exact_limit.

    ``bw``: n x n array-like of directed link throughputs (>= 0, finite off the
    diagonal; the diagonal is ignored). Exact mode uses 2^(n-1)*(n-1)*2 bytes.
    Above ``exact_limit`` the result comes from a seeded heuristic (``seed``,
    ``kicks`` perturbation rounds) and is not guaranteed optimal.

    >>> ring_order([[0, 1, 5], [5, 0, 1], [1, 5, 0]])   # 0->2->1->0 uses the 5s
    [0, 2, 1]
    """
    a = _check(bw)
    n = a.shape[0]
    if n <= 2:
        return list(range(n))
    r = _ranks(a)
    if n <= exact_limit:
        return _exact(r)
    return _heuristic(r, seed, kicks)


def bottleneck(cycle: Sequence[int], bw) -> float:
    """Slowest link of the ring ``cycle`` (inf for a single node).

    >>> bottleneck([0, 2, 1], [[0, 1, 5], [5, 0, 1], [1, 5, 0]])
    5.0
    """
    a = _check(bw)
    c = [int(v) for v in cycle]
    if sorted(c) != list(range(a.shape[0])):
        raise ValueError(f"cycle must be a permutation of 0..{a.shape[0] - 1}, got {list(cycle)}")
    if len(c) == 1:
        return math.inf
    c = np.asarray(c)
    return float(a[c, np.roll(c, -1)].min())


def all_orders_brute_force(bw) -> tuple[list[int], float]:
    """(cycle, bottleneck) by trying all (n-1)! orders; the lexicographically smallest
    optimal cycle, as ``ring_order``. For tests; n <= 10.

    >>> all_orders_brute_force([[0, 1, 5], [5, 0, 1], [1, 5, 0]])
    ([0, 2, 1], 5.0)
    """
    a = _check(bw)
    n = a.shape[0]
    if n > _BRUTE_FORCE_LIMIT:
        raise ValueError(f"brute force is for n <= {_BRUTE_FORCE_LIMIT}, got n={n}")
    if n == 1:
        return [0], math.inf
    perms = np.array(list(itertools.permutations(range(1, n))), dtype=np.int64)  # lexicographic
    cyc = np.concatenate([np.zeros((len(perms), 1), dtype=np.int64), perms], axis=1)
    vals = a[cyc, np.roll(cyc, -1, axis=1)].min(axis=1)
    k = int(np.argmax(vals))  # first maximum = lexicographically smallest
    return cyc[k].tolist(), float(vals[k])
