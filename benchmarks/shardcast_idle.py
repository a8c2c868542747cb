"""SHARDCAST at rest: what idle relays cost their origin and themselves.

``--relays`` relays mirror one small version from an origin on 127.0.0.1, then nothing happens for
``--seconds``; the CPU seconds the origin and the relays spend in that span print. An idle relay
long-polls the origin's ``/versions`` (answered when a new version appears); the baseline is the
same script at commit 79f5f3e, where it polled every 50 ms.

    .venv/bin/python benchmarks/shardcast_idle.py --relays 8
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
from intellect.shardcast.local import ServerProcess  # noqa: E402
from intellect.shardcast.store import VersionStore  # noqa: E402
from intellect.shardcast.writer import VersionWriter  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--relays", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="shardcast-idle-"))
    procs = []
    try:
        origin = ServerProcess("origin", base / "origin")
        procs.append(origin)
        key = SigningKey.generate()  # the trainer's: relays mirror only what it signed
        relays = [ServerProcess("relay", base / f"relay{i}", extra=["--upstream", origin.url,
                                                                   "--trainer-key", key.public.hex])
                  for i in range(args.relays)]
        procs += relays
        with VersionWriter(VersionStore(base / "origin"), 1, 1 << 20, key) as w:
            w.begin_file("w")
            w.write(os.urandom(4 << 20))
        deadline = time.monotonic() + 60
        while not all((m := VersionStore(base / f"relay{i}").manifest(1)) is not None and m.complete
                      for i in range(args.relays)):
            if time.monotonic() > deadline:
                raise TimeoutError("the relays did not mirror the version")
            time.sleep(0.05)
        time.sleep(1.0)
        before = [cpu_s(p.pid) for p in procs]
        time.sleep(args.seconds)
        spent = [cpu_s(p.pid) - b for p, b in zip(procs, before)]
        print(f"{args.relays} idle relays, {args.seconds:g} s: origin {spent[0]:.2f} CPU-s, "
              f"relays {sum(spent[1:]):.2f} CPU-s in all")
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
