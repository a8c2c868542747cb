"""Weight patches vs full checkpoints through SHARDCAST: bytes per RL step and end-to-end time, side by side.

Part 1, a real RL run. The demo's RL phase (``configs/demo.toml`` ``[rl]``: GRPO, AdamW at lr 1e-4,
the rate every shipped RL config uses) runs ``--steps`` steps from the demo's pretrained model
(``--from``), writing a checkpoint per step (``--checkpoints DIR`` measures an existing run's
checkpoints instead). For each pair of consecutive checkpoints, as published (float32, or bf16 with
``--inference-dtype bf16``) and as a bf16 inference copy (each float tensor rounded to bf16), the bytes of the full
checkpoint and of the weight patch (``intellect.shardcast.patch``) in each of ``--encodings``, and
the share of elements whose bits changed. Then the bf16 copies go through a real origin process, one
relay process and a client on 127.0.0.1 (``intellect.shardcast.origin.Origin``, ``ShardcastClient``),
once every version full (``anchor_every = 1``) and once as patches of each encoding (``anchor_every =
10``), in rotating order over ``--repeats`` rounds: per step, publish + relay mirror + client fetch +
rebuild, timed.

Part 2, the Qwen2.5-0.5B shape (494M parameters, tied embeddings): float32 master weights under
AdamW (betas 0.9/0.999, no weight decay, as the RL trainer's default) on synthetic gradients (Gaussian;
the embedding's rows nonzero only for a random ``--token-share`` of the vocabulary per step, as a
batch touches few tokens), at each ``--lrs``; per step the share of bf16 elements whose bits
changed and the patch bytes of each encoding (the codec's own packing, ``diff_elements``, and the
seconds it took) against the 988 MB bf16 checkpoint. One tensor at a time, so it fits a small machine.

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

from intellect.shardcast.header import PatchEncoding  # noqa: E402
from intellect.shardcast.patch import FORMATS, checkpoint_files, diff_elements, make_patch  # noqa: E402


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
    if args.inference_dtype is not None:
        rl["trainer"]["inference_dtype"] = args.inference_dtype
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


def bytes_table(copies: list[Path], work: Path, encodings: list[PatchEncoding]) -> list[dict]:
    """Per consecutive pair: full bytes, patch bytes per encoding, and the share of elements whose bits changed."""
    from intellect.shardcast.patch import checkpoint_digest  # noqa: PLC0415 - heavy (torch)

    rows = []
    for i, (a, b) in enumerate(zip(copies, copies[1:])):
        row: dict = {"step": i + 1, "patch_bytes": {}}
        for enc in encodings:
            stats = make_patch(a, b, work / f"patch-{i}", checkpoint_digest(a), enc)
            row.update(full_bytes=stats.full_bytes, changed_share=stats.changed / max(1, stats.elements))
            row["patch_bytes"][enc] = stats.bytes
            shutil.rmtree(work / f"patch-{i}")
        row["value_bytes"] = value_codings(a, b)
        rows.append(row)
    return rows


def value_codings(a: Path, b: Path) -> dict[str, int]:
    """Bytes of the changed elements' values of ``b`` against ``a`` (``model.safetensors``) under other
    codings beside bitpatch-v2's (``diff``: the zigzag difference in byte planes, run-length deflate):
    raw (bitpatch-v1), the XOR with the base's bits deflated as is (``xor``) and in byte planes with
    v2's strategy (``xor_planes``)."""
    import zlib  # noqa: PLC0415 - only this comparison

    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415 - heavy
    from safetensors.torch import load_file  # noqa: PLC0415 - with torch

    from intellect.shardcast.patch import code_values  # noqa: PLC0415

    def deflate(data: bytes, strategy: int) -> int:
        z = zlib.compressobj(1, zlib.DEFLATED, zlib.MAX_WBITS, 8, strategy)
        return len(z.compress(data) + z.flush())

    def planes(x: np.ndarray) -> bytes:
        return np.ascontiguousarray(x.view(np.uint8).reshape(-1, x.itemsize)[:, ::-1].T).tobytes()

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy has no bf16: the bits as integers
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    out = {"changed": 0, "raw": 0, "xor": 0, "xor_planes": 0, "diff": 0}
    for name, x in ta.items():
        size = x.element_size()
        old = x.contiguous().view(ints[size]).reshape(-1).numpy().view(f"<u{size}")
        new = tb[name].contiguous().view(ints[size]).reshape(-1).numpy().view(f"<u{size}")
        idx = np.flatnonzero(old != new)
        if not idx.size:
            continue
        o, n = old[idx], new[idx]
        out["changed"] += idx.size
        out["raw"] += n.nbytes
        out["xor"] += deflate((o ^ n).tobytes(), zlib.Z_DEFAULT_STRATEGY)
        out["xor_planes"] += deflate(planes(o ^ n), zlib.Z_RLE)
        out["diff"] += deflate(code_values(o, n), zlib.Z_RLE)
    return out


