"""TOPLOC speed: proofs built and checked per second, ours next to the reference, and the cost of
validating a rollout by one prefill next to the cost of generating it.

1. Proofs: 64 chunks of 32 x 4096 bf16 activations (the reference's benchmark shape), with one and
   with two torch threads on both sides (the reference goes chunk by chunk, ours batches the
   chunks, so only ours uses the second core). Ours (``intellect.toploc.proofs``) and ``toploc``
   0.1.6 (its C++ path, in ``benchmarks/peers/toploc/venv``, built by ``setup.sh``) alternate over
   ``--rounds`` rounds; each round takes the best of ``--repeats`` calls; medians over rounds and
   their ratios print.
2. Validation vs generation on the tiny model (random weights, no stop at EOS, so every rollout
   runs to ``--max-tokens``): a worker generates with hidden-state capture and builds proofs; the
   validator prefills the claimed tokens (``TorchEngine.prefill``) and checks the proofs.

    bash benchmarks/peers/toploc/setup.sh    # once, ~7 minutes; without it part 1 shows ours alone
    .venv/bin/python benchmarks/toploc_speed.py

Writes ``benchmarks/results/toploc_speed.json``.
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

from intellect.config import ModelConfig  # noqa: E402
from intellect.inference.protocol import Request  # noqa: E402
from intellect.inference.sampling import SamplingParams  # noqa: E402
from intellect.inference.torch_engine import TorchEngine  # noqa: E402
from intellect.model.checkpoint import build_model  # noqa: E402
from intellect.toploc.proofs import build_proofs, build_proofs_many, check_chunks, check_many  # noqa: E402

PEER = ROOT / "benchmarks" / "peers" / "toploc"
RESULTS = ROOT / "benchmarks" / "results"


def best(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def proofs_part(args, threads: int) -> dict:
    torch.set_num_threads(threads)
    acts = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    chunks = -(-args.tokens // 32)
    blob = build_proofs(acts)
    peer_py = PEER / "venv" / "bin" / "python"
    rows = {"ours_build": [], "ours_verify": [], "ref_build": [], "ref_verify": []}
    for _ in range(args.rounds):
        rows["ours_build"].append(chunks / best(lambda: build_proofs(acts), args.repeats))
        rows["ours_verify"].append(chunks / best(lambda: check_chunks(acts, blob), args.repeats))
        if peer_py.exists():
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([str(peer_py), str(PEER / "peer.py"), "speed", str(args.tokens), str(args.hidden),
                                str(args.repeats), f.name, str(threads)], check=True)
                ref = json.load(open(f.name))
            rows["ref_build"].append(ref["proofs"] / ref["build_seconds"][0])
            rows["ref_verify"].append(ref["proofs"] / ref["verify_seconds"][0])
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    print(f"proofs of {chunks} chunks of 32 x {args.hidden} bf16, {threads} torch thread(s) on both sides, "
          f"median of {args.rounds} rounds (best of {args.repeats} each):")
    for what in ("build", "verify"):
        line = f"  {what:6s} ours {med[f'ours_{what}']:8.0f} proofs/s"
        if f"ref_{what}" in med:
            line += (f"   toploc 0.1.6 {med[f'ref_{what}']:8.0f} proofs/s   ratio "
                     f"{med[f'ours_{what}'] / med[f'ref_{what}']:.2f}x")
        print(line)
    if "ref_build" not in med:
        print("  (no reference venv: run `bash benchmarks/peers/toploc/setup.sh` for the side-by-side)")
    return {"per_round": rows, "median": med}


def validation_part(args) -> dict:
    model, _ = build_model(ModelConfig())
    model.eval()
    engine = TorchEngine(model, eos_token_id=2, pad_token_id=0, capture_hidden=True)
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(3, 40, (8,), generator=g).tolist(), seed=i) for i in range(args.rollouts)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_at_eos=False)
    gen_times, val_times = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        done = engine.generate(requests, sampling)
        blobs = build_proofs_many([c.hidden_states for c in done])
        gen_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        scored = engine.prefill(requests, [c.tokens for c in done], sampling)
        checks = check_many([s.hidden_states for s in scored], blobs)
        val_times.append(time.perf_counter() - t)
        assert all(r.ok for c in checks for r in c), "an honest rollout failed its own check"
    gen, val = statistics.median(gen_times), statistics.median(val_times)
    tokens = args.rollouts * args.max_tokens
    print(f"tiny model, {args.rollouts} rollouts x {args.max_tokens} tokens, {torch.get_num_threads()} threads: "
          f"generate + build proofs {gen:.2f} s, prefill + check {val:.2f} s -> validation {gen / val:.1f}x faster "
          f"({tokens / val:,.0f} tokens/s checked)")
    return {"generate_seconds": gen_times, "validate_seconds": val_times, "ratio": gen / val}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of part 2")
    args = ap.parse_args()
    out = {"args": vars(args), "proofs": {str(t): proofs_part(args, t) for t in (1, 2)}}
    torch.set_num_threads(args.threads)
    out["validation"] = validation_part(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "toploc_speed.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
