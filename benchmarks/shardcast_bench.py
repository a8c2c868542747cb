"""SHARDCAST on loopback: ours, the ``shardcast`` 0.3.2 package, and one plain HTTP GET, side by side.

One payload of ``--size-mib`` random bytes, origin -> 2 relays -> 1 client, each server its own
process on 127.0.0.1. Per round:

* **ours, end to end**: the clock starts when the trainer (a running process with the package
  loaded, as the RL step's trainer is and as the peer's origin is when asked to broadcast) begins
  publishing the file into the origin's store (shards appear as they are hashed; the file is
  hard-linked there, not copied) and stops when the client holds the verified file; relays and
  client start pulling as soon as the first shards appear. Each process's CPU time over that span
  is recorded too: on 2 cores, the five processes' CPU total over two is a floor under end to end.
* **ours, client only**: a second client fetches the same version once both relays hold it.
* **plain GET**: ``curl`` fetches the same file in one request from a uvicorn/Starlette server
  (``FileResponse``; h11 and the asyncio loop, as our servers run), no hashing: a plain HTTP
  transfer of the same bytes on this machine.
* **shardcast 0.3.2** (``benchmarks/peers/shardcast/peer.py`` in its own venv; ``setup.sh``
  builds it): broadcast, relay sync, client download; end to end as ours.

    bash benchmarks/peers/shardcast/setup.sh          # once
    .venv/bin/python benchmarks/shardcast_bench.py --size-mib 1024 --rounds 3

Medians over rounds and their ratios print; ``benchmarks/results/shardcast_bench.json`` keeps every
round. The machine is shared and noisy, so rounds alternate the systems, and every system starts
after the previous one's files are deleted and synced.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.shardcast.client import ShardcastClient  # noqa: E402
from intellect.shardcast.config import ClientConfig  # noqa: E402
from intellect.shardcast.local import ServerProcess  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402

PEER = ROOT / "benchmarks" / "peers" / "shardcast"
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


# The trainer: a running process that publishes each checkpoint in-process (``publish_folder``, as the
# RL step does), asked here over stdin, as the peer's origin process is asked to broadcast.
_TRAINER = """
import json, sys
from intellect.shardcast.store import VersionStore
from intellect.shardcast.writer import publish_folder
from intellect.trust.keys import SigningKey
key = SigningKey.load(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    publish_folder(VersionStore(job["data_dir"]), job["version"], job["src"], job["shard_bytes"], keep=5, key=key)
    print("published", flush=True)
"""


def ours(payload: Path, digest: str, work: Path, shard_mib: int, parallel: int) -> dict:
    procs, trainer = [], None
    key = SigningKey.generate()  # the trainer's: it signs every version, relays and client verify
    key_file = key.save(work / "trainer.key")
    try:
        origin = ServerProcess("origin", work / "origin")
        procs.append(origin)
        relays = [ServerProcess("relay", work / f"relay{i}", extra=["--upstream", origin.url, "--parallel", str(parallel),
                                                                  "--trainer-key", key.public.hex])
                  for i in range(2)]
        procs += relays
        trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(key_file)], cwd=ROOT, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert trainer.stdin is not None and trainer.stdout is not None  # both PIPE
        if trainer.stdout.readline().strip() != "ready":
            raise RuntimeError("the trainer process did not start")
        cfg = ClientConfig(parallel=parallel, deadline=600, trainer_key=key.public.hex)
        with ShardcastClient([r.url for r in relays], cfg) as client:
            pids = {"origin": origin.pid, "relay0": relays[0].pid, "relay1": relays[1].pid, "publish": trainer.pid}
            before = {k: cpu_s(pid) for k, pid in pids.items()}
            mine = os.times()
            t0 = time.perf_counter()
            trainer.stdin.write(json.dumps({"data_dir": str(work / "origin"), "version": 1, "src": str(payload),
                                            "shard_bytes": shard_mib * MIB}) + "\n")
            trainer.stdin.flush()
            while 1 not in client.versions():
                time.sleep(0.02)  # each look is two requests: faster looks take CPU from the publisher
            t_listed = time.perf_counter()
            client.fetch(1, work / "out1")
            end_to_end = time.perf_counter() - t0
            now = os.times()
            if trainer.stdout.readline().strip() != "published":  # it has published all by now
                raise RuntimeError("publish failed")
            cpu = {k: cpu_s(pid) - before[k] for k, pid in pids.items()}
            cpu["client"] = now.user + now.system - mine.user - mine.system
        ok = sha256_file(work / "out1" / payload.name) == digest
        shutil.rmtree(work / "out1")
        os.sync()
        # the relays hold it now (the client's fetch finished from them); a fresh client alone
        with ShardcastClient([r.url for r in relays], cfg) as client:
            deadline = time.monotonic() + 60
            while client.complete_versions() != [1] and time.monotonic() < deadline:
                time.sleep(0.01)
            t1 = time.perf_counter()
            client.fetch(1, work / "out2")
            client_only = time.perf_counter() - t1
        ok = ok and sha256_file(work / "out2" / payload.name) == digest
        return {"end_to_end_s": end_to_end, "first_listed_s": t_listed - t0, "client_only_s": client_only,
                "cpu_s": {k: round(v, 2) for k, v in cpu.items()}, "ok": ok}
    finally:
        if trainer is not None:
            trainer.kill()
            trainer.wait(10)
        for p in procs:
            p.stop()


_PLAIN_SERVER = """
import sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import FileResponse
from starlette.routing import Route
from intellect.http_server import bind
from intellect.shardcast.server import write_port_file
path, port_file = sys.argv[1], sys.argv[3]
app = Starlette(routes=[Route("/file", lambda request: FileResponse(path))])
sock = bind("127.0.0.1", 0)
write_port_file(port_file, *sock.getsockname()[:2])
uvicorn.Server(uvicorn.Config(app, http="h11", loop="asyncio", log_level="warning",
                             access_log=False)).run(sockets=[sock])
"""


def plain_get(payload: Path, digest: str, work: Path) -> dict:
    port_file = work / "plain.url"
    server = subprocess.Popen([sys.executable, "-c", _PLAIN_SERVER, str(payload), "-", str(port_file)], cwd=ROOT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the plain HTTP server did not start")
            time.sleep(0.02)
        out = work / "plain.bin"
        t0 = time.perf_counter()
        subprocess.run(["curl", "-sS", "--fail", "-o", str(out), f"{port_file.read_text().strip()}/file"],
                       check=True, timeout=600)
        seconds = time.perf_counter() - t0
        return {"get_s": seconds, "ok": sha256_file(out) == digest}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)


def peer(payload: Path, work: Path, shard_mib: int) -> dict | None:
    py = PEER / "venv" / "bin" / "python"
    if not py.exists():
        return None
    r = subprocess.run([str(py), str(PEER / "peer.py"), "--size-mib", str(payload.stat().st_size // MIB),
                        "--payload", str(payload), "--workdir", str(work), "--relays", "2",
                        "--shard-mib", str(shard_mib)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        return {"ok": False}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-mib", type=int, default=16, help="Our shard size (the peer uses its default 50 MB).")
    ap.add_argument("--parallel", type=int, default=ClientConfig.model_fields["parallel"].default,
                    help="Shards our client and relays fetch at once (default: the configs' default, %(default)s).")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "shardcast_bench.json"))
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="shardcast-bench-"))
    try:
        payload = base / "payload.bin"
        with open(payload, "wb") as f:
            for _ in range(args.size_mib):
                f.write(os.urandom(MIB))
        digest = sha256_file(payload)
        rounds = []
        for r in range(args.rounds):
            row: dict[str, Any] = {"load1": os.getloadavg()[0]}  # the machine is shared: context for every round
            for name, fn in (("ours", lambda w: ours(payload, digest, w, args.shard_mib, args.parallel)),
                             ("plain", lambda w: plain_get(payload, digest, w)),
                             ("peer", None if args.no_peer else lambda w: peer(payload, w, 50))):
                if fn is None:
                    continue
                work = base / f"r{r}-{name}"
                work.mkdir()
                os.sync()  # no writeback of the previous system's files during this one
                row[name] = fn(work)
                shutil.rmtree(work, ignore_errors=True)
            print(json.dumps(row), flush=True)
            rounds.append(row)
        med = {}
        for name, key in (("ours", "end_to_end_s"), ("ours", "client_only_s"), ("plain", "get_s"),
                          ("peer", "end_to_end_s"), ("peer", "client_s")):
            vals = [row[name][key] for row in rounds if row.get(name) and row[name].get("ok") and key in row[name]]
            if vals:
                med[f"{name}_{key}"] = statistics.median(vals)
        gib = args.size_mib / 1024
        loads = ", ".join(f"{row['load1']:.1f}" for row in rounds)
        print(f"\n{args.size_mib} MiB, origin -> 2 relays -> 1 client on 127.0.0.1, median of {args.rounds} rounds "
              f"(1-min load average at round starts: {loads}):")
        for k, v in med.items():
            print(f"  {k:24s} {v:7.2f} s  ({gib * 8 * 1.073741824 / v:6.2f} Gbit/s)")
        ratios = {}
        if "peer_end_to_end_s" in med:
            ratios["peer_e2e_over_ours_e2e"] = med["peer_end_to_end_s"] / med["ours_end_to_end_s"]
        if "plain_get_s" in med:
            ratios["ours_client_over_plain_get"] = med["ours_client_only_s"] / med["plain_get_s"]
            ratios["ours_e2e_over_plain_get"] = med["ours_end_to_end_s"] / med["plain_get_s"]
        for k, v in ratios.items():
            print(f"  {k:28s} {v:6.2f}x")
        cpus = [row["ours"]["cpu_s"] for row in rounds if row.get("ours", {}).get("ok")]
        if cpus:
            med["ours_cpu_s"] = {k: statistics.median(c[k] for c in cpus) for k in cpus[0]}
            med["ours_cpu_s"]["all"] = statistics.median(sum(c.values()) for c in cpus)
            print("  ours, CPU seconds per process from publish start to verified file (medians): " +
                  ", ".join(f"{k} {v:.2f}" for k, v in med["ours_cpu_s"].items()))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"size_mib": args.size_mib, "rounds": rounds, "medians": med,
                                              "ratios": ratios}, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
