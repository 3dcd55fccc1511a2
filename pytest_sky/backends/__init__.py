"""Backends provision nodes; everything after provisioning is shared (see ``base.Backend``)."""

from __future__ import annotations

import importlib
import importlib.util

from pytest_sky import registry
from pytest_sky.backends.base import Backend
from pytest_sky.errors import BackendUnavailableError


def get_backend(name: str, **options: object) -> Backend:
    """The backend called ``name`` (or an alias of it), built from the registry's entry.

    Its module is imported only now, so choosing the local backend never loads the
    Kubernetes client.  What the module needs is looked for first: a client that is not
    installed is a line naming the package, not a ``ModuleNotFoundError`` from deep inside.
    """
    entry = registry.lookup(name)
    for module, requirement in entry.needs:
        if importlib.util.find_spec(module) is None:
            raise BackendUnavailableError(
                f"the {entry.name} backend needs the Python package {module!r}, which is not installed "
                f"in this environment: pip install '{requirement}'"
            )
    module_name, _, class_name = entry.factory.partition(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(**{k: v for k, v in options.items() if v is not None})
