#!/usr/bin/env bash
# What a tuning worker imports beyond a run (Optuna, scipy, statsmodels and theirs), staged for a lent
# GPU machine that has no network, beside vLLM's own staging (../shared/GPU.md):
#
#   bash scripts/gpu_stage_study.sh download   # here: the wheels for CPython 3.12 on x86-64 Linux, in
#                                              # .gpu_stage/study/part.NN of at most 40 MB (keep .gpu_stage/ ignored)
#   bash scripts/gpu_stage_study.sh install    # there, once every part is in .gpu_stage/study/ (one device
#                                              # call per part, carry=['.gpu_stage/study/part.NN']): into /root/site
#
#   bash scripts/gpu_stage_study.sh bundle [ARCHIVE PART...]   # here: vLLM's staged parts (.gpu_stage/part.NN,
#                                              # unstage.sh), these wheels' parts and a study's pack (its PARTs copied
#                                              # in as .gpu_stage/ARCHIVE.part-NN; the engines' compile caches
#                                              # too, where put there as compile_cache.tar.gz.part-NN) in one tar, split into
#                                              # .gpu_stage/bundle/piece.NN that fill a call's carry beside the tree
#   STUDY=runs/NAME bash scripts/gpu_stage_study.sh restore SPEC COMPACT ARCHIVE   # here, where the study's last
#                                              # pack is lost: the study written again from its committed compacted
#                                              # files (python -m evolm_lib.tune.restore), packed, and split into
#                                              # .gpu_stage/ARCHIVE.part-NN, which `bundle` then carries
#   bash scripts/gpu_stage_study.sh keep NAME PATH...   # here, after a lease's last call: its reply (PATHs: the
#                                              # folders its files came back to, or the files: compact.tar.gz,
#                                              # tune_study.tar.gz.part-NN, tune_study_status.txt) kept in
#                                              # .gpu_stage/packs/NAME/, git-ignored; a pack whose parts do not
#                                              # join is kept all the same, named DAMAGED, and never restored
#                                              # from. `restore` takes a kept pack whose compact.tar.gz is
#                                              # COMPACT's files, byte for byte, in place of a restore, so LoRA
#                                              # and GRPO runs under way go on from its checkpoints where this
#                                              # checkout outlives the session (KEPT_PACKS=0: not); the other
#                                              # kept packs, DAMAGED ones too, hand on the runs they hold whole
#                                              # that are further on (python -m evolm_lib.tune.salvage)
#   bash scripts/gpu_stage_study.sh unbundle   # there, once every piece is in /root/bundle/ (one call each:
#                                              # mkdir -p /root/bundle && cp .gpu_stage/bundle/piece.NN /root/bundle/):
#                                              # the files back in .gpu_stage/, vLLM's parts in /root/stage/ for
#                                              # unstage.sh; then `bash /root/unstage.sh` and `install`. Run again in a
#                                              # later call whose copy of the tree lacks .gpu_stage/, it copies them back
#                                              # (a file that call carried into .gpu_stage/ is kept)
#   bash scripts/gpu_stage_study.sh ready      # there: unbundle, unstage.sh and install, each where not done yet;
#                                              # what each call of a lease begins with
#
# `evolm tune SPEC --dry-run` then says whether the machine has what a worker needs.
set -euo pipefail
STAGE=.gpu_stage/study
SITE=${SITE:-/root/site}
ROOT=${STAGE_ROOT:-/root}  # where the pieces arrive and vLLM's parts go, on the GPU machine
CARRY_BYTES=${CARRY_BYTES:-67108864}  # what one device call carries, the working tree included
PACKS_KEPT=${PACKS_KEPT:-.gpu_stage/packs}  # here: the lease replies `keep` stores, git-ignored

stage_parts() {  # stage_parts ARCHIVE PART...: the parts of a pack as .gpu_stage/ARCHIVE.part-NN, for `bundle`
  local archive=$1 part; shift
  mkdir -p .gpu_stage && rm -f ".gpu_stage/$archive".part-*
  for part in "$@"; do cp "$part" ".gpu_stage/$archive.part-${part##*.part-}"; done
}

