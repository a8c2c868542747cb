"""Compute utilization of real DiLoCo runs on the WAN testbed: overlap none / delayed / eager x int8 / topk.

Every arm is one real run (``Coordinator`` + worker processes, gloo, CPU) with each worker on a host of its
own of the WAN testbed (``infra/wan``: network namespaces, every directed worker link shaped to --rate
Mbit/s, one-way --delay ms where the kernel has sch_netem; ``--topology star``: each worker's uplink and
downlink instead, shared by all its peers, as a host's WAN connection is). The coordinator (rendezvous
store, run storage) sits on one more host, its own links unshaped unless --store-rate / --store-delay (in
a star its traffic still crosses the worker's shaped access link): the question is what the
pseudo-gradient's all-reduce costs the inner phases, not the control plane. The arms
run one after another on the same testbed, side by side in one invocation; they differ only in
``diloco.overlap`` and ``diloco.compression`` (every arm has ``diloco.onboarding = "non_blocking"``, which
overlap needs and which changes nothing in a run without joiners).

Read back from each worker's metrics series (``StepReport`` rows, ``intellect/diloco/report.py``), over
the committed steps from step 1 (step 0 holds the processes' warm-up and the first boundary's bandwidth
probe), every worker's rows pooled:

- ``util``: sum of ``inner_seconds`` over sum of ``outer_seconds``: the share of the workers' wall time
  spent in inner phases, the issue's "inner compute time over wall time". The per-step
  ``compute_utilization`` (the same ratio, step by step) is printed beside it as its median (``util med``).
  An overlapped step's ``outer_seconds`` runs from its boundary to the end of its reduce phase (where the
  previous step's reduction is finished), so waiting on the network shows up in it as in a blocking step;
  the run's last reduction, drained after the last phase, is in no step: ``run s`` (the coordinator's
  start to the last worker's exit) has it.
- ``s/step``: median ``outer_seconds``; ``inner s``, ``ar s``: median ``inner_seconds`` and
  ``allreduce_seconds`` (overlapped, the reduction runs beside the next inner phase); ``tok/s``: median
  ``tokens_per_s`` (one worker's tokens over its step's wall time). Overlapped, the reduction's CPU work
  (quantizing, zstd, top-k, decoding) runs on a thread beside the inner phase; on a machine with fewer cores
  than workers it slows the inner phase and so *raises* ``util`` for no gain: ``tok/s`` is the figure that
  cannot be flattered that way, and the ratios against the blocking int8 arm are printed for both.
  ``--rate 0`` runs the same arms on unshaped links: what the all-reduce costs in CPU alone, against which
  a shaped run shows the network's part.
- ``MB/step``: median ``bytes_sent`` of one worker per step (payload its all-reduce handed to gloo).
- ``loss``: the last committed step's ``inner_loss``, mean over workers (a sanity column: short runs).

The workers share this machine's cores (printed with the load average at the start); 4 workers on 2
cores make every inner phase slower than on a host of its own, so the inner phase is long next to the
all-reduce and utilization is higher than it would be with a core per worker.

    .venv/bin/python benchmarks/wan_utilization.py [--workers 4] [--outer-steps 6] [--inner-steps 10]
        [--rate 100] [--delay 50] [--arms none/int8 eager/topk ...] [section.field=value ...]

Needs root (network namespaces, tc); otherwise it says why and exits 0.
"""

# ruff: noqa: PLC0415 - the parent drives the testbed; torch and the library load only in the runs

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.wan.testbed import IFNAME, Testbed, cleanup_stale, probe  # noqa: E402

ARMS = ["none/int8", "delayed/int8", "eager/int8", "none/topk", "delayed/topk", "eager/topk"]
BASELINE = "none/int8"


# ---------------------------------------------------------------- one arm, inside the coordinator's host


class NetnsLauncher:
    """The coordinator's :class:`~intellect.launch.Launcher` for workers on testbed hosts: worker ``w<i>``
    runs ``python -m <module>`` inside namespace ``hosts[i % len(hosts)]``, with gloo on the host's WAN
    address; output appended to ``log_dir/<name>.log``. Credentials as ``worker_launcher``'s: withheld
    from the inherited environment, only the coordinator's ``env`` hands a worker its own."""

    def __init__(self, log_dir: Path, module: str, hosts: list[str], withhold: tuple[str, ...]):
        self.log_dir, self.module, self.hosts, self.withhold = log_dir, module, hosts, frozenset(withhold)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def launch(self, name: str, args, env):
        from intellect.launch import LocalProcess

        ns = self.hosts[int(name.lstrip("w")) % len(self.hosts)]
        path = self.log_dir / f"{name}.log"
        inherited = {k: v for k, v in os.environ.items() if k not in self.withhold}
        inherited |= {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1"}
        with open(path, "ab") as out:
            # `ip netns exec` execs the command: the handle's pid is the worker's own
            proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", self.module, *args],
                                    stdout=out, stderr=subprocess.STDOUT, env={**inherited, **env},
                                    start_new_session=True, cwd=ROOT)
        return LocalProcess(name, proc, path)


