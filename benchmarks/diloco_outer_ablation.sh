#!/usr/bin/env bash
# The outer-optimizer ablation on the real corpus: DiLoCo (4 workers, H=50, int8) vs DDP at the same lr,
# one arm per outer setting, each against the DDP curve of its seed (run once, then reused).
#   [WARM_START=N] [OUTER_STEPS=T] [BATCH=B] bash benchmarks/diloco_outer_ablation.sh OUT_DIR SEED LR "ARM=KEY=VALUE,KEY=VALUE" ...
# e.g. BATCH=16 WARM_START=300 bash benchmarks/diloco_outer_ablation.sh /tmp/abl 0 1.5e-3 "nest-0.7-0.5=" \
#          "nest-0.7-0.9=diloco.outer_momentum=0.9" "avg-1.0-0=diloco.outer_lr=1.0,diloco.outer_momentum=0.0,diloco.nesterov=false"
# (an arm with no knobs runs the defaults); its table and plot: benchmarks/diloco_ablation_table.py
set -euo pipefail
out=$1 seed=$2 lr=$3; shift 3
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
common=(--data text --outer-steps "${OUTER_STEPS:-20}" --batch-size "${BATCH:-8}" --warm-start "${WARM_START:-0}" --timeout 3600
        "train.lr=$lr" "data.seed=$seed" "model.init_seed=$seed")
tag=$(echo "s$seed-lr$lr" | tr . p)  # no dots: the benchmark takes --out's suffix off
if [ "${BATCH:-8}" != 8 ]; then tag="$tag-B$BATCH"; fi
if [ "${WARM_START:-0}" != 0 ]; then  # both arms from a checkpoint pretrained WARM_START steps, made once
    common+=(--warm-dir "$out/warm-$tag-w$WARM_START")
    tag="$tag-w$WARM_START"
fi
if [ "${OUTER_STEPS:-20}" != 20 ]; then tag="$tag-T$OUTER_STEPS"; fi
base="$out/ddp-$tag"
for spec in "$@"; do
    name=${spec%%=*} knobs=${spec#*=}
    dest="$out/$(echo "$name" | tr . p)-$tag"
    args=()
    IFS=, read -ra kv <<< "$knobs"
    for k in "${kv[@]}"; do [ -n "$k" ] && args+=(--diloco "$k"); done
    # every arm of one seed and lr reads the same DDP curve: the first arm's JSON is the cache
    [ -f "$base.json" ] && cp "$base.json" "$dest.json"
    "$py" benchmarks/diloco_vs_ddp.py "${common[@]}" --reuse-ddp --out "$dest" "${args[@]}" > "$dest.log" 2>&1
    [ -f "$base.json" ] || cp "$dest.json" "$base.json"
    grep -E "final held-out loss|DDP done|reused" "$dest.log" | sed "s|^|$name s$seed: |"
done
