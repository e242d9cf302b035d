#!/usr/bin/env bash
# The tuned study (papermill_runs/tune_study_addition_gpu.yaml) on a machine of several GPUs, in
# stages that survive a machine taken back: each call packs what is finished.
#
#   bash scripts/gpu_tune_study.sh start [ARCHIVE]   # unpack an earlier pack (if given; or its parts ARCHIVE.part-NN),
#                                                    # start the workers, detached
#   bash scripts/gpu_tune_study.sh pack DIR          # pack the study in parts of 15 MiB (PART_BYTES), the first 4
#                                                    # (FIRST_PARTS) into DIR/tune_study.tar.gz.part-NN, with the
#                                                    # workers' log tails (CHECKPOINT_MIB: the checkpoints it carries)
#   bash scripts/gpu_tune_study.sh parts N DIR [COUNT]   # the last pack's parts N to N+3 (COUNT) into DIR: a call
#                                                    # returns 8 files of 16 MiB, 64 MiB together (RETURN_BYTES)
#   bash scripts/gpu_tune_study.sh stage SECONDS DIR [ARCHIVE]   # start (unless running), wait, pack: one device call
#                                                                # that ends within SECONDS (give the call a limit above it)
#   bash scripts/gpu_tune_study.sh stop [SECONDS [METHOD...]]   # end the workers (and rebuilds) of the last start,
#                                                    # each process group sent TERM, then KILL after SECONDS (30): the card
#                                                    # freed for other work once the last pack is taken; with METHODs only
#                                                    # those methods' workers, not refilled (a lease's last call leaves the
#                                                    # card to the runs that must end in it)
#   bash scripts/gpu_tune_study.sh compact DIR       # the study's rows and scores, its summary written afresh, as
#                                                    # DIR/compact.tar.gz (to commit); every pack writes it too (COMPACT=0: not)
#   bash scripts/gpu_tune_study.sh compile-cache DIR [N]   # the engines' compile caches in parts, N to N+3 into DIR:
#                                                    # staged as .gpu_stage/compile_cache.tar.gz.part-NN, the next
#                                                    # machine's `start` unpacks them and its engines start warm
#   bash scripts/gpu_tune_study.sh rebuild           # the geometry's reruns whose weights a pack left behind, run again
#                                                    # side by side (one process per method and seed), rows checked
#   bash scripts/gpu_tune_study.sh geometry DIR      # the winners' geometry in DIR/compact/geometry.json (needs the reruns'
#                                                    # weights: here, or rebuilt)
#   bash scripts/gpu_tune_study.sh finish DIR [SECONDS]   # once nothing is outstanding: rebuild, geometry, the base
#                                                    # model's held-out answers (tune.base, once) and compact into
#                                                    # DIR/compact.tar.gz, each stopped at the deadline; a stage whose
#                                                    # workers have all ended runs it before its pack (FINISH=0: not;
#                                                    # GEOMETRY=0: no rebuilds and geometry, measured before)
#   bash scripts/gpu_tune_study.sh geometry-stage SECONDS DIR [ARCHIVE]   # finish's steps for the reruns at the budget
#                                                    # while later stages are outstanding (no workers): unpack ARCHIVE,
#                                                    # start them detached, wait for them within SECONDS; once they have
#                                                    # ended DIR/compact.tar.gz, and DIR/geometry_stage_status.txt always
#
# Workers: WORKERS_PER_METHOD (default: the number of cards) `evolm tune SPEC --methods M` processes per
# method, spread round-robin over the cards (SmolLM2 leaves a card mostly idle, so five engines share
# one: the spec's gpu_memory_utilization and kv_cache_gb are set for that), started with setsid so
# they outlive the call that started them and run on while the machine is held. Workers of one
# method share its Optuna study (SQLite in the study folder); a worker that dies leaves a trial whose
# heartbeat goes stale, and Optuna retries it with the same setting. When a method has its trials,
# its workers rerun the winner on the final seeds, continue those reruns (tune.long, OUT/long) and run
# the shuffled-fitness control (tune.control, OUT/control). Packs hold finished runs, and unfinished
# runs with their newest checkpoint where it is small: ES on the model's own weights always, LoRA runs
# within a budget (python -m evolm_lib.tune.pack): a new machine unpacks the last one and runs `start`
# again, and those runs go on from their checkpoints. Each worker
# is told how many engines share its card (EVOLM_ENGINES_PER_CARD, recorded in every run's
# placement.jsonl beside the times). While a stage waits, a worker that ended cleanly (its method had
# nothing left to claim) is replaced on its card by one of the method still at work with the fewest
# workers, passing over a method one of whose workers waits for the others (REFILL=0: not).
# FILL="es_full es_lora": methods whose runs survive a lost machine (their checkpoints always pack:
# ES), given a slot no method at work may take (all its work claimed, one of its workers waiting, or
# its CLAIM_UNTIL passed), the one of them with the fewest workers alive, until each ends cleanly; so the
# end of a lease whose GRPO trials are done runs ES's reruns, continuations and control instead of
# leaving the card idle. A method in FILL takes only those slots, and `start` records FILL for the
# later calls' refills as it does CLAIM_UNTIL. Workers draw no figures (a lent machine may lack plotly and
# chromium): the figures come from the compacted study (scripts/study_tables.py). REBUILD_AT_START=1:
# `start` also starts `rebuild` detached beside the workers (it rebuilds finished reruns only), so
# the rebuilds run while the workers do rather than after them. PLACE="grpo_full@0 grpo_full@0
# es_lora@1 ...": one worker per METHOD@CARD instead of METHODS x WORKERS_PER_METHOD dealt round-robin
# (a method kept to cards of its own, several workers on one card; a method given more workers than
# tune.parallel lets run trials at once is named at the start, with how many wait). CLAIM_UNTIL="grpo_full=EPOCH ...":
# a worker of that method starts no trial or run after that time (`evolm tune --claim-until`), for runs
# whose checkpoints never travel (full GRPO's) and so must end within the lease that starts them; its
# worker then ends and its card is refilled. FINISH_BY="grpo_full=EPOCH ...": the lease's end; a worker
# of that method starts only the trials and runs the study's own finished work says end by then
# (`evolm tune --finish-by`: a rerun paced by the method's reruns, its winner's trial before any; its
# continuation by the rerun), and ends once it turns one down, its card refilled; no fixed window to
# guess. ENGINE_START_S (210): how long a worker's engine takes to start on the lent machine (`evolm
# tune --engine-start-s`, passed with either deadline): a worker none of whose work would still fit
# once its engine is up starts none, and its slot is refilled at once.
# MPS_CARDS="0 1" (or all): CUDA's Multi-Process Service on those cards (a control daemon under
# MPS_DIR, started once a lease and checked with one CUDA process a card before any worker starts),
# so the processes sharing a card run their kernels side by side instead of the card switching between them; workers on other cards never reach the daemon (its pipe is not the
# default one), and each run's placement.jsonl names the pipe it used. SPEC and STUDY name another study, e.g.
#   SPEC=papermill_runs/tune_study_conciseness_gpu.yaml STUDY=runs/tune_study_conciseness bash scripts/gpu_tune_study.sh start
set -u
. "$(dirname "${BASH_SOURCE[0]}")/gpu_cards.sh"  # on_card, MPS_DIR, mps_vars, mps_daemon
SPEC=${SPEC:-papermill_runs/tune_study_addition_gpu.yaml}
STUDY=${STUDY:-runs/tune_study_addition}
LOGS=${LOGS:-runs/tune_study_logs}
METHODS=${METHODS:-es_full grpo_full grpo_lora es_lora es_eggroll}  # the slow ones first
# the other study's spec: the geometry measures each solution's drift on its held-out prompts
# (DRIFT_SPEC= none)
case "$SPEC" in
*conciseness*) DRIFT_SPEC=${DRIFT_SPEC-papermill_runs/tune_study_addition_gpu.yaml} ;;
*) DRIFT_SPEC=${DRIFT_SPEC-papermill_runs/tune_study_conciseness_gpu.yaml} ;;
esac
PACK_SECONDS=${PACK_SECONDS:-60}  # what a stage keeps for its pack
ENGINE_START_S=${ENGINE_START_S:-210}  # an engine's start on the lent H200, six at once and cold (docs/tuning.md)
POLL_S=${POLL_S:-5}  # how often a waiting stage looks at its workers (and refills their cards)
PACKS=${PACKS:-runs/tune_study_pack}  # the last pack's parts, kept on the machine for `parts`
RETURN_BYTES=${RETURN_BYTES:-67108864}  # what one device call brings back, its files together
FIRST_PARTS=${FIRST_PARTS:-4}     # the parts a pack puts in its DIR, fewer where they would pass RETURN_BYTES
# the compile caches vLLM, Inductor and Triton write (where the environment puts them, else their
# defaults), carried from one lease to the next so that a new machine's engines start warm
home=${HOME:-$(getent passwd "$(id -u)" | cut -d : -f 6)}
COMPILE_CACHES=${COMPILE_CACHES:-"${VLLM_CACHE_ROOT:-$home/.cache/vllm} ${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)} ${TRITON_CACHE_DIR:-$home/.triton/cache}"}
CACHE_ARCHIVE=${CACHE_ARCHIVE:-.gpu_stage/compile_cache.tar.gz}  # its parts, staged (gpu_stage_study.sh bundle)
export VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=2  # many processes share the machine's cores

