"""Generated cluster names: ``sky-<label>-<token>``, the token 48 random bits.

Two CI pipelines that share a namespace must never pick the same name for clusters they run
at once: each generated name ends in 12 hex characters from :mod:`secrets` (a pair of
names meets with a chance of 2^-48), and that token is the one part no length bound cuts: a
name becomes ``<name>-worker<i>``, a DNS label of at most 63 characters, so names stay
within :data:`MAX_LENGTH` characters and it is the label that is shortened.  Should a
generated name be taken all the same, the launch draws another (``cluster.bring_up``).
"""

from __future__ import annotations

import re
import secrets

from pytest_sky.errors import TaskError

#: Random bytes in a generated name: 48 bits, 12 hex characters.
TOKEN_BYTES = 6
#: The longest cluster name: ``<name>-worker<i>`` must stay a DNS label, and a pod's
#: hostname one too.
MAX_LENGTH = 40
PREFIX = "sky"
_NAME = re.compile(rf"^[a-z]([a-z0-9-]{{0,{MAX_LENGTH - 2}}}[a-z0-9])?$")


def validate(name: str) -> str:
    """Cluster names become hostnames (``<name>-worker12``) and Kubernetes object names."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise TaskError(
            f"invalid cluster name {name!r}: use 1-{MAX_LENGTH} lower-case letters, digits and '-', "
            "starting with a letter and not ending with '-' (e.g. 'dev-2')"
        )
    return name


def token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def slug(text: str, limit: int) -> str:
    """``text`` as lower-case words joined by ``-``, at most ``limit`` characters, without a
    leading ``test``: a test's name reads ``sky-partition-...`` rather than ``sky-test-...``."""
    out = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    out = re.sub(r"^test-?", "", out) or "t"
    return out[:limit].strip("-") or "t"


def label(name: str, worker: str = "", index: int = 0) -> str:
    """What a generated name says before its token: a test's (or a shared scope's) name,
    the xdist worker, the test's how-manieth cluster."""
    return "-".join(part for part in (slug(name, 18), worker, str(index) if index else "") if part)


def generate(*labels: str) -> str:
    """``sky-<labels...>-<token>``: the labels (each already a slug, empty ones left out)
    shortened to fit :data:`MAX_LENGTH`, the token whole."""
    tok = token()
    prefix = "-".join([PREFIX, *(label for label in labels if label)])
    room = MAX_LENGTH - len(tok) - 1
    return f"{prefix[:room].rstrip('-')}-{tok}"
