"""pytest-sky's benchmark: ``python -m bench`` from the repository root.

Every figure is printed next to a baseline measured in the same run on the same machine
(plain sshd processes, a fresh OpenSSH connection, a paramiko exec on an open connection),
as a ratio, because absolute times on a shared 2-core machine move with its load while
ratios mostly do not.  DESIGN.md section 7 targets are shown where one exists.
"""

from __future__ import annotations
