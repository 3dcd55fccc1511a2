"""Every citation of the design document points at a section it has.

Code and docs justify themselves by section ("DESIGN.md section 5", "DESIGN.md 5", "DESIGN §7",
"DESIGN 2b"); a citation of a section that was never written, or of a design file somewhere
else on one person's machine, sends the reader nowhere.  So every ``.py``, ``.md`` and ``.sh``
file of the repository is read (ignored build and cache directories left out), every cited
section must be a numbered heading of the repository's own ``DESIGN.md`` (``## 5. ...``,
``## 2b. ...``), and no file may name a design file by a path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "DESIGN.md"
SUFFIXES = (".py", ".md", ".sh")
#: Directories that are not the repository's own text: virtual environments, caches, builds.
SKIPPED_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist", "node_modules"}

#: ``DESIGN`` or ``DESIGN.md`` (possibly ``'s``), then an optional ``section``/``sections``/``§``,
#: then the section: a number with an optional letter.  ``DESIGN = "..."`` or ``DESIGN)`` (a
#: name in code) has no section after it and is no citation.
CITATION = re.compile(r"\bDESIGN(?:\.md)?(?:'s)?,?[ \t]*(?:sections?[ \t]+|§[ \t]*)?(?P<section>\d+[a-z]?)\b")
#: A design file named by a path (a directory, ``..`` or a URL, then a slash): the document is
#: the repository root's ``DESIGN.md``, cited by its bare name.
PATHED = re.compile(r"[\w.~$:/-]*/" + r"DESIGN(?:\.md)?\b")
HEADING = re.compile(r"^#{2,6}[ \t]+(?P<section>\d+[a-z]?)\.[ \t]", re.M)


@dataclass(frozen=True)
class Citation:
    path: str
    line: int
    section: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text!r} cites section {self.section}"


def source_files(root: Path) -> Iterator[Path]:
    """The repository's own text files of the cited kinds, in a stable order."""
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(SUFFIXES):
                yield Path(top) / name


def citations(text: str, path: str) -> list[Citation]:
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        found += [Citation(path, number, m["section"], m[0]) for m in CITATION.finditer(line)]
    return found


def pathed(text: str, path: str) -> list[str]:
    return [
        f"{path}:{number}: {m[0]!r}"
        for number, line in enumerate(text.splitlines(), start=1)
        for m in PATHED.finditer(line)
    ]


def sections(doc: str) -> list[str]:
    return [m["section"] for m in HEADING.finditer(doc)]


def scan(root: Path) -> tuple[list[Citation], list[str]]:
    """Every citation under ``root`` and every design file named by a path."""
    cited: list[Citation] = []
    outside: list[str] = []
    for path in sorted(source_files(root)):
        text = path.read_text(encoding="utf-8", errors="replace")
        shown = str(path.relative_to(root))
        cited += citations(text, shown)
        outside += pathed(text, shown)
    return cited, outside


def test_the_design_document_is_at_the_repository_root() -> None:
    assert DOC.is_file(), "DESIGN.md is cited throughout the repository and must be at its root"


def test_every_section_is_numbered_once() -> None:
    numbers = sections(DOC.read_text(encoding="utf-8"))
    assert numbers, "DESIGN.md has no numbered section headings (## 5. ...)"
    assert sorted(n for n in set(numbers) if numbers.count(n) > 1) == []


def test_every_cited_section_exists() -> None:
    present = set(sections(DOC.read_text(encoding="utf-8")))
    cited, _ = scan(ROOT)
    assert cited, "no citation of DESIGN.md found: the scanner is broken"
    missing = [str(c) for c in cited if c.section not in present]
    assert missing == [], f"sections cited but not in DESIGN.md (it has {sorted(present)}):\n" + "\n".join(missing)


def test_no_file_cites_a_design_file_outside_the_repository() -> None:
    _, outside = scan(ROOT)
    assert outside == [], "cite the repository's own DESIGN.md by its bare name:\n" + "\n".join(outside)


# ----------------------------------------------------------------------------- the checker itself

# Built from parts, so that this file's own text holds no citation of a missing section.
NAME = "DESIGN"


@pytest.mark.parametrize(
    ("text", "section"),
    [
        (f"({NAME}.md section 2).", "2"),
        (f"veth is slower ({NAME}.md 5).", "5"),
        (f"<= 0.3 s ({NAME} §7) | pass", "7"),
        (f"{NAME} § 7 says", "7"),
        (f"prefers a library ({NAME} 2b prefers", "2b"),
        (f"{NAME}.md's section 8 says", "8"),
        (f"{NAME}.md sections 4a and 5", "4a"),
    ],
)
def test_every_spelling_in_use_is_read(text: str, section: str) -> None:
    assert [c.section for c in citations(text, "f.py")] == [section]


