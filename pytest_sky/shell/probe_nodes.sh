#!/bin/bash
# Run as a command on every node by pytest_sky.node_needs.missing_on_nodes, after
# `set -- ARG...`: each ARG is a command that must be on PATH, or py:MODULE, a module that
# python3 must import.  Prints "MISSING <name>" for each one that is not there, asked on the
# node itself: a Kubernetes image need not have what the client machine has.
for c in "$@"; do
  case "$c" in py:*) ;; *) command -v "$c" >/dev/null 2>&1 || echo "MISSING $c" ;; esac
done
if command -v python3 >/dev/null 2>&1; then
  python3 -c 'import importlib.util, sys
for m in sys.argv[1:]:
    if m.startswith("py:") and importlib.util.find_spec(m[3:]) is None:
        print("MISSING", m[3:])' "$@"
else
  echo "MISSING python3"
fi