def end_to_end(copies: list[Path], work: Path, anchor_every: int, tag: str,
               encoding: PatchEncoding = "bitpatch-v2") -> list[dict]:
    """Publish every copy in turn through a real origin, relay and client; per step the bytes and seconds."""
    from intellect.shardcast.client import ShardcastClient  # noqa: PLC0415 - after the heavy imports
    from intellect.shardcast.config import ClientConfig, ShardcastConfig  # noqa: PLC0415
    from intellect.shardcast.local import start_local  # noqa: PLC0415
    from intellect.shardcast.origin import Origin  # noqa: PLC0415
    from intellect.trust.keys import SigningKey  # noqa: PLC0415

    key = SigningKey.from_seed(b"\x51" * 32)
    cfg = ShardcastConfig(local_relays=1, keep=3, anchor_every=anchor_every, shard_size=1 << 20)
    cdn = start_local(cfg, work / tag, key.public)
    origin = Origin(cdn.origin_dir, shard_size=cfg.shard_size, keep=cfg.keep, anchor_every=anchor_every,
                    patch_encoding=encoding)
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


def qwen_steps(lr: float, steps: int, token_share: float, seed: int, encodings: list[PatchEncoding]) -> list[dict]:
    """Per AdamW step: elements whose bf16 bits changed, and each encoding's patch bytes and seconds to
    make it, over the whole model."""
    import torch  # noqa: PLC0415 - heavy

    torch.manual_seed(seed)
    b1, b2, eps = 0.9, 0.999, 1e-8
    changed = [0] * steps
    packed = {enc: [0] * steps for enc in encodings}
    seconds = {enc: [0.0] * steps for enc in encodings}
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
            old, new = prev.view(torch.int16).numpy().view("<u2"), cur.view(torch.int16).numpy().view("<u2")
            for enc in encodings:
                t0 = time.perf_counter()
                got = diff_elements(old, new, enc)
                seconds[enc][t - 1] += time.perf_counter() - t0
                if got is not None:
                    changed[t - 1] += got[0] if enc == encodings[0] else 0
                    packed[enc][t - 1] += len(got[2]) + len(got[3])
            prev = cur
    full = 2 * total
    return [{"step": t + 1, "changed_share": changed[t] / total, "full_bytes": full,
             "patch_bytes": {enc: packed[enc][t] for enc in encodings},
             "encode_seconds": {enc: seconds[enc][t] for enc in encodings}} for t in range(steps)]