case "${1:-}" in
download)
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$tmp/w" optuna==5.0.0 alembic sqlalchemy greenlet colorlog Mako MarkupSafe cmaes==0.13.1 \
    scipy==1.17.1 statsmodels==0.15.0 patsy "pandas==2.3.3" python-dateutil six tzdata pytz 2>&1 \
    | grep -v '^WARNING: Location' || true
  tar -C "$tmp/w" -cf "$tmp/study.tar" .
  rm -rf "$STAGE"; mkdir -p "$STAGE"
  split -b 40000000 -d "$tmp/study.tar" "$STAGE/part."
  echo "$(ls "$tmp/w" | wc -l) wheels in $(ls "$STAGE" | wc -l) parts under $STAGE/"
  ;;
install)
  mkdir -p "$STAGE/w" "$SITE"
  cat "$STAGE"/part.* | tar -xf - -C "$STAGE/w"
  python3 - "$STAGE/w" "$SITE" <<'PY'
import glob, os, sys, zipfile
wheels, site = sys.argv[1], sys.argv[2]
for wheel in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, site)
            mode = info.external_attr >> 16
            if mode & 0o111:
                os.chmod(path, mode & 0o777)
print(f"installed {len(glob.glob(os.path.join(wheels, '*.whl')))} wheels into {site}")
PY
  ;;
