"""The shape the design depends on, checked rather than hoped for (docs/design.md).

Imports are read from the source (function-level imports included, ``if TYPE_CHECKING:``
blocks excluded), so a cycle or a wrong-way dependency fails here before it fails at run time.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpu_exporter"
ROOT_NAME = "gpu_exporter"
MAX_LINES = 800  # a smoke alarm, not a design rule: modules are cut where their concept ends
SUMMARY_MAX_CHARS = 240
CREATE_APP_MAX_LINES = 80


@dataclass(frozen=True)
class Import:
    target: str  # a module of the project, or the top-level name of a third-party one
    lazy: bool  # inside a function: runs on first use, not at import time
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, name: str | None) -> str:
    """``from module import name``: the submodule when ``name`` is one, else the module."""
    if name is not None and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module


def _walk(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for orelse in child.orelse:
                yield from _walk(orelse, lazy)
            continue
        inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield child, inner
        yield from _walk(child, inner)


def imports_of(name: str) -> list[Import]:
    """Every import in module ``name``: project modules by full name, others by top level."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> list[Import]:
    found: list[Import] = []
    for node, lazy in _walk(ast.parse(source), False):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name if alias.name in MODULES else alias.name.split(".")[0]
                found.append(Import(target, lazy, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base == ROOT_NAME or base.startswith(ROOT_NAME + "."):
                for alias in node.names:
                    found.append(Import(_resolve(base, alias.name), lazy, node.lineno))
            else:
                found.append(Import(base.split(".")[0], lazy, node.lineno))
    return found


def project_imports(name: str) -> list[Import]:
    return [i for i in imports_of(name) if i.target in MODULES]


def room(name: str) -> str:
    """``gpu_exporter.collect.sampler`` → ``collect``; top-level modules are their own room."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def in_rooms(name: str, *rooms: str) -> bool:
    return room(name) in rooms


def cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted({i.target for i in project_imports(m)} - {m}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def wrong_way(rooms: tuple[str, ...], banned: set[str]) -> list[str]:
    """Imports from modules in ``rooms`` of project rooms or third-party names in ``banned``."""
    bad = []
    for name in MODULES:
        if not in_rooms(name, *rooms):
            continue
        for imp in imports_of(name):
            target_room = room(imp.target) if imp.target in MODULES else None
            if target_room in banned or imp.target in banned:
                bad.append(f"{name}:{imp.line} imports {imp.target}")
    return bad


def test_the_import_reader_sees_function_level_imports_and_skips_type_checking() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import model\n"
        "from gpu_exporter.choose import rank\n"
        "if TYPE_CHECKING:\n"
        "    from gpu_exporter.web.app import Services\n"
        "def f():\n"
        "    import flask\n"
        "    from ..nvml import Nvml\n"
    )
    found = {(i.target, i.lazy) for i in imports_in(source, "gpu_exporter.collect")}
    assert found == {
        ("typing", False),
        ("gpu_exporter.collect", False),  # `from . import model`: no gpu_exporter.collect.model
        ("gpu_exporter.choose.rank", False),
        ("flask", True),
        ("gpu_exporter.nvml", True),
    }


def test_no_import_cycle() -> None:
    assert cycles() == []


def test_only_the_nvml_module_imports_pynvml() -> None:
    importers = sorted(m for m in MODULES if any(i.target == "pynvml" for i in imports_of(m)))
    assert importers == ["gpu_exporter.nvml"]


def test_collect_reads_nvml_and_knows_nothing_downstream() -> None:
    assert wrong_way(("collect",), {"export", "choose", "web", "client"}) == []


def test_choose_is_plain_python() -> None:
    banned = {"flask", "werkzeug", "prometheus_client", "pynvml", "collect", "web", "export"}
    banned |= {"client", "gpu_exporter.nvml"}
    assert wrong_way(("choose",), banned) == []


def test_the_fleet_is_plain_python_beside_the_client_and_the_web() -> None:
    """gpu_exporter/fleet/ (reading, ranking and claiming across hosts) uses choose/ and the
    model; the client and /cluster/choose use it, never the other way round. The claim's
    HTTP is given by its caller (daemon.py wires the client's), so neither the fleet nor
    /cluster/choose imports the client."""
    banned = {"flask", "werkzeug", "prometheus_client", "pynvml", "collect", "web", "export"}
    banned |= {"client", "simulate", "gpu_exporter.nvml", "gpu_exporter.daemon"}
    assert wrong_way(("fleet",), banned) == []
    assert [i for i in wrong_way(("web",), {"client"}) if "web.cluster" in i] == []


def test_no_two_modules_of_the_fleet_share_a_file_name() -> None:
    names = [p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    fleet = {p.name for p in (PACKAGE / "fleet").glob("*.py")} - {"__init__.py"}
    assert all(names.count(name) == 1 for name in fleet)


def test_export_never_reaches_the_web_or_the_lease_logic_at_run_time() -> None:
    assert wrong_way(("export",), {"web", "client", "choose", "flask", "werkzeug"}) == []


def test_the_status_view_is_pure() -> None:
    """web/status.py turns a snapshot into rows for the page: no Flask, no driver."""
    imported = {i.target for i in imports_of("gpu_exporter.web.status")}
    assert not imported & {"flask", "pynvml", "gpu_exporter.nvml"}


def test_requests_cannot_reach_nvml() -> None:
    # The web room and the exposition read snapshots only; the driver is the sampler's.
    bad = [
        f"{name} imports {imp.target}"
        for name in MODULES
        if in_rooms(name, "web", "export")
        for imp in imports_of(name)
        if imp.target in {"gpu_exporter.nvml", "pynvml"} or room(imp.target) == "simulate"
    ]
    assert bad == []


def test_the_client_stays_on_the_side() -> None:
    """The client never needs the server's rooms; the local-NVML fallback is the one lazy
    exception (client/local.py reads the GPUs itself when no exporter answers)."""
    bad = []
    for name in MODULES:
        if not in_rooms(name, "client"):
            continue
        for imp in imports_of(name):
            if imp.target not in MODULES and imp.target not in {
                "flask",
                "werkzeug",
                "prometheus_client",
                "pynvml",
            }:
                continue
            allowed = name == "gpu_exporter.client.local" and imp.lazy
            wrong = room(imp.target) in {"web", "export", "collect", "simulate"} or (
                imp.target in {"gpu_exporter.nvml", "gpu_exporter.daemon"}
            )
            third_party = imp.target in {"flask", "werkzeug", "prometheus_client", "pynvml"}
            if (wrong or third_party) and not allowed:
                bad.append(f"{name}:{imp.line} imports {imp.target}")
    assert bad == []


def test_one_composition_root() -> None:
    """Only daemon.py builds the web app and the sampler together."""
    builders = sorted(
        name
        for name in MODULES
        if any(i.target == "gpu_exporter.web.app" for i in project_imports(name))
        and any(i.target == "gpu_exporter.collect.sampler" for i in project_imports(name))
    )
    assert builders == ["gpu_exporter.daemon"]


def test_no_module_is_alarmingly_long() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text())


def summary(name: str) -> str:
    """The first paragraph of a module's docstring, on one line."""
    return " ".join((ast.get_docstring(_tree(name)) or "").split("\n\n")[0].split())


def test_every_module_names_its_one_concept_in_one_sentence() -> None:
    """The docstring's first paragraph says what the module is, as one short sentence; what
    else it holds belongs to that concept (or to another module)."""
    bad = {}
    for name in MODULES:
        text = summary(name)
        one_sentence = text.endswith(".") and not re.search(r"[.!?] [A-Z`:]", text[:-1])
        if not (one_sentence and len(text) <= SUMMARY_MAX_CHARS):
            bad[name] = text
    assert bad == {}


def test_no_two_modules_share_a_file_name() -> None:
    stems: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        if path.stem != "__init__":
            stems.setdefault(path.stem, []).append(name)
    assert {s: m for s, m in stems.items() if len(m) > 1} == {}


def test_no_class_name_is_defined_twice() -> None:
    """A class name says which concept it is wherever it is imported."""
    defined: dict[str, list[str]] = {}
    for name in MODULES:
        for node in _tree(name).body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(name)
    assert {c: m for c, m in defined.items() if len(m) > 1} == {}


def test_create_app_is_short() -> None:
    (fn,) = [
        node
        for node in ast.walk(_tree("gpu_exporter.web.app"))
        if isinstance(node, ast.FunctionDef) and node.name == "create_app"
    ]
    assert fn.end_lineno is not None
    assert fn.end_lineno - fn.lineno + 1 <= CREATE_APP_MAX_LINES


@pytest.mark.parametrize(
    "module",
    [
        "units",
        "choose.rank",
        "nvml",
        "config",
        "choose.params",
        "choose.request",
        "choose.filters",
        "choose.defaults",
        "choose.selectors",
        "fleet.inventory",
        "fleet.queries",
        "fleet.packing",
        "fleet.ranking",
        "choose.values",
        "client.transport",
        "outbound",
        "client.hostapi",
        "client.query",
        "collect.procinfo",
        "collect.podresources",
        "podallocations",
        "model",
        "counters",
    ],
)
def test_doctests(module: str) -> None:
    result = doctest.testmod(importlib.import_module(f"gpu_exporter.{module}"))
    assert result.attempted > 0
    assert result.failed == 0
