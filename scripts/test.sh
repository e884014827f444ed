#!/usr/bin/env bash
# The whole test suite on a fresh machine: .venv with the test extras, the Debian packages
# the tests use (installed when running as root), then ruff, mypy and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh test

# System tools the tests use (each test skips with the reason where one is missing):
# promtool and prometheus (Debian package prometheus), victoria-metrics (the cluster test
# against a second store), wrk (load test), a C compiler (the
# fake libnvidia-ml.so.1 of the end-to-end tests and the benchmarks, tests/fakenvml),
# chromium (the status page in a headless browser).
need=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || need+=(prometheus)
command -v victoria-metrics >/dev/null || need+=(victoria-metrics)
command -v wrk >/dev/null || need+=(wrk)
command -v cc >/dev/null || command -v gcc >/dev/null || need+=(gcc libc6-dev)
command -v chromium >/dev/null || need+=(chromium)
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing Debian packages: ${need[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
            || echo "could not install ${need[*]}: the tests that need them will be skipped (see the skip reasons)" >&2
    else
        echo "missing ${need[*]} and cannot install them: the tests that need them will be skipped" >&2
    fi
fi

set -x
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
