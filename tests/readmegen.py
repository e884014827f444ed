"""``scripts/generate_readme.py`` for the tests that keep the README equal to what it
generates, loaded once per test session (its measurement is cached)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from gpu_exporter.export.readme import Costs

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "generate_readme.py"


def generator() -> ModuleType:
    if "generate_readme" not in sys.modules:
        spec = importlib.util.spec_from_file_location("generate_readme", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["generate_readme"] = module
        spec.loader.exec_module(module)
    return sys.modules["generate_readme"]


def costs() -> Costs:
    """What /metrics costs, measured on simulated exporters (cached)."""
    measured: Costs = generator().measure()
    return measured


def readme_region(text: str, name: str) -> str:
    start, end = generator().region(text, name)
    return str(text[start:end])
