"""What CI keeps of a failed multinode test: rank logs in the JUnit XML, ``--sky-artifacts``,
and the timeline, read the way a CI viewer and a person would read them."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.plugin_helpers import assert_no_traceback, needs_local_backend

INNER = """
import pytest

@pytest.mark.multinode(num_nodes=2)
def test_fails(sky_cluster):
    rank = "$SKYPILOT_NODE_RANK"
    res = sky_cluster.run(f'echo "hello from {{rank}}"; [ "{{rank}}" = 1 ] && {{{{ echo boom; exit 3; }}}}; true')
    assert res.returncode == 0, res.error

@pytest.mark.multinode(num_nodes=2)
def test_hangs(sky_cluster):
    rank = "$SKYPILOT_NODE_RANK"
    sky_cluster.run(f'echo "up {{rank}}"; [ "{{rank}}" = 1 ] && exec sleep 60; true', timeout={timeout})

@pytest.mark.multinode(num_nodes=2)
def test_passes(sky_cluster):
    assert sky_cluster.run("true").returncode == 0
"""


def cases_of(xml_path: Path) -> dict[str, ET.Element]:
    return {tc.get("name", ""): tc for tc in ET.parse(xml_path).getroot().iter("testcase")}


def properties(tc: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in tc.iter("property")}


def system_out(tc: ET.Element) -> str:
    outs = tc.findall("system-out")
    assert len(outs) <= 1, "one system-out per test case"
    return outs[0].text or "" if outs else ""


class _Text(HTMLParser):
    """The visible text of a page (checks that it parses, too)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def page_text(path: Path) -> str:
    parser = _Text()
    parser.feed(path.read_text())
    parser.close()
    return " ".join(parser.parts)


@needs_local_backend
def test_a_failed_tests_ranks_are_in_the_xml_and_its_artifacts(pytester: pytest.Pytester, inner_sky_home: Path) -> None:
    pytester.makepyfile(test_inner=INNER.format(timeout=3))
    art = pytester.path / "art"
    result = pytester.runpytest_subprocess("-o", "junit_logging=no", "--junitxml=r.xml", f"--sky-artifacts={art}")
    result.assert_outcomes(passed=1, failed=2)

    cases = cases_of(pytester.path / "r.xml")
    fails = cases["test_fails"]
    labels = properties(fails)
    (worker,) = [v for k, v in labels.items() if k.endswith("rank 1")]
    assert worker.startswith("worker1 198.1") and worker.endswith(" exit 3"), labels
    out = system_out(fails)
    assert "rank 1 (worker1, 198.1" in out and "exit 3) =====\nhello from 1\nboom\n" in out, out
    attached = [line.split("|", 1)[1].rstrip("]") for line in out.splitlines() if line.startswith("[[ATTACHMENT|")]
    assert attached and all(Path(p).is_file() for p in attached), out
    assert not properties(cases["test_passes"]) and system_out(cases["test_passes"]) == ""

    d = art / "test_inner.py_test_fails"
    (cluster_dir,) = [p for p in d.iterdir() if p.is_dir()]
    assert (cluster_dir / "job-1" / "rank-1-worker1.log").read_text() == "hello from 1\nboom\n"
    assert (cluster_dir / "job-1" / "rank-0-head.log").read_text() == "hello from 0\n"
    assert "hello from 1" in (cluster_dir / "job-1" / "merged.log").read_text()
    first_event = json.loads((cluster_dir / "job-1" / "events.jsonl").read_text().splitlines()[0])
    assert "hello from" in json.dumps(first_event)  # the run spec, with its command
    spec = json.loads((cluster_dir / "job-1" / "spec.json").read_text())
    assert "hello from" in spec["run"] and [n["name"] for n in spec["nodes"]] == ["head", "worker1"], spec
    assert "launching" in (cluster_dir / "provision.log").read_text()
    summary = json.loads((d / "summary.json").read_text())
    assert summary["outcome"] == "failed" and summary["first_failure"].startswith("rank 1 (worker1, 198.1")
    assert "rank 1 (worker1) failed first: run exited 3" in page_text(d / "timeline.html")
    assert "timeline: " + str(d / "timeline.html") in result.stdout.str()

    hung = art / "test_inner.py_test_hangs"
    text = page_text(hung / "timeline.html")
    assert "still running: rank 1 (worker1)" in text and "run: still running at the timeout" in text, text
    assert not (art / "test_inner.py_test_passes").exists()  # a passing test writes nothing
    assert [p.name for p in art.iterdir() if p.name.startswith(".")] == []