cards() {  # the machine's GPUs (a CPU machine: one "card")
  local n
  n=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$n" -ge 1 ] || n=1
  echo "$n"
}

status() {  # status LOG...: the cards' memory and load, and each existing log's last lines
  nvidia-smi 2>/dev/null --query-gpu=index,name,memory.used,utilization.gpu --format=csv
  local f
  for f in "$@"; do [ -f "$f" ] || continue; echo "== $f"; tail -n 5 "$f"; done
}

alive() {  # workers of the last start still running
  local n=0 pid
  for pid in $(cat "$LOGS/workers.pids" 2>/dev/null); do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done
  echo $n
}

claim_until() {
  # claim_until METHOD [FILE]: the deadline `start` recorded from CLAIM_UNTIL ("METHOD=EPOCH_SECONDS ...";
  # FINISH_BY's with FILE finish_by.txt) for METHOD's new workers to start runs by (to end them by):
  # nothing when METHOD has none, "past" once it has passed
  local entry
  for entry in $(cat "$LOGS/${2:-claim_until.txt}" 2>/dev/null); do
    [ "${entry%%=*}" = "$1" ] || continue
    if [ "${entry#*=}" -gt "$(date +%s)" ]; then echo "${entry#*=}"; else echo past; fi
    return 0
  done
}

