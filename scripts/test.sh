#!/usr/bin/env bash
# Set up, then run the test suite (real worker processes and sockets on loopback).
# Extra arguments go to pytest: scripts/test.sh -k parity, or scripts/test.sh tests/test_sde.py for one file
# (without test paths pytest runs tests/, pyproject.toml's testpaths).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
