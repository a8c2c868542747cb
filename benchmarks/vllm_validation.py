"""Honest vLLM rollouts through the torch validator's checks, beside the torch engine's own, on the CPU.

Both engines hold the same tiny checkpoint (the project's default model, built here and saved in fp32) and
generate the same submissions (``generate_submission``: assigned prompts, seeds and TOPLOC proofs,
16 rollouts each) in turns, submission by submission, so load on a shared machine falls on both
alike. Every rollout then goes through the validator's file-free checks: the length and
``finish_reason`` rule (``length_check``) and TOPLOC's computation, seeded sampling and
termination checks (``toploc_check``) against a torch prefill engine on the same checkpoint.
Prints the false rejects of each engine (every rollout is honest: the goal is 0) with their
reasons, how many vLLM rollouts equal the torch engine's token for token, and generated tokens/s
(median over submissions, and overall) with the ratio vLLM / torch. For contrast, the share of
tokens the validator's seeded re-check confirms when vLLM samples with its own sampler (same seeds,
the project's sampler off): why the engine runs the project's.

Runs in the vLLM environment (``make venv-vllm``):

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_validation.py --submissions 64 [--precision bf16]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from intellect.config import ComputeConfig, ModelConfig
from intellect.data.arithmetic import Problem
from intellect.data.text import eos_id
from intellect.inference import Request, TorchEngine
from intellect.inference.config import EngineConfig
from intellect.model.checkpoint import build_model, save_checkpoint
from intellect.rl.worker.submission import SubmissionConfig, generate_submission
from intellect.rl.service.validator import length_check
from intellect.toploc.check import toploc_check
from intellect.toploc.proofs import ToplocConfig

CFG = SubmissionConfig(prompts_per_submission=4, group_size=4, max_tokens=48, temperature=1.0)
TASKS = [Problem(a, op, b).to_task() for a in range(10) for b in range(1, 10) for op in "+*"]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--submissions", type=int, default=64, help="per engine; 16 rollouts each")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="of every engine, the validator's included (vLLM has no bf16 autocast: bf16 weights)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from intellect.inference.vllm_engine import VllmEngine  # noqa: PLC0415 - after vLLM's environment is set

    model, tok = build_model(ModelConfig())
    folder = save_checkpoint(model, tok, Path(tempfile.mkdtemp(prefix="vllm-validation-")) / "policy")
    compute = ComputeConfig(device="cpu", precision=args.precision)
    vllm = VllmEngine.from_folder(folder, compute, EngineConfig(kind="vllm"), capture_hidden=True)
    torch.set_num_threads(args.threads)
    engines = {"vllm": vllm, "torch": TorchEngine.from_folder(folder, compute, capture_hidden=True)}
    validator = TorchEngine.from_folder(folder, compute, capture_hidden=True)
    proofs = ToplocConfig()
    eos = [eos_id(tok)]  # what the validator stops at (intellect/rl/service/validator.py)
    checks = [length_check(CFG.max_tokens, eos), toploc_check(lambda policy: validator, CFG.sampling(), proofs, eos)]

    rows: dict[str, list] = {name: [] for name in engines}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for engine in engines.values():  # first calls warm up (vLLM's kernels, the allocator): not timed
        generate_submission(engine, tok, TASKS, "warmup", 0, 0, 0, CFG, run="bench", proofs=proofs)
    for k in range(args.submissions):
        worker, step = f"w{k % 8}", k // 8
        for name, engine in engines.items():
            start = time.perf_counter()
            got = generate_submission(engine, tok, TASKS, worker, step, 0, 0, CFG, run="bench", proofs=proofs)
            took = time.perf_counter() - start
            seconds[name] += took
            rates[name].append(sum(len(r.output_tokens) for r in got) / took)
            rows[name].append(got)

    print(f"{args.submissions} submissions x {CFG.prompts_per_submission * CFG.group_size} rollouts per engine, "
          f"max_tokens {CFG.max_tokens}, T={CFG.temperature}, {args.threads} thread(s), model "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.precision}")
    print(f"{'engine':<7} {'rollouts':>8} {'tokens':>7} {'false rejects':>13} {'tok/s median':>12} {'tok/s all':>9}  reasons")
    overall = {}
    for name in engines:
        reasons: collections.Counter[str] = collections.Counter()
        n = tokens = 0
        for sub in rows[name]:
            verdicts = [None] * len(sub)
            for check in checks:
                verdicts = [v or w for v, w in zip(verdicts, check(sub))]
            reasons.update(v for v in verdicts if v is not None)
            n += len(sub)
            tokens += sum(len(r.output_tokens) for r in sub)
        overall[name] = tokens / seconds[name]
        print(f"{name:<7} {n:>8} {tokens:>7} {sum(reasons.values()):>13} {statistics.median(rates[name]):>12.0f} "
              f"{overall[name]:>9.0f}  {dict(reasons) or '-'}")
    same = sum(a.output_tokens == b.output_tokens for sa, sb in zip(rows["vllm"], rows["torch"]) for a, b in zip(sa, sb))
    total = sum(len(s) for s in rows["vllm"])
    print(f"vLLM rollouts equal to the torch engine's, token for token: {same} / {total}")
    agree, own_rate = own_sampler(vllm, validator, [r for sub in rows["vllm"][:8] for r in sub])
    print(f"vLLM's own sampler (seeded the same, no proofs): the validator's seeded re-check confirms {agree:.1%} "
          f"of its tokens; {own_rate:.0f} tokens/s (one batch of 128)")
    print(f"tokens/s vLLM / torch: median {statistics.median(rates['vllm']) / statistics.median(rates['torch']):.2f}, "
          f"overall {overall['vllm'] / overall['torch']:.2f}")


def own_sampler(vllm, validator: TorchEngine, rows) -> tuple[float, float]:
    """The share of tokens vLLM's own seeded sampler picks (for ``rows``' prompts and seeds) that the
    validator's seeded re-check picks too, and its tokens/s."""
    from vllm import SamplingParams as VllmParams  # noqa: PLC0415  # pyright: ignore[reportMissingImports]

    sp = CFG.sampling()
    asked = [VllmParams(temperature=sp.temperature, top_p=sp.top_p, max_tokens=sp.max_tokens, seed=r.seed % (1 << 31),
                        detokenize=False) for r in rows]
    start = time.perf_counter()
    outs = vllm.llm.generate([{"prompt_token_ids": list(r.prompt_tokens)} for r in rows], asked, use_tqdm=False)
    took = time.perf_counter() - start
    requests = [Request(list(r.prompt_tokens), r.seed % (1 << 31)) for r in rows]
    claimed = [list(o.outputs[0].token_ids) for o in outs]
    scored = validator.prefill(requests, claimed, sp)
    same = sum(int((s.resampled == torch.tensor(c)).sum()) for s, c in zip(scored, claimed))
    return same / sum(len(c) for c in claimed), sum(len(c) for c in claimed) / took


if __name__ == "__main__":
    main()
