"""What the submission service costs an RL step: signed uploads through it vs the direct write.

Per RL step of the demo config (``configs/demo.toml``: its workers, ``max_submissions`` files per
worker, ``prompts_per_submission x group_size`` rows per file, completions of at most ``max_tokens``
tokens with TOPLOC proofs of ``2 + 2k`` bytes per 32 tokens), the same Parquet files go

* **direct** (what workers did before the service): ``write_submission`` into a ``file://``
  RunStorage, the done marker as a file, and the validator's read (``load_submission``);
* **service**: each worker signs and makes its calls to a :class:`SubmissionService` on 127.0.0.1
  (assignment, the upload, the done call; the service checks each signature and writes the file
  once), and the validator's read checks the sha256 the service recorded.

Both encode the same rows; the workers run one after the other in this one process (on real
deployments they are other machines, so the service's share is smaller than measured here). Each
step is written the direct way and then through the service, so both see the same machine; the
extra cost of a run is the median over its ``--steps`` steps of (service - direct) of the same
step, and the figure is the median of ``--runs`` runs.

The overhead is quoted against an RL step of the demo: the demo table
(benchmarks/results/2026-12-02.md) has the RL phase at 157 s for 150 steps, 1.05 s a step
(``--step-seconds``).

    .venv/bin/python benchmarks/submission_overhead.py --steps 20 --runs 3

Prints the medians and the service's extra share of an RL step, in wall time and in this process's
CPU time (steadier on a shared machine); writes ``benchmarks/results/submission_overhead.json``.
Goal: the service's extra cost at most 5% of an RL step.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from intellect.data.arithmetic import ALPHABET, Problem  # noqa: E402
from intellect.data.loaders import MathTask  # noqa: E402
from intellect.rl.wire.rollouts import (  # noqa: E402
    Rollout, RolloutLimits, encode_submission, load_submission, write_submission,
)
from intellect.rl.service.server import ServiceConfig, SubmissionService  # noqa: E402
from intellect.rl.worker.client import ServiceClient  # noqa: E402
from intellect.storage import RunStorage  # noqa: E402
from intellect.toploc.proofs import ToplocConfig, proof_size  # noqa: E402
from intellect.trust.keys import SigningKey  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VOCAB = len(ALPHABET) + 3  # the character tokenizer's alphabet and its specials
BOS, EOS = len(ALPHABET), len(ALPHABET) + 1


def demo_shape(path: Path) -> dict:
    rl = tomllib.loads(path.read_text())["rl"]
    toploc = ToplocConfig(**rl.get("toploc", {}))
    sub = rl.get("submission", {})
    return {"run": rl["run_name"], "workers": len(rl["workers"]["names"]), "files": rl["workers"]["max_submissions"],
            "prompts": sub["prompts_per_submission"], "group": sub["group_size"], "max_tokens": sub["max_tokens"],
            "chunk": toploc.chunk, "proof_bytes": proof_size(toploc.k)}


def rows_of(shape: dict, worker: str, step: int, k: int, rng: random.Random) -> list[Rollout]:
    """One submission as a worker of the demo makes it: 1-2 digit sums and differences, completions of
    1..max_tokens tokens (the last EOS when it stopped), one TOPLOC proof per ``chunk`` tokens."""
    rows = []
    for g in range(shape["prompts"]):
        p = Problem(rng.randrange(100), rng.choice("+-"), rng.randrange(100))
        prompt = (BOS, *(ALPHABET.index(c) for c in p.prompt))
        for i in range(shape["group"]):
            n = rng.randint(1, shape["max_tokens"])
            out = tuple(rng.randrange(len(ALPHABET)) for _ in range(n - 1)) + (EOS,)
            reward = float(rng.random() < 0.3)
            rows.append(Rollout(
                run=shape["run"], step=step, policy_step=max(0, step - 1), worker=worker, submission=k,
                seed=rng.getrandbits(63), prompt_id=p.id, group_id=g, prompt_tokens=prompt, output_tokens=out,
                finish_reason="stop" if n < shape["max_tokens"] else "length", reward=reward, task_reward=reward,
                length_penalty=0.0, advantage=reward - 0.3,
                proof=rng.randbytes(shape["proof_bytes"] * math.ceil(n / shape["chunk"]))))
    return rows


def direct_step(storage: RunStorage, limits: RolloutLimits, step: int, work: dict) -> tuple[float, float]:
    """(seconds the workers spent writing, seconds the validator spent reading) of one step."""
    t = time.perf_counter()
    for worker, subs in work.items():
        files = [write_submission(storage, step, worker, k, rows) for k, rows in enumerate(subs)]
        storage.write_text(f"rollouts/step_{step}/{worker}.done", json.dumps({"files": files, "policy_step": 0}))
    t1 = time.perf_counter()
    for worker, subs in work.items():
        for k in range(len(subs)):
            load_submission(storage, f"rollouts/step_{step}/{worker}-{k}.parquet", limits)
    return t1 - t, time.perf_counter() - t1


def service_step(svc: SubmissionService, clients: dict, limits: RolloutLimits, step: int,
                 work: dict) -> tuple[float, float]:
    """(seconds the workers spent in their calls, seconds the validator spent reading) of one step."""
    t = time.perf_counter()
    for worker, subs in work.items():
        c = clients[worker]
        files = []
        for k, rows in enumerate(subs):
            c.assignment(step, k)
            files.append(c.submit(step, k, encode_submission(rows)).path)
        c.finish(step, files, 0)
    t1 = time.perf_counter()
    for rec in svc.submissions(step):
        load_submission(svc.storage, rec.path, limits, sha256=rec.sha256, size=rec.size)
    return t1 - t, time.perf_counter() - t1


def one_run(shape: dict, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    limits = RolloutLimits(vocab_size=VOCAB)
    tasks = [MathTask(f"t{i}", f"{i}+1=", str(i + 1)) for i in range(4096)]
    keys = [SigningKey.generate() for _ in range(shape["workers"])]
    with tempfile.TemporaryDirectory(prefix="submission-overhead-") as tmp:
        direct = RunStorage(f"file://{tmp}/direct")
        svc = SubmissionService(ServiceConfig(ahead=steps + 1), run=shape["run"], storage=RunStorage(f"file://{tmp}/svc"),
                                state_dir=Path(tmp) / "state", run_info=lambda: {"run": shape["run"]}, tasks=tasks,
                                prompts_per_submission=shape["prompts"])
        svc.start()
        clients = {k.public.id: ServiceClient(svc.url, k, audience=shape["run"], timeout=30) for k in keys}
        try:
            for c in clients.values():
                c.register()
            times: dict[str, list[tuple[float, float]]] = {"direct": [], "service": []}
            cpu: dict[str, list[float]] = {"direct": [], "service": []}
            sizes = []
            for step in range(steps + 1):  # step 0 warms both paths up and is not counted
                work = {w: [rows_of(shape, w, step, k, rng) for k in range(shape["files"])] for w in clients}
                sizes += [len(encode_submission(s)) for subs in work.values() for s in subs] if step == 1 else []
                c0 = time.process_time()
                d = direct_step(direct, limits, step, work)
                c1 = time.process_time()
                s = service_step(svc, clients, limits, step, work)
                c2 = time.process_time()
                if step:
                    times["direct"].append(d)
                    times["service"].append(s)
                    cpu["direct"].append(c1 - c0)
                    cpu["service"].append(c2 - c1)
        finally:
            for c in clients.values():
                c.close()
            svc.stop()
    out = {"file_bytes": statistics.median(sizes)}
    for mode, got in times.items():
        out[mode] = statistics.median(w + r for w, r in got)
        out[mode + "_write"] = statistics.median(w for w, _ in got)
        out[mode + "_read"] = statistics.median(r for _, r in got)
        out[mode + "_cpu"] = statistics.median(cpu[mode])
    # paired: each step's service time minus the direct time of the same step, measured just before it,
    # so a change in the machine's load between steps cancels out
    out["extra"] = statistics.median(sum(s) - sum(d) for d, s in zip(times["direct"], times["service"]))
    out["extra_cpu"] = statistics.median(s - d for d, s in zip(cpu["direct"], cpu["service"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.toml")
    ap.add_argument("--steps", type=int, default=20, help="Steps per run (medians over them).")
    ap.add_argument("--runs", type=int, default=3, help="Runs (the figure is the median of their medians).")
    ap.add_argument("--step-seconds", type=float, default=157 / 150,
                    help="Wall time of one RL step of the demo "
                         "(benchmarks/results/2026-12-02.md: 157 s for 150 steps).")
    args = ap.parse_args(argv)
    shape = demo_shape(args.config)
    print(f"{args.config.name}: {shape['workers']} workers x {shape['files']} file(s) a step, "
          f"{shape['prompts'] * shape['group']} rows a file, <= {shape['max_tokens']} tokens, "
          f"{shape['proof_bytes']} B of proof per {shape['chunk']} tokens")
    runs = [one_run(shape, args.steps, seed) for seed in range(args.runs)]
    print("seconds a step (write: the workers' side; read: the validator's, the same parse in both)")
    print(f"{'run':>4} {'direct write':>13} {'service write':>14} {'direct read':>12} {'service read':>13} "
          f"{'extra':>8} {'of an RL step':>14}")
    for i, r in enumerate(runs):
        extra = r["extra"]
        print(f"{i:>4} {r['direct_write']:>13.4f} {r['service_write']:>14.4f} {r['direct_read']:>12.4f} "
              f"{r['service_read']:>13.4f} {extra:>8.4f} {extra / args.step_seconds:>13.2%}")
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    extra = med["extra"]
    share = extra / args.step_seconds
    print(f"median: direct {med['direct']:.4f} s, service {med['service']:.4f} s a step; the service adds "
          f"{extra * 1000:.1f} ms = {share:.2%} of a {args.step_seconds:.3f} s RL step (its whole write side: "
          f"{med['service_write'] * 1000:.1f} ms = {med['service_write'] / args.step_seconds:.2%}); files of "
          f"{med['file_bytes'] / 1024:.0f} KiB; goal <= 5%: {'met' if share <= 0.05 else 'NOT met'}")
    cpu_extra = med["extra_cpu"]
    print(f"CPU time of this process (service, clients and validator; steadier on a shared machine): direct "
          f"{med['direct_cpu'] * 1000:.1f} ms, service {med['service_cpu'] * 1000:.1f} ms a step, extra "
          f"{cpu_extra * 1000:.1f} ms = {cpu_extra / args.step_seconds:.2%} of an RL step")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "submission_overhead.json").write_text(json.dumps(
        {"shape": shape, "steps": args.steps, "step_seconds": args.step_seconds, "runs": runs, "median": med,
         "extra_seconds": extra, "share": share, "extra_cpu_seconds": cpu_extra}, indent=1) + "\n")
    return 0 if share <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
