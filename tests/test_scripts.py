"""scripts/run.sh, the README's first command, with the arguments its header invites.

Run in a copy of the scripts with a stand-in ``.venv`` (a ``python`` that records pip calls
and a ``gpu-exporter`` that prints its arguments): fast, offline, and it sees exactly what
run.sh would install and start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "pip $*" >> "$(dirname "$0")/../pip.log"
    exit 0
fi
exec {sys.executable} "$@"
"""

FAKE_EXPORTER = """#!/bin/sh
echo "gpu-exporter $*"
"""


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    for name in ("run.sh", "_venv.sh"):
        shutil.copy2(ROOT / "scripts" / name, tmp_path / "scripts" / name)
    shutil.copy2(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("gpu-exporter", FAKE_EXPORTER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return tmp_path


def test_run_sh_passes_its_arguments_to_serve_not_to_pip(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(tree / "scripts" / "run.sh"), "--listen-address", "127.0.0.1:9401"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    pip = (tree / ".venv" / "pip.log").read_text()
    assert "install -q -e ." in pip
    assert "--listen-address" not in pip  # was: pip install -e ".[--listen-address]"
    # No driver in the test environment: run.sh serves simulated GPUs, with our arguments.
    assert result.stdout.strip().endswith("serve --simulate 4 --listen-address 127.0.0.1:9401") or (
        result.stdout.strip() == "gpu-exporter serve --listen-address 127.0.0.1:9401"
    )
