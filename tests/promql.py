"""What the dashboards and rules ask Prometheus: their queries, and the metric names in them.

Shared by the offline checks (tests/test_deploy.py) and the real-Prometheus integration test
(tests/test_dashboards_prometheus.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "grafana/dashboards"
RULES = ROOT / "deploy/prometheus/gpu-exporter.rules.yml"
FLEET_SCENARIO = ROOT / "gpu_exporter/simulate/scenarios/fleet.toml"


@dataclass(frozen=True)
class Query:
    where: str  # "gpu-fleet.json: panel 'Free GPUs' A", for messages
    expr: str


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in rules() if "alert" in r}


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def panel_queries() -> Iterator[Query]:
    for name, dash in dashboards().items():
        for panel in dash["panels"]:
            for target in panel.get("targets") or []:
                yield Query(f"{name}: panel {panel['title']!r} {target['refId']}", target["expr"])


def annotation_queries() -> Iterator[Query]:
    for name, dash in dashboards().items():
        for ann in dash.get("annotations", {}).get("list", []):
            if "expr" in ann:
                yield Query(f"{name}: annotation {ann['name']!r}", ann["expr"])


LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def variable_queries() -> Iterator[tuple[str, str, str, str]]:
    """(dashboard, variable name, series selector, label) of every ``label_values`` variable."""
    for name, dash in dashboards().items():
        for var in dash["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = LABEL_VALUES.match(var["query"])
            assert m, f"{name}: variable {var['name']}: not label_values(...): {var['query']}"
            yield name, var["name"], m["selector"], m["label"]


def rule_queries() -> Iterator[Query]:
    for rule in rules():
        yield Query(f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])


def all_queries() -> list[Query]:
    variables = [Query(f"{d}: variable {v}", selector) for d, v, selector, _ in variable_queries()]
    return [*panel_queries(), *annotation_queries(), *variables, *rule_queries()]


_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip
_LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels and strings removed)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range and subquery windows
    s = _LABEL_LISTS.sub(" ", s)  # label lists
    s = re.sub(r"\$\w+", "", s)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)", s):
        word = m.group(1)
        rest = s[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names
