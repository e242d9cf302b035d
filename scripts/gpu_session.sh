#!/usr/bin/env bash
# One lent 4-GPU machine, vLLM and Ray staged (../shared/GPU.md): issue 9's and issue 10's
# measurements side by side, one GPU set each, results in $OUT.
#   bash scripts/gpu_session.sh a   # Ray K=1,2 (GPUs 0,1) | issue 9 throughput (GPU 2) | ES generation (GPU 3)
#   bash scripts/gpu_session.sh b   # 4 GPUs: Ray K=1 and K=4 (noise on the GPUs), about 6 minutes
#   bash scripts/gpu_session.sh c   # 2 GPUs: Ray K=1,2, then the ES generation alone (no other load)
set -u
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR=/root/cache
nvidia-smi -L
keep() { grep -v "it/s]\|Loading\|Converting\|Writing model" "$1" | tail -c 100000 > "$OUT/$(basename "$1")"; }
if [ "$1" = a ]; then
  # convert the embedded model once, before three processes want it
  python -c "from evolm_lib.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))"
  (CUDA_VISIBLE_DEVICES=0,1 python scripts/bench_ray.py --model qwen-shape --engines 1,2 --repeats 2 \
      --json "$OUT/ray_qwen_12.json" > /root/ray12.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=2 python scripts/gpu_issue9.py --out /root/i9t --skip-es > /root/i9t.log 2>&1) &
  (CUDA_VISIBLE_DEVICES=3 python scripts/gpu_issue9.py --out /root/i9e --skip-throughput > /root/i9e.log 2>&1) &
  wait
  cp /root/i9t/issue9.json "$OUT/i9t.json"; cp /root/i9e/issue9.json "$OUT/i9e.json"
  for f in /root/ray12.log /root/i9t.log /root/i9e.log; do keep "$f"; done
  tail -n 8 /root/ray12.log; grep -h "tokens_per_s\|^in_place\|^files" /root/i9t.log /root/i9e.log | cut -c 1-600
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
