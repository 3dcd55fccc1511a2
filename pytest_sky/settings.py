"""Every setting of pytest-sky, resolved once: command-line option > environment > ini > default.

The plugin, the CLI and ``pytest_sky.launch`` hand in what their callers said; the
environment twins (``PYTEST_SKY_*``) are read here and nowhere else (backends take their
settings as arguments), and each value remembers where it came from, so pytest's report
header can say why a run went to Kubernetes or kept its clusters.  Under pytest each setting
also has an ini key (``sky_<name>``, in pytest.ini, pyproject.toml, tox.ini or setup.cfg),
which the plugin hands in: a project writes its defaults once, a CI job's environment or
command line still overrides them.  A task's own ``resources`` (``infra``, ``image_id``)
come between those and the default: see :meth:`Settings.for_task`.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pytest_sky import registry
from pytest_sky.errors import SkyError
from pytest_sky.resources import OTHER_CLOUDS, Resources

ENV_PREFIX = "PYTEST_SKY_"
TASK_SOURCE = "the task's resources"
#: The local backend's link MTU when none is set: at 1500, gloo over veth is 30-40 % slower
#: than over loopback (DESIGN.md 5).
DEFAULT_MTU = 65535
#: Every pod's image when neither --kube-image nor the task's image_id names one.
DEFAULT_KUBE_IMAGE = "python:3.11-slim-bookworm"
#: How long an attached run of a test may take when nothing says otherwise: long enough for
#: torch's imports and a rendezvous on loaded CI machines, short enough that a hung test
#: says where its ranks wait well before a CI job's own limit kills it silently.
DEFAULT_RUN_TIMEOUT = 600.0
#: Where the Slurm backend finds its login node (SkyPilot's file) and the time limit of an
#: allocation, unless set (``backends.slurm_site``, ``backends.slurm_steps`` use them).
SLURM_CONFIG = "~/.slurm/config"
SLURM_TIME = "1:00:00"
#: Seconds a Slurm launch waits for its allocation to run, unless set.
SLURM_TIMEOUT = 300.0
#: The defaults the Kubernetes backend applies (``backends.kube_lease`` holds the reasons);
#: here for the report header, which must not import the backend.
LEASE_SECONDS = 120.0
MAX_LIFETIME = 6 * 3600.0
_TRUE = ("1", "true", "yes", "on")


class Deadline(enum.Enum):
    """``Cluster.run``'s default ``timeout``: its cluster's ``run_timeout``, which under pytest
    is the session's ``--sky-run-timeout`` (``None`` means no deadline, on purpose)."""

    SESSION = "the session's run timeout"


SESSION_DEADLINE = Deadline.SESSION


class SettingsError(SkyError):
    """A setting's value is not one pytest-sky can use (the message names it and the fix)."""


class Kind(enum.Enum):
    """How an option's text becomes its value (the same on the command line and in the environment)."""

    TEXT = "text"
    SWITCH = "switch"  # a flag without a value; its environment twin is 1/true/yes/on
    WHOLE = "whole number"
    SECONDS = "number of seconds"
    BACKEND = "backend"


