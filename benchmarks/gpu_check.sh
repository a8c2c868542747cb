#!/usr/bin/env bash
# The GPU check: on a machine with at least one CUDA GPU, in under 10 minutes,
#   1. the tests marked `gpu` (CUDA device, autocast on CUDA, NCCL transport, pinned buffers);
#   2. a short bf16-mixed smoke run of a ~150M Llama (llama-150m preset) on the standard library's source;
#   3. a 2-worker DiLoCo run of the same model (one GPU each when there are two, else both on GPU 0);
# and prints tokens/s and MFU from each run's report. Figures on a GPU are quoted only from this script.
#   bash benchmarks/gpu_check.sh            (from the repository root, after `make venv`)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"

if ! "$BIN/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2
  exit 2
fi
"$BIN/python" -c 'import torch; print("device:", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'

echo "== gpu tests"
timeout 240 "$BIN/python" -m pytest -q -p no:cacheprovider -m gpu tests/gpu

MODEL=(model.preset=llama-150m model.max_position_embeddings=1024 compute.device=auto compute.precision=bf16-mixed
       storage.url="file://./$OUT")
echo "== smoke: llama-150m, bf16-mixed, 60 steps"
timeout 200 "$BIN/intellect" smoke --config configs/pretrain-text.toml "${MODEL[@]}" run_name=gpu-smoke \
  train.steps=60 train.batch_size=16 data.text.seq_len=1024 train.warmup_steps=10 | tee "$OUT/smoke.txt"

echo "== DiLoCo: 2 workers, llama-150m, bf16-mixed, 3 outer steps of 20 inner steps"
timeout 240 "$BIN/intellect" diloco --config configs/diloco-text.toml "${MODEL[@]}" run_name=gpu-diloco \
  diloco.workers=2 diloco.inner_steps=20 diloco.outer_steps=3 train.batch_size=8 data.text.seq_len=1024 \
  train.warmup_steps=10 | tee "$OUT/diloco.txt"

echo "== figures (tokens/s, MFU)"
grep -hiE "tokens/s|mfu|utilization" "$OUT/smoke.txt" "$OUT/diloco.txt" || true
