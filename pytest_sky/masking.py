"""A task's secrets, masked in what a rank prints: ``***`` where a value stood.

A CI user expects what their CI system does with a masked secret, so a secret's value is
replaced where a rank's output is first collected, on the head (``agent.rank.Rank``): every
record made from it (the job's ``run.log`` and ``events.jsonl``, the events the client reads,
``RunResult.output``, each ``RankResult.stdout``, the JUnit XML and the artifacts) then holds
``***``.  The program itself still gets the real value in its environment.

A value shorter than :data:`MIN_MASKED` characters is not masked (masking ``1`` or ``on``
would blot out the log); the client says so in one line when the task runs
(:func:`too_short`).  Each line of a multi-line value (a PEM key) is masked on its own too,
as output is collected line by line.

Shipped inside the node agent (``python -I -S``): stdlib only, importing nothing but
``protocol`` (which the agent has loaded already).
"""

from __future__ import annotations

from pytest_sky.protocol import SECRET_SHOWN

TYPE_CHECKING = False  # typing's own would cost its import on the agent's every run
if TYPE_CHECKING:
    from collections.abc import Mapping

#: What stands where a secret's value was printed.
MASK = SECRET_SHOWN
#: The shortest value that is masked.
MIN_MASKED = 4


def masked_values(secrets: Mapping[str, str]) -> list[str]:
    """The strings to replace: each value and each line of one, if at least
    :data:`MIN_MASKED` long, longest first (so that no shorter one cuts a longer apart)."""
    found: set[str] = set()
    for value in secrets.values():
        for part in (value, *value.splitlines()):
            if len(part) >= MIN_MASKED:
                found.add(part)
    return sorted(found, key=len, reverse=True)


def mask(text: str, values: list[str]) -> str:
    """``text`` with every one of ``values`` (:func:`masked_values`) replaced by :data:`MASK`."""
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    return text


def too_short(secrets: Mapping[str, str]) -> list[str]:
    """The names of the secrets whose value, or a line of it, is too short to be masked."""
    return sorted(
        name
        for name, value in secrets.items()
        if len(value) < MIN_MASKED or any(0 < len(line) < MIN_MASKED for line in value.splitlines())
    )