@dataclass(frozen=True)
class Option:
    """One setting: its ``Settings`` field, its command-line flag and environment twin, and
    what the backend's constructor and the report header make of it.

    The pytest options, the CLI's flags, ``resolve`` and the report header are all made from
    :data:`OPTIONS`, so a new setting is one row here and one field of :class:`Settings`.
    """

    name: str
    flag: str
    help: str
    kind: Kind = Kind.TEXT
    metavar: str | None = None
    #: The one backend it applies to (None: every backend).
    backend: str | None = None
    #: The keyword of that backend's constructor that takes it.
    keyword: str | None = None
    #: What the report header shows while it is unset (None: the value itself, e.g. False).
    unset: str | None = None
    #: Shown in the report header (the ``kubernetes`` switch is folded into ``backend``).
    shown: bool = True
    #: Also a flag of ``pytest-sky launch`` (not ``--keep-clusters``: the CLI always keeps).
    on_cli: bool = True
    #: The backend a switch chooses (``--kubernetes``, ``--slurm``: ``--backend NAME`` in short).
    selects: str | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def dest(self) -> str:
        """Its attribute on a parsed command line (prefixed: pytest's namespace is shared)."""
        return "sky_" + self.name

    @property
    def ini(self) -> str:
        """Its key in pytest's ini file (``sky_backend``, ``sky_run_timeout``): pytest's ini
        namespace is shared with every other plugin, hence the prefix."""
        return self.dest

    def argparse_kwargs(self, twin: str | None = None) -> dict[str, Any]:
        """``add_argument``'s keywords for its flag, for pytest's parser and the CLI's alike;
        ``twin`` (the environment variable) is named at the end of the help."""
        kwargs: dict[str, object] = {"help": f"{self.help} [{twin}]" if twin else self.help}
        if self.kind is Kind.SWITCH:
            kwargs["action"] = "store_true"
        elif self.kind is Kind.BACKEND:
            kwargs["choices"] = registry.spellings()
        else:
            kwargs["metavar"] = self.metavar
        return kwargs

    def parse(self, raw: object, source: str) -> object:
        """The value of ``raw`` (text from the environment, or a command line's value)."""
        if self.kind is Kind.SWITCH:
            return raw is True or (isinstance(raw, str) and raw.strip().lower() in _TRUE)
        if self.kind is Kind.BACKEND:
            if raw not in registry.spellings():
                names = [repr(n) for n in registry.names()]
                known = " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"
                raise SettingsError(f"{source}={raw!r} is not a backend: use {known}")
            return registry.canonical(str(raw))
        if self.kind in (Kind.WHOLE, Kind.SECONDS):
            try:
                value = int(raw) if self.kind is Kind.WHOLE else float(raw)  # type: ignore[arg-type,call-overload]
            except ValueError:
                value = -1
            if value < 0 or not math.isfinite(value):
                example = "65535" if self.kind is Kind.WHOLE else "600"
                raise SettingsError(f"{source}={raw!r} is not a {self.kind.value} (e.g. {example})") from None
            return value
        return raw


