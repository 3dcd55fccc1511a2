"""What the plugin's tests (``test_plugin.py``, ``test_plugin_scope.py``) share: whether the
local backend can run here, the recorder pasted into inner test files, and the checks of what
a run left behind and what it printed.  A module, not a test module, so that test modules
share these without importing each other.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.leftovers import our_links, processes_mentioning


def _local_backend_problem() -> str | None:
    from pytest_sky.backends import netns
    from pytest_sky.errors import SkyError

    try:
        netns.local_mode()  # root's, or rootless where the host allows it
        netns.require_tools()
    except SkyError as exc:
        return str(exc)
    return None


_PROBLEM = _local_backend_problem()
#: This process runs the local backend rootless (an ordinary user): its nodes' processes are
#: that user, not root, and it has no cgroups and no link on the host.
ROOTLESS = os.geteuid() != 0
needs_local_backend = pytest.mark.skipif(_PROBLEM is not None, reason=f"local backend unavailable: {_PROBLEM}")

# Inner test files import nothing from this repository: this is pasted at the top of those that
# report the clusters they got.  `links` is what of the cluster is on the host's links: its link
# into its namespace (a cluster of an earlier version, without a holder: its bridge and veths).
RECORDER = """
import json, os, time
from pathlib import Path


def host_links(journal):
    links = [journal["bridge"]] + ([] if journal.get("holder") else journal["veths"])
    return [link for link in links if link]


def record(cluster, tag, **extra):
    data = {
        "tag": tag,
        "name": cluster.name,
        "num_nodes": cluster.num_nodes,
        "node_ips": cluster.node_ips,
        "links": host_links(cluster.journal.load()),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "time": time.time(),
        **extra,
    }
    out = Path(os.environ["SKY_TEST_OUT"])
    tmp = out / f".{tag}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(out / f"{tag}.json")
"""


def recorded(pytester: pytest.Pytester) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((pytester.path / "out").glob("*.json"))}


def link_names() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line}


def cluster_leftovers(home: Path, info: dict) -> list[str]:
    name = info["name"]
    left = []
    if (home / "clusters" / name).exists():
        left.append(f"state directory {home / 'clusters' / name}")
    # A link by its name and its owner: under xdist another worker's cluster may reuse the
    # name at once, and its alias then names that cluster's directory, not this one's.
    left += [f"link {link}" for link in our_links(home / "clusters" / name)]
    left += [f"process {p}" for p in processes_mentioning(f"{home}/clusters/{name}/")]
    return left


def assert_nothing_left(home: Path, infos: list[dict]) -> None:
    assert infos, "the inner tests recorded no cluster"
    left = [f"{info['name']}: {what}" for info in infos for what in cluster_leftovers(home, info)]
    assert not left, left
    records = sorted(p.name for p in (home / "clusters").iterdir())
    assert records == [], records


def assert_no_traceback(result: pytest.RunResult) -> None:
    """Neither a Python traceback nor pytest's own rendering of one (``>`` source, ``E`` lines)."""
    text = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in text, text
    assert not [line for line in text.splitlines() if re.match(r"^(>|E) ", line)], text


def report_block(result: pytest.RunResult, title: str, rule: str = "_") -> list[str]:
    """The non-blank lines of the report section whose ``____ title ____`` header is given
    (``rule="-"``: a section of a test's report, ``---- title ----``)."""
    lines = result.stdout.lines
    for i, line in enumerate(lines):
        if re.fullmatch(rf"{rule}+ {re.escape(title)} {rule}+", line):
            block = []
            for following in lines[i + 1 :]:
                if re.match(r"^[_=-]{3,} ", following):
                    break
                block.append(following)
            return [line for line in block if line.strip()]
    raise AssertionError(f"no report section {title!r} in:\n{result.stdout.str()}")
