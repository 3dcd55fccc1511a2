"""The bash that runs on the nodes, and the names it shares with Python.

Scripts live beside this module as ``.sh`` files (so that ``shellcheck`` reads them whole)
and are read at run time by :func:`script`: from the package on the client, and from the
agent's zipapp on a node, which bundles the ones the agent runs (``bootstrap.AGENT_DATA``).

A script and the Python around it must agree on a few names: what a rank supervisor prints
before anything else, the cgroup and environment token that mark a job's processes, what
the leftover check looks for on a node.  Each is named once, here; the scripts spell them
literally (so they read and run on their own) and ``tests/test_shell.py`` holds every such
spelling in every script to these constants.

Shipped inside the node agent (``python -I -S``): stdlib only, and nothing but ``os`` at
import time.
"""

from __future__ import annotations

import os

#: The agent's zipapp as a node's home holds it (``~/.sky/agent.pyz``) and as a command line
#: names it: the leftover check tells an agent process by it.
AGENT_BUNDLE = "agent.pyz"
#: Where a node's agent server keeps its pid, under the node's home: the leftover check
#: leaves that process alone (every other agent process is a job's leftover).
AGENT_PID_FILE = ".sky/agent.pid"
#: ``$0`` of a rank supervisor (``bash -c SUPERVISOR psky-rank PROGRAM``): the leftover check
#: tells a supervisor by it.
RANK_ARGV0 = "psky-rank"
#: The first line a supervisor prints, followed by the pid of the rank's process group leader.
PID_MARK = "PSKY-PID"
#: What a supervisor writes before each line of the rank's stderr, on the one stream that
#: carries both (the connection, ssh's stdout): the head tells the streams apart by it and
#: takes it off.  A control character first: no program's own line starts that way by chance.
STDERR_WORD = "PSKY-ERR"
STDERR_MARK = f"\x1e{STDERR_WORD} "
#: The environment variable that carries a job's token to each of its processes (where
#: cgroups are read-only), and the leftover check's own token.
JOB_SCOPE_VAR = "PSKY_JOB_SCOPE"
#: The environment variable that tells the head's rank the pid of the agent running its job
#: (whose child it is not when the head's server runs it): the leftover check spares it.
RUN_AGENT_VAR = "PSKY_RUN_AGENT"
#: How a job's token starts (``psky-<supervisor pid>-<random>``).
JOB_SCOPE_PREFIX = "psky-"
#: How the name of a job's cgroup starts (``psky-job-<supervisor pid>`` where the supervisor
#: makes it, ``-<agent pid>-<n>`` where the head's agent does, ``-<server pid>-<n>`` a worker's
#: agent server).
CGROUP_PREFIX = "psky-job-"

#: The environment variable that carries a rank's program to the bash that runs it (never its
#: command line, which every user of the machine may read), and what that bash runs: the
#: program, once the variable is gone from the environment its children inherit.
PROGRAM_VAR = "PSKY_PROGRAM"
RUN_PROGRAM = f'eval "unset {PROGRAM_VAR}; ${PROGRAM_VAR}"'

#: The directory, under a node's home, that every session's and rank's ``PYTHONPATH`` names:
#: it holds the ``sitecustomize`` that arms every Python process's stacks (``agent.site_hook``).
SITE_DIR = ".sky/python"
#: The environment variable that tells a pod's bootstrap its rank (which host key is its own).
POD_RANK_VAR = "PSKY_RANK"
#: What the node probe prints before each command or module a node lacks.
MISSING_MARK = "MISSING"
#: Every name above: what the scripts may spell.
MARKERS = (
    SITE_DIR,
    POD_RANK_VAR,
    AGENT_BUNDLE,
    AGENT_PID_FILE,
    RANK_ARGV0,
    PID_MARK,
    STDERR_WORD,
    JOB_SCOPE_VAR,
    RUN_AGENT_VAR,
    JOB_SCOPE_PREFIX,
    CGROUP_PREFIX,
    PROGRAM_VAR,
)

#: The scripts, by file name.
RANK_SUPERVISOR = "rank_supervisor.sh"
LEFTOVER_CHECK = "leftover_check.sh"
POD_BOOTSTRAP = "pod_bootstrap.sh"
PROBE_NODES = "probe_nodes.sh"
SYNC_FILES = "sync_files.sh"
#: The Slurm backend's: what it runs on the login node, the batch script, each node's step,
#: and what starts each rank inside its job step.
SLURM_LOGIN = "slurm_login.sh"
SLURM_BATCH = "slurm_batch.sh"
SLURM_NODE = "slurm_node.sh"
SLURM_STEP = "slurm_step.sh"


def script(name: str) -> str:
    """The text of the script ``name`` of this directory.

    Read through this module's loader, which is a zipimporter inside the agent's bundle and
    the file system elsewhere: ``importlib.resources`` would do the same at the cost of
    importing ``pathlib`` and ``zipfile`` on every run of the agent."""
    text = __loader__.get_data(  # type: ignore[name-defined]
        os.path.join(os.path.dirname(__file__), name)
    ).decode()
    return _without_header(text)


def _without_header(text: str) -> str:
    """The script less its opening comment block: that block explains the script to a reader
    of the file, and would otherwise travel on every rank's command line (2 KB per worker,
    in every ``ps`` listing of a node).  Only the header goes: a ``#`` further down may be
    inside a quoted string."""
    lines = text.splitlines(keepends=True)
    body = 0
    while body < len(lines) and (lines[body].startswith("#") or not lines[body].strip()):
        body += 1
    return "".join(lines[body:])
