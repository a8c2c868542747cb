"""Ring-order solver: ours (numpy Held-Karp on ranks) vs a plain-Python Held-Karp
(toposolve's algorithm: max-min DP over subsets with a parent table) and toposolve's
C++ figures quoted from shared/reference/diloco.md (quoted, NOT measured here).

Times are medians of --reps runs on random asymmetric matrices (seeded); memory is the
tracemalloc peak of one separate run (numpy and Python allocations). A second table
checks the heuristic (used above exact_limit) against the exact optimum.

    .venv/bin/python benchmarks/ring_order_bench.py [--max-n 20] [--baseline-max-n 14]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from intellect.diloco.ring_order import bottleneck, ring_order  # noqa: E402

# shared/reference/diloco.md, section 1 "Bandwidth-aware ring": toposolve 0.1.17 measured there.
TOPOSOLVE_QUOTED = {16: (0.07, 23), 18: (0.38, 62), 20: (3.0, 250)}


def held_karp_py(bw: list[list[float]]) -> tuple[list[int], float]:
    """Plain-Python bottleneck Held-Karp with parents (the toposolve algorithm)."""
    n = len(bw)
    m = n - 1
    full = (1 << m) - 1
    dp = [[-1.0] * m for _ in range(full + 1)]
    parent = [[-1] * m for _ in range(full + 1)]
    for v in range(m):
        dp[1 << v][v] = bw[0][v + 1]
    for s in range(1, full + 1):
        row = dp[s]
        for j in range(m):
            val = row[j]
            if val < 0:
                continue
            out = bw[j + 1]
            for v in range(m):
                if s >> v & 1:
                    continue
                cand = min(val, out[v + 1])
                t = s | (1 << v)
                if cand > dp[t][v]:
                    dp[t][v] = cand
                    parent[t][v] = j
    best_j = max(range(m), key=lambda j: min(dp[full][j], bw[j + 1][0]))
    value = min(dp[full][best_j], bw[best_j + 1][0])
    path, s, j = [], full, best_j
    while j >= 0:
        path.append(j + 1)
        s, j = s & ~(1 << j), parent[s][j]
    return [0, *path[::-1]], value


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def peak_mb(fn) -> float:
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def exact_table(ns, reps, baseline_max_n) -> None:
    print(f"## exact solver, random asymmetric bandwidths, median of {reps} (baseline: 3)")
    print(f"{'n':>3} {'ours s':>9} {'ours MB':>8} {'py-HK s':>9} {'py-HK MB':>9} {'py/ours':>9}"
          f" {'toposolve s*':>13} {'MB*':>5} {'topo*/ours':>11}")
    for n in ns:
        bw = np.random.default_rng(n).uniform(1e8, 1e10, size=(n, n))
        ours_s = median_time(lambda: ring_order(bw), reps)
        ours_mb = peak_mb(lambda: ring_order(bw))
        line = f"{n:>3} {ours_s:>9.4f} {ours_mb:>8.1f}"
        if n <= baseline_max_n:
            lists = bw.tolist()
            base_s = median_time(lambda: held_karp_py(lists), 3)
            base_mb = peak_mb(lambda: held_karp_py(lists))
            c_py, v_py = held_karp_py(lists)
            assert v_py == bottleneck(ring_order(bw), bw) == bottleneck(c_py, bw), "solvers disagree"
            line += f" {base_s:>9.3f} {base_mb:>9.1f} {base_s / ours_s:>8.0f}x"
        else:
            line += f" {'-':>9} {'-':>9} {'-':>9}"
        if n in TOPOSOLVE_QUOTED:
            ts, mb = TOPOSOLVE_QUOTED[n]
            line += f" {ts:>13.2f} {mb:>5} {ts / ours_s:>10.1f}x"
        print(line)
    print("* toposolve: quoted from shared/reference/diloco.md (C++ Held-Karp, other run), not measured here")


def heuristic_table(trials: int) -> None:
    print(f"\n## heuristic (exact_limit=0) vs exact optimum, {trials} instances per row (half symmetric)")
    print(f"{'n':>3} {'optimal':>8} {'worst ratio':>12} {'median s':>9} {'max s':>7}")
    for n in (10, 14, 18):
        rng = np.random.default_rng(100 + n)
        hits, ratios, ts = 0, [], []
        for t in range(trials):
            bw = rng.uniform(1e8, 1e10, size=(n, n))
            if t % 2:
                bw = (bw + bw.T) / 2
            opt = bottleneck(ring_order(bw), bw)
            t0 = time.perf_counter()
            h = bottleneck(ring_order(bw, exact_limit=0), bw)
            ts.append(time.perf_counter() - t0)
            hits += h == opt
            ratios.append(h / opt)
        print(f"{n:>3} {hits:>5}/{trials:<2} {min(ratios):>12.4f} {statistics.median(ts):>9.3f} {max(ts):>7.3f}")
    print("\n## heuristic above the exact limit (default ring_order), vs identity order")
    print(f"{'n':>3} {'kind':>10} {'seconds':>8} {'bottleneck':>11} {'identity':>9}")
    for n in (24, 32, 48):
        for kind in ("asymmetric", "symmetric"):
            bw = np.random.default_rng(n).uniform(1e8, 1e10, size=(n, n))
            if kind == "symmetric":
                bw = (bw + bw.T) / 2
            t0 = time.perf_counter()
            c = ring_order(bw)
            dt = time.perf_counter() - t0
            print(f"{n:>3} {kind:>10} {dt:>8.3f} {bottleneck(c, bw) / 1e9:>10.3f}G {bottleneck(list(range(n)), bw) / 1e9:>8.3f}G")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-n", type=int, default=8)
    ap.add_argument("--max-n", type=int, default=20)
    ap.add_argument("--baseline-max-n", type=int, default=14)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--heuristic-trials", type=int, default=10)
    args = ap.parse_args()
    exact_table(range(args.min_n, args.max_n + 1), args.reps, args.baseline_max_n)
    if args.heuristic_trials:
        heuristic_table(args.heuristic_trials)


if __name__ == "__main__":
    main()
