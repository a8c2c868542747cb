"""int8 all-reduce on the WAN testbed (infra/wan): 4 hosts as network namespaces, tc-shaped links.

Acceptance: "4 hosts: all-reduce time within 1.15x of the link-bandwidth bound; with one
slow link, the solved ring order at least 2x faster than the worst order."

* Part 1: every directed link at --rate Mbit/s. ``all_reduce_mean`` of --numel floats per
  rank (--buckets equal tensors, pipelined) for each algorithm. Bound = max over directed
  links (bytes this run handed to that link, from ``stats.bytes_by_peer``) / (goodput of
  that link, measured with ``tb.throughput_mbit``: ~95.6% of the tbf rate, which counts
  headers). Each algorithm is held to the bound of its OWN bytes, so an algorithm that
  sends more is slower but can still be within 1.15x. Every algorithm runs with the
  default codec (zstd-coded indices: fewer bytes, more CPU); the default algorithm also
  runs with ``codec="none"``. "unshaped s": the same trials on the same testbed with
  unshaped links (veth speed): the CPU and protocol time alone. The 4 ranks share this
  machine's cores, so when "unshaped s" is not small next to the bound, time/bound
  measures the CPU share, not the algorithm's use of the links.
* Part 2: links at --fast, except the pair 1<->2 at --slow (it is in the identity ring
  0-1-2-3). The directed bandwidth matrix is measured (stands in for the worker's
  in-transport measurement), ``ring_order`` solves it, and --ring-algorithm runs with the
  solved order and with the worst order (smallest bottleneck of the 6 directed cycles).
  ``"direct"`` also runs, with the solved order: its all-gather crosses the slow pair.
* ``auto`` (the worker config's default, ``diloco.algorithm``) runs in both parts as a
  worker does it: the ranks probe each pair over gloo (``bandwidth.measure_ring``,
  ``bandwidth_probe_bytes`` each way, not timed as part of the all-reduce), and the
  worker's ``allreduce_plan`` (``intellect.diloco.plan``) solves the ring and picks from the estimates; its row is held to the bound of the
  bytes it sent, i.e. of the algorithm it chose. In part 1 its "unshaped s" runs the
  algorithm and order it chose on the shaped links.

Times: wall time from a barrier before the call to a barrier after it, max over ranks,
median of --reps. Each rank is a process inside its host; the TCPStore master is rank 0,
on 10.77.0.1. The ranks share this machine's cores, so other load stalls the pipeline and
inflates time/bound (check ``uptime``). Needs root (network namespaces, tc); otherwise it
says why and exits 0.

    .venv/bin/python benchmarks/wan_allreduce.py [--numel 4000000] [--rate 50] [--reps 3]
"""

# ruff: noqa: PLC0415 - the parent drives the testbed; torch and the library load only in the ranks

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.wan.testbed import Testbed, cleanup_stale, probe  # noqa: E402

PORT = 29500  # each testbed's namespaces are fresh, so a fixed port is free
RESULTS = ROOT / "benchmarks" / "results" / "wan_allreduce.json"


# ---------------------------------------------------------------- one rank, inside its host


