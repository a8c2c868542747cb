"""The GRPO trainer over M = 1, 2, 4 ranks (``trainer.ranks``): memory per rank and step time, side by side.

Each M runs in a fresh process, rank 0 of the trainer as an RL run starts it
(:class:`intellect.rl.trainer.ranks.ShardedTrainer`: its followers are real processes, gloo on the
CPU, NCCL on GPUs); M = 1 is the one-process trainer (no FSDP), the one a run of ``trainer.ranks = 1``
uses. Every M trains the same synthetic samples (random tokens and advantages) from the same
checkpoint of ``--preset``, ``--steps`` timed RL steps after one untimed. Per rank:

- **tensors**: the bytes of the rank's local parameters and AdamW state (``exp_avg``, ``exp_avg_sq``,
  ``step``) after the last step, counted from the tensors (a gradient, alive within a step, is as
  large as its parameter); FSDP2's dim-0 shards are uneven, so rank 0 holds a little more than 1/M;
- **peak in training**: on a GPU ``torch.cuda.max_memory_allocated`` over the timed steps; on the CPU
  ``VmHWM`` after them minus ``VmRSS`` before them (the high-water mark reset there), with glibc's mmap
  threshold fixed as :mod:`benchmarks.fsdp_memory` explains;
- **step time**: the median of the timed RL steps, as rank 0 sees it.

The rank shown is the one with the largest figure. The ranks share the machine's cores (``--threads``
per rank; 0: the cores divided by M).

    .venv/bin/python benchmarks/trainer_scale.py                          # llama-20m, M = 1, 2, 4
    .venv/bin/python benchmarks/trainer_scale.py --preset llama-150m --ranks 1 2

Writes ``benchmarks/results/trainer_scale.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.proc_memory import reset_peak, status_kb  # noqa: E402
from intellect.checkpoints import fetch, publish  # noqa: E402
from intellect.config import ComputeConfig, ModelConfig, StorageConfig  # noqa: E402
from intellect.model.checkpoint import build_model  # noqa: E402
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig, Sample  # noqa: E402
from intellect.rl.trainer.ranks import ShardedTrainer, TrainerSpec  # noqa: E402
from intellect.storage import RunStorage  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RUN = "scale"
MB = 1024 * 1024


def samples(n: int, prompt: int, output: int, vocab: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(4, vocab, (prompt,), generator=g).tolist(),
                   torch.randint(4, vocab, (output,), generator=g).tolist(), float(torch.randn(1, generator=g)))
            for _ in range(n)]


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t  # this rank's shard
    return t.numel() * t.element_size()


def start_peak(trainer: GRPOTrainer) -> int:
    """Reset this rank's peak; its base (bytes)."""
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
        torch.cuda.reset_peak_memory_stats(trainer.device)
        return torch.cuda.memory_allocated(trainer.device)
    return reset_peak() * 1024


