"""Byte compatibility of ``intellect.toploc`` with the reference package ``toploc`` 0.1.6.

Seeded activation sets (fp32 RNG cast to bf16, since bf16 RNG streams differ across torch
versions), among them one whose chunk needs a modulus below 65497 and ones with a short last
chunk. For each set: the reference's proofs (``build_proofs_bytes(acts, 32, 128,
skip_prefill=True)``) equal ours byte for byte, our check accepts the reference's proofs, and the
reference's verifier finds no mismatch in ours.

    bash benchmarks/peers/toploc/setup.sh
    .venv/bin/python benchmarks/peers/toploc_compat.py

Exits 1 on any difference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from intellect.toploc.field import MOD  # noqa: E402
from intellect.toploc.proofs import build_proofs, check_chunks, proof_size  # noqa: E402

PEER = ROOT / "benchmarks" / "peers" / "toploc"
PY = PEER / "venv" / "bin" / "python"


def activation_sets() -> list[tuple[str, torch.Tensor]]:
    def randn(tokens, hidden, seed):
        return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))

    planted = randn(32, 4096, 2)
    flat = planted.view(-1)
    flat[100], flat[100 + MOD] = 50.0, -60.0  # two top values 65497 apart: m must step down
    sets = [("64x4096", randn(64, 4096, 0)), ("2048x4096 (64 chunks)", randn(2048, 4096, 5)), ("100x4096 (short last chunk)", randn(100, 4096, 1)),
            ("32x4096, modulus < 65497", planted), ("7x2048 (one short chunk)", randn(7, 2048, 3)),
            ("96x896 (Qwen-0.5B width)", randn(96, 896, 4) * torch.linspace(0.1, 8, 896))]
    return [(name, a.to(torch.bfloat16)) for name, a in sets]


def peer(*args: str) -> None:
    subprocess.run([str(PY), str(PEER / "peer.py"), *args], check=True)


def main() -> None:
    if not PY.exists():
        sys.exit("no reference venv: run `bash benchmarks/peers/toploc/setup.sh` first")
    sets = activation_sets()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        acts_pt, ref_json, ours_json, ver_json = (str(Path(tmp) / n) for n in ("a.pt", "r.json", "o.json", "v.json"))
        torch.save([a for _, a in sets], acts_pt)
        peer("build", acts_pt, ref_json)
        ref = json.load(open(ref_json))
        ours = [build_proofs(a) for _, a in sets]
        size = proof_size(128)
        json.dump([[o[i:i + size].hex() for i in range(0, len(o), size)] for o in ours], open(ours_json, "w"))
        peer("verify", acts_pt, ours_json, ver_json)
        their_checks = json.load(open(ver_json))
        for (name, a), r, o, tc in zip(sets, ref, ours, their_checks):
            same = bytes.fromhex("".join(r)) == o
            mine = check_chunks(a, bytes.fromhex("".join(r)))
            accepts = all(c.ok for c in mine)
            theirs_clean = all(e == 0 and mean == 0 for e, mean, _ in tc)
            moduli = sorted({int(p[:4], 16) for p in r})
            print(f"{name:28s} chunks {len(r):3d}  moduli {moduli}  bytes equal: {same}  "
                  f"ours accepts theirs: {accepts}  theirs accepts ours: {theirs_clean}")
            failures += (not same) + (not accepts) + (not theirs_clean)
    print("all identical" if not failures else f"{failures} differences")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
