"""The task: which commands to run, on how many nodes, with what resources.

It reads the subset of SkyPilot's task YAML that a test cluster needs, so that a task
file written for ``sky launch`` can be tested here as is. Loading is strict wherever a
silent mistake would only show up after a cluster has been started: unknown or
duplicate keys, values of the wrong type and paths that do not exist are errors, each
reported on one line that names the key, the value and what to write instead.

Why hand-written checks rather than pydantic (DESIGN 2b prefers a library; measured and
decided against).  Of the 59 messages here and in ``resources``, 48 name the fix in
SkyPilot's own terms (``num_nodes: 2``, ``V100:0.5``, ``did you mean 'num_nodes'?``), so a
formatter over pydantic's errors would still need one message per field and error type.
Most checks lie outside any schema: the YAML loader (aliases and the billion laughs,
duplicate keys, dates, depth, 5000-digit integers: 76 lines), reading the file (size,
UTF-8, directories: 55), task-relative paths (67), env names and SkyPilot's value
conversion (48), and SkyPilot's ``V100:0.5`` / ``4+`` / ``k8s/CONTEXT`` syntax (134), which
would become custom validators of the same length; 29 of the 59 bad-input cases
(``tests/bad_input`` and the generated ones) fail there.  What pydantic states directly is
about 30 lines (num_nodes, name, run, setup), and not even those as they are: lax mode
accepts ``num_nodes: true`` and ``'2'``, strict mode refuses ``2.0``.  Against that,
pydantic is no dependency of ours (it arrives only with the kubernetes extra), and
importing it and defining the two models takes about 75 ms (59 + 16) where this module,
``resources`` and ``errors`` take about 16 ms today (yaml, needed either way, 9.5 ms):
``import pytest_sky`` would go from 81 ms to about 140, paid by every pytest run (plugin).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping

from pytest_sky import naming
from pytest_sky.errors import TaskError
from pytest_sky.resources import (
    RESOURCE_KEYS,
    Resources,
    format_value,
    unknown_key_message,
)

MAX_NUM_NODES = 256
MAX_NAME_LENGTH = 63
TASK_KEYS = (
    "config",
    "envs",
    "file_mounts",
    "name",
    "num_nodes",
    "resources",
    "run",
    "secrets",
    "setup",
    "workdir",
)
_TASK_KEY_HINTS = {"nodes": "num_nodes", "env": "envs", "environment": "envs"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED_ENV_PREFIX = "SKYPILOT_"

StrPath = str | os.PathLike[str]


def _check_num_nodes(value: object) -> int:
    if value is None:
        return 1
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or not 1 <= number <= MAX_NUM_NODES:
        raise TaskError(
            f"num_nodes must be a whole number between 1 and {MAX_NUM_NODES}, "
            f"got {format_value(value)} (e.g. num_nodes: 2)"
        )
    return number


def _check_name(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME_LENGTH or not value.isprintable():
        raise TaskError(
            f"name must be a string of 1 to {MAX_NAME_LENGTH} printable characters, "
            f'got {format_value(value)} (e.g. name: my-test; quote numbers: name: "123")'
        )
    return value


def _check_commands(value: object, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TaskError(
        f"{key} must be a string of shell commands, got {format_value(value)} "
        f"(quote it, or write {key}: | and the commands on the following lines)"
    )


def _env_value(name: str, value: object, *, secret: bool = False) -> str:
    """Convert a scalar the way SkyPilot does: ``1`` -> "1", ``true`` -> "true".  A secret's
    value never appears in a message."""
    key = f"{'secrets' if secret else 'envs'}.{name}"
    shown = "<hidden>" if secret else format_value(value)
    if value is None:
        raise TaskError(f"{key} has no value; give one in the YAML ({name}: value) or pass env={{{name!r}: ...}}")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        try:
            return str(value)
        except ValueError:  # more digits than Python converts
            pass
    elif isinstance(value, str):
        if "\x00" in value:
            raise TaskError(f"{key} contains a NUL character, which environment variables cannot hold, got {shown}")
        return value
    raise TaskError(f"{key} must be a string, number or boolean, got {shown} (quote the value to pass it literally)")


def _check_envs(value: object, key: str = "envs") -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        shown = "<hidden>" if key == "secrets" else format_value(value)
        raise TaskError(f"{key} must be a mapping of NAME: value (e.g. {key}: {{MY_VAR: '1'}}), got {shown}")
    result: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            hint = '; quote names such as "NO" or "ON" that YAML reads as booleans' if isinstance(name, bool) else ""
            raise TaskError(
                f"{key} name {format_value(name)} is not a valid variable name: use "
                f"letters, digits and '_', not starting with a digit (e.g. MY_VAR){hint}"
            )
        if name.startswith(_RESERVED_ENV_PREFIX):
            shown = "<hidden>" if key == "secrets" else format_value(item)
            raise TaskError(
                f"{key}.{name} is reserved: names starting with {_RESERVED_ENV_PREFIX} "
                f"are set by pytest-sky on every node, got {shown} "
                "(pick another name)"
            )
        result[name] = _env_value(name, item, secret=key == "secrets")
    return result


def validate_envs(value: object) -> dict[str, str]:
    """Check and convert environment variables the way a task's ``envs`` are checked (also for
    ``Cluster.run(env=...)``): valid names, no reserved SKYPILOT_ names, scalar values, no NUL."""
    return _check_envs(value)


def _resolve_local(value: object, key: str, base_dir: StrPath | None) -> tuple[str, int]:
    """Make a local path absolute and check that it exists; return it and its mode.

    Relative paths are taken against the task file's directory, as SkyPilot does, so a
    task behaves the same whatever directory pytest was started from.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise TaskError(f"{key} must be a local path, got {format_value(value)}")
    path = os.path.expanduser(value)
    if not os.path.isabs(path):
        try:
            base = os.fspath(base_dir) if base_dir is not None else os.getcwd()
        except OSError as err:
            raise TaskError(
                f"{key} {format_value(value)} is relative, but the current directory "
                f"cannot be read ({err.strerror}); give an absolute path"
            ) from None
        path = os.path.join(base, path)
    path = os.path.normpath(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise TaskError(
            f"{key} {format_value(value)} does not exist (resolved to {path}); create it or fix the path"
        ) from None
    except OSError as err:
        raise TaskError(
            f"{key} {format_value(value)} cannot be accessed (resolved to {path}): {err.strerror}"
        ) from None
    except ValueError:  # e.g. an embedded NUL byte
        raise TaskError(f"{key} is not a valid path, got {format_value(value)}") from None
    return path, mode


def _check_workdir(value: object, base_dir: StrPath | None) -> str | None:
    if value is None:
        return None
    path, mode = _resolve_local(value, "workdir", base_dir)
    if not stat.S_ISDIR(mode):
        raise TaskError(
            f"workdir must be a directory, got {format_value(value)}, which is not one "
            f"(resolved to {path}); copy single files with file_mounts instead"
        )
    return path


def _remote_target(remote: str, key: str) -> str:
    """The target in normal form; one that leaves the node's home (``~/../x``) or would
    replace a whole tree (``/``, ``~/``) is refused: it could only overwrite what is there."""
    import posixpath

    inside = remote[2:] if remote.startswith("~/") else remote
    norm = posixpath.normpath(inside)
    if remote.startswith("~/"):
        if norm == ".." or norm.startswith("../") or norm.startswith("/"):
            raise TaskError(f"{key} leaves the home directory; use a path inside it (e.g. ~/data) or an absolute one")
        if norm == ".":
            raise TaskError(f"{key} is the home directory itself; name a directory inside it (e.g. ~/data)")
        return "~/" + norm
    norm = "/" + norm.lstrip("/")
    if norm == "/":
        raise TaskError(f"{key} is the root directory itself; name a directory (e.g. /data)")
    return norm


#: Where a shared directory cannot go: what every node makes for itself, and the home.
_NOT_SHARED = (*naming.NODE_OWN_MOUNTS, naming.NODE_HOME)


def check_shared_dir(value: object) -> str | None:
    """``shared_dir`` in normal form (an absolute path of its own), or a one-line error."""
    import posixpath

    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/"):
        raise TaskError(f"shared_dir must be an absolute path such as /mnt/shared, got {format_value(value)}")
    norm = "/" + posixpath.normpath(value).lstrip("/")
    if norm == "/" or any(norm == p or norm.startswith(p + "/") for p in _NOT_SHARED):
        raise TaskError(
            f"shared_dir {format_value(value)} would cover a directory every node needs of its own; "
            "pick one such as /mnt/shared"
        )
    return norm


def _check_file_mounts(value: object, base_dir: StrPath | None) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TaskError(
            "file_mounts must be a mapping of remote path to local path "
            f"(e.g. file_mounts: {{/data: ./data}}), got {format_value(value)}"
        )
    result: dict[str, str] = {}
    for remote, local in value.items():
        if not isinstance(remote, str) or not (remote.startswith(("/", "~/"))):
            raise TaskError(
                f"file_mounts key {format_value(remote)} must be an absolute remote "
                "path or start with ~/ (e.g. /data or ~/data)"
            )
        key = f"file_mounts[{remote!r}]"
        remote = _remote_target(remote, key)
        if isinstance(local, Mapping) or (isinstance(local, str) and "://" in local):
            raise TaskError(
                f"{key} must be a local path; cloud storage is not supported, "
                f"got {format_value(local)} (copy the data to a local directory first)"
            )
        result[remote], _ = _resolve_local(local, key, base_dir)
    return result


def _check_resources(value: object) -> Resources:
    if isinstance(value, Resources):
        return value
    return Resources.from_dict(value, where="resources")  # type: ignore[arg-type]


class Task:
    """A validated task, from a YAML file or from keyword arguments.

    Every constructor argument is checked on construction, so a ``Task`` that exists is
    one that can be launched. Use :meth:`with_overrides` rather than assigning to
    attributes, so that the new values are checked too.
    """

    def __init__(
        self,
        run: str | None = None,
        setup: str | None = None,
        num_nodes: int = 1,
        envs: Mapping[str, object] | None = None,
        resources: Resources | Mapping[str, object] | None = None,
        name: str | None = None,
        workdir: StrPath | None = None,
        file_mounts: Mapping[str, StrPath] | None = None,
        secrets: Mapping[str, object] | None = None,
        config: Mapping[str, object] | None = None,
        *,
        source: str | None = None,
        base_dir: StrPath | None = None,
    ) -> None:
        """``source`` prefixes every error message; ``base_dir`` anchors relative paths
        (the current directory when not given)."""
        self.source = source
        try:
            self.name = _check_name(name)
            self.num_nodes = _check_num_nodes(num_nodes)
            self.resources = _check_resources(resources)
            self.envs = _check_envs(envs)
            #: Exported like envs on every node; their values never appear in our output.
            self.secrets = _check_envs(secrets, "secrets")
            if config is not None and not isinstance(config, Mapping):
                raise TaskError(f"config must be a mapping of SkyPilot settings, got {format_value(config)}")
            self.config = dict(config or {})
            self.setup = _check_commands(setup, "setup")
            self.run = _check_commands(run, "run")
            self.workdir = _check_workdir(workdir, base_dir)
            self.file_mounts = _check_file_mounts(file_mounts, base_dir)
        except TaskError as err:
            if source is None:
                raise
            raise type(err)(f"{source}: {err}") from None

    @classmethod
    def from_yaml_str(
        cls,
        text: str,
        source: str = "<string>",
        *,
        base_dir: StrPath | None = None,
    ) -> Task:
        """Read a task from YAML text; ``source`` names it in error messages."""
        # PyYAML only where a task is read: most commands (queue, logs, a command's exec) read none.
        from pytest_sky.task_file import MAX_TASK_FILE_BYTES, MAX_TASK_FILE_TEXT, parse_yaml

        try:
            if not isinstance(text, str):
                raise TaskError(f"task YAML must be text, got {type(text).__name__}")
            if len(text) > MAX_TASK_FILE_BYTES:
                raise TaskError(
                    f"task YAML is {len(text)} characters; the limit is "
                    f"{MAX_TASK_FILE_BYTES} ({MAX_TASK_FILE_TEXT}); keep data out of the task file"
                )
            data = parse_yaml(text)
            if data is None:
                raise TaskError("task file is empty; give at least run: (e.g. run: echo hello)")
            if not isinstance(data, dict):
                raise TaskError(
                    "task file must be a mapping of keys such as run:, setup: and "
                    f"num_nodes:, got a {type(data).__name__} ({format_value(data)})"
                )
            for key in data:
                if key not in TASK_KEYS:
                    raise TaskError(_unknown_task_key(key))
        except TaskError as err:
            raise TaskError(f"{source}: {err}") from None
        return cls(**data, source=source, base_dir=base_dir)

    @classmethod
    def from_yaml(cls, path: StrPath, *, base_dir: StrPath | None = None) -> Task:
        """Read a task file, refusing anything that is not a small UTF-8 YAML mapping.

        Relative paths in it resolve from ``base_dir``, by default the file's own directory:
        a test's task file then works from wherever pytest runs.  The CLI passes the current
        directory, as ``sky`` resolves them."""
        if not isinstance(path, (str, os.PathLike)):
            raise TaskError(f"task file path must be a string or path, got {format_value(path)}")
        from pytest_sky.task_file import read_task_file

        shown = os.fspath(path)
        text = read_task_file(shown)
        if base_dir is None:
            base_dir = os.path.dirname(os.path.abspath(shown))
        return cls.from_yaml_str(text, source=str(shown), base_dir=base_dir)

    @property
    def display_name(self) -> str:
        return self.name or "task"

    @property
    def notes(self) -> list[str]:
        """What the task asks for that has no effect here, and the secrets too short to be
        masked in its output: one line each, printed at a run."""
        from pytest_sky.masking import MIN_MASKED, too_short

        inert = [*(["config"] if self.config else []), *(f"resources.{k}" for k in self.resources.inert)]
        notes = [f"task {self.display_name!r}: {key} has no effect on a pytest-sky cluster" for key in inert]
        short = ", ".join(f"secrets.{name}" for name in too_short(self.secrets))
        if short:
            notes.append(
                f"task {self.display_name!r}: {short}: a value (or a line of one) shorter than "
                f"{MIN_MASKED} characters is not masked in output"
            )
        return notes

    def to_dict(self) -> dict[str, object]:
        """The task as a YAML-shaped dict that :meth:`from_yaml_str` reads back equal."""
        result: dict[str, object] = {}
        if self.name is not None:
            result["name"] = self.name
        result["num_nodes"] = self.num_nodes
        resources = self.resources.to_dict()
        if resources:
            result["resources"] = resources
        if self.workdir is not None:
            result["workdir"] = self.workdir
        if self.file_mounts:
            result["file_mounts"] = dict(self.file_mounts)
        if self.envs:
            result["envs"] = dict(self.envs)
        if self.secrets:
            result["secrets"] = dict(self.secrets)
        if self.config:
            result["config"] = dict(self.config)
        if self.setup is not None:
            result["setup"] = self.setup
        if self.run is not None:
            result["run"] = self.run
        return result

    def with_overrides(
        self,
        num_nodes: int | None = None,
        envs: Mapping[str, object] | None = None,
        resources: Resources | None = None,
        secrets: Mapping[str, object] | None = None,
        name: str | None = None,
    ) -> Task:
        """A copy with some settings replaced, e.g. by a pytest marker or the command line.

        ``envs`` and ``secrets`` are added to the task's own (same names replaced), and
        ``resources`` are merged field by field, so an override only changes what it names.
        """
        merged_envs = {**self.envs, **_check_envs(envs)}
        merged_secrets = {**self.secrets, **_check_envs(secrets, "secrets")}
        merged_resources = self.resources
        if resources is not None:
            merged_resources = self.resources.merge(_check_resources(resources))
        task = Task(
            run=self.run,
            setup=self.setup,
            num_nodes=self.num_nodes if num_nodes is None else num_nodes,
            envs=merged_envs,
            resources=merged_resources,
            name=self.name if name is None else name,
            workdir=self.workdir,
            file_mounts=self.file_mounts,
            secrets=merged_secrets,
            config=self.config,
        )
        # The overrides did not come from the file, so errors above are not prefixed with
        # it; the result still describes the same task.
        task.source = self.source
        return task

    def _fields(self) -> tuple[object, ...]:
        return (
            self.name,
            self.num_nodes,
            self.resources,
            self.envs,
            self.setup,
            self.run,
            self.workdir,
            self.file_mounts,
            self.secrets,
            self.config,
        )

    def __eq__(self, other: object) -> bool:
        # Where a task was read from does not change what it does.
        if not isinstance(other, Task):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"Task(name={self.name!r}, num_nodes={self.num_nodes}, "
            f"resources={self.resources!r}, envs={self.envs!r}, setup={self.setup!r}, "
            f"run={self.run!r}, workdir={self.workdir!r}, "
            f"file_mounts={self.file_mounts!r}, secrets={sorted(self.secrets)!r} (values hidden), "
            f"source={self.source!r})"
        )


def _unknown_task_key(key: object) -> str:
    message = unknown_key_message(key, "task", TASK_KEYS, _TASK_KEY_HINTS)
    if key in RESOURCE_KEYS:
        message += f" ({key} belongs under resources:, e.g. resources: {{{key}: ...}})"
    return message


def as_task(value: object, num_nodes: int = 1) -> Task:
    """What the API and the CLI accept as a task: a Task, a YAML path, or a command string.

    A string is a path when it names a ``.yaml``/``.yml`` file on one line without spaces;
    any other string is a command to run on ``num_nodes`` nodes.
    """
    if isinstance(value, Task):
        return value
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if isinstance(text, str) and text.endswith((".yaml", ".yml")) and "\n" not in text and " " not in text:
        return Task.from_yaml(text)
    if isinstance(value, str):
        return Task(run=value, num_nodes=num_nodes)
    raise TaskError(f"run() takes a command string or a Task, got {type(value).__name__}")