@needs_local_backend
def test_under_xdist_each_test_gets_its_own_complete_files(pytester: pytest.Pytester, inner_sky_home: Path) -> None:
    pytester.makepyfile(
        test_inner="""
        import pytest

        @pytest.mark.multinode(num_nodes=2)
        @pytest.mark.parametrize("i", range(4))
        def test_many(sky_cluster, i):
            res = sky_cluster.run(f'echo "mine {i} $SKYPILOT_NODE_RANK"; exit $SKYPILOT_NODE_RANK')
            assert i == 3 or res.returncode == 0
        """
    )
    art = pytester.path / "art"
    args = ("-n", "2", "-o", "junit_logging=all", "--junitxml=r.xml", f"--sky-artifacts={art}", "--sky-artifacts-all")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=1, failed=3)
    for i in range(4):
        d = art / f"test_inner.py_test_many[{i}]"
        logs = sorted(d.glob("*/job-1/rank-*.log"))
        assert [p.read_text() for p in logs] == [f"mine {i} 0\n", f"mine {i} 1\n"], d
        assert json.loads((d / "summary.json").read_text())["outcome"] == ("passed" if i == 3 else "failed")
    assert [p.name for p in art.iterdir() if p.name.startswith(".")] == []
    for name, tc in cases_of(pytester.path / "r.xml").items():
        i = name[-2]
        out = system_out(tc)
        mine = [line for line in out.splitlines() if line.startswith("mine ")]
        assert name.endswith("[3]") or mine == [f"mine {i} 0", f"mine {i} 1"], (name, out)


def test_an_artifacts_directory_that_cannot_be_written_is_one_line(
    pytester: pytest.Pytester, inner_sky_home: Path
) -> None:
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--sky-artifacts=/proc/pytest-sky-artifacts")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    (line,) = [x for x in result.stderr.lines if x.strip()]
    assert "--sky-artifacts /proc/pytest-sky-artifacts: cannot write there" in line, line
    assert_no_traceback(result)


def test_on_kubernetes_the_artifacts_hold_each_pods_events_and_log(
    pytester: pytest.Pytester, inner_sky_home: Path, emu: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("kubernetes", reason="pip install kubernetes")
    pytester.makepyfile(
        test_inner=INNER.format(timeout=3).split("@pytest.mark.multinode(num_nodes=2)\ndef test_hangs")[0]
    )
    monkeypatch.setenv("KUBECONFIG", str(emu.kubeconfig_path))  # type: ignore[attr-defined]
    art = pytester.path / "art"
    from kube_emulator.images import READY_IMAGE

    image = f"--kube-image={READY_IMAGE}"
    result = pytester.runpytest_subprocess("--kubernetes", image, f"--sky-artifacts={art}", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    d = art / "test_inner.py_test_fails"
    (cluster_dir,) = [p for p in d.iterdir() if p.is_dir()]
    assert (cluster_dir / "job-1" / "rank-1-worker1.log").read_text() == "hello from 1\nboom\n"
    nodes = cluster_dir / "nodes"
    head = cluster_dir.name + "-head"
    assert "Scheduled" in (nodes / f"{head}.events.txt").read_text()
    assert (nodes / f"{head}.log").exists() and (nodes / f"{cluster_dir.name}-worker1.log").exists()
    assert "worker1" in json.loads((d / "summary.json").read_text())["first_failure"]


@needs_local_backend
@pytest.mark.parametrize("mode", ["log", "system-err", "out-err"])
def test_the_rank_lines_reach_system_out_whatever_junit_logging_says(
    pytester: pytest.Pytester, inner_sky_home: Path, mode: str
) -> None:
    pytester.makepyfile(
        test_inner=INNER.format(timeout=3).split("@pytest.mark.multinode(num_nodes=2)\ndef test_hangs")[0]
    )
    result = pytester.runpytest_subprocess("-o", f"junit_logging={mode}", "--junitxml=r.xml")
    result.assert_outcomes(failed=1)
    out = system_out(cases_of(pytester.path / "r.xml")["test_fails"])
    assert "exit 3) =====\nhello from 1\nboom\n" in out, out


def test_the_timeline_sets_apart_a_rank_that_never_started() -> None:
    from pytest_sky.runner import RankSpan, Timeline
    from pytest_sky.timeline import render

    spans = (
        RankSpan(0, "head", "198.18.0.2", "setup", 10.0, 11.0, 0),
        RankSpan(1, "worker1", "198.18.0.3", "setup", None, None, None),
    )
    page = render(Timeline("c", 4, 10.0, 12.0, spans, timed_out=True), test_id="t::x")
    parser = _Text()
    parser.feed(page)
    text = " ".join(parser.parts)
    assert "rank 1 (worker1, 198.18.0.3)" in text and "setup: never started" in text, text
    assert 'class="never"' in page and 'class="ok"' in page
