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
        try:
            from pytest_sky.backends.kubernetes import KubernetesBackend
        except ImportError as exc:
            raise BackendUnavailableError(
                f"the kubernetes backend needs the kubernetes client ({exc.name} is missing): "
                "pip install 'pytest-sky[kubernetes]'"
            ) from None
        return KubernetesBackend(**{k: v for k, v in options.items() if v is not None})  # type: ignore[arg-type]
    raise BackendUnavailableError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
