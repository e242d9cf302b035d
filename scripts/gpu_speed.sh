#!/usr/bin/env bash
# The speed figures of docs/measurements.md on a lent machine of 4 GPUs (vLLM and Ray staged, see
# ../shared/GPU.md): one device call per part, each under the 10-minute limit, results packed into
# OUT/speed_PART.tar.gz even when a measurement fails or runs out of time.
#
#   bash scripts/gpu_speed.sh cards OUT   # one measurement per card, side by side:
#       card 0: full-pool, 1 engine against 4 on the card (SmolLM2, Qiu et al.'s conciseness settings)
#       card 1: modes with the tiles each mode picks, and EGGROLL's update (Qwen2.5-1.5B shapes)
#       card 2: engine-start (Qwen2.5-1.5B shapes), then EGGROLL with the shipped tiles (the earlier choice)
#       card 3: grpo-update: deterministic in the same process and in its own against not deterministic
#   bash scripts/gpu_speed.sh ray OUT     # Ray: K=1 against K=4 engines, populations 64 and 128 (Qwen shapes)
#   bash scripts/gpu_speed.sh starts OUT  # cards 2, 3: engine-start with derived and default CUDA-graph sizes, each from
#                                         # a cold compile cache of its own and again warm; cards 0, 1: full-pool 1 against 4
#                                         # engines a card, modes with the tiles each mode picks
#   bash scripts/gpu_speed.sh pool8 OUT   # full-pool at 8 engines a card against 1 (card 0)
#   bash scripts/gpu_speed.sh misses OUT  # the goals missed or not measured before, side by side:
#       card 0: full-pool, 1 engine against 4 on the card, with a fixed KV cache (the 4 start together)
#       card 1: modes, EGGROLL only (Qwen2.5-1.5B shapes): its update's parts, whole-vector SGD against in place
#       cards 2, 3: grpo-update, not deterministic and deterministic in its own process with torch's
#               deterministic algorithms off first, then on twice (two configurations at a time)
#   bash scripts/gpu_speed.sh left OUT    # what the misses call left: card 0, full-pool 1 against 4 engines started
#       together; card 1: the GRPO train step profiled (scripts/grpo_update_profile.py); card 2: modes, EGGROLL
#       only, its in-place step timed at three chunk sizes; card 3: grpo-update, not deterministic against
#       deterministic in its own process with the policy's attention eager (auto) and fused (sdpa). The pool's run
#       folders come back (without files over 5 MB), so a count cut short still shows its generations.
#   bash scripts/gpu_speed.sh next OUT    # what the left call left: card 0, modes (EGGROLL against the base model,
#       nothing else heavy on the host); card 1, grpo-update with eager attention run twice (same rows?);
#       card 2, the train step profiled again, the cuBLAS workspace setting's cost told from the algorithms'
#   bash scripts/gpu_speed.sh eggroll OUT # modes, EGGROLL against the base model, alone on the host (card 0), then one
#       more call of each under torch.profiler: the kernels by category and how busy the card was (--profile)
#   bash scripts/gpu_speed.sh tiles OUT   # card 0, alone on the host: vLLM's LoRA tiles tuned on this GPU for EGGROLL's
#       calls (scripts/tune_lora_kernels.py: rank 1, 32 of the engine's 68 slots busy, as a population of 32 and its
#       mean sizes it), then modes eggroll,lora with vLLM's default tiles (from a cold compile cache: the engines after
#       it start warm), with the tiles tuned here (under torch.profiler too), and with the defaults again, warm; the
#       tuned folder comes back in the pack (RES/lora_kernel_configs), to ship where it wins. About 10 minutes on an
#       H200 (tuning 216 s, 147 s and 134 s for the first two modes runs): give it a call of its own
#   bash scripts/gpu_speed.sh paired OUT  # card 0, alone on the host: modes eggroll,lora --interleave, 15 rounds of one
#       call each of the base model and each mode, with the tiles auto picks (on an H200 the shipped ones), then
#       with vLLM's defaults: each mode against the base model of its own round (about 5 minutes)
#   bash scripts/gpu_speed.sh loose OUT   # grpo-update on every card of the machine, side by side: deterministic in
#       its own process with and without torch's deterministic algorithms, the latter twice (do its rows repeat?),
#       against not deterministic; LoRA and full policies (each configuration's progress in grpo_update_loose_logs/)
#   bash scripts/gpu_speed.sh swap OUT    # grpo-update, LoRA policy, on cards 0 and 1 (a 2-card machine will do): each
#       deterministic configuration (own process, with and without torch's deterministic algorithms) side by
#       side with not deterministic, then again with the two cards swapped, so a card's own speed cancels
#   bash scripts/gpu_speed.sh mps OUT     # full-pool, 1 engine against 4 on a card, side by side: card 0 as the card
#       comes, card 1 through CUDA's MPS (a control daemon for its processes, so their kernels run side by side)
#   bash scripts/gpu_speed.sh mps1 OUT    # the same through MPS on a one-card machine: card 0, 1 engine against 4
#   bash scripts/gpu_speed.sh grpo1 OUT   # on a one-card machine: the labels' log-probabilities' backward under
#       deterministic algorithms, torch's gather against label_logits (seconds); then the LoRA GRPO update, not
#       deterministic, then deterministic with the policy in its own process, twice (rows must repeat), micro-batches of 64 and 8
#   bash scripts/gpu_speed.sh mpsshare OUT   # through MPS on card 0, 1 engine against 8 with the whole card, then
#       8 each limited to its share of the card's SMs (--mps-thread-percentage auto: 100 / engines)
#
# Run from the repository root with PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
# EVOLM_CACHE_DIR=/root/cache set. LIMIT (default 560) is the whole part's deadline in seconds: each
# measurement is stopped when it is reached, and its JSON keeps what it had written.
set -u
. "$(dirname "${BASH_SOURCE[0]}")/gpu_cards.sh"  # mps_daemon, mps_vars
PARTS="cards ray starts pool8 misses left next eggroll tiles paired loose swap grpo1 mps mps1 mpsshare"  # each a case below
PART=${1:?a part: $PARTS}
OUT=${2:?OUT folder}
case " $PARTS " in  # before anything is converted, built or started
*" $PART "*) ;;
*) echo "unknown part $PART: one of $PARTS" >&2; exit 2 ;;
esac
LIMIT=${LIMIT:-560}
RES=runs/speed_$PART
mkdir -p "$RES" "$OUT"
export PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
nvidia-smi -L | tee "$RES/cards.txt"
# the code measured: EVOLM_CODE_COMMIT where the caller names it (a lent machine's copy of the tree may
# carry a git history older than the tree itself), else the copy's own HEAD
echo "${EVOLM_CODE_COMMIT:-$(git log -1 --format=%H 2>/dev/null)}" > "$RES/commit.txt"
python -c "from evolm_lib.models import resolve_model; resolve_model('smollm2-135m-instruct')" > /dev/null
case "$PART" in  # before any engine: the parts that measure on the Qwen2.5-1.5B shapes build them
pool8|loose|swap|grpo1|mps|mps1|mpsshare) QWEN="" ;;
*) QWEN=$(python scripts/qwen_shape.py | tail -n 1) ;;
esac
measure() {  # measure NAME CARDS COMMAND...: COMMAND --json RES/NAME.json on some cards, stopped at the deadline
  local name=$1 cards=$2 left
  shift 2
  left=$((LIMIT - SECONDS))
  if [ "$left" -lt 30 ]; then echo "$name: not started, $left s left" >> "$RES/exits.txt"; return; fi
  CUDA_VISIBLE_DEVICES=$cards timeout --signal=TERM --kill-after=10 "$left" \
    "$@" --json "$RES/$name.json" > "$RES/$name.log" 2>&1
  echo "$name: exit $? after $SECONDS s" >> "$RES/exits.txt"
}
bench() {  # bench NAME CARDS ARGS...: one `python -m evolm_lib.benchmark ARGS...`
  local name=$1 cards=$2
  shift 2
  measure "$name" "$cards" python -m evolm_lib.benchmark "$@"
}
pids=""
case "$PART" in
cards)
  bench full_pool_1_4 0 full-pool --engines 1,4 --generations 6 & pids="$pids $!"
  bench modes_auto 1 modes --model "$QWEN" --tiles auto --repeats 2 & pids="$pids $!"
  { bench engine_start 2 engine-start --model "$QWEN"
    bench modes_shipped 2 modes --model "$QWEN" --tiles shipped --modes eggroll --repeats 2 --no-update; } & pids="$pids $!"
  bench grpo_update 3 grpo-update --micro-batch-sizes 64 --steps 6 \
    --configurations not_deterministic,deterministic_same,deterministic_own,deterministic_own_rerun & pids="$pids $!"
  ;;
