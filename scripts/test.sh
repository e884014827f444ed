#!/usr/bin/env bash
# The whole test suite on a fresh machine: .venv with the test extras, the Debian packages
# prometheus and chromium (installed when running as root), then ruff, mypy and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh test

# System packages some tests need: promtool and prometheus (Debian "prometheus"; the rules
# tests and the real-Prometheus integration tests) and chromium (the status page test).
# Installed when running as root; otherwise, or if apt fails, those tests skip and say why.
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing ${missing[*]} (Debian packages)" >&2
        apt-get update -qq || true
        for pkg in "${missing[@]}"; do
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null \
                || echo "could not install $pkg: the tests that need it will be skipped (see the skip reasons)" >&2
        done
    else
        echo "${missing[*]} not found and cannot install: the tests that need them will be skipped" >&2
    fi
fi

set -x
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
