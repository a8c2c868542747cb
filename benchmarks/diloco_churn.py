"""Goodput of a DiLoCo run under churn: a member killed, or a new worker joining, every few outer steps.

For each arm (``diloco.overlap`` none / eager; both with ``diloco.onboarding = "non_blocking"``), two real
runs (``Coordinator`` + ``worker_launcher``: local subprocess workers on the CPU, gloo), one after the
other: one with no faults, and one where, every --every committed outer steps, the driver alternately
kills a random member with SIGKILL (no deathrattle: the others find out from the broken all-reduce or
the heartbeat timeout) and starts a new worker (``Coordinator.start_worker``), for the whole run. A
killed worker is not restarted; the run never rolls back to a checkpoint (none is written before the
end: ``checkpoint_every`` is past it), so whatever a fault costs is the time the survivors lose.

Goodput: the tokens that reached the model (the sum of ``tokens`` over every worker's committed
``StepReport`` rows: a contributor's inner phase that went into a committed average; a joiner's first
step, which it only relays, has none) per second of the run's wall time (the coordinator's start to the
last worker's exit), churn over no faults per arm. Both runs of an arm start the same number of workers;
under churn the member count dips by one between a kill and the next join, so goodput below 100% is
partly fewer workers, not only lost time: ``tok/s/member`` divides each committed step's tokens by its
contributors, the figure that a dead worker's absence does not lower. ``retried`` counts committed steps
that took more than one all-reduce attempt (a member died in it); ``digests`` checks that every member
of each committed step recorded the same ``theta_sync``.

The machine's cores are shared by every worker (printed with the load average): a joiner's startup
and the members' work compete for them, which the no-fault run does not pay.

``--straggler F``: the slow-member case instead. One member (the last) is made F times slower from outside
(``launch.Throttle``: its process stopped and continued on a duty cycle, as a slower host would be) from the
first commit on, in three runs: no slow member; the slow member with ``diloco.quorum = 1`` (every step waits
for it); and with ``--quorum Q`` (the others close its phase: ``diloco.stragglers``). Reported: the other
members' median step time (``outer_seconds`` of their committed steps after the first) over the run with no slow
member, and the slow member's tokens that reached the model per second against its own with no slowdown.

    .venv/bin/python benchmarks/diloco_churn.py [--workers 3] [--outer-steps 26] [--every 5] [--arms none eager]
        [--straggler 2 --quorum 0.6] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from intellect.config import load_config  # noqa: E402
from intellect.diloco.config import DilocoRunConfig  # noqa: E402
from intellect.diloco.coordinator import EXIT_DONE, Coordinator, worker_launcher  # noqa: E402
from intellect.diloco.report import metrics_series  # noqa: E402
from intellect.launch import LocalProcess, Throttle  # noqa: E402
from intellect.storage import RunStorage  # noqa: E402


def run_cfg(root: Path, name: str, a: argparse.Namespace, overlap: str) -> DilocoRunConfig:
    h = a.hidden
    over: dict[str, object] = {
        "storage.url": f"file://{root}/runs", "run_name": name,
        "model.hidden_size": h, "model.num_layers": a.layers, "model.num_heads": 4, "model.num_kv_heads": 4,
        "model.intermediate_size": 4 * h, "train.batch_size": a.batch_size, "train.warmup_steps": 2,
        "train.threads": 1, "compute.device": "cpu",
        "diloco.workers": a.workers, "diloco.inner_steps": a.inner_steps, "diloco.outer_steps": a.outer_steps,
        "diloco.overlap": f'"{overlap}"', "diloco.onboarding": '"non_blocking"',
        "diloco.checkpoint_every": 1_000_000,  # no checkpoint to roll back to before the end
        "diloco.heartbeat_interval": 0.5, "diloco.heartbeat_timeout": 5, "diloco.collective_timeout": 60,
        "diloco.boundary_timeout": 120,
    }
    over.update(o.split("=", 1) for o in a.overrides)
    return load_config(DilocoRunConfig, overrides=[f"{k}={v}" for k, v in over.items()], environ={})


def run(cfg: DilocoRunConfig, log_dir: Path, every: int, churn: bool, seed: int, timeout: float) -> dict:
    """One run; with ``churn``, every ``every`` committed steps a kill, then a join, alternately."""
    rng = random.Random(seed)
    c = Coordinator(cfg, worker_launcher(log_dir))
    events: list[dict] = []
    t0 = time.monotonic()
    try:
        c.start()
        deadline = t0 + timeout
        last, commits, kill_next = 0, [t0], True
        while time.monotonic() < deadline and any(h.poll() is None for h in c.handles.values()):
            p = c.progress() or 0
            if p > last:
                last, commits = p, [*commits, time.monotonic()]
                if churn and p % every == 0 and p < cfg.diloco.outer_steps:
                    # mid inner phase, not at the boundary (as benchmarks/diloco_join.py times its joiner)
                    time.sleep(0.4 * (commits[-1] - commits[-2]))
                    alive = [w for w, h in c.handles.items() if h.poll() is None]
                    if kill_next and len(alive) > 2:
                        w = rng.choice(alive)
                        if c.handles[w].poll() is None:  # not done meanwhile
                            c.handles[w].kill()
                            events.append({"after": p, "kill": w})
                    else:
                        events.append({"after": p, "join": c.start_worker().name})
                    kill_next = not kill_next
            time.sleep(0.05)
        codes = {w: h.poll() for w, h in c.handles.items()}
    finally:
        c.close()
    wall = time.monotonic() - t0
    return {"codes": codes, "rows": series(cfg, codes), "wall": wall, "events": events}


def series(cfg: DilocoRunConfig, workers) -> dict[str, list[dict]]:
    """Each worker's metrics series (one row per committed step) of the run."""
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    return {w: [json.loads(line) for line in storage.read_text(metrics_series(w)).splitlines()]
            if storage.exists(metrics_series(w)) else [] for w in workers}


