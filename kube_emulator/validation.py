"""What the API server checks and fills in on a new object, before admission sees it.

Validation answers with the real server's 422 field errors (their texts are what a client
shows), and defaulting fills in what a real server does, so a pod read back looks like one
from a cluster.  Pure functions of the object: nothing here reads the store.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterable
from typing import Any

from kube_emulator import scheduler
from kube_emulator.api import ApiError, invalid
from kube_emulator.store import Obj

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"


def dns_errors(value: str, path: str, kind: str) -> list[tuple[str, str]]:
    if kind == "subdomain":
        ok = len(value) <= 253 and re.fullmatch(_DNS1123_SUBDOMAIN, value)
        text = (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
            f"validation is '{_DNS1123_SUBDOMAIN}')"
        )
    elif kind == "label":
        ok = len(value) <= 63 and re.fullmatch(_DNS1123_LABEL, value)
        text = (
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
            f"start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
            f"validation is '{_DNS1123_LABEL}')"
        )
    else:
        ok = len(value) <= 63 and re.fullmatch(_DNS1035_LABEL, value)
        text = (
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
            "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
            f"regex used for validation is '{_DNS1035_LABEL}')"
        )
    return [] if ok else [(path, f'Invalid value: "{value}": {text}')]


def label_errors(labels: Any, path: str) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if labels is None:
        return errors
    if not isinstance(labels, dict):
        return [(path, "Invalid value: must be a map of strings")]
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (
            (prefix and not re.fullmatch(_DNS1123_SUBDOMAIN, prefix))
            or len(name) > 63
            or not re.fullmatch(_LABEL_NAME, name)
        ):
            errors.append(
                (
                    path,
                    f'Invalid value: "{key}": name part must consist of alphanumeric characters, '
                    "'-', '_' or '.', and must start and end with an alphanumeric character",
                )
            )
        if not isinstance(value, str) or len(value) > 63 or (value and not re.fullmatch(_LABEL_NAME, value)):
            errors.append(
                (
                    f"{path}",
                    f'Invalid value: "{value}": a valid label must be an empty string or '
                    "consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
                    "an alphanumeric character",
                )
            )
    return errors


def prepare_pod(pod: Obj) -> None:
    """Validate and default a new pod as the API server's admission and defaulting do."""
    meta, spec = pod["metadata"], pod.get("spec")
    name = meta["name"]
    errors = dns_errors(name, "metadata.name", "subdomain")
    errors += label_errors(meta.get("labels"), "metadata.labels")
    if not isinstance(spec, dict):
        raise invalid("Pod", name, [*errors, ("spec.containers", "Required value")])
    containers = spec.get("containers")
    if not containers or not isinstance(containers, list):
        errors.append(("spec.containers", "Required value"))
        containers = []
    volume_names, volume_errors = _volume_errors(spec.get("volumes") or [])
    errors += volume_errors
    seen: set[str] = set()
    for i, c in enumerate(containers):
        errors += _container_errors(f"spec.containers[{i}]", c, seen, volume_names)
    for field in ("hostname", "subdomain"):
        if spec.get(field):
            errors += dns_errors(spec[field], f"spec.{field}", "label")
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and (not isinstance(deadline, int) or not 1 <= deadline <= 2**31 - 1):
        errors.append(
            ("spec.activeDeadlineSeconds", f"Invalid value: {deadline}: must be between 1 and 2147483647, inclusive")
        )
    policy = spec.get("restartPolicy")
    if policy not in (None, "Always", "OnFailure", "Never"):
        errors.append(
            (
                "spec.restartPolicy",
                f'Unsupported value: "{policy}": supported values: "Always", "OnFailure", "Never"',
            )
        )
    if errors:
        raise invalid("Pod", name, errors)
    default_pod_spec(spec, containers)
    pod["status"] = {"phase": "Pending", "qosClass": qos_class(containers)}


def owner_reference_errors(meta: Obj) -> list[tuple[str, str]]:
    """``metadata.ownerReferences`` as apimachinery's ValidateOwnerReferences checks them:
    apiVersion, kind, name and uid each present, at most one controller."""
    errors: list[tuple[str, str]] = []
    refs = meta.get("ownerReferences") or []
    path = "metadata.ownerReferences"
    for ref in refs:
        if not isinstance(ref, dict):
            return [(path, "Invalid value: an owner reference must be an object")]
        if not str(ref.get("apiVersion") or "").rpartition("/")[2]:
            errors.append(
                (f"{path}.apiVersion", f'Invalid value: "{ref.get("apiVersion", "")}": version must not be empty')
            )
        if not ref.get("kind"):
            errors.append((f"{path}.kind", 'Invalid value: "": kind must not be empty'))
        if not ref.get("name"):
            errors.append((f"{path}.name", 'Invalid value: "": name must not be empty'))
        if not ref.get("uid"):
            errors.append((f"{path}.uid", 'Invalid value: "": uid must not be empty'))
    controllers = [r for r in refs if isinstance(r, dict) and r.get("controller")]
    if len(controllers) > 1:
        names = ", ".join(f"{r.get('kind')}/{r.get('name')}" for r in controllers)
        errors.append((path, f"Invalid value: Only one reference can have Controller set to true. Found {names}"))
    return errors


