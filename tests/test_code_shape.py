"""No function in ``pytest_sky``, ``kube_emulator``, ``slurm_testbed`` or ``bench`` is longer
than 60 lines; no module of the repository's code (those four, the tests, the smoke suite, the
examples) is over 600 and no class over 400.

A function that does not fit on a screen usually does several things, and each should have
a name (and a docstring saying why).  Length is from the ``def`` line to the end of the
body, ``end_lineno - lineno + 1``, so a docstring and comments count; decorators do not.
Nested functions and methods count on their own and inside their enclosing function.  A
string constant, such as a shell script assigned at module level, is not a function.  The
source is read with ``ast``, never imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The plugin, the emulator and the Slurm testbed its tests run on, and the benchmark that measures them.
ROOTS = [REPO / "pytest_sky", REPO / "kube_emulator", REPO / "slurm_testbed", REPO / "bench"]
LIMIT = 60


@dataclass(frozen=True)
class Function:
    path: str
    line: int
    name: str  # qualified: ``Class.method``, ``outer.inner``
    length: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.name}:{self.length}"


def functions(source: str, path: str) -> list[Function]:
    """Every function and method in ``source``, with its qualified name and length."""
    found: list[Function] = []
    todo: list[tuple[ast.AST, str]] = [(ast.parse(source, filename=path), "")]
    while todo:
        node, prefix = todo.pop()
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}."
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                found.append(Function(path, child.lineno, name[:-1], child.end_lineno - child.lineno + 1))
            todo.append((child, name))
    return sorted(found, key=lambda f: (f.path, f.line))


def too_long(root: Path, limit: int = LIMIT) -> list[Function]:
    """The functions under ``root`` longer than ``limit`` lines, in file and line order."""
    found = []
    for path in sorted(root.rglob("*.py")):
        shown = str(path.relative_to(root.parent))
        found += [f for f in functions(path.read_text(), shown) if f.length > limit]
    return found


@pytest.mark.parametrize("root", ROOTS, ids=lambda root: root.name)
def test_no_function_is_longer_than_the_limit(root: Path) -> None:
    found = too_long(root)
    assert not found, f"functions over {LIMIT} lines (path:line:name:length), split them:\n" + "\n".join(
        f"  {f}" for f in found
    )


# ----------------------------------------------------------------------------- the checker itself


def body(lines: int) -> str:
    """A function body of exactly ``lines`` lines after its ``def`` line."""
    return "".join(f"    x{i} = {i}\n" for i in range(lines))


def test_length_counts_from_def_to_the_end_of_the_body() -> None:
    source = "@decorator\ndef f(\n    a,\n):\n" + body(3)
    assert functions(source, "m.py") == [Function("m.py", 2, "f", 6)]


def test_methods_and_nested_functions_have_qualified_names() -> None:
    source = (
        "class A:\n    def m(self):\n        def inner():\n            pass\n    async def n(self):\n        pass\n"
    )
    assert [(f.name, f.length) for f in functions(source, "m.py")] == [("A.m", 3), ("A.m.inner", 2), ("A.n", 2)]


def test_a_module_level_string_is_not_a_function() -> None:
    script = 'SCRIPT = """\n' + "echo hi\n" * 100 + '"""\n'
    assert functions(script + "def f():\n    pass\n", "m.py") == [Function("m.py", 103, "f", 2)]


@pytest.mark.parametrize(("lines", "flagged"), [(LIMIT - 1, False), (LIMIT, True)])
def test_the_limit_is_inclusive(tmp_path: Path, lines: int, flagged: bool) -> None:
    """``def`` plus ``LIMIT - 1`` body lines is exactly the limit: allowed."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "m.py").write_text("import os\n\n\ndef f():\n" + body(lines))
    expected = [Function("pkg/sub/m.py", 4, "f", LIMIT + 1)] if flagged else []
    assert too_long(root) == expected
    assert [str(f) for f in expected] == (["pkg/sub/m.py:4:f:61"] if flagged else [])


# ------------------------------------------------------------------ modules and classes a newcomer can hold

MODULE_LIMIT = 600
CLASS_LIMIT = 400
#: Everything a newcomer reads, not only what ships: a 750-line benchmark module is as hard to hold.
ROOM_ROOTS = [*ROOTS, REPO / "tests", REPO / "smoke", REPO / "examples"]


def big_rooms(root: Path) -> list[str]:
    """Modules over :data:`MODULE_LIMIT` lines and classes over :data:`CLASS_LIMIT`, under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        shown = str(path.relative_to(root.parent))
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MODULE_LIMIT:
            found.append(f"{shown}: module of {lines} lines")
        for node in ast.walk(ast.parse(source, filename=shown)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > CLASS_LIMIT:
                    found.append(f"{shown}:{node.lineno}: class {node.name} of {length} lines")
    return found


@pytest.mark.parametrize("root", ROOM_ROOTS, ids=lambda root: root.name)
def test_no_module_or_class_is_too_big_to_hold(root: Path) -> None:
    """A module past 600 lines or a class past 400 does several jobs; split it by concern."""
    found = big_rooms(root)
    assert not found, "split these by concern:\n" + "\n".join(f"  {f}" for f in found)


def test_the_room_limits_flag_what_is_past_them(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "small.py").write_text("class A:\n" + body(CLASS_LIMIT - 1))
    (root / "big.py").write_text("class B:\n" + body(CLASS_LIMIT) + "x = 1\n" * (MODULE_LIMIT - CLASS_LIMIT))
    assert big_rooms(root) == ["pkg/big.py: module of 601 lines", "pkg/big.py:1: class B of 401 lines"]
