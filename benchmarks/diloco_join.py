"""What a joiner costs the members: blocking vs non-blocking onboarding (``diloco.onboarding``), same run.

For each mode, one real DiLoCo run in this process (``Coordinator`` + ``worker_launcher``: local
subprocess workers on the CPU, gloo): two founding workers (``--ranks`` processes each) train a
Llama of a few million parameters on the arithmetic task with ``checkpoint_every`` past the run's
end, so a joiner can only get the state from a peer (theta_sync + outer momentum). After
``--join-after`` committed steps a third worker is started (``Coordinator.start_worker``) and the
run goes on to the end. Read back from the members' metrics series (w0, w1), it prints per step:
the members' ``outer_seconds`` (boundary start to commit) and the phase of the step:

- ``before``: the joiner not started yet (two members, two contributors);
- ``start``: the joiner started but not yet a member (its Python startup runs on the same cores);
- ``JOIN``: the joiner is a member it was not before (non-blocking: it trains nothing and sends
  nothing while it receives the state in the background; blocking: the members waited at the
  boundary for it to start up, then for the broadcast of the state);
- ``after``: three contributors;
- ``gone``: the joiner left again (say, banned by the robust aggregation).

Then the median outer step of the steps without a join (``before``), the join step(s) against it
(ratio, and the stall: join - median), blocking beside non-blocking; and the joiner's first
contributing step (``contributors`` of the members' rows) beside the boundary it caught up at
(its ``onboarded`` row). Blocking's stall includes the joiner's whole startup: the members wait
for it at the boundary, which is what blocking onboarding is.

The machine's cores are shared by every process of the run: on a small host the joiner's startup
and, after the join, its training take CPU from the members, so ``start`` and ``after`` steps are
slower for that reason alone (printed beside ``before`` to show it).

    .venv/bin/python benchmarks/diloco_join.py [--quick] [--ranks 2] [--join-after 5] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from intellect.config import load_config  # noqa: E402
from intellect.diloco.config import DilocoRunConfig  # noqa: E402
from intellect.diloco.coordinator import EXIT_BANNED, EXIT_DONE, Coordinator, worker_launcher  # noqa: E402
from intellect.diloco.report import metrics_series  # noqa: E402
from intellect.storage import RunStorage  # noqa: E402

MEMBERS = ("w0", "w1")
JOINER = "w2"


def run_cfg(root: Path, name: str, args: argparse.Namespace, onboarding: str) -> DilocoRunConfig:
    h = args.hidden
    over = {
        "storage.url": f"file://{root}/runs", "run_name": name,
        "model.hidden_size": h, "model.num_layers": args.layers, "model.num_heads": 4, "model.num_kv_heads": 4,
        "model.intermediate_size": 4 * h, "train.batch_size": args.batch_size, "train.warmup_steps": 2,
        "train.threads": 1, "compute.device": "cpu",
        "diloco.workers": 2, "diloco.ranks_per_worker": args.ranks, "diloco.onboarding": f'"{onboarding}"',
        "diloco.inner_steps": args.inner_steps, "diloco.outer_steps": args.outer_steps,
        "diloco.checkpoint_every": 1_000_000,  # no checkpoint to load: the joiner gets the state from a peer
        "diloco.heartbeat_interval": 0.5, "diloco.heartbeat_timeout": 10, "diloco.collective_timeout": 60,
        "diloco.boundary_timeout": 120,
    }
    over.update(o.split("=", 1) for o in args.overrides)
    return load_config(DilocoRunConfig, overrides=[f"{k}={v}" for k, v in over.items()], environ={})


def params(cfg: DilocoRunConfig) -> int:
    m = cfg.model
    block = 4 * m.hidden_size ** 2 + 3 * m.hidden_size * m.intermediate_size
    return m.num_layers * block  # the embeddings (a character vocabulary) are small beside it


def run(cfg: DilocoRunConfig, log_dir: Path, join_after: int, timeout: float) -> dict:
    """Run ``cfg`` with a third worker started after ``join_after`` committed steps; the rows of each
    worker's metrics series by step, and the committed count when the joiner started."""
    c = Coordinator(cfg, worker_launcher(log_dir))
    try:
        c.start()
        deadline = time.monotonic() + timeout
        seen, commits = 0, []
        while seen < join_after:
            if time.monotonic() > deadline or any(h.poll() is not None for h in c.handles.values()):
                raise SystemExit(f"the founders did not reach step {join_after}: see {log_dir}")
            if (c.progress() or 0) > seen:
                seen, commits = c.progress() or 0, [*commits, time.monotonic()]
            time.sleep(0.02)
        # launched mid inner phase, not at the boundary: a launch between two veterans' reads of the
        # launched workers makes one of them wait boundary_timeout for a newcomer that went for the next step
        time.sleep(0.4 * (commits[-1] - commits[-2]) if len(commits) > 1 else 0.0)
        started_at = c.progress() or 0
        c.start_worker(JOINER)
        codes = c.watch(timeout=max(1.0, deadline - time.monotonic()))
        # the joiner may be banned (robust aggregation flagged its contributions): reported, not fatal
        if any(codes[w] != EXIT_DONE for w in MEMBERS) or codes.get(JOINER) not in (EXIT_DONE, EXIT_BANNED):
            raise SystemExit(f"exit codes {codes}: see {log_dir}")
        storage = RunStorage.from_config(cfg.storage, cfg.run_name)
        rows = {w: {r["step"]: r for r in map(json.loads, storage.read_text(metrics_series(w)).splitlines())}
                if storage.exists(metrics_series(w)) else {} for w in (*MEMBERS, JOINER)}
        return {"rows": rows, "started_at": started_at, "joiner_exit": codes.get(JOINER)}
    finally:
        c.close()


