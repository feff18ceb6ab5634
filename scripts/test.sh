#!/usr/bin/env bash
# Set up, then run the test suite (real worker processes and sockets on loopback).
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