# ------------------------------------------------------------------ report


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rl_part(args, work: Path, out: dict) -> None:
    """Part 1: the RL run's checkpoints, their bytes as patches, and the end-to-end comparison."""
    ckpts = step_folders(Path(args.checkpoints)) if args.checkpoints else rl_checkpoints(args, work / "run")
    ckpts = ckpts[: args.steps + 1]
    published = [inference_copy(p, work / "published" / p.name, bf16=False) for p in ckpts]
    bf16 = [inference_copy(p, work / "bf16" / p.name, bf16=True) for p in ckpts]
    encodings = args.encodings
    out["rl_bytes"] = {"published": bytes_table(published, work, encodings), "bf16": bytes_table(bf16, work, encodings)}
    for kind, rows in out["rl_bytes"].items():
        shares = ", ".join(f"{enc} {median([r['patch_bytes'][enc] / r['full_bytes'] for r in rows]):.2%}"
                           for enc in encodings)
        print(f"RL run, {kind}: patch/full bytes per step, median of {len(rows)} steps: {shares}; "
              f"changed elements {median([r['changed_share'] for r in rows]):.2%} "
              f"(range {min(r['changed_share'] for r in rows):.2%}..{max(r['changed_share'] for r in rows):.2%})",
              flush=True)
        per = {k: median([r["value_bytes"][k] / max(1, r["value_bytes"]["changed"]) for r in rows])
               for k in rows[0]["value_bytes"] if k != "changed"} if rows else {}
        print(f"  values' bytes per changed element, median: {', '.join(f'{k} {v:.3f}' for k, v in per.items())}",
              flush=True)
    modes = ["full", *encodings]
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
    for r in range(args.repeats):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # each mode first in turn
            runs[mode].append(end_to_end(bf16, work, 1, f"{mode}-{r}") if mode == "full" else
                              end_to_end(bf16, work, 10, f"{mode}-{r}", mode))
    out["end_to_end"] = runs
    per = {mode: {"seconds": median([row["seconds"] for rows in rs for row in rows if row["step"] > 0]),
                  "bytes": median([row["bytes"] for rows in rs for row in rows if row["step"] > 0]),
                  "rounds_seconds": [median([row["seconds"] for row in rows if row["step"] > 0]) for rows in rs]}
           for mode, rs in runs.items()}
    out["end_to_end_median"] = per
    full = per["full"]
    print(f"end to end per step (bf16, steps 1..{len(bf16) - 1}, median over {args.repeats} rounds): full "
          f"{full['bytes'] / 1e6:.3f} MB {full['seconds'] * 1e3:.0f} ms", flush=True)
    for enc in encodings:
        p = per[enc]
        print(f"  {enc}: {p['bytes'] / 1e6:.3f} MB {p['seconds'] * 1e3:.0f} ms (rounds "
              f"{', '.join(f'{s * 1e3:.0f}' for s in p['rounds_seconds'])}) -> bytes {p['bytes'] / full['bytes']:.2%}, "
              f"time {p['seconds'] / full['seconds']:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="from_dir", default="runs/demo-diloco/checkpoints/step_30",
                    help="HF checkpoint the RL run starts from (the demo's pretrained model: `intellect demo`).")
    ap.add_argument("--checkpoints", default=None, help="Measure this folder of step_<n> checkpoints, no RL run.")
    ap.add_argument("--steps", type=int, default=12, help="RL steps (checkpoints 1..steps after 0).")
    ap.add_argument("--rl-lr", type=float, default=None, help="The RL run's peak learning rate (default: the "
                    "demo config's, 1e-4, as every shipped RL config).")
    ap.add_argument("--inference-dtype", default=None, choices=["fp32", "bf16"], help="The RL run's "
                    "trainer.inference_dtype (default: the demo config's): bf16 measures the checkpoints as the "
                    "trainer publishes them, not copies rounded afterwards.")
    ap.add_argument("--repeats", type=int, default=3, help="Rounds of the end-to-end comparison.")
    ap.add_argument("--lrs", default="1e-4,3e-6", help="Learning rates of the 0.5B-shape part (comma-separated).")
    ap.add_argument("--qwen-steps", type=int, default=4, help="AdamW steps of the 0.5B-shape part (0: skip it).")
    ap.add_argument("--out", default=str(RESULTS / "delta_broadcast.json"), help="Where the figures go (JSON).")
    ap.add_argument("--parts", default="rl,qwen", help="Which parts to run: rl (the RL run), qwen (the 0.5B shape).")
    ap.add_argument("--token-share", type=float, default=0.03, help="Vocabulary share a step's batch touches.")
    ap.add_argument("--encodings", default=",".join(FORMATS), help="Patch encodings to measure side by side "
                    "(comma-separated, of: " + ", ".join(FORMATS) + ").")
    args = ap.parse_args()
    args.encodings = [e for e in args.encodings.split(",") if e]
    if not args.encodings or not set(args.encodings) <= set(FORMATS):
        ap.error(f"--encodings: one or more of {', '.join(FORMATS)}")
    work = Path(tempfile.mkdtemp(prefix="intellect-delta-bench-"))
    out: dict = {"args": vars(args)}
    try:
        if "rl" in args.parts.split(","):
            rl_part(args, work, out)
        out["qwen"] = {}
        for lr in ([float(x) for x in args.lrs.split(",")] if "qwen" in args.parts.split(",") else []):
            t0 = time.perf_counter()
            rows = qwen_steps(lr, args.qwen_steps, args.token_share, 0, args.encodings)
            out["qwen"][str(lr)] = rows
            shares = ", ".join(f"{r['changed_share']:.2%}" for r in rows)
            print(f"Qwen2.5-0.5B shape, lr {lr:g}: changed bf16 elements per step {shares} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            for enc in args.encodings:
                share = [r["patch_bytes"][enc] / r["full_bytes"] for r in rows]
                per_changed = [r["patch_bytes"][enc] / (r["changed_share"] * r["full_bytes"] / 2) for r in rows]
                secs = [r["encode_seconds"][enc] for r in rows]
                print(f"  {enc}: patch/full bytes per step {', '.join(f'{x:.2%}' for x in share)}; bytes per "
                      f"changed element {', '.join(f'{x:.2f}' for x in per_changed)}; encode s per step "
                      f"{', '.join(f'{x:.1f}' for x in secs)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
