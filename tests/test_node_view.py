"""What a local node sees of the host's files: the host's software, never its people's
(``netns.view``; DESIGN.md section 5, "What a node sees").

The end-to-end checks put canary credentials (``~/.ssh``, ``~/.kube``, ``~/.aws``,
``~/.config/gcloud``, ``~/.netrc``) in a home of the test's own, never the developer's: the
launching process's ``$HOME``, which also holds the virtualenv it runs from and the rootdir,
as a developer's ``~/src/project/.venv`` does.  Beside them, a second cluster's ControlMaster
socket and a listening fake ssh-agent socket under ``/tmp``.  From a node none of them can be
read, listed or connected to, while the interpreter, the virtualenv and the rootdir are
there (torch imports); with the rootdir the home itself (the worst case), the home shows and
its credentials still do not.  The real homes are looked at, never written: what a node
lists in ``/root`` and ``/home`` is only what a kept directory needs.  Root's run uses a
virtualenv under the home and root's pyenv interpreter under ``/root``; the rootless run
(``nobody``) an interpreter and site-packages under ``/tmp`` (``tests/unprivileged.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_sky.backends import netns
from pytest_sky.backends.netns import view
from pytest_sky.backends.nodeinit_protocol import ViewStep
from tests.leftovers import processes_mentioning
from tests.unprivileged import AS_NOBODY, REPO, run_python, world_dir

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("sshd") is None, reason="needs root (rootless runs as nobody) and OpenSSH sshd"
)

CANARY = "psky-canary-credential"
CREDENTIAL_FILES = (".ssh/id_ed25519", ".kube/config", ".aws/credentials", ".config/gcloud/credentials.db", ".netrc")

#: Run on a node (``python <rootdir>/probe.py HOME SOCKET...``): what it sees, one JSON line.
PROBE = r"""
import json, os, socket, sys
home, sockets = sys.argv[1], sys.argv[2:]
def look(path):
    try:
        with open(path) as f:
            return "read: " + f.read()
    except IsADirectoryError:
        return "listed: " + " ".join(sorted(os.listdir(path)))
    except OSError as e:
        return type(e).__name__
