"""Wire bytes per worker per outer step vs DDP's fp32 gradient all-reduce over H steps.

Model: the tiny Llama (``build_model(ModelConfig())``, ~860k params). W real
gloo processes on 127.0.0.1 each all-reduce a random pseudo-gradient shaped
like the model, per layer (``layer_buckets``) and as one bucket.

* ours: bytes this rank handed to the transport (payload + contributor flags),
  counted in ``transport.Channel``; mean over ranks. Every algorithm runs with
  the default codec (zstd-coded indices); the default algorithm also runs with
  ``codec="none"`` (raw uint8 indices + a 1 KiB codebook per chunk, which caps
  the ratio just under 4H).
* DDP: ``2 (W-1)/W * 4 * P`` bytes per rank per step, the ring all-reduce
  formula, times H. Gloo does not count bytes, so the formula is the number
  used; as a cross-check, one fp32 ``allreduce`` of P params over the same gloo
  group is run and the loopback interface's TX counter (/proc/net/dev, whole
  host: other processes add noise; includes TCP/IP and gloo headers) is divided
  by W (min of 3 runs), and the same is done for ours. Seconds: min of 3 (5 for
  the pipelining line), barrier to barrier, on a shared 2-core box.

    .venv/bin/python benchmarks/wire_bytes.py [--worlds 2 4 8] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from allreduce_error import spawn  # noqa: E402

from intellect.config import ModelConfig  # noqa: E402
from intellect.diloco.allreduce import DEFAULT_ALGORITHM, DEFAULT_CODEC, all_reduce_mean  # noqa: E402
from intellect.diloco.plan import layer_buckets  # noqa: E402
from intellect.model.checkpoint import build_model  # noqa: E402

ALGOS = ["direct", "ring-residual", "ring-owner", "ring"]
# (algorithm, codec) rows: every algorithm with the default codec, the default one raw too
VARIANTS = [(a, DEFAULT_CODEC) for a in ALGOS] + [(DEFAULT_ALGORITHM, "none")]


def lo_tx() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])
    return 0


def model_shapes() -> tuple[list[str], list[tuple[int, ...]]]:
    model, _ = build_model(ModelConfig())
    named = list(model.named_parameters())
    return [n for n, _ in named], [tuple(p.shape) for _, p in named]


def _rank(rank, _world, group, names, shapes, variants, window):
    g = torch.Generator().manual_seed(rank)
    grads = lambda: [torch.randn(s, generator=g) * 1e-3 for s in shapes]  # noqa: E731
    layers = layer_buckets(names)
    out = {}

    def measured(fn, reps=3):  # min over reps: other processes on the host add loopback traffic
        best_lo, best_t = None, None
        for _ in range(reps):
            group.barrier().wait()
            tx = lo_tx()
            t0 = time.perf_counter()
            res = fn()
            group.barrier().wait()
            lo, t = lo_tx() - tx, time.perf_counter() - t0
            best_lo = lo if best_lo is None else min(best_lo, lo)
            best_t = t if best_t is None else min(best_t, t)
        return res, best_lo, best_t

    flat = torch.cat([x.reshape(-1) for x in grads()])
    _, lo, sec = measured(lambda: group.allreduce([flat]).wait())
    out["ddp"] = (None, lo, sec)
    for algo, codec in variants:
        for label, buckets in (("layer", layers), ("one", [list(range(len(shapes)))])):
            st, lo, sec = measured(lambda: all_reduce_mean(grads(), group, algorithm=algo, buckets=buckets,
                                                           window=window, codec=codec))
            out[algo, codec, label] = (st.bytes_sent, lo, sec)
    for w in (1, 4):  # pipelining: per-layer buckets, one vs four in flight
        _, _, out["window", w] = measured(lambda: all_reduce_mean(grads(), group, buckets=layers, window=w), reps=5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=100, help="H, inner steps per outer step")
    ap.add_argument("--window", type=int, default=4)
    a = ap.parse_args()

    names, shapes = model_shapes()
    P = sum(torch.Size(s).numel() for s in shapes)
    print(f"tiny model: P = {P} params, {len(layer_buckets(names))} layer buckets, H = {a.steps}")
    print("bytes are per worker; DDP = 2(W-1)/W * 4P per step (ring formula) x H; lo = loopback TX / W\n")
    hdr = f"{'W':>2} {'algorithm, codec':<32}{'bucketing':<8}{'ours/step':>11}{'lo/step':>11}{'DDP x H':>13}{'ratio':>8}{'sec':>7}"
    print(hdr)
    for W in a.worlds:
        res = spawn(W, _rank, (names, shapes, VARIANTS, a.window))
        ddp = 2 * (W - 1) / W * 4 * P * a.steps
        ddp_lo = sum(r["ddp"][1] for r in res) / W / W  # every rank read the same host counter
        print(f"{W:>2} {'DDP fp32 all_reduce (1 step)':<40}{'':>11}{ddp_lo:>11.0f}{ddp / a.steps:>13.0f}"
              f"{'':>8}{max(r['ddp'][2] for r in res):>7.3f}")
        for algo, codec in VARIANTS:
            for label in ("layer", "one"):
                ours = sum(r[algo, codec, label][0] for r in res) / W
                lo = sum(r[algo, codec, label][1] for r in res) / W / W
                sec = max(r[algo, codec, label][2] for r in res)
                name = f"{algo}, {codec}" + (" (default)" if (algo, codec) == (DEFAULT_ALGORITHM, DEFAULT_CODEC) else "")
                print(f"{W:>2} {name:<32}{label:<8}{ours:>11.0f}{lo:>11.0f}{ddp:>13.0f}{ddp / ours:>7.1f}x{sec:>7.3f}")
        w1 = max(r["window", 1] for r in res)
        w4 = max(r["window", 4] for r in res)
        print(f"{W:>2} pipelining ({DEFAULT_ALGORITHM}, layer buckets): window=1 {w1:.3f} s, window=4 {w4:.3f} s\n")


if __name__ == "__main__":
    main()
