"""Rank logs in the JUnit XML: what CI viewers show of a failed multinode test.

pytest writes a test's captured output into ``<system-out>`` only as ``junit_logging`` says
(by default: not at all), and never the report's other sections, where the rank logs are.
So the plugin adds, for a failed multinode test, one ``<property>`` per rank (rank, node,
IP and exit code) and a ``<system-out>`` holding each rank's lines under a labelled header,
then ``[[ATTACHMENT|path]]`` lines for the artifacts (Jenkins' attachments plugin and
GitLab read those), whatever ``junit_logging`` is.  Under xdist the text travels with the
report (:data:`REPORT_ATTR`) to the controller, which alone writes the XML.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import pytest

#: The attribute of a test report that carries the text for ``<system-out>``.
REPORT_ATTR = "sky_junit_output"


def rank_header(cluster: str, job_id: int, rank: int, node: str, ip: str, code: int) -> str:
    return f"===== sky {cluster} job {job_id} rank {rank} ({node}, {ip}, exit {code}) ====="


def attachment_lines(paths: Sequence[Path]) -> str:
    return "".join(f"[[ATTACHMENT|{p}]]\n" for p in paths)


#: The ``junit_logging`` values for which pytest writes captured stdout, and captured log
#: only, into ``<system-out>`` (at teardown): the text joins what pytest writes there.
_WITH_STDOUT = ("system-out", "out-err", "all")
_WITH_LOG_ONLY = ("log",)


def attach(item: pytest.Item, report: pytest.TestReport, text: str) -> None:
    """Make ``text`` part of the test case's one ``<system-out>``: as captured output where
    pytest writes that there, else (``no``, ``system-err``) by the controller's
    :func:`add_system_out`, from the report."""
    mode = item.config.getini("junit_logging")
    if mode in _WITH_STDOUT:
        item.add_report_section(report.when, "stdout", text)
    elif mode in _WITH_LOG_ONLY:
        item.add_report_section(report.when, "log", text)
    else:
        setattr(report, REPORT_ATTR, text)


def add_system_out(config: pytest.Config, report: pytest.TestReport, text: str) -> None:
    """Append ``text`` to the test case's ``<system-out>`` (made if pytest wrote none)."""
    try:
        from _pytest.junitxml import bin_xml_escape, xml_key
    except ImportError:  # a pytest that moved them: the properties still carry the ranks
        return
    xml = config.stash.get(xml_key, None)
    if xml is None:
        return
    reporter = xml.node_reporter(report)
    for node in reporter.nodes:
        if node.tag == "system-out":
            node.text = (node.text or "") + "\n" + bin_xml_escape(text)
            return
    out = ET.Element("system-out")
    out.text = bin_xml_escape(text)
    reporter.append(out)