def run_arm(spec: dict) -> dict:
    """One run with ``spec``'s overrides; every worker's metrics rows and exit code, the run's wall time."""
    from intellect.config import load_config
    from intellect.diloco.config import DilocoRunConfig
    from intellect.diloco.coordinator import CREDENTIAL_ENVS, WORKER_MODULE, Coordinator
    from intellect.diloco.report import metrics_series
    from intellect.storage import RunStorage

    cfg = load_config(DilocoRunConfig, overrides=[f"{k}={v}" for k, v in spec["overrides"].items()], environ={})
    log_dir = Path(spec["log_dir"])
    c = Coordinator(cfg, NetnsLauncher(log_dir, WORKER_MODULE, spec["hosts"], CREDENTIAL_ENVS))
    t0 = time.monotonic()
    try:
        c.start()
        codes = c.watch(timeout=spec["timeout"])
    finally:
        c.close()
    wall = time.monotonic() - t0
    storage = RunStorage.from_config(cfg.storage, cfg.run_name)
    rows = {}
    for w in sorted(codes):
        name = metrics_series(w)
        rows[w] = [json.loads(line) for line in storage.read_text(name).splitlines()] if storage.exists(name) else []
    return {"codes": codes, "rows": rows, "wall": wall}


# ---------------------------------------------------------------- driver


def overrides(a: argparse.Namespace, root: Path, arm: str, store_addr: str) -> dict[str, object]:
    overlap, compression = arm.split("/")
    h = a.hidden
    over: dict[str, object] = {
        "storage.url": f"file://{root}/runs", "run_name": arm.replace("/", "-"),
        "model.hidden_size": h, "model.num_layers": a.layers, "model.num_heads": 4, "model.num_kv_heads": 4,
        "model.intermediate_size": 4 * h, "train.batch_size": a.batch_size, "train.warmup_steps": 2,
        "train.threads": 1, "compute.device": "cpu",
        "diloco.workers": a.workers, "diloco.inner_steps": a.inner_steps, "diloco.outer_steps": a.outer_steps,
        "diloco.overlap": f'"{overlap}"', "diloco.compression": f'"{compression}"',
        "diloco.onboarding": '"non_blocking"', "diloco.store_host": f'"{store_addr}"',
        "diloco.checkpoint_every": 1_000_000,  # the run's last checkpoint only: disk writes are not the question
        "diloco.heartbeat_interval": 1.0, "diloco.heartbeat_timeout": 30, "diloco.collective_timeout": 120,
        "diloco.boundary_timeout": 300,
    }
    over.update(o.split("=", 1) for o in a.overrides)
    return over


def params(a: argparse.Namespace) -> int:
    block = 4 * a.hidden ** 2 + 3 * a.hidden * 4 * a.hidden
    return a.layers * block  # the embeddings (a character vocabulary) are small beside it


