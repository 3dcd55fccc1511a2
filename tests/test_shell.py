"""The project's bash: clean under ``shellcheck``, and in agreement with the Python around it.

Every ``.sh`` file in the repository, and the two bash scripts without the suffix
(``scripts/flake-check``, ``.ci/run``), must pass ``shellcheck`` with nothing to report: a
finding is either fixed or silenced in the script with a directive that says why.

The scripts under ``pytest_sky/shell`` share names with Python (the pid line a rank
supervisor prints, the token and cgroup that mark a job's processes, what the leftover check
looks for).  They spell those names literally, so that each reads and runs on its own and
``shellcheck`` sees it whole, rather than taking them as arguments: every argument would add
an indirection for a reader and travel in every rank's command line.  The price is that a
rename on one side must reach the other, which is what this module checks: each script
spells exactly the markers it is listed with here, each as ``pytest_sky.shell`` names it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pytest_sky import shell

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "pytest_sky" / "shell"
#: Bash scripts whose names do not end in ``.sh``.
UNSUFFIXED = ("scripts/flake-check", "scripts/with-slurm-testbed", ".ci/run")
#: Directories never searched for scripts: virtualenvs, caches, build output, git's own.
SKIPPED_DIRS = {"node_modules", "build", "dist", "__pycache__"}


def shell_files() -> list[Path]:
    """Every ``.sh`` file of the repository, then the unsuffixed bash scripts."""
    found = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        found += [Path(top) / f for f in files if f.endswith(".sh")]
    return sorted(found) + [REPO / p for p in UNSUFFIXED]


def test_shellcheck_finds_nothing() -> None:
    checker = shutil.which("shellcheck")
    if checker is None:
        pytest.skip("shellcheck is not installed (scripts/setup.sh installs it): the shell scripts went unchecked")
    files = shell_files()
    assert SCRIPTS / shell.RANK_SUPERVISOR in files and REPO / ".ci/run" in files
    done = subprocess.run(
        [checker, *(str(f.relative_to(REPO)) for f in files)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"shellcheck found problems:\n{done.stdout}{done.stderr}"


# ----------------------------------------------------------------------------- shared names

#: What a marker looks like in a script: ``psky-...`` and ``PSKY_...`` words, a ``.pyz`` name.
MARKER_LIKE = re.compile(r"psky[\w-]*|PSKY[\w-]*|[\w.-]+\.pyz")

#: The markers each script spells, by its name in ``pytest_sky.shell``.
SPELLED = {
    shell.RANK_SUPERVISOR: {
        shell.PID_MARK,
        shell.STDERR_WORD,
        shell.JOB_SCOPE_VAR,
        shell.JOB_SCOPE_PREFIX,
        shell.CGROUP_PREFIX,  # its own $0 is RANK_ARGV0, given by the agent's command line
        shell.PROGRAM_VAR,
    },
    shell.LEFTOVER_CHECK: {
        shell.JOB_SCOPE_VAR,
        shell.RUN_AGENT_VAR,
        shell.CGROUP_PREFIX,
        shell.RANK_ARGV0,
        shell.AGENT_BUNDLE,
    },
    shell.POD_BOOTSTRAP: {shell.POD_RANK_VAR, shell.AGENT_BUNDLE},
    shell.PROBE_NODES: set(),
    shell.SYNC_FILES: set(),
    shell.SLURM_LOGIN: set(),
    shell.SLURM_BATCH: set(),
    shell.SLURM_NODE: set(),
    shell.SLURM_STEP: set(),
}


def markers_in(text: str) -> set[str]:
    return set(MARKER_LIKE.findall(text))


def test_every_packaged_script_is_listed() -> None:
    assert sorted(p.name for p in SCRIPTS.glob("*.sh")) == sorted(SPELLED)


@pytest.mark.parametrize("name", sorted(SPELLED))
def test_a_script_spells_its_markers_as_python_names_them(name: str) -> None:
    found = markers_in(shell.script(name))
    unknown = found - set(shell.MARKERS)
    assert not unknown, f"{name} spells markers that pytest_sky.shell does not name: {sorted(unknown)}"
    assert found == SPELLED[name]


def test_the_rank_supervisor_runs_its_program_as_the_agent_server_does() -> None:
    """Both start a rank's bash with the same words: the program from the environment."""
    assert shell.RUN_PROGRAM in shell.script(shell.RANK_SUPERVISOR)


def test_the_checker_sees_a_misspelt_marker() -> None:
    assert markers_in('mkdir "$r/psky-jobs-$$"; echo "PSKY-PID $$"; case $a in *agent.pyz) ;; esac') == {
        "psky-jobs-",
        "PSKY-PID",
        "agent.pyz",
    }
    assert "psky-jobs-" not in shell.MARKERS
