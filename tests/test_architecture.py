"""The shape the design depends on, checked rather than hoped for."""

from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpu_exporter"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.add(node.module.split(".")[0])
    return names


def test_only_the_nvml_module_imports_pynvml() -> None:
    importers = sorted(p.name for p in PACKAGE.rglob("*.py") if "pynvml" in imports_of(p))
    assert importers == ["nvml.py"]


def test_ranking_is_pure() -> None:
    imported = imports_of(PACKAGE / "choose" / "rank.py")
    assert not imported & {
        "flask",
        "werkzeug",
        "pynvml",
        "gpu_exporter.nvml",
        "gpu_exporter.collect.sampler",
        "gpu_exporter.collect.read",
    }


def test_requests_cannot_reach_nvml() -> None:
    for module in (
        "web/app.py",
        "export/spec.py",
        "export/collectors.py",
        "export/exposition.py",
    ):
        assert "gpu_exporter.nvml" not in imports_of(PACKAGE / module), module


@pytest.mark.parametrize(
    "module",
    [
        "units",
        "choose.rank",
        "nvml",
        "config",
        "choose.params",
        "choose.fleet",
        "choose.promql",
        "choose.values",
        "client.transport",
        "client.api",
        "collect.procinfo",
        "model",
    ],
)
def test_doctests(module: str) -> None:
    result = doctest.testmod(importlib.import_module(f"gpu_exporter.{module}"))
    assert result.attempted > 0
    assert result.failed == 0
