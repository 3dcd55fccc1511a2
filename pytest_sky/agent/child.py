"""A process the agent spawns, with pipes, without the subprocess module (~25 ms to import)."""

from __future__ import annotations

import os
import signal


class Child:
    """A spawned process with pipes, without the subprocess module (~25 ms to import)."""

    def __init__(self, argv: list[str], *, capture_stderr: bool, env: dict[str, str] | None = None) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if capture_stderr else (-1, -1)
        actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1)]
        if capture_stderr:
            actions.append((os.POSIX_SPAWN_DUP2, err_w, 2))
        # Pipes are close-on-exec (PEP 446): the child keeps only what dup2 put on 0, 1, 2.
        self.pid = os.posix_spawnp(argv[0], argv, os.environ if env is None else env, file_actions=actions)
        for fd in (in_r, out_w, err_w):
            if fd >= 0:
                os.close(fd)
        self.stdin: int | None = in_w
        self.stdout = out_r
        self.stderr = err_r
        self.returncode: int | None = None
        #: What :class:`Rank` reads of a rank, as of a :class:`~pytest_sky.agent.remote.Remote`.
        self.exit_mark: bytes | None = None
        self.error = ""

    def open(self) -> int:
        return self.stdout

    def ended(self, code: int | None) -> None:
        """Its output is read to the end."""
        os.close(self.stdout)

    def close_stdin(self) -> None:
        if self.stdin is not None:
            try:
                os.close(self.stdin)
            except OSError:
                pass
            self.stdin = None

    def write_stdin(self, data: bytes) -> None:
        assert self.stdin is not None
        while data:
            data = data[os.write(self.stdin, data) :]

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:  # reaped by a concurrent poll(), which set returncode
                if self.returncode is None:
                    self.returncode = 255
                break
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
