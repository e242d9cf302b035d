#!/usr/bin/env bash
# What a GRPO step costs on the GPU with and without `deterministic` (vLLM's batch-invariant mode,
# which overrides torch operators for the whole process the HF policy shares) and with the step's
# 64 rollouts in one backward pass or in 8: the addition study's GRPO settings, 4 generations
# (15 steps), one run per card side by side, vLLM staged (../shared/GPU.md). Prints the median
# seconds of the rollouts and of the update per step.
set -u
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR=/root/cache
export VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
A=papermill_runs/study_addition_smollm2_gpu.yaml
nvidia-smi -L
i=0; pids=""
for det in true false; do
  for micro in 64 8; do
    spec=papermill_runs/_probe_${det}_${micro}.yaml
    sed -e "s/^    deterministic: true /    deterministic: $det /" -e "s/micro_batch_size: 64 /micro_batch_size: $micro /" $A > $spec
    CUDA_VISIBLE_DEVICES=$i VLLM_CACHE_ROOT=/root/vcache/probe$i python -m evolm_lib.cli sweep $spec --methods grpo_lr5e4 \
      --seeds 0 --generations 4 --no-kl --no-notebook --out /root/probe/${det}_${micro} > /root/probe_$i.log 2>&1 &
    pids="$pids $!"; i=$((i + 1))
  done
done
for pid in $pids; do wait "$pid"; done
python - <<'PY'
import glob, json, statistics
for folder in sorted(glob.glob("/root/probe/*/grpo_lr5e4_seed0")):
    rows = [json.loads(line) for line in open(folder + "/metrics.jsonl")][1:]
    med = lambda key: statistics.median(r[key] for r in rows if key in r)
    det, micro = folder.split("/")[3].split("_")
    print(f"deterministic {det:5} micro_batch {micro:>2}: {len(rows)} steps, rollout {med('time/rollout_s'):.3f} s, "
          f"update {med('time/update_s'):.3f} s a step")
PY
tail -n 3 /root/probe_*.log
