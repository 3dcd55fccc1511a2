"""Admission of pods as the API server's plugins do it: LimitRanger, ServiceAccount, PodSecurity,
ResourceQuota.

A real cluster's namespace may default and cap a container's resources (LimitRange), cap
the namespace's total (ResourceQuota) and refuse pods by their security settings (Pod
Security admission, by the namespace's ``pod-security.kubernetes.io/enforce`` label).  The
emulator applies the same rules in the same order (LimitRanger mutates before validation;
LimitRanger, PodSecurity and ResourceQuota then validate) with the real messages' shapes,
because the backend tells the three apart by them:

- ``pods "x" is forbidden: maximum cpu usage per Container is 2, but limit is 4``
- ``pods "x" is forbidden: exceeded quota: compute, requested: requests.cpu=1, used:
  requests.cpu=4, limited: requests.cpu=4``; ``failed quota: compute: must specify
  limits.cpu for: node; limits.memory for: node``
- ``pods "x" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation
  != false (container "node" must set securityContext.allowPrivilegeEscalation=false), ...``

Pure functions over plain dicts: the cluster hands in the pod, the namespace's policies and
its live pods, and turns a message into a 403.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from typing import Any

from kube_emulator.config import ClusterConfig
from kube_emulator.scheduler import QuantityError, is_terminated, parse_quantity
from kube_emulator.store import random_suffix

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION_LABEL = "pod-security.kubernetes.io/enforce-version"
# Pod Security's lists, from k8s.io/pod-security-admission/policy (Kubernetes 1.31-1.35; none
# changed since the versions named), never from pytest-sky's own: the judge of the pods the
# product makes cannot share its lists.
#: check_capabilities_baseline.go, ``capabilities_allowed_1_0``: what "baseline" lets a
#: container add.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
#: check_sysctls.go: the "safe" sysctls "baseline" lets a pod set (``sysctls_allowed_1_0``,
#: then ip_local_reserved_ports from 1.27 and the TCP keepalive and FIN timeouts from 1.29).
BASELINE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
#: check_restrictedVolumes.go: the volume types "restricted" allows.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
Obj = dict[str, Any]


#: Where the ServiceAccount admission plugin mounts a pod's API credentials
#: (plugin/pkg/admission/serviceaccount/admission.go, DefaultAPITokenMountPath).
TOKEN_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def mount_service_account_token(pod: Obj, account_named: Callable[[str], Obj | None]) -> None:
    """The ServiceAccount admission plugin: the pod runs as ``default`` unless it names its
    account, and unless the pod (or else its account) sets ``automountServiceAccountToken:
    false``, a projected volume ``kube-api-access-<suffix>`` (a bound token, the cluster's CA,
    the namespace) is mounted read-only in every container at :data:`TOKEN_MOUNT_PATH`."""
    spec = pod.setdefault("spec", {})
    spec["serviceAccountName"] = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    automount = spec.get("automountServiceAccountToken")
    if automount is None:
        automount = (account_named(spec["serviceAccountName"]) or {}).get("automountServiceAccountToken")
    if automount is False:
        return
    name = f"kube-api-access-{random_suffix()}"
    sources = [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {
            "downwardAPI": {
                "items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]
            }
        },
    ]
    spec.setdefault("volumes", []).append({"name": name, "projected": {"sources": sources, "defaultMode": 420}})
    for container in spec.get("containers") or []:
        mounts = container.setdefault("volumeMounts", [])
        mounts.append({"name": name, "readOnly": True, "mountPath": TOKEN_MOUNT_PATH})


def default_policies(config: ClusterConfig) -> list[tuple[str, Obj]]:
    """What an administrator commonly sets on a shared namespace, sized so that the smoke
    suite passes (besides Pod Security "baseline" enforced): a LimitRange that fills in
    limits of one node's size (and small requests for containers that state none); a
    ResourceQuota on requests (the nodes' total) and limits (ten times that), so a pod must
    state both, which the LimitRange's defaults see to.  (resource, object) to create."""
    cpu, memory = config.cpus_per_node, config.memory_per_node
    total_cpu = parse_quantity(cpu) * config.nodes
    total_memory = parse_quantity(memory) * config.nodes
    limits = {
        "type": "Container",
        "default": {"cpu": cpu, "memory": memory},
        "defaultRequest": {"cpu": "100m", "memory": "128Mi"},
    }
    hard = {
        "pods": str(110 * config.nodes),
        "requests.cpu": format_quantity(total_cpu, False),
        "requests.memory": format_quantity(total_memory, True),
        "limits.cpu": format_quantity(total_cpu * 10, False),
        "limits.memory": format_quantity(total_memory * 10, True),
    }
    return [
        ("limitranges", {"metadata": {"name": "defaults"}, "spec": {"limits": [limits]}}),
        ("resourcequotas", {"metadata": {"name": "compute"}, "spec": {"hard": hard}}),
    ]


def format_quantity(value: Fraction, memory: bool) -> str:
    """A quantity as the API server prints a sum: ``2``, ``500m``, ``1536Mi``."""
    if not memory:
        return str(int(value)) if value.denominator == 1 else f"{int(value * 1000)}m"
    for suffix, size in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if value % size == 0 and value:
            return f"{int(value / size)}{suffix}"
    return str(int(value))


# -- LimitRange -----------------------------------------------------------------------------


def default_limit_range(obj: Obj) -> None:
    """The API server's defaulting of a new LimitRange (``SetDefaults_LimitRangeItem``): a
    Container item's default limit is its max, its default request the default or the min."""
    for item in (obj.get("spec") or {}).get("limits") or []:
        if item.get("type") != "Container":
            continue
        default = item.setdefault("default", {})
        request = item.setdefault("defaultRequest", {})
        for key, value in (item.get("max") or {}).items():
            default.setdefault(key, value)
        for key, value in default.items():
            request.setdefault(key, value)
        for key, value in (item.get("min") or {}).items():
            request.setdefault(key, value)


def _container_items(limit_ranges: Iterable[Obj], kind: str) -> list[Obj]:
    return [i for lr in limit_ranges for i in (lr.get("spec") or {}).get("limits") or [] if i.get("type") == kind]


def limit_ranger_mutate(pod: Obj, limit_ranges: Iterable[Obj]) -> None:
    """Fill in each container's missing limits and requests from the Container defaults
    (after the API's own defaulting of requests from limits, which comes first)."""
    items = _container_items(limit_ranges, "Container")
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.setdefault("resources", {})
        if not isinstance(res, dict):
            continue
        for key, value in (res.get("limits") or {}).items():
            res.setdefault("requests", {}).setdefault(key, value)
        for item in items:
            for key, value in (item.get("default") or {}).items():
                res.setdefault("limits", {}).setdefault(key, value)
            for key, value in (item.get("defaultRequest") or {}).items():
                res.setdefault("requests", {}).setdefault(key, value)


def _q(values: Mapping[str, Any], key: str) -> Fraction | None:
    try:
        return parse_quantity(values[key]) if key in values else None
    except QuantityError:
        return None


def _bounds(kind: str, item: Obj, requests: Mapping[str, Any], limits: Mapping[str, Any]) -> list[str]:
    """limitranger.go's minConstraint, maxConstraint and limitRequestRatioConstraint."""
    errors = []
    for key, bound in (item.get("min") or {}).items():
        enforced, req, lim = parse_quantity(bound), _q(requests, key), _q(limits, key)
        if req is None:
            errors.append(f"minimum {key} usage per {kind} is {bound}.  No request is specified")
        elif req < enforced:
            errors.append(f"minimum {key} usage per {kind} is {bound}, but request is {requests[key]}")
        elif lim is not None and lim < enforced:
            errors.append(f"minimum {key} usage per {kind} is {bound}, but limit is {limits[key]}")
    for key, bound in (item.get("max") or {}).items():
        enforced, req, lim = parse_quantity(bound), _q(requests, key), _q(limits, key)
        if lim is None:
            errors.append(f"maximum {key} usage per {kind} is {bound}.  No limit is specified")
        elif lim > enforced:
            errors.append(f"maximum {key} usage per {kind} is {bound}, but limit is {limits[key]}")
        elif req is not None and req > enforced:
            errors.append(f"maximum {key} usage per {kind} is {bound}, but request is {requests[key]}")
    for key, bound in (item.get("maxLimitRequestRatio") or {}).items():
        req, lim = _q(requests, key), _q(limits, key)
        if not req:
            errors.append(
                f"{key} max limit to request ratio per {kind} is {bound}, but no request is specified or request is 0"
            )
        elif not lim:
            errors.append(
                f"{key} max limit to request ratio per {kind} is {bound}, but no limit is specified or limit is 0"
            )
        elif lim / req > parse_quantity(bound):
            errors.append(
                f"{key} max limit to request ratio per {kind} is {bound}, but provided ratio is {float(lim / req):f}"
            )
    return errors


def limit_ranger_validate(pod: Obj, limit_ranges: Iterable[Obj]) -> list[str]:
    """Every Container and Pod bound of the namespace's LimitRanges the pod breaks."""
    ranges = list(limit_ranges)
    containers = (pod.get("spec") or {}).get("containers") or []
    errors = []
    for item in _container_items(ranges, "Container"):
        for c in containers:
            res = c.get("resources") or {}
            errors += _bounds("Container", item, res.get("requests") or {}, res.get("limits") or {})
    pod_items = _container_items(ranges, "Pod")
    if pod_items:
        requests: dict[str, Fraction] = {}
        limits: dict[str, Fraction] = {}
        complete: dict[str, bool] = {}
        for c in containers:
            res = c.get("resources") or {}
            for total, values in ((requests, res.get("requests") or {}), (limits, res.get("limits") or {})):
                for key, value in values.items():
                    total[key] = total.get(key, Fraction(0)) + parse_quantity(value)
            for key in {*requests, *limits}:
                complete[key] = complete.get(key, True) and key in (res.get("limits") or {})
        lim_text = {k: format_quantity(v, k == "memory") for k, v in limits.items() if complete.get(k)}
        req_text = {k: format_quantity(v, k == "memory") for k, v in requests.items()}
        for item in pod_items:
            errors += _bounds("Pod", item, req_text, lim_text)
    return errors


# -- PodSecurity ----------------------------------------------------------------------------


def _who(names: list[str]) -> str:
    quoted = ", ".join(f'"{n}"' for n in names)
    return f"container {quoted}" if len(names) == 1 else f"containers {quoted}"


def baseline_violations(spec: Obj, containers: list[Obj]) -> list[tuple[str, str]]:
    """(check id, message) for each Pod Security \"baseline\" check the pod fails, as
    k8s.io/pod-security-admission names and words them."""
    out = []
    sc_of = {c.get("name", ""): c.get("securityContext") or {} for c in containers}
    added = {
        n: [x for x in (sc.get("capabilities") or {}).get("add") or [] if x not in BASELINE_CAPABILITIES]
        for n, sc in sc_of.items()
    }
    if any(added.values()):
        caps = sorted({x for xs in added.values() for x in xs})
        names = [n for n, xs in added.items() if xs]
        shown = ", ".join(f'"{x}"' for x in caps)
        out.append(
            (
                "capabilities_baseline",
                f"non-default capabilities ({_who(names)} must not include {shown} "
                "in securityContext.capabilities.add)",
            )
        )
    hosts = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if hosts:
        out.append(("hostNamespaces", f"host namespaces ({', '.join(hosts)})"))
    host_paths = [v.get("name", "") for v in spec.get("volumes") or [] if "hostPath" in v]
    if host_paths:
        word = "volume" if len(host_paths) == 1 else "volumes"
        out.append(
            ("hostPathVolumes", f"hostPath volumes ({word} {', '.join(f'{chr(34)}{n}{chr(34)}' for n in host_paths)})")
        )
    ports = [(c.get("name", ""), p["hostPort"]) for c in containers for p in c.get("ports") or [] if p.get("hostPort")]
    if ports:
        out.append(
            ("hostPorts", "hostPort (" + ", ".join(f'container "{n}" uses hostPort {p}' for n, p in ports) + ")")
        )
    privileged = [n for n, sc in sc_of.items() if sc.get("privileged")]
    if privileged:
        out.append(("privileged", f"privileged ({_who(privileged)} must not set securityContext.privileged=true)"))
    unmasked = [n for n, sc in sc_of.items() if sc.get("procMount") not in (None, "Default")]
    if unmasked:
        out.append(("procMount", f'procMount ({_who(unmasked)} must not set securityContext.procMount to "Unmasked")'))
    pod_sc = spec.get("securityContext") or {}
    forbidden = [s.get("name", "") for s in pod_sc.get("sysctls") or [] if s.get("name") not in BASELINE_SYSCTLS]
    if forbidden:
        out.append(("sysctls", f"forbidden sysctls ({', '.join(forbidden)})"))
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append(
            (
                "seccompProfile_baseline",
                'seccompProfile (pod must not set securityContext.seccompProfile.type to "Unconfined")',
            )
        )
    unconfined = [n for n, sc in sc_of.items() if (sc.get("seccompProfile") or {}).get("type") == "Unconfined"]
    if unconfined:
        out.append(
            (
                "seccompProfile_baseline",
                f'seccompProfile ({_who(unconfined)} must not set securityContext.seccompProfile.type to "Unconfined")',
            )
        )
    return out


def _restricted(spec: Obj, containers: list[Obj]) -> list[tuple[str, str]]:
    out = []
    pod_sc = spec.get("securityContext") or {}
    sc_of = {c.get("name", ""): c.get("securityContext") or {} for c in containers}
    escalating = [n for n, sc in sc_of.items() if sc.get("allowPrivilegeEscalation") is not False]
    if escalating:
        out.append(
            (
                "allowPrivilegeEscalation",
                f"allowPrivilegeEscalation != false ({_who(escalating)} "
                "must set securityContext.allowPrivilegeEscalation=false)",
            )
        )
    caps = []
    no_drop = [n for n, sc in sc_of.items() if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or [])]
    if no_drop:
        caps.append(f'{_who(no_drop)} must set securityContext.capabilities.drop=["ALL"]')
    extra = {
        n: [x for x in (sc.get("capabilities") or {}).get("add") or [] if x != "NET_BIND_SERVICE"]
        for n, sc in sc_of.items()
    }
    if any(extra.values()):
        shown = ", ".join(f'"{x}"' for x in sorted({x for xs in extra.values() for x in xs}))
        caps.append(
            f"{_who([n for n, xs in extra.items() if xs])} must not include {shown} in securityContext.capabilities.add"
        )
    if caps:
        out.append(("capabilities_restricted", f"unrestricted capabilities ({'; '.join(caps)})"))
    kinds = [(v.get("name", ""), next((k for k in v if k != "name"), "")) for v in spec.get("volumes") or []]
    bad = [(n, k) for n, k in kinds if k not in RESTRICTED_VOLUMES]
    if bad:
        out.append(
            (
                "restrictedVolumes",
                "restricted volume types ("
                + ", ".join(f'volume "{n}" uses restricted volume type "{k}"' for n, k in bad)
                + ")",
            )
        )
    out += _restricted_identity(pod_sc, sc_of)
    return out


