"""Resource requests of a task: CPUs, memory, accelerators and where to run.

The syntax follows SkyPilot's task YAML so that a file written for ``sky launch`` loads
here unchanged, as long as it asks for something the local and Kubernetes backends can
provide. Every value is checked when it is read, so that a typo fails before any node is
started, and every error names the key, the value and a form that would have worked.
The checks are written by hand rather than as a pydantic schema; the docstring of
``pytest_sky.task`` says why, with the measurements.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_sky import registry
from pytest_sky.errors import ResourcesError

# Bounds that no real node has; a value past them is a typo (an extra zero, MB for GB).
MAX_ACCELERATOR_COUNT = 1024
MAX_CPUS = 1024
MAX_MEMORY_GB = 65536

#: SkyPilot's other clouds: a task that names one (SkyPilot's own examples often do) is
#: accepted and runs on the selected backend, with a note (``settings.Settings.for_task``).
OTHER_CLOUDS = (
    "aws", "gcp", "azure", "lambda", "ibm", "oci", "scp", "runpod", "vsphere", "cudo", "fluidstack",
    "paperspace", "do", "nebius", "vast", "hyperbolic", "seeweb", "primeintellect", "ssh",
)  # fmt: skip
#: SkyPilot's other resources keys: accepted and checked, with a note that they have no
#: effect here (a test cluster has no ports to open, no spot market, no disk to size).
INERT_RESOURCE_KEYS = ("disk_size", "instance_type", "job_recovery", "labels", "ports", "use_spot")
#: Lists of alternatives (SkyPilot's any_of / ordered): the first one is used here.
CHOICE_KEYS = ("any_of", "ordered")
RESOURCE_KEYS = ("accelerators", "cloud", "cpus", "image_id", "infra", "memory", *INERT_RESOURCE_KEYS, *CHOICE_KEYS)
# Keys that people reach for by habit; difflib alone would not map them to the right one.
_RESOURCE_KEY_HINTS = {
    "gpus": "accelerators",
    "gpu": "accelerators",
    "image": "image_id",
}

_ACCELERATOR_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Digits only: float() would also take '1_0', '1e3', '-1', 'inf' and 'nan', none of which
# anyone means in a resource request.
_PLAIN_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)")
_ACCELERATOR_EXAMPLE = "e.g. V100, V100:2, V100:0.5 or {A100: 8}"
_VALUE_DISPLAY_LIMIT = 60


def format_value(value: object) -> str:
    """Render a user-supplied value for an error message.

    Messages must stay on one line and short whatever the user wrote, so this uses repr
    (which escapes newlines inside strings) and cuts long values off.
    """
    try:
        text = repr(value)
    except ValueError:  # an int past Python's limit on digits in str()
        text = f"<{type(value).__name__}>"
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if len(text) > _VALUE_DISPLAY_LIMIT:
        text = text[: _VALUE_DISPLAY_LIMIT - 3] + "..."
    return text


def format_number(value: float) -> str:
    """Print 2.0 as '2' and 0.5 as '0.5', the way users write these numbers in YAML."""
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def unknown_key_message(
    key: object,
    where: str,
    allowed: Iterable[str],
    hints: Mapping[str, str] | None = None,
) -> str:
    """Build the message for a key that is not allowed, with the nearest allowed one.

    Shared by the task and resources levels so that both read the same way.
    """
    allowed = sorted(allowed)
    message = f"unknown key {format_value(key)} in {where}; allowed keys: {', '.join(allowed)}"
    if isinstance(key, str):
        suggestion = (hints or {}).get(key.lower())
        message += f"; did you mean {suggestion!r}?" if suggestion else _did_you_mean(key.lower(), allowed, "; ")
    return message


def _did_you_mean(word: str, choices: Iterable[str], lead: str = " ") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"{lead}did you mean {close[0]!r}?" if close else ""


def _accelerator_error(key: str, value: object, problem: str) -> ResourcesError:
    return ResourcesError(f"{key} {problem}, got {format_value(value)} ({_ACCELERATOR_EXAMPLE})")


def _check_accelerator(name: object, count: object, key: str, original: object) -> float:
    """Validate one accelerator request and return its count as a float.

    Used both when parsing user input and when an :class:`Accelerator` is built directly,
    so that no invalid request can exist whichever way it was made.
    """
    if not isinstance(name, str) or not _ACCELERATOR_NAME.fullmatch(name):
        raise _accelerator_error(key, original, "name may only contain letters, digits, '_', '.' and '-'")
    if isinstance(count, str):
        text = count.strip()
        if not _PLAIN_NUMBER.fullmatch(text):
            raise _accelerator_error(key, original, "count must be a positive number")
        count = float(text)
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        raise _accelerator_error(key, original, "count must be a positive number")
    try:
        number = float(count)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _accelerator_error(key, original, "count must be a finite number")
    if number <= 0:
        raise _accelerator_error(key, original, "count must be greater than 0")
    if number > MAX_ACCELERATOR_COUNT:
        raise _accelerator_error(key, original, f"count must be at most {MAX_ACCELERATOR_COUNT}")
    if number > 1 and not number.is_integer():
        raise _accelerator_error(
            key,
            original,
            "count must be a whole number, or a fraction below 1 to share one device",
        )
    return number


@dataclass(frozen=True)
class Accelerator:
    """An accelerator type and how many of it one node asks for.

    Counts below 1 are kept as requested (several tasks share one device); scheduling
    needs whole devices, which is what :meth:`per_node_ceiling` is for.
    """

    name: str
    count: float

    def __post_init__(self) -> None:
        shown = f"{self.name}:{self.count}"
        count = _check_accelerator(self.name, self.count, "accelerator", shown)
        object.__setattr__(self, "count", count)

    def per_node_ceiling(self) -> int:
        """Whole devices a node must have for this request (0.5 still needs one)."""
        return math.ceil(self.count)

    def __str__(self) -> str:
        return f"{self.name}:{format_number(self.count)}"


def _parse_accelerator_text(text: str, key: str, original: object) -> Accelerator:
    text = text.strip()
    if not text:
        raise _accelerator_error(key, original, "must not be empty; give NAME or NAME:COUNT")
    name, sep, count_text = text.partition(":")
    count: object = count_text if sep else 1
    if sep and ":" in count_text:
        raise _accelerator_error(key, original, "must be NAME or NAME:COUNT")
    name = name.strip()
    return Accelerator(name, _check_accelerator(name, count, key, original))


def parse_accelerators(value: object, key: str = "resources.accelerators") -> Accelerator | None:
    """Read an accelerator request in any of the forms SkyPilot task files use.

    ``key`` is the name the user wrote (``gpus`` for a marker argument), so that the error
    points at their own spelling. Candidate sets (several types, any one will do) are
    refused: a test cluster must be reproducible, so it asks for exactly one type.
    """
    if value is None:
        return None
    if isinstance(value, Accelerator):
        return value
    if isinstance(value, str):
        return _parse_accelerator_text(value, key, value)
    if isinstance(value, Mapping):
        if len(value) != 1:
            raise _accelerator_error(
                key,
                value,
                "must name exactly one accelerator type (candidate sets are not supported)",
            )
        ((name, count),) = value.items()
        if not isinstance(name, str):
            raise _accelerator_error(key, value, "name must be a string")
        if count is None:
            # YAML reads the flow form `{A100:8}` as {"A100:8": None}.
            return _parse_accelerator_text(name, key, value)
        name = name.strip()
        return Accelerator(name, _check_accelerator(name, count, key, value))
    raise _accelerator_error(key, value, "must be NAME or NAME:COUNT, or a mapping {NAME: COUNT}")


def _parse_amount(value: object, key: str, limit: float, unit: str, example: str) -> float:
    """Read a CPU or memory amount: a number, a numeric string, or SkyPilot's 'N+'.

    'N+' means "at least N"; nodes here are made to measure, so at least N is N.
    """
    number: float | None = None
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("+"):
            text = text[:-1].rstrip()
        if _PLAIN_NUMBER.fullmatch(text):
            number = float(text)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
    if number is None or not math.isfinite(number) or not 0 < number <= limit:
        raise ResourcesError(
            f"{key} must be a number{unit} greater than 0 and at most {format_number(limit)}, "
            f"or 'N+' meaning at least N, got {format_value(value)} (e.g. {example})"
        )
    return number


def _parse_cpus(value: object, key: str) -> float:
    return _parse_amount(value, key, MAX_CPUS, "", "2 or '4+'")


def _parse_memory(value: object, key: str) -> float:
    return _parse_amount(value, key, MAX_MEMORY_GB, " of GB", "8 or '16+'")


def _parse_infra(value: object, key: str) -> tuple[str, str | None]:
    """Split ``k8s/my-context`` into the normalised infra and the Kubernetes context."""
    known = ", ".join(registry.spellings())
    if not isinstance(value, str):
        raise ResourcesError(f"{key} must be one of {known} (or kubernetes/CONTEXT), got {format_value(value)}")
    base, sep, context = value.strip().partition("/")
    base = base.strip().lower()
    if base in OTHER_CLOUDS:
        return base, None  # its region/zone part means nothing here
    if base not in registry.spellings():
        raise ResourcesError(
            f"{key} must be one of {known} (or kubernetes/CONTEXT) or a SkyPilot cloud such as aws, "
            f"got {format_value(value)}{_did_you_mean(base, (*registry.spellings(), *OTHER_CLOUDS))}"
        )
    base = registry.canonical(base)
    if not sep:
        return base, None
    _check_context(base, context, key, value)
    return base, context


def _check_context(infra: str, context: object, key: str, original: object) -> None:
    if not registry.lookup(infra).takes_context:
        raise ResourcesError(
            f"{key} takes a /CONTEXT part only for kubernetes, got {format_value(original)} "
            "(e.g. k8s/my-context, or just local)"
        )
    if not isinstance(context, str) or not context or any(ch.isspace() or not ch.isprintable() for ch in context):
        raise ResourcesError(
            f"{key} needs a Kubernetes context name without spaces after '/', "
            f"got {format_value(original)} (e.g. k8s/my-context)"
        )


#: Each inert key's form (as SkyPilot checks it) and an example for the message.
_INERT_FORMS: dict[str, tuple[Callable[[object], bool], str]] = {
    "use_spot": (lambda v: isinstance(v, bool), "true"),
    "disk_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "256"),
    "instance_type": (lambda v: isinstance(v, str) and bool(v.strip()), "p3.2xlarge"),
    "labels": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v), "{team: ml}"),
    "ports": (lambda v: isinstance(v, (int, str, list)) and not isinstance(v, bool), "8080 or [8080, '9000-9010']"),
    "job_recovery": (lambda v: isinstance(v, (str, Mapping)), "FAILOVER"),
}


def _check_inert(name: str, value: object, key: str) -> str:
    """Check one of SkyPilot's keys that have no effect here, as SkyPilot would; its name."""
    valid, example = _INERT_FORMS[name]
    if not valid(value):
        raise ResourcesError(f"{key} has the wrong form, got {format_value(value)} (e.g. {name}: {example})")
    return name


