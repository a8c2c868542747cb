"""Weight patches vs full checkpoints through SHARDCAST: bytes per RL step and end-to-end time, side by side.

Part 1, a real RL run. The demo's RL phase (``configs/demo.toml`` ``[rl]``: GRPO, AdamW at lr 1e-4,
the rate every shipped RL config uses) runs ``--steps`` steps from the demo's pretrained model
(``--from``), writing a checkpoint per step (``--checkpoints DIR`` measures an existing run's
checkpoints instead). For each pair of consecutive checkpoints, as published (the trainer writes
float32) and as a bf16 inference copy (each float tensor rounded to bf16), the bytes of the full
checkpoint and of the weight patch (``intellect.shardcast.patch``) and the share of elements whose
bits changed. Then the bf16 copies go through a real origin process, one relay process and a client
on 127.0.0.1 (``intellect.shardcast.origin.Origin``, ``ShardcastClient``), once every version full
(``anchor_every = 1``, today's broadcast) and once as patches (``anchor_every = 10``), in alternating
order over ``--repeats`` rounds: per step, publish + relay mirror + client fetch + rebuild, timed.

Part 2, the Qwen2.5-0.5B shape (494M parameters, tied embeddings): float32 master weights under
AdamW (betas 0.9/0.999, no weight decay, as the RL trainer's default) on synthetic gradients (Gaussian;
the embedding's rows nonzero only for a random ``--token-share`` of the vocabulary per step, as a
batch touches few tokens), at each ``--lrs``; per step the share of bf16 elements whose bits
changed and the patch bytes (the codec's own packing, ``diff_elements``) against the 988 MB bf16
checkpoint. One tensor at a time, so it fits a small machine.

    .venv/bin/python benchmarks/delta_broadcast.py --steps 12 --repeats 3

Writes ``benchmarks/results/delta_broadcast.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from intellect.shardcast.patch import checkpoint_files, diff_elements, make_patch  # noqa: E402


# ------------------------------------------------------------------ part 1: a real RL run


def rl_checkpoints(args, work: Path) -> list[Path]:
    """Run the demo's RL phase for ``args.steps`` steps; its checkpoint folders, oldest first."""
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="intellect-bench-prefect-"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # as the tests: a busy machine
    from flows.rl import rl_train  # noqa: PLC0415 - prefect reads the PREFECT_* settings above at import
    from intellect.rl.config import RLRunConfig  # noqa: PLC0415 - heavy (torch)

    rl = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())["rl"]
    tasks = ROOT / "runs" / "demo-filter" / "tasks.jsonl"
    rl.update(run_name="delta-bench", steps=args.steps, storage={"url": f"file://{work}"},
              init={"path": str(Path(args.from_dir).resolve()), "from_run": None}, eval={"every": 0, "size": 64})
    if args.rl_lr is not None:
        rl["trainer"]["lr"] = args.rl_lr
    if tasks.is_file():
        rl["tasks"]["file"] = str(tasks)
    else:  # the demo's filter has not run here: the generated pool of the same arithmetic
        rl["tasks"].pop("file", None)
        rl["tasks"].pop("heldout", None)
    t0 = time.perf_counter()
    rep = rl_train(RLRunConfig.model_validate(rl))
    print(f"RL run: {rep.steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return step_folders(work / "delta-bench" / "checkpoints")


def step_folders(folder: Path) -> list[Path]:
    from intellect.storage import parse_step  # noqa: PLC0415 - loaded with the run's modules

    steps = sorted((n, p) for p in folder.iterdir() if (n := parse_step(p.name)) is not None and
                   (p / "model.safetensors").is_file())
    return [p for _, p in steps]


def inference_copy(src: Path, dest: Path, bf16: bool) -> Path:
    """``src``'s inference files in ``dest``; with ``bf16``, every float tensor rounded to bf16."""
    import torch  # noqa: PLC0415 - numpy has no bf16
    from safetensors.torch import load_file, save_file  # noqa: PLC0415 - with torch

    from intellect.checkpoints import inference_files  # noqa: PLC0415 - heavy (torch)

    dest.mkdir(parents=True)
    for name in inference_files(checkpoint_files(src)):
        if bf16 and name.endswith(".safetensors"):
            t = load_file(str(src / name))
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in t.items()},
                      str(dest / name))
        else:
            shutil.copyfile(src / name, dest / name)
    return dest