mps_env() {  # mps_env CARD: the variables that send CARD's processes through the MPS daemon (MPS_CARDS)
  grep -qx "$1" "$LOGS/mps_cards.txt" 2>/dev/null && mps_vars
}

start_mps() {
  # The MPS daemon for the cards of MPS_CARDS (validated by `start`), started unless one answers
  # already (an earlier call of the lease), and one CUDA process through it on each of those cards:
  # a daemon that cannot serve them stops the start before any worker has one
  local card
  : > "$LOGS/mps_cards.txt"
  [ -n "${MPS_CARDS:-}" ] || return 0
  mps_daemon || { echo "MPS_CARDS: the MPS control daemon did not start" >&2; exit 1; }
  for card in $MPS_CARDS; do
    echo "$card" >> "$LOGS/mps_cards.txt"
    env $(mps_env "$card") CUDA_VISIBLE_DEVICES="$card" python -c 'import torch; torch.ones(1, device="cuda").sum().item()' \
      || { echo "MPS_CARDS: card $card: a CUDA process through MPS failed (the daemon's log: $MPS_DIR/log)" >&2; exit 1; }
  done
  echo "MPS on cards $(paste -sd, "$LOGS/mps_cards.txt") (daemon: $MPS_DIR)"
}

stop() {
  # stop SECONDS [METHOD...]: TERM to each worker's process group (setsid made each a leader), KILL
  # after SECONDS; with METHODs, only the workers of those methods (the rebuilds and the others run
  # on, and a stopped worker is not refilled: it did not end cleanly), a method no worker was
  # started for refused before anything is stopped
  local seconds=$1 pid pids method groups="" waited=0
  shift
  if [ $# -gt 0 ]; then
    for method in "$@"; do
      cut -f 4 "$LOGS/workers.tsv" 2>/dev/null | grep -qx "$method" \
        || { echo "stop: no worker of $method was started (workers: $(cut -f 4 "$LOGS/workers.tsv" 2>/dev/null | sort -u | paste -sd ' ' -))" >&2; return 2; }
    done
    pids=$(while IFS=$'\t' read -r pid _ _ method _ _; do
      case " $* " in *" $method "*) echo "$pid" ;; esac
    done < "$LOGS/workers.tsv")
  else
    pids=$(cat "$LOGS/workers.pids" "$LOGS/rebuild.pid" "$LOGS/geometry_stage.pid" 2>/dev/null)
  fi
  for pid in $pids; do
    kill -0 "$pid" 2>/dev/null && groups="$groups $pid" && kill -TERM -- "-$pid" 2>/dev/null
  done
  while [ "$waited" -lt "$seconds" ]; do
    local left=0
    for pid in $groups; do kill -0 -- "-$pid" 2>/dev/null && left=$((left + 1)); done
    [ "$left" -eq 0 ] && break
    sleep 1; waited=$((waited + 1))
  done
  for pid in $groups; do kill -KILL -- "-$pid" 2>/dev/null && echo "process group $pid: killed after ${seconds} s"; done
  echo "stopped:${groups:- none running}"
}

launch() {  # launch METHOD CARD ENGINES LOG: one detached worker, recorded in workers.pids and workers.tsv
  local offset=0 claim finish deadline
  claim=$(claim_until "$1")
  finish=$(claim_until "$1" finish_by.txt)
  [ "$claim" = past ] && { echo "card $2: no worker of $1, whose deadline for starting runs has passed"; return 0; }
  [ "$finish" = past ] && { echo "card $2: no worker of $1, whose deadline for ending runs has passed"; return 0; }
  [ -f "$4" ] && offset=$(wc -c < "$4")  # logs are appended to: this worker's part starts here
  deadline=$claim$finish  # with either, the worker weighs its work as of its engine's start (ENGINE_START_S)
  env $(mps_env "$2") EVOLM_ENGINES_PER_CARD=$3 CUDA_VISIBLE_DEVICES=$2 \
    setsid python -m evolm_lib.cli tune "$SPEC" --methods "$1" --no-figures ${claim:+--claim-until "$claim"} \
    ${finish:+--finish-by "$finish"} ${deadline:+--engine-start-s "$ENGINE_START_S"} >> "$4" 2>&1 < /dev/null &
  echo $! >> "$LOGS/workers.pids"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' $! "$2" "$3" "$1" "$4" "$offset" >> "$LOGS/workers.tsv"
}

ended_cleanly() {  # ended_cleanly LOG OFFSET: the worker that wrote LOG from OFFSET on printed its summary
  tail -c +$(($2 + 1)) "$1" 2>/dev/null | grep -q '^summary: '
}

waiting() {  # waiting LOG OFFSET: the worker that writes LOG from OFFSET on waits for other workers
  # (its last line; a waiting worker prints nothing more until work it may start appears)
  tail -c +$(($2 + 1)) "$1" 2>/dev/null | grep -v '^[[:space:]]*$' | tail -n 1 | grep -q '^waiting for other workers: '
}

