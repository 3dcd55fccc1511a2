"""Bridges for the tests that make their own: the ``ip`` tool, and subnet indexes no
bridge is on.  A module, not a test module, so that test modules share these without
importing each other.
"""

from __future__ import annotations

import os
import random

from pytest_sky.backends import clusterns, netns

IP = netns.require_tools()["ip"] if os.geteuid() == 0 else "ip"


def free_indexes(count: int) -> int:
    """A run of ``count`` consecutive subnet indexes (in 198.18.x) with no bridge on them."""
    for _ in range(1000):
        start = random.randrange(2, 250 - count)
        if not any(netns.link_exists(clusterns.bridge_name(i)) for i in range(start, start + count)):
            return start
    raise AssertionError("no free subnet indexes")
