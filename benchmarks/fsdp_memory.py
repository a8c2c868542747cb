"""Memory per rank of a worker sharded by FSDP2 over M = 1, 2, 4 ranks (CPU, gloo), side by side.

Each M is its own set of M spawned processes (:class:`intellect.diloco.mesh.WorkerMesh`,
:func:`intellect.parallel.parallelize`, AdamW built after sharding, a few training steps on random
tokens, the global batch split over the ranks). Per rank it reports:

- **tensors**: the bytes of the rank's local shards of the parameters, of their gradients and of
  AdamW's state (``exp_avg``, ``exp_avg_sq``, ``step``), counted from the tensors themselves after
  the last step, each beside its expectation, the M = 1 figure divided by M (FSDP2's dim-0 shards
  are uneven, so rank 0 holds a little more than 1/M);
- **RSS growth in training**: ``VmHWM`` after the steps minus ``VmRSS`` after sharding (the
  kernel's high-water mark reset there through ``/proc/self/clear_refs``): the shards' gradients
  and AdamW state, the parameters gathered for forward and backward, activations, communication
  buffers and allocator slack;
- **RSS growth at build**: ``VmHWM`` after sharding minus ``VmRSS`` before the model was built:
  every rank builds the whole fp32 model and then shards it (no meta-device initialisation yet),
  so this is a full model whatever M.

RSS follows the live tensors only if freed tensors go back to the kernel. glibc allocates a large
block with ``mmap`` (returned on free), but its threshold rises to the size of any such block freed,
up to 32 MiB, and from then on the per-block gradient and all-gather buffers FSDP frees every step
stay in the heap and in gloo's threads' arenas, so RSS measures the allocator. The ranks therefore
run with a fixed threshold (``MALLOC_MMAP_THRESHOLD_``, 1 MiB unless set); ``--default-malloc``
measures without it.

The rank shown is the one with the largest figure. Linux only. Processes share the machine's cores
(``--threads`` per rank).

    .venv/bin/python benchmarks/fsdp_memory.py                       # llama-150m, M = 1, 2, 4
    .venv/bin/python benchmarks/fsdp_memory.py --preset llama-20m    # quick

Writes ``benchmarks/results/fsdp_memory.json``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.proc_memory import reset_peak, status_kb  # noqa: E402
from intellect.config import ComputeConfig, ModelConfig  # noqa: E402
from intellect.diloco.mesh import WorkerMesh  # noqa: E402
from intellect.model.checkpoint import build_model  # noqa: E402
from intellect.parallel import parallelize  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MB = 1024 * 1024


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t  # pyright: ignore[reportAttributeAccessIssue]
    return local.numel() * local.element_size()


def _rank(rank: int, ranks: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(args.threads)
    # public torch API (torch.distributed's docs); its __init__ re-exports it from torch._C without __all__
    store = torch.distributed.TCPStore("127.0.0.1", port, ranks, rank == 0,  # pyright: ignore[reportPrivateImportUsage]
                                       timeout=datetime.timedelta(seconds=600))
    mesh = WorkerMesh.create(torch.device("cpu"), rank, ranks, store=store, timeout=600)
    gc.collect()
    before_build = reset_peak()
    model, _ = build_model(ModelConfig(preset=args.preset))
    vocab = int(model.config.vocab_size)
    model = parallelize(model.train(), mesh.fsdp_mesh, ComputeConfig(device="cpu", precision=args.precision))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gc.collect()
    build_peak = status_kb("VmHWM") - before_build
    before_train = reset_peak()
    per = args.batch // ranks
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)[rank * per:(rank + 1) * per]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients kept, so they are counted below
    train_peak = status_kb("VmHWM") - before_train
    params = list(model.parameters())
    res = {
        "rank": rank,
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params),
        "adamw": sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        "rss_train_mb": train_peak / 1024,
        "rss_build_mb": build_peak / 1024,
        "full_params": sum(p.numel() for p in params),
    }
    mesh.close()
    Path(out, f"{rank}.json").write_text(json.dumps(res))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(ranks: int, args: argparse.Namespace) -> list[dict]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, ranks, port, args, out)) for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"M={ranks}: exit codes {[p.exitcode for p in procs]}")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(ranks)]


def table(results: dict[int, list[dict]]) -> str:
    base = max(results[min(results)], key=lambda r: r["params"])
    lines = ["| M | params MB (1/M) | grads MB (1/M) | AdamW MB (1/M) | sum MB (1/M) | sum / (1/M) "
             "| RSS growth in training MB | RSS growth at build MB |", "|---|---|---|---|---|---|---|---|"]
    for m, rows in sorted(results.items()):
        r = max(rows, key=lambda x: x["params"] + x["grads"] + x["adamw"])
        scale = min(results) / m

        def cell(k):
            return f"{r[k] / MB:,.1f} ({base[k] * scale / MB:,.1f})"

        total, expect = r["params"] + r["grads"] + r["adamw"], (base["params"] + base["grads"] + base["adamw"]) * scale
        rss_train = max(x["rss_train_mb"] for x in rows)
        rss_build = max(x["rss_build_mb"] for x in rows)
        lines.append(f"| {m} | {cell('params')} | {cell('grads')} | {cell('adamw')} | {total / MB:,.1f} "
                     f"({expect / MB:,.1f}) | {total / expect:.3f} | {rss_train:,.0f} | {rss_build:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--preset", default="llama-150m")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over the ranks")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--default-malloc", action="store_true", help="glibc's dynamic mmap threshold (see above)")
    args = ap.parse_args()
    if not args.default_malloc:  # read by glibc when a rank starts: spawned ranks inherit it
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    if any(args.batch % m for m in args.ranks):
        ap.error("--batch must divide by every --ranks")
    results = {m: measure(m, args) for m in args.ranks}
    print(f"preset {args.preset}: {results[args.ranks[0]][0]['full_params'] / 1e6:,.1f} M parameters, "
          f"precision {args.precision}, {args.steps} steps of {args.batch} x {args.seq} tokens, "
          f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'dynamic')}; the largest rank")
    print(table(results))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fsdp_memory.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
