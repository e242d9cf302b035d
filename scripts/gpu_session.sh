#!/usr/bin/env bash
# One lent 4-GPU machine, vLLM and Ray staged (../shared/GPU.md): issue 9's and issue 10's
# measurements side by side, one GPU set each, results in $OUT.
#   bash scripts/gpu_session.sh a   # Ray K=1,2 (GPUs 0,1) | issue 9 throughput (GPU 2) | ES generation (GPU 3)
#   bash scripts/gpu_session.sh b   # 4 GPUs: Ray K=1 and K=4 (noise on the GPUs), about 6 minutes
#   bash scripts/gpu_session.sh c   # 2 GPUs: Ray K=1,2, then the ES generation alone (no other load)
# One GPU, one call each (under 10 minutes):
#   bash scripts/gpu_session.sh es      # the ES generation at population 32 on SmolLM2 (in_place riding / own call / files)
#   bash scripts/gpu_session.sh tp      # population throughput against the base model, Qwen2.5-1.5B shapes, ranks 1 and 8
#   bash scripts/gpu_session.sh tuned   # tune vLLM's LoRA kernels for those shapes, then the throughput again with them
#   bash scripts/gpu_session.sh tp8     # rank 8: vLLM's default LoRA kernel tiles, then the tiles shipped here
#   bash scripts/gpu_session.sh det1    # deterministic: rank-1 population throughput and repeat rates, off then on
#   bash scripts/gpu_session.sh det8    # the same at rank 8
#   bash scripts/gpu_session.sh detes   # deterministic ES on SmolLM2: two runs, and a SIGKILL then resume, identical rows?
# Two GPUs, side by side:
#   bash scripts/gpu_session.sh modes   # es_mode eggroll throughput against base, its update, full mode's write/restore
#                                       # (Qwen2.5-1.5B shapes; shipped LoRA tiles on GPU 0, vLLM's on GPU 1)
set -u
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR=/root/cache
nvidia-smi -L
keep() { grep -v "it/s]\|Loading\|Converting\|Writing model" "$1" | tail -c 100000 > "$OUT/$(basename "$1")"; }
# the throughput tables evolm_lib.throughput.format_throughput prints (rows and ratios start with the engine)
table() { grep -h "^model \|^vllm \|^vLLM engine start" "$@" | cut -c 1-200; }
model() { python -c "from evolm_lib.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))" >/dev/null 2>&1; }
if [ "$1" = es ]; then
  model
  python scripts/gpu_issue9.py --out /root/i9e --skip-throughput > /root/i9e.log 2>&1
  cp /root/i9e/issue9.json "$OUT/i9e.json"; keep /root/i9e.log; grep -h "^in_place\|^files" /root/i9e.log | cut -c 1-900
elif [ "$1" = tp ]; then
  model
  python scripts/gpu_issue9.py --out /root/i9t --skip-es > /root/i9t.log 2>&1
  cp /root/i9t/issue9.json "$OUT/i9t.json"; keep /root/i9t.log; table /root/i9t.log
elif [ "$1" = tp8 ]; then
  # rank 8 with vLLM's default LoRA kernel tiles, then with the tiles shipped in evolm_lib (one process each)
  model
  python scripts/gpu_issue9.py --out /root/i9n --skip-es --ranks 8 --lora-configs none > /root/i9n.log 2>&1
  cp /root/i9n/issue9.json "$OUT/i9n.json"; keep /root/i9n.log; table /root/i9n.log
  python scripts/gpu_issue9.py --out /root/i9a --skip-es --ranks 8 --lora-configs auto > /root/i9a.log 2>&1
  cp /root/i9a/issue9.json "$OUT/i9a.json"; keep /root/i9a.log; table /root/i9a.log