@pytest.mark.parametrize(
    "text",
    [
        f'{NAME} = "issue"',
        f"targets=[Target(1.5, {NAME})]",
        f"from bench.sections import {NAME}, Namer",
        f"the ratio against {NAME}.md's target",
        f"{NAME}ED by someone",
        "a design of ours, section 5",
    ],
)
def test_names_and_prose_are_not_citations(text: str) -> None:
    assert citations(text, "f.py") == []


def test_a_missing_section_and_a_pathed_file_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f'"""As {NAME}.md section 99 says."""\n')
    (tmp_path / "notes.md").write_text(f"See /work/shared/{NAME}.md and ../{NAME}.md.\n")
    (tmp_path / "run.sh").write_text(f"# {NAME} §7\n")
    (tmp_path / "data.txt").write_text(f"{NAME}.md section 98\n")  # not a cited kind of file
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "x.py").write_text(f"# {NAME}.md section 97\n")  # not the repository's
    cited, outside = scan(tmp_path)
    assert [(c.path, c.line, c.section) for c in cited] == [("pkg/m.py", 1, "99"), ("run.sh", 1, "7")]
    assert outside == [
        f"notes.md:1: '/work/shared/{NAME}.md'",
        f"notes.md:1: '../{NAME}.md'",
    ]


def test_headings_are_read_with_their_letters() -> None:
    doc = "# Title\n\n## 2. Contract\n\n## 2b. Libraries\n\n### 4a. Layers\n\nsection 9 in prose\n"
    assert sections(doc) == ["2", "2b", "4a"]


# ------------------------------------------------------------ the tests the documents name

#: ``tests/test_x.py`` or ``tests/test_x.py::test_y`` in the README, DESIGN.md or a page of
#: the docs, and in a table row's last cell (its
#: proof) a bare ``test_y`` in backticks (the security table names its tests so, under
#: ``tests/test_security.py`` unless named; prose, and a claim's own words, name SkyPilot's
#: tests so too).
NAMED_TEST = re.compile(r"`?(?P<file>tests/test_\w+\.py)(?:::(?P<test>test_\w+))?")
BARE_TEST = re.compile(r"`(?P<test>test_\w+)`")


#: The documents whose tables pair each claim with the test that proves it.
PROOF_PAGES = frozenset({"DESIGN.md", "docs/how-it-works.md", "docs/security.md"})


def named_tests(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(file, test or "") for each test named with its file, and each test named bare."""
    with_file = [(m["file"], m["test"] or "") for m in NAMED_TEST.finditer(text)]
    proof = [line.rstrip(" |").rsplit("|", 1)[-1] for line in text.splitlines() if line.startswith("|")]
    return with_file, [m["test"] for cell in proof for m in BARE_TEST.finditer(cell)]


def test_every_test_the_documents_name_exists() -> None:
    """Each claim names the test that proves it: a claim whose test was renamed or deleted
    would stand on nothing."""
    defined = {
        path.name: set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
        for path in (ROOT / "tests").glob("test_*.py")
    }
    every = set().union(*defined.values())
    missing = []
    pages = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    for page in pages:
        doc = str(page.relative_to(ROOT))
        # An HTML comment is no claim: the docs' example markers name the reader's own files.
        with_file, bare = named_tests(re.sub(r"<!--.*?-->", "", page.read_text(encoding="utf-8"), flags=re.S))
        # The pages of the proof tables (reliability, security) and the design name tests.
        assert with_file or doc not in PROOF_PAGES, f"{doc} names no test: the scanner is broken"
        for file, test in with_file:
            name = Path(file).name
            if name not in defined or (test and test not in defined[name]):
                missing.append(f"{doc}: {file}{'::' + test if test else ''}")
        missing += [f"{doc}: {test}" for test in bare if test not in every]
    assert missing == [], "named in the documents, but no such test:\n" + "\n".join(missing)


def test_a_test_named_with_its_file_or_bare_is_read() -> None:
    text = "| x, as SkyPilot's `test_e` | `tests/test_a.py::test_b`, `test_c`, `tests/test_d.py` |"
    assert named_tests(text) == ([("tests/test_a.py", "test_b"), ("tests/test_d.py", "")], ["test_c"])