def phases(rows: dict, started_at: int) -> dict[int, str]:
    """The phase of each step the members committed (see the module docstring)."""
    out: dict[int, str] = {}
    for t, r in sorted(rows["w0"].items()):
        if JOINER in r["members"]:
            out[t] = "after" if "JOIN" in out.values() else "JOIN"
        elif "JOIN" in out.values():
            out[t] = "gone"  # the joiner left or was banned
        else:
            out[t] = "before" if t < started_at else "start"
    return out


def summarize(mode: str, result: dict) -> dict:
    rows, started_at = result["rows"], result["started_at"]
    phase = phases(rows, started_at)
    print(f"\n== onboarding = {mode}: joiner started after {started_at} committed steps")
    print(f"{'step':>4}  {'phase':<6}  {'w0 outer s':>10}  {'w1 outer s':>10}  {'w0 inner s':>10}  "
          f"{'w0 allreduce s':>14}  {'members':>7}  {'contrib':>7}  {'flagged':>9}  joiner onboarded")
    for t, p in phase.items():
        a, b = rows["w0"][t], rows["w1"].get(t, {})
        j = rows[JOINER].get(t)
        print(f"{t:>4}  {p:<6}  {a['outer_seconds']:>10.2f}  {b.get('outer_seconds', float('nan')):>10.2f}  "
              f"{a['inner_seconds']:>10.2f}  {a['allreduce_seconds']:>14.2f}  {len(a['members']):>7}  "
              f"{a['contributors']:>7}  {','.join(a['flagged']) or '-':>9}  {'' if j is None else j['onboarded']}")

    def times(kind: str) -> list[float]:
        return [rows[w][t]["outer_seconds"] for t, p in phase.items() if p == kind for w in MEMBERS if t in rows[w]]

    before = [rows[w][t]["outer_seconds"] for t, p in phase.items() if p == "before" and t > 0 for w in MEMBERS]
    base = statistics.median(before)  # step 0 left out: the founders' first step warms up
    join = times("JOIN")
    first = next((t for t, r in sorted(rows["w0"].items()) if r["contributors"] == 3), None)
    caught = next((t for t, r in sorted(rows[JOINER].items()) if r["onboarded"]), None)
    out = {"mode": mode, "median_before": base, "join": max(join) if join else float("nan"),
           "median_start": statistics.median(times("start")) if times("start") else float("nan"),
           "median_after": statistics.median(times("after")) if times("after") else float("nan"),
           "first_contribution": first, "caught_up_at": caught}
    out["joiner"] = {EXIT_DONE: "done", EXIT_BANNED: "BANNED"}.get(result["joiner_exit"], str(result["joiner_exit"]))
    out["ratio"] = out["join"] / base
    out["stall"] = out["join"] - base
    print(f"median outer step without a join (before, w0 and w1, from step 1): {base:.2f} s; "
          f"join step: {out['join']:.2f} s (x{out['ratio']:.2f}, stall {out['stall']:+.2f} s); "
          f"median start {out['median_start']:.2f} s, after {out['median_after']:.2f} s")
    flagged = [t for t, r in sorted(rows["w0"].items()) if JOINER in r["flagged"]]
    print(f"joiner onboarded at the boundary of step {caught}; its first contribution: step {first}; "
          f"flagged as an outlier at steps {flagged}; joiner's exit: {out['joiner']}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (a smoke run)")
    p.add_argument("--ranks", type=int, default=1, help="diloco.ranks_per_worker")
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=20)
    p.add_argument("--outer-steps", type=int, default=16,
                   help="enough that the joiner starts up, joins and contributes a few steps before the end")
    p.add_argument("--join-after", type=int, default=5, help="committed steps before the joiner starts")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--modes", nargs="+", default=["blocking", "non_blocking"])
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides (both modes)")
    p.add_argument("--workdir", help="keep the runs and the workers' logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.inner_steps, args.outer_steps, args.join_after = 192, 16, 14, 4
    out = []
    with tempfile.TemporaryDirectory(prefix="diloco-join-") as tmp:
        root = Path(args.workdir or tmp)
        for mode in args.modes:
            cfg = run_cfg(root, f"join-{mode}", args, mode)
            if not out:
                print(f"model ~{params(cfg) / 1e6:.1f} M params in the blocks (theta_sync + momentum: "
                      f"~{2 * 4 * params(cfg) / 2**20:.0f} MiB to the joiner); {args.ranks} rank(s) per worker, "
                      f"H={args.inner_steps}, {args.outer_steps} outer steps, joiner after {args.join_after}")
            t0 = time.monotonic()
            result = run(cfg, root / f"logs-{mode}", args.join_after, args.timeout)
            print(f"({mode}: {time.monotonic() - t0:.0f} s wall)")
            out.append(summarize(mode, result))
    print(f"\n{'onboarding':<13}  {'median s':>8}  {'join s':>7}  {'ratio':>6}  {'stall s':>7}  "
          f"{'start s':>7}  {'after s':>7}  {'caught up':>9}  {'1st contrib':>11}  joiner")
    for o in out:
        print(f"{o['mode']:<13}  {o['median_before']:>8.2f}  {o['join']:>7.2f}  {o['ratio']:>6.2f}  "
              f"{o['stall']:>+7.2f}  {o['median_start']:>7.2f}  {o['median_after']:>7.2f}  "
              f"{str(o['caught_up_at']):>9}  {str(o['first_contribution']):>11}  {o['joiner']}")


if __name__ == "__main__":
    main()
