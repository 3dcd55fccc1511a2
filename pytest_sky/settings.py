"""Every setting of pytest-sky, resolved once: command-line option > environment > default.

The plugin, the CLI and ``pytest_sky.launch`` hand in what their callers said; the
environment twins (``PYTEST_SKY_*``) are read here and nowhere else (backends take their
settings as arguments), and each value remembers where it came from, so pytest's report
header can say why a run went to Kubernetes or kept its clusters.  A task's own
``resources`` (``infra``, ``image_id``) come between the environment and the default: see
:meth:`Settings.for_task`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pytest_sky.errors import SkyError
from pytest_sky.resources import OTHER_CLOUDS, Resources

ENV_PREFIX = "PYTEST_SKY_"
TASK_SOURCE = "the task's resources"
#: The local backend's link MTU when none is set: at 1500, gloo over veth is 30-40 % slower
#: than over loopback (DESIGN.md 5).
DEFAULT_MTU = 65535
#: Every pod's image when neither --kube-image nor the task's image_id names one.
DEFAULT_KUBE_IMAGE = "python:3.11-slim-bookworm"
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
    kube_timeout: float | None = None  # seconds a launch waits for pods (PYTEST_SKY_KUBE_TIMEOUT)
    kube_shared_pvc: str | None = None  # the ReadWriteMany claim that holds shared_dir on Kubernetes
    #: The node label naming GPU products (None: the first known key the nodes carry, else
    #: GPU feature discovery's ``nvidia.com/gpu.product``; ``backends.kube_policy``).
    kube_gpu_label: str | None = None
    #: Where each value came from: ``--backend``, ``PYTEST_SKY_BACKEND`` or ``default``.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def backend_options(self) -> dict[str, Any]:
        """The keyword arguments of the chosen backend's constructor."""
        if self.backend == "local":
            return {"mtu": self.mtu} if self.mtu else {}
        options: dict[str, Any] = {
            "context": self.kube_context,
            "namespace": self.kube_namespace,
            "image": self.kube_image,
        }
        if self.kube_timeout is not None:
            options["ready_timeout"] = self.kube_timeout
        if self.kube_shared_pvc:
            options["shared_pvc"] = self.kube_shared_pvc
        if self.kube_gpu_label:
            options["gpu_label"] = self.kube_gpu_label
        return options

    def given(self, name: str) -> bool:
        """The command line or the environment set it (not the default, not a task)."""
        return self.sources.get(name, "default") not in ("default", TASK_SOURCE)

    def for_task(self, resources: Resources) -> tuple[Settings, list[str]]:
        """These settings with the task's ``infra`` and ``image_id`` applied, and notes for the
        user on what the task asked for and does not get.

        A task's ``infra: kubernetes`` (``k8s/CONTEXT``) runs there and ``infra: local`` here,
        unless the command line or environment chose a backend; its ``image_id`` is the
        pods' image unless ``--kube-image`` says otherwise.  Local nodes run this machine's
        own software, so an ``image_id`` there is noted, not used.
        """
        changes: dict[str, Any] = {}
        sources = dict(self.sources)
        notes = []
        backend = self.backend
        if resources.infra in OTHER_CLOUDS:
            notes.append(
                f"the task asks for infra {resources.infra}, which pytest-sky does not provision; it runs on {backend}"
            )
        elif resources.infra is not None and resources.infra != backend:
            if self.given("backend"):
                notes.append(
                    f"the task asks for infra {resources.infra}; it runs on {backend}, "
                    f"as {self.sources['backend']} says"
                )
            else:
                backend = changes["backend"] = resources.infra
                sources["backend"] = TASK_SOURCE
        on_kubernetes = backend == "kubernetes" and resources.infra == "kubernetes"
        if on_kubernetes and resources.infra_context and not self.given("kube_context"):
            changes["kube_context"] = resources.infra_context
            sources["kube_context"] = TASK_SOURCE
        image = resources.image_id
        if image is not None:
            if backend != "kubernetes":
                notes.append(f"image_id {image} has no effect on the local backend: nodes run this machine's software")
            elif self.given("kube_image"):
                notes.append(f"the task's image_id {image} is not used: {self.sources['kube_image']} chose the image")
            else:
                changes["kube_image"] = image.removeprefix("docker:")
                sources["kube_image"] = TASK_SOURCE
        return replace(self, **changes, sources=sources), notes

    def describe(self) -> str:
        """One line for pytest's report header: each setting that applies, and its source."""
        names = ["backend", "keep_clusters"]
        names += (
            ["mtu"] if self.backend == "local" else ["kube_context", "kube_namespace", "kube_image", "kube_gpu_label"]
        )
        parts = []
        unset = {
            "mtu": DEFAULT_MTU,
            "kube_context": "(kubeconfig's)",
            "kube_namespace": "(kubeconfig's)",
            "kube_image": DEFAULT_KUBE_IMAGE,
            "kube_gpu_label": "(the nodes' known GPU label, else nvidia.com/gpu.product)",
        }
        for name in names:
            value = getattr(self, name)
            shown = unset.get(name, value) if value is None else value
            parts.append(f"{name}={shown} (from {self.sources.get(name, 'default')})")
        return "pytest-sky: " + ", ".join(parts)


def state_home(environ: Mapping[str, str] | None = None) -> Path:
    """Where cluster records live: ``PYTEST_SKY_HOME``, else ``~/.pytest_sky``.

    Read on each use, not once per session: a test (or a reaping subprocess) points it
    elsewhere through the environment.
    """
    env = os.environ if environ is None else environ
    return Path(env.get(ENV_PREFIX + "HOME") or "~/.pytest_sky").expanduser().resolve()


def _truthy(value: object) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in _TRUE)


def _seconds(raw: str | None) -> float | None:
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        raise SettingsError(f"PYTEST_SKY_KUBE_TIMEOUT={raw!r} is not a number of seconds (e.g. 600)") from None


def resolve(
    *,
    backend: str | None = None,
    kubernetes: bool | None = None,
    kube_context: str | None = None,
    kube_namespace: str | None = None,
    kube_image: str | None = None,
    keep_clusters: bool | None = None,
    mtu: int | None = None,
    kube_shared_pvc: str | None = None,
    kube_gpu_label: str | None = None,
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
    timeout = _seconds(pick("kube_timeout", None, ""))
    return Settings(
        backend="kubernetes" if chosen == "k8s" else chosen,
        kube_context=pick("kube_context", kube_context, "--kube-context"),
        kube_namespace=pick("kube_namespace", kube_namespace, "--kube-namespace"),
        kube_image=pick("kube_image", kube_image, "--kube-image"),
        keep_clusters=_truthy(pick("keep_clusters", keep_clusters, "--keep-clusters")),
        mtu=mtu_value,
        kube_timeout=timeout,
        kube_shared_pvc=pick("kube_shared_pvc", kube_shared_pvc, "--kube-shared-pvc"),
        kube_gpu_label=pick("kube_gpu_label", kube_gpu_label, "--kube-gpu-label"),
        sources=sources,
    )