def log_tails(log_dir: Path, lines: int = 12) -> str:
    out = []
    for p in sorted(log_dir.glob("*.log")):
        tail = p.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {p.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(out)


def summarize(arm: str, res: dict, outer_steps: int) -> dict:
    rows = [r for w in res["rows"].values() for r in w if r["committed"] and r["step"] >= 1]
    last = [w[-1] for w in res["rows"].values() if w]
    steps = {w: len(v) for w, v in res["rows"].items()}
    out = {"arm": arm, "codes": res["codes"], "run_s": res["wall"], "committed": steps,
           "complete": all(n == outer_steps for n in steps.values()) and all(c == 0 for c in res["codes"].values())}
    if not rows:
        return out
    inner, outer = sum(r["inner_seconds"] for r in rows), sum(r["outer_seconds"] for r in rows)
    out |= {
        "util": inner / outer, "util_med": statistics.median(r["compute_utilization"] for r in rows),
        "s_step": statistics.median(r["outer_seconds"] for r in rows),
        "inner_s": statistics.median(r["inner_seconds"] for r in rows),
        "allreduce_s": statistics.median(r["allreduce_seconds"] for r in rows),
        "tok_s": statistics.median(r["tokens_per_s"] for r in rows),
        "mb_step": statistics.median(r["bytes_sent"] for r in rows) / 1e6,
        "loss": statistics.fmean(r["inner_loss"] for r in last),
        "attempts": max(r["attempts"] for r in rows), "algorithm": sorted({r["algorithm"] for r in rows}),
    }
    return out


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["arm"] == BASELINE and "util" in r), None)
    head = (f"{'arm':<14}{'util':>7}{'util med':>9}{'s/step':>8}{'inner s':>8}{'ar s':>6}{'tok/s':>8}{'MB/step':>9}"
            f"{'loss':>7}{'run s':>7}{'util/base':>10}{'tok/s/base':>11}  notes")
    lines = [head]
    for r in results:
        if "util" not in r:
            lines.append(f"{r['arm']:<14}  FAILED: exit codes {r['codes']}, committed {r['committed']}")
            continue
        ratio = (f"{r['util'] / base['util']:>10.3f}{r['tok_s'] / base['tok_s']:>11.3f}" if base
                 else f"{'-':>10}{'-':>11}")
        notes = ",".join(r["algorithm"]) + ("" if r["attempts"] <= 1 else f", up to {r['attempts']} attempts")
        notes += "" if r["complete"] else f"; INCOMPLETE: codes {r['codes']}, committed {r['committed']}"
        lines.append(f"{r['arm']:<14}{r['util']:>7.3f}{r['util_med']:>9.3f}{r['s_step']:>8.2f}{r['inner_s']:>8.2f}{r['allreduce_s']:>6.2f}"
                     f"{r['tok_s']:>8.0f}{r['mb_step']:>9.3f}{r['loss']:>7.3f}{r['run_s']:>7.0f}{ratio}  {notes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--outer-steps", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=10, help="H")
    p.add_argument("--rate", type=float, default=100.0,
                   help="Mbit/s of every directed link between workers (0: unshaped, the CPU-only reference)")
    p.add_argument("--topology", choices=("mesh", "star"), default="mesh",
                   help="mesh: a link of its own per pair of workers; star: one uplink and downlink per worker, "
                   "shared by all its peers (a host's WAN connection)")
    p.add_argument("--delay", type=float, default=0.0,
                   help="one-way ms of every link between workers (needs sch_netem in the kernel)")
    p.add_argument("--store-rate", type=float, default=None, help="Mbit/s of the coordinator's links (unshaped)")
    p.add_argument("--store-delay", type=float, default=0.0, help="one-way ms of the coordinator's links")
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--arms", nargs="+", default=ARMS, metavar="OVERLAP/COMPRESSION")
    p.add_argument("--timeout", type=float, default=600, help="seconds per arm")
    p.add_argument("--workdir", help="keep the runs and the workers' logs here (default: a temporary folder)")
    p.add_argument("--json", help="write the per-arm results here")
    p.add_argument("--arm-spec", help=argparse.SUPPRESS)  # internal: run one arm (inside the coordinator's host)
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides (every arm)")
    a = p.parse_args(argv)
    if a.arm_spec:
        print(json.dumps(run_arm(json.loads(a.arm_spec))), flush=True)
        return 0
    for arm in a.arms:
        if arm.count("/") != 1:
            p.error(f"an arm is OVERLAP/COMPRESSION, not {arm!r}")
    if why := probe().missing(rate=True, delay=bool(a.delay or a.store_delay)):
        print(f"WAN testbed unavailable: {why}")
        return 0
    cleanup_stale()
    W = a.workers
    coord = W  # the coordinator's host: one more, after the workers
    if a.topology == "mesh":
        rate = [[(a.store_rate if coord in (i, j) else a.rate or None) for j in range(W + 1)] for i in range(W + 1)]
        delay = [[(a.store_delay if coord in (i, j) else a.delay) for j in range(W + 1)] for i in range(W + 1)]
    else:  # each host's uplink and downlink; one-way delay i->j = delay[i] + delay[j]
        rate = [*[a.rate or None] * W, a.store_rate]
        delay = [*[a.delay / 2] * W, a.store_delay]
    link = "every directed link" if a.topology == "mesh" else "every worker's uplink and downlink (star)"
    load = os.getloadavg()
    print(f"{W} workers on WAN hosts, {link} {f'{a.rate:g} Mbit/s' if a.rate else 'unshaped'}, one-way delay {a.delay:g} ms; "
          f"coordinator on its own host ({a.store_rate or 'unshaped'} Mbit/s, {a.store_delay:g} ms)\n"
          f"model ~{params(a) / 1e6:.1f} M params in the blocks, batch {a.batch_size}, H={a.inner_steps}, "
          f"{a.outer_steps} outer steps; figures over steps 1..{a.outer_steps - 1}, every worker's rows pooled\n"
          f"the {W} workers share this machine's {os.cpu_count()} cores (load average at start "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}): inner phases are slower than with a core each")
    results = []
    with tempfile.TemporaryDirectory(prefix="wan-utilization-") as tmp, \
            Testbed(W + 1, topology=a.topology, rate_mbit=rate, delay_ms=delay, own_hostname=True) as tb:
        root = Path(a.workdir or tmp)
        for arm in a.arms:
            log_dir = root / f"logs-{arm.replace('/', '-')}"
            spec = {"overrides": overrides(a, root, arm, tb.addr(coord)), "hosts": tb.hosts[:W],
                    "log_dir": str(log_dir), "timeout": a.timeout}
            child = tb.run(coord, [sys.executable, __file__, "--arm-spec", json.dumps(spec)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = child.communicate(timeout=a.timeout + 120)
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
            lines = out.strip().splitlines()
            if child.returncode or not lines:
                print(f"\n{arm}: the run's driver exited {child.returncode}:\n{err[-3000:]}\n{log_tails(log_dir)}")
                results.append({"arm": arm, "codes": {}, "committed": {}})
                continue
            r = summarize(arm, json.loads(lines[-1]), a.outer_steps)
            print(f"{arm}: {r['run_s']:.0f} s, exit codes {r['codes']}, committed steps {r['committed']}", flush=True)
            if not r["complete"]:
                print(log_tails(log_dir))
            results.append(r)
    print("\n" + table(results))
    print(f"(util, tok/s: ratios against {BASELINE}; load average at the end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())})")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