fewest_alive() {
  # fewest_alive DONE SKIP KIND METHOD...: of the METHODs not in DONE or SKIP (" a b " lists) whose
  # CLAIM_UNTIL has not passed and none of whose workers waits for the others (it has more hands than
  # work they may start: say, reruns that wait for its last trials), the one with the fewest workers
  # alive (the first listed of a tie); KIND at-work takes only a method with a worker alive, fill one
  # with none as well
  local done=$1 skip=$2 kind=$3 m n idle p mm l o target="" best=""
  shift 3
  for m in "$@"; do
    case "$done$skip" in *" $m "*) continue ;; esac
    [ "$(claim_until "$m")" = past ] && continue  # it may start nothing more here
    [ "$(claim_until "$m" finish_by.txt)" = past ] && continue
    n=0 idle=0
    while IFS=$'\t' read -r p _ _ mm l o; do
      [ "$mm" = "$m" ] && kill -0 "$p" 2>/dev/null || continue
      n=$((n + 1))
      waiting "$l" "$o" && idle=1
    done < "$LOGS/workers.tsv"
    [ "$idle" = 0 ] || continue
    [ "$kind" = fill ] || [ "$n" -gt 0 ] || continue
    if [ -z "$best" ] || [ "$n" -lt "$best" ]; then target=$m; best=$n; fi
  done
  echo "$target"
}

refill() {
  # A worker that ended cleanly (its summary line) found nothing left to claim in its method: its
  # card slot goes to a new worker of a method still at work (none of whose workers ended so), the
  # one with the fewest workers alive and none waiting. Methods left with the most work then get more
  # hands. A slot none of them may take goes to FILL's methods, the one with the fewest workers alive.
  local pid card engines method log offset target m done_methods fill
  while IFS=$'\t' read -r pid card engines method log offset; do
    kill -0 "$pid" 2>/dev/null && continue
    grep -qx "$pid" "$LOGS/replaced.txt" && continue
    echo "$pid" >> "$LOGS/replaced.txt"
    ended_cleanly "$log" "$offset" || continue  # died: its log says why; no replacement
    done_methods=" "
    while IFS=$'\t' read -r _ _ _ m l o; do ended_cleanly "$l" "$o" && done_methods="$done_methods$m "; done < "$LOGS/workers.tsv"
    fill=" $(cat "$LOGS/fill.txt" 2>/dev/null | paste -sd ' ' -) "
    target=$(fewest_alive "$done_methods" "$fill" at-work $METHODS)
    [ -n "$target" ] || target=$(fewest_alive "$done_methods" " " fill $fill)
    [ -n "$target" ] || continue
    launch "$target" "$card" "$engines" "$LOGS/$target.r$(wc -l < "$LOGS/replaced.txt").log"
    echo "card $card: a worker of $method ended; a worker of $target took its place"
  done < <(cat "$LOGS/workers.tsv")
}

start() {
  local archive=${1:-}
  if [ "$(alive)" -gt 0 ]; then
    echo "workers already running: $(alive)"; return 0
  fi
  local gpus per i=0 method entry card entries="" names wave=0 launched=0 n
  gpus=$(cards)
  if [ -n "${PLACE:-}" ]; then
    entries=$PLACE
  else
    per=${WORKERS_PER_METHOD:-$gpus}
    for method in $METHODS; do
      for _ in $(seq 1 "$per"); do entries="$entries $method@$((i % gpus))"; i=$((i + 1)); done
    done
  fi
  for entry in $entries; do
    card=${entry#*@}
    case "$entry" in *@*) ;; *) echo "PLACE: $entry is not METHOD@CARD" >&2; exit 2 ;; esac
    case "$card" in ''|*[!0-9]*) echo "PLACE: $entry: the card is not a number" >&2; exit 2 ;; esac
    [ "$card" -lt "$gpus" ] || { echo "PLACE: $entry: this machine has cards 0 to $((gpus - 1))" >&2; exit 2; }
  done
  [ "${MPS_CARDS:-}" = all ] && MPS_CARDS=$(seq -s ' ' 0 $((gpus - 1)))
  for card in ${MPS_CARDS:-}; do
    case "$card" in *[!0-9]*) echo "MPS_CARDS: $card is not a card number" >&2; exit 2 ;; esac
    [ "$card" -lt "$gpus" ] || { echo "MPS_CARDS: card $card: this machine has cards 0 to $((gpus - 1))" >&2; exit 2; }
  done
  if [ -n "${MPS_CARDS:-}" ] && ! command -v nvidia-cuda-mps-control > /dev/null; then
    echo "MPS_CARDS: this machine has no nvidia-cuda-mps-control" >&2; exit 2
  fi
  for entry in ${CLAIM_UNTIL:-}; do
    case "${entry#*=}" in ''|*[!0-9]*) echo "CLAIM_UNTIL: $entry is not METHOD=EPOCH_SECONDS" >&2; exit 2 ;; esac
  done
  for entry in ${FINISH_BY:-}; do
    case "${entry#*=}" in ''|*[!0-9]*) echo "FINISH_BY: $entry is not METHOD=EPOCH_SECONDS" >&2; exit 2 ;; esac
  done
  names=$(for entry in $entries; do echo "${entry%@*}"; done | awk '!seen[$0]++' | paste -sd, -)
  # each step before the launch timed: on a lent machine they come out of the time the runs must end in
  local began=$SECONDS stepped=$SECONDS steps=""
  step() { steps="$steps $1 $((SECONDS - stepped)) s,"; stepped=$SECONDS; }
  [ -n "$archive" ] && unpack "$archive"
  step unpack
  mkdir -p "$LOGS"
  : > "$LOGS/workers.pids"; : > "$LOGS/workers.tsv"; : > "$LOGS/replaced.txt"
  printf '%s\n' ${CLAIM_UNTIL:-} > "$LOGS/claim_until.txt"  # read again by later calls' refills
  printf '%s\n' ${FINISH_BY:-} > "$LOGS/finish_by.txt"
  printf '%s\n' ${FILL:-} > "$LOGS/fill.txt"
  python -c "from evolm_lib.models import resolve_model; resolve_model('smollm2-135m-instruct')" >/dev/null 2>&1
  step model
  # the dry run checks FILL's methods too: a name the spec lacks is refused before any worker starts
  python -m evolm_lib.cli tune "$SPEC" --dry-run --no-figures \
    --methods "$(printf '%s\n' ${names//,/ } ${FILL:-} | awk '!seen[$0]++' | paste -sd, -)" > "$LOGS/dry_run.txt" 2>&1 \
    || { cat "$LOGS/dry_run.txt" >&2; exit 1; }
  step "dry run"
  # tune.parallel caps a method's trials at once: its workers past that hold an engine and wait
  python -c '
