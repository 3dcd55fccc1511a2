"""The one list of backends: their names, aliases, where their code lives and what they need.

The plugin's ``--backend`` choices, the CLI's, the settings' check of ``PYTEST_SKY_BACKEND``,
a task's ``infra:`` and ``backends.get_backend`` all read this table, so a backend is added
(or an alias given) in one place.  It imports nothing heavy: a backend's module is named
here as text and imported only when that backend is chosen.  The table is read on each use
(functions, not constants), so a test can add a backend of its own (``tests/fake_backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_sky.errors import BackendUnavailableError


@dataclass(frozen=True)
class BackendEntry:
    name: str
    #: Other spellings a user may write (SkyPilot's ``infra: k8s``, ``PYTEST_SKY_BACKEND=k8s``).
    aliases: tuple[str, ...]
    #: ``module:Class`` of the backend, imported when chosen.
    factory: str
    #: One line for ``--help``: what a node is on this backend.
    summary: str
    #: Whether the backend takes an infra context (``kubernetes/CONTEXT``, a kubeconfig context).
    takes_context: bool = False
    #: Top-level modules it imports that are not in the standard library, with the pip
    #: requirement that brings each: checked before the import, so a missing one is one line.
    needs: tuple[tuple[str, str], ...] = ()
    #: Whether its clusters can be stopped and started again with their disks (``stop``/``start``).
    can_stop: bool = False
    #: Why not, where they cannot: what ``pytest-sky stop`` says.
    cannot_stop: str = ""


BACKENDS: tuple[BackendEntry, ...] = (
    BackendEntry(
        "local",
        (),
        "pytest_sky.backends.local:LocalBackend",
        "namespace nodes on this machine, each with its own network and sshd",
        can_stop=True,
    ),
    BackendEntry(
        "kubernetes",
        ("k8s",),
        "pytest_sky.backends.kubernetes:KubernetesBackend",
        "pods on the current kube context",
        takes_context=True,
        needs=(("kubernetes", "kubernetes>=29,<38"),),
        cannot_stop="a pod has no stopped state; SkyPilot refuses too",
    ),
    BackendEntry(
        "slurm",
        (),
        "pytest_sky.backends.slurm:SlurmBackend",
        "one allocation of a Slurm cluster, reached over SSH through its login node (~/.slurm/config)",
        cannot_stop="an allocation ends when cancelled and is not the user's to suspend; SkyPilot refuses too",
    ),
)


def names() -> tuple[str, ...]:
    """Every backend's own name, in the table's order (the first is the default)."""
    return tuple(b.name for b in BACKENDS)


def default() -> str:
    return BACKENDS[0].name


def spellings() -> tuple[str, ...]:
    """Every spelling accepted where a backend is named: names, then aliases."""
    return names() + tuple(a for b in BACKENDS for a in b.aliases)


def lookup(spelling: str) -> BackendEntry:
    """The backend a name or alias means; an unknown one is refused with the known ones."""
    for entry in BACKENDS:
        if spelling == entry.name or spelling in entry.aliases:
            return entry
    raise BackendUnavailableError(f"unknown backend {spelling!r}: choose one of {', '.join(spellings())}")


def canonical(spelling: str) -> str:
    """``k8s`` -> ``kubernetes``; an own name stays itself."""
    return lookup(spelling).name
