#!/usr/bin/env bash
# The HTML report's browser test drives Debian's headless chromium (tests/verify/test_html_engine.py).
# Install it when it is missing; nothing else is downloaded (the Python driver comes from PyPI
# with the dev dependencies and uses this browser, never a browser build of its own).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "chromium is missing; install Debian's chromium package (apt-get install chromium)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null
