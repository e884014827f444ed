"""The wheel a user installs: licence, metadata, and the bundled scenarios usable by name.

Built offline from a copy of the sources with the test environment's setuptools
(``--no-build-isolation``; the test extra pins the same floor as ``[build-system]``).
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "gpu_exporter", src / "gpu_exporter", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    (built,) = out.glob("gpu_exporter-*.whl")
    return built


def test_wheel_carries_the_license_and_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (license_path,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert zf.read(license_path) == (ROOT / "LICENSE").read_bytes()
        (meta_path,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_path))
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = meta.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.10" in classifiers
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert any(url.startswith("Source, ") for url in meta.get_all("Project-URL") or [])


def test_installed_wheel_serves_bundled_scenarios_by_name(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = (
        "import gpu_exporter.simulate.scenario as s; "
        f"assert s.__file__.startswith({str(site)!r}), s.__file__; "
        "print(len(s.Scenario.from_argument('lab').gpus), len(s.Scenario.from_argument('fleet.toml').gpus))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the checkout: only the unpacked wheel can answer
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert all(int(n) > 0 for n in result.stdout.split())