OPTIONS: tuple[Option, ...] = (
    Option(
        "backend",
        "--backend",
        "where clusters run: "
        + "; ".join(f"'{b.name}': {b.summary}" for b in registry.BACKENDS)
        + f" (default: the task's infra, else {registry.default()})",
        Kind.BACKEND,
    ),
    Option(
        "kubernetes", "--kubernetes", "same as --backend kubernetes: pods on the current kube context", Kind.SWITCH,
        shown=False, selects="kubernetes",
    ),
    Option(
        "slurm", "--slurm", "same as --backend slurm: an allocation of the Slurm cluster of ~/.slurm/config",
        Kind.SWITCH, shown=False, selects="slurm",
    ),
    Option(
        "kube_context", "--kube-context", "kubeconfig context to use", metavar="CONTEXT",
        backend="kubernetes", keyword="context", unset="(kubeconfig's)",
    ),
    Option(
        "kube_namespace", "--kube-namespace", "namespace for the cluster's pods", metavar="NAMESPACE",
        backend="kubernetes", keyword="namespace", unset="(kubeconfig's)",
    ),
    Option(
        "kube_image", "--kube-image", "container image of every pod", metavar="IMAGE",
        backend="kubernetes", keyword="image", unset=DEFAULT_KUBE_IMAGE,
    ),
    Option(
        "kube_shared_pvc", "--kube-shared-pvc", "ReadWriteMany PersistentVolumeClaim that holds a test's shared_dir",
        metavar="CLAIM", backend="kubernetes", keyword="shared_pvc", unset="(none)",
    ),
    Option(
        "kube_gpu_label", "--kube-gpu-label",
        "node label naming the GPU product (default: the nodes' known one, else nvidia.com/gpu.product)",
        metavar="KEY", backend="kubernetes", keyword="gpu_label",
        unset="(the nodes' known GPU label, else nvidia.com/gpu.product)",
    ),
    Option(
        "kube_timeout", "--kube-timeout", "seconds a launch waits for its pods to be ready", Kind.SECONDS,
        metavar="SECONDS", backend="kubernetes", keyword="ready_timeout", unset="(the backend's)",
    ),
    Option(
        "slurm_config", "--slurm-config", f"SSH config whose Host is the Slurm login node (default {SLURM_CONFIG})",
        metavar="FILE", backend="slurm", keyword="config", unset=SLURM_CONFIG,
    ),
    Option(
        "slurm_cluster", "--slurm-cluster", "the Host of the Slurm config to use (default: its only one)",
        metavar="NAME", backend="slurm", keyword="cluster", unset="(the config's only Host)",
    ),
    Option(
        "slurm_partition", "--slurm-partition", "Slurm partition of the allocations", metavar="PARTITION",
        backend="slurm", keyword="partition", unset="(the site's default)",
    ),
    Option(
        "slurm_account", "--slurm-account", "Slurm account the allocations are charged to", metavar="ACCOUNT",
        backend="slurm", keyword="account", unset="(the user's default)",
    ),
    Option(
        "slurm_qos", "--slurm-qos", "Slurm QOS of the allocations", metavar="QOS",
        backend="slurm", keyword="qos", unset="(the site's default)",
    ),
    Option(
        "slurm_time", "--slurm-time", f"time limit of each allocation, Slurm's format (default {SLURM_TIME})",
        metavar="TIME", backend="slurm", keyword="time_limit", unset=SLURM_TIME,
    ),
    Option(
        "slurm_shared_dir", "--slurm-shared-dir",
        "a directory every node of the Slurm site mounts (NFS, Lustre): a test's shared_dir, one cluster at a time",
        metavar="PATH", backend="slurm", keyword="shared_dir", unset="(none)",
    ),
    Option(
        "slurm_timeout", "--slurm-timeout", "seconds a launch waits for its allocation to run", Kind.SECONDS,
        metavar="SECONDS", backend="slurm", keyword="ready_timeout", unset=f"{SLURM_TIMEOUT:g}",
    ),
    Option(
        "kube_lease_seconds", "--kube-lease-seconds",
        "seconds a cluster's lease lasts unrenewed: once its owner is gone that long, any --kubernetes session "
        "or `pytest-sky down --stale --kubernetes` reaps it", Kind.SECONDS, metavar="SECONDS",
        backend="kubernetes", keyword="lease_seconds", unset=f"{LEASE_SECONDS:.0f}",
    ),
    Option(
        "kube_max_lifetime", "--kube-max-lifetime",
        "seconds a pod may run (its activeDeadlineSeconds), the end of a cluster whose owner never returns; "
        "kept clusters get one only when this is given", Kind.SECONDS, metavar="SECONDS",
        backend="kubernetes", keyword="max_lifetime", unset=f"{MAX_LIFETIME:.0f} (6 h; kept clusters: none)",
    ),
    Option(
        "keep_clusters", "--keep-clusters", "do not tear clusters down; print how to reach and delete them",
        Kind.SWITCH, on_cli=False,
    ),
    Option(
        "artifacts", "--sky-artifacts",
        "keep each failed multinode test's rank logs, run spec, provision log and timeline in DIR/<test id>/",
        metavar="DIR", unset="(off)", on_cli=False,
    ),
    Option(
        "artifacts_all", "--sky-artifacts-all", "with --sky-artifacts: keep them for passing tests too",
        Kind.SWITCH, on_cli=False,
    ),
    Option(
        "run_timeout", "--sky-run-timeout",
        "seconds an attached run of a test may take; then pytest-sky reports where every rank waits and stops them "
        f"(default {DEFAULT_RUN_TIMEOUT:g}; 0: no deadline; run(timeout=...) sets one run's)",
        Kind.SECONDS, metavar="SECONDS", unset=f"{DEFAULT_RUN_TIMEOUT:g}", on_cli=False,
    ),
    Option(
        "rootdir", "--sky-rootdir",
        "a directory local nodes see, copy-on-write, wherever it lives (as they see pytest's interpreter and "
        "virtualenv, while no home or scratch directory of the host's): default pytest's rootdir",
        metavar="DIR", backend="local", keyword="rootdir", unset="(pytest's rootdir)", shown=False, on_cli=False,
    ),
    Option(
        "mtu", "--sky-mtu", f"MTU of local cluster links (default {DEFAULT_MTU})", Kind.WHOLE, metavar="MTU",
        backend="local", keyword="mtu", unset=str(DEFAULT_MTU),
    ),
)  # fmt: skip
_BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    backend: str = field(default_factory=registry.default)
    kube_context: str | None = None
    kube_namespace: str | None = None
    kube_image: str | None = None
    keep_clusters: bool = False
    #: Where failed tests' artifacts go (``pytest_sky.artifacts``); None: nowhere.
    artifacts: str | None = None
    artifacts_all: bool = False
    mtu: int | None = None
    rootdir: str | None = None  # a directory local nodes see wherever it lives (pytest's rootdir)
    kube_timeout: float | None = None  # seconds a launch waits for pods (PYTEST_SKY_KUBE_TIMEOUT)
    kube_shared_pvc: str | None = None  # the ReadWriteMany claim that holds shared_dir on Kubernetes
    #: The node label naming GPU products (None: the first known key the nodes carry, else
    #: GPU feature discovery's ``nvidia.com/gpu.product``; ``backends.kube_policy``).
    kube_gpu_label: str | None = None
    #: How long a cluster's lease lasts unrenewed (``backends.kube_lease``); None: its default.
    kube_lease_seconds: float | None = None
    #: Pods' activeDeadlineSeconds; None: the default, and none for kept clusters.
    kube_max_lifetime: float | None = None
    #: Seconds an attached run in a pytest session may take (None: the default; 0: none).
    run_timeout: float | None = None
    slurm_config: str | None = None  # the SSH config naming the login node (PYTEST_SKY_SLURM_CONFIG)
    slurm_cluster: str | None = None  # its Host
    slurm_partition: str | None = None
    slurm_account: str | None = None
    slurm_qos: str | None = None
    slurm_time: str | None = None  # each allocation's --time
    slurm_shared_dir: str | None = None  # the site's shared directory that shared_dir may name
    slurm_timeout: float | None = None  # seconds a launch waits for its allocation to run
    #: Where each value came from: ``--backend``, ``PYTEST_SKY_BACKEND``, ``sky_backend in
    #: pytest.ini`` or ``default``.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def run_deadline(self) -> float | None:
        """The seconds a test's attached run gets when it names none (None: no deadline)."""
        if self.run_timeout is None:
            return DEFAULT_RUN_TIMEOUT
        return self.run_timeout or None

    def backend_options(self) -> dict[str, Any]:
        """The keyword arguments of the chosen backend's constructor: its options that are set."""
        return {
            o.keyword: getattr(self, o.name)
            for o in OPTIONS
            if o.backend == self.backend and o.keyword and getattr(self, o.name) is not None
        }

    def given(self, name: str) -> bool:
        """The command line, the environment or the ini file set it (not the default, not a task)."""
        return self.sources.get(name, "default") not in ("default", TASK_SOURCE)

    def for_task(self, resources: Resources) -> tuple[Settings, list[str]]:
        """These settings with the task's ``infra`` and ``image_id`` applied, and notes for the
        user on what the task asked for and does not get.

        A task's ``infra: kubernetes`` (``k8s/CONTEXT``) runs there and ``infra: local`` here,
        unless the command line, environment or ini file chose a backend; its ``image_id`` is the
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
                whose = "the site's" if backend == "slurm" else "this machine's"
                notes.append(f"image_id {image} has no effect on the {backend} backend: nodes run {whose} software")
            elif self.given("kube_image"):
                notes.append(f"the task's image_id {image} is not used: {self.sources['kube_image']} chose the image")
            else:
                changes["kube_image"] = image.removeprefix("docker:")
                sources["kube_image"] = TASK_SOURCE
        return replace(self, **changes, sources=sources), notes

    def describe(self, backend_mode: str = "") -> str:
        """One line for pytest's report header: each setting that applies, and its source;
        ``backend_mode`` is how the backend runs here (the local one: ``rootless``)."""
        parts = []
        for o in OPTIONS:
            if o.shown and o.backend in (None, self.backend):
                value = getattr(self, o.name)
                shown = o.unset if value is None and o.unset is not None else value
                if o.name == "backend" and backend_mode:
                    shown = f"{shown} ({backend_mode})"
                parts.append(f"{o.name}={shown} (from {self.sources.get(o.name, 'default')})")
        return "pytest-sky: " + ", ".join(parts)


def state_home(environ: Mapping[str, str] | None = None) -> Path:
    """Where cluster records live: ``PYTEST_SKY_HOME``, else ``~/.pytest_sky``.

    Read on each use, not once per session: a test (or a reaping subprocess) points it
    elsewhere through the environment.
    """
    env = os.environ if environ is None else environ
    return Path(env.get(ENV_PREFIX + "HOME") or "~/.pytest_sky").expanduser().resolve()


def resolve(
    *,
    environ: Mapping[str, str] | None = None,
    ini: Mapping[str, str] | None = None,
    ini_file: str | None = None,
    **given: object,
) -> Settings:
    """The effective settings, from the command line's values (keyword per :data:`OPTIONS` row;
    None: not given), the environment's twins and the ini file's keys (``ini``, by
    :attr:`Option.ini`, as pytest read them from ``ini_file``; empty: not set).

    ``--kubernetes`` is ``--backend kubernetes`` and ``--slurm`` ``--backend slurm``; at the same
    level (command line, environment, ini) a switch wins over a ``backend`` name, and a higher
    level wins over a lower one whichever of the two it sets.
    """
    unknown = sorted(set(given) - set(_BY_NAME))
    if unknown:
        raise TypeError(f"resolve() got unknown settings {unknown}")
    env = os.environ if environ is None else environ
    ini = ini or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    levels: dict[str, int] = {}
    for option in OPTIONS:
        found = [
            (given.get(option.name), option.flag),
            (env.get(option.env) or None, option.env),
            (ini.get(option.ini) or None, f"{option.ini} in {ini_file or 'the ini file'}"),
        ]
        for level, (raw, source) in enumerate(found):
            if raw is not None:
                values[option.name] = option.parse(raw, source)
                sources[option.name], levels[option.name] = source, level
                break
    _apply_switches(values, sources, levels)
    return Settings(**values, sources=sources)


def _apply_switches(values: dict[str, Any], sources: dict[str, str], levels: dict[str, int]) -> None:
    """``--kubernetes`` and ``--slurm`` into ``backend``: the switches set at the highest level
    (command line, environment, ini) count; there, one wins over a ``backend`` name at the
    same level or a lower one, and two choosing different backends are an error."""
    on = [(o, levels[o.name], sources[o.name]) for o in OPTIONS if o.selects and values.pop(o.name, False)]
    for o in OPTIONS:
        if o.selects:
            sources.pop(o.name, None)
    if not on:
        return
    top = min(level for _, level, _ in on)
    pick = [(o, source) for o, level, source in on if level == top]
    if len(pick) > 1:
        raise SettingsError(f"{' and '.join(source for _, source in pick)} choose different backends: give one")
    option, source = pick[0]
    if top <= levels.get("backend", top):
        values["backend"], sources["backend"] = option.selects, source
