"""The README and the documentation site hold together: a short README, links and anchors that
resolve, reference tables that list what the code has, a benchmark table nobody typed.

``mkdocs build --strict`` (in .ci/run, and here once, about a second) checks the site's own
links once it is built; these tests also check them without building it, so that a failure
names the page's line, and the README too, which the site does not hold: a README link must
work on a repository host that renders ``docs/*.md`` as they are (without the site's
includes), a docs link on the site (with them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 200
MAX_LINE = 120

#: ``--8<-- "FILE"`` or ``--8<-- "FILE:SECTION"`` alone on a line (pymdownx.snippets).
INCLUDE = re.compile(r'^--8<-- "(?P<file>[^":]+)(?::(?P<section>[\w-]+))?"\s*$', re.M)
#: An inline link or image, ``[text](target)``, target without spaces.
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("**/*.md"))]


def included(name: str, section: str | None) -> str:
    """What ``--8<-- "name:section"`` puts in a page: the file, or the lines between its
    ``--8<-- [start:section]`` and ``[end:section]`` markers."""
    text = (ROOT / name).read_text(encoding="utf-8")
    if section is None:
        return text
    start = re.search(rf"^.*--8<-- \[start:{re.escape(section)}\].*$", text, re.M)
    end = re.search(rf"^.*--8<-- \[end:{re.escape(section)}\].*$", text, re.M)
    assert start and end and start.end() < end.start(), f"{name} has no snippet section {section!r}"
    return text[start.end() : end.start()]


def expanded(path: Path) -> str:
    """The page as the site renders it: its includes in place."""
    return INCLUDE.sub(lambda m: included(m["file"], m["section"]), path.read_text(encoding="utf-8"))


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """Each line outside fenced code blocks, numbered from 1."""
    fence = ""
    for number, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if m and (not fence or m[1].startswith(fence)):
            fence = "" if fence else m[1]
            continue
        if not fence:
            yield number, line


def site_slug(title: str) -> str:
    """The anchor Python-Markdown's toc extension (the site's) makes of a heading."""
    from markdown.extensions.toc import slugify

    return slugify(_plain(title), "-")


def host_slug(title: str) -> str:
    """The anchor a repository host (GitHub, GitLab) makes of a heading in a rendered file."""
    return re.sub(r"[^\w\- ]", "", _plain(title).lower()).replace(" ", "-")


def _plain(title: str) -> str:
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").replace("*", "")


def anchors(text: str, slug: object) -> set[str]:
    found: set[str] = set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            found.add(slug(m["title"]))  # type: ignore[operator]
    return found


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: ({self.target})"


def links(path: Path, text: str) -> list[Link]:
    found = []
    for number, line in prose_lines(text):
        prose = re.sub(r"`[^`]*`", "", line)
        found += [Link(path, number, m["target"]) for m in LINK.finditer(prose)]
    return found


def broken(link: Link, *, on_site: bool) -> str | None:
    """Why ``link`` leads nowhere, or None.  External links are not followed."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", link.target):
        return None
    name, _, anchor = link.target.partition("#")
    target = (link.page.parent / name).resolve() if name else link.page
    if not target.exists():
        return f"{link}: no file {name}"
    if on_site and DOCS not in target.parents:
        return f"{link}: the site holds only docs/ (link to a page there, e.g. design.md for DESIGN.md)"
    if not anchor or target.suffix != ".md":
        return None
    text = expanded(target) if on_site else target.read_text(encoding="utf-8")
    slugs = anchors(text, site_slug if on_site else host_slug)
    return None if anchor in slugs else f"{link}: {name or 'this page'} has no heading for #{anchor}"


# ----------------------------------------------------------------------------- the README


def test_the_readme_is_short_and_its_prose_lines_fit() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= MAX_README_LINES
    long = [f"README.md:{n}: {len(line)} characters" for n, line in prose_lines(text) if len(line) > MAX_LINE]
    assert long == []


def test_the_readme_keeps_ci_s_two_commands() -> None:
    """.ci/run runs them as the README words them; the README's own wording must not drift."""
    text = README.read_text(encoding="utf-8")
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest smoke -k multinode\n" in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -n 4 --dist worksteal\n" in text


# ----------------------------------------------------------------------------- links and anchors


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_internal_link_and_anchor_resolves(page: Path) -> None:
    on_site = page != README
    text = expanded(page) if on_site else page.read_text(encoding="utf-8")
    found = links(page, text)
    assert found or page.name in {"design.md"}, f"{page.name} links nowhere: is the link reader broken?"
    assert [why for link in found if (why := broken(link, on_site=on_site))] == []


def test_every_page_is_in_the_site_s_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*([\w/-]+\.md)\s*$", nav, re.M))
    assert listed == {str(p.relative_to(DOCS)) for p in DOCS.glob("**/*.md")}


