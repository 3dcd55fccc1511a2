"""Reading a task file: bytes to a YAML value, strictly, with one-line errors.

A task file is read before any cluster exists, so whatever it hides (a duplicate key, an
alias bomb, a date where a string was meant, a file that is not UTF-8, a directory given
for the file) is refused here, with the position in the file, rather than noticed on the
nodes.  ``task`` checks the value this returns against SkyPilot's task schema.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any, ClassVar

import yaml

from pytest_sky.errors import TaskError

#: A task file this long is refused: SkyPilot's own smoke tests run a 5.5 MB script, and
#: what is larger is data, which belongs in file_mounts.
MAX_TASK_FILE_BYTES = 64 * 1024 * 1024
MAX_TASK_FILE_TEXT = f"{MAX_TASK_FILE_BYTES // (1024 * 1024)} MiB"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _LoaderRefusal(Exception):
    """A construct the task loader refuses on purpose, with where it was found."""

    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        super().__init__(message)
        self.message = message
        self.mark = mark


class _TaskLoader(yaml.SafeLoader):
    """SafeLoader without aliases, duplicate keys or dates.

    Aliases are refused because a few lines of them expand to gigabytes (the "billion
    laughs"), and a task file has no need of them. Duplicate keys are refused because
    YAML silently keeps the last one, so a second ``run:`` would drop the first without
    a word. Dates stay the text that was written, so that ``FOO: 2024-01-01`` in
    ``envs`` is passed on as written.
    """

    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {  # type: ignore[misc]
        first: [(tag, regexp) for tag, regexp in resolvers if tag != _TIMESTAMP_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise _LoaderRefusal(
                "YAML aliases (&/*) are not supported in task files (write the value out in full)",
                event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[tuple[str, str]] = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                    continue
                identity = (key_node.tag, key_node.value)
                if identity in seen:
                    raise _LoaderRefusal(
                        f"duplicate key {key_node.value!r} (YAML would silently keep only "
                        "the last one; remove or merge the repeats)",
                        key_node.start_mark,
                    )
                seen.add(identity)
        return super().construct_mapping(node, deep=deep)


def _at(mark: yaml.Mark | None) -> str:
    return "" if mark is None else f"line {mark.line + 1}, column {mark.column + 1}: "


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _yaml_error_message(err: yaml.YAMLError) -> str:
    """Turn PyYAML's multi-line report into one line that keeps the position."""
    if isinstance(err, yaml.MarkedYAMLError):
        what = "; ".join(_one_line(part) for part in (err.context, err.problem) if part)
        where = _at(err.problem_mark or err.context_mark)
        return f"{where}invalid YAML: {what or 'syntax error'}"
    if isinstance(err, yaml.reader.ReaderError):
        return (
            f"invalid YAML: character #x{err.character:04x} at offset {err.position} "
            f"is not allowed ({err.reason}); remove it"
        )
    return f"invalid YAML: {_one_line(str(err))}"


def parse_yaml(text: str) -> object:
    try:
        return yaml.load(text, Loader=_TaskLoader)  # a SafeLoader subclass
    except _LoaderRefusal as err:
        raise TaskError(f"{_at(err.mark)}{err.message}") from None
    except yaml.YAMLError as err:
        raise TaskError(_yaml_error_message(err)) from None
    except RecursionError:
        raise TaskError("YAML is nested too deeply (a task file needs only a few levels)") from None
    except (ValueError, OverflowError) as err:
        # e.g. an integer with more digits than Python converts; the rest of its
        # message is advice for programmers
        reason = _one_line(str(err)).split(";")[0]
        raise TaskError(f"invalid YAML value: {reason}") from None


def read_task_file(path: str) -> str:
    """Read at most the size limit, even from a file that lies about its size."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TaskError(
            f"task file not found: {path} (check the path; it is resolved against the "
            f"current directory {_cwd_for_message()})"
        ) from None
    except (OSError, ValueError) as err:
        raise TaskError(f"{path}: cannot read task file: {_os_reason(err)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise TaskError(
            f"{path}: is a directory, not a task file "
            f"(give the YAML file inside it, e.g. {os.path.join(path, 'task.yaml')})"
        )
    if not stat.S_ISREG(info.st_mode):
        raise TaskError(f"{path}: is not a regular file; give a YAML task file")
    too_big = TaskError(
        f"{path}: task file is larger than {MAX_TASK_FILE_BYTES} bytes ({MAX_TASK_FILE_TEXT}); "
        "a task file holds settings, so keep data in file_mounts"
    )
    if info.st_size > MAX_TASK_FILE_BYTES:
        raise too_big
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_TASK_FILE_BYTES + 1)
    except OSError as err:
        raise TaskError(f"{path}: cannot read task file: {_os_reason(err)}") from None
    if len(data) > MAX_TASK_FILE_BYTES:
        raise too_big
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise TaskError(
            f"{path}: task file is not valid UTF-8 (byte 0x{data[err.start]:02x} at "
            f"offset {err.start}); save it as UTF-8"
        ) from None


def _os_reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return _one_line(str(err))


def _cwd_for_message() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "(which no longer exists)"