def run_slow(cfg: DilocoRunConfig, log_dir: Path, factor: float, timeout: float) -> dict:
    """One run whose last worker runs ``1/factor`` of the time (``factor`` 1: not slowed) from the first commit."""
    c = Coordinator(cfg, worker_launcher(log_dir))
    t0 = time.monotonic()
    throttle = None
    try:
        c.start()
        slow = list(c.handles)[-1]
        while time.monotonic() < t0 + timeout and any(h.poll() is None for h in c.handles.values()):
            if throttle is None and factor > 1 and (c.progress() or 0) >= 1:
                period = 0.1  # short against an inner step's worth of heartbeats, long against the signals' cost
                handle = c.handles[slow]
                assert isinstance(handle, LocalProcess), "a local worker process is what the throttle slows"
                throttle = Throttle(handle.pid, run=period / factor, pause=period * (1 - 1 / factor))
            time.sleep(0.05)
        codes = {w: h.poll() for w, h in c.handles.items()}
    finally:
        if throttle is not None:
            throttle.stop()
        c.close()
    wall = time.monotonic() - t0
    return {"codes": codes, "rows": series(cfg, codes), "wall": wall, "slow": slow}


def summarize_slow(res: dict) -> dict:
    """The others' median step time and waiting, the slow member's committed tokens per second of the run."""
    others = [r for w, rows in res["rows"].items() if w != res["slow"] for r in rows if r["committed"] and r["step"] > 0]
    mine = [r for r in res["rows"][res["slow"]] if r["committed"]]
    return {
        "step_s": statistics.median(r["outer_seconds"] for r in others) if others else float("nan"),
        "wait_s": statistics.median(r["outer_seconds"] - r["inner_seconds"] for r in others) if others else float("nan"),
        "slow_tok_s": sum(r["tokens"] for r in mine) / res["wall"],
        "slow_steps": [r.get("inner_steps", 0) for r in mine],
        "slow_in": len(mine), "steps": 1 + max((r["step"] for r in others), default=-1),
        "attempts": max((r["attempts"] for r in others), default=0), "codes": res["codes"], "wall": res["wall"],
    }


def stragglers(a: argparse.Namespace) -> list[dict]:
    """The slow-member case: per arm, no slow member, a slow one with quorum 1, a slow one with ``--quorum``."""
    cases = [("even", 1.0, 1.0), ("slow-wait", a.straggler, 1.0), ("slow-quorum", a.straggler, a.quorum)]
    out = []
    with tempfile.TemporaryDirectory(prefix="diloco-straggler-") as tmp:
        root = Path(a.workdir or tmp)
        for overlap in a.arms:
            row = {"overlap": overlap}
            for case, factor, quorum in cases:
                name = f"straggler-{overlap}-{case}"
                a_case = argparse.Namespace(**{**vars(a), "overrides": [*a.overrides, f"diloco.quorum={quorum}"]})
                res = summarize_slow(run_slow(run_cfg(root, name, a_case, overlap), root / f"logs-{name}", factor,
                                              a.timeout))
                print(f"{name}: {res['wall']:.0f} s, {res['steps']} steps, others' median step {res['step_s']:.2f} s "
                      f"(waiting {res['wait_s']:.2f} s), slow member in {res['slow_in']} steps, inner steps "
                      f"{res['slow_steps']}, exit codes {res['codes']}", flush=True)
                row[case] = res
            out.append(row)
    print(f"\n{'overlap':<8}{'even step s':>12}{'slow, wait':>11}{'x':>7}{'slow, quorum':>13}{'x':>7}"
          f"{'slow tok/s (wait, quorum) / even':>34}")
    for r in out:
        ev, sw, sq = r["even"], r["slow-wait"], r["slow-quorum"]
        print(f"{r['overlap']:<8}{ev['step_s']:>12.2f}{sw['step_s']:>11.2f}{sw['step_s'] / ev['step_s']:>7.2f}"
              f"{sq['step_s']:>13.2f}{sq['step_s'] / ev['step_s']:>7.2f}"
              f"{sw['slow_tok_s'] / ev['slow_tok_s']:>17.3f}{sq['slow_tok_s'] / ev['slow_tok_s']:>9.3f}")
    return out


