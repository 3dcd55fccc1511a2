"""``python -m pytest_sky.cli``: the same as the ``pytest-sky`` command."""

import sys

from pytest_sky.cli import main

sys.exit(main())
