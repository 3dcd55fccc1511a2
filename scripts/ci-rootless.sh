#!/usr/bin/env bash
# CI's rootless stage: the multinode smoke suite as an ordinary user, set up exactly as
# docs/getting-started.md ("Without root") tells one (scripts/setup.sh has run as root
# already; the user runs it again, without sudo, for a virtualenv of their own, then the
# smoke command). The user works on a copy of
# this checkout's HEAD in their own home. A user this script created is removed afterwards,
# with its home.
set -euo pipefail
cd "$(dirname "$0")/.."

user=${PSKY_CI_USER:-psky-ci}
created=""
if ! id "$user" >/dev/null 2>&1; then
  useradd --create-home --shell /bin/bash "$user"
  created=1
fi
cleanup() {
  if [ -n "$created" ]; then
    userdel --remove "$user" 2>/dev/null || true
    rm -rf "/tmp/pytest-of-$user"
  fi
}
trap cleanup EXIT

home=$(getent passwd "$user" | cut -d: -f6)
runuser -u "$user" -- mkdir -p "$home/repo"
git archive --format=tar HEAD | runuser -u "$user" -- tar -x -C "$home/repo"
# runuser keeps the environment (PIP_FIND_LINKS: where the CPU torch wheel lies) but sets
# HOME; PATH keeps root's entries, which the user cannot enter and so skips.
runuser -u "$user" -- bash -c 'cd ~/repo && bash scripts/setup.sh && .venv/bin/python -m pytest smoke -k multinode -q -rs'
