"""Cluster records on disk: who owns which cluster, so a later run can reap what a killed one left.

One directory per cluster under ``$PYTEST_SKY_HOME/clusters/<name>/`` holds ``record.json``
(who owns the cluster and, once it is up, its :class:`~pytest_sky.cluster_info.ClusterInfo`),
the backend's journal (``backend.json``: what it made, written before it makes it) and the
cluster's key material and SSH config.  Writers hold a lock on the state directory
(:class:`~pytest_sky.locks.ReentrantFlock`): pytest-xdist workers, the CLI and a reaping run may all touch records
at once.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pytest_sky import procs
from pytest_sky.cluster_info import ClusterInfo
from pytest_sky.locks import ReentrantFlock
from pytest_sky.resources import Resources
from pytest_sky.settings import state_home


def home() -> Path:
    root = state_home()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return root


class ClusterStatus(str, enum.Enum):
    """A cluster's life on disk: PROVISIONING from its claim until its nodes answer, then UP;
    STOPPED between ``stop`` and ``start``.

    A ``str`` enum so that the record's JSON stays the word and status tables print it as is.
    """

    PROVISIONING = "PROVISIONING"
    UP = "UP"
    STOPPED = "STOPPED"  # its nodes powered off, their disks kept (``pytest-sky stop``)

    def __str__(self) -> str:
        return self.value

    @property
    def sky_word(self) -> str:
        """What ``sky status`` shows for it (SkyPilot says INIT until a cluster is up)."""
        return "INIT" if self is ClusterStatus.PROVISIONING else self.value


@dataclass(frozen=True)
class ClusterResources:
    """What a cluster was launched with, as later launches, tasks and ``status`` compare it.

    ``accelerators`` is the canonical text of the request (``V100:1``), so two requests
    for the same thing compare equal however they were written.
    """

    cpus: float | None = None
    memory: float | None = None
    accelerators: str | None = None
    gpus_per_node: int = 0

    @classmethod
    def of(cls, resources: Resources) -> ClusterResources:
        accel = resources.accelerators
        return cls(resources.cpus, resources.memory, str(accel) if accel else None, resources.gpus_per_node)

    @classmethod
    def from_dict(cls, data: dict | None) -> ClusterResources:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in (data or {}).items() if k in known})


@dataclass
class ClusterRecord:
    name: str
    backend: str
    num_nodes: int
    owner_pid: int
    owner_start_time: int | None
    created: float = field(default_factory=time.time)
    keep: bool = False  # --keep-clusters / CLI: never reaped when the owner exits
    status: ClusterStatus = ClusterStatus.PROVISIONING
    resources: ClusterResources = field(default_factory=ClusterResources)
    resources_label: str = ""
    info: ClusterInfo | None = None  # what provisioning returned; None while PROVISIONING

    @property
    def node_ips(self) -> list[str]:
        return self.info.ips if self.info is not None else []

    def owner_alive(self) -> bool:
        return procs.is_alive(self.owner_pid, self.owner_start_time)

    @property
    def orphaned(self) -> bool:
        """Its owner is gone and it was not kept on purpose: nobody but a reaper will tear it
        down (a killed pytest run's, a crashed xdist worker's)."""
        return not self.keep and not self.owner_alive()

    @property
    def node_names(self) -> list[str]:
        return self.info.hostnames if self.info is not None else []

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterRecord:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> ClusterRecord:
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in data.items() if k in known}
        if fields.get("info") is not None:
            fields["info"] = ClusterInfo.from_dict(fields["info"])
        fields["resources"] = ClusterResources.from_dict(fields.get("resources"))
        fields["status"] = ClusterStatus(fields.get("status", ClusterStatus.PROVISIONING))
        return cls(**fields)


#: In a cluster's directory: its :class:`ClusterRecord`.
RECORD = "record.json"


def read_record(cluster_dir: Path, *, without_info: bool = False) -> ClusterRecord | None:
    """The record in ``cluster_dir``; None when there is none, or it is unreadable.
    ``without_info``: all but what the launch found (``info``), which is all a reaper needs
    to judge the cluster, and reads a record another version of pytest-sky wrote (whose
    nodes this one may not read) as well."""
    try:
        data = json.loads((cluster_dir / RECORD).read_text())
        return ClusterRecord.from_dict({**data, "info": None} if without_info else data)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


class Journal:
    """A backend's own record of what it made, kept beside the cluster's record.

    Written before each step that creates something (intent before action), so that from it
    alone ``destroy`` removes a cluster whose launch was killed half-way, in a later process.
    Its content is the backend's private business: only the backend that writes it reads it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: dict | None = None  # what this object last wrote: no re-read per step

    @property
    def cluster_dir(self) -> Path:
        return self.path.parent

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def update(self, **fields: object) -> dict:
        """Merge ``fields`` into the journal and make it durable before returning."""
        data = {**(self._written if self._written is not None else self.load()), **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
        self._written = data
        return data


class StateStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or home()
        (self.root / "clusters").mkdir(parents=True, exist_ok=True, mode=0o700)
        mark_top_directory(self.root / "clusters")
        self._lock = ReentrantFlock(self.root / "state.lock")

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._lock:
            yield

    def cluster_dir(self, name: str) -> Path:
        return self.root / "clusters" / name

    def journal(self, name: str) -> Journal:
        return Journal(self.cluster_dir(name) / "backend.json")

    def save(self, record: ClusterRecord) -> None:
        d = self.cluster_dir(record.name)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = d / (RECORD + ".tmp")
        tmp.write_text(record.to_json())
        os.replace(tmp, d / RECORD)

    def load(self, name: str) -> ClusterRecord | None:
        return read_record(self.cluster_dir(name))

    def records(self) -> list[ClusterRecord]:
        out = []
        for d in sorted((self.root / "clusters").iterdir()):
            rec = self.load(d.name)
            if rec is not None:
                out.append(rec)
        return out

    def claim(self, record: ClusterRecord) -> bool:
        """Create the record unless the name is taken; False if another cluster has it."""
        with self.locked():
            if (self.cluster_dir(record.name) / RECORD).exists():
                return False
            self.save(record)
            return True

    def forget(self, name: str) -> None:
        """The cluster's record and files leave its name at once: one rename into ``trash/``
        (its name is free for the next launch, and no reader lists it); the files are then
        deleted on a thread of this process's own, which teardown does not wait for and
        this process does before it exits (:func:`drain_removals`).  Deleting a cluster's
        few hundred files takes 2-5 ms each on a loaded disk here: 0.2 s of a 16-node
        teardown's 0.3 s.  A process killed before its thread finished leaves entries that
        the next process's thread removes (they are named after their owner's pid)."""
        d = self.cluster_dir(name)
        trash = self.root / TRASH
        trash.mkdir(mode=0o700, exist_ok=True)
        dest = trash / f"{_OWNER}-{next(_SEQUENCE)}"
        try:
            os.rename(d, dest)
        except FileNotFoundError:
            return
        except OSError:  # not renameable (a foreign mount inside?): deleted where it is
            remove_tree(d)
            return
        _REMOVER.add(dest)

    def keep_history(self, name: str, filename: str) -> None:
        """Keep one file of a kept cluster (the CLI's) past its teardown, as sky's cluster
        history keeps its launch log: ``logs --provision NAME`` still answers after ``down``.
        A rename, so teardown pays nothing; the newest :data:`HISTORY_KEPT` clusters' stay."""
        history = self.root / HISTORY
        try:
            (history / name).mkdir(mode=0o700, parents=True, exist_ok=True)
            os.replace(self.cluster_dir(name) / filename, history / name / filename)
            entries = sorted(history.iterdir(), key=lambda p: p.stat().st_mtime)
        except OSError:
            return  # nothing to keep (a launch that never wrote it), or no room: history is a courtesy
        for old in entries[:-HISTORY_KEPT]:
            shutil.rmtree(old, ignore_errors=True)

    def history_file(self, name: str, filename: str) -> Path:
        """Where :meth:`keep_history` kept ``filename`` of a torn-down cluster ``name``."""
        return self.root / HISTORY / name / filename

    def stale_trash(self) -> list[Path]:
        """Files of torn-down clusters that no live process is still deleting, and the files
        of processes that died before they could delete their own (:func:`process_files`)."""
        return stale_trash(self.root / TRASH) + stale_trash(self.root / PROCESS_FILES)


#: ``FS_IOC_GETFLAGS`` / ``FS_IOC_SETFLAGS`` and ``FS_TOPDIR_FL`` (linux/fs.h): chattr's ``T``.
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_TOPDIR_FL = 0x80086601, 0x40086602, 0x00020000


def mark_top_directory(path: Path) -> None:
    """Ask ext4 to place each cluster directory made under ``path`` in a block group of its
    own (chattr +T: "the top of directory hierarchies" for its Orlov allocator).

    Why: a cluster is a tree of a few thousand files made and deleted as a unit, and ext4
    without a journal skips every inode deleted in the last ~30 s when it allocates one.
    With every cluster in the same group, a launch right after a teardown paid a scan past
    the last cluster's inodes for each of its own: 64 nodes took 1.45 s to be ready instead
    of 1.0 s.  Elsewhere (another filesystem, no such flag) this does nothing."""
    import array
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        if not flags[0] & _FS_TOPDIR_FL:
            flags[0] |= _FS_TOPDIR_FL
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)
    except OSError:
        pass  # not ext2/3/4, or not ours to change: only a placement hint is lost
    finally:
        os.close(fd)


