"""Entry point for ``python -m bench``; the work is in :mod:`bench.cli`."""

from __future__ import annotations

from bench.cli import main

raise SystemExit(main())
