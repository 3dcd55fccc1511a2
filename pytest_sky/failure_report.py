"""What a failed test's report holds of the clusters it used: each rank's lines, where every
rank was when a run was stopped (its deadline, Ctrl-C, a test's own timeout: DESIGN.md
section 4e), the JUnit XML's copy of them, and the artifacts directory (``--sky-artifacts``).

Which clusters a test used: those its fixtures lent it (``sky_cluster``, ``sky_launch``),
and every other cluster of the session's (a user's fixture built on
``sky_cluster_factory``, of any scope) that was made or ran something while the test was
on.  Of a cluster that several tests use, a report shows the runs of its own test only:
those that began after the test did (``artifacts.runs_since``).

Light to import (the plugin's configure takes :class:`JunitWriter` and
:func:`artifacts_problem` from here in every session): the cluster machinery is imported
by the functions that have clusters to report.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_sky import junit

if TYPE_CHECKING:
    from pytest_sky.cluster import Cluster
    from pytest_sky.settings import Settings


def add(
    item: pytest.Item,
    report: pytest.TestReport,
    clusters: list[Cluster],
    since: float,
    settings: Settings | None,
    reported: set[int] | None = None,
) -> None:
    """The rank sections of a failed setup or call, and the artifacts where asked for; the
    stopped runs it shows join ``reported`` (by ``id``)."""
    out = []
    if report.failed:
        out += _rank_sections(item, report, clusters, since)
        out += _stopped_sections(report, clusters, since, set() if reported is None else reported)
    if settings is not None and settings.artifacts and (report.failed or (settings.artifacts_all and report.passed)):
        out.append(_keep_artifacts(report, settings.artifacts, clusters, since))
    if out and report.failed:
        junit.attach(item, report, "".join(out))


def _rank_sections(item: pytest.Item, report: pytest.TestReport, clusters: list[Cluster], since: float) -> list[str]:
    """Each rank's lines as a section of the terminal report, a property of the test in the
    JUnit XML, and the text of its ``<system-out>`` (returned)."""
    from pytest_sky.artifacts import RUNS_SHOWN, runs_since

    out = []
    for cluster in clusters:
        for result in runs_since(cluster, since)[-RUNS_SHOWN:]:
            for rank in result.ranks:
                title = f"sky {cluster.name} job {result.job_id} rank {rank.rank} ({rank.name}, exit {rank.returncode})"
                report.sections.append((title, rank.output or "(no output)\n"))
                item.user_properties.append(
                    (
                        f"sky {cluster.name} job {result.job_id} rank {rank.rank}",
                        f"{rank.name} {rank.ip} exit {rank.returncode}",
                    )
                )
                header = junit.rank_header(cluster.name, result.job_id, rank.rank, rank.name, rank.ip, rank.returncode)
                out.append(f"{header}\n{rank.output or '(no output)'}\n")
            if result.error:
                report.sections.append((f"sky {cluster.name} job {result.job_id}", result.error + "\n"))
                out.append(f"===== sky {cluster.name} job {result.job_id}: {result.error}\n")
    return out


def _stopped_sections(
    report: pytest.TestReport, clusters: list[Cluster], since: float, reported: set[int]
) -> list[str]:
    """Where every rank was when a run of the test was stopped: a section of the terminal
    report, and the text for the JUnit XML's ``<system-out>`` (returned)."""
    from pytest_sky.artifacts import RUNS_SHOWN, stopped_since

    out = []
    for cluster in clusters:
        for stopped in stopped_since(cluster, since)[-RUNS_SHOWN:]:
            reported.add(id(stopped))
            capture = stopped.capture
            title = f"sky {cluster.name} job {capture.job_id}: where every rank was"
            report.sections.append((title, capture.summary()))
            out.append(f"===== {title} {capture.why} =====\n{capture.summary()}")
    return out


def _keep_artifacts(report: pytest.TestReport, directory: str, clusters: list[Cluster], since: float) -> str:
    """Write the test's artifacts (before its clusters go) and say where, in the report and
    as attachment lines; a failure to gather them is a line in the report, never an error."""
    from pytest_sky import artifacts
    from pytest_sky.errors import SkyError

    try:
        where = artifacts.write(
            Path(directory).resolve(), report.nodeid, report.outcome, report.when, clusters, since=since
        )
    except (OSError, SkyError) as exc:
        report.sections.append(("sky artifacts", f"could not write artifacts under {directory}: {exc}\n"))
        return ""
    lines = f"artifacts: {where}\n"
    if (where / artifacts.TIMELINE).exists():
        lines += f"timeline: {where / artifacts.TIMELINE}\n"
    lines += "".join(f"where every rank was, in full: {path}\n" for path in artifacts.stacks_files(where))
    report.sections.append(("sky artifacts", lines))
    return lines + junit.attachment_lines(artifacts.files(where))


def artifacts_problem(directory: str) -> str | None:
    """Why ``--sky-artifacts DIR`` cannot be used, or None, found without making anything
    (the first test that keeps artifacts makes the directory): the nearest directory that
    exists must be one this user may write in, on a filesystem that stores files (``/proc``
    and ``/sys`` have no blocks; root passes every permission check, not those)."""
    import os

    path = Path(directory).expanduser().resolve()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fs = os.statvfs(existing)
    if not existing.is_dir():
        why = f"{existing} is not a directory"
    elif fs.f_flag & os.ST_RDONLY:
        why = f"{existing} is on a read-only filesystem"
    elif fs.f_blocks == 0:
        why = f"{existing} is on a filesystem that stores no files"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable by this user"
    else:
        return None
    return f"--sky-artifacts {directory}: cannot write there ({why}): pick a writable directory"


class JunitWriter:
    """On the process that writes the JUnit XML (the controller, under xdist): the rank logs
    and attachment lines into each failed test case's ``<system-out>``.  One per session,
    holding its config: ``pytest_runtest_logreport`` is not given it."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        text = getattr(report, junit.REPORT_ATTR, None)
        if text:
            junit.add_system_out(self.config, report, text)
