#!/usr/bin/env bash
# The five-seed study (issue 20) on one lent machine of several GPUs, vLLM staged (../shared/GPU.md):
# papermill_runs/study_{addition,conciseness}_smollm2_gpu.yaml, one `evolm sweep --methods M --seeds S`
# process per job line below, spread round-robin over the cards (SmolLM2 leaves a card mostly idle,
# so several engines share one: gpu_memory_utilization 0.12 in the specs). Each process stops after
# LIMIT seconds (SIGTERM; runs resume from their checkpoints), so a later call on the warm machine
# continues what this one did not finish. The logs go to /root/logs; `scripts/gpu_collect.sh` packs
# the run folders (no weights) and the logs into $OUT. /root/study.done marks the end.
#   bash scripts/gpu_study.sh 500 all       # every run of both specs
#   bash scripts/gpu_study.sh 500 grpo      # the GRPO variants alone, a process per seed
#   bash scripts/gpu_study.sh 1200 finish   # what the first GPU session left: GRPO on addition at both
#                                           # rates, GRPO at 5e-4 on conciseness, EGGROLL seeds 2-4,
#                                           # and the ES forms on addition at twice the budget
# Long enough for several calls: `setsid nohup bash scripts/gpu_study.sh 1200 finish > /root/driver.log 2>&1 &`
# then `bash scripts/gpu_collect.sh 570` in each call (waits for the end or 570 s, then packs).
set -u
LIMIT=${1:-500}
JOBSET=${2:-all}
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR=/root/cache
export VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=2  # 20-odd processes share the machine's cores: torch's default (all of them each) oversubscribes
rm -f /root/study.done
nvidia-smi -L
GPUS=$(nvidia-smi -L | wc -l)
python -c "from evolm_lib.models import resolve_model; resolve_model('smollm2-135m-instruct')" >/dev/null 2>&1
A=papermill_runs/study_addition_smollm2_gpu.yaml
C=papermill_runs/study_conciseness_smollm2_gpu.yaml
LONG="--generations 120 --out runs/study_addition_long"  # twice the budget: do the ES forms stop rising?
# name spec methods seeds [more sweep options]   (the slow ones first)
case "$JOBSET" in
all) JOBS="
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
ag $A grpo_lr2e3,grpo_lr5e4 0,1
ah $A grpo_lr2e3,grpo_lr5e4 2,3,4
al $A es_lora 0,1,2,3,4
ae $A es_eggroll 0,1,2,3,4
cg $C grpo_lr2e3,grpo_lr5e4 0,1,2,3,4
cl $C es_lora 0,1,2,3,4
ce $C es_eggroll 0,1,2,3,4
" ;;
grpo) JOBS=""
  for seed in 0 1 2 3 4; do
    JOBS="$JOBS
ag${seed} $A grpo_lr2e3 $seed
ah${seed} $A grpo_lr5e4 $seed
cg${seed} $C grpo_lr2e3,grpo_lr5e4 $seed"
  done ;;
finish) JOBS="
lf0 $A es_full 0 $LONG
lf1 $A es_full 1 $LONG
lf2 $A es_full 2 $LONG
lf3 $A es_full 3 $LONG
lf4 $A es_full 4 $LONG
ag0 $A grpo_lr2e3 0
ag1 $A grpo_lr2e3 1
ag2 $A grpo_lr2e3 2
ag3 $A grpo_lr2e3 3
ag4 $A grpo_lr2e3 4
ah0 $A grpo_lr5e4 0
ah1 $A grpo_lr5e4 1
ah2 $A grpo_lr5e4 2
ah3 $A grpo_lr5e4 3
ah4 $A grpo_lr5e4 4
ae $A es_eggroll 2,3,4
ce $C es_eggroll 2,3,4
ch $C grpo_lr5e4 0,1,2
ci $C grpo_lr5e4 3,4
ll $A es_lora 0,1,2 $LONG
lm $A es_lora 3,4 $LONG
le $A es_eggroll 0,1,2 $LONG
lg $A es_eggroll 3,4 $LONG
" ;;
*) echo "unknown job set $JOBSET: all, grpo or finish" >&2; exit 2 ;;
esac
mkdir -p /root/logs
pids=""
i=0
while read -r name spec methods seeds more; do
  [ -z "$name" ] && continue
  gpu=$((i % GPUS)); i=$((i + 1))
  # shellcheck disable=SC2086  # $more holds several options
  CUDA_VISIBLE_DEVICES=$gpu VLLM_CACHE_ROOT=/root/vcache/$name timeout --signal=TERM --kill-after=20 "$LIMIT" \
    python -m evolm_lib.cli sweep "$spec" --methods "$methods" --seeds "$seeds" --no-notebook $more \
    >> /root/logs/$name.log 2>&1 &
  pids="$pids $!"
done <<< "$JOBS"
echo "$i processes on $GPUS GPUs, at most $LIMIT s each"
for pid in $pids; do wait "$pid"; done
touch /root/study.done
