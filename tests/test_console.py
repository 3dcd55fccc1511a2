"""``pytest_sky.console``: plain lines for logs and CI, rich's live display on a terminal.

The plain format is asserted exactly: scripts and CI logs read it, and ``tests/test_cli.py``
counts its lines.  The terminal mode runs against a rich console forced to think it is a
terminal, writing into a string, so the escape codes it emits can be inspected.
"""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Iterator

import pytest
from rich.console import Console

from pytest_sky import console

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with progress on and no counters left over from another."""
    monkeypatch.delenv("CI", raising=False)
    console.enable(True)
    console._open.clear()
    monkeypatch.setattr(console, "_last", "")
    monkeypatch.setattr(console, "_rich", None)
    yield
    console._stop_live()
    console._open.clear()
    console.enable(False)


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "interactive", lambda: False)


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """A terminal 80 columns wide whose bytes land in the returned buffer."""
    buf = io.StringIO()
    monkeypatch.setattr(console, "interactive", lambda: True)
    forced = Console(file=buf, force_terminal=True, force_interactive=True, width=80, color_system="standard")
    monkeypatch.setattr(console, "_rich", forced)
    return buf


def visible_lines(raw: str) -> list[str]:
    return [line for line in ANSI.sub("", raw).replace("\r", "\n").split("\n") if line.strip()]


def test_not_a_terminal_is_not_interactive(capsys: pytest.CaptureFixture[str]) -> None:
    assert not console.interactive()


def test_plain_messages_are_exact_lines(plain: None, capsys: pytest.CaptureFixture[str]) -> None:
    console.progress("launching dev: 2 node(s) on local")
    for done in range(4):
        console.counter("nodes ready", done, 3)
    console.counter("nodes ready", 3, 3)  # a poll loop seeing the last node again
    console.hint("follow: pytest-sky logs dev 1 --follow")
    console.error("job 1: exit code 3")
    err = capsys.readouterr().err
    assert err == (
        "pytest-sky: launching dev: 2 node(s) on local\n"
        "pytest-sky: nodes ready 3/3\n"
        "pytest-sky: follow: pytest-sky logs dev 1 --follow\n"
        "pytest-sky: error: job 1: exit code 3\n"
    )


def test_a_counter_reused_later_prints_again(plain: None, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("a", "b"):
        console.progress(f"launching {name}")
        console.counter("nodes ready", 1, 1)
    assert capsys.readouterr().err.count("nodes ready 1/1\n") == 2


def test_disabled_shows_only_errors_and_hints(plain: None, capsys: pytest.CaptureFixture[str]) -> None:
    console.enable(False)
    console.progress("launching")
    console.counter("nodes ready", 2, 2)
    console.hint("h")
    console.error("e")
    assert capsys.readouterr().err == "pytest-sky: h\npytest-sky: error: e\n"


def test_messages_are_logged(plain: None, caplog: pytest.LogCaptureFixture) -> None:
    console.enable(False)
    with caplog.at_level("DEBUG", logger="pytest_sky"):
        console.progress("launching")
        console.counter("nodes ready", 1, 2)
        console.error("boom")
    assert [r.getMessage() for r in caplog.records] == ["launching", "nodes ready 1/2", "error: boom"]


def test_plain_table_is_space_aligned(plain: None, capsys: pytest.CaptureFixture[str]) -> None:
    console.table(["NAME", "NODES", "AGE"], [["dev", "2", ""], ["long-name", "10", "3m"]])
    assert capsys.readouterr().out == "NAME       NODES  AGE\ndev        2\nlong-name  10     3m\n"


def test_plain_table_without_rows_is_the_header(plain: None, capsys: pytest.CaptureFixture[str]) -> None:
    console.table(["ID", "STATUS"], [])
    assert capsys.readouterr().out == "ID  STATUS\n"


def test_terminal_table_shows_every_cell(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(console, "interactive", lambda: True)
    console.table(["NAME", "NODES"], [["dev", "2"]])
    assert [line.split() for line in capsys.readouterr().out.splitlines()] == [["NAME", "NODES"], ["dev", "2"]]


def test_terminal_counter_redraws_in_place_and_ends_on_the_total(terminal: io.StringIO) -> None:
    console.progress("launching dev")
    for done in range(1, 4):
        console.counter("nodes ready", done, 3)
    raw = terminal.getvalue()
    assert "\r\x1b[K" not in raw  # the old hand-written redraw; rich erases lines its own way
    assert "nodes ready 1/3" in raw and "nodes ready 2/3" in raw
    assert raw.endswith("pytest-sky: nodes ready 3/3\n")
    assert visible_lines(raw)[0] == "pytest-sky: launching dev"
    assert console._live is None


def test_terminal_message_during_a_counter_prints_above_it(terminal: io.StringIO) -> None:
    console.counter("pods running", 1, 2)
    console.progress("pulling image")
    assert console._live is not None
    console.counter("pods running", 2, 2)
    assert console._live is None
    assert terminal.getvalue().endswith("pytest-sky: pods running 2/2\n")


def test_terminal_error_is_red_and_ends_open_counters(terminal: io.StringIO) -> None:
    console.counter("nodes ready", 1, 4)
    console.error("node dev-worker1 did not come up")
    raw = terminal.getvalue()
    assert "\x1b[31mpytest-sky: error:\x1b[0m node dev-worker1 did not come up\n" in raw
    assert raw.endswith("did not come up\n") and console._live is None


def count_from_threads(labels: int, steps: int) -> None:
    """Many threads each report their own counter, all at once."""
    start = threading.Barrier(labels)

    def count(label: str) -> None:
        start.wait()
        for done in range(1, steps + 1):
            console.counter(label, done, steps)

    threads = [threading.Thread(target=count, args=(f"t{i}",)) for i in range(labels)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_terminal_counters_from_threads(terminal: io.StringIO) -> None:
    count_from_threads(labels=16, steps=20)
    finals = [line for line in visible_lines(terminal.getvalue()) if line.endswith(" 20/20")]
    assert sorted(finals) == sorted(f"pytest-sky: t{i} 20/20" for i in range(16))
    assert console._live is None and not console._open


def test_plain_counters_from_threads(plain: None, capsys: pytest.CaptureFixture[str]) -> None:
    count_from_threads(labels=16, steps=20)
    lines = capsys.readouterr().err.splitlines()
    assert sorted(lines) == sorted(f"pytest-sky: t{i} 20/20" for i in range(16))
