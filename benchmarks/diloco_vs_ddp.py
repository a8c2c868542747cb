"""Quality: DiLoCo (W workers, H inner steps, int8 all-reduce) vs DDP on the same tokens.

DiLoCo runs as real worker processes (``Coordinator`` + ``worker_launcher``) and
publishes an outer checkpoint after every outer step; each is evaluated after
the run (held-out loss and greedy accuracy on 512 held-out problems), so wall
times (process start to training done) leave evaluation out. DDP (``ddp_baseline.py``) then trains the same
model from the same init with global batch W*B on exactly the same sequences
(rank r = DiLoCo worker r's shard stream) for T*H steps, evaluated every H
steps. The two runs go one after the other, never concurrently. Pass: final
DiLoCo loss within 3% of DDP's.

    .venv/bin/python benchmarks/diloco_vs_ddp.py [--outer-steps 60 --batch-size 32] [section.field=value ...]

Positional overrides apply to both runs; ``--diloco KEY=VALUE`` only to DiLoCo
(its knobs: outer lr/momentum, inner lr); ``--reuse-ddp`` skips the DDP run when
the JSON already holds one with the same DDP config. Writes
``benchmarks/results/diloco_vs_ddp.{png,json}`` (``--out``).

Both arms need their own lr: a positional ``train.lr=`` sets DDP's (and DiLoCo's unless
``--diloco train.lr=`` overrides it). Check DDP's before trusting a ratio: a ratio against a
DDP lr that ends far above DDP's best flatters DiLoCo. A worker steps on B sequences where a DDP
step sees W*B, so its inner AdamW wants a lower lr than DDP's (the square-root batch rule for Adam
suggests DDP's / sqrt(W)). The run behind ``docs/diloco_vs_ddp.png`` (its figures and the knobs
tried are in ``benchmarks/results/``)::

    .venv/bin/python benchmarks/diloco_vs_ddp.py --outer-steps 90 --timeout 3600 \
        train.lr=1.5e-3 train.min_lr_ratio=0.0 \
        --diloco diloco.outer_lr=1.0 --diloco diloco.outer_momentum=0.0 --diloco diloco.nesterov=false \
        --diloco train.lr=5e-4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddp_baseline import EVAL_SIZE, run_ddp  # noqa: E402

from intellect.config import load_config  # noqa: E402
from intellect.diloco.config import DilocoConfig, DilocoRunConfig  # noqa: E402
from intellect.data.arithmetic import heldout_problems  # noqa: E402
from intellect.diloco.coordinator import Coordinator, worker_launcher  # noqa: E402
from intellect.model.checkpoint import build_model  # noqa: E402
from intellect.checkpoints import fetch  # noqa: E402
from intellect.storage import RunStorage  # noqa: E402
from intellect.train import evaluate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.03


def run_diloco(run: DilocoRunConfig, log_dir: Path, timeout: float) -> dict:
    c = Coordinator(run, worker_launcher(log_dir), env={"OMP_NUM_THREADS": "1"})
    try:
        t0 = time.perf_counter()
        c.start()
        codes = c.watch(timeout=timeout)
        seconds = time.perf_counter() - t0
        if any(code != 0 for code in codes.values()):
            tails = "".join(f"--- {p.name}\n" + "".join(p.read_text().splitlines(True)[-15:])
                            for p in sorted(log_dir.glob("*.log")))
            raise RuntimeError(f"DiLoCo workers exited {codes}:\n{tails}")
        metrics = [c.metrics(t) for t in range(run.diloco.outer_steps)]
    finally:
        c.close()
    storage = RunStorage.from_config(run.storage, run.run_name)
    tasks = heldout_problems(run.data, EVAL_SIZE)
    loss, acc = [], []
    for n in range(run.diloco.outer_steps + 1):
        r = evaluate(*fetch(storage, n), tasks)
        loss.append(r.loss)
        acc.append(r.accuracy)
    per_step = [sum(m["bytes_sent"] for m in ms) / len(ms) for ms in metrics]
    return {"loss": loss, "accuracy": acc, "seconds": seconds,
            "bytes_per_worker_per_outer_step": sum(per_step) / len(per_step),
            "bytes_total": sum(m["bytes_sent"] for ms in metrics for m in ms),
            "inner_seconds": sum(m["inner_seconds"] for ms in metrics for m in ms) / run.diloco.workers,
            "allreduce_seconds": sum(m["allreduce_seconds"] for ms in metrics for m in ms) / run.diloco.workers}


def plot(path: Path, tokens: list[int], d: dict, b: dict, title: str) -> str:
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency, only for the plot
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional dependency; after matplotlib.use("Agg")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = [t / 1e6 for t in tokens]
    ax.plot(x, b["loss"], "o-", ms=3, label="DDP (fp32 grads every step)")
    ax.plot(x, d["loss"], "s-", ms=3, label="DiLoCo (int8 pseudo-grads every H steps)")
    ax.set(xlabel="training tokens (millions, all workers)", ylabel=f"held-out loss ({EVAL_SIZE} problems)",
           ylim=(min(d["loss"] + b["loss"]) * 0.97, b["loss"][1] * 1.15))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="B, sequences per worker per inner step")
    ap.add_argument("--inner-steps", type=int, default=50, help="H")
    ap.add_argument("--outer-steps", type=int, default=90, help="T (T*H steps in all, both arms)")
    ap.add_argument("--diloco", action="append", default=[], metavar="KEY=VALUE",
                    help="override for the DiLoCo run only (e.g. diloco.outer_lr=1.0, train.lr=2e-3)")
    ap.add_argument("--reuse-ddp", action="store_true",
                    help="take the DDP curve from --out's JSON when its DDP config is this one (tuning DiLoCo)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds the DiLoCo run may take")
    ap.add_argument("--out", type=Path, default=RESULTS / "diloco_vs_ddp")
    ap.add_argument("overrides", nargs="*", help="section.field=value overrides for both runs")
    a = ap.parse_args()
    W, B, H, T = a.workers, a.batch_size, a.inner_steps, a.outer_steps
    out_json = a.out.with_suffix(".json")

    with tempfile.TemporaryDirectory(prefix="intellect-quality-") as tmp:
        base = ["run_name=quality", f"storage.url=file://{tmp}/runs", "storage.keep_last=100000",
                "data.max_digits=2", f"diloco.workers={W}", f"train.batch_size={B}", f"diloco.inner_steps={H}",
                f"diloco.outer_steps={T}", "diloco.checkpoint_every=1", *a.overrides]
        ddp_run = load_config(DilocoRunConfig, environ={}, overrides=base)
        run = load_config(DilocoRunConfig, environ={}, overrides=base + a.diloco)
        ddp_cfg = ddp_run.model_dump(mode="json", exclude={"storage": True, "run_name": True, "diloco": {
            k for k in DilocoConfig.model_fields if k not in ("workers", "inner_steps", "outer_steps", "data_split")}})
        P = sum(p.numel() for p in build_model(run.model)[0].parameters())
        print(f"tiny model P={P}; W={W} B={B} H={H} T={T} ({T * H} steps, global batch {W * B}); "
              f"DiLoCo: outer lr {run.diloco.outer_lr}, momentum {run.diloco.outer_momentum}, "
              f"inner lr {run.train.lr}, {run.diloco.algorithm}; DDP lr {ddp_run.train.lr}", flush=True)
        d = run_diloco(run, Path(tmp) / "logs", a.timeout)
        print(f"DiLoCo done in {d['seconds']:.0f} s", flush=True)
    old = json.loads(out_json.read_text()) if a.reuse_ddp and out_json.exists() else {}
    if old.get("ddp_config") == ddp_cfg:
        b = old["ddp"]
        print(f"DDP curve reused from {out_json}\n")
    else:
        b = run_ddp(ddp_run)
        print(f"DDP done in {b['seconds_with_startup']:.0f} s\n", flush=True)

    tokens = b["tokens"]  # identical sequences on both sides, so identical token counts
    print(f"{'outer':>5}{'step':>6}{'tokens':>10}{'DiLoCo':>9}{'DDP':>9}{'ratio':>8}{'acc D':>8}{'acc DDP':>8}")
    for t in range(T + 1):
        print(f"{t:>5}{t * H:>6}{tokens[t]:>10}{d['loss'][t]:>9.4f}{b['loss'][t]:>9.4f}"
              f"{d['loss'][t] / b['loss'][t]:>8.4f}{d['accuracy'][t]:>8.3f}{b['accuracy'][t]:>8.3f}")
    ratio = d["loss"][-1] / b["loss"][-1]
    ok = ratio <= 1 + TOLERANCE
    ddp_bytes = 2 * (W - 1) / W * 4 * P * H  # ring all-reduce of fp32 grads, per worker, H steps
    print(f"\nfinal held-out loss: DiLoCo {d['loss'][-1]:.4f}, DDP {b['loss'][-1]:.4f}, ratio {ratio:.4f} "
          f"-> {'PASS' if ok else 'FAIL'} (within {TOLERANCE:.0%})")
    print(f"final greedy accuracy: DiLoCo {d['accuracy'][-1]:.3f}, DDP {b['accuracy'][-1]:.3f}")
    print(f"wall, process start to training done (no eval): DiLoCo {d['seconds']:.0f} s, "
          f"DDP {b['seconds_with_startup']:.0f} s")
    print(f"  DiLoCo per worker: inner {d['inner_seconds']:.0f} s, all-reduce {d['allreduce_seconds']:.1f} s; "
          f"DDP training loop {b['seconds']:.0f} s (compute + fp32 all-reduce every step)")
    print(f"wire bytes per worker per outer step: DiLoCo {d['bytes_per_worker_per_outer_step']:.0f}, "
          f"DDP (ring formula) {ddp_bytes:.0f} ({ddp_bytes / d['bytes_per_worker_per_outer_step']:.0f}x); "
          f"DiLoCo total {d['bytes_total']} B")

    a.out.parent.mkdir(parents=True, exist_ok=True)
    title = (f"DiLoCo W={W} H={H} int8 vs DDP, global batch {W * B}, {T * H} steps\n"
             f"DiLoCo outer lr {run.diloco.outer_lr} mom {run.diloco.outer_momentum}, inner lr {run.train.lr}; "
             f"DDP lr {ddp_run.train.lr}: final loss ratio {ratio:.3f}")
    print("plot:", plot(a.out.with_suffix(".png"), tokens, d, b, title))
    out_json.write_text(json.dumps({
        "config": run.model_dump(mode="json", exclude={"storage"}), "ddp_config": ddp_cfg, "params": P,
        "tokens": tokens, "steps": [t * H for t in range(T + 1)], "diloco": d, "ddp": b, "final_ratio": ratio,
        "tolerance": TOLERANCE, "pass": ok, "ddp_bytes_per_worker_per_outer_step": ddp_bytes}, indent=1))
    print("numbers:", out_json)


if __name__ == "__main__":
    main()
