"""``\\boxed{`` answer extraction: the linear matcher vs the quadratic scan it replaced, side by side.

Two completions per size: *adversarial* (``\\boxed{`` repeated, none closed: the scan restarts at
every box and runs to the end of the text each time) and *ordinary* (prose with one closed box at
the end). Each cell is the median of ``--repeats`` calls of the row's function on the same text.
The baseline is skipped where its time, extrapolated quadratically from the previous size, would
pass ``--baseline-budget`` seconds per call.

    .venv/bin/python benchmarks/boxed_extraction.py
    .venv/bin/python benchmarks/boxed_extraction.py --sizes 7000 28000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from intellect.rl.rewards.math import _last_boxed  # noqa: E402


def quadratic_last_boxed(text: str) -> str | None:
    """The scan the linear matcher replaced: from each ``\\boxed{``, last first, walk to its close."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j]
        start = text.rfind("\\boxed{", 0, start)
    return None


def completion(kind: str, size: int) -> str:
    if kind == "adversarial":
        return ("\\boxed{" * (size // 7 + 1))[:size]
    prose = "We add the two numbers {carefully}, then check the sum. "
    tail = "So the answer is \\boxed{\\frac{1}{2}}."
    return (prose * (size // len(prose) + 1))[: size - len(tail)] + tail


def median_seconds(fn, text: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(text)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[7_000, 28_000, 1 << 20], help="completion characters")
    ap.add_argument("--repeats", type=int, default=5, help="calls per cell (median)")
    ap.add_argument("--baseline-budget", type=float, default=30.0, help="skip baseline calls predicted longer (s)")
    args = ap.parse_args()

    print(f"{'input':<12} {'chars':>9} {'linear ms':>11} {'quadratic ms':>13} {'ratio':>9}")
    for kind in ("adversarial", "ordinary"):
        prev: tuple[int, float] | None = None
        for size in sorted(args.sizes):
            text = completion(kind, size)
            assert _last_boxed(text) == (None if kind == "adversarial" else "\\frac{1}{2}")
            ours = median_seconds(_last_boxed, text, args.repeats)
            predicted = None if prev is None else prev[1] * (size / prev[0]) ** 2
            if predicted is not None and predicted > args.baseline_budget:
                print(f"{kind:<12} {size:>9} {ours * 1e3:>11.3f} {'skipped':>13} {'':>9}  "
                      f"(predicted {predicted:,.0f}s per call)")
                continue
            assert quadratic_last_boxed(text) == _last_boxed(text)
            base = median_seconds(quadratic_last_boxed, text, max(1, min(args.repeats, 3)))
            prev = (size, base)
            print(f"{kind:<12} {size:>9} {ours * 1e3:>11.3f} {base * 1e3:>13.3f} {base / ours:>8.1f}x")


if __name__ == "__main__":
    main()
