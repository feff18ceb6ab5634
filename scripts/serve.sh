#!/usr/bin/env bash
# Set up, then serve. With no arguments: the embedded tiny Wan model on http://127.0.0.1:8000.
# Any arguments go to launch.py, e.g. --model /path/to/Wan2.1-T2V-1.3B-Diffusers --topology encoder=1,denoise=2,decode=1
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python launch.py "$@"
