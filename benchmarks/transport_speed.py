"""The group between workers, ``TcpGroup`` (``transport.new_group(backend="tcp")``, the default),
beside gloo's (``backend="gloo"``, the baseline it replaced), in one run, real processes on 127.0.0.1.

W processes all-reduce ``--numel`` fp32 values with ``allreduce.all_reduce_mean`` (MACs on, int8 and
fp32 compression, ring and direct algorithms), ``--steps`` times per arm, the arms interleaved step by
step so that load on a shared machine falls on both alike. Printed: the median over steps of the
slowest rank's seconds, per arm, and tcp/gloo. A raw point-to-point line (``--numel`` fp32 values one
way, unsealed) shows the transports without the codec.

``--attack``: instead, per transport, two processes all-reduce where rank 1 holds the MAC key but
appends 1 MB to every message it sends; printed: how the honest rank 0 ends (its exit code, and the
error it recorded, if it lived to record one).

    .venv/bin/python benchmarks/transport_speed.py [--world 4] [--numel 4194304] [--steps 7]
    .venv/bin/python benchmarks/transport_speed.py --attack
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

from typing import cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from intellect.diloco.allreduce import all_reduce_mean  # noqa: E402
from intellect.diloco.coordinator import free_port  # noqa: E402
from intellect.diloco.transport import new_group  # noqa: E402

KEY = b"benchmark key of 32 bytes, fixed"
BACKENDS = ("gloo", "tcp")
ARMS = (("ring", "int8"), ("direct", "int8"), ("ring", "fp32"))


def _rank(rank: int, world: int, port: int, numel: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    res: dict = {}
    try:
        store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
        groups = {b: new_group(store, f"bench-{b}", rank, world, timeout=300.0, backend=b, hostname="127.0.0.1")
                  for b in BACKENDS}
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 1e-3
        for step in range(steps):
            for b in BACKENDS:
                g = groups[b]
                for algorithm, compression in ARMS:
                    store.add(f"barrier/{step}/{b}/{algorithm}/{compression}", 1)
                    while store.add(f"barrier/{step}/{b}/{algorithm}/{compression}", 0) < world:
                        time.sleep(0.001)
                    t = x.clone()
                    t0 = time.perf_counter()
                    all_reduce_mean([t], g, algorithm=algorithm, compression=compression, mac_key=KEY)
                    res.setdefault(f"{b} {algorithm}/{compression}", []).append(time.perf_counter() - t0)
                # point to point: rank 0 to rank 1, unsealed
                store.add(f"barrier/{step}/{b}/p2p", 1)
                while store.add(f"barrier/{step}/{b}/p2p", 0) < world:
                    time.sleep(0.001)
                t0 = time.perf_counter()
                if rank == 0:
                    g.send([x], 1, 99).wait()
                elif rank == 1:
                    buf = torch.empty_like(x)
                    g.recv([buf], 0, 99).wait()
                res.setdefault(f"{b} p2p", []).append(time.perf_counter() - t0 if rank < 2 else 0.0)
    except BaseException:  # noqa: BLE001 - reported to the parent
        res = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(res, f)


class _Padding:
    """Rank 1's group in the attack: every message it sends is 1 MB longer than the plan's."""

    def __init__(self, group):
        self.group = group

    def __getattr__(self, name: str):
        return getattr(self.group, name)

    def send(self, tensors, dst: int, tag: int):
        (t,) = tensors
        return self.group.send([torch.cat([t.view(torch.uint8).flatten(), torch.zeros(1 << 20, dtype=torch.uint8)])],
                               dst, tag)


def _attacked(rank: int, port: int, backend: str, out: str) -> None:
    store = torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        "127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    group = new_group(store, "attack", rank, 2, timeout=20.0, backend=backend, hostname="127.0.0.1")
    try:
        honest_or_not = group if rank == 0 else cast(dist.ProcessGroup, _Padding(group))
        all_reduce_mean([torch.ones(100_000)], honest_or_not, mac_key=KEY, timeout=20)
        result = "completed"
    except Exception as e:  # noqa: BLE001 - what the honest rank recorded is the result
        result = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"attack-{backend}-{rank}.txt"), "w") as f:
        f.write(result)
    time.sleep(1)  # let the peer finish reading before this process's sockets close


def attack() -> None:
    print("| transport | honest rank's exit code | what it recorded |\n|---|---|---|")
    for backend in BACKENDS:
        with tempfile.TemporaryDirectory() as out:
            port = free_port()
            procs = [mp.get_context("spawn").Process(target=_attacked, args=(r, port, backend, out)) for r in (0, 1)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
            path = os.path.join(out, f"attack-{backend}-0.txt")
            said = open(path).read() if os.path.exists(path) else "(nothing: the process ended first)"
            print(f"| {backend} | {procs[0].exitcode} | {said[:160]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--attack", action="store_true", help="the oversized-message attack on each transport instead")
    a = ap.parse_args()
    if a.attack:
        attack()
        return
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [mp.get_context("spawn").Process(target=_rank, args=(r, a.world, port, a.numel, a.steps, out))
                 for r in range(a.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
        ranks = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(a.world)]
    for r in ranks:
        if "error" in r:
            sys.exit(r["error"])
    print(f"world {a.world}, {a.numel:,} fp32 values ({a.numel * 4 / 1e6:.1f} MB), {a.steps} steps, "
          f"median of the slowest rank's seconds; cpu {torch.backends.cpu.get_cpu_capability()}")
    print("| arm | gloo s | tcp s | tcp/gloo |\n|---|---|---|---|")
    for arm in [f"{al}/{c}" for al, c in ARMS] + ["p2p"]:
        med = {b: statistics.median(max(r[f"{b} {arm}"][s] for r in ranks) for s in range(a.steps)) for b in BACKENDS}
        print(f"| {arm} | {med['gloo']:.3f} | {med['tcp']:.3f} | {med['tcp'] / med['gloo']:.2f} |")


if __name__ == "__main__":
    main()
