"""What signing SHARDCAST versions costs: the trainer's Ed25519 signature per shard and per header,
a reader's verification of each, and both beside hashing the shard's bytes (which every reader
does anyway).

    .venv/bin/python benchmarks/shardcast_signing.py [--shards 4096] [--shard-mib 16]

Prints microseconds per signature and per verification (median of ``--rounds``), what a version of
``--shards`` shards costs the origin (signing) and each relay or client (verifying, through
``ManifestView.apply`` with the listing in deltas of 16 shards, as a reader following a version
being written takes it), and those as a share of SHA-256 over the version's bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.shardcast.manifest import FileEntry, ManifestDelta, ManifestView, ShardEntry  # noqa: E402
from intellect.shardcast.signing import Verifier, VersionSigner  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402

MIB = 1 << 20


def one_round(n: int, shard: int) -> dict:
    key = SigningKey.generate()
    signer = VersionSigner(key, 7)
    files = [FileEntry(name="model.safetensors", offset=0)]
    entries = [ShardEntry(index=i, offset=i * shard, size=shard, sha256=os.urandom(32).hex(),
                          chain=os.urandom(32).hex()) for i in range(n)]
    t0 = time.perf_counter()
    signed = [signer.shard(e) for e in entries]
    header = signer.header(files, shard)
    sign_s = time.perf_counter() - t0
    view = ManifestView(7, Verifier(key.public))
    deltas = [ManifestDelta(version=7, files=files, shard_size=shard, publication=signer.publication, signature=header,
                            listing="ab", since=i, shards=signed[i:i + 16]) for i in range(0, n, 16)]
    t0 = time.perf_counter()
    for d in deltas:
        view.apply("relay", d)
    verify_s = time.perf_counter() - t0
    assert len(view.entries) == n
    unsigned = [ManifestDelta(version=7, files=files, shard_size=shard, listing="ab", since=i,
                              shards=entries[i:i + 16]) for i in range(0, n, 16)]
    bare = ManifestView(7, Verifier(key.public))
    bare.verifier.header = lambda *_a, **_k: None  # the view's own bookkeeping, without any signature checked
    bare.verifier.shard = lambda *_a, **_k: None
    t0 = time.perf_counter()
    for d in unsigned:
        bare.apply("relay", d)
    bare_s = time.perf_counter() - t0
    return {"sign_s": sign_s, "verify_s": verify_s, "bookkeeping_s": bare_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4096, help="Shards of the version (a 62 GB checkpoint: ~4,000).")
    ap.add_argument("--shard-mib", type=float, default=16.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    shard = int(args.shard_mib * MIB)
    rows = [one_round(args.shards, shard) for _ in range(args.rounds)]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    data = os.urandom(16 * MIB)
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    hash_per_byte = (time.perf_counter() - t0) / len(data)
    hash_s = hash_per_byte * shard * args.shards
    n = args.shards
    print(f"{n} shards of {args.shard_mib:g} MiB, median of {args.rounds} rounds:")
    print(f"  origin, signing:   {med['sign_s'] * 1e6 / n:6.1f} us per shard, {med['sign_s']:.3f} s per version")
    print(f"  reader, verifying: {(med['verify_s'] - med['bookkeeping_s']) * 1e6 / n:6.1f} us per shard "
          f"({med['verify_s']:.3f} s through ManifestView.apply in deltas of 16, {med['bookkeeping_s']:.3f} s of "
          f"which is the view's own bookkeeping)")
    verify_s = med["verify_s"] - med["bookkeeping_s"]
    print(f"  SHA-256 of the version's bytes (each reader hashes them anyway): {hash_s:.1f} s; signing is "
          f"{100 * med['sign_s'] / hash_s:.3f}% of it, verifying {100 * verify_s / hash_s:.3f}%")


if __name__ == "__main__":
    main()