import collections, sys
from evolm_lib.tune.spec import load_tune_spec
limit = load_tune_spec(sys.argv[1]).settings.parallel
for method, n in collections.Counter(entry.split("@")[0] for entry in sys.argv[2:]).items():
    if limit and n > limit:
        print(f"{method}: {n} workers, but tune.parallel runs {limit} of its trials at once: {n - limit} wait"
              " (an engine each) until its trials are done, then take its reruns")
' "$SPEC" $entries
  step "parallel check"
  restore_compile_cache
  step "compile caches"
  start_mps
  step MPS
  echo "before the launch:${steps%,}; $((SECONDS - began)) s in all" | tee "$LOGS/start_steps.txt"
  date +%s > "$LOGS/launched_at.txt"  # the status compares the first runs' start with it
  local total
  local -A workers  # each method's workers so far: their logs' numbers
  total=$(echo $entries | wc -w)
  # wave by wave, the next worker of each card: engines sharing a card start a few seconds apart,
  # since vLLM's start-up memory profile of one must not see another's allocations arrive
  while [ "$launched" -lt "$total" ]; do
    wave=$((wave + 1))
    for card in $(seq 0 $((gpus - 1))); do
      n=0
      for entry in $entries; do
        [ "${entry#*@}" = "$card" ] || continue
        n=$((n + 1))
        [ "$n" -eq "$wave" ] || continue
        method=${entry%@*}
        workers[$method]=$((${workers[$method]:-0} + 1))
        launch "$method" "$card" "$(echo " $entries " | grep -o "@$card " | wc -l)" "$LOGS/$method.${workers[$method]}.log"
        launched=$((launched + 1))
      done
    done
    sleep "${WAVE_S:-8}"
  done
  echo "$total workers on $gpus GPUs: $names"
  if [ "${REBUILD_AT_START:-0}" = 1 ]; then
    # the geometry's rebuilds beside the workers, detached as they are: a rebuild needs only a
    # finished rerun's config, and `finish` waits for these (after REBUILD_DELAY_S, so the workers'
    # engines have started before theirs)
    setsid bash -c "sleep ${REBUILD_DELAY_S:-60}; exec bash '$0' rebuild" > "$LOGS/rebuild.out" 2>&1 < /dev/null &
    echo $! > "$LOGS/rebuild.pid"
    echo "the geometry's rebuilds start beside them in ${REBUILD_DELAY_S:-60} s (log: $LOGS/rebuild.out)"
  fi
}

rebuild() {
  # The first three final seeds of every method (the geometry's), each rerun without weights here run
  # again by `python -m evolm_lib.tune.rebuild` into STUDY/rebuilt/, one process per method and seed,
  # round-robin over the cards; returns when all have ended (their logs: LOGS/rebuild.METHOD.SEED.log).
  local gpus method seed i=0 pids="" pid failed=0 total=0
  gpus=$(cards)
  mkdir -p "$LOGS"
  seeds() { ls "$STUDY/final/$1" | sed -n 's/^seed\([0-9]*\)$/\1/p' | sort -n | head -n 3; }
  for method in $(ls "$STUDY/final"); do total=$((total + $(seeds "$method" | wc -l))); done
  for method in $(ls "$STUDY/final"); do
    for seed in $(seeds "$method"); do
      # each run records the rebuilds that share its card (EVOLM_ENGINES_PER_CARD), as the workers do
      # and goes through the card's MPS daemon where the workers do (MPS_CARDS)
      env $(mps_env $((i % gpus))) EVOLM_ENGINES_PER_CARD=$(on_card "$total" "$gpus" "$i") CUDA_VISIBLE_DEVICES=$((i % gpus)) \
        python -m evolm_lib.tune.rebuild "$STUDY" --methods "$method" --seeds "$seed" \
        > "$LOGS/rebuild.$method.$seed.log" 2>&1 < /dev/null &
      pids="$pids $!"
      i=$((i + 1))
      [ $((i % gpus)) -eq 0 ] && sleep "${REBUILD_WAVE_S:-8}"  # engines of one card start apart, as the workers'
    done
  done
  for pid in $pids; do wait "$pid" || failed=$((failed + 1)); done
  tail -q -n 1 "$LOGS"/rebuild.*.log
  echo "$i rebuilds on $gpus GPUs, $failed failed or with rows that differ"
}

