"""DDP baseline for the DiLoCo quality benchmark: W processes, torch DDP (gloo on the CPU, NCCL on CUDA).

Same model and init as a DiLoCo run (``build_model(run.model)``), on the device and in the
precision of ``run.compute`` (rank r takes GPU r of the visible ones); rank r draws its B
sequences per step from DiLoCo worker r's data: ``shard_stream(run, r)`` for the arithmetic
task, shard r of W of the corpus (``PackedStream``) for ``data.kind = "text"``, so both see
exactly the same sequences in the same order and the ranks read disjoint documents; global batch
W*B; the same AdamW hyperparameters and one warmup+cosine schedule over all
``outer_steps * inner_steps`` steps (the schedule DiLoCo's inner loop follows).
Rank 0 snapshots the weights (fp32, on the CPU) every H steps and evaluates the snapshots after
training, so the wall time is training only: held-out loss and greedy accuracy on the arithmetic
task, held-out loss (``heldout_batches``; accuracy NaN) on a corpus.

    .venv/bin/python benchmarks/ddp_baseline.py [--batch-size 32 --inner-steps 50 --outer-steps 40]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from intellect.config import load_config  # noqa: E402
from intellect.diloco.config import DilocoRunConfig  # noqa: E402
from intellect.data.arithmetic import heldout_problems  # noqa: E402
from intellect.data.text import PackedStream, heldout_batches  # noqa: E402
from intellect.device import dist_backend, prepare_model, resolve_device  # noqa: E402
from intellect.diloco.coordinator import free_port  # noqa: E402
from intellect.diloco.data import shard_stream  # noqa: E402
from intellect.diloco.worker import inner_train_config  # noqa: E402
from intellect.model.checkpoint import build_model  # noqa: E402
from intellect.train import Trainer, evaluate, heldout_loss  # noqa: E402

EVAL_SIZE = 512


def _batches(run: DilocoRunConfig, tok, rank: int, world: int):
    """Rank ``rank``'s training batches: DiLoCo worker ``rank``'s stream, or shard ``rank`` of ``world`` of the corpus."""
    size = run.train.batch_size
    stream = PackedStream(run.data, tok, shard=rank, shards=world) if run.data.kind == "text" else shard_stream(run, rank)
    return iter(lambda: stream.next_batch(size), None)


def heldout_point(model, tok, held: list | None, tasks: list | None) -> tuple[float, float]:
    """(held-out loss, greedy accuracy) of ``model``: on the text corpus's held-out batches ``held``
    (accuracy NaN: text has no answers), else on the arithmetic ``tasks``. Both arms evaluate with it."""
    if held is not None:
        return heldout_loss(model, held).loss, math.nan
    assert tasks is not None
    r = evaluate(model, tok, tasks)
    return r.loss, r.accuracy


def _rank(rank: int, world: int, port: int, run_json: str, out: str) -> None:
    run = DilocoRunConfig.model_validate_json(run_json)
    device = resolve_device(run.compute.device, rank=rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # W processes share few cores
    H, T = run.diloco.inner_steps, run.diloco.outer_steps
    dist.init_process_group(dist_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    model, tok = build_model(run.model)
    prepare_model(model, run.compute, device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    trainer = Trainer(ddp, tok, inner_train_config(run), compute=run.compute)
    batches = _batches(run, tok, rank, world)
    snap = lambda: {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in model.state_dict().items()}  # noqa: E731
    snaps, tokens, seen = [snap()], [0], 0
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(T):
        seen += sum(int(log["tokens"]) for log in trainer.train_steps(H, batches))
        n = torch.tensor([seen], dtype=torch.long, device=device)  # NCCL reduces device tensors only
        dist.all_reduce(n)
        tokens.append(int(n))
        if rank == 0:
            snaps.append(snap())
    dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        t1 = time.perf_counter()
        text = run.data.kind == "text"
        held = heldout_batches(run.data, tok) if text else None
        tasks = None if text else heldout_problems(run.data, EVAL_SIZE)
        loss, acc = [], []
        for s in snaps:
            model.load_state_dict(s)
            point = heldout_point(model, tok, held, tasks)
            loss.append(point[0])
            acc.append(point[1])
        torch.save({"step": [t * H for t in range(T + 1)], "tokens": tokens, "loss": loss, "accuracy": acc,
                    "seconds": seconds, "eval_seconds": time.perf_counter() - t1}, out)
    dist.destroy_process_group()
    # Gloo's teardown can deadlock: ~ProcessGroupGloo (run by DDP's reducer as it is freed, GIL held)
    # joins a worker thread that waits for the GIL to free a finished work's tensors. Everything is
    # saved: leave without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ddp(run: DilocoRunConfig) -> dict:
    """Train with DDP over ``run.diloco.workers`` processes; the curve at every H steps."""
    with tempfile.TemporaryDirectory(prefix="intellect-ddp-") as tmp:
        out = os.path.join(tmp, "result.pt")
        t0 = time.perf_counter()
        mp.start_processes(  # pyright: ignore[reportPrivateImportUsage]  # documented API, missing from __all__
            _rank, args=(run.diloco.workers, free_port(), run.model_dump_json(), out),
            nprocs=run.diloco.workers, join=True, start_method="spawn")
        r = torch.load(out)
        r["seconds_with_startup"] = time.perf_counter() - t0 - r["eval_seconds"]
        return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="B, sequences per rank per step")
    ap.add_argument("--inner-steps", type=int, default=50, help="H: evaluate every H steps")
    ap.add_argument("--outer-steps", type=int, default=40, help="T: T*H steps in all")
    ap.add_argument("overrides", nargs="*", help="extra section.field=value config overrides")
    a = ap.parse_args()
    run = load_config(DilocoRunConfig, environ={}, overrides=[
        "data.max_digits=2", f"diloco.workers={a.workers}", f"train.batch_size={a.batch_size}",
        f"diloco.inner_steps={a.inner_steps}", f"diloco.outer_steps={a.outer_steps}", *a.overrides])
    r = run_ddp(run)
    print(f"{'step':>6}{'tokens':>10}{'loss':>9}{'acc':>7}")
    for row in zip(r["step"], r["tokens"], r["loss"], r["accuracy"]):
        print(f"{row[0]:>6}{row[1]:>10}{row[2]:>9.4f}{row[3]:>7.3f}")
    print(f"train wall {r['seconds']:.1f} s ({r['seconds_with_startup']:.1f} s with process start)")


if __name__ == "__main__":
    main()
