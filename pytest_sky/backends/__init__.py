"""Backends provision nodes; everything after provisioning is shared (see ``base.Backend``)."""

from __future__ import annotations

from pytest_sky.backends.base import Backend
from pytest_sky.errors import BackendUnavailableError

BACKENDS = ("local", "kubernetes")


def get_backend(name: str, **options: object) -> Backend:
    """The backend called ``name``; heavy modules are imported only when chosen."""
    if name == "local":
        from pytest_sky.backends.local import LocalBackend

        return LocalBackend(**options)  # type: ignore[arg-type]
    if name in ("kubernetes", "k8s"):
        raise BackendUnavailableError(
            "the kubernetes backend is not part of this version of pytest-sky yet; "
            "run without --kubernetes to use the local backend"
        )
    raise BackendUnavailableError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