#: A Lease's MicroTime fields (coordination.k8s.io/v1), RFC 3339 with microseconds.
_MICRO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})")


def prepare_lease(lease: Obj) -> None:
    """A Lease as coordination.k8s.io/v1's validation takes it: its spec's durations positive,
    its times RFC 3339 (``MicroTime``)."""
    name = lease["metadata"]["name"]
    errors = dns_errors(name, "metadata.name", "subdomain")
    errors += label_errors(lease["metadata"].get("labels"), "metadata.labels")
    spec = lease.get("spec") or {}
    for key in ("leaseDurationSeconds", "leaseTransitions"):
        value = spec.get(key)
        low = 1 if key == "leaseDurationSeconds" else 0
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            errors.append(
                (f"spec.{key}", f"Invalid value: {value}: must be greater than {'0' if low else 'or equal to 0'}")
            )
    for key in ("acquireTime", "renewTime"):
        value = spec.get(key)
        if value is not None and not (isinstance(value, str) and _MICRO_TIME.fullmatch(value)):
            raise ApiError(
                400,
                "BadRequest",
                f'Lease in version "v1" cannot be handled as a Lease: parsing time "{value}" as '
                '"2006-01-02T15:04:05.000000Z07:00": cannot parse',
            )
    if errors:
        raise invalid("Lease", name, errors)


def prepare_claim(claim: Obj) -> None:
    """A claim needs access modes and a storage request, and is bound at once (the
    emulator provisions a directory of its own for it when a pod first mounts it)."""
    name = claim["metadata"]["name"]
    spec = claim.get("spec") or {}
    errors = dns_errors(name, "metadata.name", "subdomain")
    modes = spec.get("accessModes") or []
    if not modes:
        errors.append(("spec.accessModes", "Required value: at least 1 access mode is required"))
    allowed = ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod")
    errors += [("spec.accessModes", f'Unsupported value: "{m}"') for m in modes if m not in allowed]
    if not ((spec.get("resources") or {}).get("requests") or {}).get("storage"):
        errors.append(("spec.resources[storage]", "Required value"))
    if errors:
        raise invalid("PersistentVolumeClaim", name, errors)
    claim["status"] = {"phase": "Bound", "accessModes": list(modes)}