elif [ "$1" = tuned ]; then
  model
  shape=$(python scripts/qwen_shape.py | tail -n 1)  # Qwen2.5-1.5B's shapes, random weights
  timeout 200 python scripts/tune_lora_kernels.py --model-dir "$shape" --ranks 1,8 --num-loras 33 --max-loras 66 \
      --num-tokens 256,2048 --quick --out /root/lora_configs --json "$OUT/tuning.json" > /root/tune.log 2>&1
  keep /root/tune.log; tail -n 30 /root/tune.log
  VLLM_TUNED_CONFIG_FOLDER=/root/lora_configs timeout 360 python scripts/gpu_issue9.py --out /root/i9k --skip-es > /root/i9k.log 2>&1
  cp /root/i9k/issue9.json "$OUT/i9k.json"; keep /root/i9k.log; table /root/i9k.log; grep -h "LoRA kernel" /root/i9k.log | cut -c 1-300
elif [ "$1" = det1 ] || [ "$1" = det8 ]; then
  model; python scripts/qwen_shape.py > /dev/null 2>&1
  r=${1#det}
  for d in 0 1; do  # one process each: vLLM reads batch invariance once per process
    python scripts/gpu_deterministic.py throughput --rank "$r" --deterministic $d --json "$OUT/det_r${r}_d$d.json" > /root/det$r$d.log 2>&1
    keep /root/det$r$d.log; tail -n 1 /root/det$r$d.log | cut -c 1-1500
  done
elif [ "$1" = detes ]; then
  model
  python scripts/gpu_deterministic.py es --json "$OUT/det_es.json" > /root/detes.log 2>&1
  keep /root/detes.log; tail -n 1 /root/detes.log | cut -c 1-1500
elif [ "$1" = modes ]; then
  model
  python scripts/qwen_shape.py > /dev/null 2>&1  # built once, before two processes want it
  (CUDA_VISIBLE_DEVICES=0 python scripts/gpu_modes.py --tiles auto --json "$OUT/modes_auto.json" > /root/ma.log 2>&1) &
  a=$!
  (CUDA_VISIBLE_DEVICES=1 python scripts/gpu_modes.py --tiles none --json "$OUT/modes_none.json" > /root/mn.log 2>&1) &
  b=$!
  wait $a $b
  keep /root/ma.log; keep /root/mn.log
  grep -h "^vllm\|^ratios\|^modes\|^vLLM engine start\|Error" /root/ma.log /root/mn.log | cut -c 1-600
elif [ "$1" = a ]; then
  # convert the embedded model once, before three processes want it
  python -c "from evolm_lib.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))"
  (CUDA_VISIBLE_DEVICES=0,1 python scripts/bench_ray.py --model qwen-shape --engines 1,2 --repeats 2 \
      --json "$OUT/ray_qwen_12.json" > /root/ray12.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=2 python scripts/gpu_issue9.py --out /root/i9t --skip-es > /root/i9t.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=3 python scripts/gpu_issue9.py --out /root/i9e --skip-throughput > /root/i9e.log 2>&1) &
  wait
  cp /root/i9t/issue9.json "$OUT/i9t.json"; cp /root/i9e/issue9.json "$OUT/i9e.json"
  for f in /root/ray12.log /root/i9t.log /root/i9e.log; do keep "$f"; done
  tail -n 8 /root/ray12.log; table /root/i9t.log; grep -h "^in_place\|^files" /root/i9e.log | cut -c 1-600
elif [ "$1" = c ]; then
  # 2 GPUs, one after the other: Ray K=1,2 (noise on the GPUs), then the ES generation alone
  python -c "from evolm_lib.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))" >/dev/null 2>&1
  python scripts/bench_ray.py --model qwen-shape --engines 1,2 --repeats 2 --json "$OUT/ray_qwen_12.json" > /root/ray12.log 2>&1
  keep /root/ray12.log; tail -n 6 /root/ray12.log
  CUDA_VISIBLE_DEVICES=0 python scripts/gpu_issue9.py --out /root/i9e --skip-throughput > /root/i9e.log 2>&1
  cp /root/i9e/issue9.json "$OUT/i9e.json"; keep /root/i9e.log; grep -h "^in_place\|^files" /root/i9e.log | cut -c 1-700
else
  python -c "from evolm_lib.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))" >/dev/null 2>&1
  python scripts/bench_ray.py --model qwen-shape --engines 1,4 --repeats 2 --json "$OUT/ray_qwen_4.json" > /root/ray4.log 2>&1
  keep /root/ray4.log; tail -n 8 /root/ray4.log
fi
