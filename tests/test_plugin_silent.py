"""A session that asks for no cluster: the plugin is installed, loaded, and does nothing.

Run as a user's project runs it (a fresh interpreter, the plugin found by its entry point,
``HOME`` a directory of the test's own and no ``PYTEST_SKY_HOME``), once plainly and once
under xdist, against a baseline run with the plugin switched off (``-p no:sky``): the home
stays empty, every signal handler is what it is without the plugin, and neither ``-X
importtime`` (every process's: the xdist workers' too) nor any process's ``sys.modules`` at
its end lists any of the cluster machinery.  (``-X importtime`` leaves out the modules that
pytest's assertion rewriter loads, the plugin's own entry module among them: ``sys.modules``
is the other witness.)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

#: What a session that asks for no cluster must not import: the cluster machinery, and the
#: heavy libraries behind it.
NOT_IMPORTED = (
    "pytest_sky.cluster",
    "pytest_sky.state",
    "pytest_sky.backends",
    "pytest_sky.lifecycle",
    "pytest_sky.runner",
    "kubernetes",
    "paramiko",
    "torch",
)

#: The inner project: a plain test, and a conftest that writes down every signal handler as
#: each process has it during the test and after the session (``pytest_unconfigure`` comes
#: after every ``pytest_sessionfinish``).  The test's record names no worker: xdist sends the
#: one test to either, and the two runs compared may pick differently.
CONFTEST = """
import json, os, signal

def handlers():
    return {s.name: repr(signal.getsignal(s)) for s in signal.Signals}

def pytest_unconfigure(config):
    import sys

    tag = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = os.path.join(os.environ["SKY_TEST_OUT"], f"{os.environ['RUN']}-{tag}-end.json")
    with open(path, "w") as f:
        json.dump(handlers(), f)
    with open(os.path.join(os.environ["SKY_TEST_OUT"], f"{os.environ['RUN']}-{tag}.modules"), "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
"""
TEST = """
import json, os
from conftest import handlers

def test_plain():
    tag = "worker" if "PYTEST_XDIST_WORKER" in os.environ else "main"  # whichever worker xdist picks
    with open(os.path.join(os.environ["SKY_TEST_OUT"], f"{os.environ['RUN']}-{tag}-test.json"), "w") as f:
        json.dump(handlers(), f)
"""


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for key in [k for k in __import__("os").environ if k.startswith(("PYTEST_SKY_", "PYTEST_XDIST_"))]:
        monkeypatch.delenv(key)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("SKY_TEST_OUT", str(out))
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_plain=TEST)
    return home


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, *args: str) -> pytest.RunResult:
    monkeypatch.setenv("RUN", name)
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # -X importtime, for the xdist workers too
    result = pytester.run(sys.executable, "-X", "importtime", "-m", "pytest", "-p", "no:cacheprovider", *args)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    return result


def _imported(result: pytest.RunResult) -> set[str]:
    """Every module ``-X importtime`` reported, in any process of the run."""
    names = set()
    for line in result.stderr.lines:
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", line)
        if m:
            names.add(m.group(1))
    return names


def _handlers(out: Path, run: str) -> dict[str, dict]:
    return {p.stem.removeprefix(f"{run}-"): json.loads(p.read_text()) for p in sorted(out.glob(f"{run}-*.json"))}


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["plain", "xdist"])
def test_a_session_that_asks_for_no_cluster_touches_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, project: Path, xdist: list[str]
) -> None:
    out = Path(__import__("os").environ["SKY_TEST_OUT"])
    baseline = _run(pytester, monkeypatch, "without", "-p", "no:sky", *xdist)
    result = _run(pytester, monkeypatch, "with", *xdist)
    assert "pytest-sky: backend=local" in result.stdout.str()  # the plugin was loaded: its header line
    assert "pytest-sky" not in baseline.stdout.str()

    assert sorted(p.relative_to(project) for p in project.rglob("*")) == []

    without, with_plugin = _handlers(out, "without"), _handlers(out, "with")
    assert sorted(with_plugin) == sorted(without) and with_plugin  # during the test and after, per process
    assert with_plugin == without

    imported = _imported(result)
    assert "pytest_sky.settings" in imported, result.stderr.str()[-2000:]  # the plugin's options
    assert _heavy(imported) == []
    for modules in sorted(out.glob("with-*.modules")):
        loaded = set(modules.read_text().split())
        assert "pytest_sky.plugin" in loaded, modules.name
        assert _heavy(loaded) == [], modules.name
    assert len(list(out.glob("with-*.modules"))) == (3 if xdist else 1)  # the controller and each worker


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_IMPORTED))