finish() {
  # The study's last steps on the machine that holds the reruns' weights, once no method has work
  # outstanding (tune.outstanding over the whole spec): the geometry's rebuilds, the geometry, the
  # compacted files, all in DIR/compact, packed as DIR/compact.tar.gz. Each step is stopped at the
  # deadline; what a stopped rebuild wrote resumes the next time.
  local dir=$1 until=$((SECONDS + ${2:-3600}))
  if ! python -c 'import sys
import optuna
from evolm_lib import tune
optuna.logging.set_verbosity(optuna.logging.WARNING)
left = tune.outstanding(tune.load_tune_spec(sys.argv[1], out=sys.argv[2]))
print(f"{len(left)} unfinished: {left[:3]}" if left else "the study is done")
sys.exit(1 if left else 0)' "$SPEC" "$STUDY"; then
    return 0
  fi
  last_steps "$dir" "$until"
}

last_steps() {
  # last_steps DIR UNTIL: the rebuilds, the geometry, the base model's held-out answers and the
  # compacted files into DIR/compact.tar.gz, each step stopped at UNTIL (bash's SECONDS)
  local dir=$1 until=$2
  mkdir -p "$dir/compact"
  local early
  early=$(cat "$LOGS/rebuild.pid" 2>/dev/null)  # rebuilds started beside the workers (REBUILD_AT_START)
  while [ -n "$early" ] && kill -0 "$early" 2>/dev/null && [ $((until - SECONDS)) -gt 30 ]; do sleep "$POLL_S"; done
  # GEOMETRY=0: the geometry was measured already (geometry-stage): the rows and summary alone
  [ "${GEOMETRY:-1}" = 1 ] && [ $((until - SECONDS)) -gt 30 ] && timeout --kill-after=10 $((until - SECONDS)) bash "$0" rebuild
  # the summary a worker last wrote may predate reruns finished since (a lease's end kills workers
  # before they write it): written again from the study, for the geometry's declared pairs and the
  # compacted copy; no run is started (--no-finals, every trial done)
  python -m evolm_lib.cli tune "$SPEC" --out "$STUDY" --no-finals --no-figures > "$dir/summary.txt" 2>&1
  [ "${GEOMETRY:-1}" = 1 ] && [ $((until - SECONDS)) -gt 30 ] && timeout --kill-after=10 $((until - SECONDS)) bash "$0" geometry "$dir"
  # the base model on the same held-out problems, the tables' reference, once, on the runs' machine
  if [ ! -f "$STUDY/base/heldout.jsonl" ] && [ $((until - SECONDS)) -gt 30 ]; then
    mkdir -p "$LOGS"
    timeout --kill-after=10 $((until - SECONDS)) python -m evolm_lib.tune.base "$SPEC" \
      --out "$STUDY/base/heldout.jsonl" > "$LOGS/base.txt" 2>&1
  fi
  python -m evolm_lib.tune.compact "$STUDY" "$dir/compact"
  # one file: the pack's parts beside it are as many as the call can still return (pack)
  tar -czf "$dir/compact.tar.gz" -C "$dir" compact && rm -rf "$dir/compact"
}

geometry_stage() {
  # The geometry of the reruns at the budget on a machine that runs no workers, while the study's later
  # stages (continuations, control) wait for a lease of their own: finish's steps without its check that
  # nothing is outstanding, started detached by the first call (after unpacking ARCHIVE) so they run on
  # across calls; each call waits for them until its SECONDS are up. A call that finds them ended
  # without their compact.tar.gz (failed, or killed) starts them again: rebuilds already made are kept.
  local seconds=$1 dir=$2 archive=${3:-} end pid work=$LOGS/geometry_stage
  end=$((SECONDS + seconds - 15))
  mkdir -p "$LOGS" "$dir"
  pid=$(cat "$LOGS/geometry_stage.pid" 2>/dev/null)
  if [ -z "$pid" ] || { ! kill -0 "$pid" 2>/dev/null && [ ! -f "$work/compact.tar.gz" ]; }; then
    [ -n "$pid" ] && echo "the last start ended without compact.tar.gz (its log's end: $(tail -n 1 "$LOGS/geometry_stage.out")): again"
    [ -n "$archive" ] && [ ! -d "$STUDY" ] && unpack "$archive"  # unpacked once: never over rebuilt runs
    rm -rf "$work"
    setsid bash -c "python -c \"from evolm_lib.models import resolve_model; resolve_model('smollm2-135m-instruct')\" \
      && exec bash '$0' last-steps '$work' ${GEOMETRY_STAGE_S:-3600}" > "$LOGS/geometry_stage.out" 2>&1 < /dev/null &
    echo $! > "$LOGS/geometry_stage.pid"
    echo "the rebuilds, the geometry and compact started (log: $LOGS/geometry_stage.out)"
  fi
  pid=$(cat "$LOGS/geometry_stage.pid")
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep "$POLL_S"; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "still running: the next call waits for them"
  elif [ -f "$work/compact.tar.gz" ]; then
    cp "$work/compact.tar.gz" "$dir/" && echo "done: $dir/compact.tar.gz"
  else
    echo "ended without compact.tar.gz: $dir/geometry_stage_status.txt says why"
  fi
  status "$LOGS/geometry_stage.out" "$LOGS"/rebuild.*.log > "$dir/geometry_stage_status.txt" 2>&1
}

