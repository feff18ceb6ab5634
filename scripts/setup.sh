#!/usr/bin/env bash
# Create .venv (once) and install the engine with its test extra into it.
#
# A run with nothing changed installs nothing: after a successful install a stamp in .venv records what it
# was made from (pyproject.toml, this script, TORCH_VERSION, .venv's Python, the checkout's path); while
# those stay the same, the run ends at once. SETUP_FORCE=1 installs again regardless.
#
# torch goes in first, pinned (TORCH_VERSION, default 2.13.0), and only when .venv has none: a CUDA build
# installed into .venv beforehand is kept (docs/operations.md, "A real Wan model on GPUs"). PYTHON picks the interpreter .venv is made from.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV_PY=.venv/bin/python
STAMP=.venv/.setup-stamp

say() { echo "setup: $*"; }

digest() {  # sha256 of stdin, in hex
  if command -v sha256sum >/dev/null 2>&1; then sha256sum; else shasum -a 256; fi | cut -d' ' -f1
}

install_key() {  # what an install is made from; any change means installing again
  {
    cat pyproject.toml scripts/setup.sh
    echo "torch==$TORCH_VERSION"
    "$VENV_PY" -S -c 'import sys; print(sys.version)'  # -S: no site packages to scan, a few ms
    pwd -P
  } | digest
}

if [ -z "${SETUP_FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(install_key 2>/dev/null)" ]; then
  say "up to date (.venv)"
  exit 0
fi

start=$SECONDS
if ! "$VENV_PY" -S -c '' 2>/dev/null; then
  say "first run: creating .venv and installing torch and the engine's dependencies into it:"
  say "about 1.3 GB on disk with the CPU build of torch, a few minutes; later runs skip this"
  say "creating .venv with $("${PYTHON:-python3}" --version 2>&1)"
  "${PYTHON:-python3}" -m venv .venv
fi
rm -f "$STAMP"  # an interrupted install must not look finished
if ! "$VENV_PY" -c "import torch" 2>/dev/null; then
  say "installing torch==$TORCH_VERSION (the largest part: the CPU wheel is 190 MB, 750 MB installed; CUDA: more)"
  "$VENV_PY" -m pip install -q "torch==$TORCH_VERSION"
fi
say "installing disagg-diffusion (editable) and its test extra"
"$VENV_PY" -m pip install -q -e ".[test]"
install_key > "$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
say "done in $((SECONDS - start)) s (.venv: $(du -sh .venv 2>/dev/null | cut -f1))"