def summarize(res: dict, outer_steps: int) -> dict:
    committed = [r for rows in res["rows"].values() for r in rows if r["committed"]]
    by_step: dict[int, list[dict]] = {}
    for r in committed:
        by_step.setdefault(r["step"], []).append(r)
    tokens = sum(r["tokens"] for r in committed)
    per_member = sum(sum(r["tokens"] for r in rs) / max(1, max(r["contributors"] for r in rs))
                     for rs in by_step.values())
    return {
        "steps": len(by_step), "complete": sorted(by_step) == list(range(outer_steps)),
        "tokens": tokens, "wall": res["wall"], "tok_s": tokens / res["wall"], "tok_s_member": per_member / res["wall"],
        "retried": sum(1 for rs in by_step.values() if max(r["attempts"] for r in rs) > 1),
        "digests_agree": all(len({r["digest"] for r in rs}) == 1 for rs in by_step.values()),
        "members": [len(by_step[t][0]["members"]) for t in sorted(by_step)],
        "events": res["events"], "codes": res["codes"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--outer-steps", type=int, default=26,
                   help="long enough that a joiner (its startup: tens of seconds on a loaded machine) gets in")
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--every", type=int, default=5, help="committed outer steps between churn events")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--arms", nargs="+", default=["none", "eager"], help="diloco.overlap of each arm")
    p.add_argument("--seed", type=int, default=0, help="which member each kill picks")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--workdir", help="keep the runs and the workers' logs here (default: a temporary folder)")
    p.add_argument("--json", help="write the per-run results here")
    p.add_argument("--straggler", type=float, default=0.0, metavar="F",
                   help="the slow-member case instead of churn: one member F times slower")
    p.add_argument("--quorum", type=float, default=0.6, help="--straggler: diloco.quorum of the quorum runs")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides (every run)")
    a = p.parse_args(argv)
    load = os.getloadavg()
    if a.straggler:
        print(f"{a.workers} workers ({os.cpu_count()} cores, load average {load[0]:.1f}), hidden {a.hidden} x "
              f"{a.layers} layers, batch {a.batch_size}, H={a.inner_steps}, {a.outer_steps} outer steps; one member "
              f"{a.straggler}x slower; quorum {a.quorum}")
        res = stragglers(a)
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "results": res}, indent=1))
        return 0
    print(f"{a.workers} workers (local processes sharing this machine's {os.cpu_count()} cores, load average "
          f"{load[0]:.1f}), hidden {a.hidden} x {a.layers} layers, batch {a.batch_size}, H={a.inner_steps}, "
          f"{a.outer_steps} outer steps; churn: a kill or a join, alternately, every {a.every} committed steps")
    out = []
    with tempfile.TemporaryDirectory(prefix="diloco-churn-") as tmp:
        root = Path(a.workdir or tmp)
        for overlap in a.arms:
            pair = {}
            for churn in (False, True):
                name = f"churn-{overlap}-{'churn' if churn else 'clean'}"
                cfg = run_cfg(root, name, a, overlap)
                res = summarize(run(cfg, root / f"logs-{name}", a.every, churn, a.seed, a.timeout), a.outer_steps)
                print(f"{name}: {res['wall']:.0f} s, {res['steps']} steps committed, members per step {res['members']}, "
                      f"events {res['events']}, exit codes {res['codes']}", flush=True)
                pair["churn" if churn else "clean"] = res
            out.append({"overlap": overlap, **pair})
    print(f"\n{'overlap':<8}{'clean tok/s':>12}{'churn tok/s':>12}{'goodput':>9}{'per member':>11}{'retried':>8}"
          f"{'digests':>8}{'complete':>9}  events")
    for o in out:
        cl, ch = o["clean"], o["churn"]
        ev = " ".join(f"{e['after']}:{'kill ' + e['kill'] if 'kill' in e else 'join ' + e['join']}" for e in ch["events"])
        ok = all(c == EXIT_DONE for w, c in ch["codes"].items() if not any(e.get("kill") == w for e in ch["events"]))
        print(f"{o['overlap']:<8}{cl['tok_s']:>12.0f}{ch['tok_s']:>12.0f}{ch['tok_s'] / cl['tok_s']:>9.3f}"
              f"{ch['tok_s_member'] / cl['tok_s_member']:>11.3f}{ch['retried']:>8}"
              f"{'ok' if ch['digests_agree'] and cl['digests_agree'] else 'DIFFER':>8}"
              f"{'yes' if ch['complete'] and cl['complete'] and ok else 'NO':>9}  {ev}")
    print(f"(load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
