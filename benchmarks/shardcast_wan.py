"""SHARDCAST on the WAN testbed: relays behind shaped links feed several clients; pipelining in numbers.

Star topology (``infra/wan``): host 0 is the origin, hosts 1..R the relays, the rest the clients.
Each relay's uplink is shaped to ``--rate`` Mbit/s (B); every other link is unshaped, so the
relays' uplinks are the bottleneck and R x B is the most the clients can receive together.

1. **Aggregate delivery.** A ``--size-mib`` version is published and mirrored by every relay; then
   ``--clients`` clients start at once, each downloading the whole version from all relays.
   Aggregate = clients x size / (last finish - first start), against R x B (goal: >= 0.8).
2. **Pipelining.** The origin's uplink is shaped to R x B (B towards each relay) and a new version
   is written by a "trainer" at ``--write-mbit``; one client starts as soon as the version is
   listed. A store-and-forward system (the origin takes the whole checkpoint, then each relay the
   whole version, then the client) cannot deliver before write time + size / B (origin -> each
   relay) + size / (R x B) (relays -> client): that bound is printed next to the measured time.

    sudo .venv/bin/python benchmarks/shardcast_wan.py --relays 2 --rate 100 --clients 4 --size-mib 64

Needs root, network namespaces and tc tbf (``python -m infra.wan.testbed check``). Writes
``benchmarks/results/shardcast_wan.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.wan.testbed import Testbed, probe  # noqa: E402
from intellect.shardcast.store import VersionStore  # noqa: E402
from intellect.shardcast.writer import VersionWriter  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20
PORT = 18000


def serve(tb: Testbed, host: int, role: str, data: Path, extra: list[str]) -> subprocess.Popen:
    port_file = data.parent / f"{data.name}.url"
    p = tb.run(host, [sys.executable, "-m", "intellect.shardcast", role, "--data-dir", data, "--host",
                      tb.addr(host), "--port", PORT, "--port-file", port_file, *extra],
               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(data.parent / f"{data.name}.log", "wb"))
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{role} on host {host} did not start: {(data.parent / f'{data.name}.log').read_text()}")
        time.sleep(0.05)
    return p


def wait_relays(work: Path, relays: int, version: int, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        ms = [VersionStore(work / f"relay{i}").manifest(version) for i in range(relays)]
        if all(m is not None and m.complete for m in ms):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"relays did not mirror version {version} within {timeout:.0f} s")
        time.sleep(0.05)


def clients(tb: Testbed, hosts: list[int], urls: list[str], version: int, work: Path, timeout: float,
            key: SigningKey) -> list[dict]:
    args = [a for u in urls for a in ("--relay", u)] + ["--trainer-key", key.public.hex]
    procs = [tb.run(h, [sys.executable, "-m", "intellect.shardcast", "client", *args, "--version", version,
                        "--dest", work / f"client{h}-v{version}", "--deadline", timeout],
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in hosts]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout + 30)
        if p.returncode != 0:
            raise RuntimeError(f"client failed: {stderr[-2000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--relays", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rate", type=float, default=100.0, help="Relay uplink B, Mbit/s.")
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--shard-mib", type=float, default=4.0)
    ap.add_argument("--write-mbit", type=float, default=400.0, help="How fast the trainer writes the checkpoint in part 2.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "shardcast_wan.json"))
    a = ap.parse_args()
    if why := probe().missing(rate=True):
        print(f"WAN testbed unavailable: {why}", file=sys.stderr)
        return 2
    R, C, B = a.relays, a.clients, a.rate
    size = a.size_mib * MIB
    shard = int(a.shard_mib * MIB)
    n = 1 + R + C
    uplinks = [None] + [B] * R + [None] * C
    work = Path(tempfile.mkdtemp(prefix="shardcast-wan-"))
    payload = bytes(range(256)) * (size // 256)
    key = SigningKey.generate()  # the trainer's: relays and clients pin its public half
    key_file = key.save(work / "trainer.key")
    result = {"relays": R, "clients": C, "rate_mbit": B, "size_mib": a.size_mib, "shard_mib": a.shard_mib,
              "aggregate": [], "pipelining": []}
    try:
        with Testbed(n, topology="star", rate_mbit=uplinks, downlink_mbit=[None] * n) as tb:
            origin = work / "origin"
            serve(tb, 0, "origin", origin, [])
            urls = []
            for i in range(R):
                serve(tb, 1 + i, "relay", work / f"relay{i}", ["--upstream", f"http://{tb.addr(0)}:{PORT}",
                                                               "--trainer-key", key.public.hex])
                urls.append(f"http://{tb.addr(1 + i)}:{PORT}")
            store = VersionStore(origin)
            hosts = list(range(1 + R, n))
            print(f"{R} relays, uplinks {B:g} Mbit/s each (R x B = {R * B:g} Mbit/s); {C} clients; "
                  f"{a.size_mib} MiB versions in {a.shard_mib:g} MiB shards")
            version = 0
            for r in range(a.rounds):
                version += 1
                with VersionWriter(store, version, shard, key) as w:
                    w.begin_file("model.safetensors")
                    w.write(payload)
                wait_relays(work, R, version, 600)
                got = clients(tb, hosts, urls, version, work, 600, key)
                span = max(g["finished"] for g in got) - min(g["started"] for g in got)
                mbit = C * size * 8 / span / 1e6
                row = {"seconds": span, "aggregate_mbit": mbit, "of_RxB": mbit / (R * B),
                       "per_client_s": [round(g["finished"] - g["started"], 2) for g in got]}
                result["aggregate"].append(row)
                print(f"  aggregate round {r}: {C} x {a.size_mib} MiB in {span:.2f} s = {mbit:.1f} Mbit/s "
                      f"= {row['of_RxB']:.2f} x R x B")
                for h in hosts:
                    shutil.rmtree(work / f"client{h}-v{version}", ignore_errors=True)

            tb.set_uplink(0, rate_mbit=R * B)
            for r in range(a.rounds):
                version += 1
                started = time.time()
                writer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(origin), str(version), str(shard),
                                           str(size), str(a.write_mbit), str(key_file)], cwd=ROOT,
                                          stdout=subprocess.PIPE, text=True)
                while VersionStore(origin).manifest(version) is None:
                    time.sleep(0.005)
                got = clients(tb, [hosts[0]], urls, version, work, 600, key)[0]
                written = json.loads(writer.communicate(timeout=600)[0])["finished"] - started
                done = got["finished"] - started
                bound = written + size * 8 / (B * 1e6) + size * 8 / (R * B * 1e6)
                result["pipelining"].append({"client_done_s": done, "written_s": written,
                                             "store_and_forward_bound_s": bound, "ratio": done / bound})
                print(f"  pipelining round {r}: written in {written:.2f} s; client done at {done:.2f} s; a "
                      f"store-and-forward relay could not finish before {bound:.2f} s ({done / bound:.2f}x)")
                shutil.rmtree(work / f"client{hosts[0]}-v{version}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    agg = sorted(x["of_RxB"] for x in result["aggregate"])
    pipe = sorted(x["ratio"] for x in result["pipelining"])
    result["median_of_RxB"] = agg[len(agg) // 2]
    result["median_pipelining_ratio"] = pipe[len(pipe) // 2]
    print(f"median aggregate: {result['median_of_RxB']:.2f} x R x B (goal >= 0.8); median pipelined client / "
          f"store-and-forward bound: {result['median_pipelining_ratio']:.2f}x (< 1: pipelining wins)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


# The trainer of part 2: writes a checkpoint into the origin's store at a steady rate, 1 MiB at a time.
_TRAINER = """
import json, sys, time
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import VersionWriter
from intellect.trust.keys import SigningKey
root, version, shard, size, mbit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
key = SigningKey.load(sys.argv[6])
chunk = bytes(range(256)) * 4096
t0 = time.monotonic()
with VersionWriter(VersionStore(root), version, shard, key) as w:
    w.begin_file("model.safetensors")
    for k in range(size // len(chunk)):
        w.write(chunk)
        time.sleep(max(0.0, t0 + (k + 1) * len(chunk) * 8 / (mbit * 1e6) - time.monotonic()))
print(json.dumps({"finished": time.time()}))
"""

if __name__ == "__main__":
    sys.exit(main())
