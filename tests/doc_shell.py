"""Running the docs' shell blocks and CI steps as a reader would: in fresh directories, with a
shell of their own, leaving nothing up (the runner under tests/doc_examples.py)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The longest a step may take: a wheel build and a fresh virtualenv's install are the slowest
#: (tens of seconds on two busy cores); beyond this it hangs, and the test says so.
STEP_TIMEOUT_S = 900.0
#: How much of a failing step's output the failure shows.
TAIL_LINES = 40
#: What never reaches a block from this suite's own process: xdist's worker identity and
#: pytest's current test (a reader's shell has neither).
NOT_PASSED_ON = ("PYTEST_XDIST_", "PYTEST_CURRENT_TEST", "VIRTUAL_ENV")


class ExampleFailed(Exception):
    """A step exited non-zero, hung, or left a cluster up: the message is the whole report."""


@dataclass(frozen=True)
class WriteFile:
    name: str
    text: str


@dataclass(frozen=True)
class CopyFile:
    name: str
    source: Path


@dataclass(frozen=True)
class Step:
    where: str  # "README.md:42", or "docs/ci.md:30, step 'Install'"
    script: str
    in_clone: bool = False
    env: dict[str, str] = field(default_factory=dict)


Action = WriteFile | CopyFile | Step


@dataclass(frozen=True)
class Sandbox:
    """One example's directories: the reader's project, their clone of this repository beside
    it (as ``../pytest-sky``), a home and a pytest-sky state directory of its own."""

    base: Path

    @property
    def project(self) -> Path:
        return self.base / "project"

    @property
    def clone(self) -> Path:
        return self.base / "pytest-sky"

    @property
    def home(self) -> Path:
        return self.base / "home"

    @property
    def sky_home(self) -> Path:
        return self.base / "sky-home"

    def make(self) -> Sandbox:
        for d in (self.project, self.home, self.sky_home):
            d.mkdir(parents=True, exist_ok=True)
        return self


def copy_repository(dest: Path) -> Path:
    """This repository's files as a fresh clone has them (tracked and new, not ignored; no
    virtualenv, caches or builds), copied to ``dest``."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def build_wheel(dest: Path, workdir: Path) -> Path:
    """pytest-sky's wheel, built from a fresh copy of this repository, in ``dest`` (with this
    suite's setuptools: no build environment to make, 4.7 -> 1.8 CPU-seconds)."""
    source = copy_repository(workdir / "pytest-sky")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip_wheel, "--wheel-dir", str(dest), str(source)],
        check=True,
        capture_output=True,
        timeout=STEP_TIMEOUT_S,
    )
    (wheel,) = dest.glob("pytest_sky-*.whl")
    return wheel


def environment(box: Sandbox) -> dict[str, str]:
    """A reader's shell: this suite's interpreter first on PATH (an activated virtualenv), and a
    home and state directory of the example's own, so nothing of this machine's user is touched.
    pip keeps its cache where it was (a download cache, not a setting), and does not byte-compile
    what it installs (Python compiles a module when it first imports one): compiling the 4000
    modules of a fresh install was half of its CPU (17 -> 9 CPU-seconds), and a fresh
    virtualenv's install is what the docs' costliest examples do.  ``PIP_NO_COMPILE`` is
    inverted, as pip's environment twins of ``--no-*`` switches are: 0 means ``--no-compile``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(NOT_PASSED_ON)}
    env["PIP_CACHE_DIR"] = env.get("PIP_CACHE_DIR") or str(
        Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip"
    )
    env["PIP_NO_COMPILE"] = "0"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["HOME"] = str(box.home)
    env["PYTEST_SKY_HOME"] = str(box.sky_home)
    return env


def run(actions: Iterable[Action], box: Sandbox) -> str:
    """Each action in turn; returns the steps' output.  A step that fails stops the rest."""
    env = environment(box.make())
    copy_repository(box.clone)
    log: list[str] = []
    try:
        for number, action in enumerate(actions):
            if isinstance(action, (WriteFile, CopyFile)):
                target = box.project / action.name
                target.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(action, WriteFile):
                    target.write_text(action.text)
                else:
                    shutil.copy2(action.source, target)
                continue
            log.append(_step(action, number, box, {**env, **action.env}))
    finally:
        left = _clusters_left(box, env)
    if left:
        raise ExampleFailed(f"the example left clusters up ({', '.join(left)}): a reader's would stay up too")
    return "".join(log)