def _restricted_identity(pod_sc: Obj, sc_of: dict[str, Obj]) -> list[tuple[str, str]]:
    out = []
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    explicit_false = [n for n, sc in sc_of.items() if sc.get("runAsNonRoot") is False]
    unset = [n for n, sc in sc_of.items() if sc.get("runAsNonRoot") is None and not pod_non_root]
    if explicit_false:
        out.append(
            (
                "runAsNonRoot",
                f"runAsNonRoot != true ({_who(explicit_false)} must not set securityContext.runAsNonRoot=false)",
            )
        )
    elif unset:
        who = "pod or " + _who(unset)
        out.append(("runAsNonRoot", f"runAsNonRoot != true ({who} must set securityContext.runAsNonRoot=true)"))
    root = [n for n, sc in sc_of.items() if sc.get("runAsUser") == 0]
    if pod_sc.get("runAsUser") == 0:
        out.append(("runAsUser", "runAsUser=0 (pod must not set runAsUser=0)"))
    elif root:
        out.append(("runAsUser", f"runAsUser=0 ({_who(root)} must not set runAsUser=0)"))
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    missing = [
        n
        for n, sc in sc_of.items()
        if (sc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost")
        and not (pod_seccomp and not sc.get("seccompProfile"))
    ]
    if missing:
        out.append(
            (
                "seccompProfile_restricted",
                f"seccompProfile (pod or {_who(missing)} must set securityContext.seccompProfile.type to "
                '"RuntimeDefault" or "Localhost")',
            )
        )
    return out


def pod_security(pod: Obj, namespace: Obj) -> str | None:
    """The namespace's enforced Pod Security level, checked as the admission plugin does:
    ``violates PodSecurity "restricted:latest": <check> (<detail>), ...``, or None."""
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    level = labels.get(ENFORCE_LABEL, "privileged")
    if level not in ("baseline", "restricted"):
        return None
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    found = baseline_violations(spec, containers)
    if level == "restricted":
        found = [f for f in found if f[0] != "seccompProfile_baseline"] + _restricted(spec, containers)
    if not found:
        return None
    version = labels.get(ENFORCE_VERSION_LABEL, "latest")
    return f'violates PodSecurity "{level}:{version}": ' + ", ".join(text for _, text in sorted(found))


# -- ResourceQuota --------------------------------------------------------------------------


def _charge(pod: Obj) -> dict[str, Fraction]:
    """What one pod counts against a quota, by quota key (``cpu`` is ``requests.cpu``)."""
    out: dict[str, Fraction] = {"pods": Fraction(1)}
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for key, value in (res.get(kind) or {}).items():
                name = f"{kind}.{key}"
                out[name] = out.get(name, Fraction(0)) + parse_quantity(value)
    for key in ("cpu", "memory"):
        if f"requests.{key}" in out:
            out[key] = out[f"requests.{key}"]
    return out


def quota_used(quota: Obj, pods: Iterable[Obj]) -> dict[str, Fraction]:
    hard = (quota.get("spec") or {}).get("hard") or {}
    used = {key: Fraction(0) for key in hard}
    for p in pods:
        if is_terminated(p):
            continue
        for key, value in _charge(p).items():
            if key in used:
                used[key] += value
    return used


def _missing(pod: Obj, hard: Mapping[str, Any]) -> list[str]:
    """Quota keys on cpu/memory every container must state (the pod evaluator's constraint)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    out = []
    for key in sorted(hard):
        kind, _, resource = key.rpartition(".")
        kind = kind or "requests"
        if resource not in ("cpu", "memory") or kind not in ("requests", "limits"):
            continue
        lacking = [
            c.get("name", "") for c in containers if resource not in ((c.get("resources") or {}).get(kind) or {})
        ]
        if lacking:
            out.append(f"{key} for: {','.join(lacking)}")
    return out


def resource_quota(pod: Obj, quotas: Iterable[Obj], pods: list[Obj]) -> str | None:
    """The first quota the pod breaks: ``failed quota: q: must specify ...`` or ``exceeded
    quota: q, requested: ..., used: ..., limited: ...``; None if every quota admits it."""
    charge = _charge(pod)
    for quota in sorted(quotas, key=lambda q: q["metadata"]["name"]):
        name = quota["metadata"]["name"]
        hard = (quota.get("spec") or {}).get("hard") or {}
        missing = _missing(pod, hard)
        if missing:
            return f"failed quota: {name}: must specify {'; '.join(missing)}"
        used = quota_used(quota, pods)
        over = sorted(k for k in hard if k in charge and used[k] + charge[k] > parse_quantity(hard[k]))
        if over:

            def show(values: Mapping[str, Fraction], keys: list[str] = over) -> str:
                return ",".join(f"{k}={format_quantity(values[k], k.endswith('memory'))}" for k in keys)

            limited = {k: parse_quantity(hard[k]) for k in over}
            return f"exceeded quota: {name}, requested: {show(charge)}, used: {show(used)}, limited: {show(limited)}"
    return None
