"""The docs' code blocks are tests (tests/doc_examples.py): collected from the root, run as a
reader runs them, and a broken one fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import doc_examples, doc_shell

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = 'pytest_plugins = ["tests.doc_examples"]\n'


def runnable(page: Path) -> list[doc_examples.Block]:
    """The blocks of a page that are tests or reasons not to run (not files, not continuations)."""
    return [
        b
        for b in doc_examples.blocks(page)
        if (b.lang in doc_examples.PYTHON | doc_examples.SHELL or b.marks.ci)
        and b.marks.file is None
        and not b.marks.continues
    ]


def test_a_plain_pytest_from_the_root_collects_every_block_of_the_readme_and_the_docs() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    for page in pages:
        name = str(page.relative_to(ROOT))
        collected = {line.split("::")[1] for line in listed if line.startswith(f"{name}::")}
        assert collected == {b.name for b in runnable(page)}, name
    assert sum(len(runnable(p)) for p in pages) >= 20  # the reader finds blocks at all


def _readme_with(pytester: pytest.Pytester, old: str, new: str) -> None:
    text = (ROOT / "README.md").read_text()
    assert old in text
    pytester.makefile(".md", README=text.replace(old, new))
    pytester.makeconftest(PLUGIN)


def test_renaming_a_fixture_the_readme_uses_fails_the_suite(pytester: pytest.Pytester) -> None:
    _readme_with(pytester, "def test_node_ips(sky_cluster):", "def test_node_ips(sky_clusterx):")
    result = pytester.runpytest("README.md", "-k", "test_node_ips")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'sky_clusterx' not found*", "*README.md:*"])


def test_a_failing_assert_points_at_the_page_s_own_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PLUGIN)
    pytester.mkdir("docs")
    (pytester.path / "docs" / "page.md").write_text(
        "# A page\n\n```python\ndef test_arithmetic():\n    x = 2\n    assert x + 2 == 5\n```\n"
    )
    result = pytester.runpytest("docs")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*docs/page.md:6: AssertionError*", "*assert (2 + 2) == 5*"])


def _page(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makeconftest(PLUGIN)
    pytester.mkdir("docs")
    (pytester.path / "docs" / "page.md").write_text(body)
    return pytester.runpytest("docs", "-rs")


def test_a_failing_command_fails_naming_its_block_and_showing_its_output(pytester: pytest.Pytester) -> None:
    result = _page(pytester, "# A page\n\n```bash\necho about to fail\nfalse\necho never\n```\n")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*docs/page.md:3 exited 1:", "about to fail"])
    result.stdout.no_fnmatch_line("never")


def test_blocks_run_in_fresh_directories_and_continue_where_the_last_left_off(pytester: pytest.Pytester) -> None:
    body = """# A page

<!-- example: file=notes/hello.txt -->
```text
hello
```

```bash
test -z "$(ls -A | grep -v notes)"   # nothing here but the page's file
test "$(cat notes/hello.txt)" = hello
echo kept > state
test "$PYTEST_SKY_HOME" != "$HOME" && test -d "$PYTEST_SKY_HOME"
```

<!-- example: continues -->
```bash
test "$(cat state)" = kept
```

<!-- example: in=clone -->
```bash
test -f pyproject.toml && test -f README.md && test -d ../project && test ! -e .venv
```

```python
import os

assert os.listdir(".") == []
```
"""
    result = _page(pytester, body)
    result.assert_outcomes(passed=3)


def test_blocks_that_cannot_run_say_why_and_are_counted(pytester: pytest.Pytester) -> None:
    body = "# A page\n\n<!-- example: skip=gpu -->\n```python\nraise SystemExit(1)\n```\n\n" + (
        "<!-- example: skip=apt -->\n```bash\napt-get install -y nothing\n```\n\n```bash\ntrue\n```\n"
    )
    result = _page(pytester, body)
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "documentation examples: 1 ran, 2 not run here (installs Debian packages*: 1 block; needs a GPU: 1 block)",
            "*docs/page.md: line 4: needs a GPU",
        ]
    )


def test_a_marker_word_that_is_unknown_is_an_error_naming_the_line(pytester: pytest.Pytester) -> None:
    result = _page(pytester, "# A page\n\n<!-- example: skip=someday -->\n```bash\ntrue\n```\n")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*page.md:4: no reason 'someday'; use one of gpu, cloud, apt, suite, torch-index*"])


def test_an_example_that_leaves_a_cluster_up_fails_and_the_cluster_goes(pytester: pytest.Pytester) -> None:
    result = _page(pytester, "# A page\n\n```bash\npytest-sky launch -c left --num-nodes 1 -- true\n```\n")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the example left clusters up (left)*"])
    homes = list(pytester.path.parent.glob("**/sky-home/clusters/*/record.json"))
    assert homes == []


# ----------------------------------------------------------------------------- CI configurations


def test_a_github_workflow_s_run_steps_are_its_commands() -> None:
    workflow = {
        "env": {"A": 1},
        "jobs": {
            "test": {
                "env": {"B": "2"},
                "steps": [
                    {"uses": "actions/checkout@v4"},
                    {"name": "Install", "run": "echo one\necho two\n", "env": {"A": "3"}},
                    {"run": "pytest"},
                ],
            }
        },
    }
    commands = doc_shell.github_commands(workflow)
    assert [(c.script, c.env) for c in commands] == [
        ("echo one\necho two\n", {"A": "3", "B": "2"}),
        ("pytest", {"A": "1", "B": "2"}),
    ]
    assert commands[0].label == "job test, step 'Install'" and commands[0].shell != commands[1].shell


def test_a_gitlab_job_s_scripts_are_its_commands_in_two_shells() -> None:
    pipeline = {
        "variables": {"A": "1"},
        "stages": ["test"],
        ".template": {"script": ["never"]},
        "default": {"before_script": ["echo default"]},
        "job": {"script": ["one", "two"], "after_script": ["three"], "variables": {"B": 2}},
    }
    commands = doc_shell.gitlab_commands(pipeline)
    assert [c.script for c in commands] == ["echo default", "one", "two", "three"]
    assert [c.shell for c in commands] == ["job job"] * 3 + ["job job, after_script"]
    assert commands[0].env == {"A": "1", "B": "2"}


@pytest.mark.parametrize(
    ("command", "apt"),
    [
        ("sudo apt-get update && sudo apt-get install -y ssh", True),
        ("apt-get install -y iproute2", True),
        ("\napt install -y iproute2\n", True),
        ("python3 -m venv .venv", False),
        ("echo apt-get", False),
    ],
)
def test_an_apt_install_step_is_told_by_its_first_command(command: str, apt: bool) -> None:
    assert doc_shell.is_apt_install(command) is apt


def test_skip_steps_without_an_apt_step_is_an_error(pytester: pytest.Pytester) -> None:
    body = "# CI\n\n<!-- example: ci=gitlab skip-steps=apt -->\n```yaml\njob:\n  script:\n    - 'true'\n```\n"
    result = _page(pytester, body)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*skip-steps=apt, but no step is an apt-get install*"])


def test_the_environment_is_a_reader_s_shell(tmp_path: Path) -> None:
    box = doc_shell.Sandbox(tmp_path).make()
    env = doc_shell.environment(box)
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["HOME"] == str(box.home) and env["PYTEST_SKY_HOME"] == str(box.sky_home)
    assert not [k for k in env if k.startswith(doc_shell.NOT_PASSED_ON)]
