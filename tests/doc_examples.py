"""The documentation's code blocks as tests: README.md and every page under docs/ (loaded by the
root conftest.py, so a plain ``pytest`` from the repository root collects them).

A page that shows code a reader will paste is a page that rots unless something runs it.  So
every fenced ``python`` and shell (``bash``, ``sh``, ``shell``) block is a test:

- a Python block that defines tests (``def test_...``, ``class Test...``) is a test module of
  its own, collected in this session: its tests get the plugin's fixtures and markers as a
  user's would, and a failure points at the page's own line;
- any other Python block runs top to bottom as one test's code, in a fresh directory;
- a shell block runs in bash (``-e -o pipefail``) in a fresh directory, as one test.

A block says how it runs, or why it cannot run here, on an HTML comment just above its fence
(invisible on GitHub and on the site), ``<!-- example: WORD ... -->``:

- ``long=SECONDS``: the example takes about that long (the root conftest deals long tests first).
- ``skip=REASON``: not run, for one of :class:`NotRun`'s reasons; the terminal summary counts them.
- ``file=NAME``: the block is a file (a test, a task YAML) written into the fresh directory of
  every later shell block of the page, not a test of its own.
- ``continues``: a shell block that goes on where the page's previous shell block left off,
  in the same directories, as one test (install, then run what was installed).
- ``in=clone``: the shell block runs in the reader's clone of this repository instead: every
  shell block's fresh directory has a fresh copy of it beside it, as ``../pytest-sky``.
- ``ci=github`` / ``ci=gitlab``: a YAML block that is a CI configuration; its steps' commands
  run, in order, in a fresh directory holding the page's files (what a checkout gives), without
  the CI system.  ``wheels=DIR`` puts pytest-sky's wheel, built from this repository, in DIR
  there; ``skip-steps=REASON`` leaves out the steps that are an apt-get install.

A shell block gets a state directory (``PYTEST_SKY_HOME``) and ``HOME`` of its own, the
interpreter that runs this suite first on ``PATH`` (as an activated virtualenv would), and must
leave no cluster up: one it leaves is torn down and fails the test.
"""

from __future__ import annotations

import ast
import enum
import re
import shlex
import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import yaml

from tests import doc_shell

PYTHON = frozenset({"python", "py"})
SHELL = frozenset({"bash", "sh", "shell"})
#: ``user_properties`` keys (they cross from xdist workers) of a block, and of a CI step, not run.
NOT_RUN_KEY = "doc_example_not_run"
NOT_RUN_STEP_KEY = "doc_example_step_not_run"


class NotRun(enum.Enum):
    """Why a block cannot run inside this suite (the marker's word, and what the skip says)."""

    GPU = "gpu", "needs a GPU"
    CLOUD = "cloud", "needs a real Kubernetes cluster, a registry or a cloud account"
    APT = "apt", "installs Debian packages with apt (scripts/setup.sh did, once, on this machine)"
    SUITE = "suite", "runs this test suite itself, or a stage of .ci/run"
    TORCH_INDEX = "torch-index", "installs from PyTorch's CPU index, which these machines cannot reach"

    def __init__(self, word: str, reason: str) -> None:
        self.word = word
        self.reason = reason

    @classmethod
    def named(cls, word: str, where: str) -> NotRun:
        for member in cls:
            if member.word == word:
                return member
        raise DocExampleError(f"{where}: no reason {word!r}; use one of {', '.join(m.word for m in cls)}")


class CiSystem(enum.Enum):
    GITHUB = "github"
    GITLAB = "gitlab"


class DocExampleError(Exception):
    """A page whose blocks or markers cannot be read: a collection error naming file and line."""


@dataclass(frozen=True)
class Marks:
    skip: NotRun | None = None
    file: str | None = None
    continues: bool = False
    in_clone: bool = False
    ci: CiSystem | None = None
    wheels: str | None = None
    skip_steps: NotRun | None = None
    long: float | None = None


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the fence's line, 1-based
    lang: str
    code: str
    marks: Marks = field(default_factory=Marks)

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def name(self) -> str:
        return f"{self.lang}-{self.line}"


# ----------------------------------------------------------------------------- reading pages

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*example:(?P<words>.*?)-->\s*$")


def read_marks(words: str, where: str) -> Marks:
    """``skip=gpu file=x.py continues ...`` into :class:`Marks`; an unknown word is an error."""
    marks = Marks()
    for word in shlex.split(words):
        key, _, value = word.partition("=")
        if key == "skip":
            marks = replace(marks, skip=NotRun.named(value, where))
        elif key == "skip-steps":
            marks = replace(marks, skip_steps=NotRun.named(value, where))
        elif key == "file" and value:
            marks = replace(marks, file=value)
        elif key == "wheels" and value:
            marks = replace(marks, wheels=value)
        elif key == "long" and value.replace(".", "", 1).isdigit():
            marks = replace(marks, long=float(value))
        elif key == "ci" and value in {c.value for c in CiSystem}:
            marks = replace(marks, ci=CiSystem(value))
        elif word == "continues":
            marks = replace(marks, continues=True)
        elif word == "in=clone":
            marks = replace(marks, in_clone=True)
        else:
            raise DocExampleError(
                f"{where}: example marker word {word!r} is unknown; see tests/doc_examples.py for the words"
            )
    return marks


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a page, with the marker above it (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence[0] * len(fence)):
            end += 1
        if end == len(lines):
            raise DocExampleError(f"{path.name}:{i + 1}: a code fence that is never closed")
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
        found.append(Block(path, i + 1, lang, "\n".join(body) + "\n", _marks_above(lines, i, f"{path.name}:{i + 1}")))
        i = end + 1
    return found


