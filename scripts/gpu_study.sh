#!/usr/bin/env bash
# Runs the five-seed study (papermill_runs/study_{addition,conciseness}_smollm2_gpu.yaml) on one machine
# of several GPUs: one `evolm sweep SPEC --methods M --seeds S --no-notebook` process (evolm_lib.sweep)
# per job line below, spread round-robin over the cards (SmolLM2 leaves a card mostly idle, so several
# engines share one: the specs set gpu_memory_utilization for that). Each process stops after LIMIT
# seconds (SIGTERM; its runs resume from their checkpoints), so running the script again continues
# what a call did not finish. Run from the repository root; the run folders go where the specs say
# (runs/study_*), each process's log to LOGS/<job>.log, and LOGS/study.done marks the end.
#
#   bash scripts/gpu_study.sh LIMIT JOBSET [LOGS]
#     LIMIT   seconds each process may run (default 500)
#     JOBSET  all: every run of both specs; grpo: the GRPO variants alone, a process per seed;
#             finish: GRPO on addition at both rates, GRPO at 5e-4 on conciseness, EGGROLL seeds 2-4,
#             and the ES forms on addition at twice the budget (runs/study_addition_long);
#             qiu: Qiu et al.'s protocol (papermill_runs/qiu_protocol_addition_gpu.yaml), full ES and
#             full GRPO on seeds 0-2, a process per run (runs/qiu_protocol_addition)
#     LOGS    folder of the logs (default runs/study_logs)
#
# In the background: `setsid nohup bash scripts/gpu_study.sh 1200 finish > runs/study_driver.log 2>&1 &`,
# then `bash scripts/gpu_collect.sh 570 OUT` packs what is done so far.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/gpu_cards.sh"  # on_card
LIMIT=${1:-500}
JOBSET=${2:-all}
LOGS=${3:-runs/study_logs}
export VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=2  # many processes share the machine's cores: torch's default (all of them each) oversubscribes
mkdir -p "$LOGS"
rm -f "$LOGS/study.done"
nvidia-smi -L
GPUS=$(nvidia-smi -L | wc -l)
python -c "from evolm_lib.models import resolve_model; resolve_model('smollm2-135m-instruct')" >/dev/null 2>&1
A=papermill_runs/study_addition_smollm2_gpu.yaml
C=papermill_runs/study_conciseness_smollm2_gpu.yaml
Q=papermill_runs/qiu_protocol_addition_gpu.yaml
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
qiu) JOBS="
qf0 $Q es_full 0
qf1 $Q es_full 1
qf2 $Q es_full 2
qg0 $Q grpo_full 0
qg1 $Q grpo_full 1
qg2 $Q grpo_full 2
" ;;
*) echo "unknown job set $JOBSET: all, grpo, finish or qiu" >&2; exit 2 ;;
esac
pids=""
i=0
total=$(grep -c . <<< "$JOBS")
while read -r name spec methods seeds more; do
  [ -z "$name" ] && continue
  gpu=$((i % GPUS))
  # each run records how many of these processes share its card (EVOLM_ENGINES_PER_CARD, in placement.jsonl)
  engines=$(on_card "$total" "$GPUS" "$i"); i=$((i + 1))
  # shellcheck disable=SC2086  # $more holds several options
  EVOLM_ENGINES_PER_CARD=$engines CUDA_VISIBLE_DEVICES=$gpu timeout --signal=TERM --kill-after=20 "$LIMIT" \
    python -m evolm_lib.cli sweep "$spec" --methods "$methods" --seeds "$seeds" --no-notebook $more \
    >> "$LOGS/$name.log" 2>&1 &
  pids="$pids $!"
done <<< "$JOBS"
echo "$i processes on $GPUS GPUs, at most $LIMIT s each"
for pid in $pids; do wait "$pid"; done
touch "$LOGS/study.done"
