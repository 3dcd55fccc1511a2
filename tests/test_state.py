"""Cluster records: typed fields on disk, and records written by older versions still load."""

from __future__ import annotations

import json
from pathlib import Path

from pytest_sky.resources import Resources
from pytest_sky.state import ClusterRecord, ClusterResources, ClusterStatus


def test_a_record_round_trips_with_typed_resources_and_status() -> None:
    record = ClusterRecord(
        name="c1",
        backend="local",
        num_nodes=2,
        owner_pid=1,
        owner_start_time=None,
        status=ClusterStatus.UP,
        resources=ClusterResources.of(Resources.from_kwargs(gpus="V100:1", cpus="2")),
    )
    on_disk = json.loads(record.to_json())
    assert on_disk["status"] == "UP"
    assert on_disk["resources"]["accelerators"] == "V100:1"
    again = ClusterRecord.from_json(record.to_json())
    assert again == record
    assert again.status is ClusterStatus.UP and again.resources.gpus_per_node == 1


def test_an_older_record_loads_and_unknown_keys_are_ignored() -> None:
    text = json.dumps(
        {
            "name": "old",
            "backend": "kubernetes",
            "num_nodes": 1,
            "owner_pid": 5,
            "owner_start_time": 7,
            "status": "PROVISIONING",
            "resources": {"accelerators": None, "gpus_per_node": 0, "retired_key": 1},
            "a_field_from_the_future": True,
        }
    )
    record = ClusterRecord.from_json(text)
    assert record.status is ClusterStatus.PROVISIONING
    assert record.resources == ClusterResources()
    assert f"{record.status}" == "PROVISIONING"


def test_a_process_files_go_when_it_exits_and_a_killed_ones_are_reaped(tmp_path: Path) -> None:
    """The kubernetes client writes a kubeconfig's inline certificates and keys to files;
    under ``/tmp`` a killed process left them for good.  Here they are its own directory,
    gone at a normal exit and reaped once its process is killed."""
    import signal
    import subprocess
    import sys

    from pytest_sky.lifecycle import reap
    from pytest_sky.state import PROCESS_FILES, StateStore

    root = tmp_path / "state"
    script = (
        "import sys, pathlib\n"
        "from pytest_sky.state import process_files\n"
        f"d = process_files(pathlib.Path({str(root)!r}))\n"
        "(d / 'ca.pem').write_text('x')\n"
        "print(d, flush=True)\n"
        "if sys.argv[1] == 'wait': sys.stdin.read()\n"
    )
    done = subprocess.run([sys.executable, "-c", script, "exit"], capture_output=True, text=True, check=True)
    assert not Path(done.stdout.strip()).exists()  # gone at exit
    killed = subprocess.Popen(
        [sys.executable, "-c", script, "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    left = Path(killed.stdout.readline().strip())
    assert (left / "ca.pem").exists() and left.parent == root / PROCESS_FILES
    assert left not in StateStore(root).stale_trash()  # its owner lives
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert left in StateStore(root).stale_trash()  # what `pytest-sky doctor` reports
    reap(StateStore(root))
    assert not left.exists()


def test_the_state_lock_excludes_other_threads_and_lets_its_holder_in_again(tmp_path: Path) -> None:
    """Reentrant for the thread that holds it (a locked step may call another), exclusive for
    every other thread and process."""
    import threading

    from pytest_sky.locks import ReentrantFlock

    lock = ReentrantFlock(tmp_path / "state.lock")
    entered = threading.Event()

    def other() -> None:
        with lock:
            entered.set()

    with lock:
        with lock:  # the holder again: no deadlock
            thread = threading.Thread(target=other)
            thread.start()
            assert not entered.wait(0.3), "another thread got in while the lock was held"
        assert not entered.is_set(), "released by the inner exit"
    assert entered.wait(10), "the other thread never got the lock once it was free"
    thread.join()
