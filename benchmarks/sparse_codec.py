"""Bits per parameter and error: top-k 2-bit with error feedback (intellect.diloco.sparse) vs int8
(intellect.diloco.quantize, raw and zstd-coded indices), on a stream of real pseudo-gradients.

Pseudo-gradients (``--source text``): the tiny text model of ``benchmarks/diloco_vs_ddp.py
--data text`` (its ``TEXT_DEFAULTS``, BPE tokenizer trained on the Python stdlib if missing) trains
single-process with AdamW; every ``--inner`` steps the difference of its weights before and after is
one pseudo-gradient (its flat concatenation: one all-reduce bucket). ``--source gaussian``: a fixed
N(0,1) direction plus fresh N(0,1) noise per phase, model-sized. Columns:

* bits/param: wire bytes * 8 / parameters (int8: ``to_bytes``; topk: ``sparse.encode``, its fixed-width
  indices and its Rice-coded ones);
* one-shot error: ||decode(x) - x|| / ||x|| of the first pseudo-gradient (topk: residual still 0,
  so this is the error of the codec without feedback);
* sum error: ||sum of decoded - sum of pseudo-gradients|| / ||sum of pseudo-gradients|| after all
  phases (int8 has no error feedback: its errors add up; topk's stay in the residual).

    .venv/bin/python benchmarks/sparse_codec.py [--source text|gaussian] [--phases 10] [--inner 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from intellect.diloco import sparse  # noqa: E402
from intellect.diloco.quantize import dequantize, quantize, to_bytes  # noqa: E402


def text_stream(phases: int, inner: int, batch: int, tokenizer: Path, vocab: int):
    """``phases`` pseudo-gradients of the tiny text model, ``inner`` AdamW steps each."""
    from diloco_vs_ddp import TEXT_DEFAULTS  # noqa: PLC0415 - heavy imports, only for --source text

    from intellect.config import load_config  # noqa: PLC0415
    from intellect.data.text import PackedStream  # noqa: PLC0415
    from intellect.diloco.config import DilocoRunConfig  # noqa: PLC0415
    from intellect.model.bpe import ensure_tokenizer  # noqa: PLC0415
    from intellect.model.checkpoint import build_model  # noqa: PLC0415
    from intellect.train import Trainer  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="intellect-sparse-") as tmp:
        run = load_config(DilocoRunConfig, environ={}, overrides=[
            "run_name=sparse", f"storage.url=file://{tmp}", *TEXT_DEFAULTS,
            f"model.tokenizer={tokenizer}", f"model.tokenizer_vocab={vocab}"])
        assert run.model.tokenizer is not None
        ensure_tokenizer(run.model.tokenizer, run.data, run.model.tokenizer_vocab)
        model, tok = build_model(run.model)
        cfg = run.train.model_copy(update={"steps": phases * inner, "batch_size": batch})
        trainer = Trainer(model, tok, cfg, compute=run.compute)
        data = PackedStream(run.data, tok)
        batches = iter(lambda: data.next_batch(batch), None)
        for _ in range(phases):
            before = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
            trainer.train_steps(inner, batches)
            after = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
            yield before - after


def gaussian_stream(phases: int, numel: int):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(numel, generator=g)
    for _ in range(phases):
        yield base + torch.randn(numel, generator=g)


def rel(y: torch.Tensor, x: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=["text", "gaussian"], default="text")
    ap.add_argument("--phases", type=int, default=10)
    ap.add_argument("--inner", type=int, default=20, help="AdamW steps per pseudo-gradient (--source text)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--numel", type=int, default=1 << 20, help="--source gaussian: values per pseudo-gradient")
    ap.add_argument("--tokenizer", type=Path, default=Path(tempfile.gettempdir()) / "intellect-bench-tok")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--k", type=int, nargs="+", default=[41, 64, 128], help="top-k per 4096-value chunk")
    a = ap.parse_args()

    t0 = time.perf_counter()
    stream = (text_stream(a.phases, a.inner, a.batch, a.tokenizer, a.vocab) if a.source == "text"
              else gaussian_stream(a.phases, a.numel))
    deltas = list(stream)
    n = deltas[0].numel()
    print(f"{len(deltas)} pseudo-gradients of {n} values ({a.source}) in {time.perf_counter() - t0:.1f} s")

    total = torch.stack(deltas).double().sum(dim=0)
    rows = []
    for codec in ("none", "zstd"):
        nbytes, errs, sent = 0, [], torch.zeros(n, dtype=torch.float64)
        for d in deltas:
            q = quantize(d)
            nbytes += len(to_bytes(q, codec=codec))
            y = dequantize(q)
            errs.append(rel(y, d))
            sent += y.double()
        rows.append((f"int8 ({'raw' if codec == 'none' else 'zstd'} indices)", 8 * nbytes / (n * len(deltas)),
                     errs[0], rel(sent, total)))
    for k, packed in ((k, packed) for k in a.k for packed in (False, True)):
        cfg = sparse.TopK(chunk=4096, k=k)
        residual = torch.zeros(n)
        nbytes, errs, sent = 0, [], torch.zeros(n, dtype=torch.float64)
        for d in deltas:
            s, residual = sparse.compress(residual, d, cfg)
            data = sparse.encode(s, cfg, packed=packed)
            nbytes += len(data)
            got = sparse.decode(data, n, cfg)
            assert isinstance(got, sparse.Sparse), got
            y = sparse.densify(got)
            errs.append(rel(y, d))
            sent += y.double()
        rows.append((f"topk {k}/4096 ({100 * k / 4096:.2f}%), 2-bit + EF, {'Rice-coded' if packed else '12-bit'} "
                     "indices", 8 * nbytes / (n * len(deltas)),
                     errs[0], rel(sent, total)))
    print(f"| codec | bits/param | x below fp32 | one-shot error | sum error after {len(deltas)} phases |")
    print("|---|---|---|---|---|")
    for name, bits, step, cum in rows:
        print(f"| {name} | {bits:.3f} | {32 / bits:.0f}x | {step:.3f} | {cum:.3f} |")


if __name__ == "__main__":
    main()
