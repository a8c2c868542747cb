"""Prefect's share of an RL step's wall time: the same steps with and without Prefect's bookkeeping.

Two runs start from the same checkpoint with the same config (rl-tiny's by default, generation in
this process so nothing else competes): run A executes each step's DAG as Prefect task runs inside
one flow run (``flows.rl.run_step``, as ``rl-train`` does), run B the very same code with every
task replaced by its plain function (``task.fn``; ``.submit`` on a thread pool, as Prefect's
default runner does). Steps alternate A, B, A, B... so both see the same machine. The work is
identical (same seeds, same samples), so the difference in step time is what Prefect costs:
creating task runs, their states, logs and events through the API server (a temporary one,
as ``intellect rl`` uses).

    .venv/bin/python benchmarks/orchestration_overhead.py --steps 20

Prints median step times and Prefect's share (goal: at most 5%); writes
``benchmarks/results/orchestration_overhead.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect import flow  # noqa: E402

from flows import rl as F  # noqa: E402
from intellect.config import load_config  # noqa: E402
from intellect.rl.config import RLRunConfig  # noqa: E402
from tasks import rl as T  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STEP_TASKS = ("assign", "generate", "validate", "record", "grpo_update", "broadcast", "commit_step")


class _Plain:
    """A task without Prefect: called directly, ``.submit`` on a thread pool (futures have ``.result()``)."""

    pool = ThreadPoolExecutor(8)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *a, **kw):
        return self.fn(*a, **kw)

    def submit(self, *a, **kw):
        return self.pool.submit(self.fn, *a, **kw)


@contextlib.contextmanager
def plain_tasks():
    saved = {name: getattr(T, name) for name in STEP_TASKS}
    for name, t in saved.items():
        setattr(T, name, _Plain(t.fn))
    try:
        yield
    finally:
        for name, t in saved.items():
            setattr(T, name, t)


@flow(name="orchestration-overhead")
def measure(a: RLRunConfig, b: RLRunConfig, steps: int) -> dict:
    T.prepare_run(a)
    with plain_tasks():
        T.prepare_run(b)
    times = {"prefect": [], "plain": []}
    for n in range(steps):
        t = time.perf_counter()
        F.run_step(a, n, local=True)
        times["prefect"].append(time.perf_counter() - t)
        with plain_tasks():
            t = time.perf_counter()
            F.run_step(b, n, local=True)
            times["plain"].append(time.perf_counter() - t)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "rl-tiny.toml"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=2, help="First steps left out of the medians (warm-up).")
    ap.add_argument("--out", default=str(RESULTS / "orchestration_overhead.json"))
    args = ap.parse_args()
    base = load_config(RLRunConfig, args.config, [])
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
    try:
        common = {"steps": args.steps, "shardcast": None, "eval": {"every": 0, "size": 1}, "async_level": 0}
        a, b = (RLRunConfig.model_validate(base.model_dump() | common | {"run_name": f"ovh-{k}",
                                                                         "ledger": str(tmp / f"{k}.duckdb")})
                for k in ("prefect", "plain"))
        times = measure(a, b, args.steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for run in ("ovh-prefect", "ovh-plain"):
            shutil.rmtree(Path(base.storage.url.removeprefix("file://")) / run, ignore_errors=True)
    med = {k: statistics.median(v[args.skip:]) for k, v in times.items()}
    share = (med["prefect"] - med["plain"]) / med["prefect"]
    print(f"RL step ({base.run_name} config, {len(base.workers.names)} workers generating in-process, "
          f"median of {args.steps - args.skip} steps): with Prefect {med['prefect']:.3f} s, "
          f"plain functions {med['plain']:.3f} s; Prefect's share {share:.1%} (goal <= 5%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"times": times, "medians": med, "prefect_share": share}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
