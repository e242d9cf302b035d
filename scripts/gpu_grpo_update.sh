#!/usr/bin/env bash
# What `deterministic` costs a GRPO step's update on the GPU, against the same settings without it
# and against another code tree with it (a change meant to speed the deterministic update is measured
# against the tree before it); and whether two deterministic runs give the same rows. The addition
# study's GRPO at 5e-4 for a few generations, through `evolm sweep`, two runs after one another on
# each of two cards. vLLM staged (docs/measurements.md says how).
#   bash scripts/gpu_grpo_update.sh OLD_TREE OUT [GENERATIONS]
set -u
OLD=${1:?the folder holding the earlier evolm_lib}; OUT=${2:?where the run folders and logs go}; GENERATIONS=${3:-4}
SITE=${EVOLM_SITE:-/root/site}
export VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR=${EVOLM_CACHE_DIR:-/root/cache} VLLM_LOGGING_LEVEL=WARNING PYTHONUNBUFFERED=1
SPEC=papermill_runs/study_addition_smollm2_gpu.yaml
mkdir -p "$OUT/logs"
sed -e "s/^\(\s*deterministic:\s*\)true/\1false/" "$SPEC" > "$OUT/spec_free.yaml"
grep -q "deterministic: true" "$SPEC" || { echo "$SPEC does not ask for deterministic: true"; exit 2; }
one() {  # card, tree, spec, name
  CUDA_VISIBLE_DEVICES=$1 VLLM_CACHE_ROOT=/root/vcache/$1 PYTHONPATH=$SITE:$2 python3 -m evolm_lib.cli sweep "$3" \
    --methods grpo_lr5e4 --seeds 0 --generations "$GENERATIONS" --no-kl --no-notebook --out "$OUT/$4" > "$OUT/logs/$4.log" 2>&1
}
(one 0 "$PWD" "$SPEC" deterministic; one 0 "$PWD" "$SPEC" deterministic_again) & first=$!
(one 1 "$PWD" "$OUT/spec_free.yaml" free; one 1 "$OLD" "$SPEC" deterministic_before) & second=$!
wait $first; wait $second
nvidia-smi -L
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
def rows(name):
    found = glob.glob(f"{out}/{name}/grpo_lr5e4_seed0/metrics.jsonl")
    return [json.loads(line) for line in open(found[0])] if found else []
for name in ("deterministic", "deterministic_again", "free", "deterministic_before"):
    steps = rows(name)[1:]
    if not steps:
        print(f"{name}: no rows (see logs/{name}.log)")
        continue
    med = lambda key: statistics.median(r[key] for r in steps if key in r)
    print(f"{name:21} {len(steps)} steps: rollout {med('time/rollout_s'):.3f} s, update {med('time/update_s'):.3f} s a step (median)")
science = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]
a, b = rows("deterministic"), rows("deterministic_again")
print("two deterministic runs:", "identical rows" if a and science(a) == science(b) else "rows DIFFER")
PY
