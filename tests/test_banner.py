"""Waiting for sshd banners: the wait ends at the real signal, never later."""

from __future__ import annotations

import socket
import threading
import time

from pytest_sky.ssh.banner import NO_BANNER, wait_for_banners


def test_nodes_that_died_end_the_wait_at_once_not_at_the_deadline() -> None:
    """A node whose process exited is known to be gone: a launch says so without waiting out
    its ready timeout (it waited all 60 s of it when every node had died)."""
    start = time.monotonic()
    failed = wait_for_banners(
        [("127.0.0.1", 9), ("127.0.0.1", 9)], deadline=start + 30, gone=lambda i: f"node {i} exited"
    )
    assert failed == {0: "node 0 exited", 1: "node 1 exited"}
    assert time.monotonic() - start < 5


def test_a_banner_is_ready_and_silence_is_reported_at_the_deadline() -> None:
    with socket.socket() as talker, socket.socket() as mute:
        for s in (talker, mute):
            s.bind(("127.0.0.1", 0))
            s.listen()

        def greet() -> None:
            conn, _ = talker.accept()
            conn.sendall(b"SSH-2.0-test\r\n")
            conn.close()

        threading.Thread(target=greet, daemon=True).start()
        ready: list[int] = []
        failed = wait_for_banners(
            [talker.getsockname(), mute.getsockname()], deadline=time.monotonic() + 1.0, on_ready=ready.append
        )
    assert ready == [0]
    assert failed == {1: NO_BANNER}