def test_every_include_names_a_file_and_section_that_exist() -> None:
    for page in DOCS.glob("**/*.md"):
        for m in INCLUDE.finditer(page.read_text(encoding="utf-8")):
            assert included(m["file"], m["section"]).strip(), f"{page.name}: {m[0]} includes nothing"


def test_the_link_reader_finds_what_is_broken(tmp_path: Path) -> None:
    page = DOCS / "faults.md"
    good = Link(page, 1, "writing-tests.md#examples")
    assert broken(good, on_site=True) is None
    assert "no heading for #nowhere" in str(broken(Link(page, 1, "cli.md#nowhere"), on_site=True))
    assert "no file" in str(broken(Link(page, 1, "missing.md"), on_site=True))
    assert "site holds only docs/" in str(broken(Link(page, 1, "../pyproject.toml"), on_site=True))
    # A heading only the site's include provides is no anchor on a repository host.
    assert broken(Link(README, 1, "docs/getting-started.md#install-in-your-own-project"), on_site=False)
    assert broken(Link(page, 1, "getting-started.md#install-in-your-own-project"), on_site=True) is None
    assert site_slug("Privileges: a node is a pod, not root") == host_slug("Privileges: a node is a pod, not root")


# ----------------------------------------------------------------------------- the site's build


def build_site(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``root``'s mkdocs.yml, as .ci/run runs it (offline: the build
    fetches nothing)."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ci_builds_the_site_strictly_and_it_builds(tmp_path: Path) -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^[^#\n]*mkdocs build --strict", ci, re.M), ".ci/run no longer builds the site"
    built = build_site(ROOT, tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()  # default directory URLs
    design = (tmp_path / "site" / "design" / "index.html").read_text(encoding="utf-8")
    assert "Performance targets" in design  # DESIGN.md, included


def test_the_strict_build_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    for name in ("mkdocs.yml", "README.md", "DESIGN.md"):
        shutil.copy2(ROOT / name, tmp_path / name)
    shutil.copytree(DOCS, tmp_path / "docs")
    faults = tmp_path / "docs" / "faults.md"
    faults.write_text(faults.read_text(encoding="utf-8") + "\nSee [nowhere](cli.md#no-such-heading).\n")
    built = build_site(tmp_path, tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-heading" in built.stderr


# ----------------------------------------------------------------------------- reference tables


def _table_rows(page: Path, heading: str) -> list[list[str]]:
    """The cells of the first table under ``heading`` (a ``## `` line) of ``page``."""
    text = page.read_text(encoding="utf-8")
    section = text.split(f"\n{heading}\n", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def test_the_options_table_lists_every_option_with_its_environment_twin() -> None:
    from pytest_sky.settings import OPTIONS

    rows = _table_rows(DOCS / "cli.md", "## Options")
    by_flag = {re.match(r"`(--[\w-]+)", r[0])[1]: r for r in rows if r[0]}  # type: ignore[index]
    missing = [o.flag for o in OPTIONS if o.flag not in by_flag]
    assert missing == [], "options without a row in docs/cli.md's table"
    assert [o.flag for o in OPTIONS if o.env not in by_flag[o.flag][1]] == [], "rows naming the wrong twin"
    assert set(by_flag) == {o.flag for o in OPTIONS}, "rows for options the code does not have"


def test_the_markers_and_fixtures_table_lists_every_one_the_plugin_has() -> None:
    from _pytest.fixtures import FixtureFunctionDefinition

    from pytest_sky import plugin

    rows = _table_rows(DOCS / "writing-tests.md", "## Markers and fixtures")
    firsts = " ".join(r[0] for r in rows)
    fixtures = [n for n, o in vars(plugin).items() if isinstance(o, FixtureFunctionDefinition)]
    assert fixtures, "no fixture found in the plugin: is the reader broken?"
    assert [f for f in fixtures if f"`{f}" not in firsts] == []
    assert [m for m in plugin.MARKERS if f"pytest.mark.{m}" not in firsts] == []


def test_every_command_is_on_the_command_line_page() -> None:
    from pytest_sky.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "subcommand"]
    text = expanded(DOCS / "cli.md") + expanded(DOCS / "faults.md") + expanded(DOCS / "troubleshooting.md")
    assert sorted(c for c in sub.choices if f"pytest-sky {c}" not in text and f"`sky {c}" not in text) == []


# ----------------------------------------------------------------------------- the benchmark's table


def test_the_performance_table_is_what_the_published_results_render() -> None:
    """Never typed: the page's block is exactly what ``python -m bench --republish`` writes."""
    from bench import cli, report

    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert report.published_block(page) == cli.published_block(report.load(cli.PUBLISHED))
    if report.load(cli.PUBLISHED).plotted:
        assert cli.DOCS_PLOT.is_file()
