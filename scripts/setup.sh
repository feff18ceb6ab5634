#!/usr/bin/env bash
# Create .venv (once) and install the engine with its test extra.
# torch goes in first and pinned: on CPU machines torch==2.13.0 is the CPU wheel;
# for GPUs install a CUDA build of torch into .venv first (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -e ".[test]"