geometry() {  # geometry DIR: the winners' geometry into DIR/compact/geometry.json
  python -m evolm_lib.tune.geometry "$STUDY" "$1/compact" ${DRIFT_SPEC:+--drift-spec "$DRIFT_SPEC"} ${GEOMETRY_ARGS:-}
}

compile_cache() {
  # compile_cache DIR [N]: the compile caches (COMPILE_CACHES) packed into PACKS once a machine (remove
  # PACKS/compile_cache.tar.gz.part-* to pack them again), in parts of PART_BYTES (absolute paths,
  # unpacked at / again), and their parts N to N+3 copied into DIR
  local dir=$1 first=${2:-0} paths="" path
  if [ ! -f "$PACKS/compile_cache.tar.gz.part-00" ]; then
    for path in $COMPILE_CACHES; do [ -d "$path" ] && paths="$paths ${path#/}"; done
    [ -n "$paths" ] || { echo "no compile cache here (COMPILE_CACHES: $COMPILE_CACHES)" >&2; return 1; }
    mkdir -p "$PACKS"
    tar -czf - -C / $paths | split -b "${PART_BYTES:-15728640}" -d -a 2 - "$PACKS/compile_cache.tar.gz.part-"
    for path in $paths; do echo "/$path: $(du -sh "/$path" | cut -f 1)"; done
  fi
  echo "compile cache parts$(copy_parts compile_cache.tar.gz "$first" "$dir") of $(ls "$PACKS"/compile_cache.tar.gz.part-* | wc -l) in $dir" \
    "($(cat "$PACKS"/compile_cache.tar.gz.part-* | wc -c) bytes): stage them as $CACHE_ARCHIVE.part-NN"
}

restore_compile_cache() {  # the compile caches an earlier machine packed, where staged: engines start warm
  [ -f "$CACHE_ARCHIVE.part-00" ] || return 0
  if cat "$CACHE_ARCHIVE".part-* | tar -xz -C /; then
    echo "compile caches restored from $CACHE_ARCHIVE.part-*"
  else
    echo "cannot unpack $CACHE_ARCHIVE.part-*: the engines start from a cold compile cache" >&2
  fi
}

unpack() {  # unpack ARCHIVE: a pack, or the parts pack split it into (ARCHIVE.part-00, -01, ...)
  local archive=$1
  if [ -f "$archive" ]; then
    mkdir -p "$(dirname "$STUDY")" && tar -xzf "$archive" -C "$(dirname "$STUDY")" || { echo "cannot unpack $archive" >&2; exit 1; }
  elif [ -f "$archive.part-00" ]; then
    mkdir -p "$(dirname "$STUDY")" && cat "$archive".part-* | tar -xz -C "$(dirname "$STUDY")" \
      || { echo "cannot unpack the parts $archive.part-*" >&2; exit 1; }
  else
    echo "no pack at $archive (nor its parts $archive.part-NN)" >&2; exit 1
  fi
  echo "unpacked $archive"
}

