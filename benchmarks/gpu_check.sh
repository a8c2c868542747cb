#!/usr/bin/env bash
# The GPU check: one run of at most 9 minutes (the step limits below, each plus GRACE, add to under
# 540 s: a lent GPU machine runs one command for at most 600 s) on a machine with a CUDA GPU:
#   wheels     on a machine without .venv (the lent GPU machine: its own python3 and torch, no
#              network), the packages its image lacks, installed from .whl/ into /tmp/site
#              (benchmarks/gpu_wheels.txt; fetch them with `bash benchmarks/gpu_wheels.sh`);
#   preflight  versions (python, torch, CUDA, GPUs), torch against pyproject's range, and every module of
#              intellect/, flows/, tasks/ imports, each failure named (benchmarks/gpu_preflight.py);
#   tests      the tests marked `gpu` in tests/gpu/: the DiLoCo outer state in pinned host memory and a
#              2-worker bf16-mixed DiLoCo run on CUDA over gloo (test_diloco_cuda.py); the RL trainer,
#              engine, TOPLOC proofs and RL steps on CUDA (test_rl_cuda.py); a bf16-mixed step of the
#              sharded GRPO trainer against the one-process one (test_rl_trainer_ranks_cuda.py); the int8 all-reduce over an
#              NCCL group (test_nccl_allreduce.py: 2 GPUs; on one GPU it is skipped, NCCL refuses two
#              ranks on one device);
#   tokenizer  the byte-level BPE tokenizer of the text runs, trained on the standard library's source;
#   smoke      a short bf16-mixed smoke run of a ~150M Llama (llama-150m preset) on that source;
#   diloco     a 2-worker DiLoCo run of the same model (one GPU each when there are two, else both on GPU 0);
#   fsdp       one DiLoCo worker of 2 ranks (FSDP2 over NCCL, diloco.ranks_per_worker = 2) of that model,
#              with its peak memory per GPU: needs 2 GPUs, else skipped;
# then prints each step's status and the tokens/s and MFU lines of the two runs last. A failed step
# does not stop the ones after it (one call tells all). Exit status: 0 all passed, 1 a step failed,
# 2 no CUDA device. Figures on a GPU are quoted only from this script.
#   bash benchmarks/gpu_check.sh      (from anywhere; uses .venv/bin/python when there is one, else python3)
# On the lent GPU machine (docs/deploy.md, "The GPU check"): fetch the wheels here first, then
#   device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 600
# Its logs (at most 8 files) are copied into $OUT when it is set, where that machine returns them.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
mkdir -p "${GPU_CHECK_LOGS:-runs/gpu-check}"
LOGS=$(cd "${GPU_CHECK_LOGS:-runs/gpu-check}" && pwd)  # absolute: worker processes may start elsewhere
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
GRACE=5  # seconds between a step's SIGTERM and its SIGKILL

if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
# Workers are started as `python -m ...` subprocesses, so the source tree (and the carried wheels) go on
# PYTHONPATH rather than relying on this shell's working directory.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

STATUS=()
FAILED=0
# run_step NAME SECONDS COMMAND...: the command under a time limit, its output shown and kept in $LOGS/NAME.txt
run_step() {
  local name=$1 limit=$2 start rc what
  shift 2
  echo "== $name (limit ${limit} s)"
  start=$SECONDS
  timeout -k "$GRACE" "$limit" "$@" 2>&1 | tee "$LOGS/$name.txt"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then what=ok; elif ((rc == 124 || rc == 137)); then what="TIMED OUT"; else what="FAILED (exit $rc)"; fi
  STATUS+=("$(printf '%-10s %-16s %4d s' "$name" "$what" $((SECONDS - start)))")
  ((rc == 0)) || FAILED=1
  return "$rc"
}

