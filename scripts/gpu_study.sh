#!/usr/bin/env bash
# The five-seed study (issue 20) on one lent machine of 4 GPUs, vLLM staged (../shared/GPU.md):
# papermill_runs/study_{addition,conciseness}_smollm2_gpu.yaml, one `evolm sweep --methods M --seeds S`
# process per line below, spread round-robin over the cards (SmolLM2 leaves a card mostly idle,
# so several engines share one: gpu_memory_utilization 0.12 in the specs). Each process stops after
# LIMIT seconds (SIGTERM; runs resume from their checkpoints), so a second call on the warm
# machine continues what the first did not finish. The run folders (no weights) come back in
# $OUT/study.tgz, the processes' logs in $OUT/logs.tgz.
#   bash scripts/gpu_study.sh 500        # every method
#   bash scripts/gpu_study.sh 500 grpo   # GRPO alone, a process per seed
set -u
LIMIT=${1:-500}
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR=/root/cache
export VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false
nvidia-smi -L
GPUS=$(nvidia-smi -L | wc -l)
python -c "from evolm_lib.models import resolve_model; resolve_model('smollm2-135m-instruct')" >/dev/null 2>&1
A=papermill_runs/study_addition_smollm2_gpu.yaml
C=papermill_runs/study_conciseness_smollm2_gpu.yaml
# name spec methods seeds   (the slow ones first: full-parameter ES runs its members one by one)
JOBS="
af0 $A es_full 0
af1 $A es_full 1
af2 $A es_full 2
af3 $A es_full 3
af4 $A es_full 4
cf0 $C es_full 0
cf1 $C es_full 1
cf2 $C es_full 2
cf3 $C es_full 3
cf4 $C es_full 4
ag1 $A grpo 0,1,2
ag2 $A grpo 3,4
al $A es_lora 0,1,2,3,4
ae $A es_eggroll 0,1,2,3,4
cg $C grpo 0,1,2,3,4
cl $C es_lora 0,1,2,3,4
ce $C es_eggroll 0,1,2,3,4
"
if [ "${2:-}" = grpo ]; then  # the GRPO runs alone, one process per seed (a later call: ES finished)
JOBS="
ag0 $A grpo 0
ag1 $A grpo 1
ag2 $A grpo 2
ag3 $A grpo 3
ag4 $A grpo 4
cg0 $C grpo 0
cg1 $C grpo 1
cg2 $C grpo 2
cg3 $C grpo 3
cg4 $C grpo 4
"
fi
mkdir -p /root/logs
pids=""
i=0
while read -r name spec methods seeds; do
  [ -z "$name" ] && continue
  gpu=$((i % GPUS)); i=$((i + 1))
  CUDA_VISIBLE_DEVICES=$gpu VLLM_CACHE_ROOT=/root/vcache/$name timeout --signal=TERM --kill-after=20 "$LIMIT" \
    python -m evolm_lib.cli sweep "$spec" --methods "$methods" --seeds "$seeds" --no-notebook \
    >> /root/logs/$name.log 2>&1 &
  pids="$pids $!"
done <<< "$JOBS"
for pid in $pids; do wait "$pid"; done
for log in /root/logs/*.log; do echo "== $(basename "$log"): $(grep -c "KL to base [0-9]" "$log") KLs; $(grep -E "^  [a-z_0-9]+ +[0-9]+/" "$log" | tail -n 1 | cut -c 1-120)"; grep -h "Error\|error:" "$log" | tail -n 2 | cut -c 1-300; done
tar czf "$OUT/study.tgz" --exclude=checkpoints --exclude=snapshots --exclude=final_model --exclude=final_adapter \
    --exclude='*.safetensors' --exclude='*.lock' runs/study_addition runs/study_conciseness 2>/dev/null
tar czf "$OUT/logs.tgz" -C /root logs
ls -la "$OUT"
