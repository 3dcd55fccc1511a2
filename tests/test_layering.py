"""The package's import graph against the layer order written in its docstring.

A newcomer reads ``pytest_sky/__init__.py`` to learn which module may use which; this test
keeps that true: no module imports one of a higher layer (lazily inside a function or under
``TYPE_CHECKING`` included, since both still tie the two together), no import circle, and
no module missing from the list.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest_sky

ROOT = Path(pytest_sky.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def short(name: str) -> str:
    return name.removeprefix("pytest_sky.") if name != "pytest_sky" else name


def layers() -> dict[str, int]:
    """``{module: layer}`` from the numbered list in the package docstring."""
    doc = pytest_sky.__doc__ or ""
    assert "Layers, lowest first" in doc, "the package docstring lost its layer list"
    out = {}
    for number, names in re.findall(r"^(\d+)\. (.+(?:\n {3}.+)*)$", doc, re.M):  # an item may go on, indented
        for name in " ".join(names.split()).split(":")[0].split(","):
            out[name.strip()] = int(number)
    return out


def imports(name: str) -> set[str]:
    """Every module of ours that ``name`` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pytest_sky")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pytest_sky"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {short(m) for m in found} - {short(name)}


GRAPH = {short(m): imports(m) for m in MODULES}


def test_every_module_has_a_layer() -> None:
    assert sorted(set(GRAPH) - set(layers())) == []
    assert sorted(set(layers()) - set(GRAPH)) == [], "the docstring names modules that do not exist"


def test_no_module_imports_from_a_higher_layer() -> None:
    layer = layers()
    upward = [
        f"{m} (layer {layer[m]}) imports {d} (layer {layer[d]})"
        for m, deps in sorted(GRAPH.items())
        for d in sorted(deps)
        if layer[d] > layer[m]
    ]
    assert upward == []


def test_no_import_circle() -> None:
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                circles.append(" -> ".join([*path[path.index(d) :], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_the_checker_sees_an_upward_import() -> None:
    """The graph is read from the source: the package's own doors import the cluster."""
    assert "cluster" in GRAPH["pytest_sky"] and "lifecycle" in GRAPH["cluster"]
    assert "protocol" in GRAPH["agent"] and GRAPH["protocol"] == set()
