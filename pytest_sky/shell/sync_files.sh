#!/bin/bash
# A task's workdir and file mounts, onto every node: run on the head by Cluster._sync as
# `bash -c "$(cat sync_files.sh)" sync WORKER_IP...`, with a gzipped tarball on stdin whose
# member names start with "~/" (unpacked in $HOME) or "/" (unpacked at /).  The head keeps a
# copy and unpacks it, then sends it to each worker over head-to-worker SSH, all at once.
set -e
f=$HOME/.sky/sync.tgz
mkdir -p "$HOME/.sky"
cat >"$f"
# Copied in with --no-overwrite-dir: the staging directory's own mode (mktemp's 0700) must
# never land on $HOME or on / (it made a pod's / unusable by non-root).
unpack() {
  d=$(mktemp -d)
  tar xzf "$1" -C "$d"
  if [ -d "$d/~" ]; then
    [ ! -d "$d/~/sky_workdir" ] || rm -rf "$HOME/sky_workdir"
    (cd "$d/~" && tar cf - .) | tar xf - -C "$HOME" --no-overwrite-dir
    rm -rf "$d/~"
  fi
  if [ -n "$(ls -A "$d")" ]; then (cd "$d" && tar cf - .) | tar xf - -C / --no-overwrite-dir; fi
  rm -rf "$d"
}
unpack "$f"
for ip in "$@"; do
  # shellcheck disable=SC2029  # unpack's definition is sent on purpose, expanded here
  ssh "$ip" "mkdir -p .sky; cat > .sky/sync.tgz; $(declare -f unpack); unpack .sky/sync.tgz" <"$f" &
done
wait
