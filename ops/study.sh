#!/usr/bin/env bash
# An `evolm tune` study on an offline GPU host for a bounded time, and the study brought back within
# a size limit on what comes back from a command (ops/README.md says how the three steps fit together).
#
#   bash ops/study.sh run SPEC STUDY SECONDS [METHODS...]   # there: workers on the cards for SECONDS
#   bash ops/study.sh pack STUDY DIR                       # there: export.tar.gz and the study in parts
#   bash ops/study.sh unpack DIR STUDY                     # here: the parts joined into a new study folder
#
# run: one worker per METHODS argument (`--methods` of `evolm tune`, e.g. es_full,es_lora), or one per
# card tuning every method; workers are dealt round-robin over the cards. Each starts no new trial after
# SECONDS (`--timeout`) and is stopped at SECONDS + GRACE_S (default 0): a trial stopped then is retried
# by the next worker from its newest checkpoint. MPS=1: the processes of a card share it through CUDA's
# MPS. Logs: STUDY/logs/worker_N.log. Extra `evolm tune` options: TUNE_ARGS.
# pack: PART_MB (default 15) per part; each run folder's newest checkpoint goes in, none of the saved
# models, snapshots or figures; a checkpoint over CHECKPOINT_MB (default: no limit) stays behind, with
# the whole run folder where the run is unfinished (it starts again there), named in left_out.txt.
set -euo pipefail
EVOLM=${EVOLM:-python -m evolm_lib.cli}
die() { echo "$*" >&2; exit 2; }