bundle)
  # a call carries the working tree (tracked and untracked files git does not ignore) beside one piece
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f 1)
  piece=${PIECE_BYTES:-$((CARRY_BYTES - tree - 2000000))}
  [ "$piece" -gt 0 ] || { echo "the working tree ($tree bytes) leaves no room for a piece" >&2; exit 1; }
  if [ $# -ge 2 ]; then
    archive=$2; shift 2
    stage_parts "$archive" "$@"
  fi
  # a pack and the compile caches are optional (a study's first lease has neither)
  files=$(cd .gpu_stage && shopt -s nullglob && echo part.[0-9]* unstage.sh study/part.[0-9]* *.part-[0-9]*)
  rm -rf .gpu_stage/bundle; mkdir -p .gpu_stage/bundle
  (cd .gpu_stage && tar -cf - $files) | split -b "$piece" -d - .gpu_stage/bundle/piece.
  echo "$(echo $files | wc -w) files in $(ls .gpu_stage/bundle | wc -l) pieces of at most $piece bytes under .gpu_stage/bundle/"
  ;;
keep)
  name=${2:?keep NAME PATH...}; shift 2
  [ $# -gt 0 ] || { echo "keep NAME PATH...: no reply folder or file given" >&2; exit 2; }
  [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || { echo "keep: NAME $name: letters, digits, '.', '_' and '-' only" >&2; exit 2; }
  kept=$PACKS_KEPT/$name
  [ -e "$kept" ] && { echo "$kept exists: a kept pack is never overwritten (choose another NAME)" >&2; exit 1; }
  files=()
  for path in "$@"; do
    if [ -d "$path" ]; then
      for f in "$path"/compact.tar.gz "$path"/tune_study.tar.gz.part-* "$path"/tune_study_status.txt; do
        [ -f "$f" ] && files+=("$f")
      done
    elif [ -f "$path" ]; then files+=("$path")
    else echo "keep: no such file or folder: $path" >&2; exit 1
    fi
  done
  mkdir -p "$kept"
  for f in "${files[@]}"; do
    [ -e "$kept/$(basename "$f")" ] && { echo "keep: two files named $(basename "$f") ($f): give each part once" >&2; rm -rf "$kept"; exit 1; }
    cp -p "$f" "$kept/"
  done
  # a pack kept whole or named as damaged: the parts must run from 00 without a gap and join into a
  # readable archive, beside the compacted study they were packed with
  why=""
  count=$(find "$kept" -maxdepth 1 -name 'tune_study.tar.gz.part-*' | wc -l)
  [ -f "$kept/compact.tar.gz" ] || why="no compact.tar.gz"
  [ "$count" -gt 0 ] || why="${why:+$why; }no tune_study.tar.gz.part-NN"
  for ((i = 0; i < count; i++)); do
    [ -f "$kept/tune_study.tar.gz.part-$(printf %02d "$i")" ] || { why="${why:+$why; }part $(printf %02d "$i") of $count missing"; break; }
  done
  if [ -z "$why" ] && ! cat "$kept"/tune_study.tar.gz.part-* | tar -tzf - > /dev/null 2>&1; then
    why="its $count parts do not join into a readable archive (a part not fetched, or cut short)"
  fi
  if [ -z "$why" ] && ! tar -tzf "$kept/compact.tar.gz" > /dev/null 2>&1; then why="compact.tar.gz is not readable"; fi
  if [ -n "$why" ]; then
    echo "$why" > "$kept/DAMAGED"
    echo "kept in $kept, DAMAGED ($why): restore never takes it" >&2; exit 1
  fi
  echo "kept in $kept: compact.tar.gz and the pack's $count parts ($(cat "$kept"/tune_study.tar.gz.part-* | wc -c) bytes)"
  ;;
restore)
  spec=${2:?restore SPEC COMPACT ARCHIVE}; compact=${3:?restore SPEC COMPACT ARCHIVE}; archive=${4:?restore SPEC COMPACT ARCHIVE}
  # the pack's top folder is the study's name: the GPU machine's `start` unpacks it beside STUDY
  name=$(basename "${STUDY:?STUDY: the study folder the GPU machine runs, e.g. runs/tune_study_conciseness}")
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  # an earlier restore's parts go first: a restore that fails leaves none for `bundle` to carry
  stage_parts "$archive"
  # A pack kept from the lease that wrote COMPACT holds what the compacted files cannot, the LoRA and
  # GRPO runs under way with their checkpoints: it is taken as it is, where its compacted study is
  # COMPACT's files byte for byte (a later lease's or an earlier one's is not the committed state).
  # Every other kept pack, whole or DAMAGED (cut short: a machine taken back before its later parts
  # came), then hands on the runs it holds whole that are further on (python -m evolm_lib.tune.salvage),
  # newest first, and the study is packed again where any was taken.
  base="" kept_all=()
  if [ "${KEPT_PACKS:-1}" = 1 ] && [ -d "$PACKS_KEPT" ]; then
    others=""
    for kept in $(ls -dt "$PACKS_KEPT"/*/ 2>/dev/null); do
      kept=${kept%/}; kept_all+=("$kept")
      [ -n "$base" ] && continue
      if [ -f "$kept/DAMAGED" ]; then others="$others $(basename "$kept") (DAMAGED)"; continue; fi
      rm -rf "$tmp/kept" && mkdir -p "$tmp/kept"
      if tar -xzf "$kept/compact.tar.gz" -C "$tmp/kept" 2>/dev/null && [ -d "$tmp/kept/compact" ] \
          && diff -rq "$tmp/kept/compact" "$compact" > /dev/null 2>&1 \
          && [ "$(cat "$kept"/tune_study.tar.gz.part-* | tar -tzf - 2>/dev/null | head -n 1 | cut -d / -f 1)" = "$name" ]; then
        base=$kept
        echo "the pack kept in $kept holds $compact's state: its $(ls "$kept"/tune_study.tar.gz.part-* | wc -l) parts, its runs" \
             "under way (LoRA and GRPO ones too) going on from its checkpoints"
        continue
      fi
      others="$others $(basename "$kept")"
    done
    [ -n "$others" ] && echo "kept packs that do not hold $compact's state:$others"
  fi
  salvaged=0
  salvage() {  # the other kept packs' runs laid over the study folder $tmp/$name; salvaged=1 where any was taken
    local from=() kept
    for kept in "${kept_all[@]}"; do [ "$kept" != "$base" ] && from+=("$kept"); done
    [ ${#from[@]} -gt 0 ] || return 0
    "${PYTHON:-python3}" -m evolm_lib.tune.salvage "$tmp/$name" "${from[@]}" | tee "$tmp/salvage.log"
    [[ "$(tail -n 1 "$tmp/salvage.log")" == "salvaged 0 runs"* ]] || salvaged=1
  }
  if [ -n "$base" ]; then
    mkdir -p "$tmp/base" && cat "$base"/tune_study.tar.gz.part-* | tar -xzf - -C "$tmp/base" && mv "$tmp/base/$name" "$tmp/$name"
    salvage
    if [ "$salvaged" = 0 ]; then
      stage_parts "$archive" "$base"/tune_study.tar.gz.part-*
      echo "its parts in .gpu_stage/$archive.part-NN, as kept"
      exit 0
    fi
  else
    "${PYTHON:-python3}" -m evolm_lib.tune.restore "$compact" "$spec" --out "$tmp/$name"
    salvage
  fi
  "${PYTHON:-python3}" -m evolm_lib.tune.pack "$tmp/$name" "$tmp/pack.tar.gz" --checkpoint-mib "${CHECKPOINT_MIB:-240}"
  split -b "${PART_BYTES:-15728640}" -d "$tmp/pack.tar.gz" ".gpu_stage/$archive.part-"
  echo "$(ls .gpu_stage/"$archive".part-* | wc -l) parts of the $([ -n "$base" ] && echo "kept" || echo "restored") study's pack" \
       "$([ "$salvaged" = 1 ] && echo "with the runs salvaged above ")in .gpu_stage/$archive.part-NN"
  ;;
unbundle)
  # The pieces are unpacked outside the checkout ($ROOT/unbundled), which a later call's copy of the tree
  # does not replace, and copied into .gpu_stage/ from there; so a later call whose copy no longer has
  # .gpu_stage/ runs `unbundle` again to get the wheels and packs back without carrying the pieces again.
  if compgen -G "$ROOT/bundle/piece.*" > /dev/null; then
    rm -rf "$ROOT/unbundled"; mkdir -p "$ROOT/unbundled" "$ROOT/stage"
    cat "$ROOT"/bundle/piece.* | tar -xf - -C "$ROOT/unbundled"
    mv "$ROOT"/unbundled/part.[0-9]* "$ROOT/stage/" && cp "$ROOT/unbundled/unstage.sh" "$ROOT/"
    rm -rf "$ROOT/bundle"
  elif [ ! -d "$ROOT/unbundled" ]; then
    echo "nothing to unbundle: no pieces in $ROOT/bundle/ and nothing unbundled before in $ROOT/unbundled/" >&2; exit 1
  fi
  # a file this call carried into .gpu_stage/ (a newer part) is kept: only what is missing is copied
  mkdir -p .gpu_stage
  (cd "$ROOT/unbundled" && find . -type f) | while IFS= read -r f; do
    [ -e ".gpu_stage/$f" ] || { mkdir -p ".gpu_stage/$(dirname "$f")" && cp -p "$ROOT/unbundled/$f" ".gpu_stage/$f"; }
  done
  echo "vLLM's $(ls "$ROOT/stage" | wc -l) parts in $ROOT/stage, $(ls "$STAGE" | wc -l) wheel parts in $STAGE, packs: $(ls .gpu_stage | grep -c '\.part-' || true) parts"
  ;;
ready)
  # unbundle, then vLLM's wheels (unstage.sh) and these (install) where not yet in SITE: the command every
  # call of a lease can begin with, the first (which carries the last piece) and each one after it
  bash "$0" unbundle
  if [ -d "$SITE/vllm" ]; then echo "vLLM already in $SITE"; else bash "$ROOT/unstage.sh" | tail -n 1; fi
  if [ -d "$SITE/optuna" ]; then echo "the study's wheels already in $SITE"; else bash "$0" install | tail -n 1; fi
  ;;
*) sed -n '2,/^set -euo pipefail$/{/^set -euo pipefail$/!p}' "$0"; exit 2 ;;  # the header above
esac
