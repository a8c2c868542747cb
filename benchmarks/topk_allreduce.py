"""Top-k all-reduce (``diloco.compression = "topk"``: ``topk_reduce``) beside int8 and fp32
(``allreduce.all_reduce_mean``, algorithm "direct"), real gloo processes on 127.0.0.1, same data.

W processes each hold ``--numel`` fp32 values per step: a direction shared by the members plus
fresh per-member noise of equal power (cosine about 0.5 between members), one new draw per step,
``--steps`` steps per arm; the top-k arm carries its error-feedback residual from step to step
(committed each step, as the synchronizer does). MACs on for every arm. Columns:

* bytes/param: bytes one rank hands the transport (payload + control + seals) per parameter,
  mean over ranks and steps (1.0 = one fp32 byte per value; 4.0 = one fp32 copy);
* seconds: median over the steps of the slowest rank's reduction (ranks start each step at a
  barrier); 2 shared cores on loopback: CPU-bound, not network-bound;
* one-step error: ||result - exact mean|| / ||exact mean|| at the first step (fp64 mean of
  the members' inputs; top-k: residual still 0, so this is the codec's own loss);
* sum error: the same for the sum of the results over all steps against the sum of the exact
  means (error feedback makes top-k's fall with the steps; int8's does not).

    .venv/bin/python benchmarks/topk_allreduce.py [--worlds 2 4] [--numel 1048576] [--steps 10]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from intellect.diloco.allreduce import all_reduce_mean  # noqa: E402
from intellect.diloco.coordinator import free_port  # noqa: E402
from intellect.diloco.sparse import TopK  # noqa: E402
from intellect.diloco.topk_reduce import ErrorFeedback, topk_all_reduce_mean  # noqa: E402
from intellect.diloco.transport import new_group  # noqa: E402

ARMS = ("fp32", "int8", "topk")
KEY = b"benchmark key of 32 bytes, fixed"


def data(worker: int, step: int, numel: int) -> torch.Tensor:
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    return (base + torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + worker + 2))) * 1e-3


def _rank(rank: int, world: int, port: int, numel: int, steps: int, k: int, out: str) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    try:
        store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
        group = new_group(store, "bench", rank, world, timeout=300.0, hostname="127.0.0.1")
        for arm in ARMS:
            fb = ErrorFeedback(numel, TopK(chunk=4096, k=k))
            secs, nbytes, first, acc = [], [], None, torch.zeros(numel, dtype=torch.float64)
            for step in range(steps):
                x = [data(rank, step, numel)]
                group.barrier().wait()
                t0 = time.perf_counter()
                if arm == "topk":
                    st = topk_all_reduce_mean(x, group, fb, mac_key=KEY)
                    fb.commit()
                else:
                    st = all_reduce_mean(x, group, algorithm="direct", compression=arm, mac_key=KEY)
                secs.append(time.perf_counter() - t0)
                nbytes.append(st.bytes_sent)
                first = x[0] if first is None else first
                acc += x[0].double()
            res[arm] = {"seconds": secs, "bytes": nbytes, "first": first, "sum": acc}
    except BaseException:  # noqa: BLE001 - handed to the parent
        res = {"crash": traceback.format_exc()}
    torch.save(res, os.path.join(out, f"{rank}.pt"))


def run(world: int, numel: int, steps: int, k: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="topk-bench-") as tmp:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, numel, steps, k, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        res = [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world)]
    for r in res:
        if "crash" in r:
            raise RuntimeError(r["crash"])
    exact = [torch.stack([data(w, s, numel).double() for w in range(world)]).mean(0) for s in range(steps)]
    total = torch.stack(exact).sum(0)
    out = {}
    for arm in ARMS:
        assert all(torch.equal(res[0][arm]["first"], r[arm]["first"]) for r in res), f"{arm}: ranks disagree"
        secs = [max(r[arm]["seconds"][s] for r in res) for s in range(steps)]
        out[arm] = {
            "bytes": statistics.mean(b for r in res for b in r[arm]["bytes"]) / numel,
            "seconds": statistics.median(secs),
            "one": float((res[0][arm]["first"].double() - exact[0]).norm() / exact[0].norm()),
            "sum": float((res[0][arm]["sum"] - total).norm() / total.norm()),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--k", type=int, default=64, help="top-k per 4096-value chunk")
    a = ap.parse_args()
    print(f"{a.numel} values, {a.steps} steps per arm, top-{a.k} of 4096; MACs on; algorithm direct (fp32, int8)")
    print("| W | arm | bytes/param sent | x below fp32 | x below int8 | seconds (median) | x int8's time "
          "| one-step error | sum error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in a.worlds:
        r = run(world, a.numel, a.steps, a.k)
        for arm in ARMS:
            m = r[arm]
            print(f"| {world} | {arm} | {m['bytes']:.4f} | {r['fp32']['bytes'] / m['bytes']:.1f} "
                  f"| {r['int8']['bytes'] / m['bytes']:.1f} | {m['seconds']:.3f} "
                  f"| {m['seconds'] / r['int8']['seconds']:.2f} | {m['one']:.4f} | {m['sum']:.4f} |")


if __name__ == "__main__":
    main()
