"""What the authenticated rendezvous costs: store ops, ours (HTTP + HMAC) vs a plain TCPStore.

Three clients side by side: a plain TCPStore; ours as a worker the coordinator launched (its
HMAC key handed over at launch); ours as a contributor, whose key came from the signed join
exchange (``intellect.diloco.admission``), MACs the same way. Then what the join itself costs
once, and the authentication alone per request: HMAC (tag + check, what every request pays) vs
Ed25519 (sign + verify: what signing every request with the contributor's own key would cost).

The store runs in a process of its own (as the coordinator's does) and one client in this
process makes, for each store, (1) each op many times, and (2) the sequence of store ops one
worker's outer step makes in the commit protocol with W members and nobody to wait for
(boundary: committed, arrive, launched, liveness, members, onboarding check; sync: ready,
plan, one gloo group's rendezvous, flags, vote, outcome, digest, the others' reports,
progress, metrics). Prints a table; the step figure is what the protocol adds to an outer
step, before any waiting for peers.

    python benchmarks/diloco_rendezvous.py [--workers 4] [--repeat 300]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from intellect.diloco import protocol  # noqa: E402
from intellect.diloco.admission import coordinator_identity, join  # noqa: E402
from intellect.diloco.coordinator import free_port  # noqa: E402
from intellect.diloco.rendezvous import check_request, peer_key, request_tag  # noqa: E402
from intellect.diloco.rendezvous_client import RendezvousStore  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402
from intellect.trust.requests import RequestVerifier, sign_request  # noqa: E402

SECRET = bytes(range(32))
CONTRIBUTOR = SigningKey.from_seed(bytes([7] * 32))
SERVE = {
    "ours": "from intellect.diloco.rendezvous import RendezvousServer as S; "
            "from intellect.diloco.admission import Admission as A; "
            f"s = S(bytes(range(32)), 'bench', port={{port}}, admission=A(bytes(range(32)), 'bench', "
            f"['{CONTRIBUTOR.public.hex}'], '{{{{}}}}'))",
    "tcpstore": "import datetime, torch.distributed as dist; s = dist.TCPStore('127.0.0.1', {port}, is_master=True, "
                "timeout=datetime.timedelta(seconds=30), wait_for_workers=False, use_libuv=True)",
}


def serve(kind: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    code = SERVE[kind].format(port=port) + "\nprint('up', flush=True)\nimport time\ntime.sleep(3600)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None  # stdout=PIPE
    assert proc.stdout.readline().strip() == "up"
    return proc, port


def client(kind: str, port: int):
    if kind == "ours":
        return RendezvousStore("127.0.0.1", port, SECRET, "bench", peer="w0", timeout=30)
    if kind == "contributor":
        joined = join("127.0.0.1", port, "bench", CONTRIBUTOR, coordinator_identity(SECRET, "bench").public)
        return RendezvousStore("127.0.0.1", port, None, "bench", peer=joined.worker, timeout=30, key=joined.key)
    return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported from torch._C
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False, use_libuv=True)


def outer_step(s, t: int, w: int) -> int:
    """One worker's store ops in one outer step with ``w`` members; returns how many."""
    me, names = "w0", [f"w{i}" for i in range(w)]
    ops = 0

    def op(fn, *a):
        nonlocal ops
        ops += 1
        return fn(*a)

    op(s.set, protocol.COMMITTED(t, me), "0")
    op(s.set, protocol.ARRIVE(t, me), "1")
    op(s.check, [protocol.MEMBERS(t, 0)])
    n = op(s.add, protocol.LAUNCHED.under(), 0)
    for i in range(n):
        op(s.check, [protocol.LAUNCHED(i)])
        op(s.get, protocol.LAUNCHED(i))
        op(s.check, [protocol.BANNED(f"w{i}")])
    for x in names[1:]:
        op(s.check, [protocol.ARRIVE(t, x)])
        op(s.check, [protocol.DEAD(x)])
        op(s.add, protocol.HB(x), 0)
    op(s.compare_set, protocol.MEMBERS(t, 0), "", json.dumps(names))
    for x in names:
        op(s.get, protocol.COMMITTED(t, x))
    op(s.set, protocol.READY(t, 0, me), "1")
    for x in names[1:]:
        op(s.check, [protocol.READY(t, 0, x)])
    for i in range(w):  # gloo's rendezvous of one group: each rank's address, read by the others
        op(s.set, f"{protocol.PG(t, 0)}/rank{i}", b"x" * 64)
    for i in range(1, w):
        op(s.get, f"{protocol.PG(t, 0)}/rank{i}")
    op(s.compare_set, protocol.PLAN(t, 0), "", json.dumps({"order": None, "algorithm": "direct", "estimates": {}}))
    op(s.set, protocol.FLAGS(t, 0, me), "[]")
    op(s.set, protocol.VOTE(t, 0, me), "ok")
    for x in names:
        op(s.check, [protocol.VOTE(t, 0, x)])
        op(s.get, protocol.VOTE(t, 0, x))
    op(s.compare_set, protocol.OUTCOME(t, 0), "", "commit")
    op(s.set, protocol.DIGEST(t, me), "d" * 64)
    for x in names:
        op(s.check, [protocol.FLAGS(t, 0, x)])
        op(s.get, protocol.FLAGS(t, 0, x))
    op(s.set, protocol.PROGRESS(), str(t + 1))
    op(s.set, protocol.METRICS(t, me), "{}" * 200)
    return ops


