"""Every setting of pytest-sky, resolved once: command-line option > environment > default.

The plugin and the CLI hand in what their command lines said; the environment twins
(``PYTEST_SKY_*``) are read here and nowhere else, and each value remembers where it came
from, so pytest's report header can say why a run went to Kubernetes or kept its clusters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_sky.errors import SkyError

ENV_PREFIX = "PYTEST_SKY_"
_TRUE = ("1", "true", "yes", "on")
BACKENDS = ("local", "kubernetes")


class SettingsError(SkyError):
    """A setting's value is not one pytest-sky can use (the message names it and the fix)."""


@dataclass(frozen=True)
class Settings:
    backend: str = "local"
    kube_context: str | None = None
    kube_namespace: str | None = None
    kube_image: str | None = None
    keep_clusters: bool = False
    mtu: int | None = None
    #: Where each value came from: ``--backend``, ``PYTEST_SKY_BACKEND`` or ``default``.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def backend_options(self) -> dict[str, Any]:
        """The keyword arguments of the chosen backend's constructor."""
        if self.backend == "local":
            return {"mtu": self.mtu} if self.mtu else {}
        return {"context": self.kube_context, "namespace": self.kube_namespace, "image": self.kube_image}

    def describe(self) -> str:
        """One line for pytest's report header: each setting that applies, and its source."""
        names = ["backend", "keep_clusters"]
        names += ["mtu"] if self.backend == "local" else ["kube_context", "kube_namespace", "kube_image"]
        parts = []
        for name in names:
            value = getattr(self, name)
            shown = "(kubeconfig's)" if value is None and name.startswith("kube_") else value
            parts.append(f"{name}={shown} (from {self.sources.get(name, 'default')})")
        return "pytest-sky: " + ", ".join(parts)


def _truthy(value: object) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in _TRUE)


def resolve(
    *,
    backend: str | None = None,
    kubernetes: bool | None = None,
    kube_context: str | None = None,
    kube_namespace: str | None = None,
    kube_image: str | None = None,
    keep_clusters: bool | None = None,
    mtu: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """The effective settings, from the command line's values (None: not given) and the environment.

    ``--kubernetes`` is ``--backend kubernetes``; within the command line and within the
    environment, the ``kubernetes`` switch wins over a ``backend`` name.
    """
    env = os.environ if environ is None else environ
    sources: dict[str, str] = {}

    def pick(name: str, given: object, option: str) -> Any:
        if given is not None:
            sources[name] = option
            return given
        value = env.get(ENV_PREFIX + name.upper()) or None
        if value is not None:
            sources[name] = ENV_PREFIX + name.upper()
        return value

    if kubernetes:
        chosen, sources["backend"] = "kubernetes", "--kubernetes"
    elif backend:
        chosen, sources["backend"] = backend, "--backend"
    elif _truthy(env.get(ENV_PREFIX + "KUBERNETES")):
        chosen, sources["backend"] = "kubernetes", ENV_PREFIX + "KUBERNETES"
    else:
        chosen = pick("backend", None, "--backend") or "local"
    if chosen not in (*BACKENDS, "k8s"):
        raise SettingsError(f"PYTEST_SKY_BACKEND={chosen!r} is not a backend: use 'local' or 'kubernetes'")
    raw_mtu = pick("mtu", mtu, "--sky-mtu")
    try:
        mtu_value = int(raw_mtu) if raw_mtu is not None else None
    except ValueError:
        raise SettingsError(f"PYTEST_SKY_MTU={raw_mtu!r} is not a whole number (e.g. 65535)") from None
    return Settings(
        backend="kubernetes" if chosen == "k8s" else chosen,
        kube_context=pick("kube_context", kube_context, "--kube-context"),
        kube_namespace=pick("kube_namespace", kube_namespace, "--kube-namespace"),
        kube_image=pick("kube_image", kube_image, "--kube-image"),
        keep_clusters=_truthy(pick("keep_clusters", keep_clusters, "--keep-clusters")),
        mtu=mtu_value,
        sources=sources,
    )