pack() {
  # The study packed (python -m evolm_lib.tune.pack; unfinished runs' checkpoints within CHECKPOINT_MIB)
  # into PACKS on this machine, split into tune_study.tar.gz.part-00, -01, ... of PART_BYTES: a device
  # call returns at most 8 files of 16 MiB, RETURN_BYTES together. The first FIRST_PARTS go to DIR (as
  # many as fit beside what DIR holds already, a compact.tar.gz say, and a MiB for the status), `parts N
  # DIR` copies the others in later calls; cat joins them, and start takes the parts as they are.
  local dir=$1 part=${PART_BYTES:-15728640} count first room
  mkdir -p "$dir" "$PACKS"
  rm -f "$PACKS"/tune_study.tar.gz* "$dir"/tune_study.tar.gz.part-*
  # the compacted study first, in every call: a few MiB, and the form that outlives the session (it is
  # what gets committed), so a machine lost before the pack's later parts are fetched loses only the
  # checkpoints of LoRA and GRPO runs under way. One finish wrote already (geometry, base) is kept.
  if [ "${COMPACT:-1}" = 1 ] && [ ! -f "$dir/compact.tar.gz" ]; then
    compact_archive "$dir" || echo "pack: the compacted study failed (above); the pack goes on without it" >&2
  fi
  python -m evolm_lib.tune.pack "$STUDY" "$PACKS/tune_study.tar.gz" --checkpoint-mib "${CHECKPOINT_MIB:-24}"
  split -b "$part" -d -a 2 "$PACKS/tune_study.tar.gz" "$PACKS/tune_study.tar.gz.part-" && rm "$PACKS/tune_study.tar.gz"
  count=$(ls "$PACKS"/tune_study.tar.gz.part-* | wc -l)
  room=$((RETURN_BYTES - $(du -cb "$dir" | tail -n 1 | cut -f 1) - 1048576))
  first=$((room / part)); [ "$first" -gt "$FIRST_PARTS" ] && first=$FIRST_PARTS; [ "$first" -lt 0 ] && first=0
  parts 0 "$dir" "$first"
  if [ "$count" -gt "$first" ]; then
    echo "this call returns $first of the pack's $count parts: the others with \`bash $0 parts $first DIR\`, $((RETURN_BYTES / part)) a call, before the machine goes back"
  fi
  status "$LOGS"/*.log > "$dir/tune_study_status.txt" 2>&1
  cat "$LOGS/start_steps.txt" >> "$dir/tune_study_status.txt" 2>/dev/null
  # where each method stands, runs under way with their generation or step and checkpoint
  python -m evolm_lib.tune.progress "$SPEC" --out "$STUDY" 2>&1 | tee -a "$dir/tune_study_status.txt"
  # and how fast each attempt went where it ran (this code's, where EVOLM_CODE_COMMIT names it): in the status only
  # and, from the time start launched the workers, how long their engines took to start
  { echo; python -m evolm_lib.tune.placement_times "$STUDY" ${EVOLM_CODE_COMMIT:+--commit "$EVOLM_CODE_COMMIT"} \
      $([ -f "$LOGS/launched_at.txt" ] && echo --launched-at "$(cat "$LOGS/launched_at.txt")"); } \
    >> "$dir/tune_study_status.txt" 2>&1
  echo "$(alive) workers alive" | tee -a "$dir/tune_study_status.txt"
}

compact_archive() {  # compact_archive DIR: the study's rows and scores, its summary written afresh, as DIR/compact.tar.gz
  local work="$PACKS/compact_work"
  rm -rf "$work" && mkdir -p "$work" "$1" \
    && python -m evolm_lib.tune.compact "$STUDY" "$work/compact" --spec "$SPEC" \
    && tar -czf "$1/compact.tar.gz" -C "$work" compact
  local rc=$?
  rm -rf "$work"
  return $rc
}

parts() {  # parts N DIR [COUNT]: the last pack's parts N, N+1, ... (COUNT of them, by default as many as a
  # call returns) copied into DIR
  echo "parts$(copy_parts tune_study.tar.gz "$@") of $(ls "$PACKS"/tune_study.tar.gz.part-* 2>/dev/null | wc -l) in $2"
}

copy_parts() {  # copy_parts ARCHIVE N DIR [COUNT]: PACKS/ARCHIVE.part-N, N+1, ... into DIR; says which
  local first=$2 dir=$3 count=${4:-$((RETURN_BYTES / ${PART_BYTES:-15728640}))} i file copied=""
  mkdir -p "$dir"
  for i in $(seq "$first" $((first + count - 1))); do
    file=$(printf '%s/%s.part-%02d' "$PACKS" "$1" "$i")
    [ -f "$file" ] && cp "$file" "$dir/" && copied="$copied $(printf %02d "$i")"
  done
  echo "${copied:- none}"
}

case "${1:-}" in
start) start "${2:-}" ;;
pack) pack "${2:?pack DIR}" ;;
parts) parts "${2:?parts N DIR [COUNT]}" "${3:?parts N DIR [COUNT]}" ${4:+"$4"} ;;
stop) stop "${2:-30}" "${@:3}" ;;
compact) compact_archive "${2:?compact DIR}" ;;
compile-cache) compile_cache "${2:?compile-cache DIR [N]}" "${3:-0}" ;;
rebuild) rebuild ;;
finish) finish "${2:?finish DIR [SECONDS]}" "${3:-3600}" ;;
last-steps) last_steps "${2:?last-steps DIR [SECONDS]}" $((SECONDS + ${3:-3600})) ;;
geometry-stage) geometry_stage "${2:?geometry-stage SECONDS DIR [ARCHIVE]}" "${3:?geometry-stage SECONDS DIR [ARCHIVE]}" "${4:-}" ;;
geometry) geometry "${2:?geometry DIR}" ;;
stage)
  seconds=${2:?stage SECONDS DIR [ARCHIVE]}; dir=${3:?stage SECONDS DIR [ARCHIVE]}
  # SECONDS is the whole stage, start and pack included: it ends by then, so a device call of that
  # limit always gets its pack back (the workers' start alone takes a minute: 8 s between waves)
  end=$((SECONDS + seconds - PACK_SECONDS))
  start "${4:-}"
  # stop waiting when no worker is left: the study is done, or the workers died (their logs say why)
  while [ $SECONDS -lt $end ] && [ "$(alive)" -gt 0 ]; do
    [ "${REFILL:-1}" = 1 ] && refill
    sleep "$POLL_S"
  done
  # every worker ended: the study may be done, and its weights are still here
  [ "$(alive)" -eq 0 ] && [ "${FINISH:-1}" = 1 ] && finish "$dir" $((end - SECONDS))
  pack "$dir" ;;
*) sed -n '2,/^set -u$/{/^set -u$/!p}' "$0"; exit 2 ;;  # the header above
esac