def bytes_table(copies: list[Path], work: Path) -> list[dict]:
    """Per consecutive pair: full and patch bytes, and the share of elements whose bits changed."""
    from intellect.shardcast.patch import checkpoint_digest  # noqa: PLC0415 - heavy (torch)

    rows = []
    for i, (a, b) in enumerate(zip(copies, copies[1:])):
        stats = make_patch(a, b, work / f"patch-{i}", checkpoint_digest(a))
        rows.append({"step": i + 1, "full_bytes": stats.full_bytes, "patch_bytes": stats.bytes,
                     "changed_share": stats.changed / max(1, stats.elements)})
        shutil.rmtree(work / f"patch-{i}")
    return rows


def end_to_end(copies: list[Path], work: Path, anchor_every: int, tag: str) -> list[dict]:
    """Publish every copy in turn through a real origin, relay and client; per step the bytes and seconds."""
    from intellect.shardcast.client import ShardcastClient  # noqa: PLC0415 - after the heavy imports
    from intellect.shardcast.config import ClientConfig, ShardcastConfig  # noqa: PLC0415
    from intellect.shardcast.local import start_local  # noqa: PLC0415
    from intellect.shardcast.origin import Origin  # noqa: PLC0415
    from intellect.trust.keys import SigningKey  # noqa: PLC0415

    key = SigningKey.from_seed(b"\x51" * 32)
    cfg = ShardcastConfig(local_relays=1, keep=3, anchor_every=anchor_every, shard_size=1 << 20)
    cdn = start_local(cfg, work / tag, key.public)
    origin = Origin(cdn.origin_dir, shard_size=cfg.shard_size, keep=cfg.keep, anchor_every=anchor_every)
    rows = []
    try:
        with ShardcastClient(cdn.relay_urls, ClientConfig(trainer_key=key.public.hex, seed=0, deadline=120)) as c:
            for v, folder in enumerate(copies):
                t0 = time.perf_counter()
                p = origin.publish(folder, v, key)
                while not c.versions().get(v):  # the relay mirrors it
                    time.sleep(0.01)
                stats = c.fetch(v, work / tag / "worker" / f"step_{v}")
                rows.append({"step": v, "encoding": p.encoding, "bytes": stats.bytes,
                             "seconds": time.perf_counter() - t0})
                if v >= 2:  # a worker keeps the newest few
                    shutil.rmtree(work / tag / "worker" / f"step_{v - 2}")
    finally:
        cdn.stop()
        shutil.rmtree(work / tag, ignore_errors=True)
    return rows


# ------------------------------------------------------------------ part 2: the Qwen2.5-0.5B shape


