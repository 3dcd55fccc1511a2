"""`sky`'s own command lines, run unchanged with ``sky() { pytest-sky "$@"; }``.

SkyPilot's smoke tests are lists of shell commands that grep ``sky``'s output and check its
exit codes; scripts and runbooks are written the same way.  Each test here is such a
sequence, in bash, against a real local cluster: the forms, the lines and the exit codes of
SkyPilot's CLI (``sky/client/cli/command.py``, ``sky/exceptions.py: JobExitCode``).

Out of scope (each needs what a test cluster is not): managed jobs (``sky jobs``), the API
server (``sky api``), several users (``-u`` is accepted and changes nothing), clouds and their
flags.  The job queue's counts are ``tests/test_job_queue.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.plugin_helpers import needs_local_backend

pytestmark = needs_local_backend

CLI = str(Path(sys.executable).with_name("pytest-sky"))

#: Every sequence runs under this: `sky` is pytest-sky, a failed check says which line.
PRELUDE = """\
set -u
sky() { "$CLI" "$@"; }
fail() { echo "FAILED: $*" >&2; exit 1; }
expect_rc() { [ "$1" -eq "$2" ] || fail "exit code $1, expected $2: $3"; }
"""


def run_sequence(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CLI": CLI, "PYTEST_SKY_HOME": str(tmp_path / "state"), "CI": "1", "C": _name()}
    body = PRELUDE + textwrap.dedent(script)
    try:
        return subprocess.run(
            ["bash", "-c", body], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=240, check=False
        )
    finally:
        subprocess.run([CLI, "down", "--all", "-y"], env=env, capture_output=True, timeout=120, check=False)


def _name() -> str:
    return f"skyf{os.getpid() % 10000}"


@pytest.mark.long(7)
def test_launch_exec_logs_exit_codes_as_sky(tmp_path: Path) -> None:
    res = run_sequence(
        tmp_path,
        """
        s=$(sky launch -y -c "$C" --num-nodes 2 "echo success-\\$SKYPILOT_NODE_RANK") || fail "launch: $s"
        echo "$s" | grep -A 1 "Launching on" | grep -q "is up." || fail "no 'Launching on' then 'is up.': $s"
        echo "$s" | grep -q "Job submitted, ID: 1" || fail "no submission line: $s"
        echo "$s" | grep -q "Job finished (status: SUCCEEDED)." || fail "no finish line: $s"
        sky logs "$C" 1 --status | grep -qx "Job 1: SUCCEEDED" || fail "logs --status of job 1"
        sky logs "$C" 1 | grep -q "success-1" || fail "logs of job 1"

        sky exec "$C" "exit 1" >/dev/null 2>&1
        expect_rc $? 100 "exec of a failing command"
        sky logs "$C" 2 --status | grep -q "Job 2: FAILED" || fail "logs --status of job 2"
        sky logs "$C" 2 >/dev/null
        expect_rc $? 100 "logs of a failed job"
        sky logs "$C" --status | grep -q "Job 2: FAILED" || fail "logs --status of the latest job"

        # Options between the cluster and the command, as sky takes them.
        sky exec "$C" -n sleeper -d "sleep 600" | grep -q "Job submitted, ID: 3" || fail "exec -n -d"
        sky logs "$C" 3 --status >/dev/null
        expect_rc $? 101 "logs --status of a running job"
        sky queue "$C" | grep sleeper | grep -q RUNNING || fail "the named job in the queue"
        sky cancel -y "$C" | grep -q "Cancelled job ID(s): 3" || fail "cancel of the latest running job"
        sky logs "$C" 3 --status >/dev/null
        expect_rc $? 103 "logs --status of a cancelled job"
        sky logs "$C" 99 --status >/dev/null 2>&1
        expect_rc $? 102 "logs --status of no such job"
        sky cancel -y "$C" 1 2 | grep -q "No jobs cancelled" || fail "cancel of ended jobs"

        # A setup that fails: sky's FAILED_SETUP, in every place it shows a status.
        printf 'setup: echo preparing; exit 3\nrun: echo never\n' > broken.yaml
        s=$(sky exec "$C" broken.yaml 2>/dev/null)
        expect_rc $? 100 "exec of a task whose setup fails"
        echo "$s" | grep -q "Job finished (status: FAILED_SETUP)." || fail "no FAILED_SETUP finish line: $s"
        sky logs "$C" 4 --status | grep -qx "Job 4: FAILED_SETUP" || fail "logs --status of job 4"
        sky queue "$C" | grep "^4 " | grep -q FAILED_SETUP || fail "FAILED_SETUP in the queue"

        sky status -r "$C" | grep "$C" | grep -q UP || fail "status -r NAME"
        sky down -y "$C" >/dev/null 2>&1 || fail "down -y"
        sky status | grep -q "No existing clusters." || fail "status after down"
        """,
    )
    assert res.returncode == 0, res.stderr + res.stdout


def test_task_files_node_counts_and_log_options_as_sky(tmp_path: Path) -> None:
    res = run_sequence(
        tmp_path,
        """
        sky launch -y -c "$C" --num-nodes 2 >/dev/null || fail "launch without a task"
        # A task file without a suffix (sky runs a temporary file so), on fewer nodes than the
        # cluster has: the first of them.
        printf 'num_nodes: 1\\nrun: |\\n  for i in 1 2 3 4 5; do echo line-$i; done\\n' > task
        s=$(sky launch -y -c "$C" task) || fail "a one-node task on a two-node cluster: $s"
        [ "$(echo "$s" | grep -c 'line-')" -eq 5 ] || fail "the task ran on one node only: $s"
        [ "$(sky logs "$C" 1 --no-follow --tail 2 | grep -c line-)" -eq 2 ] || fail "--tail 2"
        d=$(sky logs "$C" 1 --sync-down | grep "Job 1 logs:" | sed -E "s/^.*Job 1 logs: (.*)\\x1b\\[0m/\\1/g")
        [ -f "$d/run.log" ] && grep -q line-5 "$d/run.log" || fail "--sync-down to '$d'"
        sky logs --provision "$C" --no-follow | grep -q "$C is up: 2 node(s)" || fail "logs --provision"
        [ "$(sky logs "$C" --provision --tail 1 | wc -l)" -eq 1 ] || fail "logs --provision --tail 1"
        sky exec "$C" --async "sleep 600" | grep -q "Job submitted, ID: 2" || fail "exec --async"
        sky cancel -y "$C" -a | grep -q "Cancelled job ID(s): 2" || fail "cancel -a"
        # Relative paths in a task resolve from the current directory, as sky's do.
        mkdir -p tasks && echo from-the-cwd > marker && echo from-the-yaml-dir > tasks/marker
        printf 'workdir: .\nrun: cat marker\n' > tasks/cat.yaml
        sky exec "$C" tasks/cat.yaml | grep -q ") from-the-cwd" || fail "workdir: . is the current directory"
        # In a git work tree what .gitignore names stays behind, as on sky (a virtualenv would travel).
        mkdir -p repo/.venv && cd repo && git init -q && echo .venv/ > .gitignore && touch .venv/python kept
        printf 'workdir: .\nrun: ls -a\n' > t.yaml
        s=$(sky exec "$C" t.yaml) || fail "exec in a git work tree: $s"
        echo "$s" | grep -q ") kept$" || fail "an untracked file was left behind: $s"
        echo "$s" | grep -q ") .venv$" && fail "an ignored directory travelled: $s"
        cd ..
        # A 5.6 MB task file, as sky's smoke tests run: its scripts travel as files, not as arguments.
        pad() { yes "  # a long $1, as in the smoke tests sky runs on itself, padded to megabytes" | head -n 35000; }
        { printf 'num_nodes: 2\nsetup: |\n  echo setup-long\n'; pad setup
          printf 'run: |\n'; pad run; printf '  echo "end-$SKYPILOT_NODE_RANK"\n'; } > long.yaml
        s=$(sky exec "$C" long.yaml 2>&1) || fail "a long task: $s"
        [ "$(echo "$s" | grep -c -e ') setup-long$' -e ') end-[01]$')" -eq 4 ] || fail "a long task's output: $s"
        """,
    )
    assert res.returncode == 0, res.stderr + res.stdout


def test_a_command_task_is_sky_cmd_and_n_names_it(tmp_path: Path) -> None:
    res = run_sequence(
        tmp_path,
        """
        sky launch -y -c "$C" "echo one" | grep -q "(sky-cmd, pid=[0-9]*) one" || fail "a command's prefix"
        sky exec "$C" -n named "echo two" | grep -q "(named, pid=[0-9]*) two" || fail "-n in the prefix"
        sky queue "$C" | grep -q "sky-cmd" || fail "the default name in the queue"
        sky exec -c "$C" echo hi test | grep -q ") hi test" || fail "exec -c NAME words..."
        sky exec echo -c "$C" | grep -q "Job finished (status: SUCCEEDED)." || fail "exec CMD -c NAME"
        sky exec "$C" >/dev/null 2>&1 && fail "exec without a command must fail"
        true
        """,
    )
    assert res.returncode == 0, res.stderr + res.stdout


def test_stop_and_start_keep_the_disks_and_fail_the_running_job_as_sky(tmp_path: Path) -> None:
    res = run_sequence(
        tmp_path,
        """
        sky launch -y -c "$C" --num-nodes 2 'echo kept > ~/disk' >/dev/null || fail "launch"
        sky exec "$C" -d "sleep 600" | grep -q "Job submitted, ID: 2" || fail "a detached job"
        sky stop -y "$C" | grep -qx "Cluster $C stopped." || fail "stop"
        sky status "$C" | grep "$C" | grep -q STOPPED || fail "STOPPED in status"
        e=$(sky exec "$C" true 2>&1)
        expect_rc $? 2 "exec on a stopped cluster"
        [ "$e" = "pytest-sky: error: cluster $C is stopped: start it with \\`pytest-sky start $C\\`" ] || fail "$e"
        sky start -y "$C" | grep -qx "Cluster $C started." || fail "start"
        sky logs "$C" 2 --status | grep -qx "Job 2: FAILED_DRIVER" || fail "the job that ran is FAILED_DRIVER"
        expect_rc "${PIPESTATUS[0]}" 100 "logs --status of a FAILED_DRIVER job"
        [ "$(sky exec "$C" 'cat ~/disk' | grep -c ') kept')" -eq 2 ] || fail "every node's disk was kept"
        sky stop "$C" >/dev/null && sky launch -y -c "$C" "echo again" | grep -q ") again" || fail "launch starts it"
        """,
    )
    assert res.returncode == 0, res.stderr + res.stdout


def test_a_launch_prints_skys_transcript_and_a_failed_setup_names_its_workers(tmp_path: Path) -> None:
    """What SkyPilot's own smoke tests grep in ``sky launch``'s output (``VALIDATE_LAUNCH_OUTPUT``
    of ``smoke_tests_utils.py``, and ``test_launch_with_failing_setup``), line after line."""
    res = run_sequence(
        tmp_path,
        """
        printf 'name: min\nsetup: |\n  echo "running setup"\nrun: |\n  echo "task run finish"\n' > min.yaml
        s=$(sky launch -y -c "$C" --cpus 2+ --memory 4+ min.yaml) || fail "launch: $s"
        after() { echo "$s" | grep -A "$3" "$1" | grep -q "$2" || fail "no '$2' after '$1': $s"; }
        after "Launching on" "is up." 1
        after "Setup detached" "Job submitted" 1
        after "Job submitted, ID:" "Waiting for task resources on 1 node." 1
        echo "$s" | grep -A 1 "Job started. Streaming logs..." | grep "(setup pid=" | grep -q "running setup" \
          || fail "no setup line after 'Job started': $s"
        after "(setup" "(min, pid=" 1
        after "task run finish" "Job finished (status: SUCCEEDED)" 1
        after "Job finished (status: SUCCEEDED)" "Job ID:" 5
        after "Useful Commands" "Job ID: 1" 1
        sky logs "$C" 1 --no-follow | grep -q "(setup pid=[0-9]*) running setup" || fail "the log keeps sky's lines"

        # A 3-node setup whose rank 2 fails: sky's line, on stdout, naming the failed worker.
        printf 'num_nodes: 3\nsetup: |\n  echo preparing\n' > bad.yaml
        echo '  [ "$SKYPILOT_SETUP_NODE_RANK" -eq 2 ] && exit 7' >> bad.yaml
        echo '  sleep 60' >> bad.yaml
        echo 'run: echo never' >> bad.yaml
        s=$(sky launch -y -c "$C-3" bad.yaml 2>/dev/null)
        expect_rc $? 100 "launch of a task whose setup fails"
        echo "$s" | grep -q "See error logs above for more details." || fail "no 'See error logs above': $s"
        echo "$s" | grep -q "Job 1's setup failed. Failed workers: (pid=[0-9]*, returncode=7)." || fail "$s"
        echo "$s" | grep -q "(setup pid=[0-9]*, ip=198\\.1[89]\\.[0-9.]*) preparing" || fail "a worker's setup line: $s"

        # sky's other forms: the head's IP, a spot request, several jobs' logs, an unknown name.
        [ "$(sky status --ip "$C")" = "$(sky status --json | grep -o '"198\\.[0-9.]*"' | head -1 | tr -d '"')" ] \
          || fail "status --ip"
        sky launch -y -c "$C" --use-spot "true" >/dev/null 2>&1 || fail "launch --use-spot"
        sky logs "$C" 1 2 --sync-down | grep -c "logs: " | grep -qx 2 || fail "logs J1 J2 --sync-down"
        sky logs "$C" nothing-here ² --sync-down >/dev/null 2>&1 || fail "words that are no job id"
        s=$(sky cost-report --all) && echo $s | grep -q "$C" && echo $s | grep -q "Total Cost" || fail "cost-report"
        sky launch -y -c "$C" min.yaml | grep -A 1 "Launching on" | grep -q "is up." || fail "a relaunch says it is up"
        sky down -y "$C" no-such-cluster | grep -q "not found" || fail "down with an unknown name"
        sky status | grep -q "^$C " && fail "the known cluster went down"
        sky logs --provision "$C" --no-follow --tail 10 | grep -q "$C is up" || fail "the launch log, after down"
        true
        """,
    )
    assert res.returncode == 0, res.stderr + res.stdout
