"""Int8 quantizer: ours (intellect.diloco.quantize) vs hivemind 1.1.12 Uniform8BitQuantization.

Both sides see the same tensor (saved to a temp .pt file); hivemind runs in its own
venv (benchmarks/peers/hivemind/setup.sh) through peers/hivemind/quant_peer.py.
Times are medians of --reps runs, throughput in M floats/s of fp32 input.
"encode" is tensor -> wire bytes, "decode" wire bytes -> fp32 tensor, for both sides
(hivemind's compress/extract also (de)serialize). The "+ zstd" row is the same with the
indices entropy-coded (``to_bytes(q, codec="zstd")``, the all-reduce's default): its
extra seconds per MB saved is the price of the smaller messages.

    .venv/bin/python benchmarks/quantizer_bench.py                 # Gaussian, Laplace, Student-t
    .venv/bin/python benchmarks/quantizer_bench.py --sweep         # error vs clip_sigmas
    .venv/bin/python benchmarks/quantizer_bench.py --tensor g.pt   # add a saved tensor
    .venv/bin/python benchmarks/quantizer_bench.py --no-synthetic --tensor g.pt --sweep

--tensor takes a torch.save'd tensor, or a dict/list of them (e.g. a pseudo-gradient
state_dict): float entries are flattened and concatenated into ONE tensor, quantized
with one mu/sigma like one all-reduce bucket. Save one file per bucket/tensor to
compare at a finer granularity (mixed scales in one tensor inflate the error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.diloco.quantize import (  # noqa: E402
    DEFAULT_CLIP_SIGMAS,
    dequantize,
    from_bytes,
    quantize,
    to_bytes,
)

PEER = ROOT / "benchmarks" / "peers" / "hivemind"
PEER_PY = PEER / "venv" / "bin" / "python"


def rel_l2(y: torch.Tensor, x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(y.double() - x.double()) / torch.linalg.vector_norm(x.double()))


def synthetic(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(n, generator=g)
    # Student-t(3) = N / sqrt(chi2_3 / 3); heavy tails like real pseudo-gradients.
    z = torch.randn(n, generator=g)
    chi2 = torch.randn(3, n, generator=g).pow_(2).sum(0)
    student = z / torch.sqrt(chi2 / 3)
    laplace = torch.empty(n).exponential_(generator=g) - torch.empty(n).exponential_(generator=g)
    return {"gaussian N(0,1)": gauss, "laplace b=1": laplace, "student-t df=3": student.mul_(1e-3)}


def load_tensor(path: str) -> torch.Tensor:
    obj = torch.load(path, map_location="cpu")
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        obj = torch.cat([t.detach().reshape(-1).float() for t in obj if torch.is_tensor(t) and t.is_floating_point()])
    return obj.detach().reshape(-1).float().contiguous()


def time_ours(x: torch.Tensor, reps: int, c: float) -> dict:
    enc, dec, q_only, dq_only, into, zenc, zdec = [], [], [], [], [], [], []
    out = torch.empty_like(x)
    for _ in range(reps):
        t0 = time.perf_counter()
        q = quantize(x, c)
        t1 = time.perf_counter()
        wire = to_bytes(q)
        t2 = time.perf_counter()
        q2 = from_bytes(wire)
        t3 = time.perf_counter()
        y = dequantize(q2)
        t4 = time.perf_counter()
        t5 = time.perf_counter()
        dequantize(q2, out=out)
        into.append(time.perf_counter() - t5)
        t6 = time.perf_counter()
        zwire = to_bytes(quantize(x, c), codec="zstd")
        t7 = time.perf_counter()
        dequantize(from_bytes(zwire))
        zdec.append(time.perf_counter() - t7)
        zenc.append(t7 - t6)
        enc.append(t2 - t0)
        q_only.append(t1 - t0)
        dec.append(t4 - t2)
        dq_only.append(t4 - t3)
    med = statistics.median
    return {
        "rel_l2": rel_l2(y, x),
        "wire_bytes": len(wire),
        "encode_s": med(enc),
        "decode_s": med(dec),
        "quantize_s": med(q_only),
        "dequantize_s": med(dq_only),
        "dequantize_out_s": med(into),
        "zstd_wire_bytes": len(zwire),
        "zstd_encode_s": med(zenc),
        "zstd_decode_s": med(zdec),
    }


def time_hivemind(x: torch.Tensor, reps: int) -> dict | str:
    if not PEER_PY.exists():
        return f"hivemind venv missing: run bash {PEER.relative_to(ROOT)}/setup.sh"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.pt"
        torch.save(x, path)
        cmd = [str(PEER_PY), str(PEER / "quant_peer.py"), str(path), "--reps", str(reps),
               "--threads", str(torch.get_num_threads())]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return f"hivemind peer failed (rc={r.returncode}): {r.stderr.strip()[-500:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench(name: str, x: torch.Tensor, reps: int, c: float, hivemind: bool) -> None:
    n = x.numel()
    ours = time_ours(x, reps, c)
    hm = time_hivemind(x, reps) if hivemind else "skipped (--no-hivemind)"
    mfs = lambda s: n / s / 1e6  # noqa: E731
    print(f"\n## {name}: {n:,} floats, {reps} reps, {torch.get_num_threads()} threads, medians")
    print(f"{'':34}{'rel L2':>10}{'encode Mfl/s':>14}{'decode Mfl/s':>14}{'wire bytes':>12}")
    print(f"{f'ours (c={c:g}) wire->wire':34}{ours['rel_l2']:>10.5f}{mfs(ours['encode_s']):>14.1f}"
          f"{mfs(ours['decode_s']):>14.1f}{ours['wire_bytes']:>12,}")
    print(f"{f'ours (c={c:g}) + zstd wire->wire':34}{ours['rel_l2']:>10.5f}{mfs(ours['zstd_encode_s']):>14.1f}"
          f"{mfs(ours['zstd_decode_s']):>14.1f}{ours['zstd_wire_bytes']:>12,}")
    saved_mb = (ours["wire_bytes"] - ours["zstd_wire_bytes"]) / 1e6
    extra_s = ours["zstd_encode_s"] + ours["zstd_decode_s"] - ours["encode_s"] - ours["decode_s"]
    if saved_mb > 0:
        print(f"{'  zstd: bytes saved, extra CPU':34}{saved_mb / (ours['wire_bytes'] / 1e6):>9.1%} "
              f"{extra_s * 1e3 / saved_mb:>13.1f} ms per MB saved (coding wins on links slower than "
              f"{saved_mb * 8 / extra_s:.0f} Mbit/s when CPU and network do not overlap)")
    print(f"{'ours quantize/dequantize only':34}{'':>10}{mfs(ours['quantize_s']):>14.1f}{mfs(ours['dequantize_s']):>14.1f}")
    # A fresh 64 MB output costs ~25 ms of first-touch page faults here; a ring reuses its buffer.
    print(f"{'ours dequantize(out=reused buffer)':34}{'':>10}{'':>14}{mfs(ours['dequantize_out_s']):>14.1f}")
    if isinstance(hm, str):
        print(f"hivemind: {hm}")
        return
    print(f"{'hivemind ' + hm['hivemind'] + ' Uniform8Bit':34}{hm['rel_l2']:>10.5f}{mfs(hm['encode_s']):>14.1f}"
          f"{mfs(hm['decode_s']):>14.1f}{hm['wire_bytes']:>12,}")
    print(f"{'ratio ours/hivemind':34}{ours['rel_l2'] / hm['rel_l2']:>9.3f}x"
          f"{hm['encode_s'] / ours['encode_s']:>13.2f}x{hm['decode_s'] / ours['decode_s']:>13.2f}x"
          "   (error: <1 is better; speed: >1 is faster)")


def sweep(data: dict[str, torch.Tensor], cs: list[float]) -> None:
    print("\n## relative L2 error vs clip_sigmas (c)")
    print(f"{'c':<18}" + "".join(f"{c:>10g}" for c in cs))
    for name, x in data.items():
        print(f"{name:<18}" + "".join(f"{rel_l2(dequantize(quantize(x, c)), x):>10.5f}" for c in cs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1 << 24, help="synthetic tensor size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--clip-sigmas", type=float, default=DEFAULT_CLIP_SIGMAS)
    ap.add_argument("--tensor", action="append", default=[], help="extra saved tensor(s) (.pt), see above")
    ap.add_argument("--sweep", action="store_true", help="only print the error-vs-c table")
    ap.add_argument("--sweep-cs", default="3,4,5,6,8,12")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--no-hivemind", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads on both sides (default 1: on a shared 2-core box, 2-thread ops "
                         "stall at every OpenMP barrier when the other core is busy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    data = {} if args.no_synthetic else synthetic(args.n)
    for p in args.tensor:
        data[Path(p).name] = load_tensor(p)
    if args.sweep:
        sweep(data, [float(c) for c in args.sweep_cs.split(",")])
        return
    for name, x in data.items():
        bench(name, x, args.reps, args.clip_sigmas, not args.no_hivemind)


if __name__ == "__main__":
    main()