run() {
  local spec=$1 study=$2 seconds=$3 cards i=0 card pids=() workers
  shift 3
  [ -f "$spec" ] || die "SPEC $spec: no such file"
  [[ $seconds =~ ^[0-9]+$ ]] || die "SECONDS $seconds: a whole number of seconds"
  workers=("$@")
  cards=$(nvidia-smi -L 2>/dev/null | wc -l) && [ "$cards" -ge 1 ] || cards=1
  [ ${#workers[@]} -gt 0 ] || for ((i = 0; i < cards; i++)); do workers+=(""); done
  mkdir -p "$study/logs"
  export VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
  [ "${MPS:-0}" = 1 ] && { . "$(dirname "$0")/mps.sh"; mps_start; export $(mps_vars); }
  # the embedded model is converted once, before the workers would race to convert it
  python -c "from evolm_lib.models import resolve_model; resolve_model('${MODEL:-smollm2-135m-instruct}')" > /dev/null
  for ((i = 0; i < ${#workers[@]}; i++)); do
    card=$((i % cards))
    # shellcheck disable=SC2086  # EVOLM and TUNE_ARGS hold several words
    EVOLM_ENGINES_PER_CARD=$(((${#workers[@]} - card + cards - 1) / cards)) CUDA_VISIBLE_DEVICES=$card \
      timeout --signal=TERM --kill-after=30 $((seconds + ${GRACE_S:-0})) $EVOLM tune "$spec" --out "$study" \
      ${workers[i]:+--methods "${workers[i]}"} --timeout "$seconds" --no-figures ${TUNE_ARGS:-} \
      >> "$study/logs/worker_$i.log" 2>&1 < /dev/null &
    pids+=($!)
    # engines that share a card start apart: vLLM's memory profile of one must not see another's arrive
    [ $(((i + 1) % cards)) -eq 0 ] && sleep "${WAVE_S:-8}"
  done
  echo "${#workers[@]} workers on $cards cards until $(date -d "+$((seconds + ${GRACE_S:-0})) sec" +%T)"
  for i in "${!pids[@]}"; do
    wait "${pids[i]}" && echo "worker $i: done" || echo "worker $i: exit $? ($study/logs/worker_$i.log)"
  done
  tail -n 3 "$study"/logs/worker_*.log
}

pack() {
  local study=${1%/} dir=$2 ck mb run
  [ -f "$study/optuna.db" ] || die "STUDY $study: no optuna.db there (not a study folder)"
  [ ! -e "$dir/study.tar.gz.part-000" ] || die "DIR $dir holds a pack already: give an empty folder"
  mkdir -p "$dir"
  tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
  # shellcheck disable=SC2086  # EVOLM holds several words
  if ! { $EVOLM tune export "$study" "$tmp/export" && tar -czf "$dir/export.tar.gz" -C "$tmp" export; }; then
    echo "pack: \`evolm tune export\` failed (above): the pack goes on without export.tar.gz" >&2
  fi
  # SQLite's backup API: a consistent copy even while a worker writes
  python -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))' \
    "$study/optuna.db" "$tmp/optuna.db"
  (cd "$study" && find . -type f ! -name 'optuna.db*' ! -name '*.lock' | sed 's|^\./||' | sort) > "$tmp/all"
  # every file but weights saved at a run's end, snapshots, figures and checkpoints older than a run's newest
  awk 'function ck(p) { return match(p, /\/checkpoints\/[0-9]+\//) ? substr(p, 1, RSTART + RLENGTH - 2) : "" }
    function run(c) { sub(/\/[0-9]+$/, "", c); return c }
    function step(c) { sub(/^.*\//, "", c); return c + 0 }
    NR == FNR { c = ck($0); if (c != "" && (!(run(c) in best) || step(c) > step(best[run(c)]))) best[run(c)] = c; next }
    /(^|\/)(final_model|final_adapter|snapshots|figures|\.[^\/]*)\// { next }
    /(^|\/)adapter\// && ck($0) == "" { next }
    /(^|\/)checkpoints\// && (ck($0) == "" || best[run(ck($0))] != ck($0)) { next }
    { print }' "$tmp/all" "$tmp/all" > "$tmp/files"
  : > "$dir/left_out.txt"
  for ck in $(grep -o '^.*/checkpoints/[0-9]*' "$tmp/files" | sort -u); do
    mb=$(du -sm "$study/$ck" | cut -f 1)
    [ "$mb" -gt "${CHECKPOINT_MB:-999999999}" ] || continue
    run=${ck%/checkpoints/*}
    # a finished run keeps its rows and scores; an unfinished one without its checkpoint starts again
    if [ -e "$study/$run/heldout.jsonl" ] || [ -d "$study/$run/final_adapter" ] || [ -d "$study/$run/final_model" ]; then
      grep -v "^$ck/" "$tmp/files" > "$tmp/kept" || true; echo "$ck ($mb MB)" >> "$dir/left_out.txt"
    else
      grep -v "^$run/" "$tmp/files" > "$tmp/kept" || true; echo "$run (its checkpoint: $mb MB)" >> "$dir/left_out.txt"
    fi
    mv "$tmp/kept" "$tmp/files"
  done
  tar -czf - -C "$tmp" optuna.db -C "$(cd "$study" && pwd)" -T "$tmp/files" \
    | split -b "${PART_MB:-15}M" -d -a 3 - "$dir/study.tar.gz.part-"
  (cd "$dir" && sha256sum study.tar.gz.part-* > study.sha256)
  echo "$dir: $(ls "$dir"/study.tar.gz.part-* | wc -l) parts" \
    "($(cat "$dir"/study.tar.gz.part-* | wc -c) bytes) of $(($(wc -l < "$tmp/files") + 1)) files, beside $(cd "$dir" && ls -I 'study.tar.gz.part-*' | paste -sd ' ' -)"
  [ -s "$dir/left_out.txt" ] && { echo "left behind (left_out.txt):"; cat "$dir/left_out.txt"; }
  return 0
}

unpack() {
  local dir=$1 study=${2%/} partial
  [ -f "$dir/study.sha256" ] || die "DIR $dir: no study.sha256 (bring it back with the parts)"
  [ ! -e "$study" ] || [ -z "$(ls -A "$study")" ] || die "STUDY $study exists and is not empty: unpack into a new folder"
  (cd "$dir" && sha256sum --quiet -c study.sha256) || die "DIR $dir: a part is missing or damaged (above)"
  partial=$study.unpacking && rm -rf "$partial" && mkdir -p "$partial"
  cut -d ' ' -f 3 "$dir/study.sha256" | sed "s|^|$dir/|" | xargs -d '\n' cat | tar -xzf - -C "$partial"
  rmdir "$study" 2>/dev/null || true
  mv "$partial" "$study"
  echo "$study: $(find "$study" -type f | wc -l) files; \`evolm tune SPEC --out $study\` continues the study"
}

case "${1:-}" in
run) [ $# -ge 4 ] || die "run SPEC STUDY SECONDS [METHODS...]"; run "${@:2}" ;;
pack) [ $# -eq 3 ] || die "pack STUDY DIR"; pack "$2" "$3" ;;
unpack) [ $# -eq 3 ] || die "unpack DIR STUDY"; unpack "$2" "$3" ;;
*) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 2 ;;
esac