echo "gpu_check: python $PYTHON, logs in $LOGS"
if [[ $PYTHON != .venv/bin/python ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  run_step wheels 45 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PYTHONPATH"
elif [[ $PYTHON != .venv/bin/python ]]; then
  echo "gpu_check: no .venv and no wheels in $WHEELS/: the project's packages must already be in $PYTHON" \
       "(else fetch them here with 'bash benchmarks/gpu_wheels.sh' and carry $WHEELS)" >&2
fi

run_step preflight 45 "$PYTHON" benchmarks/gpu_preflight.py
case $? in
  0) ;;
  2) echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2; exit 2 ;;
  *) echo "gpu_check: the preflight failed (above); the steps below run anyway, to show how far it gets" >&2 ;;
esac

run_step tests 130 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/gpu

TOKENIZER=$LOGS/tokenizer-stdlib-8k
CLI=("$PYTHON" -m flows.cli)
MODEL=(model.preset=llama-150m model.max_position_embeddings=1024 model.tokenizer="$TOKENIZER"
       compute.device=auto compute.precision=bf16-mixed storage.url="file://$LOGS/runs")
rm -rf "$LOGS/runs"  # a run that exists is resumed, not measured again
run_step tokenizer 40 "${CLI[@]}" tokenizer train --config configs/pretrain-text.toml --out "$TOKENIZER" --force

# llama-150m, 60 steps of 16 x 1024 tokens, bf16-mixed
run_step smoke 100 "${CLI[@]}" smoke --config configs/pretrain-text.toml "${MODEL[@]}" run_name=gpu-smoke \
  train.steps=60 train.batch_size=16 data.text.seq_len=1024 train.warmup_steps=10

# 2 workers, llama-150m, bf16-mixed, 2 outer steps of 20 inner steps (each all-reduces 150M values on the CPU)
run_step diloco 90 "${CLI[@]}" diloco --config configs/diloco-text.toml "${MODEL[@]}" run_name=gpu-diloco \
  diloco.workers=2 diloco.inner_steps=20 diloco.outer_steps=2 train.batch_size=8 data.text.seq_len=1024 \
  train.warmup_steps=10

# one worker of 2 ranks (FSDP2 over NCCL, one GPU each), llama-150m: needs 2 GPUs
if (( $("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0) >= 2 )); then
  run_step fsdp 50 "${CLI[@]}" diloco --config configs/diloco-text.toml "${MODEL[@]}" run_name=gpu-fsdp \
    diloco.workers=1 diloco.ranks_per_worker=2 diloco.inner_steps=20 diloco.outer_steps=2 train.batch_size=8 \
    data.text.seq_len=1024 train.warmup_steps=10
else
  STATUS+=("$(printf '%-10s %-16s %4d s' fsdp "skipped (1 GPU)" 0)")
fi

{
  echo "== steps"
  printf '%s\n' "${STATUS[@]}"
  echo "== figures (tokens/s, MFU)"
  grep -h "^Pretraining: " "$LOGS/smoke.txt" 2>/dev/null | sed 's/^/smoke  /'
  grep -h "committed: {" "$LOGS/diloco.txt" 2>/dev/null |
    sed -E "s/.*(outer step [0-9]+\/[0-9]+) committed.*'tokens_per_s': ([0-9.]+), 'mfu': ([0-9.]+).*/diloco \1: \2 tokens\/s, MFU \3 (a fraction)/"
  grep -h "committed: {" "$LOGS/fsdp.txt" 2>/dev/null |
    sed -E "s/.*(outer step [0-9]+\/[0-9]+) committed.*'tokens_per_s': ([0-9.]+), 'mfu': ([0-9.]+), 'device_memory_mb': ([0-9.]+).*/fsdp \1: \2 tokens\/s, MFU \3, peak GPU memory \4 MiB/"
} > "$LOGS/summary.txt"
if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then  # the device machine returns what is in $OUT (8 files at most)
  cp "$LOGS"/*.txt "$OUT"/
  tar -czf "$OUT/diloco-worker-logs.tgz" -C "$LOGS/runs" gpu-diloco/logs 2>/dev/null || true
fi
cat "$LOGS/summary.txt"
exit "$FAILED"