def _step(step: Step, number: int, box: Sandbox, env: dict[str, str]) -> str:
    script = box.base / f"step-{number}.sh"
    script.write_text(step.script)
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", str(script)],
        cwd=box.clone if step.in_clone else box.project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group: a timeout stops everything it started
    )
    try:
        out, _ = proc.communicate(timeout=STEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise ExampleFailed(f"{step.where} did not finish in {STEP_TIMEOUT_S:.0f} s:\n{_tail(out)}") from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise ExampleFailed(f"{step.where} exited {proc.returncode}:\n{_tail(out)}")
    return out


def _tail(out: str) -> str:
    lines = out.splitlines()
    shown = lines[-TAIL_LINES:]
    return "\n".join(([f"... ({len(lines) - len(shown)} lines before)"] if len(lines) > len(shown) else []) + shown)


def _clusters_left(box: Sandbox, env: dict[str, str]) -> list[str]:
    """Clusters the example left in its state directory, torn down here whatever happened."""
    left = sorted(p.parent.name for p in (box.sky_home / "clusters").glob("*/record.json"))
    if left:
        subprocess.run(
            [sys.executable, "-m", "pytest_sky.cli", "down", "--all", "--purge"],
            env=env,
            capture_output=True,
            timeout=STEP_TIMEOUT_S,
        )
    return left


# ----------------------------------------------------------------------------- CI configurations


def is_apt_install(command: str) -> bool:
    """A step that installs Debian packages: its first command is ``[sudo] apt-get``/``apt``."""
    first = next((line for line in command.splitlines() if line.strip()), "")
    words = shlex.split(first, comments=True)
    if words[:1] == ["sudo"]:
        words = words[1:]
    return words[:1] in (["apt-get"], ["apt"])


@dataclass(frozen=True)
class CiCommand:
    label: str
    script: str
    env: dict[str, str]
    shell: str  # the commands of one shell session (a GitHub step; a GitLab job's script part) share it


def github_commands(doc: dict) -> list[CiCommand]:
    """Every ``run`` step of every job, in order, with the workflow's, job's and step's ``env``
    (``uses`` steps are the CI system's own: checkout, upload)."""
    found = []
    for job_name, job in doc["jobs"].items():
        for step in job.get("steps", []):
            if "run" in step:
                env = {**doc.get("env", {}), **job.get("env", {}), **step.get("env", {})}
                label = f"job {job_name}, step {step.get('name') or step['run'].splitlines()[0]!r}"
                found.append(CiCommand(label, step["run"], {k: str(v) for k, v in env.items()}, shell=label))
    return found


#: Top-level keys of a .gitlab-ci.yml that are not jobs.
GITLAB_KEYWORDS = frozenset(
    {
        "default",
        "include",
        "stages",
        "variables",
        "workflow",
        "image",
        "services",
        "cache",
        "before_script",
        "after_script",
    }
)


def gitlab_commands(doc: dict) -> list[CiCommand]:
    """Every job's ``before_script``, ``script`` and ``after_script`` lines, in order, with the
    pipeline's and job's ``variables``; GitLab runs a job's ``before_script`` and ``script`` in
    one shell, its ``after_script`` in another."""
    default = doc.get("default", {})
    found = []
    for name, job in doc.items():
        if name in GITLAB_KEYWORDS or name.startswith(".") or not isinstance(job, dict) or "script" not in job:
            continue
        env = {k: str(v) for k, v in {**doc.get("variables", {}), **job.get("variables", {})}.items()}
        for part in ("before_script", "script", "after_script"):
            lines = job.get(part, default.get(part, doc.get(part, [])))
            shell = f"job {name}" + (", after_script" if part == "after_script" else "")
            found += [CiCommand(f"job {name}, {part}: {line.splitlines()[0]!r}", line, env, shell) for line in lines]
    return found