def prepare_secret(secret: Obj) -> None:
    name = secret["metadata"]["name"]
    errors = dns_errors(name, "metadata.name", "subdomain")
    errors += label_errors(secret["metadata"].get("labels"), "metadata.labels")
    data = secret.get("data") or {}
    for key, value in (secret.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    total = 0
    for key, value in data.items():
        if not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
            errors.append(
                (
                    f"data[{key}]",
                    f'Invalid value: "{key}": a valid config key must consist of '
                    "alphanumeric characters, '-', '_' or '.'",
                )
            )
        try:
            total += len(base64.b64decode(str(value), validate=True))
        except (binascii.Error, ValueError):
            raise ApiError(
                400,
                "BadRequest",
                f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data in data[{key}]',
            ) from None
    if total > 1024 * 1024:
        errors.append(("data", "Too long: must have at most 1048576 bytes"))
    if errors:
        raise invalid("Secret", name, errors)
    secret["data"] = data
    secret.setdefault("type", "Opaque")


def prepare_service(svc: Obj, allocate_ip: Callable[[], str]) -> None:
    """Validate and default a new Service; ``allocate_ip`` hands out its cluster IP (unless
    it is headless)."""
    name = svc["metadata"]["name"]
    errors = dns_errors(name, "metadata.name", "dns1035")
    errors += label_errors(svc["metadata"].get("labels"), "metadata.labels")
    spec = svc.setdefault("spec", {})
    for i, port in enumerate(spec.get("ports") or []):
        number = port.get("port")
        if not isinstance(number, int) or not 0 < number < 65536:
            errors.append((f"spec.ports[{i}].port", f"Invalid value: {number}: must be between 1 and 65535, inclusive"))
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", number)
    if not spec.get("ports") and spec.get("clusterIP") != "None":
        errors.append(("spec.ports", "Required value"))
    if errors:
        raise invalid("Service", name, errors)
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    if spec.get("clusterIP") != "None":
        spec["clusterIP"] = allocate_ip()
    spec["clusterIPs"] = [spec["clusterIP"]]
    svc["status"] = {"loadBalancer": {}}


def qos_class(containers: Iterable[dict[str, Any]]) -> str:
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_set = True
        for rname in ("cpu", "memory"):
            if rname not in lim or str(req.get(rname, lim.get(rname))) != str(lim.get(rname)):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def _volume_errors(volumes: list[Obj]) -> tuple[set[str], list[tuple[str, str]]]:
    """The pod's volume names, and what is wrong with them."""
    errors: list[tuple[str, str]] = []
    volume_names: set[str] = set()
    for i, vol in enumerate(volumes):
        vname = vol.get("name") or ""
        errors += dns_errors(vname, f"spec.volumes[{i}].name", "label")
        if vname in volume_names:
            errors.append((f"spec.volumes[{i}].name", f'Duplicate value: "{vname}"'))
        volume_names.add(vname)
    return volume_names, errors


def _container_errors(path: str, c: Obj, seen: set[str], volume_names: set[str]) -> list[tuple[str, str]]:
    """What is wrong with one container (``seen``: the names of those before it, added to)."""
    errors: list[tuple[str, str]] = []
    cname = c.get("name") or ""
    if not cname:
        errors.append((f"{path}.name", "Required value"))
    else:
        errors += dns_errors(cname, f"{path}.name", "label")
    if cname in seen:
        errors.append((f"{path}.name", f'Duplicate value: "{cname}"'))
    seen.add(cname)
    if not c.get("image"):
        errors.append((f"{path}.image", "Required value"))
    for j, vm in enumerate(c.get("volumeMounts") or []):
        if vm.get("name") not in volume_names:
            errors.append((f"{path}.volumeMounts[{j}].name", f'Not found: "{vm.get("name")}"'))
        if not str(vm.get("mountPath") or "").startswith("/"):
            errors.append((f"{path}.volumeMounts[{j}].mountPath", "Invalid value: must be an absolute path"))
    return errors + _resource_errors(path, c.get("resources") or {})


def _resource_errors(path: str, resources: Obj) -> list[tuple[str, str]]:
    """A container's requests and limits: quantities that parse, requests within limits,
    extended resources (``vendor/name``) with a limit equal to the request."""
    errors: list[tuple[str, str]] = []
    parsed: dict[str, dict[str, Any]] = {}
    for kind in ("requests", "limits"):
        for rname, qty in (resources.get(kind) or {}).items():
            try:
                parsed.setdefault(kind, {})[rname] = scheduler.parse_quantity(qty)
            except scheduler.QuantityError as exc:
                errors.append((f"{path}.resources.{kind}[{rname}]", f'Invalid value: "{qty}": {exc}'))
    req, lim = parsed.get("requests", {}), parsed.get("limits", {})
    for rname, value in req.items():
        if rname in lim and value > lim[rname]:
            errors.append(
                (
                    f"{path}.resources.requests",
                    f'Invalid value: "{resources["requests"][rname]}": must be '
                    f"less than or equal to {rname} limit of {resources['limits'][rname]}",
                )
            )
        if "/" in rname and not rname.startswith("kubernetes.io/") and rname in lim and value != lim[rname]:
            errors.append(
                (
                    f"{path}.resources.requests[{rname}]",
                    f'Invalid value: "{resources["requests"][rname]}": '
                    f"must be equal to {rname} limit of {resources['limits'][rname]}",
                )
            )
        if "/" in rname and rname not in lim:
            errors.append(
                (
                    f"{path}.resources.limits",
                    "Required value: Limit must be set for non overcommitable resources",
                )
            )
    return errors


def default_pod_spec(spec: Obj, containers: list[Obj]) -> None:
    """The API server's defaulting of a valid pod's spec."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("serviceAccountName", "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    tolerations = spec.setdefault("tolerations", [])
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if not any(t.get("key") == key for t in tolerations):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300})
    for c in containers:
        image = c["image"]
        tag = image.rsplit("/", 1)[-1]
        c.setdefault(
            "imagePullPolicy",
            "Always" if (":" not in tag or tag.endswith(":latest")) and "@" not in tag else "IfNotPresent",
        )
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        res = c.setdefault("resources", {})
        if res.get("limits"):
            requests = res.setdefault("requests", {})
            for rname, qty in res["limits"].items():
                requests.setdefault(rname, qty)
