# Sourced by run.sh and test.sh: make .venv (once) and install the project into it.
# Usage: . scripts/_venv.sh [EXTRA]   (EXTRA "test" adds pytest, hypothesis, ruff, mypy)
extra="${1:-}"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "gpu-exporter needs Python >= 3.10 (found: $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -m venv .venv 2>/dev/null; then
        # Debian and Ubuntu ship venv separately.
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "installing python3-venv" >&2
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
            rm -rf .venv && "$PYTHON" -m venv .venv
        else
            echo "cannot create a virtual environment: install python3-venv" >&2
            exit 1
        fi
    fi
fi
spec="."
[ -n "$extra" ] && spec=".[$extra]"
stamp=".venv/.installed-$(cat pyproject.toml | cksum | cut -d' ' -f1)-${extra:-base}"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -e "$spec"
    touch "$stamp"
fi
