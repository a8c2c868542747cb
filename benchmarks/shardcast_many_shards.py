"""SHARDCAST with many shards: does following a version stay linear in its shard count?

A 62 GB checkpoint in 16 MiB shards has ~4,000 shards. Here the same 64 MiB payload is published
in ever smaller shards (16 MiB down to 16 KiB: 4 to 4,096 shards), origin -> 1 relay -> 1 client on
127.0.0.1, so the per-shard costs, manifests above all, are what grows. Printed per shard count:
end to end (publish start to the client's verified copy), and each process's CPU seconds.

    .venv/bin/python benchmarks/shardcast_many_shards.py

The baseline is this protocol before manifests were followed by deltas (commit 79f5f3e: every new
shard rewrote, re-sent and re-parsed the whole manifest): run the same script at that commit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.shardcast_bench import cpu_s  # noqa: E402
from intellect.shardcast.client import ShardcastClient  # noqa: E402
from intellect.shardcast.config import ClientConfig  # noqa: E402
from intellect.shardcast.local import ServerProcess  # noqa: E402
from intellect.shardcast.store import VersionStore  # noqa: E402
from intellect.shardcast.writer import publish_folder  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--shard-kib", default="16384,1024,256,64,16", help="Comma-separated shard sizes, KiB.")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="shardcast-many-"))
    key = SigningKey.generate()  # the trainer's: every shard is signed, and verified by relay and client
    try:
        payload = base / "payload.bin"
        payload.write_bytes(os.urandom(args.size_mib << 20))
        print(f"{args.size_mib} MiB, origin -> 1 relay -> 1 client on 127.0.0.1")
        print(f"{'shards':>7} {'end to end s':>13} {'publish CPU-s':>14} {'origin':>7} {'relay':>7} {'client':>7}")
        for kib in (int(k) for k in args.shard_kib.split(",")):
            work = base / f"s{kib}"
            origin = ServerProcess("origin", work / "origin")
            relay = ServerProcess("relay", work / "relay", extra=["--upstream", origin.url,
                                                                 "--trainer-key", key.public.hex])
            try:
                servers = {"origin": origin.pid, "relay": relay.pid}
                before = {k: cpu_s(p) for k, p in servers.items()}
                t0, c0 = time.perf_counter(), os.times()
                m = publish_folder(VersionStore(work / "origin"), 1, payload, kib << 10, keep=5, key=key)
                c1 = os.times()
                with ShardcastClient([relay.url], ClientConfig(deadline=1800, trainer_key=key.public.hex)) as client:
                    client.fetch(1, work / "out")
                seconds, c2 = time.perf_counter() - t0, os.times()
                cpu = {k: cpu_s(p) - before[k] for k, p in servers.items()}
                pub = c1.user + c1.system - c0.user - c0.system
                cli = c2.user + c2.system - c1.user - c1.system
                print(f"{len(m.shards):7d} {seconds:13.2f} {pub:14.2f} {cpu['origin']:7.2f} {cpu['relay']:7.2f} "
                      f"{cli:7.2f}", flush=True)
            finally:
                relay.stop()
                origin.stop()
                shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
