"""Prefect's share of an RL step's wall time: the same steps with and without Prefect's bookkeeping.

Two runs start from the same checkpoint with the same config (the RL phase of ``configs/demo.toml``
by default: TOPLOC proofs and checks, SHARDCAST publishing; generation in this process so nothing
else competes): run A executes each step's DAG as Prefect task runs inside one flow run
(``flows.rl.run_step``, and its table artifact from a background thread, as ``rl-train`` does), run
B the very same code with every task replaced by its plain function (``task.fn``; ``.submit`` on a
thread pool, as Prefect's default runner does). Steps alternate A, B, A, B... so both see the same
machine. The work is identical (same seeds, same samples), so the difference in step time is what
Prefect costs: creating task runs, their states, logs and events through the API server (a
temporary one, as ``intellect rl`` uses).

    .venv/bin/python benchmarks/orchestration_overhead.py --steps 20

Prints median step times and Prefect's share (goal: at most 5%), and the same for this process's
CPU time (steadier on a shared machine); writes ``benchmarks/results/orchestration_overhead.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect import flow  # noqa: E402
from prefect.utilities.annotations import BaseAnnotation  # noqa: E402

from flows import rl as rl_flows  # noqa: E402
from flows.artifacts import BackgroundArtifacts  # noqa: E402
from intellect.config import load_config  # noqa: E402
from intellect.pipeline import DemoConfig  # noqa: E402
from intellect.rl.config import RLRunConfig  # noqa: E402
from tasks import rl as rl_tasks  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STEP_TASKS = ("collect", "validate", "record", "grpo_update", "broadcast", "commit_step")


class _Plain:
    """A task without Prefect: called directly, ``.submit`` on a thread pool (futures have ``.result()``)."""

    pool = ThreadPoolExecutor(8)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *a, **kw):
        return self.fn(*_bare(a), **dict(zip(kw, _bare(kw.values()))))

    def submit(self, *a, **kw):
        return self.pool.submit(self, *a, **kw)


def _bare(args) -> list:
    """Arguments without Prefect's annotations (``quote(cfg)`` -> ``cfg``), as Prefect hands them to the task."""
    return [x.unwrap() if isinstance(x, BaseAnnotation) else x for x in args]


@contextlib.contextmanager
def plain_tasks():
    saved = {name: getattr(rl_tasks, name) for name in STEP_TASKS}
    for name, t in saved.items():
        setattr(rl_tasks, name, _Plain(t.fn))
    try:
        yield
    finally:
        for name, t in saved.items():
            setattr(rl_tasks, name, t)


def children_cpu() -> float:
    """CPU seconds of this process's children (the temporary API server), from /proc."""
    me, total = os.getpid(), 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # ppid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@flow(name="orchestration-overhead")
def measure(a: RLRunConfig, b: RLRunConfig, steps: int) -> dict:
    with rl_tasks.open_run(a), rl_tasks.open_run(b):  # tasks act on the run their flow opened
        rl_tasks.prepare_run(a)
        with plain_tasks():
            rl_tasks.prepare_run(b)
        times: dict[str, list[float]] = {"prefect": [], "plain": [], "prefect_cpu": [], "plain_cpu": []}

        def timed(kind: str, cfg: RLRunConfig, n: int, artifacts: BackgroundArtifacts | None) -> None:
            t, c = time.perf_counter(), time.process_time()
            summary = rl_flows.run_step(cfg, n, local=True)
            if artifacts is not None:  # the step's table, published in the background as rl-train does
                rl_flows._publish_step(cfg, summary, artifacts.submit)
            times[kind].append(time.perf_counter() - t)
            times[f"{kind}_cpu"].append(time.process_time() - c)

        server0 = children_cpu()
        with BackgroundArtifacts() as artifacts:
            for n in range(steps):
                timed("prefect", a, n, artifacts)
                with plain_tasks():
                    timed("plain", b, n, None)
        times["server_cpu"] = [children_cpu() - server0]
        return times


def rl_config(path: Path) -> RLRunConfig:
    """The RL run of ``path``: an RL config, or the ``[rl]`` phase of a demo config."""
    if "rl" in tomllib.loads(path.read_text()):
        return load_config(DemoConfig, path, []).rl
    return load_config(RLRunConfig, path, [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"),
                    help="An RL run config, or a demo config (its [rl] phase; run `make demo` once first).")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=2, help="First steps left out of the medians (warm-up).")
    ap.add_argument("--out", default=str(RESULTS / "orchestration_overhead.json"))
    args = ap.parse_args()
    base = rl_config(Path(args.config))
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
    try:
        common = {"steps": args.steps, "eval": {"every": 0, "size": 1}, "async_level": 0}
        a, b = (RLRunConfig.model_validate(base.model_dump() | common | {"run_name": f"ovh-{k}",
                                                                         "ledger": str(tmp / f"{k}.duckdb")})
                for k in ("prefect", "plain"))
        times = measure(a, b, args.steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for run in ("ovh-prefect", "ovh-plain"):
            shutil.rmtree(Path(base.storage.url.removeprefix("file://")) / run, ignore_errors=True)
    med = {k: statistics.median(times[k][args.skip:]) for k in ("prefect", "plain", "prefect_cpu", "plain_cpu")}
    share = (med["prefect"] - med["plain"]) / med["prefect"]
    cpu_share = (med["prefect_cpu"] - med["plain_cpu"]) / med["prefect_cpu"]
    server = times["server_cpu"][0] / args.steps
    print(f"RL step ({base.run_name} config, {len(base.workers.names)} workers generating in-process, "
          f"median of {args.steps - args.skip} steps): with Prefect {med['prefect']:.3f} s, "
          f"plain functions {med['plain']:.3f} s; Prefect's share {share:.1%} (goal <= 5%)")
    print(f"CPU time of this process per step: with Prefect {med['prefect_cpu']:.3f} s, plain "
          f"{med['plain_cpu']:.3f} s ({cpu_share:.1%}); the API server process used {server:.3f} s of CPU "
          f"per step pair besides (events and logs, on the other core)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"times": times, "medians": med, "prefect_share": share, "cpu_share": cpu_share,
                                           "server_cpu_per_step": server}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