ray)
  bench ray 0,1,2,3 ray --model "$QWEN" --engines 1,4 --population 64,128 --repeats 2 & pids="$pids $!"
  ;;
starts)  # engine-start from a cold cache and again warm, derived and default sizes side by side
  full=0
  for capture in derived default; do
    card=$((2 + full)); full=$((full + 1))
    { export VLLM_CACHE_ROOT=/tmp/cold_$capture TORCHINDUCTOR_CACHE_DIR=/tmp/cold_$capture/inductor TRITON_CACHE_DIR=/tmp/cold_$capture/triton
      bench start_${capture}_cold $card engine-start --model "$QWEN" --capture $capture
      bench start_${capture}_warm $card engine-start --model "$QWEN" --capture $capture; } & pids="$pids $!"
  done
  bench full_pool_1_4 0 full-pool --engines 1,4 --generations 6 & pids="$pids $!"
  bench modes_auto 1 modes --model "$QWEN" --tiles auto --repeats 2 & pids="$pids $!"
  ;;
pool8)
  bench full_pool_1_8 0 full-pool --engines 1,8 --generations 6 & pids="$pids $!"
  ;;
misses)
  bench full_pool_1_4_together 0 full-pool --engines 1,4 --generations 6 --kv-cache-gb 2 & pids="$pids $!"
  bench modes_eggroll 1 modes --model "$QWEN" --modes eggroll --tiles auto --repeats 2 & pids="$pids $!"
  # the configurations' own processes pick their cards (--devices); CUDA_VISIBLE_DEVICES names them all
  bench grpo_update 0,1,2,3 grpo-update --devices 2,3 --micro-batch-sizes 64 --steps 12 \
    --configurations not_deterministic,deterministic_own_loose,deterministic_own,deterministic_own_rerun & pids="$pids $!"
  ;;
