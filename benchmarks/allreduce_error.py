"""Error and bytes of the int8 all-reduce algorithms vs PRIME's scheme, real gloo processes.

For each W, W processes on 127.0.0.1 each hold ``--numel`` floats (in 4 equal
buckets) = shared signal + worker-specific noise of equal power (cosine ~0.5
between workers), and run every algorithm on the same data. Reported: relative
L2 error of the result vs the exact fp64 mean (max over ranks; bit-identical
algorithms agree on every rank), payload bytes sent per rank / (4 x numel)
(1.0 = one fp32 copy), and seconds (2 shared cores: CPU-bound, not network).

"prime" is PRIME's data path (requantize the partial sum at every
reduce-scatter hop AND every all-gather hop: ``prime_allreduce.py``) with our
quantizer (mean +- c sigma, bucket means), not PRIME's +-3 RMS codebook, so only
the data path differs.
``--clip 6`` quantizes with the quantizer's fixed default; the default tries
c = 4 and 6 per chunk and keeps the better fit.

    .venv/bin/python benchmarks/allreduce_error.py                  # W = 2 4 8 16, 1M floats
    .venv/bin/python benchmarks/allreduce_error.py --worlds 2 4 --numel 262144
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from intellect.diloco.allreduce import DEFAULT_CLIPS, all_reduce_mean  # noqa: E402
from intellect.diloco.transport import new_group  # noqa: E402
from prime_allreduce import PLAN, PrimeRun  # noqa: E402

VARIANTS = {  # label -> all_reduce_mean kwargs
    "direct": {"algorithm": "direct"},
    "ring-residual": {"algorithm": "ring-residual"},
    "ring-owner": {"algorithm": "ring-owner"},
    "ring relay=2": {"algorithm": "ring", "relay": 2},
    "ring": {"algorithm": "ring"},
    "prime": {"algorithm": PLAN, "schedule": PrimeRun},
}
NBUCKETS = 4


def make_data(worker: int, numel: int, dist: str, seed: int = 0) -> list[torch.Tensor]:
    def draw(s):
        g = torch.Generator().manual_seed(s)
        if dist == "gaussian":
            return torch.randn(numel, generator=g)
        if dist == "laplace":
            u = torch.rand(numel, generator=g, dtype=torch.float64) - 0.5
            return (-u.sign() * torch.log1p(-2 * u.abs())).float()
        if dist == "t3":  # Student-t, 3 degrees of freedom
            z = torch.randn(numel, generator=g, dtype=torch.float64)
            chi = torch.randn(3, numel, generator=g, dtype=torch.float64).pow(2).sum(0)
            return (z / (chi / 3).sqrt()).float()
        raise ValueError(dist)

    x = draw(seed) + draw(seed + 1000 * (worker + 1))
    return list(x.chunk(NBUCKETS))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, fn, args: tuple, timeout: float = 600.0) -> list:
    """Run ``fn(rank, world, group, *args)`` in ``world`` processes; return their results."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_main, args=(r, world, port, tmp, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        out = []
        for r in range(world):
            res = torch.load(os.path.join(tmp, f"{r}.pt")) if os.path.exists(os.path.join(tmp, f"{r}.pt")) else None
            if not isinstance(res, dict) or "error" in res:
                raise RuntimeError(f"rank {r} failed: {res and res.get('error')}")
            out.append(res["value"])
        return out


def _main(rank, world, port, tmp, fn, args):
    torch.set_num_threads(1)
    try:
        store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]  # public, from torch._C
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120)
        )
        group = new_group(store, "bench", rank, world, timeout=300, hostname="127.0.0.1")
        res = {"value": fn(rank, world, group, *args)}
    except BaseException:  # noqa: BLE001 - any failure goes back to the parent, which names the rank
        res = {"error": traceback.format_exc()}
    torch.save(res, os.path.join(tmp, f"{rank}.pt"))


def _bench_rank(rank, world, group, numel, dist, variants, tmp, clip):
    ref_path = os.path.join(tmp, f"ref_{world}.pt")
    if rank == 0:  # one rank builds the exact mean; the others read it after the first barrier
        acc = torch.zeros(numel, dtype=torch.float64)
        for w in range(world):
            acc += torch.cat(make_data(w, numel, dist)).double()
        torch.save(acc / world, ref_path + ".tmp")
        os.replace(ref_path + ".tmp", ref_path)
    group.barrier().wait()
    ref = torch.load(ref_path)
    out = {}
    for label in variants:
        ts = make_data(rank, numel, dist)
        group.barrier().wait()
        st = all_reduce_mean(ts, group, clip_sigmas=clip, **VARIANTS[label])
        err = float((torch.cat(ts).double() - ref).norm() / ref.norm())
        out[label] = (err, st.payload_bytes, st.seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--dist", default="gaussian", choices=["gaussian", "laplace", "t3"])
    ap.add_argument("--clip", type=float, nargs="+", default=list(DEFAULT_CLIPS),
                    help="clip_sigmas candidates, best fit per chunk (encoder side); 6 = fixed")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = ap.parse_args()

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for W in a.worlds:
            t0 = time.perf_counter()
            res = spawn(W, _bench_rank, (a.numel, a.dist, a.variants, tmp, a.clip))
            rows[W] = {
                v: (
                    max(r[v][0] for r in res),
                    sum(r[v][1] for r in res) / W / (4 * a.numel),
                    max(r[v][2] for r in res),
                )
                for v in a.variants
            }
            print(f"# W={W}: {time.perf_counter() - t0:.1f} s incl. process start", file=sys.stderr)

    print(f"relative L2 error vs exact fp32 mean ({a.dist}, {a.numel} floats/rank, {NBUCKETS} buckets, clip {a.clip})")
    w = max(len(v) for v in a.variants) + 2
    print(f"{'W':>3} " + "".join(f"{v:>{w}}" for v in a.variants))
    for W, r in rows.items():
        print(f"{W:>3} " + "".join(f"{r[v][0] * 100:>{w - 1}.2f}%" for v in a.variants))
    print("\npayload bytes sent per rank / fp32 bytes of the tensor (fp32 ring: 2(W-1)/W)")
    for W, r in rows.items():
        print(f"{W:>3} " + "".join(f"{r[v][1]:>{w}.3f}" for v in a.variants))
    print("\nseconds (max over ranks; 2 shared cores, loopback)")
    for W, r in rows.items():
        print(f"{W:>3} " + "".join(f"{r[v][2]:>{w}.2f}" for v in a.variants))
    if "prime" in a.variants:
        print("\nerror ratio prime / variant (higher = better than PRIME)")
        for W, r in rows.items():
            print(f"{W:>3} " + "".join(f"{r['prime'][0] / r[v][0]:>{w}.2f}" for v in a.variants))


if __name__ == "__main__":
    main()
