#!/usr/bin/env bash
# The whole test suite on a fresh machine: .venv with the test extras, promtool (Debian
# package "prometheus") and a C compiler (gcc, for the fake libnvidia-ml.so.1 of the
# end-to-end tests), both installed when running as root, then ruff, mypy and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh test

if ! command -v promtool >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing promtool (Debian package prometheus)" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
            || echo "could not install prometheus: promtool tests will be skipped (see the skip reasons)" >&2
    else
        echo "promtool not found and cannot install it: promtool tests will be skipped" >&2
    fi
fi

if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing gcc (for tests/fakenvml)" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null \
            || echo "could not install gcc: end-to-end tests will be skipped (see the skip reasons)" >&2
    else
        echo "no C compiler and cannot install one: end-to-end tests will be skipped" >&2
    fi
fi

set -x
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
