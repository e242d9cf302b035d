#!/usr/bin/env bash
# Packs what scripts/gpu_study.sh has done so far: waits up to WAIT seconds for its end (LOGS/study.done),
# prints each process's progress from its log, then packs the study's run folders (rows, KLs, held-out
# scores; no weights) into OUT/study.tgz and the logs into OUT/logs.tgz. Run from the repository root,
# as often as wanted while the study runs: each call's archives hold everything done until then.
#
#   bash scripts/gpu_collect.sh WAIT OUT [LOGS]
#     WAIT  seconds to wait for the study's end (default 0)
#     OUT   folder for study.tgz and logs.tgz (default: $OUT, else the current folder)
#     LOGS  the study's log folder, as given to gpu_study.sh (default runs/study_logs)
set -u
WAIT=${1:-0}
DEST=${2:-${OUT:-.}}
LOGS=${3:-runs/study_logs}
mkdir -p "$DEST"
waited=0
while [ ! -e "$LOGS/study.done" ] && [ "$waited" -lt "$WAIT" ]; do sleep 10; waited=$((waited + 10)); done
[ -e "$LOGS/study.done" ] && echo "study: finished" || echo "study: still running after ${waited} s"
for log in "$LOGS"/*.log; do
  [ -e "$log" ] || continue
  echo "== $(basename "$log"): $(grep -c "KL to base [0-9]" "$log") KLs, $(grep -c "held-out on [0-9]* problems" "$log") held-out; $(grep -E "^  [a-z_0-9]+ +[0-9]+/" "$log" | tail -n 1 | cut -c 1-110)"
  grep -h "Error\|error:" "$log" | tail -n 2 | cut -c 1-300
done
tar czf "$DEST/study.tgz" --exclude=checkpoints --exclude=snapshots --exclude=final_model --exclude=final_adapter \
    --exclude='*.safetensors' --exclude='*.lock' runs/study_addition runs/study_conciseness runs/study_addition_long \
    runs/qiu_protocol_addition 2>/dev/null
tar czf "$DEST/logs.tgz" "$LOGS" 2>/dev/null
ls -la "$DEST"
