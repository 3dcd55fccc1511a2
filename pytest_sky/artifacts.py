"""A failed multinode test's artifacts: what CI keeps once its clusters are torn down.

``--sky-artifacts DIR`` (``PYTEST_SKY_ARTIFACTS``) writes, for each failed test that used a
cluster, ``DIR/<test id>/`` before teardown:

- ``<cluster>/job-<id>/rank-<r>-<node>.log``: each rank's own lines, setup included;
- ``<cluster>/job-<id>/merged.log`` (the prefixed log as the terminal shows it),
  ``spec.json`` (what was run, where, with which environment: a secret's value as ``***``)
  and ``events.jsonl`` (the head's record of the job: the run spec first, then every event),
  every secret masked (``pytest_sky.masking``);
- ``<cluster>/provision.log``: the launch's account;
- ``<cluster>/nodes/``: what the backend knows beyond the runs (Kubernetes: each pod's
  events and container log);
- ``<cluster>/job-<id>-stacks/``: where every rank of a run was when it was stopped (its
  deadline, Ctrl-C, a test's own timeout): ``stacks.txt``, every process, thread and frame
  of every node (``diagnosis.Capture.full``), and ``capture.json``, the same as data;
- ``timeline.html``: the last run's ranks over time (``pytest_sky.timeline``), with the
  deadline of a run that did not end by itself;
- ``summary.json``: the test, its outcome, and per cluster, job and rank where it ran and
  how it ended.

A directory is written under a temporary name and renamed into place, so parallel workers
(``-n``) never interleave files and a reader never sees half of one.  ``--sky-artifacts-all``
keeps them for passing tests too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pytest_sky.cluster import Cluster
from pytest_sky.diagnosis import Capture
from pytest_sky.errors import RunTimeoutError, SkyError
from pytest_sky.lifecycle import PROVISION_LOG
from pytest_sky.protocol import SpecEvent, decode_event
from pytest_sky.runner import RunResult, StoppedRun, Timeline
from pytest_sky.timeline import render

SUMMARY = "summary.json"
TIMELINE = "timeline.html"
STACKS = "stacks.txt"


#: How many of a cluster's runs during a test its report shows (the last ones).
RUNS_SHOWN = 3


def runs_since(cluster: Cluster, since: float) -> list[RunResult]:
    """The cluster's runs that began at ``since`` or later (``time.time()``), oldest first."""
    return [r for r in cluster.results if r.timeline is None or r.timeline.started >= since]


def used_since(cluster: Cluster, since: float) -> bool:
    """Whether the cluster was made, or ran something, at ``since`` or later."""
    if cluster.record.created >= since or runs_since(cluster, since):
        return True
    return bool(_timed_out_since(cluster, since) or stopped_since(cluster, since))


def dir_name(nodeid: str) -> str:
    """A file name for a test id, readable and unique per id (parameters included)."""
    slug = re.sub(r"[^A-Za-z0-9_.\[\]-]+", "_", nodeid).strip("_")
    return slug[:200] or "test"


@dataclass(frozen=True)
class RankSummary:
    rank: int
    node: str
    ip: str
    exit: int
    log: str  # relative to the test's directory


@dataclass(frozen=True)
class JobSummary:
    job_id: int
    returncode: int
    error: str | None
    seconds: float
    ranks: tuple[RankSummary, ...]
    timed_out: bool = False
    stacks: str | None = None  # where every rank was when it was stopped, relative to the test's directory


@dataclass(frozen=True)
class ClusterSummary:
    name: str
    backend: str
    nodes: tuple[tuple[int, str, str], ...]  # (rank, name, ip)
    jobs: tuple[JobSummary, ...]


@dataclass(frozen=True)
class Summary:
    test: str
    outcome: str  # "failed" or "passed"
    when: str  # the phase that failed: "setup" or "call"
    clusters: tuple[ClusterSummary, ...]
    timeline: str | None = None
    first_failure: str | None = None
    problems: tuple[str, ...] = field(default=())  # what could not be gathered, and why


def write(root: Path, nodeid: str, outcome: str, when: str, clusters: list[Cluster], *, since: float = 0.0) -> Path:
    """Everything listed in the module's docstring, for one test; returns its directory.
    Of each cluster, the runs that began at ``since`` or later (``time.time()``: the test's
    start, where other tests used the cluster before)."""
    final = root / dir_name(nodeid)
    tmp = root / f".{final.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    problems: list[str] = []
    summaries = [_cluster(tmp, c, problems, since) for c in clusters]
    timeline = _last_timeline(clusters, since)
    first = None
    if timeline is not None:
        (tmp / TIMELINE).write_text(render(timeline, test_id=nodeid), encoding="utf-8")
        span = timeline.first_failure()
        first = f"rank {span.rank} ({span.name}, {span.ip}): {span.phase} exited {span.code}" if span else None
    summary = Summary(nodeid, outcome, when, tuple(summaries), TIMELINE if timeline else None, first, tuple(problems))
    (tmp / SUMMARY).write_text(json.dumps(asdict(summary), indent=2) + "\n", encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)  # a rerun of the same test id: the newest account wins
    os.replace(tmp, final)
    return final


def files(directory: Path) -> list[Path]:
    """Every file written for a test, in a stable order."""
    return sorted(p for p in directory.rglob("*") if p.is_file())


def stopped_since(cluster: Cluster, since: float) -> list[StoppedRun]:
    """The cluster's runs stopped before they ended (where every rank was) at ``since`` or later."""
    return [s for s in cluster.stopped if s.capture.taken >= since]


