"""Times hivemind 1.1.12 Uniform8BitQuantization on a saved tensor; prints one JSON line.

Runs inside benchmarks/peers/hivemind/venv (see setup.sh) so the project venv never
imports hivemind. Usage: venv/bin/python quant_peer.py TENSOR.pt [--reps N] [--threads T]
"""

import argparse
import json
import statistics
import time
import warnings

import hivemind
import torch
from hivemind.compression import CompressionInfo, Uniform8BitQuantization

warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tensor")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    x = torch.load(args.tensor).float().contiguous()
    comp = Uniform8BitQuantization()
    enc, dec = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        msg = comp.compress(x, CompressionInfo.from_tensor(x, key=0), allow_inplace=False)
        t1 = time.perf_counter()
        y = comp.extract(msg)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
    rel = float(torch.linalg.vector_norm((y.double() - x.double())) / torch.linalg.vector_norm(x.double()))
    print(json.dumps({
        "hivemind": hivemind.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "numel": x.numel(),
        "rel_l2": rel,
        "wire_bytes": len(msg.buffer),
        "encode_s": statistics.median(enc),
        "decode_s": statistics.median(dec),
    }))


if __name__ == "__main__":
    main()
