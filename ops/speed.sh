#!/usr/bin/env bash
# The project's GPU speed measurements on an offline GPU host (vLLM staged: ops/README.md). Each is a
# `python -m evolm_lib.benchmark` or scripts/*.py command, stopped LIMIT seconds (default 560) after
# the start; the JSON and logs come back as one file, OUT/speed_MODE.tar.gz (files over 5 MB stay).
#
#   bash ops/speed.sh modes OUT   # card 0: LoRA population and EGGROLL against the base model, Qwen2.5-1.5B
#                                 # shapes, 15 interleaved rounds with the tiles `auto` picks, then vLLM's defaults
#   bash ops/speed.sh tiles OUT   # card 0: vLLM's LoRA tiles tuned for this card (scripts/tune_lora_kernels.py,
#                                 # kept in lora_kernel_configs/), then modes with vLLM's defaults and the tuned tiles
#   bash ops/speed.sh grpo OUT    # card 0: the labels' log-probabilities under deterministic algorithms, then the
#                                 # LoRA GRPO update, not deterministic against deterministic twice (same rows?)
#   bash ops/speed.sh pool OUT    # card 0: full-parameter ES at Qiu et al.'s settings, 1 engine against 4 (MPS=1:
#                                 # the 4 through CUDA's MPS)
#   bash ops/speed.sh start OUT   # card 0: an engine's start, Qwen2.5-1.5B shapes, CUDA-graph sizes derived and default
#   bash ops/speed.sh ray OUT     # every card: Ray, 1 engine against 4, populations 64 and 128 (Ray staged)
#   bash ops/speed.sh large OUT   # card 0: full-parameter ES on Qwen2.5-7B shapes (random, built first): the memory
#                                 # plan against the card's use, and a generation's time
#
# Run from the repository root with PYTHONPATH=SITE:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR set.
set -u
MODE=${1:-}
OUT=${2:-}
case "$MODE" in
modes | tiles | grpo | pool | start | ray | large) [ -n "$OUT" ] || { echo "$MODE OUT: no OUT folder given" >&2; exit 2; } ;;
*) sed -n '2,/^set -u$/{/^set -u$/!p}' "$0"; exit 2 ;;
esac
LIMIT=${LIMIT:-560}
RES=runs/speed_$MODE
mkdir -p "$RES" "$OUT"
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
nvidia-smi -L | tee "$RES/cards.txt"
git log -1 --format=%H > "$RES/commit.txt" 2>/dev/null
python -c "from evolm_lib.models import resolve_model; resolve_model('smollm2-135m-instruct')" > /dev/null
case "$MODE" in modes | tiles | start | ray) QWEN=$(python scripts/qwen_shape.py | tail -n 1) ;; esac
measure() {  # measure NAME CARDS COMMAND...: COMMAND --json RES/NAME.json, stopped at LIMIT
  local name=$1 cards=$2 left=$((LIMIT - SECONDS))
  shift 2
  if [ "$left" -lt 30 ]; then echo "$name: not started, $left s left" | tee -a "$RES/exits.txt"; return; fi
  CUDA_VISIBLE_DEVICES=$cards timeout --signal=TERM --kill-after=10 "$left" "$@" --json "$RES/$name.json" > "$RES/$name.log" 2>&1
  echo "$name: exit $? after $SECONDS s" | tee -a "$RES/exits.txt"
}
bench() { local name=$1 cards=$2; shift 2; measure "$name" "$cards" python -m evolm_lib.benchmark "$@"; }
case "$MODE" in
modes)
  for tiles in auto default; do
    bench "modes_$tiles" 0 modes --model "$QWEN" --modes eggroll,lora --tiles $tiles --repeats 15 --no-update --interleave
  done ;;
tiles)
  measure tune_tiles 0 python scripts/tune_lora_kernels.py --model-dir "$QWEN" --ranks 1 --num-tokens 256,2048 \
    --num-loras 32 --max-loras 68 --out "$RES/lora_kernel_configs"
  bench modes_default 0 modes --model "$QWEN" --modes eggroll,lora --tiles default --repeats 3 --no-update
  # a folder of tuned tiles is what --tiles auto reads first
  [ -d "$RES/lora_kernel_configs" ] && VLLM_TUNED_CONFIG_FOLDER=$PWD/$RES/lora_kernel_configs \
    bench modes_tuned 0 modes --model "$QWEN" --modes eggroll,lora --tiles auto --repeats 3 --no-update ;;
grpo)
  bench label_logits 0 label-logits
  bench grpo_update 0 grpo-update --micro-batch-sizes 64,8 --steps 8 --policy-weights lora \
    --configurations not_deterministic,deterministic_own,deterministic_own_rerun ;;
pool)
  if [ "${MPS:-0}" = 1 ]; then . "$(dirname "$0")/mps.sh" && mps_start && export $(mps_vars) || exit 1; fi
  bench full_pool 0 full-pool --engines 1,4 --generations 5 --kv-cache-gb 2 --workdir "$RES/pool_runs" ;;
start) bench engine_start 0 engine-start --model "$QWEN" ;;
large)
  QWEN7=$(python scripts/qwen_shape.py --shape 7b | tail -n 1)
  bench full_memory 0 full-memory --model "$QWEN7" --population 8 --prompts 2 --new-tokens 64 --generations 2 \
    --gpu-memory-utilization 0.3 --kv-cache-gb 2 ;;
ray)
  all=$(awk '{print NR - 1}' "$RES/cards.txt" | paste -sd, -)
  bench ray "$all" ray --model "$QWEN" --engines 1,4 --population 64,128 --repeats 2 ;;
esac
find "$RES" -type f -size +5M > "$RES/left_out.txt"  # checkpoints of the pool's run folders
tar -czf "$OUT/speed_$MODE.tar.gz" -X "$RES/left_out.txt" "$RES"
for f in "$RES"/*.log; do echo "== $f"; tail -n 20 "$f"; done
