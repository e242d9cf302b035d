#!/usr/bin/env bash
# On a lent GPU machine, vLLM staged (docs/measurements.md says how): the rows of this code tree
# against those of an earlier one, in every ES mode, with scripts/gpu_same_rows.py. Six engines
# share the card (three modes x two trees), each in its own process.
#   bash scripts/gpu_same_rows.sh OLD_TREE OUT     (OLD_TREE: a folder holding an earlier evolm_lib)
set -u
OLD=${1:?the folder holding the earlier evolm_lib}; OUT=${2:?where the rows and logs go}
SITE=${EVOLM_SITE:-/root/site}  # where the staged wheels were unpacked
mkdir -p "$OUT/logs"
export EVOLM_CACHE_DIR=${EVOLM_CACHE_DIR:-/root/cache} VLLM_USE_FLASHINFER_SAMPLER=0
# the embedded model is converted once, before six processes would race to do it
for tree in "$OLD" "$PWD"; do
  PYTHONPATH=$SITE:$tree python3 -c "from evolm_lib.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))"
done
pids=()
for mode in lora full eggroll; do
  PYTHONPATH=$SITE:$OLD python3 scripts/gpu_same_rows.py run --mode "$mode" --out "$OUT/old" \
    --gpu-memory-utilization 0.12 > "$OUT/logs/old_$mode.log" 2>&1 & pids+=($!)
  PYTHONPATH=$SITE:$PWD python3 scripts/gpu_same_rows.py run --mode "$mode" --out "$OUT/new" \
    --gpu-memory-utilization 0.12 > "$OUT/logs/new_$mode.log" 2>&1 & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || echo "a run ended with status $? (see $OUT/logs)"; done
PYTHONPATH=$SITE:$PWD python3 scripts/gpu_same_rows.py compare "$OUT/old" "$OUT/new" | tee "$OUT/compare.txt"