def rank_memory(trainer: GRPOTrainer) -> dict:
    """This rank's tensors and peak since :func:`start_peak` (bytes)."""
    params = sum(_local_bytes(p) for p in trainer.model.parameters())
    optim = sum(_local_bytes(v) for st in trainer.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    if trainer.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(trainer.device)
    else:
        peak = status_kb("VmHWM") * 1024
    return {"params": params, "optimizer": optim, "peak": peak}


def child(args: argparse.Namespace) -> None:
    """One M: rank 0 of the trainer; prints its figures as one JSON line."""
    ranks, threads = args.child, args.threads or max(1, (os.cpu_count() or 1) // args.child)
    torch.set_num_threads(threads)
    cfg = RLTrainerConfig(lr=1e-5, warmup_steps=0, steps_per_rollout=args.mini_steps,
                          micro_batch_tokens=args.micro_batch_tokens, ranks=ranks)
    compute = ComputeConfig(device=args.device, precision=args.precision)
    if ranks == 1:
        model, tok = fetch(RunStorage.from_config(StorageConfig(url=args.storage), RUN), 0)
        trainer = GRPOTrainer(model, tok, cfg, compute=compute)
        run = None
    else:
        run = ShardedTrainer.start(TrainerSpec(run_name=RUN, storage=StorageConfig(url=args.storage), trainer=cfg,
                                               compute=compute, checkpoint=0, threads=threads))
        trainer = run.trainer
    # by their module's name, which the followers import (this file runs as __main__)
    from benchmarks.trainer_scale import rank_memory as mem_fn, start_peak as peak_fn  # noqa: PLC0415
    vocab = int(getattr(trainer.model, "config").vocab_size)
    batch = [samples(args.samples, args.prompt, args.output, vocab, seed) for seed in range(args.steps + 1)]
    try:
        step = run.train_step if run is not None else trainer.train_step
        step(batch[0])  # untimed: AdamW's state allocated, allocator warm
        bases = run.on_ranks(peak_fn) if run is not None else [peak_fn(trainer)]
        seconds = []
        for b in batch[1:]:
            t0 = time.perf_counter()
            step(b)
            seconds.append(time.perf_counter() - t0)
        mem = run.on_ranks(mem_fn) if run is not None else [mem_fn(trainer)]
    finally:
        if run is not None:
            run.close()
    for m, base in zip(mem, bases):
        m["peak"] -= base
    print(json.dumps({"ranks": ranks, "threads": threads, "step_seconds": seconds, "per_rank": mem}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--preset", default="llama-20m")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--samples", type=int, default=16, help="samples per RL step")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=96)
    ap.add_argument("--mini-steps", type=int, default=2, help="optimizer steps per RL step")
    ap.add_argument("--micro-batch-tokens", type=int, default=256, help="tokens per forward/backward row")
    ap.add_argument("--steps", type=int, default=3, help="timed RL steps per M")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: the cores / M)")
    ap.add_argument("--out", type=Path, default=RESULTS / "trainer_scale.json")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--storage", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MB))}
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainer-scale-") as tmp:
        storage_url = f"file://{tmp}"
        model, tok = build_model(ModelConfig(preset=args.preset))
        publish(model, tok, RunStorage.from_config(StorageConfig(url=storage_url), RUN), 0)
        n_params = sum(p.numel() for p in model.parameters())
        del model
        for m in args.ranks:
            cmd = [sys.executable, __file__, "--child", str(m), "--storage", storage_url,
                   *[a for a in sys.argv[1:] if a != "--child"]]
            out = subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{args.preset} ({n_params / 1e6:.1f}M parameters), {args.device} {args.precision}, "
          f"{args.samples} samples x {args.prompt}+{args.output} tokens, {args.mini_steps} optimizer steps per RL step")
    print(f"{'M':>2} {'params MiB':>11} {'AdamW MiB':>10} {'peak MiB':>9} {'step s (median)':>16}")
    rows.sort(key=lambda r: r["ranks"])
    one = rows[0]  # the ratio's base: the fewest ranks measured
    base = {k: v * one["ranks"] for k, v in max(one["per_rank"], key=lambda x: x["params"]).items()}
    for r in rows:
        big = max(r["per_rank"], key=lambda x: x["params"] + x["optimizer"])
        peak = max(x["peak"] for x in r["per_rank"])
        r["median_step_seconds"] = statistics.median(r["step_seconds"])
        print(f"{r['ranks']:>2} {big['params'] / MB:>11.1f} {big['optimizer'] / MB:>10.1f} {peak / MB:>9.1f} "
              f"{r['median_step_seconds']:>16.2f}   (tensors x M / fewest ranks': "
              f"{(big['params'] + big['optimizer']) * r['ranks'] / (base['params'] + base['optimizer']):.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"preset": args.preset, "parameters": n_params, "device": args.device,
                                    "precision": args.precision, "samples": args.samples, "prompt": args.prompt,
                                    "output": args.output, "date": datetime.date.today().isoformat(),
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
