"""Does GRPO raise held-out greedy accuracy of a pretrained tiny model on arithmetic?

Pretrains the model of ``--pretrain-config`` (default ``configs/smoke-slips.toml``: the smoke
model on a corpus where 60% of the answers carry a sign error) or reuses a checkpoint folder
(``--from``), copies it as checkpoint 0 of a fresh RL run, then loops
:func:`intellect.rl.trainer.local_step.run_rl_step` (2 workers, async level 0) on a pool of non-held-out 1-2 digit
problems until a time budget runs out, evaluating held-out greedy exact-match accuracy of the
published checkpoints every few steps. The pretraining is not part of the budget.

    .venv/bin/python benchmarks/rl_learning.py --from runs/smoke-slips/checkpoints/step_3000 --minutes 12

``--inference-dtype bf16`` publishes bf16 checkpoints (the trainer's masters stay fp32), so the same seed
runs with the inference weights in either precision. ``--min-signal-samples N`` turns on the online filter (``online_filter``: a step trains once it holds N
validated samples with signal, asking the workers for more in up to ``--max-rounds`` rounds), so the same
seed runs with and without it. Each step and evaluation records the FLOPs spent so far, estimated from
the ledger's token counts with N parameters: 2N per generated token (prompt and completion, every sample
generated) plus 8N per token trained on (a forward and backward, 6N, and the old log-probs' forward, 2N).

Writes ``benchmarks/results/rl_learning.{json,png}`` (``--tag`` changes the name).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.config import DataConfig, SmokeConfig, load_config  # noqa: E402
from intellect.data.arithmetic import heldout_problems, train_stream  # noqa: E402
from intellect.ledger import Ledger  # noqa: E402
from intellect.model.checkpoint import load_checkpoint  # noqa: E402
from intellect.checkpoints import fetch, publish, record  # noqa: E402
from intellect.pretrain import init_checkpoint, pretrain  # noqa: E402
from intellect.rl.trainer.loss import GRPOLossConfig  # noqa: E402
from intellect.rl.config import OnlineFilterConfig, RLRunConfig, WorkersConfig  # noqa: E402
from intellect.rl.trainer.local_step import run_rl_step  # noqa: E402
from intellect.rl.trainer.step import signal_rows  # noqa: E402
from intellect.rl.worker.submission import SubmissionConfig  # noqa: E402
from intellect.rl.trainer.grpo import GRPOTrainer, RLTrainerConfig  # noqa: E402
from intellect.storage import RunStorage  # noqa: E402
from intellect.train import evaluate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKERS = ("worker-a", "worker-b")


def pretrained_model(args):
    """(model, tokenizer, note) of the starting checkpoint: ``--from`` or a fresh pretrain."""
    if args.from_dir:
        model, tok = load_checkpoint(Path(args.from_dir))
        for p in model.parameters():
            p.data = p.data.clone()
        return model, tok, f"reused {args.from_dir}"
    cfg = load_config(SmokeConfig, Path(args.pretrain_config))
    storage = RunStorage(f"file://{RESULTS / 'rl_learning_pretrain' / cfg.run_name}")
    init_checkpoint(cfg, storage)
    t0 = time.perf_counter()
    out = pretrain(cfg, storage, 0)
    print(f"pretrained {cfg.run_name}: {cfg.train.steps} steps in {time.perf_counter() - t0:.0f} s "
          f"(loss {out.first_loss:.3f} -> {out.final_loss:.3f}, resumed={out.resumed})", flush=True)
    model, tok = fetch(storage, out.step)
    return model, tok, f"pretrained {args.pretrain_config} step {out.step} ({out.seconds:.0f} s)"


def task_pool(n: int, seed: int):
    data = DataConfig(max_digits=2)
    seen, stream = {}, train_stream(data, seed=seed)
    while len(seen) < n:
        p = next(stream)
        seen.setdefault(p.id, p.to_task())
    return list(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="from_dir", default=None, help="HF checkpoint folder to start from.")
    ap.add_argument("--pretrain-config", default=str(ROOT / "configs" / "smoke-slips.toml"),
                    help="Smoke config to pretrain the starting model with when --from is not given.")
    ap.add_argument("--minutes", type=float, default=12.0, help="Time budget of the RL loop (evals included).")
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool", type=int, default=2000, help="Training prompts (non-held-out).")
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps-per-rollout", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048, help="Tokens per forward/backward (packed).")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4, help="Prompts per submission (per worker).")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--normalization", default=None, choices=["constant", "token", "sequence"])
    ap.add_argument("--min-signal-samples", type=int, default=0,
                    help="Online filter: validated samples with signal a step waits for (0: off).")
    ap.add_argument("--max-rounds", type=int, default=4, help="Online filter: most rounds of assignment per step.")
    ap.add_argument("--inference-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="trainer.inference_dtype: the weights the trainer publishes, which generation and "
                    "evaluation load (bf16: its fp32 masters rounded).")
    ap.add_argument("--tag", default="rl_learning")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok, origin = pretrained_model(args)

    run_dir = RESULTS / "rl_runs" / args.tag
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    storage = RunStorage(f"file://{run_dir / 'storage'}")
    loss_kw = {"normalization": args.normalization} if args.normalization else {}
    cfg = RLRunConfig(
        run_name=args.tag.replace("/", "-")[:64],
        async_level=0,
        toploc=None, trusted_workers=True,  # one process plays every role: the learning figure, not the checks
        submission=SubmissionConfig(prompts_per_submission=args.prompts, group_size=args.group_size,
                                    temperature=args.temperature, max_tokens=args.max_tokens),
        trainer=RLTrainerConfig(lr=args.lr, warmup_steps=args.warmup, steps_per_rollout=args.steps_per_rollout,
                                micro_batch_tokens=args.micro_batch_tokens, temperature=max(args.temperature, 1e-3),
                                loss=GRPOLossConfig(**loss_kw), inference_dtype=args.inference_dtype),
        online_filter=OnlineFilterConfig(min_signal_samples=args.min_signal_samples, max_rounds=args.max_rounds),
        workers=WorkersConfig(names=list(WORKERS), max_submissions=args.max_rounds + 1),
    )
    publish(model.eval(), tok, storage, 0, dtype=cfg.trainer.published_dtype)
    ledger = Ledger(run_dir / "ledger.duckdb")
    # readers adopt only checkpoints whose digest the ledger holds
    record(storage, ledger, 0)
    tasks = task_pool(args.pool, seed=1234)
    heldout = heldout_problems(DataConfig(max_digits=2), args.eval_n)
    held_ids = {p.id for p in heldout}
    assert not held_ids & {t.id for t in tasks}, "training pool overlaps the held-out set"

    def accuracy(step: int) -> float:
        m, t = fetch(storage, step)
        return evaluate(m.float(), t, heldout).accuracy  # a bf16 checkpoint upcast, as the fp32 workers run it

    t_start = time.perf_counter()
    acc0 = accuracy(0)
    print(f"start: {origin}; held-out greedy accuracy {acc0:.3f} (n={len(heldout)})", flush=True)
    print(f"config: {cfg.submission.model_dump()} trainer lr={args.lr} spr={args.steps_per_rollout} "
          f"warmup={args.warmup} loss={cfg.trainer.loss.model_dump()}", flush=True)
    trainer = GRPOTrainer(model, tok, cfg.trainer)  # kept across steps: holds checkpoint `step` and its optimizer
    params = sum(p.numel() for p in model.parameters())
    flops = 0.0
    rows, evals = [], [{"step": 0, "accuracy": acc0, "elapsed": 0.0, "flops": 0.0}]
    budget = args.minutes * 60
    print(f"{'step':>4} {'sec':>6} {'reward':>7} {'acc':>4} {'train':>5} {'loss':>8} {'heldout':>8} {'elapsed':>7}",
          flush=True)
    step = 0
    while step < args.max_steps and time.perf_counter() - t_start < budget:
        t0 = time.perf_counter()
        rep = run_rl_step(cfg, storage, ledger, step, WORKERS, tasks, trainer=trainer)
        secs = time.perf_counter() - t0
        acc_rows = ledger.accepted(step)
        reward = statistics.fmean(r["reward"] for r in acc_rows) if acc_rows else float("nan")
        gen_tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in acc_rows)
        train_tokens = sum(r["prompt_tokens"] + r["output_tokens"] for r in signal_rows(acc_rows))
        flops += 2 * params * gen_tokens + 8 * params * train_tokens
        row = {"step": step, "seconds": secs, "mean_reward": reward, "accepted": rep.accepted,
               "rejected": rep.rejected, "trained_samples": rep.trained_samples, "loss": rep.loss,
               "timings": rep.timings, "heldout_accuracy": None, "flops": flops,
               "filter": rep.filter.model_dump() if rep.filter else None}
        step += 1
        elapsed = time.perf_counter() - t_start
        if step % args.eval_every == 0 or elapsed >= budget or step >= args.max_steps:
            acc = accuracy(step)
            row["heldout_accuracy"] = acc
            evals.append({"step": step, "accuracy": acc, "elapsed": time.perf_counter() - t_start, "flops": flops})
        rows.append(row)
        loss = "" if rep.loss is None else f"{rep.loss:8.4f}"
        held = "" if row["heldout_accuracy"] is None else f"{row['heldout_accuracy']:.3f}"
        print(f"{row['step']:>4} {secs:6.2f} {reward:7.3f} {rep.accepted:>4} {rep.trained_samples:>5} "
              f"{loss:>8} {held:>8} {time.perf_counter() - t_start:7.0f}", flush=True)
    ledger.close()

    if evals[-1]["step"] != step:
        evals.append({"step": step, "accuracy": accuracy(step), "elapsed": time.perf_counter() - t_start,
                      "flops": flops})
    best = max(evals, key=lambda e: e["accuracy"])
    total = time.perf_counter() - t_start
    print(f"\nheld-out greedy accuracy: before {acc0:.3f} -> after {evals[-1]['accuracy']:.3f} "
          f"({step} RL steps, {total:.0f} s); best {best['accuracy']:.3f} at step {best['step']}; "
          f"delta {100 * (evals[-1]['accuracy'] - acc0):+.1f} points", flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "origin": origin, "config": cfg.model_dump(), "threads": torch.get_num_threads(),
           "pool": len(tasks), "heldout_n": len(heldout), "before": acc0, "after": evals[-1]["accuracy"],
           "best": best, "rl_steps": step, "seconds": total, "params": params, "flops": flops, "steps": rows,
           "evals": evals}
    (RESULTS / f"{args.tag}.json").write_text(json.dumps(out, indent=1))
    if not args.no_plot:
        import matplotlib  # noqa: PLC0415 - heavy, plotting only (--no-plot skips it)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use("Agg")

        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        ax[0].plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-")
        ax[0].axhline(acc0 + 0.2, ls="--", c="gray", label="+20 points")
        ax[0].set(xlabel="RL step", ylabel="held-out greedy accuracy", title="held-out accuracy")
        ax[0].legend()
        ax[1].plot([r["step"] for r in rows], [r["mean_reward"] for r in rows], ".-")
        ax[1].set(xlabel="RL step", ylabel="mean sampled reward", title=f"T={args.temperature}")
        fig.suptitle(f"GRPO on tiny model: lr={args.lr}, spr={args.steps_per_rollout}, G={args.group_size}, "
                     f"prompts/worker={args.prompts}")
        fig.tight_layout()
        fig.savefig(RESULTS / f"{args.tag}.png", dpi=100)
    print(f"wrote {RESULTS / (args.tag + '.json')}", flush=True)


if __name__ == "__main__":
    main()