def _marks_above(lines: list[str], fence: int, where: str) -> Marks:
    above = fence - 1
    while above >= 0 and not lines[above].strip():
        above -= 1
    m = MARKER.match(lines[above]) if above >= 0 else None
    return read_marks(m["words"], where) if m else Marks()


def defines_tests(code: str, where: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise DocExampleError(f"{where}: the Python block does not parse: {exc.msg} (its line {exc.lineno})") from exc
    return any(
        (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"))
        or (isinstance(node, ast.ClassDef) and node.name.startswith("Test"))
        for node in tree.body
    )


def is_doc_page(path: Path, root: Path) -> bool:
    if path.suffix != ".md":
        return False
    return path == root / "README.md" or (root / "docs") in path.parents


# ----------------------------------------------------------------------------- the plugin's hooks


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if is_doc_page(file_path, parent.config.rootpath):
        return DocPage.from_parent(parent, path=file_path)
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line: how many of the docs' examples ran, and how many could not here, and why."""
    ran = 0
    blocks: Counter[str] = Counter()
    steps: Counter[str] = Counter()
    seen: set[str] = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport) or report.nodeid in seen or not _is_example(report):
                continue
            skipped_blocks = [value for key, value in report.user_properties if key == NOT_RUN_KEY]
            if report.when != "call" and not (report.skipped and skipped_blocks):
                continue
            seen.add(report.nodeid)
            blocks.update(skipped_blocks)
            steps.update(value for key, value in report.user_properties if key == NOT_RUN_STEP_KEY)
            ran += not report.skipped
    if ran or blocks or steps:
        told = "; ".join(
            f"{reason}: "
            + ", ".join(
                f"{n} {kind}{'s' if n > 1 else ''}"
                for n, kind in ((blocks[reason], "block"), (steps[reason], "CI step"))
                if n
            )
            for reason in sorted(blocks.keys() | steps.keys(), key=lambda r: (-(blocks[r] + steps[r]), r))
        )
        total = sum(blocks.values()) + sum(steps.values())
        terminalreporter.write_line(
            f"documentation examples: {ran} ran, {total} not run here" + (f" ({told})" if told else "")
        )


def _is_example(report: pytest.TestReport) -> bool:
    path = report.nodeid.split("::", 1)[0]
    return path == "README.md" or (path.startswith("docs/") and path.endswith(".md"))


class DocPage(pytest.File):
    """A markdown page: each of its runnable blocks (or chains of them) is a child."""

    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        try:
            page = blocks(self.path)
            yield from self._children(page)
        except DocExampleError as exc:
            raise self.CollectError(str(exc)) from None

    def _children(self, page: list[Block]) -> Iterator[pytest.Item | pytest.Collector]:
        shell: ShellExample | None = None
        for block in page:
            runs_shell = block.lang in SHELL or block.marks.ci is not None
            if block.marks.skip is not None:
                if runs_shell or block.lang in PYTHON:
                    yield NotRunExample.from_parent(self, name=block.name, block=block)
            elif block.marks.file is not None:
                continue
            elif block.marks.ci is not None:
                yield CiExample.from_parent(self, name=block.name, block=block, page=page)
            elif block.lang in SHELL and block.marks.continues:
                if shell is None:
                    raise DocExampleError(f"{block.where}: 'continues', but no shell block above it to continue")
                shell.chain.append(block)
            elif block.lang in SHELL:
                shell = ShellExample.from_parent(self, name=block.name, block=block, page=page)
                yield shell
            elif block.lang in PYTHON and defines_tests(block.code, block.where):
                yield ExampleModule.from_parent(
                    self, path=self.path, name=block.name, nodeid=f"{self.nodeid}::{block.name}", block=block
                )
            elif block.lang in PYTHON:
                yield PythonExample.from_parent(self, name=block.name, block=block)


def compiled(block: Block, config: pytest.Config) -> types.CodeType:
    """The block's code, its asserts rewritten as pytest rewrites a test module's, compiled so
    that a traceback's line numbers are the page's own (the block's lines, shifted)."""
    from _pytest.assertion.rewrite import rewrite_asserts

    source = "\n" * block.line + block.code
    tree = ast.parse(source, filename=str(block.path))
    rewrite_asserts(tree, source.encode(), str(block.path), config)
    return compile(tree, str(block.path), "exec", dont_inherit=True)


class ExampleModule(pytest.Module):
    """A block that defines tests: a module built from the block, not imported from a file."""

    def __init__(self, *, block: Block, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.block = block

    def _getobj(self) -> types.ModuleType:
        module = types.ModuleType(f"doc_example_{self.block.path.stem}_{self.block.line}".replace("-", "_"))
        module.__file__ = str(self.block.path)
        exec(compiled(self.block, self.config), module.__dict__)
        return module


class NotRunExample(pytest.Item):
    def __init__(self, *, block: Block, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.block = block
        assert block.marks.skip is not None
        self.user_properties.append((NOT_RUN_KEY, block.marks.skip.reason))
        self.add_marker(pytest.mark.skip(reason=f"line {block.line}: {block.marks.skip.reason}"))

    def runtest(self) -> None:
        raise AssertionError("never called: the item is marked skip")

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, self.block.line, self.name


class PythonExample(pytest.Item):
    """A block of plain Python: run top to bottom as this test's code, in a fresh directory."""

    def __init__(self, *, block: Block, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.block = block

    def runtest(self) -> None:
        code = compiled(self.block, self.config)
        where = self.config._tmp_path_factory.mktemp("doc-example")  # type: ignore[attr-defined]
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(where)
            exec(code, {"__name__": "__doc_example__", "__file__": str(self.block.path)})

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: str | None = None) -> str:  # type: ignore[override]
        return str(super().repr_failure(excinfo, style="short"))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, self.block.line, self.name


class ShellExample(pytest.Item):
    """A shell block, and the blocks that continue it, run in turn as a reader pastes them."""

    def __init__(self, *, block: Block, page: list[Block], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.block = block
        self.page = page
        self.chain = [block]
        if block.marks.long is not None:
            self.add_marker(pytest.mark.long(block.marks.long))

    def actions(self) -> list[doc_shell.Action]:
        """The chain's steps, with the page's files written where they stand between them."""
        last = self.chain[-1].line
        files = [b for b in self.page if b.marks.file is not None and b.marks.skip is None and b.line < last]
        ordered = sorted([*files, *self.chain], key=lambda b: b.line)
        return [
            doc_shell.WriteFile(b.marks.file, b.code)
            if b.marks.file is not None
            else doc_shell.Step(self._where(b), b.code, in_clone=b.marks.in_clone)
            for b in ordered
        ]

    def _where(self, block: Block) -> str:
        return f"{block.path.relative_to(self.config.rootpath)}:{block.line}"

    def runtest(self) -> None:
        box = doc_shell.Sandbox(self.config._tmp_path_factory.mktemp("doc-example"))  # type: ignore[attr-defined]
        self.add_report_section("call", "output", doc_shell.run(self.actions(), box))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: str | None = None) -> str:  # type: ignore[override]
        if isinstance(excinfo.value, doc_shell.ExampleFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, self.block.line, self.name


class CiExample(ShellExample):
    """A CI configuration: its steps' commands in order, in a fresh directory holding what a
    checkout of the reader's project gives (the page's files; pytest-sky's wheel if asked)."""

    def actions(self) -> list[doc_shell.Action]:
        files: list[doc_shell.Action] = [
            doc_shell.WriteFile(b.marks.file, b.code) for b in self.page if b.marks.file and b.line < self.block.line
        ]
        if self.block.marks.wheels is not None:
            wheel = _wheel(self.config)
            files.append(doc_shell.CopyFile(f"{self.block.marks.wheels}/{wheel.name}", wheel))
        return [*files, *self._steps()]

    def _steps(self) -> list[doc_shell.Action]:
        doc = yaml.safe_load(self.block.code)
        read = doc_shell.github_commands if self.block.marks.ci is CiSystem.GITHUB else doc_shell.gitlab_commands
        commands = read(doc)
        skip = self.block.marks.skip_steps
        if skip is not None:
            left_out = [c for c in commands if doc_shell.is_apt_install(c.script)]
            if not left_out:
                raise DocExampleError(f"{self.block.where}: skip-steps={skip.word}, but no step is an apt-get install")
            self.user_properties += [(NOT_RUN_STEP_KEY, skip.reason) for _ in left_out]
            commands = [c for c in commands if c not in left_out]
        shells: dict[str, list[doc_shell.CiCommand]] = {}
        for command in commands:
            shells.setdefault(command.shell, []).append(command)
        where = self._where(self.block)
        return [
            doc_shell.Step(f"{where}, {cs[0].shell}", "\n".join(c.script for c in cs) + "\n", env=cs[0].env)
            for cs in shells.values()
        ]


def _wheel(config: pytest.Config) -> Path:
    """pytest-sky's wheel, built once per process from a fresh copy of this repository."""
    key = "_doc_examples_wheel"
    wheel = getattr(config, key, None)
    if wheel is None:
        base = config._tmp_path_factory.mktemp("doc-wheel")  # type: ignore[attr-defined]
        wheel = doc_shell.build_wheel(base / "dist", base)
        setattr(config, key, wheel)
    return wheel
