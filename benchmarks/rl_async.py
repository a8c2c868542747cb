"""Asynchronous vs synchronous RL: the same ``rl-train`` flow at ``async_level`` 2 and 0.

Both runs start from the same checkpoint with the same config (prompts, samples, trainer, threads,
local worker processes); only the lag bound differs. The default fits this 2-core machine: one
inference worker process and the trainer, one thread each (as INTELLECT-2 puts inference and
training on different machines). With ``async_level = 0`` a worker waits for
checkpoint ``n`` before generating step ``n``, so generation and training alternate; with 2 the
workers generate steps ``n + 1`` and ``n + 2`` while step ``n`` trains. The runs alternate order
over ``--repeats`` rounds (the machine is shared and noisy); the speedup is the ratio of median
steps per hour of the step loop (evaluations excluded), and the final held-out greedy accuracies are compared against
their binomial standard error.

    .venv/bin/python benchmarks/rl_async.py --steps 150 --repeats 3

Writes ``benchmarks/results/rl_async.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def config(args, level: int, root: Path, tag: str):
    # heavy (torch, transformers): loaded once the arguments and the checkpoint folder are checked
    from intellect.config import load_config  # noqa: PLC0415 - heavy, see above
    from intellect.rl.config import RLRunConfig  # noqa: PLC0415 - heavy, see above

    return load_config(RLRunConfig, ROOT / "configs" / "rl-tiny.toml", [
        f"run_name={tag}", f"storage.url=file://{root}", f"init.path={Path(args.from_dir).resolve()}",
        f"steps={args.steps}", f"async_level={level}", "eval.every=0", f"eval.size={args.eval_n}",
        f"submission.prompts_per_submission={args.prompts}", f"trainer.lr={args.lr}",
        f"trainer_threads={args.trainer_threads}", f"workers.threads={args.worker_threads}",
        f"workers.names={json.dumps([f'worker-{i}' for i in range(args.workers)])}",
    ], environ={})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="from_dir", default="runs/smoke-slips/checkpoints/step_6000",
                    help="HF checkpoint folder RL starts from (run `intellect smoke --config "
                    "configs/smoke-slips.toml` first).")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="Inference worker processes.")
    ap.add_argument("--prompts", type=int, default=64, help="Prompts per worker and step (x8 samples).")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--trainer-threads", type=int, default=1)
    ap.add_argument("--worker-threads", type=int, default=1)
    args = ap.parse_args()
    if not (Path(args.from_dir) / "config.json").is_file():
        sys.exit(f"{args.from_dir} is not a checkpoint folder: run `intellect smoke --config configs/smoke-slips.toml` first")

    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="intellect-bench-prefect-"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.rl import rl_train  # noqa: PLC0415 - prefect reads the PREFECT_* settings above at import

    work = Path(tempfile.mkdtemp(prefix="intellect-rl-async-"))
    runs: dict[int, list[dict]] = {2: [], 0: []}
    try:
        for r in range(args.repeats):
            for level in ((2, 0) if r % 2 == 0 else (0, 2)):
                tag = f"a{level}-r{r}"
                t0 = time.perf_counter()
                rep = rl_train(config(args, level, work, tag))
                acc = rep.evals[-1]["accuracy"]
                runs[level].append({"steps_per_hour": rep.steps_per_hour, "loop_seconds": rep.seconds,
                                    "total_seconds": time.perf_counter() - t0, "final_accuracy": acc,
                                    "accuracy_at_0": rep.evals[0]["accuracy"]})
                print(f"round {r} async_level={level}: {rep.steps} steps in {rep.seconds:.1f} s "
                      f"({rep.steps_per_hour:.0f} steps/h), final held-out accuracy {acc:.3f}", flush=True)
                shutil.rmtree(work / tag, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {lv: statistics.median(x["steps_per_hour"] for x in rs) for lv, rs in runs.items()}
    acc = {lv: statistics.mean(x["final_accuracy"] for x in rs) for lv, rs in runs.items()}
    p = acc[0]
    se = math.sqrt(max(p * (1 - p), 1e-9) / args.eval_n)
    speedup = med[2] / med[0]
    print(f"\nsteps/hour, median of {args.repeats}: async_level=2 {med[2]:.0f}, async_level=0 {med[0]:.0f} "
          f"-> {speedup:.2f}x")
    print(f"final held-out accuracy, mean: async 2 {acc[2]:.3f}, async 0 {acc[0]:.3f} "
          f"(difference {acc[2] - acc[0]:+.3f}; one binomial s.e. of a {args.eval_n}-problem eval: {se:.3f})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "runs": {str(k): v for k, v in runs.items()}, "median_steps_per_hour":
           {str(k): v for k, v in med.items()}, "speedup": speedup, "mean_final_accuracy":
           {str(k): v for k, v in acc.items()}, "accuracy_standard_error": se}
    (RESULTS / "rl_async.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'rl_async.json'}")


if __name__ == "__main__":
    main()
