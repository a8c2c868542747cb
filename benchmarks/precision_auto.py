"""First contact: `intellect smoke --config configs/pretrain-text.toml` with its shipped
``compute.precision = "auto"``, side by side with the same command forced to fp32 (the baseline) and
to bf16-mixed (what the config said before ``auto``), in one run, as a new user would type them.

Each arm is the real CLI in its own process (so each decides ``auto`` afresh and logs why), on a
shared tokenizer trained by a first, untimed run; ``auto`` and fp32 alternate for ``--repeats`` rounds
so the machine's load falls on both alike, and the medians of their training tokens/s and their ratios
to fp32 are printed. The bf16-mixed arm (the "before") runs once, for ``--before-steps`` steps: on a CPU
that emulates bf16 a step takes tens of seconds. The acceptance: ``auto`` reaches at least half of fp32's tokens/s on a
CPU without native bf16, and never runs slower than the faster of the two fixed precisions by much.

``--emulate-avx2`` runs every arm as a CPU without native bf16 would: ``ONEDNN_MAX_CPU_ISA=AVX2``
(oneDNN's matmuls, which do torch's bf16 work on the CPU, use AVX2 at most) and
``ATEN_CPU_CAPABILITY=avx2`` (torch's own kernels likewise), so a machine with AMX can measure what an
AVX2-only laptop gets.

    python benchmarks/precision_auto.py --steps 30 --repeats 3 [--emulate-avx2]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/pretrain-text.toml"
# the smoke report's pretraining line: "... (2,554 tokens/s, MFU 39.30%, cpu bf16-mixed)"
RATE = re.compile(r"\(([\d,]+) tokens/s, MFU ([\d.]+%|n/a), (\S+) (fp32|bf16-mixed|bf16)\)")
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def smoke(folder: Path, name: str, precision: str | None, steps: int, env: dict[str, str],
          timeout: float) -> tuple[float, str, str, str]:
    """One `intellect smoke` run: (training tokens/s, MFU, precision it ran in, its precision log line)."""
    args = [sys.executable, "-m", "flows.cli", "smoke", "--config", CONFIG, f"run_name={name}",
            f"storage.url=file://{folder / 'runs'}", f"model.tokenizer={folder / 'tokenizer'}",
            f"train.steps={steps}", "train.warmup_steps=5", "checkpoint_every=0", "data.text.eval_sequences=8"]
    if precision is not None:
        args.append(f"compute.precision={precision}")
    t0 = time.perf_counter()
    out = subprocess.run(args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    text = out.stdout + out.stderr
    match = RATE.search(text)
    if out.returncode or match is None:
        raise SystemExit(f"{name} failed ({out.returncode}) after {time.perf_counter() - t0:.0f} s:\n{text[-3000:]}")
    said = next((line.strip() for line in text.splitlines() if "precision" in line and ("auto ->" in line
                 or "would choose" in line)), "")
    return float(match.group(1).replace(",", "")), match.group(2), match.group(4), said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the arms, alternated")
    ap.add_argument("--emulate-avx2", action="store_true", help="run every arm as a CPU without native bf16")
    ap.add_argument("--before-steps", type=int, default=5, help="steps of the one bf16-mixed run (0: none)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    a = ap.parse_args()
    env = AVX2_ENV if a.emulate_avx2 else {}
    arms = ["auto", "fp32"] + (["bf16-mixed"] if a.before_steps else [])
    import torch  # noqa: PLC0415 - only to say what this machine reports

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}, emulate AVX2: {a.emulate_avx2}")
    with tempfile.TemporaryDirectory(prefix="precision-auto-") as tmp:
        folder = Path(tmp)
        smoke(folder, "tokenizer", "fp32", 1, env, a.timeout)  # trains the shared tokenizer, untimed
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        for r in range(a.repeats):
            for arm in arms if r == 0 else arms[:2]:
                steps = a.before_steps if arm == "bf16-mixed" else a.steps
                tps, mfu, ran, said = smoke(folder, f"{arm}-{r}", None if arm == "auto" else arm, steps, env,
                                            a.timeout)
                rates[arm].append(tps)
                print(f"round {r} {arm:>10}: {tps:>8,.0f} tokens/s  MFU {mfu:>7}  ran {ran}  {said}", flush=True)
    base = statistics.median(rates["fp32"]) if "fp32" in rates else None
    print("\narm         median tokens/s   / fp32")
    for arm in arms:
        med = statistics.median(rates[arm])
        print(f"{arm:>10}  {med:>15,.0f}   {med / base:.2f}x" if base else f"{arm:>10}  {med:>15,.0f}")


if __name__ == "__main__":
    main()
