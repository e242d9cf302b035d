#!/usr/bin/env bash
# What a tuning worker imports beyond a run (Optuna, scipy, statsmodels and theirs), staged for a lent
# GPU machine that has no network, beside vLLM's own staging (../shared/GPU.md):
#
#   bash scripts/gpu_stage_study.sh download   # here: the wheels for CPython 3.12 on x86-64 Linux, in
#                                              # .gpu_stage/study/part.NN of at most 40 MB (keep .gpu_stage/ ignored)
#   bash scripts/gpu_stage_study.sh install    # there, once every part is in .gpu_stage/study/ (one device
#                                              # call per part, carry=['.gpu_stage/study/part.NN']): into /root/site
#
# `evolm tune SPEC --dry-run` then says whether the machine has what a worker needs.
set -euo pipefail
STAGE=.gpu_stage/study
SITE=${SITE:-/root/site}
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
*) sed -n 2,10p "$0"; exit 2 ;;
esac
