#!/usr/bin/env bash
# Quickstart: install into .venv and serve on :9400. With an NVIDIA driver it reads the real
# GPUs; without one it says so and runs 4 simulated GPUs instead. Extra arguments go to
# `gpu-exporter serve` (e.g. --listen-address 127.0.0.1:9400).
set -euo pipefail
cd "$(dirname "$0")/.."
# An explicit (empty) EXTRA: a bare `. file` would hand the sourced file our own arguments.
. scripts/_venv.sh ""
if .venv/bin/python -c 'import ctypes; ctypes.CDLL("libnvidia-ml.so.1")' 2>/dev/null; then
    exec .venv/bin/gpu-exporter serve "$@"
fi
echo "No NVIDIA driver found (libnvidia-ml.so.1): serving 4 simulated GPUs (--simulate 4)." >&2
exec .venv/bin/gpu-exporter serve --simulate 4 "$@"