def prime(s, w: int) -> None:
    # the keys other members would have written, so that no get waits
    for i in range(w):
        s.set(protocol.LAUNCHED(i), f"w{i}")
    s.add(protocol.LAUNCHED.under(), w - s.add(protocol.LAUNCHED.under(), 0))  # a contributor's join counted 1


def bench(kind: str, workers: int, repeat: int) -> dict:
    proc, port = serve("ours" if kind == "contributor" else kind)
    try:
        s = client(kind, port)
        prime(s, workers)
        for x in [f"w{i}" for i in range(workers)]:
            s.set(f"{protocol.ARRIVE.name}/{x}", "1")
        out = {}
        cases = {"set": lambda i: s.set(f"k{i}", "v" * 32), "get": lambda i: s.get(f"k{i}"),
                 "check": lambda i: s.check([f"k{i}"]), "add": lambda i: s.add("counter", 1),
                 "compare_set": lambda i: s.compare_set(f"c{i}", "", "x")}
        for name, fn in cases.items():
            times = []
            for i in range(repeat):
                t0 = time.perf_counter()
                fn(i)
                times.append(time.perf_counter() - t0)
            out[name] = statistics.median(times) * 1e6
        steps = []
        for t in range(max(5, repeat // 30)):
            for x in [f"w{i}" for i in range(workers)]:  # the others' keys of this step
                for key, value in ((protocol.COMMITTED(t, x), "0"), (protocol.VOTE(t, 0, x), "ok"),
                                   (protocol.FLAGS(t, 0, x), "[]")):
                    s.set(key, value)
            t0 = time.perf_counter()
            n = outer_step(s, t, workers)
            steps.append(time.perf_counter() - t0)
        out["ops_per_step"] = n
        out["step_ms"] = statistics.median(steps) * 1e3
        return out
    finally:
        proc.kill()
        proc.wait()


def median_us(fn, repeat: int) -> float:
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def auth_costs(repeat: int) -> dict[str, float]:
    """Per request, both ends: HMAC tag + check, Ed25519 sign + verify (over the same body); and one join."""
    body, key = json.dumps({"key": "metrics/3/w0", "value": "e30="}).encode(), peer_key(SECRET, "bench", "w0")
    verifier = RequestVerifier("bench", guard=None)

    def hmac_both(i: int) -> None:
        nonce = f"{i:032x}"
        assert check_request(key, request_tag(key, "set", body, 1000, nonce, "w0"), "set", body, 1000, nonce, "w0")

    def ed25519_both(i: int) -> None:  # noqa: ARG001 - a fresh nonce each call
        verifier.verify("POST", "/v1/set", body, sign_request(CONTRIBUTOR, "POST", "/v1/set", body, audience="bench"))

    proc, port = serve("ours")
    try:
        identity = coordinator_identity(SECRET, "bench").public
        joins = median_us(lambda i: join("127.0.0.1", port, "bench", CONTRIBUTOR, identity), max(20, repeat // 10))
    finally:
        proc.kill()
        proc.wait()
    return {"hmac_us": median_us(hmac_both, repeat), "ed25519_us": median_us(ed25519_both, repeat),
            "join_ms": joins / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args()
    rows = {kind: bench(kind, args.workers, args.repeat) for kind in ("tcpstore", "ours", "contributor")}
    print(f"median over {args.repeat} calls, us per op; one worker's outer step of the commit protocol "
          f"with {args.workers} members, ms (cpus: {os.cpu_count()})")
    print(f"{'':12}" + "".join(f"{k:>12}" for k in rows["ours"]))
    for kind, row in rows.items():
        print(f"{kind:12}" + "".join(f"{v:12.1f}" if isinstance(v, float) else f"{v:12d}" for v in row.values()))
    a = auth_costs(args.repeat)
    print(f"authentication alone, both ends, per request: HMAC-SHA256 {a['hmac_us']:.1f} us, Ed25519 "
          f"{a['ed25519_us']:.1f} us; a contributor's join (once per process start): {a['join_ms']:.2f} ms")


if __name__ == "__main__":
    main()
