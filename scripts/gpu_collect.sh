#!/usr/bin/env bash
# Waits up to WAIT seconds for scripts/gpu_study.sh to end (/root/study.done), prints each process's
# progress, then packs the study's run folders (rows, KLs, held-out scores; no weights) into
# $OUT/study.tgz and the logs into $OUT/logs.tgz. Run it in every device call while the study runs:
# what a call packs comes back even if the machine is lost before the next one.
#   bash scripts/gpu_collect.sh 570
set -u
WAIT=${1:-0}
waited=0
while [ ! -e /root/study.done ] && [ "$waited" -lt "$WAIT" ]; do sleep 10; waited=$((waited + 10)); done
[ -e /root/study.done ] && echo "study: finished" || echo "study: still running after ${waited} s"
for log in /root/logs/*.log; do
  echo "== $(basename "$log"): $(grep -c "KL to base [0-9]" "$log") KLs, $(grep -c "held-out success" "$log") held-out; $(grep -E "^  [a-z_0-9]+ +[0-9]+/" "$log" | tail -n 1 | cut -c 1-110)"
  grep -h "Error\|error:" "$log" | tail -n 2 | cut -c 1-300
done
tar czf "$OUT/study.tgz" --exclude=checkpoints --exclude=snapshots --exclude=final_model --exclude=final_adapter \
    --exclude='*.safetensors' --exclude='*.lock' runs/study_addition runs/study_conciseness runs/study_addition_long 2>/dev/null
tar czf "$OUT/logs.tgz" -C /root logs driver.log 2>/dev/null
ls -la "$OUT"
