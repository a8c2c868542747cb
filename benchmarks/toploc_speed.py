"""TOPLOC speed: proofs built and checked per second, ours next to the reference, and the cost of
validating a rollout by one prefill next to the cost of generating it.

1. Proofs: 64 chunks of 32 x 4096 bf16 activations (the reference's benchmark shape), with one and
   with two torch threads on both sides (the reference goes chunk by chunk, ours batches the
   chunks, so only ours uses the second core). Ours (``intellect.toploc.proofs``) and ``toploc``
   0.1.6 (its C++ path, in ``benchmarks/peers/toploc/venv``, built by ``setup.sh``) alternate over
   ``--rounds`` rounds; each round takes the best of ``--repeats`` calls; medians over rounds and
   their ratios print.
2. Validation vs generation on the tiny model (random weights), two settings: ``long`` (64
   rollouts, no stop at EOS, so every rollout runs to 64 tokens: two proofs each) and ``rl-tiny``
   (``configs/rl-tiny.toml``'s submission: 256 rollouts, max_tokens 8, stopping at EOS). A worker
   generates with hidden-state capture and builds the proofs; the validator runs its whole row
   check (``toploc_check``: one prefill, then the computation, sampling and termination checks).
   The model's bare forward over the same batches is timed too: no validation by prefill can be
   faster than it, and on a CPU it costs about what decoding the same tokens does (batch-64
   decoding of a model that fits in cache is compute-bound, not memory-bound as on a GPU).

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
from typing import TypedDict

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.config import ModelConfig  # noqa: E402
from intellect.inference.protocol import Request  # noqa: E402
from intellect.inference.sampling import SamplingParams  # noqa: E402
from intellect.inference.torch_engine import TorchEngine  # noqa: E402
from intellect.model.checkpoint import build_model  # noqa: E402
from intellect.model.generate import left_pad  # noqa: E402
from intellect.rl.wire.rollouts import Rollout  # noqa: E402
from intellect.toploc.check import toploc_check  # noqa: E402
from intellect.toploc.proofs import ToplocConfig, build_proofs, check_chunks, completion_proofs  # noqa: E402

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


class Setting(TypedDict):
    """One validation setting: rollouts of ``prompt`` random tokens, sampled up to ``max_tokens``."""

    rollouts: int
    prompt: int
    max_tokens: int
    stop_at_eos: bool


SETTINGS: dict[str, Setting] = {
    # the long setting: every rollout runs to max_tokens, two chunks of 32 each
    "long": Setting(rollouts=64, prompt=8, max_tokens=64, stop_at_eos=False),
    # configs/rl-tiny.toml's submission: 32 prompts x group 8, max_tokens 8, stopping at EOS, batches of
    # 64 (the workers' TorchEngine), arithmetic prompts of about 7 tokens (BOS, "12+34=")
    "rl-tiny": Setting(rollouts=256, prompt=7, max_tokens=8, stop_at_eos=True),
}


def validation_part(args, setting: str) -> dict:
    """Generation (the worker: generate with hidden-state capture, build the proofs) next to
    validation (the validator's whole row check, :func:`intellect.toploc.check.toploc_check`:
    prefill, computation, seeded and distribution sampling, termination checks), alternating."""
    s = SETTINGS[setting]
    model, _ = build_model(ModelConfig())
    model.eval()
    engine = TorchEngine(model, eos_token_id=2, pad_token_id=0, capture_hidden=True)
    g = torch.Generator().manual_seed(1)
    requests = [Request(torch.randint(3, 40, (s["prompt"],), generator=g).tolist(), seed=i)
                for i in range(s["rollouts"])]
    sampling = SamplingParams(temperature=1.0, max_tokens=s["max_tokens"], stop_at_eos=s["stop_at_eos"])
    cfg = ToplocConfig()
    check = toploc_check(lambda _policy: engine, sampling, cfg, eos_ids=[2])
    gen_times, val_times, fwd_times = [], [], []
    for _ in range(args.rounds + 1):  # the first round warms every side up
        t = time.perf_counter()
        done = engine.generate(requests, sampling)
        blobs = completion_proofs(done, cfg)
        gen_times.append(time.perf_counter() - t)
        # the floor of any validation by prefill: the model's forward over the same batches alone
        # (sorted by length, as the engine's prefill batches them)
        seqs = sorted((r.prompt_ids + c.tokens[:-1] for r, c in zip(requests, done)), key=len)
        batches = [left_pad(seqs[a:a + engine.max_batch_size], 0) for a in range(0, len(seqs), engine.max_batch_size)]
        t = time.perf_counter()
        with torch.no_grad():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        fwd_times.append(time.perf_counter() - t)
        rows = [Rollout(run="bench", step=0, policy_step=0, worker="w", submission=0, seed=r.seed, prompt_id=str(i),
                        group_id=i // 8, prompt_tokens=tuple(r.prompt_ids), output_tokens=tuple(c.tokens),
                        finish_reason=c.finish_reason, reward=0.0, task_reward=0.0, length_penalty=0.0,
                        advantage=0.0, proof=b) for i, (r, c, b) in enumerate(zip(requests, done, blobs))]
        t = time.perf_counter()
        verdicts = check(rows)
        val_times.append(time.perf_counter() - t)
        assert verdicts == [None] * len(rows), f"an honest rollout failed its own check: {set(verdicts)}"
    gen_times, val_times, fwd_times = gen_times[1:], val_times[1:], fwd_times[1:]
    gen, val, fwd = (statistics.median(x) for x in (gen_times, val_times, fwd_times))
    tokens = sum(len(r.output_tokens) for r in rows)
    print(f"tiny model, {setting}: {s['rollouts']} rollouts, prompts of {s['prompt']}, max_tokens {s['max_tokens']} "
          f"({tokens / len(rows):.1f} generated a rollout), {torch.get_num_threads()} thread(s), median of "
          f"{args.rounds}: generate + build proofs {gen:.3f} s, validate (prefill + every check) {val:.3f} s -> "
          f"validation {gen / val:.1f}x faster ({tokens / val:,.0f} tokens/s checked); the forward alone "
          f"{fwd:.3f} s, so no prefill-based validation beats {gen / fwd:.1f}x here")
    return {"setting": s, "threads": torch.get_num_threads(), "generate_seconds": gen_times,
            "validate_seconds": val_times, "forward_seconds": fwd_times, "ratio": gen / val, "ceiling": gen / fwd}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of part 2 (both sides)")
    ap.add_argument("--part", choices=("all", "proofs", "validation"), default="all")
    args = ap.parse_args()
    out = {"args": vars(args)}
    if args.part in ("all", "proofs"):
        out["proofs"] = {str(t): proofs_part(args, t) for t in (1, 2)}
    if args.part in ("all", "validation"):
        torch.set_num_threads(args.threads)
        out["validation"] = {name: validation_part(args, name) for name in SETTINGS}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "toploc_speed.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
