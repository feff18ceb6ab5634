#!/usr/bin/env bash
# Set up, then run the test suite (real worker processes and sockets on loopback).
# Extra arguments go to pytest: scripts/test.sh -k parity, or scripts/test.sh tests/test_sde.py for one file
# (without test paths pytest runs tests/, pyproject.toml's testpaths).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The browser tests (tests/test_web_page.py) drive Debian's chromium: installed here when it is missing and
# apt-get can (as root); elsewhere, or with SETUP_BROWSER=0, nothing happens and those tests skip, saying why.
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
if [ "${SETUP_BROWSER:-1}" != 0 ] && [ ! -x "$CHROMIUM" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "test: installing chromium (apt-get) for the browser tests"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "test: chromium could not be installed; the browser tests will skip"
fi
exec .venv/bin/python -m pytest -q "$@"