left)
  bench full_pool_1_4_together 0 full-pool --engines 1,4 --generations 5 --kv-cache-gb 2 --workdir "$RES/pool_runs" & pids="$pids $!"
  bench grpo_update 0,1,2,3 grpo-update --devices 3 --micro-batch-sizes 64 --steps 8 \
    --configurations not_deterministic,deterministic_own,deterministic_own_sdpa & pids="$pids $!"
  measure grpo_profile 1 python scripts/grpo_update_profile.py --steps 10 & pids="$pids $!"
  bench modes_eggroll 2 modes --model "$QWEN" --modes eggroll --tiles auto --repeats 2 & pids="$pids $!"
  ;;
next)
  bench modes_eggroll 0 modes --model "$QWEN" --modes eggroll --tiles auto --repeats 3 --no-update & pids="$pids $!"
  bench grpo_update 0,1,2,3 grpo-update --devices 1 --micro-batch-sizes 64 --steps 8 \
    --configurations not_deterministic,deterministic_own,deterministic_own_rerun & pids="$pids $!"
  measure grpo_profile 2 python scripts/grpo_update_profile.py --steps 10 & pids="$pids $!"
  ;;
eggroll)
  bench modes_eggroll 0 modes --model "$QWEN" --modes eggroll --tiles auto --repeats 5 --no-update --profile & pids="$pids $!"
  ;;
