#!/bin/sh
# A pod's first process (pytest_sky.backends.kube_manifests.BOOTSTRAP): sshd from the keys in
# the cluster's Secret.  Everything it writes goes to $HOME or /run, never to other paths of
# the image (the emulator's pods share a disk).  __T__ and __MARK__ are filled in by Python:
# how long installing openssh-server may take, and the line that says the image lacks sshd
# (the backend turns a pod that failed with it into its one-line error).
set -e
S=/run/pytest-sky-secret
R=/run/pytest-sky
mkdir -p "$R" /run/sshd
chmod 755 /run/sshd
SSHD=$(command -v sshd || true)
[ -n "$SSHD" ] || [ ! -x /usr/sbin/sshd ] || SSHD=/usr/sbin/sshd
if [ -z "$SSHD" ]; then
  echo "pytest-sky: no sshd in the image: installing openssh-server (at most __T__ s)"
  # With whichever package manager the image has, each network step bounded (no retries,
  # short timeouts); `timeout` bounds the whole.
  # shellcheck disable=SC2016  # the install's own script: it expands in the shell that runs it
  install='set -e
    if command -v apt-get >/dev/null 2>&1; then
      A="-o Acquire::Retries=0 -o Acquire::http::Timeout=10 -o Acquire::https::Timeout=10"
      A="$A -o APT::Update::Error-Mode=any -o Dpkg::Use-Pty=0"
      apt-get $A update -qq
      DEBIAN_FRONTEND=noninteractive apt-get $A install -y -qq --no-install-recommends openssh-server
    elif command -v apk >/dev/null 2>&1; then apk add --no-cache openssh-server
    elif command -v dnf >/dev/null 2>&1; then
      dnf install -y -q --setopt=retries=0 --setopt=timeout=10 openssh-server
    else echo "no apt-get, apk or dnf in the image"; exit 1; fi'
  T=; command -v timeout >/dev/null 2>&1 && T="timeout -k 5 __T__"
  code=0
  # shellcheck disable=SC2086  # $T is a command and its arguments, or nothing
  $T /bin/sh -c "$install" >"$R/install.log" 2>&1 || code=$?
  if [ "$code" != 0 ]; then
    why=$(grep -E '^(E|W|Err):' "$R/install.log" | head -n 1 | cut -c1-200)
    [ -n "$why" ] || why=$(grep -v '^ *$' "$R/install.log" | tail -n 1 | cut -c1-200)
    [ "$code" != 124 ] && [ "$code" != 137 ] || why="no package repository answered within __T__ s"
    echo "__MARK__ ${why:-exit $code}"
    exit 1
  fi
  SSHD=/usr/sbin/sshd
fi
[ -x "$SSHD" ] || { echo "__MARK__ the package installed no $SSHD"; exit 1; }
umask 077
mkdir -p "$HOME/.ssh" "$HOME/.sky"
cp "$S/authorized_keys" "$HOME/.ssh/authorized_keys"
cp "$S/id_ed25519" "$HOME/.ssh/id_ed25519"
cp "$S/id_ed25519.pub" "$HOME/.ssh/id_ed25519.pub"
cp "$S/agent.pyz" "$HOME/.sky/agent.pyz"
mkdir -p "$HOME/.sky/python"
cp "$S/sitecustomize.py" "$HOME/.sky/python/sitecustomize.py"
cp "$S/host_key_$PSKY_RANK" "$R/ssh_host_ed25519_key"
# The config comes in the Secret (ssh.sshd renders every backend's); only the image knows
# its PATH and home, so the pod appends that line itself (sshd reads one SetEnv line).
{ cat "$S/sshd_config"; echo "SetEnv PATH=$PATH PYTHONPATH=$HOME/.sky/python"; } >"$R/sshd_config"
exec "$SSHD" -D -e -f "$R/sshd_config"
