"""``run_command_in_parallel``: the concurrency check SkyPilot's Kubernetes PR used, as an API."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from pytest_sky.errors import CommandFailedError


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    output: str  # stdout and stderr, merged
    seconds: float


def _one(cmd: Sequence[str], timeout: float | None, fail_fast: bool = True) -> CommandResult:
    start = time.monotonic()
    try:
        proc = subprocess.run(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode("utf-8", "replace") if exc.stdout else ""
        result = CommandResult(-1, out, time.monotonic() - start)
        if not fail_fast:
            return result
        raise CommandFailedError(f"{' '.join(cmd)} timed out after {timeout} s", result) from None
    result = CommandResult(proc.returncode, proc.stdout.decode("utf-8", "replace"), time.monotonic() - start)
    if proc.returncode != 0 and fail_fast:
        last = result.output.strip().splitlines()[-1:] or ["no output"]
        raise CommandFailedError(f"{' '.join(cmd)} exited with {proc.returncode}: {last[0]}", result)
    return result


def run_command_in_parallel(
    cmd: Sequence[str], num_times: int, poolsize: int = 8, *, timeout: float | None = 60.0, fail_fast: bool = True
) -> list[CommandResult]:
    """Run ``cmd`` ``num_times`` times on ``poolsize`` threads; raise on the first failure.

    Returns the per-run results (exit code, output, seconds) in input order.  With
    ``fail_fast=False`` nothing raises and failed runs are returned with their exit codes
    (what ``pytest-sky stress-ssh`` counts).
    """
    if isinstance(cmd, str):
        raise TypeError("cmd must be an argv list such as ['ssh', 'host', 'echo hi'], not a string")
    if num_times < 0 or poolsize < 1:
        raise ValueError("num_times must be >= 0 and poolsize >= 1")
    with ThreadPoolExecutor(max_workers=poolsize) as pool:
        futures = [pool.submit(_one, cmd, timeout, fail_fast) for _ in range(num_times)]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f in finished and f.exception() is not None:
                for other in futures:
                    other.cancel()
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]