tiles)
  { measure tune_tiles 0 python scripts/tune_lora_kernels.py --model-dir "$QWEN" --ranks 1 --num-tokens 256,2048 \
      --num-loras 32 --max-loras 68 --out "$RES/lora_kernel_configs"
    bench modes_default_cold 0 modes --model "$QWEN" --modes eggroll,lora --tiles default --repeats 2 --no-update
    if [ -d "$RES/lora_kernel_configs" ]; then  # a user's folder: what --tiles auto picks for every mode
      VLLM_TUNED_CONFIG_FOLDER=$PWD/$RES/lora_kernel_configs \
        bench modes_tuned 0 modes --model "$QWEN" --modes eggroll,lora --tiles auto --repeats 5 --no-update --profile
    fi
    bench modes_default 0 modes --model "$QWEN" --modes eggroll,lora --tiles default --repeats 3 --no-update
  } & pids="$pids $!"
  ;;
paired)
  { bench modes_paired_auto 0 modes --model "$QWEN" --modes eggroll,lora --tiles auto --repeats 15 --no-update --interleave
    bench modes_paired_default 0 modes --model "$QWEN" --modes eggroll,lora --tiles default --repeats 15 --no-update \
      --interleave; } & pids="$pids $!"
  ;;
loose)
  all=$(awk '{print NR - 1}' "$RES/cards.txt" | paste -sd, -)  # every card listed above: 0,1,...,N-1
  bench grpo_update_loose "$all" grpo-update --devices "$all" --micro-batch-sizes 64 --steps 8 --policy-weights lora,full \
    --configurations not_deterministic,deterministic_own,deterministic_own_loose,deterministic_own_loose_rerun & pids="$pids $!"
  ;;
swap)
  { for c in deterministic_own deterministic_own_loose; do
      for order in "not_deterministic,$c" "$c,not_deterministic"; do
        bench "grpo_update_swap_${c}_${order%%,*}_on_0" 0,1 grpo-update --devices 0,1 --micro-batch-sizes 64 --steps 8 \
          --policy-weights lora --configurations "$order"
      done
    done; } & pids="$pids $!"
  ;;
grpo1)
  { bench label_logits 0 label-logits
    bench grpo_update_one_card 0 grpo-update --micro-batch-sizes 64,8 --steps 8 --policy-weights lora \
      --configurations not_deterministic,deterministic_own,deterministic_own_rerun; } & pids="$pids $!"
  ;;
mps)
  mps_daemon || { echo "the MPS control daemon did not start" >&2; exit 1; }
  bench full_pool_1_4 0 full-pool --engines 1,4 --generations 5 --kv-cache-gb 2 --workdir "$RES/pool_runs" & pids="$pids $!"
  ( export $(mps_vars)
    bench full_pool_1_4_mps 1 full-pool --engines 1,4 --generations 5 --kv-cache-gb 2 --workdir "$RES/pool_runs_mps" ) & pids="$pids $!"
  ;;
mps1)
  mps_daemon || { echo "the MPS control daemon did not start" >&2; exit 1; }
  ( export $(mps_vars)
    bench full_pool_1_4_mps 0 full-pool --engines 1,4 --generations 5 --kv-cache-gb 2 --workdir "$RES/pool_runs_mps" ) & pids="$pids $!"
  ;;
mpsshare)
  mps_daemon || { echo "the MPS control daemon did not start" >&2; exit 1; }
  ( export $(mps_vars)
    bench full_pool_1_8_8_share 0 full-pool --engines 1,8,8 --generations 4 --kv-cache-gb 2 --mps-thread-percentage none,none,auto \
      --workdir "$RES/pool_runs_share" ) & pids="$pids $!"
  ;;
*) echo "unknown part $PART: one of $PARTS" >&2; exit 2 ;;
esac
for pid in $pids; do wait "$pid"; done
find "$RES" -type f -size +5M > "$RES/left_out.txt"  # checkpoints of kept run folders: not worth the transfer
tar -czf "$OUT/speed_$PART.tar.gz" -X "$RES/left_out.txt" "$RES"
cat "$RES/exits.txt"
for f in "$RES"/*.log; do echo "== $f"; tail -n 25 "$f"; done