def _timed_out_since(cluster: Cluster, since: float) -> list[RunTimeoutError]:
    return [e for e in cluster.timed_out if not isinstance(e.timeline, Timeline) or e.timeline.started >= since]


def _cluster(tmp: Path, cluster: Cluster, problems: list[str], since: float) -> ClusterSummary:
    cdir = tmp / cluster.name
    cdir.mkdir()
    src = cluster.journal.cluster_dir / PROVISION_LOG
    with contextlib.suppress(OSError):
        shutil.copyfile(src, cdir / PROVISION_LOG)
    jobs = [_job(tmp, cdir, cluster, r, problems) for r in runs_since(cluster, since)[-RUNS_SHOWN:]]
    for exc in _timed_out_since(cluster, since)[-1:]:
        timeline = exc.timeline if isinstance(exc.timeline, Timeline) else None
        job_id = timeline.job_id if timeline else 0
        jdir = cdir / f"job-{job_id}-timed-out"
        jdir.mkdir(exist_ok=True)
        (jdir / "merged.log").write_text(exc.partial_output + "\n", encoding="utf-8")
        _events(jdir, cluster, job_id, problems)
        jobs.append(JobSummary(job_id, -1, str(exc), 0.0, (), timed_out=True))
    for stopped in stopped_since(cluster, since)[-RUNS_SHOWN:]:
        jobs.append(_stacks(tmp, cdir, stopped.capture))
    try:
        extra = cluster.diagnostics()
    except Exception as exc:  # noqa: BLE001 - an artifact that cannot be read is noted, never fatal
        extra = []
        problems.append(f"{cluster.name} node diagnostics: {exc}")
    if extra:
        (cdir / "nodes").mkdir()
        for name, text in extra:
            (cdir / "nodes" / Path(name).name).write_text(text, encoding="utf-8")
    nodes = tuple(zip(range(cluster.num_nodes), cluster.node_names, cluster.node_ips, strict=True))
    return ClusterSummary(cluster.name, cluster.backend, nodes, tuple(jobs))


def _job(tmp: Path, cdir: Path, cluster: Cluster, result: RunResult, problems: list[str]) -> JobSummary:
    jdir = cdir / f"job-{result.job_id}"
    jdir.mkdir(exist_ok=True)
    ranks = []
    for r in result.ranks:
        log = jdir / f"rank-{r.rank}-{r.name}.log"
        log.write_text(r.output, encoding="utf-8")
        ranks.append(RankSummary(r.rank, r.name, r.ip, r.returncode, str(log.relative_to(tmp))))
    (jdir / "merged.log").write_text(result.output, encoding="utf-8")
    _events(jdir, cluster, result.job_id, problems)
    return JobSummary(result.job_id, result.returncode, result.error, round(result.seconds, 3), tuple(ranks))


def _events(jdir: Path, cluster: Cluster, job_id: int, problems: list[str]) -> None:
    """The head's record of the job (``events.jsonl``) and its run spec (``spec.json``)."""
    try:
        events = cluster.job_events(job_id)
    except SkyError as exc:
        problems.append(f"{cluster.name} job {job_id} events: {exc}")
        return
    (jdir / "events.jsonl").write_bytes(events)
    first = decode_event(events.split(b"\n", 1)[0]) if events.strip() else None
    if isinstance(first, SpecEvent):
        (jdir / "spec.json").write_text(json.dumps(first.spec.to_record(), indent=2) + "\n", encoding="utf-8")


def _stacks(tmp: Path, cdir: Path, capture: Capture) -> JobSummary:
    """Where every rank of a stopped run was, in full, and each rank's last lines."""
    sdir = cdir / f"job-{capture.job_id}-stacks"
    n = 1
    while sdir.exists():  # a second stop of the same job (a wait given up, then the test's timeout)
        n += 1
        sdir = cdir / f"job-{capture.job_id}-stacks-{n}"
    sdir.mkdir()
    (sdir / STACKS).write_text(capture.full(), encoding="utf-8")
    (sdir / "capture.json").write_text(capture.to_json(), encoding="utf-8")
    ranks = []
    for rank in capture.ranks:
        log = sdir / f"rank-{rank.rank}-{rank.name}.last.log"
        log.write_text("".join(line + "\n" for line in rank.last_lines), encoding="utf-8")
        code = -1 if rank.code is None else rank.code
        ranks.append(RankSummary(rank.rank, rank.name, rank.ip, code, str(log.relative_to(tmp))))
    stacks = str((sdir / STACKS).relative_to(tmp))
    return JobSummary(capture.job_id, -1, f"stopped {capture.why}", 0.0, tuple(ranks), timed_out=True, stacks=stacks)


def stacks_files(directory: Path) -> list[Path]:
    """The full accounts of stopped runs in a test's directory."""
    return sorted(directory.glob(f"*/job-*-stacks*/{STACKS}"))


def _last_timeline(clusters: list[Cluster], since: float) -> Timeline | None:
    """The timeline of the test's last run on any of its clusters, timed-out ones included."""
    found: list[Timeline] = []
    for c in clusters:
        found += [r.timeline for r in runs_since(c, since) if r.timeline is not None]
        found += [e.timeline for e in _timed_out_since(c, since) if isinstance(e.timeline, Timeline)]
        found += [s.timeline for s in stopped_since(c, since) if s.timeline is not None]
    return max(found, key=lambda t: t.ended) if found else None