def qwen_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-0.5B's tensors (hidden 896, MLP 4864, 24 layers, 14 query and 2 key/value heads of 64, tied
    embeddings of a 151,936-token vocabulary)."""
    h, m, kv, vocab = 896, 4864, 128, 151_936
    out: list[tuple[str, tuple[int, ...]]] = [("embed_tokens", (vocab, h)), ("norm", (h,))]
    for i in range(24):
        p = f"layers.{i}."
        out += [(p + "q_proj.weight", (h, h)), (p + "q_proj.bias", (h,)), (p + "k_proj.weight", (kv, h)),
                (p + "k_proj.bias", (kv,)), (p + "v_proj.weight", (kv, h)), (p + "v_proj.bias", (kv,)),
                (p + "o_proj.weight", (h, h)), (p + "gate_proj", (m, h)), (p + "up_proj", (m, h)),
                (p + "down_proj", (h, m)), (p + "input_layernorm", (h,)), (p + "post_attention_layernorm", (h,))]
    return out


def qwen_steps(lr: float, steps: int, token_share: float, seed: int) -> list[dict]:
    """Per AdamW step: elements whose bf16 bits changed, and the patch bytes, over the whole model."""
    import torch  # noqa: PLC0415 - heavy

    torch.manual_seed(seed)
    b1, b2, eps = 0.9, 0.999, 1e-8
    changed, packed = [0] * steps, [0] * steps
    total = 0
    for name, shape in qwen_shapes():
        w = torch.ones(shape) if "norm" in name else (
            torch.zeros(shape) if name.endswith("bias") else torch.randn(shape) * 0.02)
        m, v = torch.zeros(shape), torch.zeros(shape)
        prev = w.to(torch.bfloat16)
        total += w.numel()
        for t in range(1, steps + 1):
            g = torch.randn(shape)
            if name == "embed_tokens":  # a batch's tokens: the other rows get no gradient
                g *= (torch.rand(shape[0], 1) < token_share)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
            w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
            cur = w.to(torch.bfloat16)
            got = diff_elements(prev.view(torch.int16).numpy().reshape(-1), cur.view(torch.int16).numpy().reshape(-1))
            if got is not None:
                changed[t - 1] += len(got[2]) // 2
                packed[t - 1] += len(got[1]) + len(got[2])
            prev = cur
    full = 2 * total
    return [{"step": t + 1, "changed_share": changed[t] / total, "patch_bytes": packed[t], "full_bytes": full}
            for t in range(steps)]


# ------------------------------------------------------------------ report


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rl_part(args, work: Path, out: dict) -> None:
    """Part 1: the RL run's checkpoints, their bytes as patches, and the end-to-end comparison."""
    ckpts = step_folders(Path(args.checkpoints)) if args.checkpoints else rl_checkpoints(args, work / "run")
    ckpts = ckpts[: args.steps + 1]
    fp32 = [inference_copy(p, work / "fp32" / p.name, bf16=False) for p in ckpts]
    bf16 = [inference_copy(p, work / "bf16" / p.name, bf16=True) for p in ckpts]
    out["rl_bytes"] = {"fp32": bytes_table(fp32, work), "bf16": bytes_table(bf16, work)}
    for kind, rows in out["rl_bytes"].items():
        share = median([r["patch_bytes"] / r["full_bytes"] for r in rows])
        print(f"RL run, {kind}: patch/full bytes per step, median of {len(rows)} steps {share:.2%}; "
              f"changed elements {median([r['changed_share'] for r in rows]):.2%} "
              f"(range {min(r['changed_share'] for r in rows):.2%}..{max(r['changed_share'] for r in rows):.2%})",
              flush=True)
    runs: dict[str, list[list[dict]]] = {"full": [], "patch": []}
    for r in range(args.repeats):
        for mode in (("full", "patch") if r % 2 == 0 else ("patch", "full")):
            runs[mode].append(end_to_end(bf16, work, 1 if mode == "full" else 10, f"{mode}-{r}"))
    out["end_to_end"] = runs
    per = {mode: {"seconds": median([row["seconds"] for rows in rs for row in rows if row["step"] > 0]),
                  "bytes": median([row["bytes"] for rows in rs for row in rows if row["step"] > 0])}
           for mode, rs in runs.items()}
    out["end_to_end_median"] = per
    print(f"end to end per step (bf16, steps 1..{len(bf16) - 1}, median over {args.repeats} rounds): full "
          f"{per['full']['bytes'] / 1e6:.2f} MB {per['full']['seconds'] * 1e3:.0f} ms, patch "
          f"{per['patch']['bytes'] / 1e6:.3f} MB {per['patch']['seconds'] * 1e3:.0f} ms -> bytes "
          f"{per['patch']['bytes'] / per['full']['bytes']:.2%}, time {per['patch']['seconds'] / per['full']['seconds']:.2f}x",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="from_dir", default="runs/demo-diloco/checkpoints/step_30",
                    help="HF checkpoint the RL run starts from (the demo's pretrained model: `intellect demo`).")
    ap.add_argument("--checkpoints", default=None, help="Measure this folder of step_<n> checkpoints, no RL run.")
    ap.add_argument("--steps", type=int, default=12, help="RL steps (checkpoints 1..steps after 0).")
    ap.add_argument("--rl-lr", type=float, default=None, help="The RL run's peak learning rate (default: the "
                    "demo config's, 1e-4, as every shipped RL config).")
    ap.add_argument("--repeats", type=int, default=3, help="Rounds of the end-to-end comparison.")
    ap.add_argument("--lrs", default="1e-4,3e-6", help="Learning rates of the 0.5B-shape part (comma-separated).")
    ap.add_argument("--qwen-steps", type=int, default=4, help="AdamW steps of the 0.5B-shape part (0: skip it).")
    ap.add_argument("--out", default=str(RESULTS / "delta_broadcast.json"), help="Where the figures go (JSON).")
    ap.add_argument("--parts", default="rl,qwen", help="Which parts to run: rl (the RL run), qwen (the 0.5B shape).")
    ap.add_argument("--token-share", type=float, default=0.03, help="Vocabulary share a step's batch touches.")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="intellect-delta-bench-"))
    out: dict = {"args": vars(args)}
    try:
        if "rl" in args.parts.split(","):
            rl_part(args, work, out)
        out["qwen"] = {}
        for lr in ([float(x) for x in args.lrs.split(",")] if "qwen" in args.parts.split(",") else []):
            t0 = time.perf_counter()
            rows = qwen_steps(lr, args.qwen_steps, args.token_share, seed=0)
            out["qwen"][str(lr)] = rows
            later = rows[1:] or rows  # the first AdamW step moves every weight by lr: not a steady step
            shares = ", ".join(f"{r['changed_share']:.2%}" for r in rows)
            print(f"Qwen2.5-0.5B shape, lr {lr:g}: changed bf16 elements per step {shares}; patch/full bytes, "
                  "median of steps 2.. "
                  f"{median([r['patch_bytes'] / r['full_bytes'] for r in later]):.2%} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