def connect(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
import torch
try:
    import psky_view_extra  # where a .pth file of the virtualenv points, when the test made one
    extra = psky_view_extra.__file__
except ImportError:
    extra = None
names = [".ssh", ".kube", ".aws", ".config/gcloud", ".netrc", ".ssh/id_ed25519", ".kube/config",
         ".aws/credentials", ".config/gcloud/credentials.db"]
print(json.dumps({
    "prefix": sys.prefix, "base": sys.base_prefix, "torch": torch.__version__, "extra": extra,
    "home": sorted(os.listdir(home)), "seen": {n: look(os.path.join(home, n)) for n in names},
    "sockets": {p: connect(p) for p in sockets}, "in /tmp": sorted(os.listdir("/tmp")),
    "in /root": sorted(os.listdir("/root")) if os.access("/root", os.R_OK) else "unreadable",
    "in /home": sorted(os.listdir("/home")),
}))
"""

#: Run by the launching process, with ``HOME`` the test's own: two clusters, the second's
#: master opened, each node probed; one JSON line.
LIFE = r"""
import glob, json, os, re, sys
from pathlib import Path
import pytest_sky
from pytest_sky import bootstrap
home = os.environ["HOME"]
out = {"prefix": sys.prefix, "base": sys.base_prefix}
a = pytest_sky.launch(num_nodes=2, name="view-a", backend_options={"rootdir": f"{home}/project"})
b = None
try:
    b = pytest_sky.launch(num_nodes=1, name="view-b", backend_options={"rootdir": home})
    bootstrap.start_master(Path(b.ssh_config), b.name)
    pattern = re.search(r"ControlPath (\S+)", Path(b.ssh_config).read_text()).group(1).replace("%C", "*")
    out["masters"] = glob.glob(pattern)
    sockets = [*out["masters"], os.environ["SSH_AUTH_SOCK"]]
    probe = " ".join([sys.executable, f"{home}/project/probe.py", home, *sockets])
    out["a"] = [json.loads(r.stdout) if r.stdout.strip() else r.stderr for r in a.run(probe).ranks]
    out["b"] = [json.loads(r.stdout) if r.stdout.strip() else r.stderr for r in b.run(probe).ranks]
finally:
    for c in (b, a):
        if c is not None:
            c.down()
print(json.dumps(out))
"""


class FakeAgent:
    """A listening unix socket where ssh-agent keeps one (``/tmp/ssh-XXXX/agent.<pid>``),
    which anyone may connect to: only the directory it lies in keeps a node out.  It answers
    as an agent holding no key (the host's own ssh may ask it), and counts who connected."""

    def __init__(self) -> None:
        self.dir = world_dir("ssh-")
        self.path = str(self.dir / f"agent.{os.getpid()}")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o777)
        self.sock.listen(8)
        self.peers: list[int] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                self.peers.append(pid)
                with contextlib.suppress(OSError):
                    while len(conn.recv(4096)) > 0:
                        conn.sendall(struct.pack(">IBI", 5, 12, 0))  # SSH2_AGENT_IDENTITIES_ANSWER: none

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    fake = FakeAgent()
    yield fake
    fake.close()


def canary_home(home: Path) -> None:
    """A home of the test's own: canary credentials, a note, the rootdir with the probe."""
    for rel in CREDENTIAL_FILES:
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{CANARY} {rel}\n")
        path.chmod(0o644)  # readable by anyone on the host: only the node's view keeps them out
    (home / "notes.txt").write_text("the user's own\n")
    (home / "project").mkdir()
    (home / "project" / "probe.py").write_text(PROBE)
    for path in [home, *home.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o755 if path.is_dir() else path.stat().st_mode | 0o644)


def check_life(out: dict, home: Path, agent: FakeAgent, torch_version: str) -> None:
    assert len(out["masters"]) == 1, out  # the second cluster's ControlMaster socket, under /tmp
    sockets = [*out["masters"], agent.path]
    for cluster in ("a", "b"):
        for rank, seen in enumerate(out[cluster]):
            where = f"cluster {cluster} rank {rank}: {seen}"
            assert isinstance(seen, dict), where
            # The interpreter and its environment are the launching process's, torch imports.
            assert (seen["prefix"], seen["base"], seen["torch"]) == (out["prefix"], out["base"], torch_version), where
            for name, what in seen["seen"].items():
                assert CANARY not in what, f"{name}: {where}"
                assert not what.startswith("read"), f"{name}: {where}"
            assert {s: seen["sockets"][s] for s in sockets} == dict.fromkeys(sockets, "FileNotFoundError"), where
            assert not {Path(s).parts[2] for s in sockets} & set(seen["in /tmp"]), where  # nor listed
            assert set(seen["in /home"]) <= {"sky", *kept_below("/home", out)}, where
            if seen["in /root"] != "unreadable":
                assert set(seen["in /root"]) <= set(kept_below("/root", out)), where
    # The rootdir inside the home: only what the node must have of it shows.
    assert all(seen["home"] == [".venv", "project"] or seen["home"] == ["project"] for seen in out["a"]), out["a"]
    # The rootdir the home itself (the worst case): the home shows, its credentials do not.
    for seen in out["b"]:
        assert "notes.txt" in seen["home"] and ".netrc" not in seen["home"], seen
        assert all(seen["seen"][d] in ("listed: ", "FileNotFoundError") for d in (".ssh", ".kube", ".aws")), seen


def kept_below(top: str, out: dict) -> list[str]:
    """The entries of ``top`` a node shows because a kept directory lies there."""
    return [Path(p).relative_to(top).parts[0] for p in (out["prefix"], out["base"]) if Path(p).is_relative_to(top)]


def test_a_node_sees_no_credentials_nor_sockets_yet_the_interpreter_venv_and_rootdir(
    tmp_path: Path, agent: FakeAgent
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    canary_home(home)
    # The virtualenv pytest runs in lives in the home: one of the test's own, over this one's
    # packages (a .pth file), made by the base interpreter (root's pyenv build, under /root).
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(home / ".venv")], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(home / ".venv")}))
    ours = sysconfig.get_path("purelib")
    # And a directory of packages under /tmp that only a .pth file names, as an editable
    # install's source tree: the node reads the same .pth and must find it, wherever the
    # repository lives.
    extra = tmp_path / "extra-site"
    extra.mkdir()
    (extra / "psky_view_extra.py").write_text("")
    (site / "psky-test.pth").write_text(f"{REPO}\n{extra}\nimport site; site.addsitedir({ours!r})\n")
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
        "HOME": str(home),
        "PYTEST_SKY_HOME": str(tmp_path / "state"),
        "SSH_AUTH_SOCK": agent.path,
    }
    proc = subprocess.run(
        [str(home / ".venv" / "bin" / "python"), "-c", LIFE],
        capture_output=True,
        text=True,
        env=env,
        cwd=home,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prefix"] == str(home / ".venv") and out["base"] == sys.base_prefix
    check_life(out, home, agent, __import__("torch").__version__)
    assert {seen["extra"] for seen in out["a"] + out["b"]} == {str(extra / "psky_view_extra.py")}
    assert not processes_mentioning(str(tmp_path / "state"))
    assert (home / ".ssh" / "id_ed25519").read_text().startswith(CANARY)  # the host's untouched


def test_a_rootless_node_sees_no_credentials_nor_sockets_either(agent: FakeAgent) -> None:
    """As ``nobody``: the interpreter and site-packages pytest runs from are under /tmp
    (``tests/unprivileged.py`` binds them there), the home a world-readable one of the test's."""
    top = world_dir("psky-view-")
    try:
        home = top / "home"
        home.mkdir()
        canary_home(home)
        state = top / "state"
        state.mkdir(mode=0o777)
        state.chmod(0o777)
        env = {"HOME": str(home), "PYTEST_SKY_HOME": str(state), "SSH_AUTH_SOCK": agent.path}
        proc = run_python(AS_NOBODY, LIFE, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["base"].startswith("/tmp/")  # the interpreter lives under /tmp
        check_life(out, home, agent, __import__("torch").__version__)
        assert not processes_mentioning(str(state))
    finally:
        shutil.rmtree(top, ignore_errors=True)


# -- the view's steps, without a cluster ----------------------------------------------------


def test_homes_and_scratch_directories_are_emptied_and_what_a_node_needs_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A home wherever it is (``$HOME``: a CI user's ``/var/lib/jenkins``, here one of the
    test's), ``/root``, ``/home``, ``/tmp`` and ``/var/tmp`` are emptied; a kept directory
    inside one is the host's again; one outside them all needs no step."""
    home = tmp_path / "srv" / "alice"
    (home / ".ssh").mkdir(parents=True)
    (home / "src" / "proj" / ".venv").mkdir(parents=True)
    (home / ".netrc").write_text("")
    monkeypatch.setenv("HOME", str(home))
    steps = view.node_view([home / "src" / "proj" / ".venv", home / "src" / "proj", REPO, "/usr"])
    emptied = [p for s, p in steps if s is ViewStep.EMPTY]
    for path in ("/root", "/home", "/tmp", "/var/tmp"):
        assert path in emptied, steps
    assert str(tmp_path) not in emptied and not any(e.startswith(str(home) + "/") for e in emptied), steps
    kept = [p for s, p in steps if s is ViewStep.KEEP]
    expected = [str(home / "src" / "proj"), *([str(REPO)] if REPO.is_relative_to("/tmp") else [])]
    assert sorted(kept) == sorted(expected), steps

    # The rootdir the home itself: the home is kept, and its credentials emptied after.
    steps = view.node_view([home])
    assert steps.index((ViewStep.KEEP, str(home))) < steps.index((ViewStep.EMPTY, str(home / ".ssh")))
    assert (ViewStep.EMPTY, str(home / ".netrc")) in steps


def test_a_node_keeps_what_the_import_path_names_but_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a ``.pth`` file put on the launching interpreter's import path (an editable
    install's source) is kept; the directory pytest was started from, which ``python -m``
    puts first, is not: started from a home, the whole home would show."""
    from pytest_sky.backends.local import LocalBackend

    source, started_in = tmp_path / "src", tmp_path / "home"
    source.mkdir()
    started_in.mkdir()
    monkeypatch.chdir(started_in)
    monkeypatch.syspath_prepend(str(started_in))
    monkeypatch.syspath_prepend(str(source))
    seen = LocalBackend(rootdir=str(REPO))._seen()
    assert str(source) in seen and str(started_in) not in seen


def test_a_system_accounts_home_is_never_emptied(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's "home" is ``/bin``, ``/usr/sbin`` or ``/``: emptying it would empty the
    system; only a home two levels down or more is a person's."""
    monkeypatch.setenv("HOME", "/usr/sbin")
    steps = netns.node_view([])
    assert not any(p in ("/", "/bin", "/usr", "/usr/sbin", "/var") for _, p in steps), steps
