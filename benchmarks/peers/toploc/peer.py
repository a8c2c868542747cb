"""The reference side of the TOPLOC benchmarks: runs inside benchmarks/peers/toploc/venv.

    venv/bin/python peer.py build ACTS.pt OUT.json        # proofs of each activation set, hex
    venv/bin/python peer.py verify ACTS.pt PROOFS.json OUT.json
    venv/bin/python peer.py speed TOKENS HIDDEN REPEATS OUT.json [THREADS]

ACTS.pt is a list of bf16 [tokens, hidden] tensors saved by the project side.
"""

import json
import sys
import time

import torch
from toploc import build_proofs_bytes, verify_proofs_bytes

CHUNK, K = 32, 128


def best(fn, n):
    fn()  # warm the thread pool and caches before timing
    times, out = [], None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, sorted(times)


def main() -> None:
    cmd, args = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    if cmd == "build":
        sets = torch.load(args[0])
        out = [[p.hex() for p in build_proofs_bytes(a, CHUNK, K, skip_prefill=True)] for a in sets]
        json.dump(out, open(args[1], "w"))
    elif cmd == "verify":
        sets, proofs = torch.load(args[0]), json.load(open(args[1]))
        out = []
        for a, ps in zip(sets, proofs):
            res = verify_proofs_bytes(a, [bytes.fromhex(p) for p in ps], CHUNK, K, skip_prefill=True)
            out.append([[r.exp_mismatches, r.mant_err_mean, r.mant_err_median] for r in res])
        json.dump(out, open(args[2], "w"))
    elif cmd == "speed":
        tokens, hidden, repeats = int(args[0]), int(args[1]), int(args[2])
        torch.set_num_threads(int(args[4]) if len(args) > 4 else 1)
        acts = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        proofs, tb = best(lambda: build_proofs_bytes(acts, CHUNK, K, skip_prefill=True), repeats)
        _, tv = best(lambda: verify_proofs_bytes(acts, proofs, CHUNK, K, skip_prefill=True), repeats)
        json.dump({"proofs": len(proofs), "build_seconds": tb, "verify_seconds": tv}, open(args[3], "w"))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