def _first_choice(d: Mapping[str, object], where: str) -> Resources | None:
    """The first alternative of ``any_of``/``ordered`` (the one a backend here can satisfy)."""
    given = [k for k in CHOICE_KEYS if k in d]
    if not given:
        return None
    if len(given) > 1:
        raise ResourcesError(f"{where} gives both any_of and ordered; give one list of alternatives")
    key = given[0]
    options = d[key]
    if not isinstance(options, list) or not options or not all(isinstance(o, Mapping) for o in options):
        raise ResourcesError(
            f"{where}.{key} must be a list of resources mappings, got {format_value(options)} "
            f"(e.g. {key}: [{{accelerators: A100:1}}, {{accelerators: V100:1}}])"
        )
    for i, option in enumerate(options):
        if any(k in option for k in CHOICE_KEYS):
            raise ResourcesError(f"{where}.{key}[{i}] cannot hold another any_of or ordered")
    alternatives = [Resources.from_dict(o, f"{where}.{key}[{i}]") for i, o in enumerate(options)]
    return alternatives[0]


def _check_image_id(value: object, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ResourcesError(
            f"{key} must be a non-empty image name, got {format_value(value)} (e.g. docker:python:3.11-slim)"
        )
    return value.strip()


@dataclass(frozen=True)
class Resources:
    """What each node of a task needs, and where the nodes should run.

    ``None`` means "not asked for", which is different from a default: merging a marker's
    request over a task file's must only replace what the marker actually set.
    ``infra_context`` holds the Kubernetes context of ``infra: k8s/CONTEXT``.
    """

    cpus: float | None = None
    memory: float | None = None
    accelerators: Accelerator | None = None
    infra: str | None = None
    image_id: str | None = None
    infra_context: str | None = None
    #: What the request said that has no effect here (``use_spot``, ``any_of``, ...), for the
    #: one-line note a launch prints; not part of the request itself.
    inert: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        # Direct construction gets the same checks as YAML, and the same normal form, so
        # that two equal requests compare equal however they were written.
        set_field = object.__setattr__
        if self.cpus is not None:
            set_field(self, "cpus", _parse_cpus(self.cpus, "cpus"))
        if self.memory is not None:
            set_field(self, "memory", _parse_memory(self.memory, "memory"))
        if self.accelerators is not None:
            set_field(
                self,
                "accelerators",
                parse_accelerators(self.accelerators, "accelerators"),
            )
        if self.image_id is not None:
            set_field(self, "image_id", _check_image_id(self.image_id, "image_id"))
        if self.infra is None:
            if self.infra_context is not None:
                raise ResourcesError(
                    f"infra_context is set to {format_value(self.infra_context)} without infra "
                    "(give infra='k8s/CONTEXT' instead)"
                )
            return
        infra, context = _parse_infra(self.infra, "infra")
        if context is not None and self.infra_context not in (None, context):
            raise ResourcesError(
                f"infra {format_value(self.infra)} and infra_context "
                f"{format_value(self.infra_context)} name different contexts; give only one"
            )
        context = context if context is not None else self.infra_context
        if context is not None:
            _check_context(infra, context, "infra_context", context)
        set_field(self, "infra", infra)
        set_field(self, "infra_context", context)

    @classmethod
    def from_dict(cls, d: Mapping[str, object] | None, where: str = "resources") -> Resources:
        """Read the ``resources:`` section of a task file.

        ``where`` prefixes every key in messages, so that the user finds the line to fix.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ResourcesError(
                f"{where} must be a mapping such as {{cpus: 2, accelerators: V100:1}}, got {format_value(d)}"
            )
        for key in d:
            if key not in RESOURCE_KEYS:
                raise ResourcesError(unknown_key_message(key, where, RESOURCE_KEYS, _RESOURCE_KEY_HINTS))
        inert = tuple(_check_inert(key, d[key], f"{where}.{key}") for key in INERT_RESOURCE_KEYS if key in d)
        choice = _first_choice(d, where)
        if choice is not None:
            plain = {k: v for k, v in d.items() if k not in (*CHOICE_KEYS, *INERT_RESOURCE_KEYS)}
            first = cls.from_dict(plain, where).merge(choice)
            return dataclasses.replace(first, inert=(*inert, *choice.inert, *(k for k in CHOICE_KEYS if k in d)))
        cpus = d.get("cpus")
        memory = d.get("memory")
        image_id = d.get("image_id")
        infra, context = None, None
        for key in ("infra", "cloud"):
            value = d.get(key)
            if value is None:
                continue
            parsed = _parse_infra(value, f"{where}.{key}")
            if infra is not None and parsed != (infra, context):
                raise ResourcesError(
                    f"{where}.infra {format_value(d['infra'])} and {where}.cloud "
                    f"{format_value(d['cloud'])} disagree; give only one (cloud is an alias of infra)"
                )
            infra, context = parsed
        return cls(
            cpus=None if cpus is None else _parse_cpus(cpus, f"{where}.cpus"),
            memory=None if memory is None else _parse_memory(memory, f"{where}.memory"),
            accelerators=parse_accelerators(d.get("accelerators"), f"{where}.accelerators"),
            infra=infra,
            image_id=None if image_id is None else _check_image_id(image_id, f"{where}.image_id"),
            infra_context=context,
            inert=inert,
        )

    @classmethod
    def from_kwargs(
        cls,
        gpus: object = None,
        cpus: object = None,
        memory: object = None,
        accelerators: object = None,
    ) -> Resources:
        """Read a request given as keyword arguments (the pytest marker and fixture).

        Messages use the argument names as the user typed them, ``gpus`` included.
        """
        if gpus is not None and accelerators is not None:
            raise ResourcesError(
                f"give gpus= or accelerators=, not both (gpus is an alias of accelerators), "
                f"got gpus={format_value(gpus)} and accelerators={format_value(accelerators)}"
            )
        key, value = ("gpus", gpus) if gpus is not None else ("accelerators", accelerators)
        return cls(
            cpus=None if cpus is None else _parse_cpus(cpus, "cpus"),
            memory=None if memory is None else _parse_memory(memory, "memory"),
            accelerators=parse_accelerators(value, key),
        )

    @property
    def gpus_per_node(self) -> int:
        """Whole devices each node must have; a fractional request still needs one."""
        return 0 if self.accelerators is None else self.accelerators.per_node_ceiling()

    def describe(self, num_nodes: int, cloud_label: str) -> str:
        """Summarise the request the way ``sky status`` does, e.g. ``2x Local(2CPU--V100:0.5)``.

        The requested accelerator count is shown, not the rounded-up one, because that is
        what the user wrote and will look for.
        """
        parts = []
        if self.cpus is not None:
            parts.append(f"{format_number(self.cpus)}CPU")
        if self.memory is not None:
            parts.append(f"{format_number(self.memory)}GB")
        if self.accelerators is not None:
            parts.append(str(self.accelerators))
        label = f"{num_nodes}x {cloud_label}"
        return f"{label}({'--'.join(parts)})" if parts else label

    def merge(self, other: Resources) -> Resources:
        """Return this request with every field that ``other`` sets replaced by its value.

        The Kubernetes context goes with ``infra``: overriding the infra drops a context
        that belonged to the old one.
        """
        if not isinstance(other, Resources):
            raise ResourcesError(f"can only merge Resources, got {format_value(other)}")
        changes: dict[str, Any] = {
            field.name: getattr(other, field.name)
            for field in dataclasses.fields(other)
            if field.name not in ("infra_context", "inert") and getattr(other, field.name) is not None
        }
        changes["inert"] = tuple(dict.fromkeys((*self.inert, *other.inert)))
        if other.infra is not None:
            changes["infra_context"] = other.infra_context
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        """The ``resources:`` section that :meth:`from_dict` reads back to an equal request."""
        result: dict[str, object] = {}
        if self.cpus is not None:
            result["cpus"] = _plain(self.cpus)
        if self.memory is not None:
            result["memory"] = _plain(self.memory)
        if self.accelerators is not None:
            result["accelerators"] = str(self.accelerators)
        if self.infra is not None:
            result["infra"] = self.infra if self.infra_context is None else f"{self.infra}/{self.infra_context}"
        if self.image_id is not None:
            result["image_id"] = self.image_id
        return result


def _plain(value: float) -> int | float:
    """2.0 -> 2 so that a dumped task file reads like one a person wrote."""
    return int(value) if value.is_integer() else value
