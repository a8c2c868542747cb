"""Continuous against static batching in the torch engine, on a mixed-length workload.

Requests are arithmetic prompts whose ``max_tokens`` are drawn log-uniform in
``[--min-tokens, --max-tokens]`` (seeded; a long tail: most are short, a few long), EOS off, so
each request's length is the drawn one. Both schedulings run the same requests and seeds with
the same ``--batch`` rows at most, side by side (interleaved repeats), on a small random Llama
from the project's model builder. Per scheduling it prints the row-steps decoded (rows of every
forward that yields next-token logits, :class:`~intellect.inference.stats.EngineStats`),
the useful-token share (returned tokens / row-steps), the forwards, and the median tokens/s of
``--repeats`` runs, then the continuous/static ratio; it checks that both return the same tokens.

    python benchmarks/engine_batching.py [--requests 64 --batch 16 --repeats 3 --threads 2]

Writes ``benchmarks/results/engine_batching.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch

from intellect.config import DataConfig, ModelConfig
from intellect.data.arithmetic import heldout_problems
from intellect.inference import EngineConfig, Request, SamplingParams, TorchEngine
from intellect.model.checkpoint import build_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEDULINGS = ("static", "continuous")


def workload(tok, n: int, lo: int, hi: int, temperature: float, seed: int
             ) -> tuple[list[Request], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [tok(p.prompt)["input_ids"] for p in heldout_problems(DataConfig(), n)]
    lengths = [int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))) for _ in range(n)]
    requests = [Request(p, seed=seed * 100_003 + i) for i, p in enumerate(prompts)]
    params = [SamplingParams(temperature=temperature, max_tokens=min(hi, m), stop_at_eos=False) for m in lengths]
    return requests, params


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="max_batch_size of both schedulings")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-capture", action="store_true", help="skip the hidden-state capture")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = build_model(ModelConfig())
    model.to(args.device)
    requests, params = workload(tok, args.requests, args.min_tokens, args.max_tokens, args.temperature, args.seed)
    engines = {
        s: TorchEngine.for_tokenizer(model, tok, capture_hidden=not args.no_capture,
                                     config=EngineConfig(max_batch_size=args.batch, scheduling=s))
        for s in SCHEDULINGS
    }
    outputs = {s: e.generate(requests, params) for s, e in engines.items()}  # warm-up, and the token check
    same = sum(a.tokens == b.tokens for a, b in zip(outputs["static"], outputs["continuous"]))
    useful = sum(len(c.tokens) for c in outputs["continuous"])
    times: dict[str, list[float]] = {s: [] for s in SCHEDULINGS}
    for e in engines.values():
        e.stats.reset()
    for _ in range(args.repeats):  # interleaved so load drift hits both alike
        for s, e in engines.items():
            if args.device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            e.generate(requests, params)
            if args.device != "cpu":
                torch.cuda.synchronize()
            times[s].append(time.perf_counter() - t0)
    rows = {}
    for s, e in engines.items():
        st, k = e.stats, args.repeats  # stats summed over the repeats: per run is a k-th
        rows[s] = {
            "row_steps": st.row_steps // k, "tokens": st.tokens // k, "useful_share": st.useful_share,
            "prefill_forwards": st.prefill_forwards // k, "decode_forwards": st.decode_forwards // k,
            "peak_rows": st.peak_rows, "seconds": times[s],
            "tokens_per_s": useful / statistics.median(times[s]),
        }
    ratio = rows["continuous"]["tokens_per_s"] / rows["static"]["tokens_per_s"]
    drawn = [p.max_tokens for p in params]
    print(f"tiny Llama ({sum(p.numel() for p in model.parameters()):,} params), {args.requests} requests, "
          f"max_tokens log-uniform in [{args.min_tokens}, {args.max_tokens}] (median {statistics.median(drawn):.0f}, "
          f"max {max(drawn)}), T={args.temperature}, batch {args.batch}, {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats}")
    print("| scheduling | row-steps | useful tokens | useful share | prefill fwd | decode fwd | tokens/s | runs (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for s, r in rows.items():
        print(f"| {s} | {r['row_steps']:,} | {r['tokens']:,} | {100 * r['useful_share']:.1f}% | "
              f"{r['prefill_forwards']} | {r['decode_forwards']:,} | {r['tokens_per_s']:,.0f} | "
              f"{', '.join(f'{x:.2f}' for x in r['seconds'])} |")
    print(f"continuous / static throughput: x{ratio:.2f}; identical tokens: {same}/{len(requests)} requests")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "rows": rows, "ratio": ratio, "identical": same, "requests": len(requests)}
    (RESULTS / "engine_batching.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'engine_batching.json'}")


if __name__ == "__main__":
    main()
