#!/usr/bin/env bash
# Everything pytest-sky's tests need, on a fresh Debian 12 machine. Safe to re-run: it installs
# only what is missing. Run it once as root (the Debian packages); an ordinary user then runs
# it too, without sudo, for a virtualenv of their own (the local backend runs rootless for them).
#   - Debian packages: OpenSSH (server and client), iproute2, OpenMPI, tmux, sudo (setup
#     scripts call it; nodes see this machine's files), shellcheck (tests/test_shell.py),
#     tcpdump (tests/test_secrets.py reads what crosses a cluster's bridge), and Slurm with
#     munge for the Slurm testbed (python -m slurm_testbed; no daemon is started)
#   - a virtualenv in .venv (and nothing else outside the clone but pip's download cache): torch
#     2.13.0 first, as pip's configuration finds it: on an ordinary x86-64 machine with pip's
#     default index that is PyPI's CUDA build (several GB with its nvidia-* packages; the tests
#     use its CPU side); where a CPU wheel is configured (find-links, PyTorch's CPU index) the
#     CPU build; a torch that already imports is kept (docs/getting-started.md, "What the set-up
#     installs"). Then this package, its test extras and NeMo (the [nemo] extra: the smoke
#     suite trains a NeMo model across nodes on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'setup: %s\n' "$*"; }

# tool -> Debian package
declare -A NEED=(
  [sshd]=openssh-server [ssh]=openssh-client [ip]=iproute2 [unshare]=util-linux
  [mpirun]=openmpi-bin [mpicc]=libopenmpi-dev [tmux]=tmux [iptables]=iptables [sudo]=sudo
  [shellcheck]=shellcheck [tcpdump]=tcpdump
  [slurmctld]=slurmctld [slurmd]=slurmd [sbatch]=slurm-client [munged]=munge
)
missing=()
for tool in "${!NEED[@]}"; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1 || missing+=("${NEED[$tool]}")
done
PY=${PYTHON:-python3}
if ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv python3-pip)
fi
# An ordinary user's virtualenv is made with Debian's own python3 (root's default interpreter
# may live where no one else can reach it, such as under /root).
if [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
  missing+=(python3-venv python3-pip)
fi
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" != 0 ]; then
  echo "setup: Debian packages missing (${missing[*]}): run \`sudo bash scripts/setup.sh\` once, then this again as yourself" >&2
  exit 1
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  # Package scripts must not start a system sshd: our nodes run their own.
  guard=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
    guard=/usr/sbin/policy-rc.d
  fi
  trap '[ -n "$guard" ] && rm -f "$guard"' EXIT
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
  # First and alone, so that the extras below keep the build chosen here.
  say "installing torch==2.13.0 (the build pip's configuration finds)"
  .venv/bin/python -m pip install -q torch==2.13.0
fi
# Which build that is, from its metadata (no import): the CUDA build requires nvidia-* packages.
say "$(.venv/bin/python -c 'from importlib.metadata import requires, version
cuda = any(r.startswith("nvidia-") for r in requires("torch") or [])
print("torch", version("torch") + ": the", "CUDA" if cuda else "CPU", "build")')"
say "installing pytest-sky, its test extras and NeMo"
.venv/bin/python -m pip install -q -e '.[test,nemo]'
# An editable install leaves this project's own modules uncompiled, and where the environment
# forbids writing bytecode (PYTHONDONTWRITEBYTECODE, set in many CI images) every process
# would compile them again: each CLI call, inner pytest run, node start and agent server.
# Compiled once here; a stale file is recompiled in memory, never trusted.
# Test modules are compiled by pytest, which rewrites their asserts first and, for the same
# reason, would do it again in every xdist worker and inner pytest run: one collection here
# leaves its rewritten modules cached (pytest reads the cache even where it may not write it).
.venv/bin/python -m compileall -q pytest_sky kube_emulator bench tests
PYTHONDONTWRITEBYTECODE='' .venv/bin/python -m pytest --collect-only -q -p no:cacheprovider >/dev/null \
  || say "the tests do not collect: .venv/bin/python -m pytest --collect-only says why"
say "ready: the smoke suite is '.venv/bin/python -m pytest smoke -k multinode', the whole suite '.venv/bin/python -m pytest -n 4 --dist worksteal'"
