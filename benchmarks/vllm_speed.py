"""What the project's sampler costs inside vLLM: generation speed of the vLLM engine (the project's
seeded sampler as a logits processor, with and without hidden-state capture), vLLM with its own
sampler (what the engine cannot use: a validator rejects its tokens), and the torch engine, on the
same checkpoint and prompts, in one process.

Every runner generates exactly ``--new-tokens`` per prompt (EOS off), T=1, for ``--prompts`` prompts
in one call; each is timed ``--repeats`` times in turns (one untimed warm-up call first). Prints
the median and best generated tokens/s and the ratio of each median to the torch engine's.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_speed.py --prompts 64 --new-tokens 32 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from intellect.config import ComputeConfig, DataConfig, ModelConfig
from intellect.data.arithmetic import heldout_problems
from intellect.inference import Request, SamplingParams, TorchEngine
from intellect.inference.config import EngineConfig
from intellect.model.checkpoint import build_model, save_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import SamplingParams as VllmParams  # noqa: PLC0415  # pyright: ignore[reportMissingImports]

    from intellect.inference.vllm_engine import VllmEngine  # noqa: PLC0415 - after vLLM's environment is set

    model, tok = build_model(ModelConfig())
    folder = save_checkpoint(model, tok, Path(tempfile.mkdtemp(prefix="vllm-speed-")) / "policy")
    compute, cfg = ComputeConfig(device="cpu", precision="fp32"), EngineConfig(kind="vllm", max_batch_size=args.prompts)
    capture = VllmEngine.from_folder(folder, compute, cfg, capture_hidden=True)
    plain = VllmEngine.from_folder(folder, compute, cfg, capture_hidden=False)
    torch.set_num_threads(args.threads)
    problems = heldout_problems(DataConfig(), args.prompts)
    reqs = [Request(tok(p.prompt)["input_ids"], seed=i) for i, p in enumerate(problems)]
    sp = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, stop_at_eos=False)
    own = [VllmParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=r.seed, detokenize=False)
           for r in reqs]
    engine = TorchEngine.for_tokenizer(model, tok, capture_hidden=True, max_batch_size=args.prompts)

    def ours(e) -> Callable[[], int]:
        return lambda: sum(len(c.tokens) for c in e.generate(reqs, sp))

    def vllm_own() -> int:
        outs = plain.llm.generate([{"prompt_token_ids": r.prompt_ids} for r in reqs], own, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    runners = {"torch engine (hidden states)": ours(engine), "vLLM engine (hidden states)": ours(capture),
               "vLLM engine (no hidden states)": ours(plain), "vLLM's own sampler (unusable)": vllm_own}
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        run()
    for _ in range(args.repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            n = run()
            rates[name].append(n / (time.perf_counter() - start))
    base = statistics.median(rates["torch engine (hidden states)"])
    print(f"{args.prompts} prompts x {args.new_tokens} tokens, T=1, {args.threads} thread(s), "
          f"{args.repeats} repeats, fp32, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    print(f"{'runner':<32} {'median tok/s':>12} {'best':>8} {'/ torch':>8}")
    for name, r in rates.items():
        print(f"{name:<32} {statistics.median(r):>12.0f} {max(r):>8.0f} {statistics.median(r) / base:>8.2f}")


if __name__ == "__main__":
    main()