def stale_trash(trash: Path) -> list[Path]:
    """Entries of ``trash`` whose owner (``<pid>.<start time>`` begins their name) is gone."""
    try:
        entries = sorted(trash.iterdir())
    except OSError:
        return []
    return [p for p in entries if not _owner_alive(p.name.split("-")[0])]


def _owner_alive(owner: str) -> bool:
    pid, _, start = owner.partition(".")
    if not pid.isdigit():
        return False
    return procs.is_alive(int(pid), int(start) if start.isdigit() else None)


#: Where torn-down clusters' directories wait for deletion (see :meth:`StateStore.forget`).
TRASH = "trash"
#: Files a process keeps for its own use while it runs (see :func:`process_files`).
PROCESS_FILES = "process-files"
HISTORY = "history"
HISTORY_KEPT = 100
_SEQUENCE = itertools.count()
_OWNER = f"{os.getpid()}.{procs.start_time(os.getpid())}"


class _Remover:
    """Deletes directories on a thread of its own, one after another.

    Not a daemon thread: the interpreter waits for it before it exits, so a process's
    torn-down clusters leave no files behind once it ends.  ``seconds`` is the time spent
    deleting, so the benchmark can say what teardown no longer waits for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Path] = []
        self._thread: threading.Thread | None = None
        self.seconds = 0.0
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        global _OWNER
        _OWNER = f"{os.getpid()}.{procs.start_time(os.getpid())}"
        self._lock = threading.Lock()
        self._pending, self._thread = [], None  # the parent deletes its own

    def add(self, path: Path) -> None:
        with self._lock:
            self._pending.append(path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(path.parent,), name="pytest-sky-remove")
                self._thread.start()

    def _run(self, trash: Path) -> None:
        for stale in stale_trash(trash):
            remove_tree(stale)
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                path = self._pending.pop(0)
            started = time.perf_counter()
            remove_tree(path)
            self.seconds += time.perf_counter() - started

    def drain(self) -> None:
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()


_REMOVER = _Remover()


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything in it, as far as this process may.

    A rootless node's overlay leaves its work directory at mode 000 (the kernel makes it so),
    which its owner may delete but not look into: where the first pass leaves something,
    every directory is made the owner's to read and search, and the second pass takes it."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(dirpath, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


def drain_removals() -> float:
    """Wait until every cluster directory this process tore down is deleted; returns the
    seconds spent deleting so far (in the background: no teardown waited for them)."""
    _REMOVER.drain()
    return _REMOVER.seconds


def process_files(root: Path | None = None) -> Path:
    """A directory of this process's own under the state directory, deleted when it exits.

    For files a library must have on disk for as long as the process runs: the kubernetes
    client writes a kubeconfig's inline CA, client certificate and key to files (``ssl``
    reads only files) and deletes them at exit.  Under ``/tmp`` a killed process left them
    there for good, fifty in one test suite run; here the directory is named after its owner
    (``<pid>.<start time>``), so a reaper takes it once that process is gone.

    One per process, under the state directory of its first call: the client remembers the
    files it wrote by their content for the life of the process, whatever state directory
    is current later (the tests change it from test to test)."""
    pid = os.getpid()
    path = _PROCESS_FILES.get(pid)
    if path is None:
        path = (root or home()) / PROCESS_FILES / f"{pid}.{procs.start_time(pid)}"
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        _PROCESS_FILES[pid] = path
        atexit.register(shutil.rmtree, path, True)
    return path


_PROCESS_FILES: dict[int, Path] = {}