def resolve_auto(trial: dict, group, store, key: str, numel: int) -> tuple[dict, dict]:
    """A worker's ``auto``: probe, solve the ring, choose; (all_reduce_mean kwargs, what was chosen)."""
    import torch.distributed as dist

    from intellect.diloco.config import DilocoConfig
    from intellect.diloco.bandwidth import measure_ring
    from intellect.diloco.plan import allreduce_plan

    t0 = time.perf_counter()
    pstore = dist.PrefixStore(key, store)  # pyright: ignore[reportPrivateImportUsage]  # public, from torch._C
    _, columns = measure_ring(group, pstore, "col", DilocoConfig().bandwidth_probe_bytes)
    W = len(columns)
    bw = [[columns[j][i] if i != j else 0.0 for j in range(W)] for i in range(W)]  # row: sender, as the worker's
    plan = allreduce_plan("auto", bw, numel)
    info = {"chosen": plan["algorithm"], "order": plan["order"], "estimates": plan["estimates"],
            "probe_s": time.perf_counter() - t0, "probe_mbit": [[v * 8e-6 for v in row] for row in bw]}
    return {**trial, "algorithm": plan["algorithm"], "order": plan["order"]}, info


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from intellect.diloco.allreduce import all_reduce_mean
    from intellect.diloco.transport import new_group

    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    rank, world = spec["rank"], spec["world"]
    store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]  # public API, re-exported from torch._C
        spec["master"], PORT, world, rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    group = new_group(store, "wan", rank, world, timeout=120, hostname=spec["addr"])
    g = torch.Generator().manual_seed(rank)
    n, k = spec["numel"], spec["buckets"]
    grads = [torch.randn(n // k, generator=g) * 1e-3 for _ in range(k)]

    def timed(xs, **kw):
        group.barrier().wait()
        t0 = time.perf_counter()
        st = all_reduce_mean(xs, group, **kw)
        group.barrier().wait()
        return time.perf_counter() - t0, st

    timed([torch.randn(1 << 16, generator=g)])  # first-call costs (imports, allocations)
    out = []
    for t, trial in enumerate(spec["trials"]):
        auto = None
        if trial.get("algorithm") == "auto":
            trial, auto = resolve_auto(trial, group, store, f"bw/{t}", n)
        reps = []
        for _ in range(spec["reps"]):
            dt, st = timed([x.clone() for x in grads], **trial)
            reps.append({"seconds": dt, "algorithm": st.algorithm, "payload": st.payload_bytes,
                         "by_peer": {str(p): b for p, b in st.bytes_by_peer.items()}, "auto": auto})
        out.append(reps)
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- driver


def run_ranks(tb: Testbed, numel: int, buckets: int, trials: list[dict], reps: int, timeout: float) -> list:
    """Per trial: median over reps of the max over ranks, every rep's, and bytes per directed link (rep 0)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "wan0", "OMP_NUM_THREADS": "1"}
    procs = []
    for i in range(tb.n):
        spec = {"rank": i, "world": tb.n, "master": tb.addr(0), "addr": tb.addr(i), "numel": numel,
                "buckets": buckets, "trials": trials, "reps": reps}
        procs.append(tb.run(i, [sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    end, res = time.monotonic() + timeout, []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"rank {i} timed out after {timeout:.0f} s") from None
        if p.returncode:
            raise RuntimeError(f"rank {i} exited {p.returncode}:\n{err[-3000:]}")
        res.append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for t in range(len(trials)):
        secs = [max(res[i][t][r]["seconds"] for i in range(tb.n)) for r in range(reps)]
        link_bytes = {(i, int(p)): b for i in range(tb.n) for p, b in res[i][t][0]["by_peer"].items()}
        auto = [res[i][t][0]["auto"] for i in range(tb.n)]
        if auto[0] and any(x["chosen"] != auto[0]["chosen"] or x["order"] != auto[0]["order"] for x in auto):
            raise RuntimeError(f"trial {t}: the ranks' auto choices differ: {auto}")
        rows.append({"seconds": statistics.median(secs), "all_seconds": secs,
                     "algorithm": res[0][t][0]["algorithm"], "link_bytes": link_bytes, "auto": auto[0]})
    return rows


def auto_line(auto: dict) -> str:
    est = ", ".join(f"{a} {s:.3f} s" for a, s in auto["estimates"].items())
    return (f"  auto: gloo probe {auto['probe_s']:.1f} s (Mbit/s, row -> column):\n{fmt_matrix(auto['probe_mbit'])}\n"
            f"  auto: ring {'->'.join(map(str, auto['order'] + auto['order'][:1]))}, estimated {est}: "
            f"chose {auto['chosen']}")


def measure_bw(tb: Testbed, nbytes: int, rounds: int = 2) -> list[list[float]]:
    """Directed goodput matrix (Mbit/s), max of ``rounds``: noise (CPU contention, a slow
    TCP start) mostly lowers it. One direction per pair at a time: a flow's ACKs ride the
    reverse link, and on a slow link they would steal from a reverse flow."""
    bw = [[0.0] * tb.n for _ in range(tb.n)]
    for _, fwd in itertools.product(range(rounds), (True, False)):
        pairs = [(i, j) if fwd else (j, i) for i, j in itertools.combinations(range(tb.n), 2)]
        for (i, j), v in zip(pairs, tb.throughput_mbit(pairs, nbytes=nbytes, timeout=60)):
            bw[i][j] = max(bw[i][j], v)
    return bw


def bound_s(link_bytes: dict, bw: list[list[float]]) -> float:
    return max(b * 8 / (bw[i][j] * 1e6) for (i, j), b in link_bytes.items() if b)


def fmt_matrix(bw: list[list[float]]) -> str:
    return "\n".join("    " + " ".join(f"{v:7.1f}" if i != j else f"{'-':>7}" for j, v in enumerate(row))
                     for i, row in enumerate(bw))


def part1(a) -> dict:
    from intellect.diloco.allreduce import DEFAULT_ALGORITHM, DEFAULT_CODEC
    from intellect.diloco.plan import ALGORITHMS

    W = 4
    algs = a.algorithms or list(dict.fromkeys([DEFAULT_ALGORITHM, *ALGORITHMS]))
    variants = [(alg, DEFAULT_CODEC) for alg in algs] + [(algs[0], c) for c in a.codecs if c != DEFAULT_CODEC]
    variants += [("auto", DEFAULT_CODEC)] if "auto" not in algs else []
    print(f"Part 1: {W} hosts, full mesh, every link {a.rate:g} Mbit/s; {a.numel} floats/rank in "
          f"{a.buckets} buckets, window {a.window}; median of {a.reps}")
    with Testbed(W, rate_mbit=a.rate) as tb:
        bw = measure_bw(tb, 2_000_000)
        print(f"  measured goodput, Mbit/s (row -> column):\n{fmt_matrix(bw)}")
        trials = [{"algorithm": alg, "window": a.window, "codec": codec} for alg, codec in variants]
        rows = run_ranks(tb, a.numel, a.buckets, trials, a.reps, timeout=240)
    # unshaped: auto's CPU reference is the algorithm and order it chose on the shaped links
    cpu_trials = [t | ({"algorithm": r["auto"]["chosen"], "order": r["auto"]["order"]} if r["auto"] else {})
                  for t, r in zip(trials, rows)]
    with Testbed(W) as tb:
        unshaped = [r["seconds"] for r in run_ranks(tb, a.numel, a.buckets, cpu_trials, a.reps, timeout=240)]
    print(f"  {'algorithm, codec':<28}{'MB/busiest link':>16}{'bound s':>9}{'median s':>10}{'/bound':>8}{'best s':>8}"
          f"{'/bound':>8}{'unshaped s':>11}")
    out = []
    for (alg, codec), r, cpu in zip(variants, rows, unshaped):
        b = bound_s(r["link_bytes"], bw)
        default = (alg, codec) == (DEFAULT_ALGORITHM, DEFAULT_CODEC)
        name = f"{alg}{' -> ' + r['auto']['chosen'] if r['auto'] else ''}, {codec}" + (" (default)" if default else "")
        ok, best = r["seconds"] / b <= 1.15, min(r["all_seconds"])
        print(f"  {name:<28}{max(r['link_bytes'].values()) / 1e6:>16.2f}{b:>9.3f}{r['seconds']:>10.3f}"
              f"{r['seconds'] / b:>8.3f}{best:>8.3f}{best / b:>8.3f}{cpu:>11.3f}{'' if ok else '  median > 1.15x'}")
        out.append({"algorithm": alg, "codec": codec, "default": default, "bound_s": b, "seconds": r["seconds"],
                    "all_seconds": r["all_seconds"], "ratio": r["seconds"] / b, "pass": ok, "unshaped_s": cpu,
                    "auto": r["auto"], "link_bytes": {f"{i}->{j}": v for (i, j), v in r["link_bytes"].items()}})
    for r in rows:
        if r["auto"]:
            print(auto_line(r["auto"]))
    return {"bw_mbit": bw, "rows": out, "pass": all(r["pass"] for r in out)}


def part2(a) -> dict:
    from intellect.diloco.ring_order import bottleneck, ring_order

    W, ra = 4, a.ring_algorithm
    print(f"Part 2: {W} hosts, links {a.fast:g} Mbit/s except 1<->2 at {a.slow:g} Mbit/s; "
          f"{a.numel2} floats/rank in {a.buckets} buckets; median of {a.reps}")
    rate = [[a.fast] * W for _ in range(W)]
    rate[1][2] = rate[2][1] = a.slow
    with Testbed(W, rate_mbit=rate) as tb:
        bw = measure_bw(tb, 1_000_000)
        print(f"  measured goodput, Mbit/s (row -> column):\n{fmt_matrix(bw)}")
        solved = ring_order(bw)
        cycles = [[0, *p] for p in itertools.permutations(range(1, W))]
        worst = min(cycles, key=lambda c: bottleneck(c, bw))
        runs: list[tuple[str, str, list[int] | None]] = [("solved", ra, solved), ("worst", ra, worst)]
        if ra != "direct":
            runs.append(("direct", "direct", solved))
        runs.append(("auto", "auto", None))  # probes, solves and chooses inside the ranks
        trials = [{"algorithm": alg, "order": c, "window": a.window} for _, alg, c in runs]
        rows = run_ranks(tb, a.numel2, a.buckets, trials, a.reps, timeout=300)
    print(f"  {'order':<9}{'algorithm':<14}{'ring':<14}{'min Mbit/s':>11}{'bound s':>9}{'median s':>10}"
          f"{'/bound':>8}{'best s':>8}{'/bound':>8}")
    out: dict[str, Any] = {"bw_mbit": bw}
    for (label, alg, c), r in zip(runs, rows):
        if r["auto"]:
            alg, c = f"->{r['auto']['chosen']}", r["auto"]["order"]
        assert c is not None  # only the auto run has no order, and its ranks report the one they chose
        b = bound_s(r["link_bytes"], bw)
        best = min(r["all_seconds"])
        print(f"  {label:<9}{alg:<14}{'->'.join(map(str, c + c[:1])):<14}{bottleneck(c, bw):>11.1f}{b:>9.3f}"
              f"{r['seconds']:>10.3f}{r['seconds'] / b:>8.3f}{best:>8.3f}{best / b:>8.3f}")
        out[label] = {"algorithm": r["algorithm"], "order": c, "bottleneck_mbit": bottleneck(c, bw), "bound_s": b,
                      "seconds": r["seconds"], "all_seconds": r["all_seconds"], "ratio": r["seconds"] / b,
                      "auto": r["auto"], "link_bytes": {f"{i}->{j}": v for (i, j), v in r["link_bytes"].items()}}
    print(auto_line(out["auto"]["auto"]))
    out["speedup"] = out["worst"]["seconds"] / out["solved"]["seconds"]
    out["pass"] = out["speedup"] >= 2
    print(f"  {ra}: solved order {out['speedup']:.1f}x faster than the worst order (medians; target >= 2x)")
    fixed = min((out[k] for k in ("solved", "direct") if k in out), key=lambda x: x["seconds"])
    out["auto_vs_best_fixed"] = out["auto"]["seconds"] / fixed["seconds"]
    print(f"  auto ({out['auto']['algorithm']}): {out['auto_vs_best_fixed']:.2f}x the faster of {ra} on the solved "
          f"ring and direct ({fixed['algorithm']}, {fixed['seconds']:.3f} s)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--numel", type=int, default=4_000_000, help="floats per rank, part 1")
    ap.add_argument("--numel2", type=int, default=2_000_000, help="floats per rank, part 2")
    ap.add_argument("--buckets", type=int, default=8, help="equal tensors (all-reduce buckets) per rank")
    ap.add_argument("--window", type=int, default=4, help="buckets in flight (all_reduce_mean's window)")
    ap.add_argument("--rate", type=float, default=50, help="Mbit/s per link, part 1")
    ap.add_argument("--fast", type=float, default=100, help="Mbit/s, part 2")
    ap.add_argument("--slow", type=float, default=5, help="Mbit/s of the pair 1<->2, part 2")
    ap.add_argument("--algorithms", nargs="+",
                    help="part 1 (default: the library default, then every other; auto always runs too)")
    ap.add_argument("--codecs", nargs="+", default=["zstd", "none"],
                    help="part 1: codecs the first algorithm runs with (the others: the default codec)")
    ap.add_argument("--ring-algorithm", default="ring-owner", help="part 2, with the solved and the worst order")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part", type=int, choices=(1, 2), help="run only this part")
    a = ap.parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    if why := probe().missing(rate=True):
        print(f"wan_allreduce: WAN testbed unavailable, nothing measured: {why}")
        return 0
    cleanup_stale()
    t0 = time.monotonic()
    out: dict = {"config": {k: v for k, v in vars(a).items() if k != "worker"} | {"hosts": 4},
                 "loadavg_start": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"load average {out['loadavg_start'][0]:.1f} on {out['cpus']} CPUs\n")
    if a.part in (None, 1):
        out["part1"] = part1(a)
    if a.part in (None, 2):
        if "part1" in out:
            print()
        out["part2"] = part2(a)
    out["pass"] = all(out[p]["pass"] for p in ("part1", "part2") if p in out)
    out["seconds_total"], out["loadavg_end"] = time.monotonic() - t0, os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(f"\nwrote {RESULTS.relative_to(ROOT)} ({out['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
