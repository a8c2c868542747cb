"""A worker taking a new policy: the engine's weights updated in place against the engine rebuilt.

Ours: :meth:`TorchEngine.update_weights` of the new checkpoint folder (safetensors read, copied into
the running model). Baseline: a fresh engine of the folder for each policy
(:meth:`TorchEngine.from_folder`: the model built by transformers, copied out of the mapped file,
placed, wrapped). Both read the same folder from the page cache, on the same model, in the
same process; each is timed ``--repeats`` times, alternating, and the medians (and the best) are
printed with their ratio. The model is a preset of the project (``--arch``, ``--hidden`` ...), built
untrained: loading cost does not depend on the values.

    python benchmarks/weight_update.py --repeats 7 --hidden 512 --layers 8 [--precision bf16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from intellect.config import ComputeConfig, ModelConfig
from intellect.inference.engines import make_engine
from intellect.model.checkpoint import build_model, parameter_count, save_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_heads=max(1, args.hidden // 64),
                      num_kv_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden)
    compute = ComputeConfig(device="cpu", precision=args.precision)
    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for seed in (1, 2):
            model, tok = build_model(cfg.model_copy(update={"init_seed": seed}))
            folders.append(save_checkpoint(model, tok, Path(tmp) / f"step_{seed}"))
        params = parameter_count(model)
        engine = make_engine("torch", folders[0], compute)
        make_engine("torch", folders[1], compute)  # warm: imports, page cache
        inplace, rebuild = [], []
        for i in range(args.repeats):
            folder = folders[i % 2]
            t0 = time.perf_counter()
            engine.update_weights(folder)
            inplace.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            make_engine("torch", folder, compute)
            rebuild.append(time.perf_counter() - t0)
    med_in, med_re = statistics.median(inplace), statistics.median(rebuild)
    print(f"model: {params / 1e6:.1f} M parameters ({args.layers} layers, hidden {args.hidden}), {args.precision}, "
          f"{args.threads} thread(s), {args.repeats} repeats")
    print(f"in place (update_weights): median {med_in * 1e3:8.1f} ms  best {min(inplace) * 1e3:8.1f} ms")
    print(f"rebuilt  (from_folder):    median {med_re * 1e3:8.1f} ms  best {min(rebuild) * 1e3:8.1f} ms")
    print(f"rebuild / in place: {med_re / med_in:.2f}x (median)")
    assert engine.stats.weight_updates == args.repeats


if __name__ == "__main__":
    main()
