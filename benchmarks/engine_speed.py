"""Generation speed of the torch inference engine against two peers, on the tiny model.

Peers: ``intellect.model.generate.generate`` (our plain batched KV-cache loop,
one generator for the batch) and transformers' ``model.generate``. All three
run the same left-padded prompts in one batch and generate exactly
``--new-tokens`` per prompt (EOS disabled), greedy and sampled (T=1, no
top-k/top-p). The engine is also timed without hidden-state capture (the
cost of capture) and with top-p 0.9 (the cost of the sort). Prints medians of
``--repeats`` runs (and the best, steadier on a shared machine) in generated
tokens/s, and ratios to the engine.

    python benchmarks/engine_speed.py --repeats 5 [--threads 1 --clock cpu]

``--engine vllm`` (in the vLLM environment, ``make venv-vllm``) runs the vLLM engine and the torch engine
side by side instead, both built by ``make_engine`` from one checkpoint folder, at T=1 with TOPLOC's
hidden-state capture on (what a worker runs): generated tokens/s (EOS off), time to first token (the
whole batch's, one new token each), in-place weight-update time (two checkpoints in turns), and the
useful-token share (returned tokens per row-step, EOS on, so rows end at different lengths)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/engine_speed.py --engine vllm --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from intellect.config import DataConfig, ModelConfig
from intellect.data.arithmetic import heldout_problems
from intellect.inference import Request, SamplingParams, TorchEngine
from intellect.model.checkpoint import build_model
from intellect.model.generate import generate, left_pad


def runners(model, tok, prompts: list[list[int]], new: int) -> dict[tuple[str, str], Callable[[], int]]:
    """(mode, name) -> a function that generates and returns the number of new tokens."""
    reqs = [Request(p, seed=i) for i, p in enumerate(prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=new, stop_at_eos=False)
    hot = SamplingParams(temperature=1.0, max_tokens=new, stop_at_eos=False)
    nucleus = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=new, stop_at_eos=False)
    capture = TorchEngine.for_tokenizer(model, tok, max_batch_size=len(prompts))
    plain = TorchEngine.for_tokenizer(model, tok, max_batch_size=len(prompts), capture_hidden=False)
    padded, mask = left_pad(prompts, tok.pad_token_id)

    def engine(e, sp):
        return lambda: sum(len(c.tokens) for c in e.generate(reqs, sp))

    def baseline(temperature):
        def run():
            gens = generate(model, prompts, max_new_tokens=new, eos_id=-1, pad_id=tok.pad_token_id,
                            temperature=temperature, generator=torch.Generator().manual_seed(0))
            return sum(len(g.tokens) for g in gens)
        return run

    def hf(do_sample):
        def run():
            with torch.no_grad():
                out = model.generate(
                    input_ids=padded, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                    do_sample=do_sample, temperature=1.0, top_k=None, top_p=1.0, pad_token_id=tok.pad_token_id,
                )
            return (out.shape[1] - padded.shape[1]) * len(prompts)
        return run

    return {
        ("greedy", "engine (capture)"): engine(capture, greedy),
        ("greedy", "engine (no capture)"): engine(plain, greedy),
        ("greedy", "intellect generate"): baseline(0.0),
        ("greedy", "transformers .generate"): hf(False),
        ("sampled", "engine (capture)"): engine(capture, hot),
        ("sampled", "engine (no capture)"): engine(plain, hot),
        ("sampled", "engine top_p=0.9 (capture)"): engine(capture, nucleus),
        ("sampled", "intellect generate"): baseline(1.0),
        ("sampled", "transformers .generate"): hf(True),
    }


def side_by_side(args, clock) -> None:
    """``--engine vllm``: the vLLM and torch engines on the same checkpoint and prompts, interleaved."""
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from intellect.config import ComputeConfig  # noqa: PLC0415
    from intellect.inference.config import EngineConfig  # noqa: PLC0415
    from intellect.inference.engines import make_engine  # noqa: PLC0415
    from intellect.model.checkpoint import save_checkpoint  # noqa: PLC0415

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tmp = Path(tempfile.mkdtemp(prefix="engine-speed-"))
    folders = []
    for seed in (0, 1):
        model, tok = build_model(ModelConfig(init_seed=seed))
        folders.append(save_checkpoint(model, tok, tmp / f"ckpt{seed}"))
    tok = build_model(ModelConfig())[1]
    prompts = [tok(p.prompt)["input_ids"] for p in heldout_problems(DataConfig(), args.prompts)]
    reqs = [Request(p, seed=i) for i, p in enumerate(prompts)]
    compute = ComputeConfig(device=args.device, precision="fp32" if args.device == "cpu" else "bf16")
    engines = {kind: make_engine(kind, folders[0], compute, EngineConfig(kind=kind, max_batch_size=len(prompts)),
                                 capture_hidden=True) for kind in ("torch", "vllm")}
    hot = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, stop_at_eos=False)
    first = SamplingParams(temperature=1.0, max_tokens=1, stop_at_eos=False)
    eos_on = SamplingParams(temperature=1.0, max_tokens=args.new_tokens)
    figures: dict[tuple[str, str], list[float]] = {}
    useful: dict[str, float] = {}
    for kind, e in engines.items():  # warm-up, and the useful-token share of one EOS-on call
        e.generate(reqs, hot)
        e.stats.reset()
        e.generate(reqs, eos_on)
        useful[kind] = e.stats.useful_share
    for r in range(args.repeats):  # interleaved so load drift hits both alike
        for kind, e in engines.items():
            t0 = clock()
            n = sum(len(c.tokens) for c in e.generate(reqs, hot))
            figures.setdefault((kind, "tokens/s"), []).append(n / (clock() - t0))
            t0 = clock()
            e.generate(reqs, first)
            figures.setdefault((kind, "first token s"), []).append(clock() - t0)
            t0 = clock()
            e.update_weights(folders[(r + 1) % 2])
            figures.setdefault((kind, "weight update s"), []).append(clock() - t0)
    print(f"tiny model on {args.device} ({compute.precision}), {args.prompts} prompts x {args.new_tokens} new tokens, "
          "hidden states captured; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.clock} clock, median of {args.repeats}")
    for what in ("tokens/s", "first token s", "weight update s"):
        med = {kind: statistics.median(figures[kind, what]) for kind in engines}
        print(f"  {what:16} torch {med['torch']:10,.4g}  vllm {med['vllm']:10,.4g}  vllm/torch x{med['vllm'] / med['torch']:.2f}")
    print(f"  {'useful share':16} torch {useful['torch']:10.3f}  vllm {useful['vllm']:10.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: tokens per CPU-second of this process, steady on a shared machine with --threads 1")
    ap.add_argument("--engine", choices=["torch", "vllm"], default="torch",
                    help="vllm: the vLLM engine against the torch engine (run it with .venv-vllm/bin/python)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--engine vllm: where both engines run "
                    "(fp32 on the CPU, bf16 on CUDA)")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine == "vllm":
        side_by_side(args, clock)
        return
    model, tok = build_model(ModelConfig())
    prompts = [tok(p.prompt)["input_ids"] for p in heldout_problems(DataConfig(), args.prompts)]
    runs = runners(model, tok, prompts, args.new_tokens)
    for run in runs.values():  # warm-up: allocator, kernels, hooks
        run()
    speeds: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):  # interleaved so load drift hits every runner alike
        for key, run in runs.items():
            t0 = clock()
            n = run()
            speeds[key].append(n / (clock() - t0))
    print(f"tiny model, {args.prompts} prompts x {args.new_tokens} new tokens, one batch; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.clock} clock, median of {args.repeats}")
    med = {key: statistics.median(v) for key, v in speeds.items()}
    for (mode, name), v in speeds.items():
        ratio = med[mode, name] / med[mode, "engine (capture)"]
        print(f"  {mode:7} {name:28} {med[mode, name]:9,.0f} tokens/s  x{ratio:4.2f} of engine  "
              f"(best {max(v):,.0f}; runs {', '.join(f'{x:,.0f}' for x in v)})")
    for mode in ("greedy", "sampled"):
        cost = med[mode, "engine (no capture)"] / med[mode, "engine (capture)"] - 1
        print(f"  capture overhead, {mode}: {100 * cost:+.1f}% time")


if __name__ == "__main__":
    main()
