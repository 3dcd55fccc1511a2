"""``pytest-sky``: look at and clean up clusters from a shell.

This first version covers what a user needs around test runs: ``status``, ``down`` and
``doctor`` (what of ours is left on this machine).  It uses the same Python API as the plugin.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from pytest_sky import console
from pytest_sky.errors import SkyError


def _age(created: float) -> str:
    seconds = max(0, int(time.time() - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def cmd_status(args: argparse.Namespace) -> int:
    from pytest_sky.cluster import owner_alive
    from pytest_sky.state import StateStore

    records = StateStore().records()
    rows = []
    for r in records:
        status = r.status if (r.keep or owner_alive(r)) else f"{r.status} (owner gone)"
        rows.append(
            {
                "name": r.name,
                "backend": r.backend,
                "resources": r.resources_label,
                "nodes": r.num_nodes,
                "status": status,
                "age": _age(r.created),
                "head": r.head_host,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no clusters")
        return 0
    headers = ["NAME", "BACKEND", "RESOURCES", "NODES", "STATUS", "AGE"]
    table = [[str(row[h.lower()]) for h in headers] for row in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from pytest_sky.backends import get_backend
    from pytest_sky.state import StateStore

    store = StateStore()
    if args.all:
        names = [r.name for r in store.records()]
    else:
        names = args.names
        if not names:
            raise SkyError("name the clusters to tear down, or pass --all")
    for name in names:
        record = store.load(name)
        if record is None:
            raise SkyError(f"no cluster named {name!r} (see `pytest-sky status`)")
        get_backend(record.backend).destroy(record)
        store.forget(name)
        print(f"{name}: down")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from pytest_sky.doctor import leftovers

    found = leftovers()
    for line in found:
        print(line)
    if not found:
        print("nothing of pytest-sky is left on this machine")
    return 1 if found else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytest-sky",
        description="Multi-node test clusters: look at them and clean them up.",
        epilog="examples:\n  pytest-sky status\n  pytest-sky down my-cluster\n  pytest-sky down --all\n"
        "  pytest-sky doctor",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("status", help="list clusters")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("down", help="tear clusters down")
    p.add_argument("names", nargs="*", metavar="NAME")
    p.add_argument("--all", action="store_true", help="every cluster in the state directory")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask (nothing asks yet)")
    p.set_defaults(func=cmd_down)
    p = sub.add_parser("doctor", help="list anything of pytest-sky left on this machine")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except SkyError as exc:
        if args.debug:
            raise
        console.error(str(exc))
        return 2
    except KeyboardInterrupt:
        console.error("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
